"""Everything a running Engram holds, opened in order and closed in reverse, in one place.

:func:`open_services` is an async context manager built on one ``AsyncExitStack``: each part is
opened and its closing registered right away, so whatever was opened is closed however start-up
or shutdown goes, and a part that fails to close is logged without stopping the rest. Shutdown
order: the periodic loops stop, background tasks drain, the token counters are saved, then the
slot store, embedder, database, upstream client and bundled model server close.

The app keeps the result in one key, :data:`SERVICES`; nothing else is global.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from proxy import bundled
from proxy.auth import Authenticator, load_admin_token
from proxy.background.consolidation import Consolidator
from proxy.background.feedback import Feedback
from proxy.background.handback import Handback
from proxy.background.indexer import Indexer
from proxy.background.stats import CALIBRATE_EVERY, FLUSH_EVERY, Calibration, Counters
from proxy.background.summarizer import Summarizer
from proxy.chat.apis import chat_apis
from proxy.chat.memory import MemoryService
from proxy.chat.pipeline import ChatPipeline
from proxy.cli.workers import worker_number
from proxy.config import Settings
from proxy.idle import UpstreamActivity
from proxy.keys import new_admin_token
from proxy.logs import event
from proxy.masking import display_url
from proxy.paths import db_path, store_target
from proxy.rendering import rendered_tokens
from proxy.search.embedder import Embedder
from proxy.search.model_check import ModelUnavailable, VectorsMismatch, usable_embedder
from proxy.search.retrieval import Retriever
from proxy.slots.store import SlotStore
from proxy.store import queries
from proxy.store.caches.warm import cache_split
from proxy.store.changes import Deleted
from proxy.store.postgres.connection import PostgresUnavailable
from proxy.store.sqlite.lock import DatabaseBusy, DatabaseLock
from proxy.store.store import Store
from proxy.tasks import BackgroundTasks, every, stop
from proxy.tokens import TokenCounter, load_encoder
from proxy.upstream import Upstream, UpstreamInfo, detect

log = logging.getLogger("engram.services")

FOLLOW_EVERY = 1.0
"""Seconds between two reads of the changes log when no search reads it (proxy.store.changes)."""
PRUNE_CHANGES_EVERY = 60.0
"""Seconds between two prunes of PostgreSQL's changes log when consolidation is off."""
FENCE_SECRET_KEY = "fence_secret"
ADMIN_TOKEN_KEY = "admin_token"  # on PostgreSQL, when memory.admin_token is not set
"""The ``meta`` key of the memory block's tag secret (shared by every process on the database)."""
FTS_ONLY_HINT = (
    'To start anyway with full-text search only, set embedder.on_unusable = "fts-only" '
    "(ENGRAM_EMBEDDER_ON_UNUSABLE=fts-only)."
)


class StartupRefused(RuntimeError):
    """Engram must not start as configured; the message says why and what to do."""


@dataclass(frozen=True)
class MemoryParts:
    """What memory adds (``memory.enabled``); ``slots`` is None with ``slots.enabled = false``."""

    memory: MemoryService
    store: Store
    retriever: Retriever
    consolidator: Consolidator
    counters: Counters
    slots: SlotStore | None
    calibration: Calibration


@dataclass(frozen=True)
class Services:
    """The parts of a running Engram; ``parts`` is None with ``memory.enabled = false``."""

    settings: Settings
    started: float
    upstream: Upstream
    tasks: BackgroundTasks
    pipeline: ChatPipeline  # OpenAI chat completions'
    parts: MemoryParts | None
    auth: Authenticator
    pipelines: dict[str, ChatPipeline]  # every chat API's, by adapter name
    activity: UpstreamActivity  # requests in flight; Engram's own calls wait for a pause

    def require_memory(self) -> MemoryParts:
        """The memory parts; RuntimeError when memory is disabled (for tools and benchmarks)."""
        if self.parts is None:
            raise RuntimeError("memory is disabled (memory.enabled = false)")
        return self.parts

    @property
    def memory(self) -> MemoryService | None:
        return self.parts.memory if self.parts else None

    @property
    def store(self) -> Store | None:
        return self.parts.store if self.parts else None

    @property
    def retriever(self) -> Retriever | None:
        return self.parts.retriever if self.parts else None

    @property
    def consolidator(self) -> Consolidator | None:
        return self.parts.consolidator if self.parts else None

    @property
    def counters(self) -> Counters | None:
        return self.parts.counters if self.parts else None

    @property
    def slots(self) -> SlotStore | None:
        return self.parts.slots if self.parts else None


