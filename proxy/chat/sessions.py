"""Which conversation a request belongs to: placement before forwarding, and the commit's
re-check when the turn is archived.

An explicit id (header or body) names the session, scoped to its user (another user's id gets
a ``~<hash>`` suffix). Without one the conversation is recognised by its chain of message hashes
(:mod:`proxy.messages`): a stored session whose turns are a prefix of this request, matched
through at least the first assistant reply, is continued; one whose stored turns go on
differently after the match (an edited or regenerated message) is forked: the new session
stores the turns from the point where they differ. :func:`commit_turns` checks the placement
again inside the archive's transaction: if a concurrent request of the same conversation stored
something else at these positions meanwhile, the rest forks there.

Both run inside one write transaction each (``Store.write``); all SQL is in
:mod:`proxy.store.queries`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.chat.turn import Placement
from proxy.errors import NestingLimitExceeded, ParentNotFound
from proxy.store import queries
from proxy.store.db import Connection
from proxy.store.models import NewTurn, Session

log = logging.getLogger("engram.sessions")


def scoped_session_id(explicit: str, user: str, owner: str | None) -> str:
    """A client-chosen session id, kept as is unless another user already owns it."""
    if owner is None or owner == user:
        return explicit
    return f"{explicit}~{hashlib.sha256(user.encode()).hexdigest()[:8]}"


def _new_session(
    conn: Connection,
    user: str,
    sid: str,
    fingerprint: str | None,
    now: float,
    parent: Session | None = None,
    agent: str | None = None,
) -> Session:
    return queries.get_or_create_session(
        conn,
        user,
        sid,
        parent_id=parent.id if parent else None,
        agent=agent,
        fingerprint=fingerprint,
        indexed=parent is None,  # a sub-agent's raw turns stay out of everyone else's search
        now=now,
    )


def check_parent(conn: Connection, user: str, parent_id: str, max_depth: int) -> Session:
    """The parent session of a sub-agent request, or the 4xx that says why not."""
    parent = queries.get_session(conn, parent_id)
    if parent is None or parent.user_id != user:
        raise ParentNotFound(
            f"X-Engram-Parent names session {parent_id!r}, which does not exist for this user."
        )
    if parent.level + 1 > max_depth:
        raise NestingLimitExceeded(
            f"Sub-agent sessions nest at most {max_depth} deep (sessions.max_depth = "
            f"{max_depth}); session {parent_id!r} is already at depth {parent.level}."
        )
    return parent


@dataclass(frozen=True)
class PlacementRequest:
    """Who is asking, about which conversation (the inputs of :func:`place`)."""

    user: str
    explicit: str | None
    chains: Sequence[str]
    anchor: int | None
    parent: str | None = None
    agent: str | None = None
    max_depth: int = 2


def place(conn: Connection, req: PlacementRequest, create: bool, now: float) -> Placement | None:
    """Find (and with ``create``, make) the session of a request. Runs in one transaction."""
    user, chains, anchor = req.user, req.chains, req.anchor
    parent = check_parent(conn, user, req.parent, req.max_depth) if req.parent else None
    if req.explicit is not None:
        sid = req.explicit
        owner = queries.session_owner(conn, sid)
        if owner is not None and owner != user:
            sid = scoped_session_id(req.explicit, user, owner)
            owner = queries.session_owner(conn, sid)
        if owner is None:
            if not create:
                return None
            session = _new_session(conn, user, sid, None, now, parent, req.agent)
            return Placement(session, 0, True, True, 0)
        found_session = queries.get_session(conn, sid)
        assert found_session is not None
        session = found_session
        stored = set(queries.session_turn_hashes(conn, sid))
        matched = 0
        for h in chains:  # the longest stored prefix; chain hashes make prefixes unique
            if h not in stored:
                break
            matched += 1
        return Placement(session, matched, True, False, queries.next_position(conn, sid))

    found = (
        queries.resolve_session(
            conn, user, list(chains), min_length=anchor, parent_id=parent.id if parent else None
        )
        if anchor is not None
        else None
    )
    if found is not None:
        session, matched = found
        last = queries.next_position(conn, session.id) - 1
        if last < matched:  # nothing stored past the match: the same conversation, continued
            return Placement(session, matched, False, False, matched)
        if matched == len(chains) and last == matched - 1:
            return Placement(session, matched, False, False, matched)
        fork_from = session
    else:
        fork_from = None
        matched = 0
    if not create:
        return None
    fingerprint = chains[anchor - 1] if anchor is not None and len(chains) >= anchor else None
    sid = "s-" + uuid.uuid4().hex[:20]
    session = _new_session(conn, user, sid, fingerprint, now, parent, req.agent)
    if fork_from is not None:
        log.debug("conversation forked from %s at message %d", fork_from.id, matched)
    return Placement(session, matched, False, True, matched)


def commit_turns(
    conn: Connection, placement: Placement, rows: list[NewTurn], now: float
) -> tuple[Session, list[tuple[int, NewTurn]]]:
    """Store a request's rows where its placement says, checked again inside this transaction;
    returns the session they went to and the (id, row) of each row inserted.

    In a session named by the client, rows are appended after its last turn (those it holds
    already are skipped). Otherwise each row has its position: one the session holds with the
    same chain hash is already stored; one it holds with another hash means a concurrent request
    of this conversation went another way meanwhile, so this row and the rest go to a new
    session forked there (as :func:`place` forks an edited conversation).
    """
    session = queries.get_session(conn, placement.session.id)
    if session is None:  # forgotten while the request ran: nothing to add it to
        log.info("session %s was deleted during the request; not archived", placement.session.id)
        return placement.session, []
    if placement.explicit:
        return session, _append(conn, session, rows, now)
    stored = queries.hashes_from(conn, session.id, min(r.position for r in rows))
    fresh: list[NewTurn] = []
    for i, row in enumerate(rows):
        held = stored.get(row.position)
        if held is None:
            fresh.append(row)
        elif held != row.identity():
            parent = queries.get_session(conn, session.parent_id) if session.parent_id else None
            fork = _new_session(
                conn,
                session.user_id,
                "s-" + uuid.uuid4().hex[:20],
                session.fingerprint,
                now,
                parent,
                session.agent,
            )
            log.debug("concurrent requests diverged: forked %s at %d", session.id, row.position)
            inserted = _insert(conn, session, fresh, now)
            return fork, inserted + _insert(conn, fork, rows[i:], now)
    return session, _insert(conn, session, fresh, now)


def _insert(
    conn: Connection, session: Session, rows: list[NewTurn], now: float
) -> list[tuple[int, NewTurn]]:
    """Archive rows now, index them later (proxy.background.indexer): what the commit can
    afford before the client's last byte."""
    return queries.insert_turns(
        conn, session.id, session.user_id, rows, None, now, fts_pending=True
    )


def _append(
    conn: Connection, session: Session, rows: list[NewTurn], now: float
) -> list[tuple[int, NewTurn]]:
    """Append the rows the session does not hold yet, numbered after its last turn."""
    stored = set(queries.session_turn_hashes(conn, session.id))
    keep = [r for r in rows if r.identity() not in stored]
    base = queries.next_position(conn, session.id)
    fresh = [dataclasses.replace(r, position=base + n) for n, r in enumerate(keep)]
    return _insert(conn, session, fresh, now)
