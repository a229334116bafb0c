"""Where tool-result slots live, and how they stay usable when Redis goes away.

Engram replaces bulky tool outputs in forwarded prompts by ``[TOOL_RESULT:<id>]`` references and
keeps each output in a *slot*, read back by the expansion tool and by
``GET /engram/api/slots/{id}``. A slot belongs to one user namespace: the same id under another
user is another slot, or none.

Two backends with the same semantics:

- **redis** (``slots.redis_url`` set): one hash per slot at
  ``{redis_key_prefix}:{sha256(user)[:16]}:{id}`` (fields content, tool, tokens, description,
  bytes, created). Every command is bounded by ``slots.redis_timeout`` (socket timeouts, no
  client-side retries, and ``asyncio.wait_for`` around each round trip).
- **embedded**: the ``slots`` table of the SQLite file (migration 5), reached only through
  :meth:`Store.read` / :meth:`Store.write`, so SQLite never runs on the event loop. Forgetting a
  user deletes their rows (trigger ``users_ad_slots``).

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

Counters (puts, hits, misses, errors per backend) are kept in memory and added to the ``counters``
table (names ``slots_<backend>_<kind>``) every :data:`proxy.background.stats.FLUSH_EVERY` seconds
and at
:meth:`SlotStore.close`, so ``engram stats`` can show them without a server. A hit counts against
the backend that had the slot; a miss (unknown or expired everywhere) against the backend in use.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import DataError

from proxy.background.stats import FLUSH_EVERY
from proxy.config import SlotsSettings
from proxy.logs import event
from proxy.store.counters import add_counters, counter_values
from proxy.store.db import Connection
from proxy.store.store import Store
from proxy.tasks import every, stop

T = TypeVar("T")

log = logging.getLogger("engram.slots")

REDIS, EMBEDDED = "redis", "embedded"
BACKENDS = (REDIS, EMBEDDED)
KINDS = ("puts", "hits", "misses", "errors")
CONFIRM_MAX_S = 60.0
"""A slot confirmed on the current backend this recently (or ttl/10, if less) is not re-put."""
MAX_CONFIRMED = 100_000
"""Bound on the confirmed-slot cache; stale entries go first, then everything."""
SCAN_BATCH = 1000


@dataclass(frozen=True)
class Slot:
    """One stored tool output. ``id`` is deterministic (see :mod:`proxy.slots.refs`)."""

    id: str
    tool: str
    content: str
    tokens: int
    description: str


def counter_name(backend: str, kind: str) -> str:
    """Name of a slot counter in the ``counters`` table, e.g. ``slots_redis_hits``."""
    return f"slots_{backend}_{kind}"


def zero_counts() -> dict[str, dict[str, int]]:
    return {backend: dict.fromkeys(KINDS, 0) for backend in BACKENDS}


def read_slot_counters(conn: Connection) -> dict[str, dict[str, int]]:
    """The stored slot counters, per backend (zeros for those never written)."""
    stored = counter_values(conn, [counter_name(b, k) for b in BACKENDS for k in KINDS])
    return {b: {k: stored[counter_name(b, k)] for k in KINDS} for b in BACKENDS}


# --- the embedded backend: the slots table ------------------------------------------------------


def _upsert(conn: Connection, user: str, slots: Sequence[Slot], now: float, ttl: float) -> None:
    conn.executemany(
        "INSERT INTO slots(user_id, id, tool, description, content, tokens, bytes, created_at,"
        " expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT(user_id, id) DO UPDATE SET tool = excluded.tool,"
        " description = excluded.description, content = excluded.content,"
        " tokens = excluded.tokens, bytes = excluded.bytes, expires_at = excluded.expires_at,"
        " created_at = iif(slots.expires_at <= excluded.created_at, excluded.created_at,"
        " slots.created_at)",
        [
            (
                user,
                s.id,
                s.tool,
                s.description,
                s.content,
                s.tokens,
                len(s.content.encode("utf-8", "surrogatepass")),
                now,
                now + ttl,
            )
            for s in slots
        ],
    )


def _take(conn: Connection, user: str, slot_id: str, now: float, ttl: float) -> Slot | None:
    """The unexpired slot with its expiry pushed to ``now + ttl``, or None."""
    row = conn.execute(
        "UPDATE slots SET expires_at = ? WHERE user_id = ? AND id = ? AND expires_at > ?"
        " RETURNING id, tool, content, tokens, description",
        (now + ttl, user, slot_id, now),
    ).fetchone()
    if row is None:
        return None
    return Slot(id=row[0], tool=row[1], content=row[2], tokens=int(row[3]), description=row[4])


def _purge(conn: Connection, now: float) -> int:
    return conn.execute("DELETE FROM slots WHERE expires_at <= ?", (now,)).rowcount


def _figures(conn: Connection, now: float) -> tuple[int, int]:
    row = conn.execute(
        "SELECT count(*), coalesce(sum(bytes), 0) FROM slots WHERE expires_at > ?", (now,)
    ).fetchone()
    return int(row[0]), int(row[1])


def _forget(conn: Connection, user: str) -> int:
    return conn.execute("DELETE FROM slots WHERE user_id = ?", (user,)).rowcount


class EmbeddedSlots:
    """Slots in the SQLite file, through the store's reader threads and writer thread."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def put(self, user: str, slots: Sequence[Slot], ttl: float) -> None:
        now = time.time()
        await self.store.write(lambda c: _upsert(c, user, slots, now, ttl))

    async def get(self, user: str, slot_id: str, ttl: float) -> Slot | None:
        now = time.time()
        return await self.store.write(lambda c: _take(c, user, slot_id, now, ttl))

    async def purge(self) -> int:
        now = time.time()
        return await self.store.write(lambda c: _purge(c, now))

    async def figures(self) -> tuple[int, int]:
        """(slots, bytes) not expired."""
        now = time.time()
        return await self.store.read(lambda c: _figures(c, now))

    async def forget(self, user: str) -> int:
        return await self.store.write(lambda c: _forget(c, user))


