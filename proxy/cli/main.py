"""The `engram` command: build settings from file, environment and flags; run a subcommand."""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy import __version__, logs
from proxy.cli import keys, workers
from proxy.config import ConfigError, Settings, load_settings, render_defaults

log = logging.getLogger("engram.cli")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a TOML settings file (default: $ENGRAM_CONFIG if set)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engram", description="A local memory layer for OpenAI-compatible LLM servers."
    )
    parser.add_argument("--version", action="version", version=f"engram {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the proxy")
    _common(serve)
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8787)")
    serve.add_argument(
        "--workers", type=int, metavar="N", help="processes serving the port (default 1)"
    )
    serve.add_argument(
        "--allow-remote",
        action="store_true",
        default=None,
        help="allow binding a non-loopback address",
    )
    serve.add_argument(
        "--upstream",
        metavar="URL",
        help="model server base URL (default: auto-detect llama.cpp, then Ollama)",
    )
    serve.add_argument("--context-size", type=int, help="the upstream's context window in tokens")
    serve.add_argument("--log-level", help="debug, info, warning or error")
    serve.add_argument("--db", metavar="PATH", help="the memory database file")

    _memory_commands(sub)
    keys.add_parser(sub, _common)
    _migrate_command(sub)

    cfg = sub.add_parser("config", help="print settings")
    _common(cfg)
    cfg.add_argument(
        "--defaults",
        action="store_true",
        help="print every default as commented TOML (config/engram.toml)",
    )
    return parser


MEMORY_COMMANDS = (
    "search",
    "sessions",
    "forget",
    "note",
    "fact",
    "pin",
    "mute",
    "unpin",
    "export",
    "import",
    "stats",
    "doctor",
    "reindex",
)


