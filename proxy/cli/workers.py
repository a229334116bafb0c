"""``engram serve --workers N``: N processes serving one port, and the supervisor that runs them.

One Engram process is bound by Python's GIL to about one core. With ``server.workers = N`` the
command becomes a supervisor: it starts N copies of itself (``engram serve … --workers 1``, with
:data:`WORKER_ENV` set to the worker's number), each binding the same address with
``SO_REUSEPORT`` so the kernel spreads new connections over them. They share the database
(SQLite's WAL: many readers, one writer at a time) and keep their search caches in step
through its ``changes`` log (:mod:`proxy.store.changes`); background jobs take a lease per
item (:mod:`proxy.store.leases`); the memory block's tag secret is the database's, so a
conversation's prompts stay byte-identical whichever worker serves it.

The supervisor forwards SIGTERM and SIGINT to the workers and waits for them (each finishes
its requests as one process would); a worker that dies later is started again after
:data:`RESTART_DELAY_S`; one that exits with an error status in its first :data:`STARTUP_S`
seconds (a bad config, a busy port; not one killed by a signal) stops them all, and its exit
status is the command's. The bundled tiny model is
not started under workers (each would start its own): name an upstream.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

from proxy.config import Settings

log = logging.getLogger("engram.workers")

WORKER_ENV = "ENGRAM_WORKER"
"""Set in a worker's environment: its number, 1 to N."""
STARTUP_S = 15.0
RESTART_DELAY_S = 1.0
POLL_S = 0.2


def worker_number() -> int | None:
    """This process's worker number, or None when it is not a supervised worker."""
    value = os.environ.get(WORKER_ENV, "")
    return int(value) if value.isdigit() else None


def refusal(settings: Settings) -> str | None:
    """Why ``workers > 1`` cannot run as configured (None: it can)."""
    if settings.server.port == 0:
        return "server.workers > 1 needs a fixed port (server.port = 0 picks one per process)"
    if not hasattr(socket, "SO_REUSEPORT"):
        return "server.workers > 1 needs SO_REUSEPORT, which this system lacks (Linux, BSD)"
    return None


def worker_command(argv: Sequence[str]) -> list[str]:
    """The command line of one worker: this one, as one process."""
    return [sys.executable, "-m", "proxy", *argv, "--workers", "1"]


class Supervisor:
    """Runs and watches the workers (see the module docstring)."""

    def __init__(self, settings: Settings, argv: Sequence[str]) -> None:
        self.count = settings.server.workers
        self.grace = settings.server.shutdown_timeout + 10.0
        self.command = worker_command(argv)
        self.env = {**os.environ, "ENGRAM_UPSTREAM_BUNDLED": "false"}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.started: dict[int, float] = {}
        self.stopping = False
        self.restarts = 0

    def _start(self, number: int) -> None:
        env = {**self.env, WORKER_ENV: str(number)}
        self.procs[number] = subprocess.Popen(self.command, env=env)
        self.started[number] = time.monotonic()

    def _signal(self, signum: int, _frame: FrameType | None) -> None:
        if not self.stopping:
            log.info("stopping %d workers (signal %d)", len(self.procs), signum)
        self.stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._signal)
        signal.signal(signal.SIGINT, self._signal)
        for number in range(1, self.count + 1):
            self._start(number)
        log.info("engram: %d workers started (pids %s)", self.count,
                 ", ".join(str(p.pid) for p in self.procs.values()))  # fmt: skip
        status = 0
        stopped_at: float | None = None
        while True:
            time.sleep(POLL_S)
            if self.stopping and stopped_at is None:
                stopped_at = time.monotonic()
            alive = 0
            for number, proc in list(self.procs.items()):
                rc = proc.poll()
                if rc is None:
                    alive += 1
                    continue
                if self.stopping:
                    continue
                if time.monotonic() - self.started[number] < STARTUP_S and rc > 0:
                    log.error("worker %d failed to start (exit %d): stopping", number, rc)
                    status = rc
                    self._signal(signal.SIGTERM, None)
                    continue
                log.warning("worker %d exited (status %d); starting it again", number, rc)
                time.sleep(RESTART_DELAY_S)
                self.restarts += 1
                self._start(number)
                alive += 1
            if self.stopping and alive == 0:
                return status
            if stopped_at is not None and time.monotonic() - stopped_at > self.grace:
                for proc in self.procs.values():
                    if proc.poll() is None:
                        proc.kill()
                return status or 1
