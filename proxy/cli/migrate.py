"""``engram migrate --from SOURCE --to DEST``: copy a memory store to the other backend
(SQLite to PostgreSQL or back; ``sqlite:PATH``, a bare path, ``postgresql://`` or ``postgres://``).
What is copied, in which order, and what is refused: :mod:`proxy.store.transfer`. Here: the
arguments, the connections (the destination migrated and, a SQLite one, locked), the progress
bar on stderr and the summary on stdout. A URL is only ever shown without its password.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from proxy.cli.progress import Progress
from proxy.store import backend
from proxy.store.sqlite.db import Connection
from proxy.store.sqlite.lock import DatabaseBusy, DatabaseLock
from proxy.store.transfer import Refused, Report, migrate, parse_target


def run(args: argparse.Namespace) -> int:
    """``engram migrate``; the exit code (1: refused or failed, 130: interrupted)."""
    if args.batch < 1 or (args.limit is not None and args.limit < 0):
        print("engram: --batch must be at least 1 and --limit at least 0", file=sys.stderr)
        return 2
    progress = Progress(0, sys.stderr, unit="rows")
    try:
        source, dest = parse_target(args.source), parse_target(args.dest)
        with _opened(source, dest) as (src, dst):
            report = migrate(
                src,
                dst,
                batch=args.batch,
                limit=args.limit,
                force=args.force,
                on_start=lambda r: _started(r, source, dest, progress),
                on_progress=lambda r, name: progress.update(r.seen, name),
            )
    except KeyboardInterrupt:
        progress.close()
        print("engram: migrate interrupted; run it again to continue", file=sys.stderr)
        return 130
    except (Refused, DatabaseBusy) as exc:
        progress.close()
        print(f"engram: not migrating: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a driver's error: its first line never holds a password
        progress.close()
        from proxy.store.postgres.connection import redact_error

        print(f"engram: migrate failed: {redact_error(exc)}", file=sys.stderr)
        return 1
    progress.close()
    print(_summary(report, dest))
    return 0


@contextlib.contextmanager
def _opened(source: str | Path, dest: str | Path) -> Iterator[tuple[Connection, Connection]]:
    """The source (migrated, then read-only) and the destination (migrated; a SQLite one
    locked: no server may use it meanwhile)."""
    if str(source) == str(dest):
        raise Refused("the source and the destination are the same")
    if not backend.is_url(source) and not Path(source).is_file():
        raise Refused(f"no SQLite file at {source}")
    with contextlib.ExitStack() as stack:
        if not backend.is_url(dest):
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
            lock = DatabaseLock(Path(dest))
            lock.acquire(exclusive=True)
            stack.callback(lock.release)
        _migrated(source).close()  # an older source's schema brought up to date first
        dst = stack.enter_context(contextlib.closing(_migrated(dest)))
        src = backend.open_connection(source, readonly=True)
        stack.callback(src.close)
        yield src, dst


def _migrated(target: str | Path) -> Connection:
    """A read-write connection to ``target``, its migrations applied."""
    conn = backend.open_connection(target)
    try:
        backend.migrate(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def _started(report: Report, source: str | Path, dest: str | Path, progress: Progress) -> None:
    progress.restart(report.total)
    print(f"copying {report.total} rows from {_shown(source)} to {_shown(dest)}", file=sys.stderr)


def _shown(target: str | Path) -> str:
    return backend.display(target) if backend.is_url(target) else f"sqlite:{target}"


def _summary(report: Report, dest: str | Path) -> str:
    tables = ", ".join(f"{n} {c}" for n, c in report.copied.items() if c)
    what = f"copied {report.inserted} rows to {_shown(dest)}" + (f" ({tables})" if tables else "")
    if not report.finished:
        return f"{what}; stopped at --limit: run `engram migrate` again to continue"
    return f"{what}; done ({report.seen} rows looked at)"
