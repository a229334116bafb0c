"""A PostgreSQL connection that the store's SQL functions use as they use a SQLite one.

The store's table modules are synchronous functions of a connection, run on the store's writer
and reader threads (never on the event loop). :class:`PgConnection` wraps a ``psycopg`` 3
connection so that those functions run unchanged where their SQL is portable:

- ``?`` and ``:name`` placeholders become ``%s`` / ``%(name)s`` (a literal ``%`` is doubled),
  outside quoted strings and identifiers; the translation is cached per statement text.
- ``col IN (SELECT value FROM json_each(?))`` reads the JSON array with
  ``json_array_elements_text`` (``bigint`` for id columns); ``IS ?`` / ``IS NOT ?`` become
  ``IS [NOT] DISTINCT FROM ?``.
- ``BEGIN IMMEDIATE`` becomes ``BEGIN``; the connection is in autocommit mode otherwise, as the
  SQLite ones are (``isolation_level=None``): callers write ``BEGIN``/``COMMIT`` themselves.
- ``bytes`` parameters are pgvector ``vector`` values (little-endian float32, as sqlite-vec reads
  them: the schema has no other binary column) and ``vector`` columns come back as such bytes.
- a cursor answers ``fetchone``/``fetchall``/iteration/``rowcount`` like sqlite3's; there is no
  ``lastrowid``: inserts that need the id say ``RETURNING id`` (SQLite has it too).

SQL that is not portable branches on :func:`proxy.store.dialect.is_pg`.
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

try:  # an optional dependency: pip install 'engram[postgres]'
    import psycopg
    from psycopg.adapt import Dumper, Loader
    from psycopg.pq import Format
    from psycopg.types import TypeInfo
except ImportError:  # pragma: no cover - reported by connect()
    psycopg = None  # type: ignore[assignment]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class PostgresUnavailable(RuntimeError):
    """psycopg is not installed, or the server refused us."""


_IN_LIST = re.compile(
    r"(?P<col>\b[\w.]+)(?P<op>\s+(?:NOT\s+)?IN\s+)\(SELECT value FROM json_each\(\?\)\)",
    re.IGNORECASE,
)
_IS = re.compile(r"\bIS\s+\?", re.IGNORECASE)  # SQLite's IS compares NULLs as values
_IS_NOT = re.compile(r"\bIS\s+NOT\s+\?", re.IGNORECASE)
_ID_COLUMNS = frozenset({"id", "rowid", "turn_id", "source_turn"})


def _in_list(m: re.Match[str]) -> str:
    """``col IN (SELECT value FROM json_each(?))`` as PostgreSQL reads a JSON array of the
    column's type: integers for the id columns, text for every other."""
    col = m.group("col")
    value = "value::bigint" if col.rsplit(".", 1)[-1].lower() in _ID_COLUMNS else "value"
    return f"{col}{m.group('op')}(SELECT {value} FROM json_array_elements_text(?::json))"


@functools.lru_cache(maxsize=4096)
def translate(sql: str) -> str:
    """``sql`` with SQLite's placeholders as psycopg's (see the module docstring), and a
    column compared with a JSON-array parameter (``IN (SELECT value FROM json_each(?))``)
    compared with its elements."""
    sql = _IN_LIST.sub(_in_list, sql)
    sql = _IS_NOT.sub("IS DISTINCT FROM ?", _IS.sub("IS NOT DISTINCT FROM ?", sql))
    out: list[str] = []
    i, n = 0, len(sql)
    while i < n:
        ch = sql[i]
        if ch in "'\"":  # a quoted string or identifier, doubled quotes inside
            j = i + 1
            while j < n:
                if sql[j] == ch:
                    if j + 1 < n and sql[j + 1] == ch:
                        j += 2
                        continue
                    break
                j += 1
            out.append(sql[i : j + 1].replace("%", "%%"))
            i = j + 1
            continue
        if ch == "?":
            out.append("%s")
        elif ch == "%":
            out.append("%%")
        elif ch == ":" and i + 1 < n and sql[i + 1] == ":":
            out.append("::")  # a cast
            i += 2
            continue
        elif ch == ":" and (m := _NAME.match(sql, i + 1)) is not None:
            out.append(f"%({m.group(0)})s")
            i = m.end()
            continue
        else:
            out.append(ch)
        i += 1
    text = "".join(out)
    stripped = text.strip().rstrip(";").strip().upper()
    if stripped in ("BEGIN IMMEDIATE", "BEGIN DEFERRED", "BEGIN EXCLUSIVE"):
        return "BEGIN"
    return text


