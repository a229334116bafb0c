"""Figures of the memory loop for ``GET /engram/api/stats`` and ``engram stats``.

Token figures (proxied, spent on summaries, spent on consolidation) are counted in the memory of
the running server (:class:`proxy.background.summarizer.Summarizer`,
:class:`proxy.background.consolidation.Consolidator`). :class:`Counters` keeps them in the
``counters`` table (:mod:`proxy.store.counters`): it adds what each server counted since its last
write (every ``FLUSH_EVERY`` seconds and at shutdown), so several servers on one database add up,
and a server starts from the totals, so the budgets hold across restarts.
``engram stats`` reads the table (up to ``FLUSH_EVERY`` seconds behind a running server).
Everything else (hand-backs, facts, feedback, the queue) is counted in the database itself
(:func:`proxy.store.counters.memory_counts`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

from proxy.config import Settings
from proxy.store.counters import (
    add_counters,
    all_counters,
    save_token_calibration,
    token_calibration,
)
from proxy.store.sqlite.db import Connection
from proxy.store.store import Store
from proxy.tokens import TokenCounter

log = logging.getLogger("engram.stats")

PROXIED, SUMMARIES, CONSOLIDATION = "tokens_proxied", "tokens_summaries", "tokens_consolidation"
COUNTER_NAMES = (PROXIED, SUMMARIES, CONSOLIDATION)
FLUSH_EVERY = 60.0


def read_counters(conn: Connection) -> dict[str, int]:
    """The stored counters, with 0 for the token counters never written."""
    return all_counters(conn, COUNTER_NAMES)


class ProxiedCounter(Protocol):
    """What :class:`proxy.background.summarizer.Summarizer` counts."""

    tokens_proxied: int
    tokens_spent: int


class SpentCounter(Protocol):
    """What :class:`proxy.background.consolidation.Consolidator` counts."""

    tokens_spent: int


class Counters:
    """The live token counters of this server, kept in step with the ``counters`` table."""

    def __init__(
        self, store: Store, summarizer: ProxiedCounter, consolidator: SpentCounter
    ) -> None:
        self.store = store
        self.summarizer = summarizer
        self.consolidator = consolidator
        self._flushed = dict.fromkeys(COUNTER_NAMES, 0)

    def current(self) -> dict[str, int]:
        return {
            PROXIED: int(self.summarizer.tokens_proxied),
            SUMMARIES: int(self.summarizer.tokens_spent),
            CONSOLIDATION: int(self.consolidator.tokens_spent),
        }

    async def load(self) -> None:
        """Start from the stored totals (call before serving)."""
        totals = await self.store.read(read_counters)
        self.summarizer.tokens_proxied += totals[PROXIED]
        self.summarizer.tokens_spent += totals[SUMMARIES]
        self.consolidator.tokens_spent += totals[CONSOLIDATION]
        self._flushed = self.current()

    async def flush(self) -> None:
        """Add what was counted since the last flush to the stored totals."""
        now = self.current()
        deltas = {k: now[k] - self._flushed[k] for k in COUNTER_NAMES}
        if any(deltas.values()):
            await self.store.write(lambda c: add_counters(c, deltas))
        self._flushed = now


CALIBRATE_EVERY = 1.0
"""Seconds between two exchanges of the learned token corrections with the database (a read
of one row; a write only when what this process learned changed)."""
TAKE_EVERY = 1.0
"""At most one read a second for requests of a model this process has not learned."""


class Calibration:
    """The token counter's per-model corrections (:meth:`proxy.tokens.TokenCounter.learn`)
    kept in the database: a worker started beside others, or a server restarted, counts a
    model's prompts (and how much of the tool definitions its template renders) as already
    learned, instead of counting every tool definition until the model's first reply, which
    leaves an agent's first request no room for memories on a small context."""

    def __init__(self, store: Store, tokens: TokenCounter) -> None:
        self.store = store
        self.tokens = tokens
        self._saved: dict[str, dict[str, float]] | None = None
        self._taken = 0.0  # when :meth:`take` last read

    async def take(self) -> None:
        """Read what others learned now (a request of a model not learned here is about to be
        budgeted; at most once a :data:`TAKE_EVERY`)."""
        now = time.monotonic()
        if now - self._taken < TAKE_EVERY:
            return
        self._taken = now
        self.tokens.adopt(await self.store.read(token_calibration))

    async def sync(self) -> None:
        """Take what others learned (for models this process has not), store what it learned."""
        self.tokens.adopt(await self.store.read(token_calibration))
        learned = self.tokens.learned()
        if learned != self._saved and any(learned.values()):
            await self.store.write(lambda c: save_token_calibration(c, learned))
        self._saved = learned


def token_figures(totals: Mapping[str, int], settings: Settings) -> dict[str, Any]:
    proxied = totals.get(PROXIED, 0)

    def share(n: int) -> float:
        return round(n / proxied, 6) if proxied else 0.0

    return {
        "proxied": proxied,
        "summaries": totals.get(SUMMARIES, 0),
        "summaries_share": share(totals.get(SUMMARIES, 0)),
        "summaries_budget_share": settings.summary.budget_share,
        "consolidation": totals.get(CONSOLIDATION, 0),
        "consolidation_share": share(totals.get(CONSOLIDATION, 0)),
        "consolidation_budget_share": settings.consolidation.budget_share,
    }
