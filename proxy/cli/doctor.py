"""``engram doctor``: check what Engram needs, one line each, ok or FAIL with the detail.

SQLite driver and version, FTS5, sqlite-vec, the database file (on PostgreSQL instead: the
server, pgvector and the schema's version, :mod:`proxy.cli.doctor_pg`), the embedding model
(loads and embeds a sentence), whose model the database's vectors are (the configured one, or
``engram reindex`` is due), the upstream (found and answering), Redis when one is configured.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import time
from pathlib import Path
from typing import Any

from proxy.cli.checks import Check
from proxy.config import Settings
from proxy.masking import display_url
from proxy.paths import default_db_path, store_target
from proxy.redact import redact
from proxy.search.embedder import DEFAULT_MODEL, PREVIOUS_DEFAULT
from proxy.search.loading import ModelUnavailable, load_embedder
from proxy.search.model_check import REINDEX, mismatch_message
from proxy.store.backend import display, is_url
from proxy.store.sqlite.db import database_info
from proxy.store.store import Store
from proxy.store.vectable import vector_state
from proxy.upstream import LLAMACPP_DEFAULT, OLLAMA_DEFAULT, Upstream, detect


def sqlite_checks() -> list[Check]:
    try:
        info = database_info()
    except Exception as exc:
        return [Check("sqlite", False, str(exc))]
    return [
        Check("sqlite", True, f"driver {info.driver}, SQLite {info.sqlite_version}"),
        Check("fts5", info.fts5, "available" if info.fts5 else "this SQLite build lacks FTS5"),
        Check(
            "sqlite-vec",
            info.vec_version is not None,
            f"version {info.vec_version}" if info.vec_version else "not loaded",
        ),
    ]


def database_path(settings: Settings) -> Path:
    """The database file the settings name (nothing is created)."""
    configured = settings.memory.db_path
    return Path(configured).expanduser() if configured else default_db_path()


def database_target(settings: Settings) -> str | Path:
    """The store the settings name: the PostgreSQL URL (``backend = "postgres"``) or the
    SQLite file (nothing is created)."""
    memory = settings.memory
    if memory.backend == "postgres":
        return store_target(memory.backend, memory.postgres_url, memory.db_path)
    return database_path(settings)


def _missing_database(path: Path) -> Check | None:
    if path.exists():
        return None
    folder = next((p for p in path.parents if p.exists()), None)
    if folder is not None and os.access(folder, os.W_OK):
        return Check("database", True, f"{path}: not created yet (created on first use)")
    return Check("database", False, f"{path}: cannot be created (no write access to {folder})")


async def database_check(settings: Settings) -> Check:
    target = database_target(settings)
    shown = display(target)
    if not is_url(target):
        missing = _missing_database(Path(target))
        if missing is not None:
            return missing
    try:
        async with Store(target) as store:
            st = await store.stats()
    except Exception as exc:
        return Check("database", False, f"{shown}: {redact(str(exc))}")
    return Check(
        "database",
        True,
        f"{shown}: schema {st.schema_version}, {st.sessions} sessions, {st.turns} turns, "
        f"{st.vectors} vectors, {st.db_bytes / 1e6:.1f} MB",
    )


async def embedder_check(settings: Settings) -> tuple[Check, tuple[str, int] | None]:
    """The model's check, and its name and dimension when it works."""
    cfg = settings.embedder
    start = time.perf_counter()
    try:
        embedder = await load_embedder(cfg)
    except ModelUnavailable as exc:
        return Check("model", False, str(exc)), None
    try:
        (vec,) = await embedder.embed_queries(["Engram doctor: does the embedding model work?"])
    except Exception as exc:
        return Check("model", False, f"{cfg.model}: {exc}"), None
    finally:
        await embedder.aclose()
    ms = (time.perf_counter() - start) * 1000
    detail = f"{embedder.name}: {vec.shape[0]}-d, loaded and embedded in {ms:.0f} ms"
    return Check("model", True, detail), (embedder.name, int(vec.shape[0]))


