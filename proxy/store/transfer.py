"""Copying a memory store to the other backend (``engram migrate``, :mod:`proxy.cli.migrate`)
(SQLite to PostgreSQL or back; ``sqlite:PATH``, a bare path, ``postgresql://`` or ``postgres://``).

The destination's schema is made by its own migrations (:func:`proxy.store.backend.migrate`);
then :data:`PLAN`'s tables are copied in dependency order (a session's parent before it), by
primary key, a batch per transaction, every insert ``ON CONFLICT DO NOTHING``: an interrupted
run (Ctrl-C, SIGKILL, ``--limit``) keeps what it committed and a second run copies only what is
missing (0 rows when nothing is). What is derived is not copied but made again where it is
written: the full-text index (``turns_fts``, PostgreSQL's ``tsvector``) by the destination's
insert triggers, which also write its ``changes`` log; ``turn_vec`` is copied explicitly (the
vectors' bytes, never recomputed, with SQLite's bit-quantised copy made on the way), and
``embed_models`` ids are mapped by name. ``leases`` (jobs held by the source's processes) and
``schema_migrations`` stay behind. On PostgreSQL the id sequences are moved past the copied ids.

What it refuses (exit 1): a destination of another install (its ``meta`` ``fence_secret``
differs from the source's) unless ``--force``, which gives it the source's; vectors of another
model than the destination's (no ``--reembed``: copy, then ``engram reindex``); a source whose
``engram reindex`` is half-way. ``meta``'s secrets are copied, so the memory block's tag stays
valid. A URL is only ever shown without its password (:func:`proxy.store.backend.display`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.store import backend, vectable
from proxy.store.dialect import ids_in, is_pg
from proxy.store.rows import json_list
from proxy.store.sqlite.db import Connection

BATCH = 1000
"""Rows per transaction."""
FENCE_KEY = "fence_secret"  # proxy.services.FENCE_SECRET_KEY (not imported: it loads aiohttp)
SECRET_KEYS = (FENCE_KEY, "admin_token")
"""``meta`` keys that ``--force`` overwrites on the destination with the source's."""
LOCAL_META = frozenset({vectable.MODEL_KEY, vectable.BUILD_KEY, "changes_pruned_txid"})
"""``meta`` keys that describe the database itself: set by the copy (the model) or not copied."""


@dataclass(frozen=True)
class Table:
    """One table to copy: ``key`` orders and resumes the scan (unique together)."""

    name: str
    key: tuple[str, ...]


PLAN: tuple[Table, ...] = (
    Table("users", ("id",)),
    Table("sessions", ("level", "id")),  # a parent's level is below its children's
    Table("turns", ("id",)),
    Table("summaries", ("session_id",)),
    Table("prompt_blocks", ("user_id", "chain", "session_id")),
    Table("requests", ("id",)),
    Table("feedback", ("id",)),
    Table("consolidation_queue", ("request_id",)),
    Table("counters", ("name",)),
    Table("slots", ("user_id", "id")),
    Table("slot_sessions", ("session_id", "slot_id")),
    Table("api_keys", ("id",)),
    Table("scaffolds", ("user_id", "hash")),
    Table("scaffold_sessions", ("user_id", "hash", "session_id")),
    Table("paragraph_sightings", ("user_id", "hash", "session_id")),
)
"""The tables copied row by row, in an order that satisfies every foreign key. ``meta`` and
``embed_models`` go first, by their own functions, and ``turn_vec`` after ``turns``."""
VECTORS = "turn_vec"
NOT_COPIED: dict[str, str] = {
    "turns_fts": "made again by the destination's triggers on turns",
    "turns_fts_terms": "SQLite's view of turns_fts",
    "changes": "written by the destination's triggers; the source's describes the source",
    "leases": "held by the source's processes; they expire",
    "schema_migrations": "the destination's own migrations",
    "turn_vec_build": "an unfinished reindex: the copy refuses to start",
}
SEQUENCES = (("turns", "id"), ("feedback", "id"), ("embed_models", "id"))
"""PostgreSQL identities that explicit ids leave behind (SQLite's rowids follow by themselves)."""


