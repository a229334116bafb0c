"""Open SQLite with sqlite-vec loaded, through whichever driver can load extensions.

:func:`connect` is the only way the project opens its database. The driver is the first of
stdlib ``sqlite3`` (only when it can load extensions — many CPython builds, macOS system Python
among them, cannot), ``sqlean`` (sqlean-py) and ``pysqlite3`` that can load sqlite-vec and whose
SQLite has FTS5 with ``contentless_delete`` (3.43 or newer; ``turns_fts`` needs it). All three
speak DB-API 2 like ``sqlite3`` but raise their own exception classes: catch
``driver().Error`` / ``driver().OperationalError``, never ``sqlite3.Error``.

Connections are opened in autocommit mode (``isolation_level=None``); callers write
``BEGIN``/``COMMIT`` themselves. Each gets WAL, ``synchronous=NORMAL``, a busy timeout,
``foreign_keys=ON`` and ``secure_delete=ON``: deleted rows are overwritten with zeros in their pages
(and freed pages zeroed), so a forgotten turn leaves no bytes behind once the write-ahead log is
checkpointed (:mod:`proxy.store.sqlite.scrub`). It costs some write I/O on deletes and updates only.

:func:`database_info` reports the driver, SQLite version, FTS5 and sqlite-vec versions for
``engram doctor``.
"""

from __future__ import annotations

import functools
import importlib
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeAlias, cast

import sqlite_vec

from proxy.store.files import private_file

# Every driver's connection behaves as sqlite3.Connection; typed as one for mypy's sake.
Connection: TypeAlias = sqlite3.Connection

DRIVER_ORDER = ("sqlite3", "sqlean", "pysqlite3")
DEFAULT_BUSY_TIMEOUT_MS = 5000
# Memory-mapped reads make sqlite-vec's chunk blobs much cheaper to read (point lookups ~10x).
DEFAULT_MMAP_BYTES = 256 * 1024 * 1024


class DriverUnavailable(RuntimeError):
    """No installed SQLite driver can load the sqlite-vec extension."""


@dataclass(frozen=True)
class Driver:
    """A DB-API module that can load extensions, and its exception classes."""

    name: str
    module: ModuleType

    @property
    def Error(self) -> type[Exception]:
        return cast(type[Exception], self.module.Error)

    @property
    def OperationalError(self) -> type[Exception]:
        return cast(type[Exception], self.module.OperationalError)

    @property
    def IntegrityError(self) -> type[Exception]:
        return cast(type[Exception], self.module.IntegrityError)


@dataclass(frozen=True)
class DbInfo:
    """What ``engram doctor`` prints about the database layer."""

    driver: str
    sqlite_version: str
    fts5: bool
    vec_version: str | None
    journal_mode: str | None = None


def _load_vec(conn: Any) -> None:
    conn.enable_load_extension(True)
    try:
        sqlite_vec.load(conn)
    finally:
        conn.enable_load_extension(False)


def _try_driver(name: str) -> Driver | None:
    try:
        module = importlib.import_module("sqlite3" if name == "sqlite3" else f"{name}.dbapi2")
    except ImportError:
        return None
    if not hasattr(module.Connection, "enable_load_extension"):
        return None
    try:
        conn = module.connect(":memory:")
        try:
            _load_vec(conn)
            conn.execute("SELECT vec_version()").fetchone()
            conn.execute(
                "CREATE VIRTUAL TABLE temp.engram_probe"
                " USING fts5(x, content = '', contentless_delete = 1)"
            )
        finally:
            conn.close()
    except Exception:  # any failure to load means "not this driver"
        return None
    return Driver(name, module)


@functools.cache
def driver() -> Driver:
    """The first driver in :data:`DRIVER_ORDER` that loads sqlite-vec and has FTS5 with
    ``contentless_delete`` (probed once)."""
    for name in DRIVER_ORDER:
        found = _try_driver(name)
        if found is not None:
            return found
    raise DriverUnavailable(
        "no SQLite driver here can load extensions and has FTS5 (SQLite 3.43 or newer): "
        "install sqlean-py "
        "(pip install sqlean.py) or pysqlite3-binary"
    )


def connect(
    path: str | Path,
    *,
    readonly: bool = False,
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
    mmap_bytes: int = DEFAULT_MMAP_BYTES,
) -> Connection:
    """Open ``path`` (or ``":memory:"``) with sqlite-vec loaded and the project's pragmas.

    ``readonly`` sets ``query_only`` so a reader connection can never write by mistake.
    The connection may be used from a thread other than the one that opened it (one thread
    at a time).
    """
    drv = driver()
    if str(path) != ":memory:":
        private_file(Path(path))  # 0600 before SQLite creates it (its -wal/-shm follow)
    conn = drv.module.connect(
        str(path), isolation_level=None, check_same_thread=False, timeout=busy_timeout_ms / 1000
    )
    try:
        _load_vec(conn)
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        if str(path) != ":memory:":
            conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA secure_delete = ON")
        conn.execute(f"PRAGMA mmap_size = {int(mmap_bytes)}")
        if readonly:
            conn.execute("PRAGMA query_only = ON")
    except BaseException:
        conn.close()
        raise
    return cast(Connection, conn)


def has_fts5(conn: Connection) -> bool:
    """Whether this SQLite build has the FTS5 module."""
    try:
        conn.execute("CREATE VIRTUAL TABLE temp.engram_fts5_probe USING fts5(x)")
        conn.execute("DROP TABLE temp.engram_fts5_probe")
    except driver().OperationalError:
        return False
    return True


def database_info(path: str | Path = ":memory:") -> DbInfo:
    """Driver, SQLite version, FTS5 availability and sqlite-vec version, as ``path`` sees them."""
    conn = connect(path)
    try:
        (sqlite_version,) = conn.execute("SELECT sqlite_version()").fetchone()
        (vec_version,) = conn.execute("SELECT vec_version()").fetchone()
        (journal_mode,) = conn.execute("PRAGMA journal_mode").fetchone()
        return DbInfo(
            driver=driver().name,
            sqlite_version=str(sqlite_version),
            fts5=has_fts5(conn),
            vec_version=str(vec_version) if vec_version is not None else None,
            journal_mode=str(journal_mode),
        )
    finally:
        conn.close()
