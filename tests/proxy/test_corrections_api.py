"""Correcting memory through the admin API (issue 23, section 5), against a running Engram with
the fake upstream: forget a turn (gone from search and, once scrubbed, from the database file),
forget everything, notes recalled into the next chat, pins and mutes, facts edited and deleted;
each route's 4xx answers; another user's ids are 404 whoever asks (accounts with keys)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from proxy.chat.fence import BLOCK_OPEN
from proxy.services import SERVICES
from proxy.store.items import insert_item
from proxy.store.models import NewTurn, embed_text
from proxy.store.naming import create_named, facts_session_name
from proxy.store.sqlite.db import Connection
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, forwarded_memory, settle, start_engram
from tests.proxy.test_auth import bearer, db_of, keyed_engram, make_key
from tests.proxy.test_forget import found, rows_holding

pytestmark = pytest.mark.asyncio

API = "/engram/api"
SECRET = "My bicycle lock combination is vorpelquist 8812"
TOKEN = "vorpelquist"  # a word the stemmer leaves alone
FTS_PART = TOKEN[2:]  # what an FTS leaf page holds of it after a shared prefix


class Client:
    """One user's view of a running Engram: chats (returning what the upstream was sent) and
    admin calls (returning status and JSON)."""

    def __init__(
        self, http: aiohttp.ClientSession, e: Engram, fake: FakeUpstream, headers: dict[str, str]
    ) -> None:
        self.http, self.e, self.fake, self.headers = http, e, fake, headers

    async def chat(self, text: str, session: str) -> str:
        """Send ``text`` in ``session``; what Engram added to it in the prompt the upstream
        received (the memory block), as one string."""
        self.fake.requests.clear()
        async with self.http.post(
            self.e.base_url + "/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": text}]},
            headers={**self.headers, "X-Engram-Session": session},
        ) as r:
            assert r.status == 200, await r.text()
        await settle(self.e)
        messages = self.fake.chat_requests()[-1].json()["messages"]
        last = messages[-1]
        if isinstance(last["content"], list):  # the memory block leads the user's words
            *block, words = last["content"]
            assert words == {"type": "text", "text": text}
            assert all(BLOCK_OPEN in part["text"] for part in block)
        else:
            assert last == {"role": "user", "content": text}
        return forwarded_memory(messages)

    async def call(
        self, method: str, path: str, body: Any = None, raw: bytes | None = None, **params: str
    ) -> tuple[int, Any]:
        async with self.http.request(
            method,
            self.e.url + API + path,
            json=body if raw is None else None,
            data=raw,
            params=params,
            headers={**self.headers, "Content-Type": "application/json"} if raw else self.headers,
        ) as r:
            return r.status, await r.json()

    async def turn_id(self, session: str, content: str) -> int:
        status, body = await self.call("GET", f"/sessions/{session}")
        assert status == 200, body
        return next(int(t["id"]) for t in body["turns"] if t["content"] == content)

    async def search(self, q: str, mode: str = "hybrid") -> list[str]:
        status, body = await self.call("GET", "/search", q=q, mode=mode)
        assert status == 200, body
        return [r["content"] for r in body["results"]]


async def add_fact(e: Engram, user: str, text: str, source: int | None = None) -> int:
    """A fact as consolidation stores one (in ``facts~<user>``, embedded, traced to a turn)."""
    services = e.app[SERVICES]
    store, embedder = services.store, services.memory.embedder
    assert store is not None and embedder is not None
    (vector,) = await embedder.embed_passages([embed_text("fact", None, text)])

    def write(c: Connection) -> int:
        facts = create_named(
            c,
            user,
            facts_session_name(user),
            parent_id=None,
            agent=None,
            fingerprint=None,
            indexed=True,
            now=0.0,
        )
        return insert_item(c, facts.id, user, NewTurn(-1, "fact", text), vector, None, source)

    return await store.write(write)


@pytest_asyncio.fixture
async def engram(fake: FakeUpstream) -> AsyncIterator[Engram]:
    fake.reply_text = lambda last: "Noted."  # no echo: the user's words are in one turn only
    e = await start_engram(fake.url, retrieval={"neighbours": 2})
    try:
        yield e
    finally:
        await e.close()


@pytest.fixture
def alice(http: aiohttp.ClientSession, engram: Engram, fake: FakeUpstream) -> Client:
    return Client(http, engram, fake, {"X-Engram-User": "alice"})


# --- forgetting -----------------------------------------------------------------------------------


async def test_a_forgotten_turn_leaves_search_and_the_database_file(
    alice: Client, engram: Engram
) -> None:
    db = Path(db_of(engram))
    await alice.chat("We planned the garden for spring", "s1")
    await alice.chat(SECRET, "s1")
    await alice.chat("And the tulips go by the fence", "s1")
    turn = await alice.turn_id("s1", SECRET)
    assert SECRET in await alice.search(TOKEN)
    assert found(db, TOKEN)  # the check can see it (turns, the index, the request record)
    status, body = await alice.call("DELETE", f"/turns/{turn}")
    assert status == 200, body
    assert body["id"] == turn and body["deleted"] is True and body["role"] == "user"
    assert body["derived"]["requests"] == 1  # the request that asked it
    assert set(body["derived"]) == {"facts", "summaries", "handbacks", "requests"}
    for mode in ("hybrid", "fts", "vec"):
        assert SECRET not in await alice.search(f"bicycle lock combination {TOKEN}", mode)
    await settle(engram)  # the scrub that follows in the background
    assert found(db, TOKEN, FTS_PART, "bicycle lock combination") == [], rows_holding(db, TOKEN)
    assert found(db, "tulips")  # the rest of the session stays
    status, body = await alice.call("GET", "/sessions/s1")
    assert [t["content"] for t in body["turns"]] == [
        "We planned the garden for spring",
        "Noted.",
        "Noted.",
        "And the tulips go by the fence",
        "Noted.",
    ]
    status, body = await alice.call("DELETE", f"/turns/{turn}")  # already gone
    assert status == 404 and body["error"]["code"] == "turn_not_found"


async def test_forgetting_a_turn_forgets_the_facts_made_from_it(
    alice: Client, engram: Engram
) -> None:
    await alice.chat("I moved to Porto last year", "s1")
    turn = await alice.turn_id("s1", "I moved to Porto last year")
    traced = await add_fact(engram, "alice", "The user lives in Porto", turn)
    other = await add_fact(engram, "alice", "The user likes green tea")
    status, body = await alice.call("DELETE", f"/turns/{turn}")
    assert status == 200 and body["derived"]["facts"] == 1
    assert "The user lives in Porto" not in await alice.search("Porto lives")
    status, body = await alice.call("DELETE", f"/facts/{traced}")
    assert status == 404 and body["error"]["code"] == "turn_not_found"
    status, body = await alice.call("DELETE", f"/facts/{other}")
    assert status == 200 and body["deleted"] is True and body["role"] == "fact"
    assert await alice.search("green tea", "fts") == []


async def test_forgetting_everything_needs_confirmation_and_keeps_other_users(
    http: aiohttp.ClientSession, alice: Client, engram: Engram, fake: FakeUpstream
) -> None:
    bob = Client(http, engram, fake, {"X-Engram-User": "bob"})
    await alice.chat("alice likes herons", "a1")
    await alice.chat("alice likes owls", "a2")
    await bob.chat("bob likes herons too", "b1")
    for params in ({}, {"confirm": "no"}, {"confirm": "YES"}):
        status, body = await alice.call("DELETE", "/memory", **params)
        assert status == 400 and body["error"]["code"] == "confirm_required", params
    assert len((await alice.call("GET", "/sessions"))[1]["sessions"]) == 2
    status, body = await alice.call("DELETE", "/memory", confirm="yes")
    assert status == 200, body
    assert body == {"user": "alice", "deleted": True, "sessions": 2, "turns": 4}
    assert (await alice.call("GET", "/sessions"))[1]["sessions"] == []
    assert await alice.search("herons") == []
    assert "bob likes herons too" in await bob.search("herons", "fts")
    await settle(engram)
    assert not found(Path(db_of(engram)), "owls")


# --- notes, pins, mutes, facts --------------------------------------------------------------------


async def test_a_note_is_recalled_into_the_next_chat(alice: Client) -> None:
    note = "Remember that I moved to Lisbon in March"
    assert "Lisbon" not in await alice.chat("Which city did I move to in March?", "s1")
    status, body = await alice.call("POST", "/notes", {"text": f"  {note}\n"})
    assert status == 201, body
    assert body["content"] == note and body["role"] == "user" and body["api"] == "note"
    assert isinstance(body["id"], int)
    assert note in await alice.search("Lisbon", "vec")  # embedded at once
    assert note in await alice.chat("Which city did I move to in March?", "s2")


async def test_a_pinned_turn_comes_into_every_chat_and_unpinning_ends_it(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    fake.reply_text = lambda last: "Noted."
    # One memory a request: the turn that matches the question, never the pinned one by chance.
    e = await start_engram(fake.url, retrieval={"top_k": 1})
    try:
        alice = Client(http, e, fake, {"X-Engram-User": "alice"})
        fact = "My cat Pixel is allergic to salmon"
        await alice.chat(fact, "s1")
        await alice.chat("Water boils at one hundred degrees at sea level", "s0")
        turn = await alice.turn_id("s1", fact)
        unrelated = "What is the boiling point of water at sea level?"
        sent = await alice.chat(unrelated, "s2")
        assert "one hundred degrees" in sent and "salmon" not in sent
        status, body = await alice.call("POST", f"/turns/{turn}/recall", {"recall": "pinned"})
        assert status == 200, body
        assert body["id"] == turn and body["recall"] == "pinned" and body["content"] == fact
        sent = await alice.chat(unrelated, "s3")
        assert fact in sent
        assert fact in await alice.chat("Tell me a joke about trains", "s4")
        status, body = await alice.call("POST", f"/turns/{turn}/recall", {"recall": "normal"})
        assert status == 200 and body["recall"] == "normal"
        assert "salmon" not in await alice.chat(unrelated, "s5")
    finally:
        await e.close()


async def test_a_muted_turn_is_never_recalled_not_even_as_a_neighbour(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    fake.reply_text = lambda last: "Noted."
    # One search hit a request, and the turns next to it: the muted turn comes by either way.
    e = await start_engram(fake.url, retrieval={"top_k": 1, "neighbours": 2})
    try:
        alice = Client(http, e, fake, {"X-Engram-User": "alice"})
        code, shed = "The garage code is heliotrope 4417", "The spare key hangs in the shed"
        await alice.chat(code, "s1")
        await alice.chat(shed, "s1")
        question, nearby = "What is the garage code heliotrope?", "Where is the spare key, shed?"
        assert code in await alice.chat(question, "s2")  # found by search while not muted
        sent = await alice.chat(nearby, "s3")
        assert shed in sent and code in sent  # and as the shed turn's neighbour
        turn = await alice.turn_id("s1", code)
        status, body = await alice.call("POST", f"/turns/{turn}/recall", {"recall": "muted"})
        assert status == 200 and body["recall"] == "muted" and body["content"] == code
        assert "4417" not in await alice.chat(question, "s4")
        sent = await alice.chat(nearby, "s5")
        assert shed in sent and "4417" not in sent
        assert code in await alice.search("garage code heliotrope")  # still kept, searchable
        status, body = await alice.call("POST", f"/turns/{turn}/recall", {"recall": "normal"})
        assert status == 200 and body["recall"] == "normal"
        assert code in await alice.chat(nearby, "s6")
    finally:
        await e.close()


async def test_an_edited_fact_is_recalled_with_its_new_text_never_the_old(
    alice: Client, engram: Engram
) -> None:
    old_text = "The user's favourite tea is oolong"
    fact = await add_fact(engram, "alice", old_text)
    question = "What is my favourite tea?"
    assert "oolong" in await alice.chat(question, "s1")
    status, body = await alice.call(
        "POST", f"/facts/{fact}", {"text": "The user's favourite tea is rooibos"}
    )
    assert status == 200, body
    assert body["replaces"] == fact and body["role"] == "fact"
    assert body["content"] == "The user's favourite tea is rooibos"
    sent = await alice.chat(question, "s2")
    assert "rooibos" in sent and "oolong" not in sent
    assert not [c for c in await alice.search("favourite tea oolong") if "oolong" in c]
    # A pinned fact stays pinned when edited, and its old words are not kept for the next chat.
    new = body["id"]
    status, _ = await alice.call("POST", f"/turns/{new}/recall", {"recall": "pinned"})
    assert status == 200
    assert "rooibos" in await alice.chat("Tell me about trains", "s3")  # the pins are read now
    status, body = await alice.call("POST", f"/facts/{new}", {"text": "The user drinks mate"})
    assert status == 200
    sent = await alice.chat("Tell me about trains", "s4")
    assert "The user drinks mate" in sent and "rooibos" not in sent
    await settle(engram)
    assert found(Path(db_of(engram)), "oolong", "rooibos") == []


# --- what each route refuses ----------------------------------------------------------------------


async def test_each_route_refuses_bad_input(alice: Client, engram: Engram) -> None:
    await alice.chat("I like cycling along the coast", "s1")
    turn = await alice.turn_id("s1", "I like cycling along the coast")
    fact = await add_fact(engram, "alice", "The user cycles")

    async def refused(
        method: str, path: str, status: int, code: str | None, body: Any = None, **kw: Any
    ) -> None:
        got, answer = await alice.call(method, path, body, **kw)
        assert got == status, (method, path, body, answer)
        assert answer["error"]["code"] == code or code is None, answer

    for bad in ("abc", "0", "-3", "1.5", "9" * 30):
        await refused("DELETE", f"/turns/{bad}", 400, None)
        await refused("POST", f"/turns/{bad}/recall", 400, None, {"recall": "pinned"})
        await refused("POST", f"/facts/{bad}", 400, None, {"text": "x"})
        await refused("DELETE", f"/facts/{bad}", 400, None)
    missing = 10**9
    await refused("DELETE", f"/turns/{missing}", 404, "turn_not_found")
    await refused("POST", f"/turns/{missing}/recall", 404, "turn_not_found", {"recall": "muted"})
    await refused("POST", f"/facts/{missing}", 404, "turn_not_found", {"text": "x"})
    await refused("DELETE", f"/facts/{missing}", 404, "turn_not_found")
    # A turn that is not a fact is no fact.
    await refused("POST", f"/facts/{turn}", 404, "fact_not_found", {"text": "x"})
    await refused("DELETE", f"/facts/{turn}", 404, "fact_not_found")
    for recall in ("always", "PINNED", "", 1, None, True):
        await refused("POST", f"/turns/{turn}/recall", 400, None, {"recall": recall})
    await refused("POST", f"/turns/{turn}/recall", 400, None, {})
    await refused("POST", f"/turns/{turn}/recall", 400, "invalid_json", raw=b"")
    await refused("POST", f"/turns/{turn}/recall", 400, "invalid_json", raw=b"{pinned")
    await refused("POST", f"/turns/{turn}/recall", 400, "invalid_body", ["pinned"])
    for path in ("/notes", f"/facts/{fact}"):
        await refused("POST", path, 400, "invalid_text", {"text": ""})
        await refused("POST", path, 400, "invalid_text", {"text": " \n\t "})
        await refused("POST", path, 400, "invalid_text", {"text": 42})
        await refused("POST", path, 400, "invalid_text", {})
        await refused("POST", path, 400, "text_too_long", {"text": "x" * 8001})
        await refused("POST", path, 400, "invalid_json", raw=b"not json")
        await refused("POST", path, 400, "invalid_body", "a string")
    await refused("DELETE", "/memory", 400, "confirm_required")
    # Nothing was changed by any of it.
    status, body = await alice.call("GET", "/sessions/s1")
    assert body["turns"][0]["content"] == "I like cycling along the coast"
    assert "The user cycles" in await alice.search("cycles", "fts")
    status, body = await alice.call("GET", "/sessions")
    assert not [s for s in body["sessions"] if s["id"].startswith("notes~")]
    # The largest text accepted is accepted.
    status, body = await alice.call("POST", "/notes", {"text": "y" * 8000})
    assert status == 201, body


async def test_another_users_ids_are_404_with_keys(
    fake: FakeUpstream, http: aiohttp.ClientSession, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.reply_text = lambda last: "Noted."
    e = await keyed_engram(fake)
    try:
        db = db_of(e)
        keys = {u: await make_key(db, u, capsys) for u in ("alice", "bob")}
        admin_key = await make_key(db, "ops", capsys, admin=True)
        alice = Client(http, e, fake, bearer(keys["alice"]))
        bob = Client(http, e, fake, bearer(keys["bob"]))
        admin = Client(http, e, fake, bearer(admin_key))
        await alice.chat(SECRET, "a1")
        turn = await alice.turn_id("a1", SECRET)
        fact = await add_fact(e, "alice", "The user's lock code is vorpelquist")
        for client in (bob, admin):  # the admin key acts on its own user unless it names one
            for method, path, body in (
                ("DELETE", f"/turns/{turn}", None),
                ("POST", f"/turns/{turn}/recall", {"recall": "pinned"}),
                ("POST", f"/turns/{turn}/recall", {"recall": "muted"}),
                ("POST", f"/facts/{fact}", {"text": "bob was here"}),
                ("DELETE", f"/facts/{fact}", None),
                ("POST", f"/facts/{turn}", {"text": "bob was here"}),
            ):
                status, answer = await client.call(method, path, body)
                assert status == 404, (client.headers, method, path, answer)
                assert "alice" not in answer["error"]["message"]
        # bob naming alice is refused outright.
        bob.headers["X-Engram-User"] = "alice"
        status, answer = await bob.call("DELETE", f"/turns/{turn}")
        assert status == 403 and answer["error"]["code"] == "not_your_user"
        status, answer = await bob.call("POST", "/notes", {"text": "alice moved to Mars"})
        assert status == 403
        del bob.headers["X-Engram-User"]
        # bob forgetting everything forgets his own memory only.
        await bob.chat("bob's own words", "b1")
        status, answer = await bob.call("DELETE", "/memory", confirm="yes")
        assert status == 200 and answer["user"] == "bob" and answer["turns"] == 2
        # No credential at all: 401 on every correction route.
        nobody = Client(http, e, fake, {})
        for method, path, body in (
            ("DELETE", f"/turns/{turn}", None),
            ("POST", f"/turns/{turn}/recall", {"recall": "muted"}),
            ("DELETE", "/memory", None),
            ("POST", "/notes", {"text": "x"}),
            ("POST", f"/facts/{fact}", {"text": "x"}),
            ("DELETE", f"/facts/{fact}", None),
        ):
            status, _ = await nobody.call(method, path, body)
            assert status == 401, (method, path)
        # alice's memory is as it was, and she (or the admin naming her) can correct it.
        assert SECRET in await alice.search(TOKEN)
        assert "The user's lock code is vorpelquist" in await alice.search(TOKEN)
        admin.headers["X-Engram-User"] = "alice"
        status, answer = await admin.call("POST", f"/turns/{turn}/recall", {"recall": "muted"})
        assert status == 200 and answer["recall"] == "muted"
        status, answer = await alice.call("DELETE", f"/facts/{fact}")
        assert status == 200
        status, answer = await alice.call("POST", "/notes", {"text": "alice's note"})
        assert status == 201
        note = answer["id"]
        status, answer = await bob.call("DELETE", f"/turns/{note}")
        assert status == 404
    finally:
        await e.close()
