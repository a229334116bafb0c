"""Who is using a database: a lock file beside it, ``<database>.lock``.

``engram serve`` and ``engram import`` hold a shared lock on it while they run (several may
share one database); ``engram reindex`` needs it exclusively, so it never runs beside them. The
locks are ``flock`` locks: the system drops them when their process ends, however it ends
(SIGKILL included), so a stale lock never blocks anyone. The file itself stays (removing a lock
file races with the next locker) and holds nothing. Where ``fcntl`` is missing (Windows) nothing
is locked and :meth:`DatabaseLock.acquire` always succeeds.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import ModuleType

from proxy.store.files import private_file

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


class DatabaseBusy(RuntimeError):
    """The lock is held the other way by another process."""


def lock_path(db: Path) -> Path:
    return db.with_name(db.name + ".lock")


class DatabaseLock:
    """``acquire(exclusive=...)`` without waiting, ``release()`` (also on ``with``'s exit)."""

    def __init__(self, db: Path) -> None:
        self.path = lock_path(db)
        self._fd: int | None = None

    def acquire(self, *, exclusive: bool) -> None:
        """Take the lock now, or raise :class:`DatabaseBusy`."""
        if fcntl is None or self._fd is not None:
            return
        private_file(self.path)
        fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DatabaseBusy(str(self.path)) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing drops the flock

    def __enter__(self) -> DatabaseLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
