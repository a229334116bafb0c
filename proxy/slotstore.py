"""Where tool-result slots live: Redis when ``slots.redis_url`` is set, else (and whenever Redis
is down) an embedded table in the SQLite file. Same TTL semantics in both.

INTERFACE SKELETON — to be implemented.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.config import SlotsSettings
from proxy.store.store import Store


@dataclass(frozen=True)
class Slot:
    """One stored tool output. ``id`` is deterministic (see :mod:`proxy.slots`)."""

    id: str
    tool: str
    content: str
    tokens: int
    description: str


class SlotStore:
    """Redis when configured, the embedded SQLite table otherwise or while Redis is down."""

    def __init__(self, settings: SlotsSettings, store: Store) -> None:
        self.settings = settings
        self.store = store

    @property
    def backend(self) -> str:
        """The backend new slots go to now: ``"redis"`` or ``"embedded"``."""
        raise NotImplementedError

    async def start(self) -> None:
        """Connect to Redis when configured (never raises), start the purge/retry loops."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def put_many(self, user: str, slots: Sequence[Slot]) -> set[str]:
        """Store (or refresh the TTL of) ``slots`` for ``user``; the ids now stored. An id not
        returned could be stored nowhere: its output must be forwarded raw. Never raises."""
        raise NotImplementedError

    async def get(self, user: str, slot_id: str) -> Slot | None:
        """``user``'s slot, its TTL refreshed; None when unknown or expired. Never raises."""
        raise NotImplementedError

    async def stats(self) -> dict[str, dict[str, Any]]:
        """Per backend: slots, bytes, and the puts/hits/misses/errors counted."""
        raise NotImplementedError