class Cursor:
    """The sqlite3 cursor surface the store uses, over a psycopg cursor."""

    def __init__(self, cur: Any) -> None:
        self._cur = cur

    @property
    def rowcount(self) -> int:
        return int(self._cur.rowcount)

    @property
    def description(self) -> Any:
        return self._cur.description

    def fetchone(self) -> tuple[Any, ...] | None:
        if self._cur.description is None:
            return None
        row = self._cur.fetchone()
        return None if row is None else tuple(row)

    def fetchall(self) -> list[tuple[Any, ...]]:
        if self._cur.description is None:
            return []
        return [tuple(r) for r in self._cur.fetchall()]

    def fetchmany(self, size: int = 1) -> list[tuple[Any, ...]]:
        if self._cur.description is None:
            return []
        return [tuple(r) for r in self._cur.fetchmany(size)]

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        if self._cur.description is None:
            return iter(())
        return (tuple(r) for r in self._cur)


Params = Sequence[Any] | Mapping[str, Any]


class PgConnection:
    """A psycopg connection with the sqlite3 surface the store's functions call."""

    dialect = "postgres"

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.statements = 0  # run without error: whether a job reached the server (store.held)

    def execute(self, sql: str, params: Params = ()) -> Cursor:
        cur = self.raw.cursor(binary=True)
        cur.execute(translate(sql), _params(params))
        self.statements += 1
        return Cursor(cur)

    def executemany(self, sql: str, rows: Any) -> Cursor:
        cur = self.raw.cursor(binary=True)
        cur.executemany(translate(sql), [_params(r) for r in rows])
        self.statements += 1
        return Cursor(cur)

    def executescript(self, script: str) -> None:
        self.raw.execute(script)
        self.statements += 1

    @property
    def in_transaction(self) -> bool:
        return bool(self.raw.info.transaction_status != psycopg.pq.TransactionStatus.IDLE)

    def close(self) -> None:
        self.raw.close()

    @property
    def closed(self) -> bool:
        return bool(self.raw.closed)


def _params(params: Params) -> Params:
    if isinstance(params, Mapping):
        return params
    return list(params)


def connect(url: str, *, readonly: bool = False, application: str = "engram") -> PgConnection:
    """Open ``url`` (``postgresql://`` or ``postgres://``) in autocommit mode, with ``vector``
    values read and written as float32 bytes; ``readonly`` makes every transaction read-only."""
    if psycopg is None:
        raise PostgresUnavailable(
            "the postgres backend needs psycopg 3: pip install 'engram[postgres]'"
        )
    try:
        raw = psycopg.connect(
            normalise_url(url), autocommit=True, application_name=application, connect_timeout=10
        )
    except psycopg.Error as exc:
        raise PostgresUnavailable(f"cannot connect to PostgreSQL: {redact_error(exc)}") from None
    try:
        if readonly:
            raw.execute("SET default_transaction_read_only = on")
        raw.execute("SET statement_timeout = '60s'")
        register_vector(raw)
    except BaseException:
        raw.close()
        raise
    return PgConnection(raw)


def normalise_url(url: str) -> str:
    """``postgres://`` as ``postgresql://`` (libpq takes both; said once here)."""
    return "postgresql://" + url[len("postgres://") :] if url.startswith("postgres://") else url


def redact_error(exc: BaseException) -> str:
    """The first line of a driver error, which libpq never fills with the password."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


# -- vector values as float32 bytes ----------------------------------------------------------


def register_vector(raw: Any) -> None:
    """Dump ``bytes`` as ``vector`` and load ``vector`` as little-endian float32 bytes, in
    pgvector's binary format; no-op until the extension exists (before the first migration)."""
    info = TypeInfo.fetch(raw, "vector")
    if info is None:
        return
    oid = info.oid

    class VectorDumper(Dumper):
        format = Format.BINARY

        def dump(self, obj: Any) -> bytes:
            arr = np.frombuffer(bytes(obj), dtype="<f4")
            return struct.pack(">HH", arr.size, 0) + arr.astype(">f4").tobytes()

    VectorDumper.oid = oid

    class VectorLoader(Loader):
        format = Format.BINARY

        def load(self, data: Any) -> bytes:
            dim, _ = struct.unpack_from(">HH", data)
            arr = np.frombuffer(bytes(data), dtype=">f4", count=dim, offset=4)
            return arr.astype("<f4").tobytes()

    class VectorTextLoader(Loader):
        def load(self, data: Any) -> bytes:
            values = bytes(data).decode().strip("[]")
            arr = np.array([float(v) for v in values.split(",")] if values else [], "<f4")
            return arr.tobytes()

    raw.adapters.register_dumper(bytes, VectorDumper)
    raw.adapters.register_loader(oid, VectorTextLoader)
    raw.adapters.register_loader(oid, VectorLoader)


def ensure_vector_types(conn: PgConnection) -> None:
    """Register the vector adapters once the extension exists (after migrating)."""
    register_vector(conn.raw)