SERVICES = web.AppKey("services", Services)


@asynccontextmanager
async def open_services(
    settings: Settings, upstream_info: UpstreamInfo | None = None
) -> AsyncIterator[Services]:
    """Open every part (``upstream_info`` skips upstream detection); close them on exit."""
    started = time.time()
    async with AsyncExitStack() as stack:

        def closing(what: str, close: Callable[[], Awaitable[object]]) -> None:
            stack.push_async_callback(_quietly, what, close)

        info = upstream_info or await detect(settings.upstream)
        if info.found_by == "fallback" and settings.upstream.bundled:
            proc, info = await _start_bundled(info)
            if proc is not None:
                closing("stopping the bundled model server", lambda: bundled.stop_upstream(proc))
        _announce(info)
        upstream = Upstream(settings.upstream, info, keep_client_key=settings.auth.mode == "none")
        closing("closing the upstream client", upstream.close)
        tasks = BackgroundTasks()
        # Counted by the pipelines and the pass-through, waited on by Engram's own calls.
        activity = UpstreamActivity(
            settings.upstream.own_calls_idle, settings.upstream.own_calls_max_wait
        )
        enabled = settings.memory.enabled
        memory_cfg = settings.memory
        target = store_target(memory_cfg.backend, memory_cfg.postgres_url, memory_cfg.db_path)
        store: Store | None = None
        if enabled or settings.auth.mode == "keys":  # keys live in the database
            if isinstance(target, Path):
                _share_lock(target, closing)
            fts_memory, vec_memory = cache_split(settings.memory.cache_mb)
            store = Store(target, fts_memory=fts_memory, vec_memory=vec_memory)
            try:
                await store.open()
            except PostgresUnavailable as exc:
                raise StartupRefused(f"memory.postgres_url ({store.display}): {exc}") from None
            closing("closing the database", store.close)
        parts = (
            await _open_memory(settings, store, tasks, upstream, activity, closing)
            if store
            else None
        )
        token = await _admin_token(settings, store, target)
        auth = Authenticator(settings.auth, store, token)
        # Registered after the memory parts, so it runs before they close.
        closing("draining background tasks", lambda: tasks.drain(settings.server.shutdown_timeout))
        memory = parts.memory if parts else None
        pipelines = {
            api.name: ChatPipeline(settings, upstream, tasks, memory, api, activity)
            for api in chat_apis()
        }
        pipeline = pipelines["openai-chat"]
        services = Services(
            settings, started, upstream, tasks, pipeline, parts, auth, pipelines, activity
        )
        if info.kind in ("llamacpp", "unknown", "openai") and info.found_by != "fallback":
            size = await upstream.context_size()
            event(
                log,
                logging.INFO,
                "upstream context size",
                context_size=size if size else "unknown (set upstream.context_size)",
            )
        for loop in _loops(services):
            closing(f"stopping {loop.get_name()}", functools.partial(stop, loop))
        yield services


def _share_lock(
    path: Path, closing: Callable[[str, Callable[[], Awaitable[object]]], None]
) -> None:
    """The SQLite file's lock, shared with other servers (`engram reindex` takes it alone)."""
    lock = DatabaseLock(path)
    try:
        lock.acquire(exclusive=False)
    except DatabaseBusy:
        raise StartupRefused(
            f"`engram reindex` is re-embedding the database {path}; start again when it "
            "has finished (or stop it: it continues where it stopped next time)"
        ) from None
    closing("releasing the database lock", _async(lock.release))


