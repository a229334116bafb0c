"""The slot caps of ``[limits]``: the largest output kept in a slot (``max_slot_bytes``) and what
one user's live slots may add up to (``max_slots_per_user``, ``max_slot_bytes_per_user``).

An output past a cap is not slotted: :class:`proxy.slots.store.SlotStore` leaves it out of what
it stored, so it is forwarded raw, and the cap is logged once per user per
:data:`proxy.limits.LOG_EVERY` seconds. A user's live slots are a ledger kept here: every slot
stored (or read, which refreshes its TTL) with its size and expiry; the embedded backend's rows
seed a user's ledger the first time the user is seen, so a restart does not reset it (slots kept
in Redis before a restart are not counted: they expire within ``slots.ttl_seconds``). The ledger
holds one small entry per live slot, a few percent of the slots' own size.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from proxy.cache import LRU
from proxy.config import LimitsSettings
from proxy.limits import Throttle
from proxy.logs import event
from proxy.slots.model import Slot

log = logging.getLogger("engram.limits")

USERS = 100_000  # users whose ledgers are kept (the least recent go first)


def slot_bytes(slot: Slot) -> int:
    return len(slot.content.encode("utf-8", "surrogatepass"))


class SlotQuota:
    """Which slots a user may still store, and what their live slots add up to."""

    def __init__(self, limits: LimitsSettings, clock: Callable[[], float] = time.time) -> None:
        self.max_slot_bytes = limits.max_slot_bytes
        self.max_slots = limits.max_slots_per_user
        self.max_bytes = limits.max_slot_bytes_per_user
        self.clock = clock
        self.refused: Counter[str] = Counter()  # outputs forwarded raw, by cap
        # user -> slot id -> (bytes, expires at, wall-clock seconds)
        self._ledgers: LRU[str, dict[str, tuple[int, float]]] = LRU(USERS)
        self._throttle = Throttle()

    @property
    def per_user(self) -> bool:
        """Whether a per-user cap is set (then ledgers are kept)."""
        return bool(self.max_slots or self.max_bytes)

    def knows(self, user: str) -> bool:
        return not self.per_user or user in self._ledgers

    def seed(self, user: str, rows: Iterable[tuple[str, int, float]]) -> None:
        """Start ``user``'s ledger from the backend's (id, bytes, expires at)."""
        if self.per_user and user not in self._ledgers:
            self._ledgers[user] = {sid: (size, expires) for sid, size, expires in rows}

    def admit(self, user: str, slots: Sequence[Slot]) -> list[Slot]:
        """The slots ``user`` may store now, in order; the others are logged (forward them
        raw). A slot the user holds already is always admitted (storing it refreshes it)."""
        ledger = self._live(user)
        count = len(ledger)
        size = sum(b for b, _ in ledger.values())
        out: list[Slot] = []
        for slot in slots:
            n = slot_bytes(slot)
            if n > self.max_slot_bytes:
                self._refuse(user, "max_slot_bytes", slot, n)
            elif slot.id in ledger:
                out.append(slot)
            elif self.max_slots and count + 1 > self.max_slots:
                self._refuse(user, "max_slots_per_user", slot, n)
            elif self.max_bytes and size + n > self.max_bytes:
                self._refuse(user, "max_slot_bytes_per_user", slot, n)
            else:
                count += 1
                size += n
                out.append(slot)
        return out

    def record(self, user: str, slots: Sequence[Slot], ttl: float) -> None:
        """``slots`` were stored for ``user`` and live ``ttl`` seconds from now."""
        if not self.per_user:
            return
        ledger = self._ledgers.get(user)
        if ledger is None:
            ledger = self._ledgers[user] = {}
        expires = self.clock() + ttl
        for slot in slots:
            ledger[slot.id] = (slot_bytes(slot), expires)

    def touch(self, user: str, slot_id: str, ttl: float) -> None:
        """A read refreshed the slot's TTL."""
        ledger = self._ledgers.get(user) if self.per_user else None
        if ledger is not None and slot_id in ledger:
            ledger[slot_id] = (ledger[slot_id][0], self.clock() + ttl)

    def forget(self, user: str) -> None:
        self._ledgers.pop(user)

    def figures(self, user: str) -> tuple[int, int]:
        """(live slots, bytes) of ``user`` as the ledger has them."""
        ledger = self._live(user)
        return len(ledger), sum(b for b, _ in ledger.values())

    def _live(self, user: str) -> dict[str, tuple[int, float]]:
        ledger = self._ledgers.get(user) if self.per_user else None
        if ledger is None:
            return {}
        now = self.clock()
        expired = [sid for sid, (_, expires) in ledger.items() if expires <= now]
        for sid in expired:
            del ledger[sid]
        return ledger

    def _refuse(self, user: str, cap: str, slot: Slot, size: int) -> None:
        self.refused[cap] += 1
        if self._throttle.due(cap, user):
            event(
                log,
                logging.WARNING,
                f"tool output over limits.{cap}: forwarded raw, not slotted",
                user=user,
                slot=slot.id,
                bytes=size,
            )
