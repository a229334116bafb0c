"""``engram reindex``: give every turn a vector of the configured embedding model.

What it re-embeds: every turn with text whose vector is missing or was made by another model
than ``embedder.model``. Two ways, chosen by :func:`reindex`:

- *fill* — the database's vectors are already the configured model's (or there are none): the
  turns without one get theirs in place, a batch per transaction, as the indexer's replay does.
- *build* — the vectors are another model's, of the same dimension or not: the new vectors go
  to a build table (:mod:`proxy.store.vectable`) while ``turn_vec`` stays as it was, then one
  transaction swaps them in (``turn_vec`` recreated with the new model's dimension) and records
  the new model. Re-embedding in place would leave a table of two models' vectors until the end,
  and could not change the dimension; the build table costs one more copy of the vectors on disk
  until the swap.

Either way each batch is one transaction, so an interrupted run (Ctrl-C, SIGKILL, power) loses
at most the batch in flight, and the next run continues from what is stored; search is never
broken meanwhile: the old vectors serve their own model until the swap. Texts are embedded
shortest first (a batch pads less), identical texts once (a vector already computed for the same
text is copied), on every core: several model sessions embed different batches at once
(:func:`session_layout`), while another batch is written.

Nothing else may write vectors meanwhile (a server's embedder would write the old model's
vectors beside the new ones, and search the new ones with the old model's queries): ``engram
serve`` and ``engram import`` hold a shared lock beside the database
(:mod:`proxy.store.sqlite.lock`)
and reindex needs it alone, so each refuses to start while the other runs. On PostgreSQL the lock
is an advisory one, and reindex also refuses while another Engram process is connected
(:mod:`proxy.store.postgres.reindex_lock`). Turns stored without
vectors meanwhile are picked up before the swap, which checks inside its own transaction that
none is left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from proxy.cli.progress import Progress
from proxy.config import Settings
from proxy.search.embedder import Embedder
from proxy.search.loading import ModelUnavailable, load_embedder
from proxy.store import vectable
from proxy.store.backend import display
from proxy.store.models import embed_text, text_hash
from proxy.store.postgres.connection import PostgresUnavailable
from proxy.store.postgres.reindex_lock import PgReindexLock
from proxy.store.sqlite.lock import DatabaseBusy, DatabaseLock
from proxy.store.store import Store
from proxy.vectors import Vector

BATCH = 256
"""Turns per step (one read, one embedding call, one write transaction)."""
MAX_SESSIONS = 4
"""Model sessions of ``engram reindex`` at most (each holds the model in memory)."""
EMBED_BATCH = 16
"""Texts per inference. Shortest first, a batch pads little, and smaller ones stay in cache:
MiniLM on LoCoMo turns, two sessions on 2 busy cores (load 4), embedded 80 texts per CPU-second
in batches of 16, 74 in 32, 63 in 64 (bench.reindex)."""

Item = tuple[int, Vector, str]  # turn id, vector, hash of the text embedded


@dataclass
class ReindexReport:
    model: str
    dim: int
    way: str  # "fill", "build" or "none" (nothing to do)
    total: int = 0  # turns to re-embed when the run started
    done: int = 0  # turns given a vector by this run
    embedded: int = 0  # texts the model embedded (the others were copies)
    kept: int = 0  # turns an earlier, interrupted run had done already
    finished: bool = False  # every turn has a vector of the model (build: swapped in)
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.done / self.seconds if self.seconds > 0 else 0.0


async def reindex(
    store: Store,
    embedder: Embedder,
    *,
    sessions: Sequence[Embedder] = (),
    batch: int = BATCH,
    limit: int | None = None,
    on_start: Callable[[ReindexReport], None] | None = None,
    on_progress: Callable[[ReindexReport], None] | None = None,
) -> ReindexReport:
    """Re-embed what needs it with ``embedder`` (see the module); ``sessions``: more embedders
    of the same model, embedding other batches at the same time; ``limit``: stop after that
    many turns (a later call continues)."""
    if batch < 1:
        raise ValueError("batch must be at least 1")
    if any((e.name, e.dim) != (embedder.name, embedder.dim) for e in sessions):
        raise ValueError("every session must be of the same model")
    start = time.perf_counter()
    name, dim = embedder.name, embedder.dim
    state = await store.read(vectable.vector_state)
    build = state.vectors > 0 and (state.model != name or state.dim != dim)
    report = ReindexReport(name, dim, "build" if build else "fill")
    if build:
        await store.write(lambda c: vectable.start_build(c, name, dim))
        report.kept = await store.read(lambda c: vectable.vector_state(c).built)
        ids = await store.read(vectable.build_ids)
    else:  # an unfinished build towards another model stays (run with that model, it goes on)
        if not await store.ensure_embedding_model(name, dim):
            raise RuntimeError(f"the database's vectors are not {name!r}'s")  # cannot happen
        ids = await store.read(vectable.fill_ids)
    report.total = len(ids)
    if not ids and not build:
        report.way, report.finished = "none", True
    if on_start is not None:
        on_start(report)
    while True:
        todo = ids if limit is None else ids[: max(0, limit - report.done)]
        await _steps(store, [embedder, *sessions], todo, batch, build, report, on_progress)
        if len(todo) < len(ids):
            break  # stopped at the limit
        if build:
            report.finished = await store.write(vectable.finish_build)
        else:
            report.finished = True
        if report.finished:
            break
        ids = await store.read(vectable.build_ids)  # turns stored meanwhile
        report.total += len(ids)
    if report.finished and build:
        await store.ensure_embedding_model(name, dim)  # the store reads the new dimension
    report.seconds = time.perf_counter() - start
    return report


async def _steps(
    store: Store,
    embedders: Sequence[Embedder],
    ids: Sequence[int],
    batch: int,
    build: bool,
    report: ReindexReport,
    on_progress: Callable[[ReindexReport], None] | None,
) -> None:
    """Embed and store ``ids`` a batch at a time: a worker per model session (at least two,
    so that one batch is embedded while another is written), each taking the next batch."""
    chunks = deque(list(ids[i : i + batch]) for i in range(0, len(ids), batch))

    async def worker(embedder: Embedder) -> None:
        while chunks:
            items = await _prepare(store, embedder, chunks.popleft(), build, report)
            if build:
                add = functools.partial(vectable.add_built, items=items, dim=report.dim)
                await store.write(add)
            else:
                await store.set_vectors(items)
            report.done += len(items)
            if on_progress is not None:
                on_progress(report)

    try:
        async with asyncio.TaskGroup() as group:
            for k in range(max(2, len(embedders))):
                group.create_task(worker(embedders[k % len(embedders)]))
    except BaseExceptionGroup as failed:  # the first failure, as itself
        raise failed.exceptions[0] from None


async def _prepare(
    store: Store, embedder: Embedder, ids: list[int], build: bool, report: ReindexReport
) -> list[Item]:
    """The vectors of one batch: copied where the same text has one, embedded otherwise."""
    rows = await store.read(lambda c: vectable.turn_texts(c, ids))
    texts = [embed_text(role, speaker, content) for _, role, speaker, content in rows]
    hashes = [text_hash(t) for t in texts]
    known = await store.read(lambda c: vectable.known_vectors(c, hashes, build=build))
    todo = {h: t for h, t in zip(hashes, texts, strict=True) if h not in known}
    if todo:
        fresh = await embedder.embed_passages(list(todo.values()))
        known.update(zip(todo, fresh, strict=True))
        report.embedded += len(todo)
    return [(row[0], known[h], h) for row, h in zip(rows, hashes, strict=True)]


# --- the command ---------------------------------------------------------------------------------


def _lock(db: Path | str) -> DatabaseLock | PgReindexLock:
    """SQLite's lock file beside the database, or PostgreSQL's advisory lock."""
    return DatabaseLock(db) if isinstance(db, Path) else PgReindexLock(db)


def run(args: argparse.Namespace, settings: Settings, db: Path | str) -> int:
    """``engram reindex``; the exit code."""
    if args.batch < 1 or (args.limit is not None and args.limit < 0):
        print("engram: --batch must be at least 1 and --limit at least 0", file=sys.stderr)
        return 2
    lock = _lock(db)
    try:
        lock.acquire(exclusive=True)
    except DatabaseBusy as exc:
        held = f"it holds {lock.path}" if isinstance(lock, DatabaseLock) else str(exc)
        print(
            f"engram: an Engram server is using {display(db)} ({held}): stop it, run "
            "`engram reindex`, then start it again",
            file=sys.stderr,
        )
        return 1
    except PostgresUnavailable as exc:
        print(f"engram: {exc}", file=sys.stderr)
        return 1
    progress = Progress(0, sys.stderr, unit="turns")
    try:
        report = asyncio.run(_run(settings, db, args, progress))
    except KeyboardInterrupt:
        progress.close()
        print(
            "engram: reindex interrupted; what was done is kept: run `engram reindex` again to "
            "continue (the current vectors serve meanwhile)",
            file=sys.stderr,
        )
        return 130
    except ModelUnavailable as exc:
        print(f"engram: {exc}", file=sys.stderr)
        return 1
    finally:
        progress.close()
        lock.release()
    print(_summary(report))
    return 0


async def _run(
    settings: Settings, db: Path | str, args: argparse.Namespace, progress: Progress
) -> ReindexReport:
    count, threads = session_layout(os.cpu_count() or 1)

    def started(r: ReindexReport) -> None:
        progress.restart(r.total)
        if r.way != "none":
            print(_plan(r), file=sys.stderr)

    async with Store(db) as store, contextlib.AsyncExitStack() as stack:
        embedders = []
        for _ in range(count):
            embedder = await load_embedder(
                settings.embedder, threads=threads, batch_size=EMBED_BATCH
            )
            stack.push_async_callback(embedder.aclose)
            embedders.append(embedder)
        return await reindex(
            store,
            embedders[0],
            sessions=embedders[1:],
            batch=args.batch,
            limit=args.limit,
            on_start=started,
            on_progress=lambda r: progress.update(r.done, f"{r.embedded} embedded"),
        )


def session_layout(cores: int) -> tuple[int, int]:
    """(model sessions, ONNX threads each) for ``cores``: every core busy (not serving chats,
    the model may use them all), in up to :data:`MAX_SESSIONS` sessions embedding different
    batches at once. Measured on 2 busy cores: two sessions of one thread embedded 70 texts/s
    where one session of two threads did 50 (small matrices keep two threads of one session
    waiting on each other)."""
    sessions = max(1, min(cores, MAX_SESSIONS))
    return sessions, max(1, cores // sessions)


def _plan(r: ReindexReport) -> str:
    what = f"re-embedding {r.total} turns with {r.model!r} ({r.dim}-d)"
    if r.way == "fill":
        return f"{what}: they have no vector of it yet"
    kept = f"; {r.kept} done by an earlier run are kept" if r.kept else ""
    return (
        f"{what} into a new table{kept}; the current vectors serve until it is swapped in at "
        "the end"
    )


def _summary(r: ReindexReport) -> str:
    if r.way == "none":
        return f"nothing to re-embed: every turn with text has a vector of {r.model!r}"
    done = (
        f"re-embedded {r.done} turns in {r.seconds:.1f} s ({r.rate:.0f} turns/s; "
        f"{r.embedded} texts embedded, {r.done - r.embedded} copied from identical texts)"
    )
    if not r.finished:
        return f"{done}; stopped at --limit: run `engram reindex` again to continue"
    return f"{done}; every vector is now made by {r.model!r} ({r.dim}-d)"
