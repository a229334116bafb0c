"""Where tool-result slots live, and how they stay usable when Redis goes away.

Engram replaces bulky tool outputs in forwarded prompts by ``[TOOL_RESULT:<id>]`` references and
keeps each output in a *slot* (:class:`proxy.slots.model.Slot`), read back by the expansion tool
and by ``GET /engram/api/slots/{id}``. A slot belongs to one user namespace: the same id under
another user is another slot, or none.

Two backends with the same semantics: :mod:`proxy.slots.redis` (``slots.redis_url`` set; one
hash per slot, every command bounded by ``slots.redis_timeout``) and :mod:`proxy.slots.embedded`
(the ``slots`` table of the SQLite file). :class:`SlotStore`, here, is what the app uses: it
chooses between them, fails over, and counts.

TTL: a slot lives ``slots.ttl_seconds`` after it was last stored or read. Redis expires keys
itself; the embedded store ignores rows past ``expires_at`` and a purge task deletes them every
``slots.purge_interval`` seconds.

Failover: Redis is used while it answers. The first failed command (or a failed ``PING`` at start)
marks it down with one warning; from then on requests do not touch Redis at all, slots go to the
embedded table, and a background task pings Redis every ``slots.redis_retry`` seconds (one info
line when it is back). :meth:`SlotStore.get` asks Redis first (when up), then the embedded table,
where slots stored during an outage live. ``put_many``, ``get`` and ``start`` never raise:
``put_many`` answers the ids it stored somewhere, and an id it leaves out was stored nowhere (the
caller forwards that output raw).

The pipeline calls ``put_many`` on every request with every slot of the prompt, so a slot
confirmed on the current backend less than ``min(ttl/10, 60 s)`` ago is not stored again. That
cache is cleared whenever the backend switches (a Redis that comes back may have lost its data) and
a slot that a ``get`` did not find leaves it.

Forgetting: ``put_many(..., session)`` records that the session used the slots (:mod:`.links`); a
session's delete takes the embedded rows only it used, then ``forget_slots`` their Redis keys.
Caps (``[limits]``, :mod:`proxy.slots.quota`): an output larger than ``max_slot_bytes``, or one
that would take its user past ``max_slots_per_user`` / ``max_slot_bytes_per_user``, is left out of
what ``put_many`` stored (so it is forwarded raw) and logged.

Counters (puts, hits, misses, errors per backend) are kept in memory and added to the ``counters``
table (names ``slots_<backend>_<kind>``) every :data:`proxy.background.stats.FLUSH_EVERY` seconds
and at :meth:`SlotStore.close`, so ``engram stats`` can show them without a server
(:func:`proxy.slots.figures.offline_stats`). A hit counts against the backend that had the slot;
a miss (unknown or expired everywhere) against the backend in use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from redis.exceptions import DataError

from proxy.background.stats import FLUSH_EVERY
from proxy.config import LimitsSettings, SlotsSettings
from proxy.logs import event
from proxy.slots.embedded import EmbeddedSlots
from proxy.slots.figures import (
    BACKENDS,
    EMBEDDED,
    KINDS,
    REDIS,
    counter_name,
    read_slot_counters,
    zero_counts,
)
from proxy.slots.links import SlotLinks
from proxy.slots.listing import list_slots
from proxy.slots.model import Slot, SlotListing
from proxy.slots.quota import SlotQuota
from proxy.slots.redis import RedisSlots, open_redis
from proxy.store.counters import add_counters
from proxy.store.slots import user_slot_sizes
from proxy.store.store import Store
from proxy.tasks import every, stop

log = logging.getLogger("engram.slots")

CONFIRM_MAX_S = 60.0
"""A slot confirmed on the current backend this recently (or ttl/10, if less) is not re-put."""
MAX_CONFIRMED = 100_000
"""Bound on the confirmed-slot cache; stale entries go first, then everything."""


def error_text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


# --- the store the app uses ---------------------------------------------------------------------


class SlotStore:
    """Redis when configured, the embedded SQLite table otherwise or while Redis is down."""

    def __init__(
        self, settings: SlotsSettings, store: Store, limits: LimitsSettings | None = None
    ) -> None:
        self.settings = settings
        self.store = store
        self.quota = SlotQuota(limits or LimitsSettings())
        self.embedded = EmbeddedSlots(store)
        self._redis: RedisSlots | None = None
        self._redis_up = False
        self._embedded_ok = True
        # (user, slot id) -> (backend, monotonic time it was stored there)
        self._confirmed: dict[tuple[str, str], tuple[str, float]] = {}
        self._counts = zero_counts()
        self._flushed = zero_counts()
        self._retry: asyncio.Task[None] | None = None
        self._loops: list[asyncio.Task[None]] = []
        self.links = SlotLinks(store, settings.ttl_seconds, self._confirm_window)

    @property
    def backend(self) -> str:
        """The backend new slots go to now: ``"redis"`` or ``"embedded"``."""
        return REDIS if self._redis is not None and self._redis_up else EMBEDDED

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the counters, connect to Redis when configured, start the purge/flush loops.

        Never raises: an unreachable Redis leaves the embedded store in use (and a retry loop).
        """
        await self._load_counters()
        if self.settings.redis_url:
            self._redis = open_redis(self.settings)
        if self._redis is not None:
            try:
                await self._redis.ping()
            except Exception as exc:
                self._redis_failed(exc)
            else:
                self._set_redis_up(True)
                event(log, logging.INFO, "tool-result slots in Redis")
        self._loops = [
            every(self.settings.purge_interval, self._purge, "purging expired slots"),
            every(FLUSH_EVERY, self.flush_counters, "saving the slot counters"),
        ]

    async def close(self) -> None:
        """Stop the loops, save the counters, disconnect from Redis. Call before the store
        closes."""
        for task in (self._retry, *self._loops):
            await stop(task)
        self._retry, self._loops = None, []
        await self.links.drain()
        try:
            await self.flush_counters()
        except Exception:
            log.exception("saving the slot counters at shutdown failed")
        redis, self._redis = self._redis, None
        self._redis_up = False
        if redis is not None:
            try:
                await redis.aclose()
            except Exception as exc:
                event(
                    log, logging.WARNING, "closing the Redis client failed", error=error_text(exc)
                )

    # -- storing and reading -----------------------------------------------------------------

    async def put_many(
        self, user: str, slots: Sequence[Slot], session: str | None = None
    ) -> set[str]:
        """Store (or refresh the TTL of) ``slots`` for ``user``; the ids now stored. An id not
        returned could be stored nowhere: its output must be forwarded raw. Never raises.
        ``session``: the session whose prompt references them (deleting it deletes them)."""
        try:
            stored = await self._put_many(user, {s.id: s for s in slots})
        except Exception:
            log.exception("storing tool-result slots failed")
            return set()
        if session is not None and stored:
            self.links.record(user, session, stored)
        return stored

    async def _put_many(self, user: str, slots: dict[str, Slot]) -> set[str]:
        now = time.monotonic()
        done = {sid for sid in slots if self._is_confirmed(user, sid, now)}
        pending = [s for sid, s in slots.items() if sid not in done]
        if pending and not self.quota.knows(user):
            await self._seed_quota(user)
        pending = self.quota.admit(user, pending)  # those past a cap go raw (logged)
        if not pending:
            return done
        backend = await self._store_somewhere(user, pending)
        if backend is None:
            return done
        self.quota.record(user, pending, self.settings.ttl_seconds)
        self._confirm(user, (s.id for s in pending), backend, now)
        return done | {s.id for s in pending}

    async def _seed_quota(self, user: str) -> None:
        """Start the user's slot ledger from the embedded table (Redis is not scanned)."""
        wall = time.time()
        try:
            rows = await self.store.read(lambda c: user_slot_sizes(c, user, wall))
        except Exception:
            log.exception("reading a user's slot sizes failed; counting from zero")
            rows = []
        self.quota.seed(user, rows)

    async def _store_somewhere(self, user: str, slots: Sequence[Slot]) -> str | None:
        """Put ``slots`` in Redis, else in the embedded table; the backend that took them."""
        ttl = self.settings.ttl_seconds
        redis = self._live_redis()
        if redis is not None:
            try:
                await redis.put(user, slots, ttl)
            except Exception as exc:
                self._redis_failed(exc)
            else:
                self._count(REDIS, "puts", len(slots))
                return REDIS
        try:
            await self.embedded.put(user, slots, ttl)
        except Exception as exc:
            self._embedded_failed(exc)
            return None
        self._embedded_works()
        self._count(EMBEDDED, "puts", len(slots))
        return EMBEDDED

    async def get(self, user: str, slot_id: str) -> Slot | None:
        """``user``'s slot, its TTL refreshed; None when unknown or expired. Never raises."""
        found = await self.lookup(user, slot_id)
        return found[0] if found is not None else None

    async def lookup(self, user: str, slot_id: str) -> tuple[Slot, str] | None:
        """Like :meth:`get`, with the backend that had the slot. Never raises."""
        try:
            found = await self._lookup(user, slot_id)
        except Exception:
            log.exception("reading a tool-result slot failed")
            return None
        if found is None:
            self._confirmed.pop((user, slot_id), None)
            self._count(self.backend, "misses")
        else:
            self._count(found[1], "hits")
            self.quota.touch(user, slot_id, self.settings.ttl_seconds)
        return found

    async def _lookup(self, user: str, slot_id: str) -> tuple[Slot, str] | None:
        ttl = self.settings.ttl_seconds
        redis = self._live_redis()
        if redis is not None:
            try:
                slot = await redis.get(user, slot_id, ttl)
            except Exception as exc:
                self._redis_failed(exc)
            else:
                if slot is not None:
                    return slot, REDIS
        try:
            slot = await self.embedded.get(user, slot_id, ttl)
        except Exception as exc:
            self._embedded_failed(exc)
            return None
        self._embedded_works()
        return (slot, EMBEDDED) if slot is not None else None

    async def list_user(self, user: str, limit: int = 200, offset: int = 0) -> SlotListing:
        """A page of ``user``'s live slots on every backend reachable, the latest used first,
        with the total and whether Redis was unreachable (:mod:`proxy.slots.listing`). Raises
        only when the embedded table cannot be read (or for a negative limit or offset)."""
        return await list_slots(
            self.embedded, self._live_redis(), self.settings, user, limit, offset
        )

    async def forget_user(self, user: str) -> int:
        """Delete ``user``'s slots everywhere it can reach; how many. Raises when the embedded
        table cannot be changed; a Redis that is down keeps the keys until they expire."""
        self._confirmed = {k: v for k, v in self._confirmed.items() if k[0] != user}
        self.quota.forget(user)
        deleted = await self.embedded.forget(user)
        redis = self._live_redis()
        if redis is not None:
            try:
                deleted += await redis.forget(user)
            except Exception as exc:
                self._redis_failed(exc)
        return deleted

    async def forget_slots(
        self, user: str, sessions: Sequence[str], slot_ids: Sequence[str]
    ) -> int | None:
        """After ``sessions`` were deleted (their embedded slots with them): delete ``slot_ids``
        from Redis too, best effort; how many it held, None when Redis is not configured or did
        not answer (a warning: those slots live until their TTL). Never raises."""
        self.links.forget(sessions)
        gone = {(user, sid) for sid in slot_ids}
        self._confirmed = {k: v for k, v in self._confirmed.items() if k not in gone}
        if self._redis is None or not slot_ids:
            return None
        try:
            return await self._redis.delete(user, slot_ids)
        except Exception as exc:
            what = "a forgotten session's tool-result slots stay in Redis until their TTL"
            event(log, logging.WARNING, what, slots=len(slot_ids), error=error_text(exc))
            return None

    async def purge(self) -> int:
        """Delete the expired rows of the embedded table; how many."""
        return await self.embedded.purge()

    # -- figures -----------------------------------------------------------------------------

    def counters(self) -> dict[str, dict[str, int]]:
        """Puts, hits, misses and errors per backend, since the database was created."""
        return {backend: dict(kinds) for backend, kinds in self._counts.items()}

    async def stats(self) -> dict[str, dict[str, Any]]:
        """Per backend: slots, bytes, and the puts/hits/misses/errors counted. The redis entry
        (only when configured) also says whether Redis is ``up``; its slots and bytes are None
        while it is down."""
        counts = self.counters()
        out: dict[str, dict[str, Any]] = {}
        if self._redis is not None:
            slots, size = await self._redis_figures()
            out[REDIS] = {"up": self._redis_up, "slots": slots, "bytes": size, **counts[REDIS]}
        try:
            slots, size = await self.embedded.figures()
        except Exception as exc:
            event(log, logging.WARNING, "counting the embedded slots failed", error=error_text(exc))
            out[EMBEDDED] = {"slots": None, "bytes": None, **counts[EMBEDDED]}
        else:
            out[EMBEDDED] = {"slots": slots, "bytes": size, **counts[EMBEDDED]}
        return out

    async def _redis_figures(self) -> tuple[int | None, int | None]:
        redis = self._live_redis()
        if redis is None:
            return None, None
        try:
            return await redis.figures()
        except Exception as exc:
            event(log, logging.WARNING, "counting the slots in Redis failed", error=error_text(exc))
            return None, None

    async def flush_counters(self) -> None:
        """Add what was counted since the last flush to the ``counters`` table."""
        now = self.counters()
        deltas = {
            counter_name(b, k): now[b][k] - self._flushed[b][k] for b in BACKENDS for k in KINDS
        }
        if any(deltas.values()):
            await self.store.write(lambda c: add_counters(c, deltas))
        self._flushed = now

    async def _load_counters(self) -> None:
        try:
            totals = await self.store.read(read_slot_counters)
        except Exception:
            log.exception("reading the slot counters failed; counting from zero")
            return
        for backend in BACKENDS:
            for kind in KINDS:
                self._counts[backend][kind] += totals[backend][kind]
                self._flushed[backend][kind] += totals[backend][kind]

    def _count(self, backend: str, kind: str, n: int = 1) -> None:
        self._counts[backend][kind] += n

    # -- the confirmed-slot cache ------------------------------------------------------------

    def _confirm_window(self) -> float:
        return min(self.settings.ttl_seconds / 10, CONFIRM_MAX_S)

    def _is_confirmed(self, user: str, slot_id: str, now: float) -> bool:
        entry = self._confirmed.get((user, slot_id))
        return (
            entry is not None
            and entry[0] == self.backend
            and now - entry[1] < self._confirm_window()
        )

    def _confirm(self, user: str, ids: Iterable[str], backend: str, now: float) -> None:
        if backend != self.backend:  # switched while storing: trust nothing
            return
        for slot_id in ids:
            self._confirmed[(user, slot_id)] = (backend, now)
        if len(self._confirmed) > MAX_CONFIRMED:
            window = self._confirm_window()
            self._confirmed = {k: v for k, v in self._confirmed.items() if now - v[1] < window}
            if len(self._confirmed) > MAX_CONFIRMED:
                self._confirmed.clear()

    # -- failover ----------------------------------------------------------------------------

    def _live_redis(self) -> RedisSlots | None:
        """The Redis backend while it counts as up; None while it is down or not configured."""
        return self._redis if self._redis_up else None

    def _set_redis_up(self, up: bool) -> None:
        if up != self._redis_up:
            self._redis_up = up
            self._confirmed.clear()

    def _redis_failed(self, exc: BaseException) -> None:
        """Count the error; the first one of an outage logs, switches, starts the retries.

        A slot Redis cannot take (text that does not encode) is not an outage: the caller just
        tries the embedded table for it."""
        self._count(REDIS, "errors")
        if isinstance(exc, UnicodeError | DataError):
            event(log, logging.DEBUG, "a slot Redis cannot take", error=error_text(exc))
            return
        if self._retry is not None and not self._retry.done():
            return  # already marked down
        self._set_redis_up(False)
        event(
            log,
            logging.WARNING,
            "Redis is unreachable; tool-result slots go to the SQLite file until it is back",
            error=error_text(exc),
            retry_every=self.settings.redis_retry,
        )
        self._retry = asyncio.create_task(self._retry_redis(), name="slots-redis-retry")

    async def _retry_redis(self) -> None:
        """Ping Redis every ``redis_retry`` seconds until it answers, then switch back."""
        while self._redis is not None:
            await asyncio.sleep(self.settings.redis_retry)
            try:
                await self._redis.ping()
            except Exception:
                continue
            self._set_redis_up(True)
            event(log, logging.INFO, "Redis is back; tool-result slots go to Redis again")
            return

    def _embedded_failed(self, exc: BaseException) -> None:
        self._count(EMBEDDED, "errors")
        if self._embedded_ok:
            self._embedded_ok = False
            event(
                log,
                logging.WARNING,
                "the embedded slot store failed; tool outputs are forwarded raw until it works",
                error=error_text(exc),
            )

    def _embedded_works(self) -> None:
        if not self._embedded_ok:
            self._embedded_ok = True
            event(log, logging.INFO, "the embedded slot store works again")

    # -- loops -------------------------------------------------------------------------------

    async def _purge(self) -> None:
        deleted = await self.purge()
        if deleted:
            event(log, logging.DEBUG, "expired slots purged", slots=deleted)
