"""The ``engram`` commands that read or change memory: search, sessions, export, import, stats,
doctor, reindex (:mod:`proxy.cli.reindex`), and the corrections (forget, note, fact, pin, mute,
unpin: :mod:`proxy.cli.corrections`). Each opens the database directly (no server needed) in one
``asyncio.run``.

Exit codes: 0 done; 1 failed (nothing found, every import line bad, a doctor check failed);
2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from proxy.api import views as api
from proxy.background.stats import read_counters, token_figures
from proxy.cli import corrections
from proxy.cli.corrections import open_embedder
from proxy.cli.doctor import database_target, run_doctor
from proxy.cli.importer import ImportReport, import_records
from proxy.cli.progress import Progress
from proxy.cli.reindex import EMBED_BATCH, session_layout
from proxy.config import Settings, replace
from proxy.errors import BadRequest, EngramError
from proxy.jsonl import LineError, Source, export_line, parse_line
from proxy.redact import redact
from proxy.search.loading import load_embedder
from proxy.search.pool import EmbedderPool
from proxy.search.retrieval import Retriever
from proxy.slots.figures import offline_stats
from proxy.store.backend import display
from proxy.store.counters import memory_counts
from proxy.store.postgres.reindex_lock import PgReindexLock
from proxy.store.sqlite.lock import DatabaseBusy, DatabaseLock
from proxy.store.store import Store

Command = Callable[[argparse.Namespace, Settings, Store], Awaitable[int]]
MAX_ERRORS_SHOWN = 50


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Run one memory command; returns the exit code."""
    if args.command == "doctor":
        return asyncio.run(run_doctor(settings))
    path = database_target(settings)  # a SQLite file or a PostgreSQL URL
    if args.command not in ("import", "note") and isinstance(path, Path) and not path.exists():
        return fail(f"no memory database at {path} (nothing stored yet; see --db)")
    try:
        if args.command == "import":
            return import_file(args, settings, path)
        if args.command == "export":
            return export(args, path)
        if args.command == "reindex":
            from proxy.cli import reindex

            return reindex.run(args, settings, path)
        return asyncio.run(_with_store(COMMANDS[args.command], args, settings, path))
    except BadRequest as exc:
        print(f"engram: {exc.message}", file=sys.stderr)
        return 2
    except EngramError as exc:
        return fail(exc.message)
    except OSError as exc:
        return fail(str(exc))


def fail(message: str) -> int:
    print(f"engram: {message}", file=sys.stderr)
    return 1


async def _with_store(
    command: Command, args: argparse.Namespace, s: Settings, path: Path | str
) -> int:
    async with Store(path) as store:
        return await command(args, s, store)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


def _one_line(text: str, width: int = 120) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


# --- commands -----------------------------------------------------------------------------------


async def search(args: argparse.Namespace, settings: Settings, store: Store) -> int:
    user = api.clean_user(args.user)
    query = api.clean_query(args.query)
    k, mode = api.parse_k(str(args.k)), api.parse_mode(args.mode)
    embedder = await open_embedder(settings, store) if mode != "fts" else None
    try:
        retriever = Retriever(store, embedder, settings.retrieval)
        hits = await api.search(store, retriever, user, query, k=k, mode=mode, session=args.session)
    finally:
        if embedder is not None:
            await embedder.aclose()
    if args.json:
        results = [api.hit_json(h) for h in hits]
        _print_json({"user": user, "mode": mode, "k": k, "results": results})
        return 0
    if not hits:
        print("no results")
    for i, hit in enumerate(hits, 1):
        ranks = "  ".join(f"{p} {hit.ranks.get(p) or '-':>3}" for p in ("fts", "vec"))
        t = hit.turn
        via = f"  via {t.api}" if t.api else ""
        when = api.iso(t.timestamp)[:16]
        print(f"{i:>3}. {hit.score:.4f}  {ranks}  {when}  {t.session_id}{via}  turn {t.id}")
        print(f"     {t.speaker or t.role}: {_one_line(t.content)}")
    return 0