async def vectors_check(settings: Settings, model: tuple[str, int] | None) -> Check:
    """Whose model the stored vectors are, against the configured one."""
    target = database_target(settings)
    if isinstance(target, Path) and not target.exists():
        return Check("vectors", None, "no database yet")
    try:
        async with Store(target) as store:
            state = await store.read(vector_state)
    except Exception as exc:
        return Check("vectors", False, f"{display(target)}: {redact(str(exc))}")
    if model is None:
        return Check("vectors", None, f"{state.vectors} vectors of {state.model or 'no model'}")
    name, dim = model
    if state.vectors and name == DEFAULT_MODEL and state.model == PREVIOUS_DEFAULT:
        return Check(
            "vectors",
            True,
            f"{state.vectors} vectors of the previous default model {PREVIOUS_DEFAULT}, which "
            f"serves this database while embedder.model is the default; `{REINDEX}` re-embeds "
            f"its {state.turns} turns with {DEFAULT_MODEL} (twice as fast per text)",
        )
    if state.vectors and (state.model != name or state.dim != dim):
        return Check("vectors", False, mismatch_message(state, name, dim, display(target)))
    detail = f"{state.vectors} of {state.turns} turns with text have a vector of {name} ({dim}-d)"
    if state.vectors < state.turns:
        detail += f"; the rest get one in the background, or now with `{REINDEX}`"
    if state.build_model is not None:
        detail += (
            f"; a reindex towards {state.build_model} was left after {state.built} turns "
            "(it continues when run with that model)"
        )
    return Check("vectors", True, detail)


async def upstream_check(settings: Settings) -> Check:
    info = await detect(settings.upstream)
    if info.found_by == "fallback":
        return Check(
            "upstream",
            False,
            f"nothing answers on {LLAMACPP_DEFAULT} (llama.cpp) or {OLLAMA_DEFAULT} (Ollama); "
            "start one or pass --upstream URL",
        )
    upstream = Upstream(settings.upstream, info)
    try:
        ok, detail = await upstream.probe()
    finally:
        await upstream.close()
    shown = display_url(info.url)
    return Check("upstream", ok, f"{shown} ({info.kind}, {info.found_by}): {redact(detail)}")


async def redis_check(settings: Settings) -> Check:
    slots: Any = getattr(settings, "slots", None)
    url = getattr(slots, "redis_url", "") if slots is not None else ""
    if not url:
        return Check("redis", None, "not configured (tool slots use SQLite)")
    shown = display_url(url)
    try:
        module: Any = importlib.import_module("redis.asyncio")
        client = module.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        try:
            await client.ping()
        finally:
            await client.aclose()
    except Exception as exc:
        return Check("redis", False, f"{shown}: {redact(str(exc))}")
    return Check("redis", True, f"{shown}: PING answered")


def _not_opened(found: list[Check]) -> str:
    """Why the PostgreSQL store was not opened, from its checks."""
    by_name = {c.name: c for c in found}
    if not by_name["postgres"].ok:
        return "PostgreSQL not reached"
    schema = by_name.get("schema")
    if schema is not None and schema.ok and schema.detail.startswith("none yet"):
        return "no schema yet"
    return "the schema or pgvector is not as this Engram needs"


async def store_checks(settings: Settings, model: tuple[str, int] | None) -> list[Check]:
    """SQLite's checks, the database and its vectors; on PostgreSQL the server's, pgvector's
    and the schema's first, and the store opened only when the schema is this Engram's (so
    that doctor never migrates a database)."""
    target = database_target(settings)
    if not is_url(target):
        return [
            *sqlite_checks(),
            await database_check(settings),
            await vectors_check(settings, model),
        ]
    from proxy.cli.doctor_pg import postgres_state  # imported late: it loads psycopg

    state = await asyncio.to_thread(postgres_state, str(target))
    if not state.schema_current:
        skipped = _not_opened(state.checks)
        return [
            *state.checks,
            Check("database", None, skipped),
            Check("vectors", None, skipped),
        ]
    return [*state.checks, await database_check(settings), await vectors_check(settings, model)]


async def checks(settings: Settings) -> list[Check]:
    model_check, model = await embedder_check(settings)
    store = await store_checks(settings, model)
    return [
        *store[:-1],
        model_check,
        store[-1],
        await upstream_check(settings),
        await redis_check(settings),
    ]


async def run_doctor(settings: Settings) -> int:
    """Print every check; 1 if any failed."""
    results = await checks(settings)
    for check in results:
        print(check.line())
    return 1 if any(c.ok is False for c in results) else 0
