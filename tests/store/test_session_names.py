"""Sessions by (user, name) (:mod:`proxy.store.naming`) and migration 7, which gives an existing
database's sessions their names so that they keep working for their owners."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from proxy.chat.sessions import PlacementRequest, commit_turns, place
from proxy.store import backend, queries
from proxy.store.models import NewTurn, Session, SessionConflict
from proxy.store.naming import create_named, free_session_id, named_session, session_names
from proxy.store.sqlite import db, migrations
from proxy.store.sqlite.db import Connection


def h8(user: str) -> str:
    return hashlib.sha256(user.encode()).hexdigest()[:8]


def _v6(path: Path, monkeypatch: pytest.MonkeyPatch) -> Connection:
    c = db.connect(path)
    with monkeypatch.context() as m:
        m.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:6])
        migrations.migrate(c)
    return c


def _old_session(c: Connection, sid: str, user: str, turns: int = 1) -> None:
    """A session as an Engram before migration 7 stored it (no name), with a turn or more."""
    c.execute("INSERT OR IGNORE INTO users(id, created_at) VALUES (?, 0)", (user,))
    c.execute(
        "INSERT INTO sessions(id, user_id, created_at, last_seen) VALUES (?, ?, 0, 0)", (sid, user)
    )
    for p in range(turns):
        c.execute(
            "INSERT INTO turns(session_id, user_id, position, role, content, timestamp,"
            " content_hash) VALUES (?, ?, ?, 'user', ?, 0, ?)",
            (sid, user, p, f"{sid} {p}", f"{sid}-{p}"),
        )


def test_migration_7_names_existing_sessions_for_their_owners(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = _v6(tmp_path / "v6.db", monkeypatch)
    try:
        _old_session(c, "project", "bob")
        _old_session(c, f"project~{h8('alice')}", "alice", turns=2)  # scoped for alice
        _old_session(c, f"other~{h8('alice')}", "mallory")  # mallory's squat: stays hers
        _old_session(c, "facts~carol", "mallory")  # squatted facts name
        _old_session(c, f"facts~carol~{h8('carol')}", "carol")  # carol's real facts session
        _old_session(c, "s-0123456789abcdef0123", "alice")
        assert migrations.migrate(c) == [v for v, _ in migrations.MIGRATIONS[6:]]
        names = {(u, sid): n for sid, u, n in c.execute("SELECT id, user_id, name FROM sessions")}
        assert names == {
            ("bob", "project"): "project",
            ("alice", f"project~{h8('alice')}"): "project",
            ("mallory", f"other~{h8('alice')}"): f"other~{h8('alice')}",
            ("mallory", "facts~carol"): "facts~carol",
            ("carol", f"facts~carol~{h8('carol')}"): "facts~carol",
            ("alice", "s-0123456789abcdef0123"): "s-0123456789abcdef0123",
        }
        # alice's client keeps sending "project": its session is found, and continued.
        c.execute("BEGIN IMMEDIATE")
        chains = [f"project~{h8('alice')}-0", f"project~{h8('alice')}-1", "new"]
        placement = place(c, PlacementRequest("alice", "project", chains, 1), 1.0)
        assert not placement.created and placement.session.id == f"project~{h8('alice')}"
        assert placement.matched == 2 and placement.next_position == 2
        row = NewTurn(position=2, role="user", content="continued", content_hash="new")
        session, inserted = commit_turns(c, placement, [row], 1.0)
        c.execute("COMMIT")
        assert session.id == f"project~{h8('alice')}" and len(inserted) == 1
        # The name is unique per user.
        with pytest.raises(Exception, match="UNIQUE"):
            c.execute(
                "INSERT INTO sessions(id, user_id, created_at, last_seen, name)"
                " VALUES ('x', 'alice', 0, 0, 'project')"
            )
    finally:
        c.close()


def test_names_are_per_user_and_ids_stay_unique(store_target: str | Path) -> None:
    c = backend.open_connection(store_target)
    backend.migrate(c)
    try:

        def new(user: str, name: str) -> Session:
            return create_named(
                c, user, name, parent_id=None, agent=None, fingerprint=None, indexed=True, now=0
            )

        bob = new("bob", "project")
        alice = new("alice", "project")
        assert bob.id == "project" and alice.name == "project" and alice.id != bob.id
        assert new("alice", "project").id == alice.id
        assert named_session(c, "alice", "project") == alice
        assert named_session(c, "mallory", "project") is None
        assert named_session(c, "bob", alice.id) is None  # an id is not a name
        # mallory naming a session after alice's id gets her own, under another id.
        squat = new("mallory", alice.id)
        assert squat.id not in (alice.id, bob.id) and squat.user_id == "mallory"
        assert free_session_id(c, "carol", "project") not in (bob.id, alice.id, squat.id)
        assert session_names(c, [alice.id, bob.id, "nope"]) == {
            alice.id: "project",
            bob.id: "project",
        }
        with pytest.raises(SessionConflict):  # an id-keyed create may not reuse a name
            queries.get_or_create_session(
                c,
                "alice",
                "fresh",
                name="project",
                parent_id=None,
                agent=None,
                fingerprint=None,
                indexed=True,
                now=0,
            )
    finally:
        c.close()