class Refused(RuntimeError):
    """The copy must not start; the message says why and what to do."""


@dataclass
class Report:
    """What a run copied, table by table (rows inserted; 0 where the destination had them)."""

    copied: dict[str, int] = field(default_factory=dict)
    total: int = 0  # rows of the source to look at
    seen: int = 0  # rows looked at
    finished: bool = False  # every table scanned to its end (not stopped at --limit)

    @property
    def inserted(self) -> int:
        return sum(self.copied.values())


def parse_target(text: str) -> str | Path:
    """A URL as given, ``sqlite:PATH`` or a bare path as a :class:`Path`."""
    if backend.is_url(text):
        return text
    rest = text[len("sqlite:") :] if text.startswith("sqlite:") else text
    if rest.startswith("///"):
        rest = rest[2:]  # sqlite:///abs/path
    if not rest:
        raise Refused(f"{text!r} names no SQLite file")
    return Path(rest).expanduser()


def scan_sql(table: Table, columns: Sequence[str], conn: Connection, first: bool) -> str:
    """The next batch of ``table`` after a key (none when ``first``), in key order."""
    key = ", ".join(table.key)
    after = "" if first else f" WHERE ({key}) > ({', '.join('?' for _ in table.key)})"
    return f"SELECT {', '.join(columns)} FROM {table.name}{after} ORDER BY {key} LIMIT ?"


def insert_sql(table: str, columns: Sequence[str]) -> str:
    """One row's insert, skipped where the destination holds its key already."""
    marks = ", ".join("?" for _ in columns)
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks}) ON CONFLICT DO NOTHING"


def columns_of(conn: Connection, table: str) -> list[str]:
    """``table``'s columns in order."""
    cur = conn.execute(f"SELECT * FROM {table} LIMIT 0")
    return [str(d[0]) for d in cur.description]


