"""Which requests a web page on another origin may make, where Engram leaves CORS to the
upstream, and JSON-only bodies.

A browser lets any page send "simple" requests anywhere (``text/plain``, form or multipart bodies,
no preflight), and a page on ``http://127.0.0.1:9999`` reaching Engram on ``127.0.0.1:8787`` even
passes the Host check. So, before any handler runs (:func:`check`), after the Host allow-list
(DNS-rebinding protection, ``proxy.app``), which every request meets:

- **Origin.** A request is *foreign* when the browser says so: ``Sec-Fetch-Site`` other than
  ``same-origin`` or ``none`` (``same-site`` too: another port on the same host is same-site), or,
  from browsers that do not send that header, an ``Origin`` that is not Engram's own (``null``,
  from sandboxed frames and ``file://`` pages, included). Clients that are not browsers (curl, the
  SDKs) send neither header and are not affected.
- **Transparent where nothing is protected.** A request is *memory-free* when its path is a
  pass-through route (neither a chat route, :data:`CHAT_PATHS`, nor under ``/engram``), or a chat
  route while memory is disabled for the whole server (``memory.enabled = false``). On a
  memory-free route Engram does not judge origins, provided it adds no credential of its own to
  what the client sent — that is, unless ``upstream.api_key`` is set with ``auth.mode = "none"``
  (a page would borrow that key; with ``auth.mode = "keys"`` a page has no Engram key and gets a
  401 anyway): CORS preflights (``OPTIONS`` with ``Access-Control-Request-Method``) go to the
  upstream and its answer comes back as it is, cross-site requests go through, and the
  upstream's ``Access-Control-*`` headers are relayed unchanged; Engram adds none
  (:func:`transparent`). A preflight sent on is asked for no Engram key, since a browser sends
  none with it (:func:`forwards_preflight`); the request that follows is.
- **Guarded routes: no cross-site writes.** Everywhere else — chat routes while memory is on,
  Engram's own routes, and every route when Engram adds a credential — a foreign request is
  refused (403) unless its origin is listed in ``server.cors_origins``, for every method but GET
  and HEAD (and those too when they ask for a WebSocket).
- **Engram's own routes** (``/engram/...``) answer only their own origin: the admin API
  (``/engram/api``) and the MCP endpoint (``/engram/mcp``) to no other origin with any method,
  configured or not, and the rest (health, metrics, the inspector page) to GET and HEAD only. They
  never carry CORS headers.
- **JSON only.** A body sent to a chat route, the admin API or the MCP endpoint must be
  ``application/json``
  (or ``application/*+json``), from anyone, memory on or off: a page cannot send that without a
  CORS preflight. Anything else is a 415. Pass-through routes accept any body (multipart audio
  uploads).
- **CORS on guarded routes.** Engram answers preflights itself (204), and adds CORS headers, only
  for configured origins and only on the chat and pass-through routes; there, an upstream's own
  CORS headers never reach an origin that is not configured.

The decisions are pure functions of the method, the path, the header values and two facts about
the server (memory enabled; Engram adds a credential, :func:`adds_credential`); :func:`check`,
:func:`preflight_origin`, :func:`is_forwarded_preflight` and :func:`cors_hook` are the thin
aiohttp edges.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Awaitable, Callable, Collection, Mapping
from urllib.parse import urlsplit

from aiohttp import web

from proxy.errors import EngramError, Forbidden

# The chat APIs of the request path (DESIGN.md): JSON APIs, whose bodies Engram may archive.
# Every path a chat adapter serves (proxy.chat.apis; a test keeps the two the same).
CHAT_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/chat/completions",
        "/v1/messages",
        "/v1/responses",
        "/responses",
        "/api/chat",
    }
)
ADMIN_PREFIX = "/engram/api"
MCP_PATH = "/engram/mcp"  # the MCP endpoint (proxy.mcp): guarded like the admin API
ENGRAM_PREFIX = "/engram"
SAFE_METHODS = frozenset({"GET", "HEAD"})
# Sec-Fetch-Site values that mean "not another web page": the page's own origin, or the user
# typing the address / opening a bookmark.
_OWN_FETCH_SITES = frozenset({"same-origin", "none"})
_JSON = re.compile(r"application/(?:[a-z0-9!#$&^_.+-]+\+)?json")
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


class UnsupportedMediaType(EngramError):
    """415: a body that is not JSON sent to a route that takes JSON only."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class Source(enum.Enum):
    """Where a request comes from, as far as the browser tells."""

    OWN = "own"  # Engram's own origin, or not a browser at all
    CONFIGURED = "configured"  # a foreign origin listed in server.cors_origins
    FOREIGN = "foreign"  # any other web page


