"""Slot figures: the counters' names, and what ``engram stats`` shows without a server.

The counters (puts, hits, misses, errors per backend) live in the ``counters`` table under names
``slots_<backend>_<kind>``; :class:`proxy.slots.store.SlotStore` adds to them as it runs.
"""

from __future__ import annotations

from typing import Any

from proxy.config import SlotsSettings
from proxy.slots.embedded import EmbeddedSlots
from proxy.slots.redis import redis_figures_once
from proxy.store.counters import counter_values
from proxy.store.sqlite.db import Connection
from proxy.store.store import Store

REDIS, EMBEDDED = "redis", "embedded"
BACKENDS = (REDIS, EMBEDDED)
KINDS = ("puts", "hits", "misses", "errors")


def counter_name(backend: str, kind: str) -> str:
    """Name of a slot counter in the ``counters`` table, e.g. ``slots_redis_hits``."""
    return f"slots_{backend}_{kind}"


def zero_counts() -> dict[str, dict[str, int]]:
    return {backend: dict.fromkeys(KINDS, 0) for backend in BACKENDS}


def read_slot_counters(conn: Connection) -> dict[str, dict[str, int]]:
    """The stored slot counters, per backend (zeros for those never written)."""
    stored = counter_values(conn, [counter_name(b, k) for b in BACKENDS for k in KINDS])
    return {b: {k: stored[counter_name(b, k)] for k in KINDS} for b in BACKENDS}


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
        figures = await redis_figures_once(settings)
        out[REDIS] = {
            "up": figures is not None,
            "slots": figures[0] if figures else None,
            "bytes": figures[1] if figures else None,
            **counts[REDIS],
        }
        if figures is not None:
            out["backend"] = REDIS
    return out
