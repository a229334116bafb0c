"""The store's table modules on both backends (``[sqlite]``, ``[postgres]``): requests, feedback
and the consolidation queue, counters, API keys, the inspector's paged reads, scaffolding stored
once per user, sub-agent completion, memory items, a search's candidate rows and the export.
What each returns is the same on both."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from proxy.store import (
    NewTurn,
    Store,
    browse,
    counters,
    feedback,
    items,
    keys,
    scaffolds,
    slots,
    subagents,
)
from proxy.store.caches import scope
from proxy.store.feedback import RecordedRequest
from proxy.store.models import Scaffold
from proxy.store.sqlite.db import Connection

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def store(store_target: str | Path) -> AsyncIterator[Store]:
    async with Store(store_target) as s:
        yield s


def request(rid: str, user: str = "u", session: str | None = "a", at: float = 1.0) -> Any:
    return RecordedRequest(rid, user, session, "m", f"query {rid}", [1, 2], at)


async def test_requests_feedback_and_the_queue(store: Store) -> None:
    await store.get_or_create_session("u", "a")

    def run(c: Connection) -> dict[str, Any]:
        for i in range(5):
            feedback.insert_request(c, request(f"r{i}", at=float(i)))
        feedback.insert_request(c, request("r0", at=99.0))  # recorded once: left as it was
        feedback.insert_request(c, request("gone", session="deleted-meanwhile"))
        feedback.insert_request(c, request("v1", user="v", session=None, at=5.0))
        r1 = feedback.get_request(c, "r1")
        assert r1 is not None
        queued = feedback.add_feedback(c, r1, False, "api", "wrong", 10.0)
        again = feedback.add_feedback(c, r1, False, "api", "", 11.0)
        praised = feedback.add_feedback(c, r1, True, "api", None, 12.0)
        r2 = feedback.get_request(c, "r2")
        assert r2 is not None
        feedback.add_feedback(c, r2, False, "api", None, 13.0)
        r3 = feedback.get_request(c, "r3")
        assert r3 is not None
        feedback.add_feedback(c, r3, False, "api", None, 14.0)
        return {
            "r0": feedback.get_request(c, "r0"),
            "gone": feedback.get_request(c, "gone"),
            "missing": feedback.get_request(c, "nope"),
            "flags": (queued, again, praised),
            "notes": feedback.feedback_notes(c, "r1"),
            "counts": feedback.queue_counts(c),
            "of v": feedback.queue_counts(c, "v"),
            "pending": feedback.pending_requests(c, None, 10),
            "pending of u, 1": feedback.pending_requests(c, "u", 1),
        }

    got = await store.write(run)
    assert got["r0"] == RecordedRequest("r0", "u", "a", "m", "query r0", [1, 2], 0.0)
    assert got["gone"] is not None and got["gone"].session_id is None  # kept, its link lost
    assert got["missing"] is None
    assert got["flags"] == (True, True, True)  # still waiting after the praise
    assert got["notes"] == ["wrong"]
    assert got["counts"] == {"pending": 3, "done": 0, "failed": 0}
    assert got["of v"] == {"pending": 0, "done": 0, "failed": 0}
    assert got["pending"] == [("r1", "u"), ("r2", "u"), ("r3", "u")]
    assert got["pending of u, 1"] == [("r1", "u")]

    def work(c: Connection) -> dict[str, Any]:
        feedback.mark_done(c, "r1", 2)
        first = feedback.mark_failed_try(c, "r2", "boom" * 200, max_attempts=2)
        second = feedback.mark_failed_try(c, "r2", "boom", max_attempts=2)
        row = c.execute(
            "SELECT attempts, facts, error FROM consolidation_queue WHERE request_id = ?", ("r2",)
        ).fetchone()
        return {
            "tries": (first, second),
            "r2": (int(row[0]), int(row[1]), row[2]),
            "pending": (feedback.is_pending(c, "r1"), feedback.is_pending(c, "r3")),
            "counts": feedback.queue_counts(c, "u"),
        }

    got = await store.write(work)
    assert got["tries"] == ("pending", "failed")
    assert got["r2"] == (2, 0, "boom")
    assert got["pending"] == (False, True)
    assert got["counts"] == {"pending": 1, "done": 1, "failed": 1}
    # A flag queues a done request again.
    r1 = await store.read(lambda c: feedback.get_request(c, "r1"))
    assert r1 is not None
    assert await store.write(lambda c: feedback.add_feedback(c, r1, False, "api", None, 20.0))
    assert await store.read(lambda c: feedback.is_pending(c, "r1"))

    # Pruning: older than 2.5 goes, unless waiting; then at most two per user.
    def prune(c: Connection) -> tuple[int, list[str]]:
        feedback.insert_request(c, request("r5", at=5.0))
        feedback.insert_request(c, request("r6", at=6.0))
        gone = feedback.prune_requests(c, keep_per_user=2, older_than=2.5)
        return gone, sorted(str(r[0]) for r in c.execute("SELECT id FROM requests"))

    gone, left = await store.write(prune)
    # r0, "gone" (1.0) and r2 are old and not waiting (r1 and r3 wait); of u's r6, r5, r4 and
    # those waiting, the two newest stay, and those waiting.
    assert left == ["r1", "r3", "r5", "r6", "v1"] and gone == 4
    assert await store.read(lambda c: feedback.feedback_notes(c, "r2")) == []


async def test_counters_and_memory_counts(store: Store) -> None:
    for sid in ("a", "kid", "facts~u"):
        await store.get_or_create_session("u", sid, parent_id="a" if sid == "kid" else None)
    await store.get_or_create_session("v", "b")
    await store.add_turns("a", "u", [NewTurn(0, "user", "hello")])

    def setup(c: Connection) -> None:
        counters.add_counters(c, {"tokens": 5, "zero": 0, "puts": 1})
        counters.add_counters(c, {"tokens": 7})
        items.insert_item(c, "a", "u", NewTurn(-1, "summary", "the kid did it"), None, "kid")
        items.insert_item(c, "facts~u", "u", NewTurn(-1, "fact", "f1"), None, "a")
        items.insert_item(c, "facts~u", "u", NewTurn(-1, "fact", "f2"), None, None)
        items.insert_item(c, "b", "v", NewTurn(-1, "fact", "v's"), None, None)
        feedback.insert_request(c, request("r1"))
        feedback.insert_request(c, request("r2", user="v", session="b"))
        r1 = feedback.get_request(c, "r1")
        assert r1 is not None
        feedback.add_feedback(c, r1, False, "api", None, 2.0)
        feedback.add_feedback(c, r1, True, "api", None, 3.0)

    await store.write(setup)
    assert await store.read(lambda c: counters.all_counters(c, ["never"])) == {
        "never": 0,
        "tokens": 12,
        "puts": 1,
    }
    assert await store.read(lambda c: counters.counter_values(c, ["tokens", "x"])) == {
        "tokens": 12,
        "x": 0,
    }
    queue = {"pending": 1, "done": 0, "failed": 0}
    assert await store.read(lambda c: counters.memory_counts(c, "u")) == {
        "handbacks": 1,
        "facts": 2,
        "requests": 1,
        "feedback": {"unhelpful": 1, "helpful": 1},
        "queue": queue,
    }
    everyone = await store.read(counters.memory_counts)
    assert (everyone["facts"], everyone["requests"], everyone["handbacks"]) == (3, 2, 1)
    nobody = await store.read(lambda c: counters.memory_counts(c, "nobody"))
    assert nobody["facts"] == nobody["requests"] == nobody["feedback"]["helpful"] == 0


async def test_api_keys(store: Store) -> None:
    def run(c: Connection) -> dict[str, Any]:
        keys.insert_key(c, "k2", "bob", "h2", False, "", 2.0)
        keys.insert_key(c, "k1", "alice", "h1", True, "laptop", 1.0)
        keys.insert_key(c, "k3", "alice", "h3", False, "", 3.0)
        revoked = (keys.revoke_key(c, "k3", 4.0), keys.revoke_key(c, "k3", 5.0))
        return {
            "k1": keys.find_key(c, "k1"),
            "k3": keys.find_key(c, "k3"),
            "none": keys.find_key(c, "nope"),
            "all": [k.id for k in keys.list_keys(c)],
            "alice": [k.id for k in keys.list_keys(c, "alice")],
            "revoked": revoked,
            "active": keys.count_active_keys(c),
        }

    got = await store.write(run)
    assert got["k1"] == keys.KeyRow("k1", "alice", "h1", True, "laptop", 1.0, None)
    assert got["k3"].revoked_at == 4.0 and got["k3"].admin is False
    assert got["none"] is None
    assert got["all"] == ["k1", "k2", "k3"] and got["alice"] == ["k1", "k3"]
    assert got["revoked"] == (True, False) and got["active"] == 2


async def test_the_inspectors_pages(store: Store) -> None:
    t0 = time.time()
    for i, (sid, parent) in enumerate(
        (("Alpha", None), ("beta", None), ("Beta-kid", "beta"), ("grandkid", "Beta-kid"))
    ):
        await store.get_or_create_session("u", sid, parent_id=parent)
        await store.add_turns(
            sid,
            "u",
            [
                NewTurn(0, "system", "be nice", timestamp=t0 + i),
                NewTurn(1, "user", f"  first words of {sid}", api="openai-chat" if i else None),
                NewTurn(2, "assistant", "an answer", api="anthropic" if i == 1 else None),
            ],
        )
    await store.get_or_create_session("v", "theirs")
    await store.write(
        lambda c: items.insert_item(c, "beta", "u", NewTurn(-1, "fact", "a fact"), None, "beta")
    )

    def pages(c: Connection) -> dict[str, Any]:
        def names(found: tuple[list[browse.SessionRow], int]) -> tuple[list[str], int]:
            return sorted(r.session.id for r in found[0]), found[1]

        every, total = browse.session_page(c, "u", limit=2)
        row = next(r for r in browse.session_page(c, "u", limit=10)[0] if r.session.id == "beta")
        return {
            "first page": (len(every), total),
            "beta": (row.turns, row.first_line, sorted(row.apis)),
            "named": names(browse.session_page(c, "u", limit=10, name="BETA")),
            "among": names(browse.session_page(c, "u", limit=10, among=["Alpha", "theirs"])),
            "name or among": names(
                browse.session_page(c, "u", limit=10, name="kid", among=["Alpha"])
            ),
            "api": names(browse.session_page(c, "u", limit=10, api="anthropic")),
            "api, past the end": names(
                browse.session_page(c, "u", limit=10, offset=5, api="openai-chat")
            ),
            "apis": browse.session_apis(c, "u"),
            "turns": [t.position for t in browse.turn_page(c, "beta", limit=2, offset=1)],
            "tree": [(s.id, d) for s, d in browse.sub_sessions(c, "beta")],
            "facts": browse.user_items(c, "u", "fact", limit=5)[1],
            "totals": browse.user_totals(c, "u"),
            "newest": [
                t.position for t in browse.session_turns_newest(c, "Alpha", limit=2, offset=0)[0]
            ],
            "facts of": [t.content for t in browse.facts_of(c, "u", "beta", 5)],
        }

    got = await store.read(pages)
    assert got == {
        "first page": (2, 4),
        "beta": (3, "  first words of beta", ["anthropic", "openai-chat"]),
        "named": (["Beta-kid", "beta"], 2),
        "among": (["Alpha"], 1),
        "name or among": (["Alpha", "Beta-kid", "grandkid"], 3),
        "api": (["beta"], 1),
        "api, past the end": ([], 3),
        "apis": ["anthropic", "openai-chat"],
        "turns": [1, 2],
        "tree": [("Beta-kid", 1), ("grandkid", 2)],
        "facts": 1,
        "totals": (13, 4),
        "newest": [2, 1],
        "facts of": ["a fact"],
    }


async def test_scaffolding_is_stored_once_and_put_back(store: Store) -> None:
    head = Scaffold("h-head", "repeated", "HEADER\n", 0, "", "")
    tail = Scaffold("h-tail", "tool", "TAIL", 5, " ", "")
    for sid in ("a", "b"):
        await store.get_or_create_session("u", sid)
    (one,) = await store.add_turns(
        "a", "u", [NewTurn(0, "user", "words", scaffold=(head, tail), sightings=("p1", "p2"))]
    )
    (two,) = await store.add_turns(
        "b", "u", [NewTurn(0, "user", "plain", scaffold=(head,), sightings=("p2",))]
    )

    def read(c: Connection) -> dict[str, Any]:
        return {
            "whole": scaffolds.full_contents(c, "u", [one, two, 10**9]),
            "known from b": scaffolds.known_paragraphs(c, "u", ["p1", "p2", "h-tail", "x"], "b"),
            "known anywhere": scaffolds.known_paragraphs(c, "u", ["p1", "x"], None),
            "known to v": scaffolds.known_paragraphs(c, "v", ["p1", "h-head"], None),
            "repeated": scaffolds.repeated_hashes(c, "u"),
            "rows": scope.turn_rows(c, [one, two], "u").keys(),
            "rows of v": scope.turn_rows(c, [one], "v"),
        }

    got = await store.read(read)
    assert got["whole"] == {one: "HEADER\nwords TAIL", two: "HEADER\nplain"}
    assert got["known from b"] == {"p1", "p2", "h-tail"}  # sighted in a, or stored as such
    assert got["known anywhere"] == {"p1"}
    assert got["known to v"] == set()
    assert got["repeated"] == frozenset({"h-head"})
    assert sorted(got["rows"]) == [one, two] and got["rows of v"] == {}
    exported = [item async for item in store.export("u")]
    assert [(i["type"], i.get("content")) for i in exported if i["type"] == "turn"] == [
        ("turn", "HEADER\nwords TAIL"),
        ("turn", "HEADER\nplain"),
    ]
    assert [i["name"] for i in exported if i["type"] == "session"] == ["a", "b"]

    # Forgetting a deletes what only it used: the tail; the header stays, b uses it.
    assert await store.delete_session("a")
    left = await store.read(
        lambda c: sorted(str(r[0]) for r in c.execute("SELECT hash FROM scaffolds"))
    )
    assert left == ["h-head"]
    assert (
        await store.read(lambda c: scaffolds.known_paragraphs(c, "u", ["p1", "p2"], "b")) == set()
    )


async def test_subagents_items_and_slots(store: Store) -> None:
    await store.get_or_create_session("u", "parent")
    await store.get_or_create_session("u", "kid", parent_id="parent")
    await store.get_or_create_session("u", "kid2", parent_id="parent")
    now = time.time()

    def run(c: Connection) -> dict[str, Any]:
        subagents.set_completed(c, "kid", now)
        ids = [
            items.insert_item(c, "parent", "u", NewTurn(-1, "summary", f"s{i}", "kid"), None, None)
            for i in range(3)
        ]
        slots.upsert_slots(
            c, "u", [slots.SlotRow(f"s{i}", "t", "é" * i, i, "d" * 300) for i in range(3)], now, 60
        )
        slots.upsert_slots(c, "v", [slots.SlotRow("x", "t", "x", 1, "")], now - 120, 60)
        page, total = slots.user_slot_page(c, "u", now, limit=2, description_chars=5)
        return {
            "completed": [subagents.is_completed(c, s) for s in ("kid", "kid2", "nope")],
            "idle": sorted(subagents.idle_subagents(c, now + 1)),
            "next": items.next_item_position(c, "parent"),
            "items": [t.content for t in items.session_items(c, "parent", "summary", 2)],
            "ids": ids,
            "texts": sorted(items.fact_texts(c, "parent")),
            "page": [(s.id, s.description, s.bytes) for s in page],
            "total": total,
            "figures": slots.slot_figures(c, now),
            "sizes": sorted(slots.user_slot_sizes(c, "u", now))[:1],
            "purged": slots.purge_slots(c, now),
            "forgot": slots.forget_slots(c, "u"),
        }

    got = await store.write(run)
    assert got["completed"] == [True, False, False]
    assert got["idle"] == ["kid2"]
    assert got["next"] == -4
    assert got["items"] == ["s2", "s1"]  # the newest first
    assert got["texts"] == []
    assert got["page"] == [("s0", "ddddd", 0), ("s1", "ddddd", 2)]  # same expiry: by id
    assert got["total"] == 3
    assert got["figures"] == (3, 6)
    assert got["sizes"] == [("s0", 0, pytest.approx(now + 60))]
    assert got["purged"] == 1 and got["forgot"] == 3
