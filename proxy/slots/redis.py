"""The Redis slot backend: one hash per slot, expired by Redis itself.

A slot of ``user`` is the hash at ``{redis_key_prefix}:{sha256(user)[:16]}:{id}`` (fields content,
tool, tokens, description, bytes, created), with a TTL reset to ``slots.ttl_seconds`` whenever it
is stored or read. Every command is bounded by ``slots.redis_timeout`` (socket timeouts, no
client-side retries, and ``asyncio.wait_for`` around each round trip). What to do when Redis
does not answer is :class:`proxy.slots.store.SlotStore`'s business: these methods raise.
:func:`redis_figures_once`, :func:`forget_redis_user` and :func:`forget_redis_slots` use the
configured Redis once, with a client of their own, for the command line (no server running); they
answer None when it does not.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from proxy.config import SlotsSettings
from proxy.logs import event
from proxy.slots.model import DESCRIPTION_CHARS, Slot, SlotInfo

T = TypeVar("T")

log = logging.getLogger("engram.slots")

SCAN_BATCH = 1000
INFO_FIELDS = ("tool", "tokens", "description", "bytes", "created")
"""The fields a listing reads (never ``content``)."""


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

    async def infos(self, user: str, ttl: int) -> list[SlotInfo]:
        """``user``'s slots without their content (SCAN of the user's namespace, then HMGET of
        :data:`INFO_FIELDS` and PTTL, pipelined per batch); their TTLs are not touched. Last
        use: now less (``ttl`` less the remaining TTL)."""
        namespace = user_namespace(self.prefix, user)
        found: dict[str, SlotInfo] = {}
        for batch in await self._scan(f"{glob_escape(namespace)}:*"):
            keys = [k for k in dict.fromkeys(batch) if k[len(namespace) + 1 :] not in found]
            async with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hmget(key, INFO_FIELDS)
                    pipe.pttl(key)
                replies = await self._bounded(pipe.execute(raise_on_error=False))
            now = time.time()
            for i, key in enumerate(keys):
                slot_id = key[len(namespace) + 1 :]
                info = slot_info(slot_id, replies[2 * i], replies[2 * i + 1], now, ttl)
                if info is not None:
                    found[slot_id] = info
        return list(found.values())

    async def forget(self, user: str) -> int:
        deleted = 0
        for keys in await self._scan(f"{glob_escape(user_namespace(self.prefix, user))}:*"):
            deleted += int(await self._bounded(self.client.unlink(*keys)))
        return deleted

    async def delete(self, user: str, slot_ids: Sequence[str]) -> int:
        """Delete ``user``'s slots ``slot_ids``; how many existed."""
        deleted = 0
        keys = [self.key(user, sid) for sid in slot_ids]
        for start in range(0, len(keys), SCAN_BATCH):
            deleted += int(
                await self._bounded(self.client.unlink(*keys[start : start + SCAN_BATCH]))
            )
        return deleted

    async def aclose(self) -> None:
        await self.client.aclose()


def slot_info(slot_id: str, fields: Any, pttl: Any, now: float, ttl: int) -> SlotInfo | None:
    """The listing entry of one key from its HMGET and PTTL replies; None when it is gone (expired
    since the SCAN) or is no slot hash (an error reply)."""
    if isinstance(fields, Exception) or isinstance(pttl, Exception) or pttl == -2:
        return None
    tool, tokens, description, size, created = fields
    if tool is None and size is None:
        return None
    expires_at = now + pttl / 1000 if pttl >= 0 else None
    last_used = now - (ttl - pttl / 1000) if pttl >= 0 else None
    created_at = float(created) if created else (last_used or now)
    return SlotInfo(
        id=slot_id,
        tool=tool or "",
        description=(description or "")[:DESCRIPTION_CHARS],
        tokens=int(tokens or 0),
        bytes=int(size or 0),
        created_at=created_at,
        last_used=min(last_used, now) if last_used is not None else created_at,
        expires_at=expires_at,
        backend="redis",
    )


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


async def redis_figures_once(settings: SlotsSettings) -> tuple[int, int] | None:
    """(slots, bytes) in the configured Redis, through a client of its own; None when
    unreachable (``engram stats``)."""
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
    return await _once(settings, lambda redis: redis.forget(user))


async def forget_redis_slots(
    settings: SlotsSettings, user: str, slot_ids: Sequence[str]
) -> int | None:
    """Delete ``user``'s slots ``slot_ids`` from the configured Redis; how many, None when
    unreachable (or not configured)."""
    return await _once(settings, lambda redis: redis.delete(user, slot_ids))


async def _once(settings: SlotsSettings, job: Callable[[RedisSlots], Awaitable[int]]) -> int | None:
    redis = open_redis(settings) if settings.redis_url else None
    if redis is None:
        return None
    try:
        return await job(redis)
    except Exception:
        return None
    finally:
        await redis.aclose()
