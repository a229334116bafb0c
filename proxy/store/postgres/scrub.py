"""Scrubbing after deletes on PostgreSQL: every table of the store's schema rewritten by
``VACUUM FULL``, so that forgotten text leaves the relation files, not only the visible rows.

A deleted row is a dead tuple that stays in its heap page until something rewrites the page;
plain ``VACUUM`` is not enough (measured: tests/store/test_forget.py): it frees the line
pointer and compacts the page, but a tuple that was the page's last (lowest) one is left as it
was in the freed space, and a GIN index never removes an entry key (the ``tsvector``'s lexemes
stay in ``turns_fts_tsv`` for good). ``VACUUM FULL`` writes each table (its TOAST table with
it) into new files and rebuilds its indexes; the old files are truncated at commit.

The price: each table is held under ``ACCESS EXCLUSIVE`` while it is rewritten (readers of that
table wait; ``turns`` dominates), the rewrite needs room for a second copy, and it writes the
table into the WAL. Tables are done one at a time, each its own statement, waiting at most
:data:`LOCK_TIMEOUT` for its lock (a long reader ahead in the queue would otherwise stall
everyone behind the ``VACUUM``) and tried again :data:`LOCK_TRIES` times. The server's
``statement_timeout`` (60 s on the store's connections) does not apply to the rewrite.

The planner's statistics hold forgotten text too: ``ANALYZE`` (autovacuum's, or anyone's) keeps
sample values of each column in ``pg_statistic`` (compressed: a grep of the files misses them),
and ``VACUUM FULL`` leaves them as they were. So the rewritten tables are analysed again and
``pg_statistic`` rewritten in turn (the database's owner may; a role that may not is reported
as skipped). Its lock stops the planning of queries on this database for those milliseconds.

What this does not reach: the WAL, which keeps the deleted rows (and the rewritten tables)
until its segments are recycled after later checkpoints, and the file system's freed blocks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("engram.store")

LOCK_TIMEOUT = "5s"
"""How long one table's rewrite waits for its lock before giving way (then tried again)."""
LOCK_TRIES = 3
RETRY_WAIT_S = 0.5


@dataclass(frozen=True)
class PgScrubReport:
    """Tables rewritten, and those left because their lock never came."""

    rewritten: tuple[str, ...]
    skipped: tuple[str, ...]


def store_tables(conn: Any) -> list[str]:
    """The ordinary tables of the connection's schema (the store's), by name."""
    rows = conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.relkind IN ('r', 'm') AND n.nspname = current_schema() ORDER BY 1"
    )
    return [str(r[0]) for r in rows]


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _rewrite(conn: Any, table: str, *, quote: bool = True) -> bool:
    """``VACUUM FULL`` one table; False when its lock did not come in :data:`LOCK_TIMEOUT`."""
    from psycopg import errors

    name = _quoted(table) if quote else table
    for attempt in range(LOCK_TRIES):
        try:
            conn.execute(f"VACUUM (FULL) {name}")
            return True
        except errors.LockNotAvailable:
            time.sleep(RETRY_WAIT_S * (attempt + 1))
    return False


STATISTICS = "pg_catalog.pg_statistic"
"""The planner's statistics: ``ANALYZE`` keeps sample values of each column there (a text
column's ``histogram_bounds``, compressed), forgotten sentences among them."""


def _filenode(conn: Any, relation: str) -> int:
    return int(conn.execute("SELECT pg_relation_filenode(?::regclass)", (relation,)).fetchone()[0])


def restatistic(conn: Any, tables: list[str]) -> bool:
    """``ANALYZE`` the rewritten tables (new samples, none of the deleted rows), then rewrite
    :data:`STATISTICS` so that the replaced samples leave its files too; False when that rewrite
    did not happen (``VACUUM`` only warns where the role may not maintain the catalog: its new
    file tells)."""
    if tables:
        conn.execute("ANALYZE " + ", ".join(_quoted(t) for t in tables))
    before = _filenode(conn, STATISTICS)
    return _rewrite(conn, STATISTICS, quote=False) and _filenode(conn, STATISTICS) != before


def vacuum_full(conn: Any) -> PgScrubReport:
    """Rewrite every table of the store, then the statistics (:func:`restatistic`), outside any
    transaction (``VACUUM`` refuses one), with no statement timeout and :data:`LOCK_TIMEOUT`
    for each lock; the session's settings are restored afterwards."""
    timeout = conn.execute("SHOW statement_timeout").fetchone()[0]
    lock = conn.execute("SHOW lock_timeout").fetchone()[0]
    conn.execute("SET statement_timeout = 0")
    conn.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
    rewritten: list[str] = []
    skipped: list[str] = []
    try:
        for table in store_tables(conn):
            (rewritten if _rewrite(conn, table) else skipped).append(table)
        (rewritten if restatistic(conn, rewritten) else skipped).append(STATISTICS)
    finally:
        conn.execute("SELECT set_config('statement_timeout', ?, false)", (str(timeout),))
        conn.execute("SELECT set_config('lock_timeout', ?, false)", (str(lock),))
    if skipped:
        log.warning(
            "could not rewrite %s after a delete (locked by long readers, or the role may "
            "not maintain the catalog): the forgotten text may stay in their files until the "
            "next scrub",
            ", ".join(skipped),
        )
    return PgScrubReport(tuple(rewritten), tuple(skipped))
