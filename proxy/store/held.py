"""The store's connections: one per thread (the writer, each reader, the loader), opened when
first needed, and again after the server went away.

:meth:`Connections.run` runs a job on the calling thread's connection. On PostgreSQL a job whose
connection turns out lost (``psycopg``'s ``broken``: the server restarted, a failover, the
network) is handled here rather than by every caller:

- if the connection had not run a statement in this job and was not just opened, the job runs
  once more on a fresh one: nothing of it reached the server (a server restarted between two
  requests costs no request anything);
- otherwise, or if no connection can be opened, the :class:`~proxy.store.gate.Gate` goes down
  and the job raises :class:`~proxy.store.gate.StoreUnavailable`.

A connection opened before the gate last went down is closed and reopened before its next use
(it is most likely dead too). SQLite's connections are opened once and never taken as lost.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from proxy.store import backend
from proxy.store.gate import Gate, StoreUnavailable
from proxy.store.sqlite.db import Connection

T = TypeVar("T")


def _lost(conn: Any) -> bool:
    raw = getattr(conn, "raw", None)
    return raw is not None and bool(getattr(raw, "broken", False) or raw.closed)


def _statements(conn: Any) -> int:
    return int(getattr(conn, "statements", 0))


class Connections:
    """Per-thread connections to ``target`` (a SQLite file or a PostgreSQL URL)."""

    def __init__(self, target: str | Path, gate: Gate) -> None:
        self.target = target
        self.pg = backend.is_url(target)
        self.gate = gate
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: dict[int, Connection] = {}  # id(conn) -> conn, every thread's
        self.opened = 0  # connections opened, reopenings included

    @property
    def count(self) -> int:
        """Connections open now."""
        with self._lock:
            return len(self._open)

    def adopt(self, conn: Connection) -> None:
        """Make ``conn`` (opened by the caller, e.g. the writer's, migrated) this thread's."""
        self._local.conn = conn
        self._local.epoch = self.gate.epoch
        with self._lock:
            self._open[id(conn)] = conn
            self.opened += 1

    def run(self, fn: Callable[[Connection], T], *, readonly: bool) -> T:
        """``fn(conn)`` on this thread's connection (module docstring for a lost one)."""
        conn, fresh = self._get(readonly)
        before = _statements(conn)
        try:
            result = fn(conn)
        except Exception as exc:
            if not (self.pg and _lost(conn)):
                raise
            self._drop()
            if not fresh and _statements(conn) == before:  # nothing of it reached the server
                return self.run(fn, readonly=readonly)
            self.gate.failed(exc)
            raise StoreUnavailable(f"{self.gate.name} went away: {exc}") from exc
        self.gate.succeeded(getattr(self._local, "epoch", None))
        return result

    def _get(self, readonly: bool) -> tuple[Connection, bool]:
        """This thread's connection, and whether it was opened just now."""
        conn: Connection | None = getattr(self._local, "conn", None)
        if conn is not None and self.pg and getattr(self._local, "epoch", 0) < self.gate.epoch:
            self._drop()  # opened before the server last went away
            conn = None
        if conn is not None:
            return conn, False
        try:
            conn = backend.open_connection(self.target, readonly=readonly)
        except Exception as exc:
            if not self.pg:
                raise
            self.gate.failed(exc)
            raise StoreUnavailable(f"{self.gate.name} is unavailable: {exc}") from exc
        self.adopt(conn)
        return conn, True

    def _drop(self) -> None:
        conn: Connection | None = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is None:
            return
        with self._lock:
            self._open.pop(id(conn), None)
        with contextlib.suppress(Exception):  # already dead: nothing to close
            conn.close()

    def close_mine(self) -> None:
        """Close this thread's connection (the writer's, after its queue)."""
        self._drop()

    def close_all(self) -> None:
        """Close every thread's connection (their threads have stopped)."""
        with self._lock:
            conns, self._open = list(self._open.values()), {}
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.close()