async def sessions(args: argparse.Namespace, settings: Settings, store: Store) -> int:
    users = [api.clean_user(args.user)] if args.user else await store.list_users()
    rows = [row for user in users for row in await api.sessions_json(store, user)]
    if args.json:
        _print_json({"sessions": rows})
        return 0
    if not rows:
        print("no sessions")
    for r in rows:
        extra = f"  parent {r['parent']}" if r["parent"] else ""
        extra += f"  agent {r['agent']}" if r["agent"] else ""
        print(
            f"{r['user']:<20} {r['id']:<28} {r['turns']:>6} turns  "
            f"last seen {r['last_seen_iso'][:16]}{extra}"
        )
    return 0


def export(args: argparse.Namespace, path: Path | str) -> int:
    out: TextIO = (
        open(args.output, "w", encoding="utf-8", opener=_private)  # noqa: SIM115
        if args.output
        else sys.stdout
    )
    try:
        counts = asyncio.run(_export(path, args.user, out))
    finally:
        if out is not sys.stdout:
            out.close()
    where = f" to {args.output}" if args.output else ""
    print(f"exported {counts['session']} sessions, {counts['turn']} turns{where}", file=sys.stderr)
    return 0


def _private(path: str, flags: int) -> int:
    """Open a new export file 0600 (umask aside): it holds memory."""
    return os.open(path, flags, 0o600)


async def _export(path: Path | str, user: str | None, out: TextIO) -> dict[str, int]:
    counts = {"session": 0, "turn": 0}
    async with Store(path) as store:
        for name in [api.clean_user(user)] if user else await store.list_users():
            async for item in store.export(name):
                counts[item["type"]] += 1
                out.write(json.dumps(export_line(item), ensure_ascii=False) + "\n")
    return counts


