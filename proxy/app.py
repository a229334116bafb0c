"""``create_app(settings)``: the routes and the one middleware; the running parts are opened
and closed by :func:`proxy.services.open_services` in the app's cleanup context.

Nothing happens at import time and nothing is global, so two apps can run in one process.
Routes: Engram's own under ``/engram/`` (:mod:`proxy.api`); chat completions through the
pipeline (:mod:`proxy.chat.pipeline`); every other method and path passed through to the upstream
untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from proxy import guard
from proxy.api.routes import add_routes as add_admin_routes
from proxy.api.status import health, metrics
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
from proxy.relay import read_body, relay
from proxy.services import SERVICES, open_services
from proxy.upstream import UpstreamInfo, forward_headers

log = logging.getLogger("engram.app")
access_log = logging.getLogger("engram.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]", "localhost.localdomain"})


def create_app(settings: Settings, upstream_info: UpstreamInfo | None = None) -> web.Application:
    """Build the application. ``upstream_info`` skips detection (tests, pre-detected CLI)."""
    app = web.Application(
        client_max_size=settings.server.max_body_bytes,
        middlewares=[_middleware(settings)],
    )
    if settings.server.cors_origins:
        app.on_response_prepare.append(
            guard.cors_hook(guard.normalise_origins(settings.server.cors_origins))
        )

    async def running(app: web.Application) -> AsyncIterator[None]:
        async with open_services(settings, upstream_info) as services:
            app[SERVICES] = services
            yield

    app.cleanup_ctx.append(running)
    app.router.add_get("/engram/health", health)
    app.router.add_get("/engram/metrics", metrics)
    add_admin_routes(app)
    app.router.add_route("*", "/engram/{tail:.*}", engram_not_found)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/chat/completions", chat_completions)
    app.router.add_route("*", "/{tail:.*}", passthrough)
    return app


# --- middleware ---------------------------------------------------------------------------------


def _middleware(settings: Settings) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The one middleware: the Host allow-list (DNS-rebinding protection), no cross-site
    writes and JSON-only bodies (:mod:`proxy.guard`), CORS preflight, every failure turned into
    OpenAI's error shape, and the access log line."""
    server = settings.server
    allowed = _allowed_hosts(settings)
    origins = guard.normalise_origins(server.cors_origins)
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
            guard.check(request, origins)
            if guard.preflight_origin(request, origins):
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


def _hostname(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


# --- handlers -----------------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await request.app[SERVICES].pipeline.handle(request)


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Any method and path Engram does not own: forwarded and relayed unchanged."""
    services = request.app[SERVICES]
    settings = services.settings
    body = await read_body(request, settings.server.max_body_bytes)
    upstream = services.upstream
    up = await upstream.send(
        request.method, request.raw_path, forward_headers(request.headers), body
    )
    resp, _ = await relay(request, up, keep_cors=bool(settings.server.cors_origins))
    return resp


async def engram_not_found(request: web.Request) -> web.StreamResponse:
    raise NotFound(f"No Engram route {request.method} {request.path}.", code="not_found")