def _memory_commands(sub: Any) -> None:
    """The commands that read or change memory (implemented in proxy.cli.commands)."""

    def add(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description)
        _common(p)
        p.add_argument("--db", metavar="PATH", help="the memory database file")
        return p

    p = add("search", "search one user's memory")
    p.add_argument("query", help="the text to search for")
    p.add_argument("--user", help="user namespace (default: default)")
    p.add_argument("--session", help="only this session")
    p.add_argument("-k", type=int, default=10, help="how many results (1-100, default 10)")
    p.add_argument("--mode", default="hybrid", choices=("hybrid", "fts", "vec"))
    p.add_argument("--json", action="store_true", help="print JSON")
    p = add("sessions", "list sessions")
    p.add_argument("--user", help="only this user namespace (default: every user)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = add(
        "forget",
        "delete a session, a turn (--turn ID) or (--user U --all --yes) a whole user namespace",
    )
    p.add_argument("session", nargs="?", metavar="SESSION_ID")
    p.add_argument(
        "--turn",
        metavar="ID",
        help="delete this turn and what was made from it (facts, summaries, hand-backs)",
    )
    p.add_argument(
        "--user", help="the user namespace (default: a session's owner; a turn's: default)"
    )
    p.add_argument("--all", action="store_true", help="delete everything of --user")
    p.add_argument("--yes", action="store_true", help="confirm --all")
    p = add("note", "add a note, recalled like a turn of yours (prints its turn id)")
    p.add_argument("text", metavar="TEXT", help='what to remember ("I moved to Lisbon")')
    p.add_argument("--user", help="user namespace (default: default)")
    p = add("fact", "correct or delete a fact that consolidation distilled")
    p.add_argument("--user", help="user namespace (default: default)")
    facts = p.add_subparsers(dest="action", required=True, metavar="{edit,delete}")
    for name, help in (("edit", "replace a fact's text (it gets a new id)"), ("delete", "")):
        f = facts.add_parser(name, help=help or "delete a fact and its words")
        # Given after the action too; SUPPRESS keeps a value given before it.
        f.add_argument("--config", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        f.add_argument(
            "--db", metavar="PATH", default=argparse.SUPPRESS, help="the memory database file"
        )
        f.add_argument("id", metavar="ID", help="the fact's turn id (engram search shows it)")
        if name == "edit":
            f.add_argument("text", metavar="TEXT", help="what the fact says now")
        f.add_argument(
            "--user", default=argparse.SUPPRESS, help="user namespace (default: default)"
        )
    for name, help in (
        ("pin", "recall a turn into every chat of its user"),
        ("mute", "never recall a turn"),
        ("unpin", "recall a turn only when search finds it (undoes pin and mute)"),
    ):
        p = add(name, help)
        p.add_argument("id", metavar="ID", help="the turn's id (engram search shows it)")
        p.add_argument("--user", help="user namespace (default: default)")
    p = add("export", "write memory as JSON Lines (readable by engram import)")
    p.add_argument("--user", help="only this user namespace (default: every user)")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p = add("import", "import turns from a JSON Lines file")
    p.add_argument("file", metavar="FILE.jsonl")
    p.add_argument("--batch", type=int, default=256, help="lines per batch (default 256)")
    p = add("stats", "counts and sizes")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = add("doctor", "check the store (SQLite or PostgreSQL, pgvector), the model, the upstream")
    p.add_argument("--upstream", metavar="URL", help="model server base URL")
    p = add(
        "reindex",
        "re-embed every turn with the configured embedding model (resumable)",
        "Give every turn a vector of embedder.model: those whose vector is missing or was made "
        "by another model (after embedder.model changed). The current vectors keep serving "
        "until the new ones replace them in one step at the end; interrupted (Ctrl-C, a crash), "
        "it continues where it stopped when run again. Stop `engram serve` on the database "
        "first: reindex refuses to run beside it.",
    )
    p.add_argument("--batch", type=int, default=256, help="turns per step (default 256)")
    p.add_argument(
        "--limit", type=int, metavar="N", help="stop after N turns (run again to continue)"
    )


def _migrate_command(sub: Any) -> None:
    """``engram migrate`` (implemented in proxy.cli.migrate)."""
    p: argparse.ArgumentParser = sub.add_parser(
        "migrate",
        help="copy memory to another backend (SQLite <-> PostgreSQL; resumable)",
        description="Copy every user's memory from one database to another: a SQLite file "
        "(sqlite:PATH or a path) or PostgreSQL (postgresql://...). Vectors are copied, not "
        "recomputed; interrupted, it continues where it stopped when run again; run again "
        "after it finished, it copies only what is new. Stop `engram serve` on both first.",
    )
    _common(p)
    p.add_argument("--from", dest="source", required=True, metavar="SOURCE")
    p.add_argument("--to", dest="dest", required=True, metavar="DEST")
    p.add_argument("--batch", type=int, default=1000, help="rows per step (default 1000)")
    p.add_argument(
        "--limit", type=int, metavar="N", help="stop after N rows (run again to continue)"
    )
    p.add_argument(
        "--force", action="store_true", help="copy into another install's database anyway"
    )


def _overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    flags = {
        ("server", "host"): getattr(args, "host", None),
        ("server", "port"): getattr(args, "port", None),
        ("server", "workers"): getattr(args, "workers", None),
        ("server", "allow_remote"): getattr(args, "allow_remote", None),
        ("server", "log_level"): getattr(args, "log_level", None),
        ("upstream", "url"): getattr(args, "upstream", None),
        ("upstream", "context_size"): getattr(args, "context_size", None),
        ("memory", "db_path"): getattr(args, "db", None),
    }
    out: dict[str, dict[str, Any]] = {}
    for (section, key), value in flags.items():
        if value is not None:
            out.setdefault(section, {})[key] = value
    return out


def settings_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Settings:
    env = dict(os.environ if environ is None else environ)
    config_file = args.config or (Path(env["ENGRAM_CONFIG"]) if env.get("ENGRAM_CONFIG") else None)
    return load_settings(config_file, env, _overrides(args))


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


KEY_HINT = "create one with `engram keys create --user NAME` (same --db / --config as serve)"


def remote_refusal(settings: Settings) -> str | None:
    """Why a non-loopback bind must not start (None when it may): it needs allow_remote, and
    accounts (auth.mode = keys) with at least one key or a trusted front-end."""
    server, auth = settings.server, settings.auth
    if is_loopback_host(server.host):
        return None
    if not server.allow_remote:
        return (
            "it is not a loopback address and would expose your memory to the network. "
            "Pass --allow-remote (or set server.allow_remote = true) if you mean it, with "
            "auth.mode = keys."
        )
    if auth.mode != "keys":
        return (
            "auth.mode is 'none', so anyone on the network could read and write every user's "
            f"memory. Set auth.mode = keys (ENGRAM_AUTH_MODE=keys) and {KEY_HINT}."
        )
    if not auth.trusted_proxy_secret and not _active_keys(settings):
        return f"auth.mode = keys but the database holds no key yet: {KEY_HINT}."
    return None


def _active_keys(settings: Settings) -> int:
    from proxy.paths import store_target
    from proxy.store.keys import count_active_keys
    from proxy.store.store import Store

    memory = settings.memory
    target = store_target(memory.backend, memory.postgres_url, memory.db_path)

    async def count() -> int:
        async with Store(target) as store:
            return await store.read(count_active_keys)

    return asyncio.run(count())


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    """uvloop when asked for or available (``auto``), else the standard loop."""
    if kind in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise ConfigError(
                    "config: server.event_loop = 'uvloop' but uvloop is not "
                    "installed (pip install uvloop)"
                ) from None
        else:
            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return loop
    return asyncio.new_event_loop()


def serve(settings: Settings, argv: Sequence[str] = ()) -> int:
    """Run the proxy (``argv``: the command line, which ``--workers`` runs once per worker)."""
    server = settings.server
    listener = logs.setup(server.log_level, server.log_format)
    try:
        if server.workers > 1 and workers.worker_number() is None:
            return _supervise(settings, argv)
        return _serve(settings)
    finally:
        listener.stop()


def _supervise(settings: Settings, argv: Sequence[str]) -> int:
    why = workers.refusal(settings) or remote_refusal(settings)
    if why:
        print(f"engram: not starting {settings.server.workers} workers: {why}", file=sys.stderr)
        return 2
    if not settings.upstream.url:
        log.warning("workers never start the bundled tiny model: set upstream.url if none is found")
    return workers.Supervisor(settings, argv).run()


async def _freeze(_app: web.Application) -> None:
    """What start-up made (modules, the model's wrappers, caches' structures) lives as long as
    the process: out of the collector's reach, so that a full collection under load walks only
    what requests made (memory on, in process: 97 ms of collections in 10 s, one of them a full
    one stopping the event loop for ~90 ms, became 7 ms and none)."""
    gc.collect()
    gc.freeze()


def _serve(settings: Settings) -> int:
    from proxy.app import create_app  # imported late: `engram config` needs no aiohttp app

    server = settings.server
    refusal = remote_refusal(settings)
    if refusal:
        print(f"engram: refusing to bind {server.host}: {refusal}", file=sys.stderr)
        return 2
    if not is_loopback_host(server.host):
        log.warning(
            "binding %s: Engram is reachable from the network; every request needs a key",
            server.host,
        )
    elif settings.auth.mode == "keys" and not _active_keys(settings):
        log.warning("auth.mode = keys but no key exists: every request gets a 401; %s", KEY_HINT)
    app = create_app(settings)
    app.on_startup.append(_freeze)  # after the services' start (the cleanup context's)

    number = workers.worker_number()

    def announce(text: str) -> None:
        if number is not None and number > 1:
            return  # the first worker speaks for all
        log.info(
            "engram %s listening on http://%s:%d — point OPENAI_BASE_URL at http://%s:%d/v1",
            __version__,
            server.host,
            server.port,
            server.host,
            server.port,
        )
        if settings.inspector.enabled and settings.memory.enabled:
            log.info(
                "the inspector: http://%s:%d/engram/ (sign in with `engram keys admin-token`)",
                server.host,
                server.port,
            )

    from proxy.services import StartupRefused

    try:
        web.run_app(
            app,
            loop=new_event_loop(server.event_loop),
            host=server.host,
            port=server.port,
            shutdown_timeout=server.shutdown_timeout,
            handler_cancellation=True,
            access_log=None,
            print=announce,
            reuse_port=number is not None,  # the other workers bind the same port
        )
    except StartupRefused as exc:
        print(f"engram: not starting: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
        if args.command == "serve":
            return serve(settings, sys.argv[1:] if argv is None else argv)
        if args.command == "keys":
            return keys.run(args, settings)
        if args.command == "migrate":
            from proxy.cli import migrate  # imported late: it loads the store

            return migrate.run(args)
        if args.command in MEMORY_COMMANDS:
            from proxy.cli import commands  # imported late: it loads the store and the embedder

            logs.setup_cli()

            return commands.run(args, settings)
    except ConfigError as exc:
        print(f"engram: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        if args.defaults:
            sys.stdout.write(render_defaults())
        else:
            import json

            from proxy.masking import masked_settings

            print(json.dumps(masked_settings(settings), indent=2))
        return 0
    return 2