async def _admin_token(settings: Settings, store: Store | None, target: str | Path) -> str:
    """``memory.admin_token``; else on SQLite the token file beside the database, on
    PostgreSQL the one kept in the database (every replica the same)."""
    configured = settings.memory.admin_token
    if store is not None and store.pg and not configured:
        made = new_admin_token()
        return await store.write(lambda c: queries.shared_value(c, ADMIN_TOKEN_KEY, made))
    path = target if isinstance(target, Path) else db_path(settings.memory.db_path)
    return await asyncio.to_thread(load_admin_token, configured, path)


def _async(fn: Callable[[], None]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        fn()

    return run


async def _quietly(what: str, close: Callable[[], Awaitable[object]]) -> None:
    try:
        await close()
    except Exception:
        log.exception("%s failed", what)


def _loops(s: Services) -> list[asyncio.Task[None]]:
    """The periodic background loops (each through :func:`proxy.tasks.every`)."""
    loops: list[asyncio.Task[None]] = []
    memory = s.memory
    if memory is None:
        return loops
    handback = memory.handback
    idle_every = handback.idle_check_interval() if handback is not None else None
    if handback is not None and idle_every is not None:
        loops.append(every(idle_every, handback.complete_idle, "completing idle sub-agents"))
    interval = s.settings.consolidation.interval
    if interval > 0 and s.consolidator is not None:
        loops.append(every(interval, s.consolidator.scheduled_pass, "consolidation pass"))
    elif s.consolidator is not None and s.parts is not None and s.parts.store.pg:
        # no passes to prune PostgreSQL's changes log at: on its own (proxy.background.changes)
        prune = s.consolidator.changes.run
        loops.append(every(PRUNE_CHANGES_EVERY, prune, "pruning the changes log"))
    if s.counters is not None:
        loops.append(every(FLUSH_EVERY, s.counters.flush, "saving the token counters"))
    if s.parts is not None:  # other processes' writes, between searches (proxy.store.changes)
        loops.append(every(FOLLOW_EVERY, s.parts.store.follow, "following other processes"))
        sync = s.parts.calibration.sync
        loops.append(every(CALIBRATE_EVERY, sync, "sharing the token corrections"))
    return loops


def _forget_views(memory: MemoryService, deleted: Deleted | None) -> None:
    """Another process deleted these turns (None: perhaps any): the views of them go, as
    :func:`proxy.api.effects.after` does for a forget in this process."""
    if deleted is None:
        memory.recent.clear()
        memory.last_requests.clear()
        return
    for user, (sessions, turns) in deleted.items():
        for sid in sessions:
            memory.last_requests.pop(sid)
        memory.recent.drop(user, tuple(sessions), turns=turns)


async def _open_memory(
    settings: Settings,
    store: Store,
    tasks: BackgroundTasks,
    upstream: Upstream,
    activity: UpstreamActivity,
    closing: Callable[[str, Callable[[], Awaitable[object]]], None],
) -> MemoryParts | None:
    if not settings.memory.enabled:
        return None
    path = store.display
    embedder = await _open_embedder(settings, store)
    if embedder is not None:
        closing("stopping the embedder", embedder.aclose)
    retriever = Retriever(store, embedder, settings.retrieval)
    tokens = TokenCounter(await asyncio.to_thread(load_encoder))
    summarizer = Summarizer(settings, store, upstream, tokens, activity)
    feedback = Feedback(settings, store, tasks)
    consolidator = Consolidator(settings, store, embedder, summarizer, feedback)
    counters = Counters(store, summarizer, consolidator)
    await counters.load()
    slots = SlotStore(settings.slots, store, settings.limits) if settings.slots.enabled else None
    if slots is not None:
        await slots.start()
        closing("closing the slot store", slots.close)
    closing("saving the token counters", counters.flush)
    indexer = Indexer(store, embedder, tasks, settings.limits.index_queue_turns)
    memory = MemoryService(
        settings,
        store,
        embedder,
        retriever,
        tasks,
        tokens,
        context_size=upstream.context_size,
        summarizer=summarizer,
        handback=Handback(settings, store, embedder, summarizer, tasks),
        feedback=feedback,
        slots=slots,
        indexer=indexer,
        # Other processes write to this database: requests in flight claim session positions
        # on it (proxy.chat.claims), not only in this process.
        shared=settings.memory.backend == "postgres" or worker_number() is not None,
    )
    # The memory block's tags the same in every process on this database, and after a
    # restart: the upstream's prompt cache keeps matching (proxy.chat.fence.block_tag).
    memory.rewriter.fence_secret = await store.write(
        lambda c: queries.shared_secret(c, FENCE_SECRET_KEY)
    )
    loop = asyncio.get_running_loop()

    def deleted_elsewhere(deleted: Deleted | None) -> None:  # a reader thread
        with contextlib.suppress(RuntimeError):  # the loop closed: nothing left to forget
            loop.call_soon_threadsafe(_forget_views, memory, deleted)

    store.follower.on_deleted = deleted_elsewhere
    calibration = Calibration(store, tokens)  # what other processes learned of token counts
    await calibration.sync()
    memory.rewriter.unlearned = calibration.take
    memory.rewriter.render_probe = functools.partial(rendered_tokens, upstream)
    closing("saving the token corrections", calibration.sync)
    # Turns archived but not indexed when Engram last stopped (a crash, a dead embedder).
    tasks.spawn(indexer.replay(), name="index-replay")
    # The recent users' terms and vectors into memory before they ask (store.warm).
    tasks.spawn(store.preload(), name="cache-preload")
    event(
        log,
        logging.INFO,
        "memory open",
        db=str(path),
        embedder=embedder.name if embedder else "none (full-text search only)",
    )
    return MemoryParts(memory, store, retriever, consolidator, counters, slots, calibration)


async def _open_embedder(settings: Settings, store: Store) -> Embedder | None:
    """The configured embedder, if it loads and the database's vectors are its own; else
    :class:`StartupRefused`, or with ``embedder.on_unusable = "fts-only"`` None (full-text
    search only, never another model's vectors)."""
    try:
        return await usable_embedder(store, settings.embedder)
    except (ModelUnavailable, VectorsMismatch) as exc:
        if settings.embedder.on_unusable == "refuse":
            raise StartupRefused(f"{exc} {FTS_ONLY_HINT}") from None
        event(log, logging.ERROR, "vector search is off (embedder.on_unusable)", reason=str(exc))
        return None


async def _start_bundled(
    info: UpstreamInfo,
) -> tuple[asyncio.subprocess.Process | None, UpstreamInfo]:
    event(
        log,
        logging.WARNING,
        "no upstream found on 127.0.0.1:8080 (llama.cpp) or 127.0.0.1:11434 (Ollama): starting "
        "the bundled tiny model (SmolLM2-135M on llama-server) so you can try Engram; it is far "
        "too small for real work. The first start builds llama-server (about 5 minutes).",
    )
    try:
        proc, url = await bundled.start_upstream()
    except (bundled.SetupError, OSError) as exc:
        event(log, logging.ERROR, "the bundled model could not start", error=str(exc))
        return None, info
    return proc, UpstreamInfo(url, "llamacpp", "bundled")


def _announce(info: UpstreamInfo) -> None:
    if info.found_by == "fallback":
        event(
            log,
            logging.WARNING,
            "no upstream found on 127.0.0.1:8080 (llama.cpp) or 127.0.0.1:11434 (Ollama); "
            "chat requests get 502 until one runs there (or pass --upstream URL)",
            upstream=display_url(info.url),
        )
    else:
        shown = display_url(info.url)
        event(log, logging.INFO, f"upstream {info.found_by}", upstream=shown, kind=info.kind)
