"""One user's tool-result slots, for the inspector: every backend reachable, no content.

:meth:`proxy.slots.store.SlotStore.list_user` calls :func:`list_slots`. The embedded table is
paged in SQL; Redis (when configured and counted as up) is walked with SCAN over the user's
namespace and merged in, the latest used first (then by id). A slot stored in both backends (put
in Redis, again in the SQLite file during an outage) is listed once per backend. Listing reads
only: no TTL is refreshed.

A Redis that is down, or too slow (each round trip bounded by ``slots.redis_timeout``, the whole
walk by :data:`REDIS_ROUND_TRIPS` of them), is skipped: the page holds the embedded slots and
says ``redis_unreachable``. A Redis the store already counts as down is not asked at all. Only a
failing embedded table raises.
"""

from __future__ import annotations

import asyncio
import logging

from proxy.config import SlotsSettings
from proxy.logs import event
from proxy.slots.embedded import EmbeddedSlots
from proxy.slots.model import SlotInfo, SlotListing
from proxy.slots.redis import RedisSlots

log = logging.getLogger("engram.slots")

REDIS_ROUND_TRIPS = 10
"""The whole Redis walk of one listing may take this many ``slots.redis_timeout``."""


def newest_use_first(info: SlotInfo) -> tuple[float, str, str]:
    return (-info.last_used, info.id, info.backend)


async def list_slots(
    embedded: EmbeddedSlots,
    redis: RedisSlots | None,
    settings: SlotsSettings,
    user: str,
    limit: int,
    offset: int,
) -> SlotListing:
    """A page (``limit`` from ``offset``) of ``user``'s live slots and their total. ``redis``:
    the Redis backend while it counts as up, else None (unreachable when ``slots.redis_url`` is
    set)."""
    if limit < 0 or offset < 0:
        raise ValueError("limit and offset must not be negative")
    unreachable = bool(settings.redis_url) and redis is None
    in_redis: list[SlotInfo] = []
    if redis is not None:
        budget = settings.redis_timeout * REDIS_ROUND_TRIPS
        try:
            in_redis = await asyncio.wait_for(redis.infos(user, settings.ttl_seconds), budget)
        except Exception as exc:
            what = "listing the slots in Redis failed; listing the SQLite file's only"
            event(log, logging.WARNING, what, error=str(exc) or type(exc).__name__)
            unreachable = True
    ttl = settings.ttl_seconds
    if not in_redis:
        page, total = await embedded.listing(user, ttl, limit, offset)
        return SlotListing(page, total, unreachable)
    # the merged page's embedded part is among the embedded table's first offset + limit
    head, total = await embedded.listing(user, ttl, offset + limit)
    merged = sorted([*head, *in_redis], key=newest_use_first)
    return SlotListing(merged[offset : offset + limit], total + len(in_redis), unreachable)
