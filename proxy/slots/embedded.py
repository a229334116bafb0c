"""The embedded slot backend: slots in the ``slots`` table of the SQLite file.

Reached only through :meth:`Store.read` / :meth:`Store.write`, so SQLite never runs on the event
loop; the SQL is in :mod:`proxy.store.slots`. A slot lives ``ttl`` seconds after it was last
stored or read: rows past ``expires_at`` are ignored, and :meth:`EmbeddedSlots.purge` (run by
:class:`proxy.slots.store.SlotStore` every ``slots.purge_interval`` seconds) deletes them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from proxy.slots.model import DESCRIPTION_CHARS, Slot, SlotInfo
from proxy.store.forget import purge_links
from proxy.store.slots import (
    SlotRow,
    forget_slots,
    purge_slots,
    slot_figures,
    take_slot,
    upsert_slots,
    user_slot_page,
)
from proxy.store.sqlite.db import Connection
from proxy.store.store import Store


class EmbeddedSlots:
    """Slots in the SQLite file, through the store's reader threads and writer thread."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def put(self, user: str, slots: Sequence[Slot], ttl: float) -> None:
        """Store (or refresh) ``slots`` for ``user``, each for ``ttl`` seconds."""
        now = time.time()
        rows = [SlotRow(s.id, s.tool, s.content, s.tokens, s.description) for s in slots]
        await self.store.write(lambda c: upsert_slots(c, user, rows, now, ttl))

    async def get(self, user: str, slot_id: str, ttl: float) -> Slot | None:
        """The unexpired slot with its TTL reset to ``ttl``, or None."""
        now = time.time()
        row = await self.store.write(lambda c: take_slot(c, user, slot_id, now, ttl))
        if row is None:
            return None
        return Slot(
            id=row.id,
            tool=row.tool,
            content=row.content,
            tokens=row.tokens,
            description=row.description,
        )

    async def listing(
        self, user: str, ttl: float, limit: int, offset: int = 0
    ) -> tuple[list[SlotInfo], int]:
        """A page of ``user``'s unexpired slots, the latest used first (last use: expiry less
        ``ttl``), without content and without touching their TTL; and how many there are."""
        now = time.time()
        rows, total = await self.store.read(
            lambda c: user_slot_page(
                c, user, now, limit=limit, offset=offset, description_chars=DESCRIPTION_CHARS
            )
        )
        infos = [
            SlotInfo(
                id=r.id,
                tool=r.tool,
                description=r.description,
                tokens=r.tokens,
                bytes=r.bytes,
                created_at=r.created_at,
                last_used=r.expires_at - ttl,
                expires_at=r.expires_at,
                backend="embedded",
            )
            for r in rows
        ]
        return infos, total

    async def purge(self) -> int:
        """Delete the expired rows (and the session links kept past their time); how many
        slots."""
        now = time.time()

        def job(c: Connection) -> int:
            purge_links(c, now)
            return purge_slots(c, now)

        return await self.store.write(job)

    async def figures(self) -> tuple[int, int]:
        """(slots, bytes) not expired."""
        now = time.time()
        return await self.store.read(lambda c: slot_figures(c, now))

    async def forget(self, user: str) -> int:
        """Delete ``user``'s slots; how many."""
        return await self.store.write(lambda c: forget_slots(c, user))
