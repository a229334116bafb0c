"""Scrubbing after deletes, so that forgotten text leaves the database files, not only its rows.

With ``secure_delete`` (:func:`proxy.store.sqlite.db.connect`) a deleted row is zeroed in its page,
but
three copies live on elsewhere until something rewrites them:

- ``turns_fts`` is a contentless-delete FTS5 index: deleting a row only records a tombstone; the
  row's tokens stay in the index segments until the segment is rewritten. :func:`merge_fts`
  merges the segments into one, a page budget at a time (``'merge'`` with a negative budget:
  every segment takes part, and a lone segment holding tombstones is rewritten too), each step its
  own short write transaction, so a chat turn's archive commit (which does not touch the index)
  waits for one step, not for the whole rewrite; :func:`fts_optimize` then confirms the end
  state (a no-op once the merges are done).
- Freed pages go to the freelist (zeroed); :func:`vacuum_step` (``auto_vacuum = INCREMENTAL``)
  hands them back to the file system, a page budget at a time.
- The write-ahead log holds older images of changed pages: :func:`checkpoint` (``TRUNCATE``)
  copies what is current into the database and empties the log file.

:class:`Scrubber` runs these steps through the store's writer (never on the event loop), one scrub
at a time; deletes that ask while one runs share the next run. ``auto_vacuum`` can only be chosen
before the first table exists, or by a ``VACUUM``: :func:`ensure_incremental_vacuum` does that for
new databases (before the schema) and, once, for older ones
(:func:`proxy.store.sqlite.migrations.migrate`
calls it).

On PostgreSQL the scrub is :func:`proxy.store.postgres.scrub.vacuum_full` instead: every table of
the
store rewritten by ``VACUUM FULL`` (plain ``VACUUM`` leaves the bytes; that module says why).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from proxy.store.dialect import is_pg
from proxy.store.postgres.scrub import vacuum_full
from proxy.store.sqlite.db import Connection, driver

T = TypeVar("T")

log = logging.getLogger("engram.store")

MERGE_PAGES = 200
"""FTS5 pages written per merge step (about 40 ms of work at 100k turns; one transaction)."""
VACUUM_PAGES = 2000
"""Free pages handed back to the file system per incremental-vacuum step."""
MAX_STEPS = 100_000
"""Bound on the incremental-vacuum steps of one scrub (a safety net: it ends long before)."""
MAX_SEGMENTS = 500
"""Past this many full-text segments the merge steps give way to one ``optimize``."""
CHECKPOINT_TRIES = 5
CHECKPOINT_WAIT_S = 0.2

AUTO_VACUUM_INCREMENTAL = 2


def fts_merge_step(conn: Connection, pages: int | None = None) -> bool:
    """One FTS5 merge of ``pages`` (:data:`MERGE_PAGES`) over every segment of ``turns_fts``;
    whether it did any work."""
    budget = abs(pages or MERGE_PAGES)
    before = conn.total_changes
    conn.execute("INSERT INTO turns_fts(turns_fts, rank) VALUES ('merge', ?)", (-budget,))
    # FTS5's own test: fewer than two changes means nothing was left to merge.
    return conn.total_changes - before >= 2


def fts_pages(conn: Connection) -> int:
    """Rows (about pages) of the full-text index's data."""
    return int(conn.execute("SELECT count(*) FROM turns_fts_data").fetchone()[0])


def fts_segments(conn: Connection) -> int:
    """Segments of the full-text index holding terms."""
    return int(conn.execute("SELECT count(DISTINCT segid) FROM turns_fts_idx").fetchone()[0])


def fts_optimize(conn: Connection) -> None:
    """Merge ``turns_fts`` into one segment without deleted entries (cheap when already so)."""
    conn.execute("INSERT INTO turns_fts(turns_fts) VALUES ('optimize')")


def free_pages(conn: Connection) -> int:
    return int(conn.execute("PRAGMA freelist_count").fetchone()[0])


def vacuum_step(conn: Connection, pages: int = VACUUM_PAGES) -> int:
    """Hand up to ``pages`` free pages back to the file system (``auto_vacuum = INCREMENTAL``
    only; otherwise nothing); how many free pages are left."""
    if auto_vacuum_mode(conn) != AUTO_VACUUM_INCREMENTAL:
        return 0
    conn.execute(f"PRAGMA incremental_vacuum({int(pages)})").fetchall()
    return free_pages(conn)


def checkpoint(conn: Connection) -> bool:
    """Copy the write-ahead log into the database and truncate it to zero bytes (outside any
    transaction); False while a reader still needs the log (try again later)."""
    busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    return int(busy) == 0


def auto_vacuum_mode(conn: Connection) -> int:
    """0 none, 1 full, 2 incremental."""
    return int(conn.execute("PRAGMA auto_vacuum").fetchone()[0])


