"""``create_app(settings)``: resources opened and closed in ``cleanup_ctx``, routes, middleware.

Nothing happens at import time and nothing is global, so two apps can run in one process.
Routes: Engram's own under ``/engram/``; chat completions through the pipeline; every other
method and path passed through to the upstream untouched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from proxy import __version__, bundled
from proxy.background.consolidation import Consolidator
from proxy.background.feedback import Feedback
from proxy.background.handback import Handback
from proxy.background.indexer import Indexer
from proxy.background.stats import FLUSH_EVERY, Counters
from proxy.background.summarizer import Summarizer
from proxy.chat.memory import MemoryService
from proxy.chat.pipeline import ChatPipeline
from proxy.config import Settings
from proxy.errors import (
    EngramError,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    error_body,
    error_response,
)
from proxy.logs import event
from proxy.paths import db_path
from proxy.relay import read_body, relay
from proxy.search.embedder import Embedder, from_settings
from proxy.search.retrieval import Retriever
from proxy.slots.store import SlotStore
from proxy.store.store import Store
from proxy.tasks import BackgroundTasks, every, stop
from proxy.tokens import TokenCounter, load_encoder
from proxy.upstream import Upstream, UpstreamInfo, detect, forward_headers

log = logging.getLogger("engram.app")
access_log = logging.getLogger("engram.access")

SETTINGS = web.AppKey("settings", Settings)
UPSTREAM = web.AppKey("upstream", Upstream)
TASKS = web.AppKey("tasks", BackgroundTasks)
PIPELINE = web.AppKey("pipeline", ChatPipeline)
STARTED = web.AppKey("started", float)
STORE = web.AppKey("store", Store)
RETRIEVER = web.AppKey("retriever", Retriever)
MEMORY = web.AppKey("memory", MemoryService)
CONSOLIDATOR = web.AppKey("consolidator", Consolidator)
COUNTERS = web.AppKey("counters", Counters)
SLOTS = web.AppKey("slots", SlotStore)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]", "localhost.localdomain"})


def create_app(settings: Settings, upstream_info: UpstreamInfo | None = None) -> web.Application:
    """Build the application. ``upstream_info`` skips detection (tests, pre-detected CLI)."""
    app = web.Application(
        client_max_size=settings.server.max_body_bytes,
        middlewares=[_middleware(settings)],
    )
    if settings.server.cors_origins:
        app.on_response_prepare.append(_cors_headers(set(settings.server.cors_origins)))
    app[SETTINGS] = settings
    app[STARTED] = time.time()
    app.cleanup_ctx.append(_resources(upstream_info))

    app.router.add_get("/engram/health", health)
    app.router.add_get("/engram/metrics", metrics)
    from proxy.api.routes import add_routes as add_admin_routes  # it imports this module's keys

    add_admin_routes(app)
    app.router.add_route("*", "/engram/{tail:.*}", engram_not_found)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/chat/completions", chat_completions)
    app.router.add_route("*", "/{tail:.*}", passthrough)
    return app


def _resources(
    upstream_info: UpstreamInfo | None,
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        info = upstream_info or await detect(settings.upstream)
        bundled_proc = None
        if info.found_by == "fallback" and settings.upstream.bundled:
            bundled_proc, info = await _start_bundled(info)
        _announce(info)
        upstream = Upstream(settings.upstream, info)
        tasks = BackgroundTasks()
        app[UPSTREAM] = upstream
        app[TASKS] = tasks
        memory = (
            await _open_memory(app, settings, tasks, upstream) if settings.memory.enabled else None
        )
        app[PIPELINE] = ChatPipeline(settings, upstream, tasks, memory)
        if info.kind in ("llamacpp", "unknown", "openai") and info.found_by != "fallback":
            size = await upstream.context_size()
            event(
                log,
                logging.INFO,
                "upstream context size",
                context_size=size if size else "unknown (set upstream.context_size)",
            )
        watchers: list[asyncio.Task[None]] = []
        if memory is not None:
            handback = memory.handback
            idle_every = handback.idle_check_interval() if handback is not None else None
            if handback is not None and idle_every is not None:
                watchers.append(
                    every(idle_every, handback.complete_idle, "completing idle sub-agents")
                )
            interval = settings.consolidation.interval
            if interval > 0:
                watchers.append(
                    every(interval, app[CONSOLIDATOR].scheduled_pass, "consolidation pass")
                )
            watchers.append(every(FLUSH_EVERY, app[COUNTERS].flush, "saving the token counters"))
        try:
            yield
        finally:
            for watcher in watchers:
                await stop(watcher)
            await tasks.drain(settings.server.shutdown_timeout)
            await upstream.close()
            if bundled_proc is not None:
                await bundled.stop_upstream(bundled_proc)
            if memory is not None:
                try:
                    await app[COUNTERS].flush()
                except Exception:
                    log.exception("saving the token counters at shutdown failed")
                if memory.slots is not None:
                    await memory.slots.close()
                await memory.store.close()
                if memory.embedder is not None:
                    await memory.embedder.aclose()

    return ctx


async def _open_memory(
    app: web.Application, settings: Settings, tasks: BackgroundTasks, upstream: Upstream
) -> MemoryService:
    path = db_path(settings.memory.db_path)
    store = Store(path)
    await store.open()
    embedder = await _load_embedder(settings)
    if embedder is not None and not await store.ensure_embedding_model(embedder.name):
        event(
            log,
            logging.ERROR,
            "the database holds vectors of another embedding model; "
            "vector search is off until they are re-indexed",
            db=str(path),
            model=embedder.name,
        )
        await embedder.aclose()
        embedder = None
    retriever = Retriever(store, embedder, settings.retrieval)
    tokens = TokenCounter(await asyncio.to_thread(load_encoder))
    summarizer = Summarizer(settings, store, upstream, tokens)
    feedback = Feedback(settings, store, tasks)
    consolidator = Consolidator(settings, store, embedder, summarizer, feedback)
    counters = Counters(store, summarizer, consolidator)
    await counters.load()
    slots = SlotStore(settings.slots, store) if settings.slots.enabled else None
    if slots is not None:
        await slots.start()
        app[SLOTS] = slots
    service = MemoryService(
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
        indexer=Indexer(store, embedder, tasks),
    )
    assert service.indexer is not None
    # Turns archived but not embedded when Engram last stopped (a crash, a dead embedder).
    tasks.spawn(service.indexer.replay(), name="index-replay")
    app[STORE] = store
    app[CONSOLIDATOR] = consolidator
    app[COUNTERS] = counters
    app[RETRIEVER] = retriever
    app[MEMORY] = service
    event(
        log,
        logging.INFO,
        "memory open",
        db=str(path),
        embedder=embedder.name if embedder else "none (full-text search only)",
    )
    return service


async def _load_embedder(settings: Settings) -> Embedder | None:
    cfg = settings.embedder
    try:
        embedder = from_settings(cfg)
        await embedder.load()
        return embedder
    except Exception as exc:  # memory degrades to full-text search; the proxy still runs
        event(
            log,
            logging.ERROR,
            "embedding model failed to load; vector search is off",
            model=cfg.model,
            error=str(exc),
        )
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
            upstream=info.url,
        )
    else:
        event(log, logging.INFO, f"upstream {info.found_by}", upstream=info.url, kind=info.kind)


# --- middleware ---------------------------------------------------------------------------------


def _middleware(settings: Settings) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The one middleware: the Host allow-list (DNS-rebinding protection), CORS preflight,
    every failure turned into OpenAI's error shape, and the access log line."""
    server = settings.server
    allowed = _allowed_hosts(settings)
    origins = set(server.cors_origins)
    too_large = PayloadTooLarge(
        f"Request body too large: Engram accepts at most {server.max_body_bytes} bytes "
        "(setting server.max_body_bytes)."
    )

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        start = time.perf_counter()
        status = 500
        try:
            host = request.headers.get("Host")
            if allowed is not None and host is not None and _hostname(host) not in allowed:
                raise Forbidden(
                    f"Host {host!r} is not allowed. Engram answers only to "
                    f"{', '.join(sorted(allowed))}; add other names to server.allowed_hosts.",
                    code="host_not_allowed",
                )
            if (
                origins
                and request.method == "OPTIONS"
                and "Access-Control-Request-Method" in request.headers
                and _cors_origin(request, origins)
            ):
                resp: web.StreamResponse = web.Response(status=204)
            else:
                resp = await handler(request)
            status = resp.status
            return resp
        except EngramError as exc:
            status = exc.status
            return error_response(exc)
        except web.HTTPRequestEntityTooLarge:
            status = 413
            return error_response(too_large)
        except web.HTTPException as exc:
            status = exc.status
            if exc.status < 400:
                raise
            return web.json_response(
                error_body(exc.reason, "invalid_request_error"),
                status=exc.status,
                headers={k: v for k, v in exc.headers.items() if k.lower() == "allow"},
            )
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return web.json_response(
                error_body("Engram hit an internal error; see its log.", "server_error"), status=500
            )
        finally:
            if server.access_log:
                event(
                    access_log,
                    logging.INFO,
                    "request",
                    method=request.method,
                    path=request.path,
                    status=status,
                    ms=round((time.perf_counter() - start) * 1000, 2),
                )

    return middleware