# --- pure decisions -----------------------------------------------------------------------------


def is_admin_path(path: str) -> bool:
    return path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")


def is_mcp_path(path: str) -> bool:
    return path == MCP_PATH


def is_engram_path(path: str) -> bool:
    return path == ENGRAM_PREFIX or path.startswith(ENGRAM_PREFIX + "/")


def memory_free(path: str, memory_enabled: bool) -> bool:
    """Whether nothing Engram protects lies behind ``path``: a pass-through route (neither a chat
    route nor under ``/engram``), or a chat route while memory is disabled for the whole server."""
    if is_engram_path(path):
        return False
    return path not in CHAT_PATHS or not memory_enabled


def adds_credential(api_key: str, auth_mode: str) -> bool:
    """Whether Engram sends the upstream a credential the client need not have: an
    ``upstream.api_key`` with no accounts (``auth.mode = "none"``). With accounts, a request
    shows one of Engram's keys first, which a page does not have."""
    return bool(api_key) and auth_mode == "none"


def transparent(path: str, *, memory_enabled: bool, adds_credential: bool) -> bool:
    """Whether Engram leaves origins and CORS on this path to the upstream: the path is
    memory-free and no credential of Engram's own goes with the request."""
    return not adds_credential and memory_free(path, memory_enabled)


def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
    """A CORS preflight: ``OPTIONS`` with ``Access-Control-Request-Method``."""
    return method == "OPTIONS" and "Access-Control-Request-Method" in headers


def is_json_media_type(content_type: str) -> bool:
    """``application/json`` or ``application/<anything>+json``, parameters ignored."""
    return _JSON.fullmatch(content_type.split(";", 1)[0].strip().lower()) is not None


def json_only(method: str, path: str) -> bool:
    """Whether a body sent with this method to this path must be JSON."""
    return (
        method not in SAFE_METHODS
        and method != "OPTIONS"
        and (path in CHAT_PATHS or is_admin_path(path) or is_mcp_path(path))
    )


def media_type_error(
    method: str, path: str, content_type: str | None, has_body: bool
) -> UnsupportedMediaType | None:
    """The 415 for a non-JSON body on a JSON-only route; None when the request may go on.
    A request without a body may say anything or nothing about it (``POST
    /engram/api/consolidate``; some clients label an empty body ``application/octet-stream``)."""
    if not has_body or not json_only(method, path):
        return None
    if content_type is None or not content_type.strip():
        shown = "none"
    elif is_json_media_type(content_type):
        return None
    else:
        shown = repr(content_type)
    return UnsupportedMediaType(
        f"Unsupported Content-Type ({shown}) on {method} {path}: Engram's chat, admin and MCP "
        "routes take JSON bodies only. Send 'Content-Type: application/json' "
        "(with curl: -H 'Content-Type: application/json').",
        param="Content-Type",
    )


def _origin_parts(origin: str) -> tuple[str, int | None] | None:
    """(host, port) of a serialised origin, the scheme's default port filled in."""
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return None
    if not parts.scheme or not parts.hostname:
        return None
    return parts.hostname, port if port is not None else _DEFAULT_PORTS.get(parts.scheme)