def ensure_incremental_vacuum(conn: Connection) -> bool:
    """Give the database ``auto_vacuum = INCREMENTAL`` (outside any transaction): at once for a
    database without tables yet; by a one-time ``VACUUM`` (a full rewrite, which also clears the
    leftovers of deletes made before ``secure_delete``) for an older one. Whether it vacuumed.
    A ``VACUUM`` that cannot run now (another connection reading) is logged and tried again at
    the next open."""
    if auto_vacuum_mode(conn) == AUTO_VACUUM_INCREMENTAL:
        return False
    conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
    if auto_vacuum_mode(conn) == AUTO_VACUUM_INCREMENTAL:  # no table yet: set for good
        return False
    pages, size = (
        int(conn.execute(f"PRAGMA {p}").fetchone()[0]) for p in ("page_count", "page_size")
    )
    log.info(
        "vacuuming the database once for incremental vacuum (%.0f MB; about 10 s per GB)",
        pages * size / 2**20,
    )
    t0 = time.perf_counter()
    try:
        conn.execute("VACUUM")
    except driver().OperationalError as exc:
        log.warning("could not VACUUM the database to enable incremental vacuum: %s", exc)
        return False
    log.info("database vacuumed once for incremental vacuum in %.1f s", time.perf_counter() - t0)
    return True


class Writes(Protocol):
    """What the scrubber needs of :class:`proxy.store.store.Store`."""

    async def write(self, fn: Callable[[Connection], T], *, transaction: bool = ...) -> T: ...


@dataclass(frozen=True)
class ScrubReport:
    """What one scrub did: FTS merge steps, whether they had to end in one ``optimize``
    transaction instead, free pages left, whether the log was emptied (SQLite); the tables
    rewritten, and those skipped because their lock never came (PostgreSQL, whose WAL is never
    emptied: ``checkpointed`` is False there)."""

    merge_steps: int
    optimized_at_once: bool
    free_pages_left: int
    checkpointed: bool
    seconds: float
    rewritten: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()


async def merge_fts(store: Writes) -> tuple[int, bool]:
    """Merge ``turns_fts`` into one segment without deleted entries, :data:`MERGE_PAGES` at a
    time; (steps, whether it fell back to one ``optimize``).

    A negative merge starts over whenever a new segment has appeared since the last step (FTS5
    puts every segment on one level first), so the steps converge only while nothing else writes
    to the index: :class:`Scrubber` holds the indexer meanwhile (:meth:`Scrubber.fts_writable`).
    Should other writes still arrive (a hand-back, a fact, another process), the steps stop after
    twice the pages the index holds, or once it has :data:`MAX_SEGMENTS` segments (FTS5 allows
    2000), and one ``optimize`` finishes the job."""
    pages = await store.write(fts_pages)
    limit = 2 * (pages // MERGE_PAGES) + 10
    steps = 0
    while await store.write(fts_merge_step):
        steps += 1
        if steps >= limit or (steps % 10 == 0 and await store.write(fts_segments) > MAX_SEGMENTS):
            log.info("FTS merge steps did not converge (other writes); optimizing at once")
            await store.write(fts_optimize)
            return steps, True
    await store.write(fts_optimize)  # a no-op once the merges are done: the end state, checked
    return steps, False


async def scrub(store: Writes) -> ScrubReport:
    """Merge the FTS segments, vacuum the freed pages, checkpoint the log, step by step on the
    store's writer (each step queues behind the writes already waiting); on PostgreSQL,
    rewrite the store's tables (:func:`proxy.store.postgres.scrub.vacuum_full`), one writer job."""
    t0 = time.perf_counter()
    if await store.write(is_pg, transaction=False):
        done_pg = await store.write(vacuum_full, transaction=False)
        seconds = time.perf_counter() - t0
        return ScrubReport(0, False, 0, False, seconds, done_pg.rewritten, done_pg.skipped)
    steps, at_once = await merge_fts(store)
    left, vacuumed = 0, 0
    while vacuumed < MAX_STEPS:
        left = await store.write(vacuum_step)
        vacuumed += 1
        if left == 0:
            break
    done = False
    for attempt in range(CHECKPOINT_TRIES):
        done = await store.write(checkpoint, transaction=False)
        if done:
            break
        await asyncio.sleep(CHECKPOINT_WAIT_S * (attempt + 1))
    if not done:
        log.warning("the write-ahead log could not be emptied after a delete (readers busy)")
    return ScrubReport(steps, at_once, left, done, time.perf_counter() - t0)


class Scrubber:
    """Runs :func:`scrub` after deletes, one at a time; callers that ask while one runs are
    served by the next, shared run (a burst of deletes costs two scrubs, not one each). While
    one runs, :meth:`fts_writable` holds those who write to the full-text index (the indexer)."""

    def __init__(self, store: Writes) -> None:
        self._store = store
        self._lock = asyncio.Lock()
        self._idle = asyncio.Event()
        self._idle.set()
        self._asked = 0
        self._covered = 0
        self.runs = 0
        self.last: ScrubReport | None = None

    async def fts_writable(self) -> None:
        """Return once no scrub is merging the full-text index (at once, nearly always)."""
        await self._idle.wait()

    async def scrub(self) -> ScrubReport | None:
        """Scrub what was deleted before this call; None when a run that started after this
        call already did."""
        self._asked += 1
        ticket = self._asked
        async with self._lock:
            if self._covered >= ticket:
                return None
            covers = self._asked
            self._idle.clear()
            try:
                report = await scrub(self._store)
            finally:
                self._idle.set()
            self._covered = covers
            self.runs += 1
            self.last = report
            return report
