"""``create_app(settings)``: the routes and the one middleware; the running parts are opened
and closed by :func:`proxy.services.open_services` in the app's cleanup context.

Nothing happens at import time and nothing is global, so two apps can run in one process.
Routes: Engram's own under ``/engram/`` (:mod:`proxy.api`); chat completions through the
pipeline (:mod:`proxy.chat.pipeline`); every other method and path passed through to the upstream
untouched.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from proxy import guard
from proxy.api.routes import add_routes as add_admin_routes
from proxy.api.status import health, metrics
from proxy.auth import PRINCIPAL
from proxy.chat.api import ChatAPI
from proxy.chat.apis import chat_apis
from proxy.config import Settings
from proxy.errors import (
    BadRequest,
    EngramError,
    ErrorShape,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    error_response,
)
from proxy.inspector.routes import add_routes as add_inspector_routes
from proxy.logs import event
from proxy.mcp import access as mcp_access
from proxy.mcp.http import add_mcp_routes
from proxy.relay import BODY_TIMEOUT, read_body, relay
from proxy.services import SERVICES, open_services
from proxy.upstream import UpstreamInfo, forward_headers

log = logging.getLogger("engram.app")
access_log = logging.getLogger("engram.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]", "localhost.localdomain"})
ADMIN_PATHS = ("/engram/api", "/engram/metrics")


def create_app(settings: Settings, upstream_info: UpstreamInfo | None = None) -> web.Application:
    """Build the application. ``upstream_info`` skips detection (tests, pre-detected CLI)."""
    apis = chat_apis()
    app = web.Application(
        client_max_size=settings.server.max_body_bytes,
        middlewares=[_middleware(settings, apis)],
    )
    app[BODY_TIMEOUT] = settings.limits.body_timeout
    if settings.server.cors_origins:
        app.on_response_prepare.append(
            guard.cors_hook(
                guard.normalise_origins(settings.server.cors_origins),
                memory_enabled=settings.memory.enabled,
                adds_credential=_adds_credential(settings),
            )
        )

    async def running(app: web.Application) -> AsyncIterator[None]:
        async with open_services(settings, upstream_info) as services:
            app[SERVICES] = services
            yield

    app.cleanup_ctx.append(running)
    app.router.add_get("/engram/health", health)
    app.router.add_get("/engram/metrics", metrics)
    add_admin_routes(app)
    add_inspector_routes(app, settings)
    add_mcp_routes(app)
    app.router.add_route("*", "/engram/{tail:.*}", engram_not_found)
    for api in apis:
        for path in api.paths:
            app.router.add_post(path, _chat_handler(api.name))
    app.router.add_route("*", "/{tail:.*}", passthrough)
    return app


# --- middleware ---------------------------------------------------------------------------------


def _middleware(
    settings: Settings, apis: list[ChatAPI]
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The one middleware: the Host allow-list (DNS-rebinding protection), no cross-site
    writes and JSON-only bodies (:mod:`proxy.guard`), the CORS preflights Engram answers itself
    (those it forwards are asked for no key), every failure turned into OpenAI's error shape, and
    the access log line."""
    server = settings.server
    allowed = _allowed_hosts(settings)
    shape_of = _error_shapes(apis)
    origins = guard.normalise_origins(server.cors_origins)
    memory_on, borrows = settings.memory.enabled, _adds_credential(settings)
    too_large = PayloadTooLarge(
        f"Request body too large: Engram accepts at most {server.max_body_bytes} bytes "
        "(setting server.max_body_bytes)."
    )

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        start = time.perf_counter()
        status = 500
        try:
            check_host(request.headers.get("Host"), allowed)
            guard.check(request, origins, memory_enabled=memory_on, adds_credential=borrows)
            if guard.preflight_origin(
                request, origins, memory_enabled=memory_on, adds_credential=borrows
            ):
                resp: web.StreamResponse = web.Response(status=204)
            else:
                if not guard.is_forwarded_preflight(
                    request, memory_enabled=memory_on, adds_credential=borrows
                ):
                    await _authenticate(request)
                resp = await handler(request)
            status = resp.status
            return resp
        except EngramError as exc:
            status = exc.status
            if exc.closes:
                return await _answer_and_close(request, error_response(exc, shape_of(request.path)))
            return error_response(exc, shape_of(request.path))
        except web.HTTPRequestEntityTooLarge:
            status = 413
            return error_response(too_large, shape_of(request.path))
        except web.HTTPException as exc:
            status = exc.status
            if exc.status < 400:
                raise
            error = EngramError(
                exc.reason, headers={k: v for k, v in exc.headers.items() if k.lower() == "allow"}
            )
            error.status, error.type = exc.status, "invalid_request_error"
            return error_response(error, shape_of(request.path))
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            internal = EngramError("Engram hit an internal error; see its log.")
            return error_response(internal, shape_of(request.path))
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