def _host_parts(host: str) -> tuple[str, int | None] | None:
    """(host, port or None) of a Host header value."""
    try:
        parts = urlsplit("//" + host.strip())
        return (parts.hostname, parts.port) if parts.hostname else None
    except ValueError:
        return None


def is_own_origin(origin: str, host: str | None) -> bool:
    """Whether ``origin`` is the origin the request was addressed to (its Host header). A Host
    without a port matches the origin scheme's default port."""
    own = _host_parts(host) if host else None
    theirs = _origin_parts(origin)
    if own is None or theirs is None or own[0] != theirs[0]:
        return False
    return (own[1] is None and theirs[1] in (80, 443)) or own[1] == theirs[1]


def source(
    origin: str | None, fetch_site: str | None, host: str | None, configured: Collection[str]
) -> Source:
    """Classify a request by its ``Origin``, ``Sec-Fetch-Site`` and ``Host`` headers. The
    browser's own ``Sec-Fetch-Site`` is believed first; ``Origin`` is compared with the Host
    header only where it is missing (older browsers)."""
    site = fetch_site.strip().lower() if fetch_site is not None else None
    if site in _OWN_FETCH_SITES:
        return Source.OWN
    if origin is not None:
        origin = origin.strip().lower()
        if site is None and is_own_origin(origin, host):
            return Source.OWN
        if origin in configured or "*" in configured:
            return Source.CONFIGURED
        return Source.FOREIGN
    return Source.OWN if site is None else Source.FOREIGN


def cross_site_error(
    method: str, path: str, src: Source, origin: str | None, upgrade: bool = False
) -> Forbidden | None:
    """The 403 for a request another web page may not make on a guarded path (one that is not
    :func:`transparent`); None when it may go on. ``upgrade``: the request asks to switch
    protocols (a WebSocket, which CORS never guards)."""
    if src is Source.OWN:
        return None
    shown = origin if origin is not None else "another site"
    read = method in SAFE_METHODS and not upgrade
    if is_engram_path(path):
        if read and not (is_admin_path(path) or is_mcp_path(path)):
            return None
        return Forbidden(
            f"Cross-site request refused: {method} {path} came from a web page ({shown}) that is "
            "not Engram's own. Engram's routes under /engram/ answer only their own origin and "
            "clients that are not browsers; server.cors_origins does not extend to them.",
            code="cross_site_request",
        )
    if src is Source.CONFIGURED or read:
        return None
    return Forbidden(
        f"Cross-site request refused: {method} {path} came from a web page ({shown}) that "
        "Engram does not trust, so it may not write to your memory or your model server. To let "
        "a web app on another origin use Engram, add its origin to server.cors_origins.",
        code="cross_site_request",
    )


def request_error(
    method: str,
    path: str,
    headers: Mapping[str, str],
    configured: Collection[str],
    *,
    has_body: bool,
    memory_enabled: bool,
    adds_credential: bool,
) -> EngramError | None:
    """The 403 or 415 a request gets; None when it may go on. ``headers``: the request's, looked
    up case-insensitively (aiohttp's); ``configured``: :func:`normalise_origins` of
    ``server.cors_origins``. On a :func:`transparent` path only the JSON-only rule applies."""
    if not transparent(path, memory_enabled=memory_enabled, adds_credential=adds_credential):
        origin = headers.get("Origin")
        src = source(origin, headers.get("Sec-Fetch-Site"), headers.get("Host"), configured)
        refused = cross_site_error(method, path, src, origin, "Upgrade" in headers)
        if refused is not None:
            return refused
    return media_type_error(method, path, headers.get("Content-Type"), has_body)


