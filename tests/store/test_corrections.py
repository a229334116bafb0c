"""Corrections in the store (:mod:`proxy.store.corrections`, issue 23 section 5): forgetting one
turn takes its full-text row, its vector and what was made from it (facts traced to it, the
summary that covers it, its session's hand-backs, the request records that asked it) and nothing
else; another user's id answers None and changes nothing; pins and mutes; a replaced fact keeps
its place and sources while its old words leave ``turns`` and ``turns_fts``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from proxy.store import NewTurn, Store, browse, corrections
from proxy.store.dialect import is_pg
from proxy.store.feedback import RecordedRequest, insert_request
from proxy.store.items import insert_item
from proxy.store.sqlite.db import Connection
from proxy.store.summaries import Summary, get_summary, put_summary
from proxy.vectors import Vector

pytestmark = pytest.mark.asyncio

DIM = 384
SECRET = "I keep the zorblingfax key inside the blue vase"
FACT = "The user keeps the zorblingfax key in a vase"


def unit(i: int) -> Vector:
    v = np.zeros(DIM, dtype=np.float32)
    v[i % DIM] = 1.0
    return v


def count(c: Connection, sql: str, *args: object) -> int:
    return int(c.execute(sql, args).fetchone()[0])


def matches(c: Connection, term: str, turn_id: int | None = None) -> int:
    """How many full-text rows hold ``term`` (in their body or their neighbours' context), of
    all or of ``turn_id``'s; a quoted phrase is matched as words in sequence (on PostgreSQL,
    whose English ``tsvector`` drops "in a", as the indexed text holding it)."""
    one = "" if turn_id is None else f" AND {'turn_id' if is_pg(c) else 'rowid'} = {turn_id:d}"
    if not is_pg(c):
        return count(c, f"SELECT count(*) FROM turns_fts WHERE turns_fts MATCH ?{one}", term)
    if term.startswith('"'):
        sql = "SELECT count(*) FROM turns_fts WHERE (body || ' ' || ctx) ILIKE ?"
        return count(c, sql + one, "%" + term.strip('"') + "%")
    sql = "SELECT count(*) FROM turns_fts WHERE tsv @@ plainto_tsquery('english', ?)"
    return count(c, sql + one, term)


def fts_id(c: Connection) -> str:
    """The column of ``turns_fts`` that is the turn's id."""
    return "turn_id" if is_pg(c) else "rowid"


def vectors(c: Connection, *ids: int) -> int:
    return sum(count(c, "SELECT count(*) FROM turn_vec WHERE turn_id = ?", i) for i in ids)


@pytest_asyncio.fixture
async def store(store_target: str | Path) -> AsyncIterator[Store]:
    async with Store(store_target) as s:
        yield s