async def _answer_and_close(request: web.Request, resp: web.Response) -> web.Response:
    """Send ``resp`` now, then close the connection: its request's body was not read to the end
    (it broke, or came too late), and aiohttp would otherwise keep the connection open after
    the answer to read and drop the rest of that body, up to 10 s (lingering). The bytes written
    go out before the socket closes."""
    try:
        await resp.prepare(request)
        await resp.write_eof()
    except ConnectionError:
        pass  # the client is gone already
    finally:
        if request.protocol is not None:
            request.protocol.force_close()
    return resp


def _adds_credential(settings: Settings) -> bool:
    """Whether Engram sends the upstream a credential of its own (:func:`guard.adds_credential`)."""
    return guard.adds_credential(settings.upstream.api_key, settings.auth.mode)


def _error_shapes(apis: list[ChatAPI]) -> Callable[[str], ErrorShape | None]:
    """The error shape for a path: its chat API's, also below it (``/v1/messages/count_tokens``
    errs as Anthropic does); None (OpenAI's) elsewhere."""
    exact = {path: api.error_body for api in apis for path in api.paths}
    below = [(path.rstrip("/") + "/", api.error_body) for api in apis for path in api.paths]

    def shape_of(path: str) -> ErrorShape | None:
        found = exact.get(path)
        if found is None:
            found = next((shape for prefix, shape in below if path.startswith(prefix)), None)
        return found

    return shape_of


async def _authenticate(request: web.Request) -> None:
    """The request's :class:`~proxy.auth.Principal`, kept in ``request[PRINCIPAL]``; a 401
    when it may not use the route. ``/engram/health`` is open (it shows no memory); the MCP
    endpoint takes the chat routes' credentials or the admin token (:mod:`proxy.mcp.access`)."""
    path = request.path
    auth = request.app[SERVICES].auth
    if path.startswith(ADMIN_PATHS):
        request[PRINCIPAL] = await auth.admin(request.headers, request.remote)
    elif guard.is_mcp_path(path):
        request[PRINCIPAL] = await mcp_access.principal(auth, request.headers)
    elif not path.startswith("/engram/"):
        request[PRINCIPAL] = await auth.client(request.headers)


def _allowed_hosts(settings: Settings) -> frozenset[str]:
    """Host names accepted besides IP literals: loopback names, the bound host, this machine's
    names when bound beyond loopback, and ``server.allowed_hosts``."""
    server = settings.server
    allowed = {h.lower() for h in server.allowed_hosts} | LOOPBACK_NAMES | {server.host.lower()}
    if server.host not in LOOPBACK_NAMES and not server.host.startswith("127."):
        allowed |= {socket.gethostname().lower(), socket.getfqdn().lower()}
    return frozenset(allowed)


def check_host(host: str | None, allowed: frozenset[str]) -> None:
    """DNS-rebinding protection: a 403 unless the Host header is an IP literal (a page can only
    rebind a name) or an allowed name; a 400 without one (HTTP/1.0 clients must send it too)."""
    if host is None or not host.strip():
        raise BadRequest(
            "A Host header is required (Engram checks it against DNS rebinding).",
            code="host_required",
        )
    name = _hostname(host)
    if name in allowed or _is_ip_literal(name):
        return
    raise Forbidden(
        f"Host {host!r} is not allowed. Engram answers to IP addresses and "
        f"{', '.join(sorted(allowed))}; add other names to server.allowed_hosts.",
        code="host_not_allowed",
    )


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name[1:-1] if name.startswith("[") else name)
    except ValueError:
        return False
    return True


def _hostname(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


# --- handlers -----------------------------------------------------------------------------------


def _chat_handler(name: str) -> Handler:
    async def chat(request: web.Request) -> web.StreamResponse:
        return await request.app[SERVICES].pipelines[name].handle(request)

    chat.__name__ = f"chat_{name.replace('-', '_')}"
    return chat


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Any method and path Engram does not own: forwarded and relayed unchanged. The upstream's
    CORS headers are kept where Engram is transparent (:func:`proxy.guard.transparent`: CORS
    preflights come here too) or grants CORS itself."""
    services = request.app[SERVICES]
    if request.method != "POST":  # reads (models, props, health): no prompt for the slots
        return await _passthrough(request)
    with services.activity.request():  # completions, embeddings…: Engram's own calls wait
        return await _passthrough(request)


async def _passthrough(request: web.Request) -> web.StreamResponse:
    services = request.app[SERVICES]
    settings = services.settings
    body = await read_body(request, settings.server.max_body_bytes)
    upstream = services.upstream
    up = await upstream.send(
        request.method, request.raw_path, forward_headers(request.headers), body
    )
    keep_cors = bool(settings.server.cors_origins) or guard.transparent(
        request.path,
        memory_enabled=settings.memory.enabled,
        adds_credential=_adds_credential(settings),
    )
    resp, _ = await relay(request, up, keep_cors=keep_cors)
    return resp


async def engram_not_found(request: web.Request) -> web.StreamResponse:
    raise NotFound(f"No Engram route {request.method} {request.path}.", code="not_found")
