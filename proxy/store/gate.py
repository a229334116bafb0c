"""Whether the memory database answers, and how often to try again while it does not.

A PostgreSQL server can go away (restarted, failed over, the network between): memory then
degrades, the proxy does not. :class:`Gate` is the store's circuit breaker:

- a job whose connection is lost (or a connection that cannot be opened) calls :meth:`failed`:
  the gate goes *down* and logs one warning; every connection opened before that moment is
  taken as lost too (:attr:`epoch`) and reopened before its next use;
- while down, :meth:`check` refuses every job at once with :class:`StoreUnavailable` (no thread
  hop, no network wait), except one probe each time the backoff runs out (0.5 s, doubling to
  30 s): that job opens a fresh connection and runs; if it succeeds, :meth:`succeeded` brings
  the gate *up* with one line at info, and memory is back by itself;
- :class:`StoreUnavailable` says ``quiet``: the per-request handlers that log a failed memory
  stage with its traceback leave it out (:class:`proxy.logs.QuietOutages`), so an outage is one
  warning, not one traceback per request and background tick.

SQLite never trips it: a local file does not go away between two statements, and its errors
are the caller's to see.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("engram.store")

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 30.0


class StoreUnavailable(RuntimeError):
    """The memory database does not answer now (memory degrades; the request goes on)."""

    quiet = True  # logged once by the gate, not per request (proxy.logs.QuietOutages)


@dataclass(frozen=True)
class GateState:
    up: bool
    down_for_s: float  # 0.0 while up
    next_try_s: float  # seconds until the next probe; 0.0 while up
    outages: int  # times it went down
    refused: int  # jobs refused while down
    last_error: str


class Gate:
    """A circuit breaker over one database (see the module). Thread-safe."""

    def __init__(
        self,
        name: str,
        *,
        first_delay: float = FIRST_DELAY_S,
        max_delay: float = MAX_DELAY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name  # what the log lines call the database ("PostgreSQL at …")
        self._first = first_delay
        self._max = max_delay
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._next_try = 0.0
        self._delay = first_delay
        self._probe_out = False  # a probe went through since the last failure
        self.epoch = 0  # bumped when it goes down: connections of an older epoch are stale
        self.outages = 0
        self.refused = 0
        self.last_error = ""

    @property
    def up(self) -> bool:
        return self._down_since is None

    def check(self) -> None:
        """Let a job through, or raise :class:`StoreUnavailable` while down (one probe goes
        through each time the backoff runs out)."""
        if self.up:  # the common case, without the lock
            return
        with self._lock:  # up again meanwhile: _next_try is 0, so it goes through
            now = self._clock()
            if now >= self._next_try:  # this job is the probe; the next waits a full delay
                self._next_try = now + self._delay
                self._probe_out = True
                return
            self.refused += 1
        raise StoreUnavailable(f"{self.name} is unavailable: {self.last_error}")

    def failed(self, error: BaseException | str) -> None:
        """A connection was lost or could not be opened."""
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        with self._lock:
            now = self._clock()
            self.last_error = text
            if self._down_since is None:
                self._down_since = now
                self._delay = self._first
                self.epoch += 1
                self.outages += 1
                self._next_try = now + self._delay
                went_down = True
            else:
                # Jobs already under way when it went down fail too, all at once: only a
                # failed probe doubles the delay, or one outage would jump straight to the cap.
                if self._probe_out:
                    self._delay = min(self._delay * 2, self._max)
                    self._next_try = now + self._delay
                went_down = False
            self._probe_out = False
        if went_down:
            log.warning(
                "%s is unavailable (%s): memory is off until it answers; "
                "requests are forwarded unchanged, retrying with backoff",
                self.name,
                text,
            )

    def succeeded(self, epoch: int | None = None) -> None:
        """A job ran on a live connection, opened in ``epoch``: one opened before the gate
        last went down (a job under way then, that ended well just after) says nothing of the
        server now, so it does not bring the gate up."""
        if self.up:
            return
        with self._lock:
            since = self._down_since
            if since is None or (epoch is not None and epoch < self.epoch):
                return
            down_for = self._clock() - since
            self._down_since = None
            self._delay = self._first
            self._next_try = 0.0
            self._probe_out = False
        log.info("%s answers again after %.1f s: memory is back", self.name, down_for)

    def state(self) -> GateState:
        with self._lock:
            now = self._clock()
            down = self._down_since
            return GateState(
                up=down is None,
                down_for_s=0.0 if down is None else round(now - down, 1),
                next_try_s=0.0 if down is None else round(max(0.0, self._next_try - now), 1),
                outages=self.outages,
                refused=self.refused,
                last_error=self.last_error,
            )