# --- the Redis backend --------------------------------------------------------------------------


def user_namespace(prefix: str, user: str) -> str:
    """The key prefix of one user's slots: ``{prefix}:{sha256(user)[:16]}``."""
    return f"{prefix}:{hashlib.sha256(user.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"


def glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis ``MATCH`` pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class RedisSlots:
    """Slots as Redis hashes with a TTL; every round trip bounded by ``timeout`` seconds."""

    def __init__(self, url: str, prefix: str, timeout: float) -> None:
        self.prefix = prefix
        self.timeout = timeout
        self.client: Redis = Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )

    def key(self, user: str, slot_id: str) -> str:
        return f"{user_namespace(self.prefix, user)}:{slot_id}"

    async def _bounded(self, aw: Awaitable[T]) -> T:
        return await asyncio.wait_for(aw, self.timeout)

    async def ping(self) -> None:
        await self._bounded(self.client.ping())

    async def put(self, user: str, slots: Sequence[Slot], ttl: int) -> None:
        now = time.time()
        async with self.client.pipeline(transaction=True) as pipe:
            for s in slots:
                key = self.key(user, s.id)
                pipe.hset(
                    key,
                    mapping={
                        "content": s.content,
                        "tool": s.tool,
                        "tokens": s.tokens,
                        "description": s.description,
                        "bytes": len(s.content.encode("utf-8", "surrogatepass")),
                    },
                )
                pipe.hsetnx(key, "created", now)
                pipe.expire(key, ttl)
            await self._bounded(pipe.execute())

    async def get(self, user: str, slot_id: str, ttl: int) -> Slot | None:
        """The slot with its TTL reset to ``ttl``, or None."""
        key = self.key(user, slot_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hgetall(key)
            pipe.expire(key, ttl)
            fields, _ = await self._bounded(pipe.execute())
        if not fields or "content" not in fields:
            return None
        return Slot(
            id=slot_id,
            tool=fields.get("tool", ""),
            content=fields["content"],
            tokens=int(fields.get("tokens") or 0),
            description=fields.get("description", ""),
        )

    async def _scan(self, pattern: str) -> list[list[str]]:
        """Batches of the keys matching ``pattern``."""
        batches: list[list[str]] = []
        cursor = 0
        while True:
            cursor, keys = await self._bounded(
                self.client.scan(cursor, match=pattern, count=SCAN_BATCH)
            )
            if keys:
                batches.append([k if isinstance(k, str) else k.decode() for k in keys])
            if cursor == 0:
                return batches

    async def figures(self) -> tuple[int, int]:
        """(slots, bytes) of every user's slots."""
        slots = size = 0
        for keys in await self._scan(f"{glob_escape(self.prefix)}:*"):
            async with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hget(key, "bytes")
                values = await self._bounded(pipe.execute())
            for value in values:
                if value is not None:  # not expired since the SCAN
                    slots += 1
                    size += int(value)
        return slots, size

    async def forget(self, user: str) -> int:
        deleted = 0
        for keys in await self._scan(f"{glob_escape(user_namespace(self.prefix, user))}:*"):
            deleted += int(await self._bounded(self.client.unlink(*keys)))
        return deleted

    async def aclose(self) -> None:
        await self.client.aclose()


def open_redis(settings: SlotsSettings) -> RedisSlots | None:
    """The Redis backend of ``settings``; None (with an error logged) for an unusable URL."""
    try:
        return RedisSlots(settings.redis_url, settings.redis_key_prefix, settings.redis_timeout)
    except Exception as exc:
        event(
            log,
            logging.ERROR,
            "slots.redis_url is not a usable Redis URL; tool-result slots stay in the SQLite file",
            error=str(exc),
        )
        return None


def describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


# --- the store the app uses ---------------------------------------------------------------------


class SlotStore:
    """Redis when configured, the embedded SQLite table otherwise or while Redis is down."""

    def __init__(self, settings: SlotsSettings, store: Store) -> None:
        self.settings = settings
        self.store = store
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
                event(log, logging.WARNING, "closing the Redis client failed", error=describe(exc))

    # -- storing and reading -----------------------------------------------------------------

    async def put_many(self, user: str, slots: Sequence[Slot]) -> set[str]:
        """Store (or refresh the TTL of) ``slots`` for ``user``; the ids now stored. An id not
        returned could be stored nowhere: its output must be forwarded raw. Never raises."""
        try:
            return await self._put_many(user, {s.id: s for s in slots})
        except Exception:
            log.exception("storing tool-result slots failed")
            return set()

    async def _put_many(self, user: str, slots: dict[str, Slot]) -> set[str]:
        now = time.monotonic()
        done = {sid for sid in slots if self._is_confirmed(user, sid, now)}
        pending = [s for sid, s in slots.items() if sid not in done]
        if not pending:
            return done
        backend = await self._store_somewhere(user, pending)
        if backend is None:
            return done
        self._confirm(user, (s.id for s in pending), backend, now)
        return done | {s.id for s in pending}

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

    async def forget_user(self, user: str) -> int:
        """Delete ``user``'s slots everywhere it can reach; how many. Raises when the embedded
        table cannot be changed; a Redis that is down keeps the keys until they expire."""
        self._confirmed = {k: v for k, v in self._confirmed.items() if k[0] != user}
        deleted = await self.embedded.forget(user)
        redis = self._live_redis()
        if redis is not None:
            try:
                deleted += await redis.forget(user)
            except Exception as exc:
                self._redis_failed(exc)
        return deleted

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
            event(log, logging.WARNING, "counting the embedded slots failed", error=describe(exc))
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
            event(log, logging.WARNING, "counting the slots in Redis failed", error=describe(exc))
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
            event(log, logging.DEBUG, "a slot Redis cannot take", error=describe(exc))
            return
        if self._retry is not None and not self._retry.done():
            return  # already marked down
        self._set_redis_up(False)
        event(
            log,
            logging.WARNING,
            "Redis is unreachable; tool-result slots go to the SQLite file until it is back",
            error=describe(exc),
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
                error=describe(exc),
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


# --- figures without a server (engram stats) ----------------------------------------------------


async def offline_stats(settings: SlotsSettings, store: Store) -> dict[str, Any]:
    """What ``engram stats`` shows: the backend a server would use now and, per backend, slots,
    bytes and the stored counters. Redis (when configured) is asked directly; ``"up": False``
    and None figures when it does not answer."""
    counts = await store.read(read_slot_counters)
    slots, size = await EmbeddedSlots(store).figures()
    out: dict[str, Any] = {
        "backend": EMBEDDED,
        EMBEDDED: {"slots": slots, "bytes": size, **counts[EMBEDDED]},
    }
    if settings.redis_url:
        figures = await _redis_figures_once(settings)
        out[REDIS] = {
            "up": figures is not None,
            "slots": figures[0] if figures else None,
            "bytes": figures[1] if figures else None,
            **counts[REDIS],
        }
        if figures is not None:
            out["backend"] = REDIS
    return out


async def _redis_figures_once(settings: SlotsSettings) -> tuple[int, int] | None:
    redis = open_redis(settings)
    if redis is None:
        return None
    try:
        return await redis.figures()
    except Exception:
        return None
    finally:
        await redis.aclose()


async def forget_redis_user(settings: SlotsSettings, user: str) -> int | None:
    """Delete ``user``'s slots from the configured Redis; how many, None when unreachable."""
    redis = open_redis(settings) if settings.redis_url else None
    if redis is None:
        return None
    try:
        return await redis.forget(user)
    except Exception:
        return None
    finally:
        await redis.aclose()