def _allowed_hosts(settings: Settings) -> set[str] | None:
    """Host names accepted, or None when any is (a network bind with no allow-list)."""
    server = settings.server
    allowed = {h.lower() for h in server.allowed_hosts}
    if server.host in ("127.0.0.1", "::1", "localhost") or server.host.startswith("127."):
        return allowed | LOOPBACK_NAMES | {server.host.lower()}
    if not allowed:
        return None
    return allowed | {server.host.lower()}


def _cors_origin(request: web.Request, origins: set[str]) -> str | None:
    origin = request.headers.get("Origin")
    if origin is not None and ("*" in origins or origin in origins):
        return origin
    return None


def _cors_headers(
    origins: set[str],
) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """Adds CORS headers as any response (streamed ones included) is about to be sent."""

    async def on_prepare(request: web.Request, resp: web.StreamResponse) -> None:
        origin = _cors_origin(request, origins)
        if origin is None:
            return
        resp.headers["Access-Control-Allow-Origin"] = origin
        resp.headers["Access-Control-Allow-Headers"] = request.headers.get(
            "Access-Control-Request-Headers", "*"
        )
        resp.headers["Access-Control-Allow-Methods"] = "GET, POST, PUT, PATCH, DELETE, OPTIONS"
        resp.headers["Access-Control-Expose-Headers"] = "*"
        resp.headers["Vary"] = "Origin"

    return on_prepare