async def memory(store: Store) -> dict[str, Any]:
    """User u: session a (five turns, the third SECRET), its sub-agent a-kid (one turn, handed
    back into a), session b; a summary of a covering SECRET, facts, request records. User v:
    one turn."""
    for sid, parent in (("a", None), ("a-kid", "a"), ("b", None), ("facts~u", None)):
        await store.get_or_create_session("u", sid, parent_id=parent)
    texts = ["we talked about gardens", "and about tulips", SECRET, "thanks", "the weather"]
    ids = await store.add_turns(
        "a",
        "u",
        [NewTurn(i, "user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(texts)],
        [unit(i) for i in range(len(texts))],
    )
    (kid,) = await store.add_turns("a-kid", "u", [NewTurn(0, "user", "the kid read a file")])
    (b,) = await store.add_turns("b", "u", [NewTurn(0, "user", SECRET)], [unit(9)])
    await store.get_or_create_session("v", "other")
    (theirs,) = await store.add_turns("other", "v", [NewTurn(0, "user", "v's own words")])
    now = time.time()
    secret = ids[2]

    def setup(c: Connection) -> dict[str, int]:
        made = {
            "fact": insert_item(
                c, "facts~u", "u", NewTurn(-1, "fact", FACT), unit(20), "a", source_turn=secret
            ),
            "other fact": insert_item(
                c, "facts~u", "u", NewTurn(-1, "fact", "tulips"), None, "a", source_turn=ids[1]
            ),
            "untraced fact": insert_item(
                c, "facts~u", "u", NewTurn(-1, "fact", "gardens"), None, "a"
            ),
            "handback": insert_item(
                c, "a", "u", NewTurn(-1, "summary", "kid: found it"), None, "a-kid"
            ),
        }
        put_summary(c, Summary("a", f"they said: {SECRET}", 3, 10, now), None)
        put_summary(c, Summary("b", f"b said: {SECRET}", 1, 10, now), None)
        for rid, sid, query in (
            ("asked", "a", SECRET),
            ("asked-inside", "a", "zorblingfax key"),
            ("other-question", "a", "what about tulips"),
            ("asked-elsewhere", "b", SECRET),
        ):
            insert_request(c, RecordedRequest(rid, "u", sid, None, query, [], now))
        return made

    made = await store.write(setup)
    return {"ids": ids, "secret": secret, "kid": kid, "b": b, "theirs": theirs, **made}


async def test_forgetting_a_turn_takes_what_was_made_from_it_and_nothing_else(
    store: Store,
) -> None:
    m = await memory(store)
    secret = m["secret"]
    before = await store.read(lambda c: matches(c, "zorblingfax"))
    assert before >= 4  # the turn, its neighbours' context, b's turn, the fact
    gone = await store.write(lambda c: corrections.forget_turn(c, "u", secret))
    assert gone == corrections.TurnForgotten(
        "u", secret, "a", "user", facts=1, summaries=1, handbacks=0, requests=2
    )

    def left(c: Connection) -> dict[str, Any]:
        return {
            "turn": corrections.user_turn(c, "u", secret),
            "fact": corrections.user_turn(c, "u", m["fact"]),
            "vectors": vectors(c, secret, m["fact"]),
            "turns in a": count(c, "SELECT count(*) FROM turns WHERE session_id = 'a'"),
            "summary a": get_summary(c, "a"),
            "summary b": get_summary(c, "b") is not None,
            "requests": sorted(r[0] for r in c.execute("SELECT id FROM requests")),
            "facts": sorted(r[0] for r in c.execute("SELECT content FROM turns WHERE role='fact'")),
            "fts": matches(c, "zorblingfax"),
            "fts of b": matches(c, "zorblingfax", m["b"]),
            "neighbours": (
                vectors(c, m["ids"][1], m["ids"][3]),
                count(
                    c,
                    f"SELECT count(*) FROM turns_fts WHERE {fts_id(c)} IN (?, ?)",
                    m["ids"][1],
                    m["ids"][3],
                ),
            ),
        }

    after = await store.read(left)
    assert after == {
        "turn": None,
        "fact": None,
        "vectors": 0,
        "turns in a": 5,  # four turns and the hand-back
        "summary a": None,
        "summary b": True,
        "requests": ["asked-elsewhere", "other-question"],
        "facts": ["gardens", "tulips"],
        "fts": 1,  # b's turn only: its neighbours' context no longer holds the word either
        "fts of b": 1,
        "neighbours": (2, 2),  # their vectors and full-text rows stay
    }


async def test_a_summary_that_does_not_cover_the_turn_stays_and_a_subagents_turn_takes_its_handback(
    store: Store,
) -> None:
    m = await memory(store)
    last = m["ids"][4]  # position 4: the summary covers positions < 3
    gone = await store.write(lambda c: corrections.forget_turn(c, "u", last))
    assert gone is not None and (gone.summaries, gone.handbacks, gone.facts) == (0, 0, 0)
    assert await store.read(lambda c: get_summary(c, "a")) is not None
    gone = await store.write(lambda c: corrections.forget_turn(c, "u", m["kid"]))
    assert gone is not None and gone.handbacks == 1 and gone.session_id == "a-kid"
    assert await store.read(lambda c: corrections.user_turn(c, "u", m["handback"])) is None
    assert await store.get_session("a-kid") is not None  # the session itself stays


async def test_another_users_id_answers_none_and_changes_nothing(store: Store) -> None:
    m = await memory(store)

    def snapshot(c: Connection) -> dict[str, int]:
        return {
            table: count(c, f"SELECT count(*) FROM {table}")
            for table in ("turns", "turn_vec", "summaries", "requests")
        } | {"fts": matches(c, "zorblingfax"), "recall": count(c, "SELECT sum(recall) FROM turns")}

    before = await store.read(snapshot)
    for turn_id in (m["secret"], m["fact"]):
        assert await store.read(lambda c, t=turn_id: corrections.user_turn(c, "v", t)) is None
        assert await store.write(lambda c, t=turn_id: corrections.forget_turn(c, "v", t)) is None
        assert await store.write(lambda c, t=turn_id: corrections.set_recall(c, "v", t, 1)) is None
    new = NewTurn(-1, "fact", "v rewrites u's fact")
    assert (
        await store.write(lambda c: corrections.replace_fact(c, "v", m["fact"], new, None)) is None
    )
    assert await store.write(lambda c: corrections.forget_turn(c, "u", 10**9)) is None
    assert await store.read(snapshot) == before
    # and u cannot reach v's turn either
    assert await store.write(lambda c: corrections.forget_turn(c, "u", m["theirs"])) is None
    assert await store.read(snapshot) == before


async def test_pins_and_mutes(store: Store) -> None:
    m = await memory(store)
    ids = m["ids"]
    for turn_id, value in ((ids[0], 1), (ids[1], 1), (ids[3], -1)):
        turn = await store.write(lambda c, t=turn_id, v=value: corrections.set_recall(c, "u", t, v))
        assert turn is not None and turn.recall == value
    pinned = await store.read(lambda c: corrections.pinned(c, "u", 10))
    assert [t.id for t in pinned] == [ids[1], ids[0]]  # the newest first
    assert [t.id for t in await store.read(lambda c: corrections.pinned(c, "u", 1))] == [ids[1]]
    marked = await store.read(lambda c: browse.marked(c, "u", 10))
    assert [(t.id, t.recall) for t in marked] == [(ids[3], -1), (ids[1], 1), (ids[0], 1)]
    assert await store.read(lambda c: corrections.pinned(c, "v", 10)) == []
    turn = await store.write(lambda c: corrections.set_recall(c, "u", ids[3], 0))
    assert turn is not None and turn.recall == 0
    with pytest.raises(ValueError):
        await store.write(lambda c: corrections.set_recall(c, "u", ids[0], 2))
    assert corrections.RECALL_MODES == {"pinned": 1, "normal": 0, "muted": -1}


async def test_a_replaced_fact_keeps_its_place_and_sources_and_its_old_words_go(
    store: Store,
) -> None:
    m = await memory(store)
    old = m["fact"]
    await store.write(lambda c: corrections.set_recall(c, "u", old, 1))
    new = NewTurn(-1, "fact", "The user keeps the quintarble key in a drawer")
    turn = await store.write(lambda c: corrections.replace_fact(c, "u", old, new, unit(30)))
    assert turn is not None
    assert (turn.session_id, turn.role, turn.content) == ("facts~u", "fact", new.content)
    assert turn.recall == 1  # still pinned

    def check(c: Connection) -> dict[str, Any]:
        return {
            "old": corrections.user_turn(c, "u", old),
            "sources": corrections.fact_sources(c, [turn.id])[turn.id],
            "old words in turns": count(
                c, "SELECT count(*) FROM turns WHERE content LIKE ?", "%in a vase%"
            ),
            "old in fts": matches(c, '"in a vase"'),
            "new in fts": matches(c, "quintarble"),
            "vectors": (vectors(c, old), vectors(c, turn.id)),
        }

    assert await store.read(check) == {
        "old": None,
        "sources": ("a", m["secret"]),
        "old words in turns": 0,
        "old in fts": 0,
        "new in fts": 1,
        "vectors": (0, 1),
    }
    # A turn that is not a fact is not replaced.
    user_turn = m["ids"][0]
    assert (
        await store.write(lambda c: corrections.replace_fact(c, "u", user_turn, new, None)) is None
    )
    # The replacement is still traced to its source turn: forgetting that turn takes it.
    gone = await store.write(lambda c: corrections.forget_turn(c, "u", m["secret"]))
    assert gone is not None and gone.facts == 1
    assert await store.read(lambda c: corrections.user_turn(c, "u", turn.id)) is None


async def test_notes_live_in_one_session_per_user(store: Store) -> None:
    first = await store.write(lambda c: corrections.notes_session(c, "u", time.time()))
    again = await store.write(lambda c: corrections.notes_session(c, "u", time.time()))
    theirs = await store.write(lambda c: corrections.notes_session(c, "v", time.time()))
    assert first == again != theirs
    session = await store.get_session(first)
    assert session is not None and (session.name, session.user_id) == ("notes~u", "u")
    assert session.indexed
