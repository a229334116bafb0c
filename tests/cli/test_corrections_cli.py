"""Correcting memory from the command line (issue 23, section 5), on a real database file: the
same actions as the admin API (:mod:`proxy.api.actions`) through ``engram forget --turn``,
``engram note``, ``engram fact edit|delete`` and ``engram pin|mute|unpin``. Another user's id, an
unknown one and empty text fail (exit 1) and change nothing; what is forgotten leaves the file
before the command exits."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from proxy.cli.main import main
from proxy.search.embedder import HashEmbedder
from proxy.store import Store, corrections
from proxy.store.feedback import RecordedRequest, insert_request
from proxy.store.items import insert_item
from proxy.store.models import NewTurn, Turn, embed_text
from proxy.store.naming import create_named, facts_session_name
from proxy.store.sqlite.db import Connection
from proxy.store.summaries import Summary, get_summary, put_summary
from tests.cli.test_cli import engram, env, write  # noqa: F401  (env: a fixture)
from tests.proxy.test_forget import found
from tests.unit.test_redact import p, rnd

T = TypeVar("T")

SECRET = "My locker combination is quarnelfip 3141"
LINES = [
    '{"user": "alice", "session": "a1", "role": "user", "content": "We planned the garden"}',
    f'{{"user": "alice", "session": "a1", "role": "user", "content": "{SECRET}"}}',
    '{"user": "alice", "session": "a1", "role": "assistant", "content": "Noted, the locker"}',
    '{"user": "bob", "session": "b1", "role": "user", "content": "Bob rides a red bicycle"}',
]


def on_store(db: Path, fn: Callable[[Store], Awaitable[T]]) -> T:
    async def go() -> T:
        async with Store(db) as store:
            return await fn(store)

    return asyncio.run(go())


def turn(db: Path, user: str, turn_id: int) -> Turn | None:
    return on_store(db, lambda s: s.read(lambda c: corrections.user_turn(c, user, turn_id)))


def turn_id(db: Path, user: str, content: str) -> int:
    def find(c: Connection) -> int:
        row = c.execute(
            "SELECT id FROM turns WHERE user_id = ? AND content = ?", (user, content)
        ).fetchone()
        assert row is not None, content
        return int(row[0])

    return on_store(db, lambda s: s.read(find))


def add_fact(db: Path, user: str, text: str, source: int | None = None) -> int:
    """A fact as consolidation stores one (in ``facts~<user>``, embedded, traced to a turn)."""

    async def go(store: Store) -> int:
        (vector,) = await HashEmbedder().embed_passages([embed_text("fact", None, text)])

        def add(c: Connection) -> int:
            facts = create_named(
                c,
                user,
                facts_session_name(user),
                parent_id=None,
                agent=None,
                fingerprint=None,
                indexed=True,
                now=time.time(),
            )
            return insert_item(c, facts.id, user, NewTurn(-1, "fact", text), vector, None, source)

        return await store.write(add)

    return on_store(db, go)


def facts(db: Path, user: str) -> list[str]:
    def read(c: Connection) -> list[str]:
        rows = c.execute("SELECT content FROM turns WHERE user_id = ? AND role = 'fact'", (user,))
        return [str(r[0]) for r in rows]

    return on_store(db, lambda s: s.read(read))


def search(db: Path, capsys: pytest.CaptureFixture[str], query: str, *args: str) -> list[Any]:
    capsys.readouterr()
    assert engram(db, "search", query, "--json", *args) == 0
    results: list[Any] = json.loads(capsys.readouterr().out)["results"]
    return results


def fails(capsys: pytest.CaptureFixture[str], db: Path, *args: str, says: str) -> None:
    capsys.readouterr()
    assert engram(db, *args) == 1, args
    err = capsys.readouterr().err
    assert says in err, err


@pytest.fixture
def db(env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:  # noqa: F811
    assert engram(env, "import", str(write(tmp_path / "in.jsonl", LINES))) == 0
    capsys.readouterr()
    return env


def test_forget_a_turn_takes_what_was_made_from_it_and_scrubs_the_file(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = turn_id(db, "alice", SECRET)
    fact = add_fact(db, "alice", "The user's locker opens with quarnelfip", secret)
    kept = add_fact(db, "alice", "The user plans a garden")

    def made(c: Connection) -> None:
        put_summary(c, Summary("a1", f"They said: {SECRET}", 3, 10, time.time()), None)
        insert_request(c, RecordedRequest("r1", "alice", "a1", None, SECRET, [], time.time()))

    on_store(db, lambda s: s.write(made))
    assert found(db, "quarnelfip")  # the check can see it
    bob = turn_id(db, "bob", "Bob rides a red bicycle")
    # Not alice's, not there, not a turn id: exit 1 and nothing changes.
    fails(capsys, db, "forget", "--turn", str(secret), "--user", "bob", says="No turn")
    fails(capsys, db, "forget", "--turn", str(secret), says="for user 'default'")
    fails(capsys, db, "forget", "--turn", str(bob), "--user", "alice", says="No turn")
    fails(capsys, db, "forget", "--turn", "99999", "--user", "alice", says="No turn")
    fails(capsys, db, "forget", "--turn", "x1", "--user", "alice", says="turn id")
    assert engram(db, "forget", "--turn", str(secret), "a1") == 2  # one of them
    assert engram(db, "forget", "--turn", str(secret), "--user", "alice", "--all") == 2
    assert turn(db, "alice", secret) is not None
    capsys.readouterr()
    assert engram(db, "forget", "--turn", str(secret), "--user", "alice") == 0
    out = capsys.readouterr().out
    assert f"deleted turn {secret} (user) of user 'alice'" in out
    assert "1 facts, 1 summaries, 0 hand-backs, 1 request records" in out
    assert turn(db, "alice", secret) is None and turn(db, "alice", fact) is None
    assert turn(db, "alice", kept) is not None and turn(db, "bob", bob) is not None
    assert on_store(db, lambda s: s.read(lambda c: get_summary(c, "a1"))) is None
    for mode in ("fts", "vec", "hybrid"):
        hits = search(
            db, capsys, "locker combination quarnelfip", "--user", "alice", "--mode", mode
        )
        assert all("quarnelfip" not in h["content"] for h in hits), mode
    # Scrubbed before the command exited: no byte of it is left in the files.
    assert found(db, "quarnelfip", "arnelfip", "locker combination") == []
    assert found(db, "garden", "bicycle")  # the rest is still there
    fails(capsys, db, "forget", "--turn", str(secret), "--user", "alice", says="No turn")


def test_a_note_is_stored_embedded_and_found(
    db: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    capsys.readouterr()
    assert engram(db, "note", "  I moved to Lisbon in March\n", "--user", "alice") == 0
    note = int(capsys.readouterr().out.strip())  # the new turn id, alone on its line
    stored = turn(db, "alice", note)
    assert stored is not None
    assert (stored.role, stored.content, stored.api) == (
        "user",
        "I moved to Lisbon in March",
        "note",
    )
    hits = search(db, capsys, "Lisbon March", "--user", "alice", "--mode", "vec")
    assert hits[0]["id"] == note and hits[0]["session"] == "notes~alice"  # embedded at once
    assert search(db, capsys, "Lisbon", "--user", "bob", "--mode", "fts") == []
    # Without --user it is the default user's.
    assert engram(db, "note", "the default user's note") == 0
    default = int(capsys.readouterr().out.strip())
    assert turn(db, "default", default) is not None and turn(db, "alice", default) is None
    # Secrets are redacted as in chats (memory.redact_secrets), unless that is off.
    token = p("gh", "p_") + rnd("note", 36)
    assert engram(db, "note", f"my token is {token}", "--user", "alice") == 0
    stored = turn(db, "alice", int(capsys.readouterr().out.strip()))
    assert stored is not None and token not in stored.content and "[REDACTED" in stored.content
    monkeypatch.setenv("ENGRAM_MEMORY_REDACT_SECRETS", "false")
    assert engram(db, "note", f"my token is {token}", "--user", "alice") == 0
    stored = turn(db, "alice", int(capsys.readouterr().out.strip()))
    assert stored is not None and token in stored.content
    for text in ("", "   \n", "x" * 8001):
        fails(capsys, db, "note", text, "--user", "alice", says="TEXT")


def test_a_note_starts_a_database(env: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    assert not env.exists()
    assert engram(env, "note", "the first thing remembered") == 0
    assert turn(env, "default", int(capsys.readouterr().out.strip())) is not None


def test_pin_mute_unpin(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    secret = turn_id(db, "alice", SECRET)

    def recall() -> int:
        found = turn(db, "alice", secret)
        assert found is not None
        return found.recall

    for command, value, word in (
        ("pin", 1, "pinned"),
        ("unpin", 0, "normal"),
        ("mute", -1, "muted"),
        ("unpin", 0, "normal"),  # unpin un-mutes too
        ("mute", -1, "muted"),
        ("pin", 1, "pinned"),
    ):
        capsys.readouterr()
        assert engram(db, command, str(secret), "--user", "alice") == 0
        assert f"turn {secret} of user 'alice' is {word}" in capsys.readouterr().out
        assert recall() == value, command
    pinned = on_store(db, lambda s: s.read(lambda c: corrections.pinned(c, "alice", 10)))
    assert [t.id for t in pinned] == [secret]
    for command in ("pin", "mute", "unpin"):
        fails(capsys, db, command, str(secret), "--user", "bob", says="No turn")
        fails(capsys, db, command, str(secret), says="No turn")  # the default user's: none
        fails(capsys, db, command, "0", "--user", "alice", says="positive integer")
        fails(capsys, db, command, "seven", "--user", "alice", says="turn id")
    assert recall() == 1  # as the last success left it


def test_fact_edit_and_delete(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fact = add_fact(db, "alice", "The user's favourite tea is oolong")
    user_turn = turn_id(db, "alice", SECRET)
    on_store(db, lambda s: s.write(lambda c: corrections.set_recall(c, "alice", fact, 1)))
    fails(capsys, db, "fact", "edit", str(fact), "rooibos", "--user", "bob", says="No turn")
    fails(capsys, db, "fact", "edit", str(fact), "rooibos", says="No turn")
    fails(capsys, db, "fact", "edit", str(user_turn), "x", "--user", "alice", says="No fact")
    fails(capsys, db, "fact", "edit", str(fact), " ", "--user", "alice", says="TEXT")
    fails(capsys, db, "fact", "delete", str(fact), "--user", "bob", says="No turn")
    fails(capsys, db, "fact", "delete", str(user_turn), "--user", "alice", says="No fact")
    assert turn(db, "alice", fact) is not None and turn(db, "alice", user_turn) is not None
    capsys.readouterr()
    # --db and --user after the action, as a person types them.
    args = ["fact", "edit", str(fact), "The user's favourite tea is rooibos", "--user", "alice"]
    assert main([*args, "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert f"fact {fact} of user 'alice' is now fact " in out
    new = int(out.split("is now fact ")[1].split(":")[0])
    edited = turn(db, "alice", new)
    # (A new row; its id is the old one's again when the fact was the newest row: SQLite
    # gives a table without AUTOINCREMENT the highest id plus one.)
    assert edited is not None
    assert facts(db, "alice") == ["The user's favourite tea is rooibos"]
    assert (edited.role, edited.content, edited.recall) == (
        "fact",
        "The user's favourite tea is rooibos",
        1,  # still pinned
    )
    hits = search(db, capsys, "favourite tea", "--user", "alice", "--mode", "vec")
    assert hits[0]["id"] == new  # embedded at once
    assert not [
        h for h in search(db, capsys, "oolong", "--user", "alice") if "oolong" in h["content"]
    ]
    assert found(db, "oolong") == []  # scrubbed before the command exited
    capsys.readouterr()
    assert engram(db, "fact", "delete", str(new), "--user", "alice") == 0
    assert f"deleted fact {new} of user 'alice'" in capsys.readouterr().out
    assert turn(db, "alice", new) is None and found(db, "rooibos") == []
    fails(capsys, db, "fact", "delete", str(new), "--user", "alice", says="No turn")


def test_session_and_user_forget_still_answer_as_before(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the shared actions now: the same messages and exit codes."""
    fails(capsys, db, "forget", "a1", "--user", "bob", says="No session 'a1' for user 'bob'")
    fails(capsys, db, "forget", "nothing-here", says="no session 'nothing-here'")
    assert engram(db, "forget", "a1") == 0
    assert "deleted session 'a1' of user 'alice' (3 turns)" in capsys.readouterr().out
    assert found(db, "quarnelfip") == []
    fails(capsys, db, "forget", "--user", "carol", "--all", "--yes", says="no user namespace")
    assert engram(db, "forget", "--user", "bob", "--all") == 2
    assert "this deletes user 'bob': 1 sessions, 1 turns" in capsys.readouterr().err
    assert engram(db, "forget", "--user", "bob", "--all", "--yes") == 0
    assert "deleted user 'bob': 1 sessions, 1 turns" in capsys.readouterr().out
    assert found(db, "bicycle") == []
    assert engram(db, "forget", "--all", "--yes") == 2  # --all needs --user
