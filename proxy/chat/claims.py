"""One request at a time extends a stored conversation at a position, decided before the reply's
headers go out, so the session a reply names (``X-Engram-Session``) is the one that stores its
turn, at any client speed and across processes sharing the database.

Two requests may continue one stored session from the same point at once: a regenerate sent
while the first still runs, a hedged retry, or conversations the user started alike (the same
first message, the same reply) that only now go different ways. Only one can take the next
position. The archive's commit used to find that out after the reply, when its headers had
named the session already, and forked the later commit away (:func:`~proxy.chat.sessions.
commit_turns`, still the backstop): the reply named a session that never held its turn.

So a request recognised by its messages (not named by the client, not new) claims its
session's next position before forwarding. The one that finds it held goes to the same
position of a session holding the same messages (a conversation started alike,
:attr:`Placement.alike`), or else is planned at once as a fork of that session there (a new
session, created by its commit, holding this request's turns from there on), and its headers
name that session. The claim is given back by the commit that stores the turn, or when the
request ends without one (the upstream rejected it, the client or the upstream went away).

Where claims live:

- One process on its database (SQLite, the default): in this process's memory. They die with
  it, so a server killed mid-request holds nothing after its restart.
- Processes sharing a database (PostgreSQL replicas, ``engram serve --workers N``): a row of
  ``leases`` (:mod:`proxy.store.leases`), ``turn:<session>:<position>``, taken in one statement
  under the database's write lock, so two processes claiming at once cannot both win, and
  given back in the commit's transaction. One write per such request. A claim lasts
  ``CLAIM_TTL_S`` without its release: a process that dies holding one makes a continuation
  of that position fork until then, and a request slower than that may meet the backstop.

Named sessions need no claim (rows are appended, whoever commits first), nor do new ones (each
planned session is its own, created with the id its reply names).
"""

from __future__ import annotations

import dataclasses
import uuid
from functools import partial

from proxy.cache import LRU
from proxy.chat.turn import Claim, Placement
from proxy.store import leases, queries
from proxy.store.models import Session
from proxy.store.sqlite.db import Connection
from proxy.store.store import Store

STORED_SESSIONS = 10_000
"""Sessions whose last claimed position this process remembers (the most recent)."""
CLAIM_TTL_S = 120.0
"""How long a shared claim holds without its release: longer than nearly any reply takes."""


def claim_name(placement: Placement) -> str | None:
    """The claim a placement must hold to store its turns where it says (None: it needs none)."""
    if placement.created or placement.explicit:
        return None
    return position_name(placement.session.id, placement.next_position)


def position_name(session_id: str, position: int) -> str:
    return f"turn:{session_id}:{position}"


def fork_of(placement: Placement, now: float) -> Placement:
    """A placement continuing a session, planned instead as a new session forked there: it
    stores this request's turns from the same position on, under an id of its own."""
    sid = "s-" + uuid.uuid4().hex[:20]
    planned = dataclasses.replace(
        placement.session, id=sid, name=sid, created_at=now, last_seen=now
    )
    return Placement(
        planned, placement.matched, False, True, placement.next_position, (), placement.by_words
    )


def _session(conn: Connection, placement: Placement, sid: str) -> Session | None:
    """The placement's session, or the one of its alike sessions that ``sid`` names."""
    return placement.session if sid == placement.session.id else queries.get_session(conn, sid)


def _take_shared(
    conn: Connection, placement: Placement, now: float
) -> tuple[Placement, Claim | None]:
    """:meth:`Claims.take` on the database: the leases, one statement each."""
    holder = uuid.uuid4().hex
    position = placement.next_position
    for sid in (placement.session.id, *placement.alike):
        name = position_name(sid, position)
        session = _session(conn, placement, sid)
        if session is None or not leases.claim(conn, name, holder, now, CLAIM_TTL_S):
            continue
        if queries.next_position(conn, sid) != position:  # stored meanwhile (after placing)
            leases.release(conn, name, holder)
            continue
        claim = Claim(name, holder, sid, position)
        return dataclasses.replace(placement, session=session, alike=()), claim
    return fork_of(placement, now), None


class Claims:
    """The positions held by requests in flight (in this process, or on the shared database)."""

    def __init__(self, store: Store, shared: bool) -> None:
        self.store = store
        self.shared = shared
        self._held: dict[str, str] = {}  # name -> holder (one process)
        # session -> the last position a claimed commit stored there (one process): a request
        # placed before that commit, claiming after it, must not take the position again.
        self._stored: LRU[str, int] = LRU(STORED_SESSIONS)

    async def take(self, placement: Placement, now: float) -> tuple[Placement, Claim | None]:
        """The placement to use and the claim it holds (None: it needs none, or it is a fork
        of its own)."""
        if claim_name(placement) is None:
            return placement, None
        if self.shared:
            return await self.store.write(lambda c: _take_shared(c, placement, now))
        holder = uuid.uuid4().hex
        position = placement.next_position
        for sid in (placement.session.id, *placement.alike):
            name = position_name(sid, position)
            taken = self._stored.get(sid)
            if name in self._held or (taken is not None and taken >= position):
                continue
            session = (
                placement.session
                if sid == placement.session.id
                else await self.store.read(partial(_session, placement=placement, sid=sid))
            )
            if session is None or name in self._held:  # forgotten, or taken meanwhile
                continue
            self._held[name] = holder
            claim = Claim(name, holder, sid, position)
            return dataclasses.replace(placement, session=session, alike=()), claim
        return fork_of(placement, now), None

    def release_in(self, conn: Connection, claim: Claim) -> None:
        """Give the position back in the caller's transaction (the commit that took it)."""
        if self.shared:
            leases.release(conn, claim.name, claim.holder)

    def released(self, claim: Claim, stored: bool = False) -> None:
        """The claim is given back (after :meth:`release_in`'s transaction committed;
        ``stored``: that commit stored the turn at the claimed position)."""
        claim.released = True
        if self.shared:
            return
        last = self._stored.get(claim.session_id)
        if stored and (last is None or last < claim.position):
            self._stored[claim.session_id] = claim.position
        if self._held.get(claim.name) == claim.holder:
            del self._held[claim.name]

    async def release(self, claim: Claim) -> None:
        """Give the position back on its own (the request ends without a commit)."""
        if claim.released:
            return
        if self.shared:
            await self.store.write(lambda c: leases.release(c, claim.name, claim.holder))
        self.released(claim)