def own_preflight(
    method: str,
    path: str,
    headers: Mapping[str, str],
    configured: Collection[str],
    *,
    memory_enabled: bool,
    adds_credential: bool,
) -> str | None:
    """The configured origin of a CORS preflight that Engram answers itself, else None (not a
    preflight; a transparent path, whose preflights the upstream answers; no configured origin)."""
    if not is_preflight(method, headers) or transparent(
        path, memory_enabled=memory_enabled, adds_credential=adds_credential
    ):
        return None
    return cors_origin(path, headers.get("Origin"), configured)


def forwards_preflight(
    method: str,
    path: str,
    headers: Mapping[str, str],
    *,
    memory_enabled: bool,
    adds_credential: bool,
) -> bool:
    """Whether this is a CORS preflight that goes to the upstream (on a transparent path). A
    browser never sends credentials with a preflight, so Engram asks it for none (with
    ``auth.mode = "keys"`` too, as for the preflights Engram answers itself); the request that
    follows needs its key as any other."""
    return is_preflight(method, headers) and transparent(
        path, memory_enabled=memory_enabled, adds_credential=adds_credential
    )


def cors_origin(path: str, origin: str | None, configured: Collection[str]) -> str | None:
    """The origin Engram grants CORS to on a guarded path: a configured one, never on Engram's
    own routes."""
    if origin is None or not configured or is_engram_path(path):
        return None
    low = origin.strip().lower()
    if low in configured or "*" in configured:
        return origin
    return None


def normalise_origins(origins: Collection[str]) -> frozenset[str]:
    """Configured origins as compared: lower case (browsers send them so)."""
    return frozenset(o.strip().lower() for o in origins)


# --- aiohttp edges ------------------------------------------------------------------------------


def check(
    request: web.Request, configured: frozenset[str], *, memory_enabled: bool, adds_credential: bool
) -> None:
    """Raise the 403 or 415 this request gets, if any (called by the one middleware)."""
    error = request_error(
        request.method,
        request.path,
        request.headers,
        configured,
        has_body=request.body_exists,
        memory_enabled=memory_enabled,
        adds_credential=adds_credential,
    )
    if error is not None:
        raise error


def preflight_origin(
    request: web.Request, configured: frozenset[str], *, memory_enabled: bool, adds_credential: bool
) -> str | None:
    """The configured origin of a CORS preflight Engram answers itself, else None."""
    return own_preflight(
        request.method,
        request.path,
        request.headers,
        configured,
        memory_enabled=memory_enabled,
        adds_credential=adds_credential,
    )


def is_forwarded_preflight(
    request: web.Request, *, memory_enabled: bool, adds_credential: bool
) -> bool:
    """Whether this request is a CORS preflight for the upstream to answer."""
    return forwards_preflight(
        request.method,
        request.path,
        request.headers,
        memory_enabled=memory_enabled,
        adds_credential=adds_credential,
    )


def cors_hook(
    configured: frozenset[str], *, memory_enabled: bool, adds_credential: bool
) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """An ``on_response_prepare`` hook for guarded paths: CORS headers for configured origins on
    the chat and pass-through routes, and no ``Access-Control-*`` header (the upstream's
    included) on any other response. Responses on transparent paths are left as they are."""

    async def on_prepare(request: web.Request, resp: web.StreamResponse) -> None:
        if transparent(
            request.path, memory_enabled=memory_enabled, adds_credential=adds_credential
        ):
            return
        origin = cors_origin(request.path, request.headers.get("Origin"), configured)
        if origin is None:
            for name in [k for k in resp.headers if k.lower().startswith("access-control-")]:
                resp.headers.popall(name, None)
            return
        resp.headers["Access-Control-Allow-Origin"] = origin
        resp.headers["Access-Control-Allow-Headers"] = request.headers.get(
            "Access-Control-Request-Headers", "*"
        )
        resp.headers["Access-Control-Allow-Methods"] = "GET, POST, PUT, PATCH, DELETE, OPTIONS"
        resp.headers["Access-Control-Expose-Headers"] = "*"
        vary = resp.headers.get("Vary", "")
        if "origin" not in vary.lower():
            resp.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"

    return on_prepare