def read_jsonl(path: Path) -> Iterator[tuple[int, Source]]:
    """(line number, parsed record or error) for every non-blank line."""
    with path.open("rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield n, LineError(n, "not valid UTF-8")
                continue
            text = text.lstrip("\ufeff") if n == 1 else text
            if text.strip():
                yield n, parse_line(n, text)


def import_file(args: argparse.Namespace, settings: Settings, db: Path | str) -> int:
    path = Path(args.file)
    if not path.is_file():
        return fail(f"no file {path}")
    if args.batch < 1:
        raise BadRequest("--batch must be at least 1")
    with path.open("rb") as fh:
        total = sum(1 for line in fh if line.strip())
    # shared, as a server's: never beside `engram reindex` (a file lock, or an advisory one)
    lock = DatabaseLock(db) if isinstance(db, Path) else PgReindexLock(db)
    try:
        lock.acquire(exclusive=False)
    except DatabaseBusy:
        return fail(f"`engram reindex` is re-embedding {display(db)}; import when it has finished")
    progress = Progress(total, sys.stderr)
    try:
        report = asyncio.run(_import(settings, db, path, args.batch, progress))
    finally:
        progress.close()
        lock.release()
    for err in report.errors[:MAX_ERRORS_SHOWN]:
        print(f"{path}:{err.line}: {err.reason}", file=sys.stderr)
    if len(report.errors) > MAX_ERRORS_SHOWN:
        print(f"... and {len(report.errors) - MAX_ERRORS_SHOWN} more bad lines", file=sys.stderr)
    summary = (
        f"imported {report.imported} turns ({report.vectors} with vectors) from "
        f"{report.lines} lines; {report.sessions} new sessions; "
        f"{report.duplicates} already stored; {len(report.errors)} bad lines"
    )
    if report.unembedded:
        summary += f"; {report.unembedded} stored without vectors (embedding failed)"
    print(summary)
    return 0 if report.good > 0 else 1


async def _import(
    settings: Settings, db: Path | str, path: Path, batch: int, progress: Progress
) -> ImportReport:
    # A bulk import is not serving chats: the model may use every core, as several sessions of
    # fewer threads each embedding part of every batch (as engram reindex does: 2 x 1 on 2 cores
    # outran 1 x 2 by about a third).
    count, threads = session_layout(os.cpu_count() or 1)
    settings = replace(settings, "embedder", threads=threads, batch_size=EMBED_BATCH)
    async with Store(db) as store:
        embedder = await open_embedder(settings, store)
        if embedder is not None and count > 1:
            more = [
                await load_embedder(settings.embedder, threads=threads, batch_size=EMBED_BATCH)
                for _ in range(count - 1)
            ]
            embedder = EmbedderPool([embedder, *more])
        try:
            return await import_records(
                store,
                embedder,
                read_jsonl(path),
                batch,
                lambda r: progress.update(r.lines, f"{r.imported} turns, {len(r.errors)} bad"),
                redact=redact if settings.memory.redact_secrets else None,
            )
        finally:
            if embedder is not None:
                await embedder.aclose()


async def stats(args: argparse.Namespace, settings: Settings, store: Store) -> int:
    st = await store.stats()
    per_user = {
        user: {"sessions": len(await store.list_sessions(user)), "turns": st.per_user.get(user, 0)}
        for user in await store.list_users()
    }
    tokens = token_figures(await store.read(read_counters), settings)
    loop = await store.read(memory_counts)
    slots = await offline_stats(settings.slots, store)
    data = {
        **dataclasses.asdict(st),
        "db": store.display,  # a URL without its password
        "per_user": per_user,
        "tokens": tokens,
        **loop,
        "slots": slots,
    }
    if args.json:
        _print_json(data)
        return 0
    for key in ("db", "schema_version", "users", "sessions", "turns", "vectors"):
        print(f"{key:<15} {data[key]}")
    print(f"{'size':<15} {st.db_bytes / 1e6:.2f} MB (+ {st.wal_bytes / 1e6:.2f} MB WAL)")
    for user, c in per_user.items():
        print(f"  {user:<30} {c['sessions']:>6} sessions {c['turns']:>8} turns")
    for line in loop_lines(tokens, loop):
        print(line)
    for line in slot_lines(slots):
        print(line)
    return 0


def slot_lines(slots: dict[str, Any]) -> list[str]:
    """The tool-result slot figures per backend, as ``engram stats`` prints them."""
    lines = [f"{'slots':<15} new slots go to {slots['backend']}"]
    for backend in ("embedded", "redis"):
        f = slots.get(backend)
        if f is None:
            continue
        held = (
            f"{f['slots']} slots, {f['bytes'] / 1e6:.2f} MB" if f.get("up", True) else "unreachable"
        )
        lines.append(
            f"  {backend:<13} {held}; {f['hits']} hits, {f['misses']} misses (unknown or "
            f"expired), {f['puts']} puts, {f['errors']} errors"
        )
    return lines


def loop_lines(tokens: dict[str, Any], loop: dict[str, Any]) -> list[str]:
    """The token figures and the feedback loop's counts, as ``engram stats`` prints them."""

    def spent(name: str) -> str:
        return (
            f"{tokens[name]} ({tokens[name + '_share']:.2%} of proxied; "
            f"budget {tokens[name + '_budget_share']:.0%})"
        )

    q, fb = loop["queue"], loop["feedback"]
    return [
        f"{'tokens proxied':<15} {tokens['proxied']}",
        f"  {'summaries':<13} {spent('summaries')}  (rolling summaries and hand-backs)",
        f"  {'consolidation':<13} {spent('consolidation')}",
        f"{'hand-backs':<15} {loop['handbacks']}",
        f"{'facts':<15} {loop['facts']}",
        f"{'feedback':<15} {fb['unhelpful']} flagged, {fb['helpful']} helpful "
        f"({loop['requests']} requests recorded)",
        f"{'queue':<15} {q['pending']} pending, {q['done']} done, {q['failed']} failed",
    ]


COMMANDS: dict[str, Command] = {
    "search": search,
    "sessions": sessions,
    "stats": stats,
    **corrections.COMMANDS,
}