@contextlib.contextmanager
def transaction(conn: Connection) -> Iterator[None]:
    """One write transaction on either backend."""
    conn.execute("BEGIN" if is_pg(conn) else "BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _meta(conn: Connection) -> dict[str, str]:
    return {str(k): str(v) for k, v in conn.execute("SELECT key, value FROM meta")}


def check(src: Connection, dst: Connection, *, force: bool) -> None:
    """Refused when the copy would mix installs or models, or the source is half re-embedded."""
    state = vectable.vector_state(src)
    if state.build_model is not None:
        raise Refused(
            f"the source is being re-embedded with {state.build_model!r} (`engram reindex` "
            "has not finished): finish it first"
        )
    mine, theirs = _meta(src).get(FENCE_KEY), _meta(dst).get(FENCE_KEY)
    if not force and mine is not None and theirs is not None and mine != theirs:
        raise Refused(
            "the destination belongs to another Engram install (its fence secret differs): "
            "pass --force to copy into it anyway, giving it this install's secrets"
        )
    there = vectable.vector_state(dst)
    same = (there.model, vectable.table_dim(dst)) == (state.model, vectable.table_dim(src))
    if there.vectors and state.vectors and not same:
        raise Refused(
            f"the destination holds vectors of {there.model!r}, the source of {state.model!r}: "
            "vectors are copied, never recomputed; copy into an empty destination, then run "
            "`engram reindex` there"
        )


def copy_meta(src: Connection, dst: Connection, *, force: bool) -> int:
    """``meta`` but the database's own keys (the secrets overwritten with ``force``)."""
    rows = [(k, v) for k, v in _meta(src).items() if k not in LOCAL_META]
    inserted = 0
    with transaction(dst):
        for key, value in rows:
            if force and key in SECRET_KEYS:
                dst.execute(
                    "INSERT INTO meta(key, value) VALUES (?, ?)"
                    " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (key, value),
                )
                continue
            inserted += dst.execute(insert_sql("meta", ("key", "value")), (key, value)).rowcount
    return inserted


def copy_models(src: Connection, dst: Connection) -> tuple[int, dict[int, int]]:
    """``embed_models`` by id where it is free; (rows inserted, source id -> destination id by
    name), then the source's table model claimed on the destination (``turn_vec`` rebuilt for
    its dimension while empty)."""
    models = [
        (int(i), str(n), int(d))
        for i, n, d in src.execute("SELECT id, name, dim FROM embed_models")
    ]
    state = vectable.vector_state(src)
    inserted = 0
    with transaction(dst):
        for model, name, dim in models:
            cur = dst.execute(insert_sql("embed_models", ("id", "name", "dim")), (model, name, dim))
            inserted += cur.rowcount
        advance_sequences(dst, ["embed_models"])  # before a model is added without its id
        names = {str(n): int(i) for i, n in dst.execute("SELECT id, name FROM embed_models")}
        for _model, name, dim in models:
            if name not in names:  # its id was taken by another name
                names[name] = vectable.model_id(dst, name, dim)
                inserted += 1
        if state.model is not None and not vectable.claim_model(
            dst, state.model, vectable.table_dim(src)
        ):
            raise Refused(f"the destination's vectors are not {state.model!r}'s")
    return inserted, {model: names[name] for model, name, _ in models}


def copy_table(
    src: Connection,
    dst: Connection,
    table: Table,
    *,
    batch: int,
    budget: Callable[[], int | None],
    on_batch: Callable[[int, int], None],
    convert: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None,
) -> bool:
    """Copy ``table`` a batch per transaction; ``on_batch(read, inserted)`` after each. False
    when ``budget()`` (rows still allowed, None: no limit) ran out before its end."""
    columns = columns_of(src, table.name)
    missing = set(columns) - set(columns_of(dst, table.name))
    if missing:
        raise Refused(f"the destination's {table.name} lacks {sorted(missing)}: upgrade Engram")
    at = [columns.index(k) for k in table.key]
    insert = insert_sql(table.name, columns)
    last: tuple[Any, ...] | None = None
    while True:
        left = budget()
        if left is not None and left <= 0:
            return False
        size = batch if left is None else min(batch, left)
        rows = src.execute(
            scan_sql(table, columns, src, last is None), (*(last or ()), size)
        ).fetchall()
        if not rows:
            return True
        last = tuple(rows[-1][i] for i in at)
        out = [convert(r) for r in rows] if convert is not None else rows
        with transaction(dst):
            inserted = dst.executemany(insert, out).rowcount  # the rows' sum on both
        on_batch(len(rows), inserted)
        if len(rows) < size:
            return True


def read_vectors(conn: Connection, ids: Sequence[int]) -> list[tuple[Any, ...]]:
    """(turn id, user, session, indexed, float32 bytes) of those of ``ids`` with a vector."""
    columns = "turn_id, user_id, session_id, indexed, embedding"
    if is_pg(conn):
        sql = f"SELECT {columns} FROM turn_vec WHERE turn_id IN {ids_in(conn)} ORDER BY turn_id"
        return conn.execute(sql, (json_list(ids),)).fetchall()
    found = []  # sqlite-vec answers point lookups by its key
    for turn in ids:
        row = conn.execute(f"SELECT {columns} FROM turn_vec WHERE turn_id = ?", (turn,)).fetchone()
        if row is not None:
            found.append((int(row[0]), row[1], row[2], row[3], bytes(row[4])))
    return found


def write_vectors(conn: Connection, rows: Sequence[tuple[Any, ...]]) -> int:
    """Insert the rows the destination lacks (``vec0`` takes no ``ON CONFLICT``); how many."""
    have = {int(r[0]) for r in read_vectors(conn, [int(r[0]) for r in rows])}
    todo = [r for r in rows if int(r[0]) not in have]
    if is_pg(conn):
        conn.executemany(
            "INSERT INTO turn_vec(turn_id, user_id, session_id, indexed, embedding)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            todo,
        )
    else:
        conn.executemany(
            "INSERT INTO turn_vec(turn_id, user_id, session_id, indexed, embedding,"
            " embedding_bits) VALUES (?, ?, ?, ?, ?, vec_quantize_binary(?))",
            [(*r, r[4]) for r in todo],
        )
    return len(todo)


def copy_vectors(
    src: Connection,
    dst: Connection,
    *,
    batch: int,
    budget: Callable[[], int | None],
    on_batch: Callable[[int, int], None],
) -> bool:
    """``turn_vec``, walked by the ids of ``turns`` with a vector (as :func:`copy_table`)."""
    last = 0
    while True:
        left = budget()
        if left is not None and left <= 0:
            return False
        size = batch if left is None else min(batch, left)
        ids = [
            int(r[0])
            for r in src.execute(
                "SELECT id FROM turns WHERE id > ? AND embed_hash IS NOT NULL ORDER BY id LIMIT ?",
                (last, size),
            )
        ]
        if not ids:
            return True
        last = ids[-1]
        rows = read_vectors(src, ids)
        with transaction(dst):
            inserted = write_vectors(dst, rows)
        on_batch(len(rows), inserted)
        if len(ids) < size:
            return True


def advance_sequences(conn: Connection, tables: Sequence[str] = ()) -> None:
    """PostgreSQL's identities (of ``tables``; default: all) past the largest id stored (a
    no-op on SQLite)."""
    if not is_pg(conn):
        return
    for table, column in SEQUENCES:
        if tables and table not in tables:
            continue
        conn.execute(
            f"SELECT setval(pg_get_serial_sequence('{table}', '{column}'),"
            f" (SELECT coalesce(max({column}), 0) + 1 FROM {table}), false)"
        )


def source_rows(conn: Connection) -> int:
    """Rows :func:`migrate` looks at: every table of the plan, and the vectors."""
    total = sum(int(conn.execute(f"SELECT count(*) FROM {t.name}").fetchone()[0]) for t in PLAN)
    return total + vectable.vector_count(conn)


FIRST = ("meta", "embed_models")
"""Copied whole before the tables (not counted against ``--limit``)."""


def migrate(
    src: Connection,
    dst: Connection,
    *,
    batch: int = BATCH,
    limit: int | None = None,
    force: bool = False,
    on_start: Callable[[Report], None] | None = None,
    on_progress: Callable[[Report, str], None] | None = None,
) -> Report:
    """Copy ``src`` into ``dst`` (both migrated); ``limit``: stop after copying that many
    rows (a later call continues: rows the destination already has are skipped, not
    counted). Raises :class:`Refused` (see the module)."""
    if batch < 1:
        raise ValueError("batch must be at least 1")
    check(src, dst, force=force)
    report = Report(total=source_rows(src))
    if on_start is not None:
        on_start(report)
    report.copied["meta"] = copy_meta(src, dst, force=force)
    report.copied["embed_models"], model_ids = copy_models(src, dst)

    def budget() -> int | None:  # rows still to copy; rows already there do not count
        if limit is None:
            return None
        done = sum(n for name, n in report.copied.items() if name not in FIRST)
        return limit - done

    def counted(name: str) -> Callable[[int, int], None]:
        def on_batch(read: int, inserted: int) -> None:
            report.seen += read
            report.copied[name] = report.copied.get(name, 0) + inserted
            if on_progress is not None:
                on_progress(report, name)

        return on_batch

    embed_at = columns_of(src, "turns").index("embed_model")

    def remap(row: tuple[Any, ...]) -> tuple[Any, ...]:
        model = row[embed_at]
        if model is None:
            return row
        return (*row[:embed_at], model_ids.get(int(model), model), *row[embed_at + 1 :])

    for table in PLAN:
        report.copied.setdefault(table.name, 0)
        convert = remap if table.name == "turns" else None
        done = copy_table(
            src,
            dst,
            table,
            batch=batch,
            budget=budget,
            on_batch=counted(table.name),
            convert=convert,
        )
        if done and table.name == "turns":
            report.copied.setdefault(VECTORS, 0)
            done = copy_vectors(src, dst, batch=batch, budget=budget, on_batch=counted(VECTORS))
        if not done:
            break
    else:
        report.finished = True
    advance_sequences(dst)  # stopped half-way too: a server may write to it meanwhile
    return report


# --- the command ---------------------------------------------------------------------------------