def _hostname(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


# --- handlers -----------------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await request.app[PIPELINE].handle(request)


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Any method and path Engram does not own: forwarded and relayed unchanged."""
    settings = request.app[SETTINGS]
    body = await read_body(request, settings.server.max_body_bytes)
    upstream = request.app[UPSTREAM]
    up = await upstream.send(
        request.method, request.raw_path, forward_headers(request.headers), body
    )
    resp, _ = await relay(request, up, keep_cors=bool(settings.server.cors_origins))
    return resp


async def health(request: web.Request) -> web.Response:
    """Engram's own state and whether the upstream answers."""
    app = request.app
    upstream = app[UPSTREAM]
    reachable, detail = await upstream.probe()
    info = upstream.info
    return web.json_response(
        {
            "status": "ok" if reachable else "degraded",
            "version": __version__,
            "uptime_s": round(time.time() - app[STARTED], 1),
            "upstream": {
                "url": info.url,
                "kind": info.kind,
                "found_by": info.found_by,
                "reachable": reachable,
                "detail": detail,
                "context_size": info.context_size,
            },
            "background_tasks": len(app[TASKS]),
            # Where new tool-result slots go ("embedded" also while a configured Redis is down).
            "slots": app[SLOTS].backend if SLOTS in app else None,
        }
    )


async def metrics(request: web.Request) -> web.Response:
    """Counters in Prometheus' text format."""
    app = request.app
    pipeline, tasks = app[PIPELINE], app[TASKS]
    values: dict[str, float] = {
        "engram_uptime_seconds": round(time.time() - app[STARTED], 1),
        "engram_background_tasks": len(tasks),
        "engram_background_tasks_failed_total": tasks.failed,
    }
    for mode in ("on", "off", "read-only", "write-only"):
        values[f'engram_chat_requests_total{{mode="{mode}"}}'] = pipeline.counts[f"chat_{mode}"]
    for name in (
        "client_disconnects",
        "upstream_failures",
        "memories_injected",
        "memory_failures",
        "archive_failures",
    ):
        values[f"engram_{name}_total"] = pipeline.counts[name]
    memory = pipeline.memory
    if memory is not None:
        values["engram_turns_archived_total"] = memory.archived_turns
        indexer = memory.indexer
        values["engram_embed_failures_total"] = indexer.failures if indexer else 0
        for name, value in app[COUNTERS].current().items():
            values[f"engram_{name}_total"] = value
        values["engram_facts_stored_total"] = app[CONSOLIDATOR].facts_stored
    expander = pipeline.expander
    if expander is not None:
        for name in ("round_trips", "expanded", "expired"):
            values[f"engram_expansion_{name}_total"] = expander.counts[name]
        slots = expander.slots
        if slots.settings.redis_url:
            values["engram_slots_redis_up"] = float(slots.backend == "redis")
        for backend, counts in slots.counters().items():
            for name, value in counts.items():
                values[f'engram_slots_{name}_total{{backend="{backend}"}}'] = value
    text = "".join(f"{k} {v:g}\n" for k, v in values.items())
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def engram_not_found(request: web.Request) -> web.StreamResponse:
    raise NotFound(f"No Engram route {request.method} {request.path}.", code="not_found")
