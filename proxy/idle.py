"""Whether the model server is busy with the user's requests: Engram's own calls wait for a pause.

A model server keeps the last prompt of each slot in its KV cache and computes only what follows
the longest prefix a new request shares with it. With one slot (llama-server ``--parallel 1``)
Engram's own calls to the model — rolling summaries, sub-agent hand-backs, consolidation — are
other prompts on that slot: sent while a conversation goes on, the user's next turn waits behind
their generation, and on a llama-server that keeps no copy of the slot in host memory (built
before its ``--cache-ram`` prompt cache, or started with ``--cache-ram 0``) it then recomputes
its whole prompt. Nothing in the request body keeps the slot: ``cache_prompt: false`` and
``id_slot`` on Engram's request leave the user's next turn recomputing just the same, so Engram
sends neither (measured, ``bench/own_calls.py``; BENCHMARKS.md has the figures). Waiting is the
answer that works on every upstream, Ollama included.

So those calls wait, on :meth:`UpstreamActivity.wait_idle`, until no request that uses a slot is
in flight through this process and none has ended within ``upstream.own_calls_idle`` seconds
(an agent loop sends its next turn the instant a reply ends; a person reads and types for
longer), and at most ``upstream.own_calls_max_wait`` seconds: a server that is never idle still
gets its summaries, at the price of the eviction. They go one at a time (:meth:`own_call`), each
looking again once the one before it is done, so a user who comes back meanwhile waits for one
of them at most. Waiting is asyncio; nothing blocks the loop.

The decision is a pure function of the clock (:meth:`UpstreamActivity.decide`), so it is tested
with a clock of the test's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Literal

from proxy.logs import event

log = logging.getLogger("engram.idle")

Verdict = Literal["idle", "forced", "wait"]


class UpstreamActivity:
    """The requests in flight to the upstream through this process and when the last one ended;
    created once per process (:mod:`proxy.services`), counted by the chat pipeline and the
    pass-through, waited on by Engram's own upstream calls."""

    def __init__(
        self, idle: float, max_wait: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.idle = idle  # seconds without a request before the upstream counts as idle
        self.max_wait = max_wait  # the longest one own call waits for that
        self.clock = clock
        self.in_flight = 0
        self.last_end = -math.inf  # clock time at which the last request ended
        self._changed = asyncio.Event()  # set (and replaced) whenever a request starts or ends
        self._one_at_a_time = asyncio.Lock()  # Engram's own calls, one after the other
        # For /engram/metrics:
        self.waiting = 0  # own calls waiting now
        self.delayed = 0  # own calls that waited before they ran
        self.forced = 0  # own calls that ran at the ceiling, the upstream still busy

    # -- the requests --------------------------------------------------------------------------

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Counts one client request to the upstream from its start to the end of its reply,
        however it ends (the reply relayed, an error, the client gone)."""
        self.in_flight += 1
        self._wake()
        try:
            yield
        finally:
            self.in_flight -= 1
            self.last_end = self.clock()
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- the decision --------------------------------------------------------------------------

    def quiet_in(self, now: float) -> float | None:
        """Seconds until the upstream counts as idle: 0.0 when it does now; None while a request
        is in flight (when it ends is not known)."""
        if self.in_flight > 0:
            return None
        return max(0.0, self.last_end + self.idle - now)

    def decide(self, now: float, since: float) -> tuple[Verdict, float]:
        """What an own call that began waiting at ``since`` does at ``now``: ``("idle", 0)`` go,
        the upstream is idle; ``("forced", 0)`` go, it has waited ``max_wait``; ``("wait", s)``
        look again within ``s`` seconds (or when a request starts or ends)."""
        quiet = self.quiet_in(now)
        if quiet == 0.0:
            return "idle", 0.0
        left = since + self.max_wait - now
        if left <= 0:
            return "forced", 0.0
        return "wait", left if quiet is None else min(quiet, left)

    # -- waiting -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def own_call(self, what: str = "background call") -> AsyncIterator[bool]:
        """Around one of Engram's own calls to the upstream: entered when no other is under
        way and the upstream is idle (True) or this call has waited ``max_wait`` seconds in all
        (False)."""
        since = self.clock()
        async with self._one_at_a_time:
            yield await self.wait_idle(what, since)

    async def wait_idle(self, what: str = "background call", since: float | None = None) -> bool:
        """Return when the upstream is idle (True), or when this call has waited ``max_wait``
        seconds since ``since`` (default: now) (False: it goes anyway, and may evict the
        user's cached prompt)."""
        since = self.clock() if since is None else since
        waited = False
        self.waiting += 1
        try:
            while True:
                changed = self._changed  # taken before deciding: a change after it wakes us
                verdict, pause = self.decide(self.clock(), since)
                if verdict != "wait":
                    break
                waited = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), pause)
        finally:
            self.waiting -= 1
        self.delayed += waited
        if verdict == "forced":
            self.forced += 1
            event(
                log,
                logging.INFO,
                "the upstream was not idle within upstream.own_calls_max_wait; Engram's own "
                "call goes anyway",
                what=what,
                waited_s=round(self.clock() - since, 1),
                in_flight=self.in_flight,
            )
        return verdict == "idle"
