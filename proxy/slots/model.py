"""The :class:`Slot`: one stored tool output, as every slot module sees it (pure, no imports).

:mod:`proxy.slots.refs` makes slot ids, :mod:`proxy.slots.expand` reads slots back into
prompts, and both backends (:mod:`proxy.slots.redis`, :mod:`proxy.slots.embedded`) store them.
:class:`SlotInfo` and :class:`SlotListing` are what :mod:`proxy.slots.listing` answers about a
user's slots (no content).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

DESCRIPTION_CHARS = 200
"""A listed slot's description is cut to this many characters."""


@dataclass(frozen=True)
class Slot:
    """One stored tool output. ``id`` is deterministic (see :mod:`proxy.slots.refs`)."""

    id: str
    tool: str
    content: str
    tokens: int
    description: str


@dataclass(frozen=True)
class SlotInfo:
    """One listed slot, without its content. Times are Unix seconds: ``last_used`` is when it
    was last stored or read (its expiry less ``slots.ttl_seconds``), ``expires_at`` None for a
    Redis key without a TTL (never set so by Engram). ``backend``: ``"embedded"`` or
    ``"redis"``."""

    id: str
    tool: str
    description: str
    tokens: int
    bytes: int
    created_at: float
    last_used: float
    expires_at: float | None
    backend: str


class SlotListing(NamedTuple):
    """A page of one user's slots, the latest used first; ``total``: how many on every backend
    listed. ``redis_unreachable``: Redis is configured but was down or too slow, so only the
    embedded table's slots are in it."""

    slots: list[SlotInfo]
    total: int
    redis_unreachable: bool
