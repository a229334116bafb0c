"""Which conversation a request belongs to: placement before forwarding (nothing written), and
the commit that creates the session and stores the turn once the upstream accepted it.

Sessions are keyed by owner (:mod:`proxy.store.naming`): a client's session id is a name within
its user's namespace, looked up by (user, name) and never by the global key, so no id chosen in
another namespace can capture a turn, and two users may use the same name. Names Engram keeps
for itself (``facts~<user>``) are mapped away from what clients send (:func:`client_name`).

An explicit id (header or body) names the session. A sub-agent's session (``X-Engram-Parent``,
a name of the same user) is always a child of that parent: an explicit id naming any other
session (the parent's own, say) is not used, and the request is placed by its messages among
the parent's children. Without an explicit id the conversation is recognised by its chain of
message hashes (:mod:`proxy.messages`): a stored session whose turns are a prefix of this
request, matched through at least the first assistant reply, is continued; one whose stored
turns go on differently after the match (an edited or regenerated message) is forked: the new
session stores the turns from the point where they differ.

:func:`place` only reads: a session it finds no place for is planned (``Placement.created``), and
:func:`commit_turns` creates it in the archive's transaction, after the upstream accepted the
request, so a rejected request leaves no session behind, under the id its reply named
(``X-Engram-Session``, sent before the commit). A request continuing a stored session holds
its next position while it runs (:mod:`proxy.chat.claims`); one that finds it held is planned
as a fork there at once, so its reply names the fork. New conversations alike (the same first
request, sent at once by two clients or twice by one) are each their own session: only their
replies can tell them apart, and those come after the headers. The commit checks the placement
again, holding the conversation's lock (:mod:`proxy.store.twins`: commits of one conversation
on replicas sharing one PostgreSQL run one at a time, as SQLite's do): if a concurrent request
of the same conversation stored something else at these positions meanwhile (a claim that
expired, say), the rest forks there. All SQL is in :mod:`proxy.store`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy import said
from proxy.chat.turn import Placement
from proxy.errors import NestingLimitExceeded, ParentNotFound
from proxy.store import queries, said_match, twins
from proxy.store.models import NewTurn, Session
from proxy.store.naming import RESERVED_PREFIXES, create_named, free_session_id, named_session
from proxy.store.sqlite.db import Connection

log = logging.getLogger("engram.sessions")

MAX_ALIKE = 8
"""Most sessions holding the same longest prefix that a placement considers (conversations
started alike: the same messages, the same replies)."""


def client_name(value: str | None) -> str | None:
    """A session name as a client sent it, mapped away from the names Engram reserves (a stable
    ``h-<hash>``, as :mod:`proxy.chat.identity` makes of an unsafe id)."""
    if value is None or not value.startswith(RESERVED_PREFIXES):
        return value
    return "h-" + hashlib.sha256(value.encode()).hexdigest()[:24]


def _chain_id() -> str:
    return "s-" + uuid.uuid4().hex[:20]


def _planned(
    user: str,
    sid: str,
    name: str,
    fingerprint: str | None,
    now: float,
    parent: Session | None,
    agent: str | None,
) -> Session:
    """A session to create if the request is accepted (nothing written yet)."""
    return Session(
        id=sid,
        user_id=user,
        parent_id=parent.id if parent else None,
        level=parent.level + 1 if parent else 0,
        agent=agent,
        created_at=now,
        last_seen=now,
        fingerprint=fingerprint,
        indexed=parent is None,  # a sub-agent's raw turns stay out of everyone else's search
        name=name,
    )


def _create_chain(conn: Connection, planned: Session, now: float) -> Session:
    """Create a session placed by its hash chain (its name is its id, ``s-<random>``)."""
    sid = planned.id
    while queries.get_session(conn, sid) is not None or named_session(conn, planned.user_id, sid):
        sid = _chain_id()
    return queries.get_or_create_session(
        conn,
        planned.user_id,
        sid,
        parent_id=planned.parent_id,
        agent=planned.agent,
        fingerprint=planned.fingerprint,
        indexed=planned.indexed,
        now=now,
    )


def check_parent(conn: Connection, user: str, parent_name: str, max_depth: int) -> Session:
    """The parent session of a sub-agent request (a name of this user), or the 4xx that says
    why not."""
    name = client_name(parent_name)
    parent = named_session(conn, user, name) if name is not None else None
    if parent is None:
        raise ParentNotFound(
            f"X-Engram-Parent names session {parent_name!r}, which does not exist for this user."
        )
    if parent.level + 1 > max_depth:
        raise NestingLimitExceeded(
            f"Sub-agent sessions nest at most {max_depth} deep (sessions.max_depth = "
            f"{max_depth}); session {parent_name!r} is already at depth {parent.level}."
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
    # The messages (for a match by what was said when the chain as sent finds their history
    # nowhere: proxy.said).
    messages: Sequence[Mapping[str, Any]] = ()


def place(conn: Connection, req: PlacementRequest, now: float) -> Placement:
    """Find the session of a request, or plan a new one (``created``: made by the commit).
    Only reads."""
    user, chains, anchor = req.user, req.chains, req.anchor
    parent = check_parent(conn, user, req.parent, req.max_depth) if req.parent else None
    name = client_name(req.explicit)
    if name is not None:
        found = named_session(conn, user, name)
        if found is None:
            sid = free_session_id(conn, user, name)
            planned = _planned(user, sid, name, None, now, parent, req.agent)
            return Placement(planned, 0, True, True, 0)
        if parent is None or found.parent_id == parent.id:
            stored = set(queries.session_turn_hashes(conn, found.id))
            matched = 0
            for h in chains:  # the longest stored prefix; chain hashes make prefixes unique
                if h not in stored:
                    break
                matched += 1
            nxt = queries.next_position(conn, found.id)
            return _said_in_named(conn, req, Placement(found, matched, True, False, nxt))
        # A sub-agent naming a session that is not its own child: placed by its messages.

    prefixes = (
        queries.longest_prefixes(
            conn, user, list(chains), min_length=anchor, parent_id=parent.id if parent else None
        )
        if anchor is not None
        else None
    )
    matched = 0
    if prefixes is not None:
        best, matched, alike = prefixes
        # Those with nothing stored past the match: the same conversation, continued (several
        # when conversations started alike; the others are where a concurrent request of one
        # goes, proxy.chat.claims).
        free = [sid for sid in alike[:MAX_ALIKE] if queries.next_position(conn, sid) == matched]
        session = queries.get_session(conn, free[0]) if free else None
        if session is not None:
            return Placement(session, matched, False, False, matched, tuple(free[1:]))
        log.debug("conversation forks from %s at message %d", best, matched)
    fingerprint = chains[anchor - 1] if anchor is not None and len(chains) >= anchor else None
    by_words = _by_words(conn, req, matched, parent)
    if by_words is not None and by_words.index >= matched:
        found = queries.get_session(conn, by_words.session_id) if by_words.free else None
        if found is not None:
            nxt = queries.next_position(conn, found.id)
            return Placement(found, by_words.index + 1, False, False, nxt, by_words=True)
        sid = _chain_id()  # what was said goes on otherwise than stored: a fork there
        planned = _planned(user, sid, sid, fingerprint, now, parent, req.agent)
        return Placement(planned, by_words.index + 1, False, True, by_words.position + 1, (), True)
    sid = _chain_id()
    planned = _planned(user, sid, sid, fingerprint, now, parent, req.agent)
    return Placement(planned, matched, False, True, matched)


def _by_words(
    conn: Connection, req: PlacementRequest, matched: int, parent: Session | None
) -> said_match.SaidMatch | None:
    """Where what the request says was said before, when the chain as sent found its history
    (a reply after the first ``matched`` messages) nowhere: the session holding the longest
    prefix of it through its first reply (None: none does)."""
    if not said.unmatched_history(req.messages, matched):
        return None
    chain, _ = said.said_chain(req.messages)
    anchor = said.said_anchor(req.messages, chain)
    if anchor is None:
        return None
    parent_id = parent.id if parent else None
    return said_match.longest_said(conn, req.user, chain, anchor, parent_id)


def _said_in_named(conn: Connection, req: PlacementRequest, placement: Placement) -> Placement:
    """A request to a named session whose history the chain as sent did not find there (a reply
    after the matched messages): placed after what the session holds of what it says."""
    if not said.unmatched_history(req.messages, placement.matched):
        return placement
    chain, _ = said.said_chain(req.messages)
    index = said_match.said_in(conn, placement.session.id, chain)
    if index is None or index < placement.matched:
        return placement
    return dataclasses.replace(placement, matched=index + 1, by_words=True)


def _materialise(conn: Connection, placement: Placement, now: float) -> Session | None:
    """The session a placement planned, created now under the id its reply named (or the one
    a concurrent request created under the same client-chosen name meanwhile); None when its
    parent was deleted during the request."""
    planned = placement.session
    if planned.parent_id is not None and queries.get_session(conn, planned.parent_id) is None:
        return None
    if not placement.explicit:
        return _create_chain(conn, planned, now)
    session = create_named(
        conn,
        planned.user_id,
        planned.name,
        parent_id=planned.parent_id,
        agent=planned.agent,
        fingerprint=None,
        indexed=planned.indexed,
        now=now,
        session_id=planned.id,
    )
    if planned.parent_id is not None and session.parent_id != planned.parent_id:
        # Taken meanwhile by a session that is not this sub-agent's: it gets its own.
        return _create_chain(conn, dataclasses.replace(planned, id=_chain_id()), now)
    return session


def _conversation_key(placement: Placement) -> tuple[str, ...]:
    """What names the conversation a commit writes to, for :func:`twins.lock_conversation`: its
    user and name when the client named it (created or not), else its session (planned or
    stored)."""
    session = placement.session
    if placement.explicit:
        return ("name", session.user_id, session.name)
    return ("session", session.id)


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
    twins.lock_conversation(conn, *_conversation_key(placement))
    found = (
        _materialise(conn, placement, now)
        if placement.created
        else queries.get_session(conn, placement.session.id)
    )
    if found is None:  # forgotten while the request ran: nothing to add it to
        log.info("session %s was deleted during the request; not archived", placement.session.id)
        return placement.session, []
    session = found
    if placement.explicit:
        return session, _append(conn, session, rows, now)
    stored = queries.hashes_from(conn, session.id, min(r.position for r in rows))
    fresh: list[NewTurn] = []
    for i, row in enumerate(rows):
        held = stored.get(row.position)
        if held is None:
            fresh.append(row)
        elif held != row.identity():
            fork = _create_chain(conn, dataclasses.replace(session, id=_chain_id()), now)
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
