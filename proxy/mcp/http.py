"""The MCP endpoint's aiohttp edge: ``POST /engram/mcp`` (Streamable HTTP, JSON responses), a
405 with ``Allow: POST`` for every other method (no GET stream, no session to DELETE), and a 404
of Engram's own for OAuth discovery documents.

Before a POST reaches :func:`proxy.mcp.dispatch.answer`, the one middleware has checked its
Host, refused a foreign ``Origin`` (403, :mod:`proxy.guard`: any method) and a body that is not
JSON (415), and authenticated it (:func:`proxy.mcp.access.principal`: a plain 401, with no
``WWW-Authenticate``). Here: the ``Accept`` header must allow JSON (406), the body is capped at
:data:`MAX_BODY_BYTES` (or ``server.max_body_bytes`` when smaller: 413 with a JSON-RPC error),
and it must parse (-32700).

OAuth discovery: Cursor and Claude Code drop a configured bearer header once they find an OAuth
authorization server, so Engram answers ``/.well-known/oauth-authorization-server``,
``/.well-known/oauth-protected-resource`` and ``/.well-known/openid-configuration`` (and what
lies below them) itself, with a 404, instead of passing them to the upstream like other paths.
"""

from __future__ import annotations

from aiohttp import web

from proxy import json_input
from proxy.auth import PRINCIPAL
from proxy.errors import EngramError, NotFound, Unauthorized
from proxy.guard import MCP_PATH
from proxy.mcp.access import access_of
from proxy.mcp.calls import ToolResult, call_tool
from proxy.mcp.dispatch import Reply, answer
from proxy.mcp.protocol import INVALID_REQUEST, PARSE_ERROR, RpcError, error_message
from proxy.relay import body_read, encode_json
from proxy.services import SERVICES

MAX_BODY_BYTES = 1 << 20
"""The largest MCP message accepted (1 MiB): a note is at most 8,000 characters."""
OAUTH_DISCOVERY = (
    "/.well-known/oauth-authorization-server",
    "/.well-known/oauth-protected-resource",
    "/.well-known/openid-configuration",
)
_JSON_ACCEPTED = ("application/json", "application/*", "*/*")


class MethodNotAllowed(EngramError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class NotAcceptable(EngramError):
    status = 406
    type = "invalid_request_error"
    code = "not_acceptable"


async def mcp_handler(request: web.Request) -> web.StreamResponse:
    if request.method != "POST":
        raise MethodNotAllowed(
            f"{request.method} {MCP_PATH}: Engram's MCP endpoint takes POST only (one JSON-RPC "
            "message per POST; it is stateless: no GET stream, no session to DELETE).",
            headers={"Allow": "POST"},
        )
    accept = request.headers.get("Accept")
    if accept is not None and not any(t in accept.lower() for t in _JSON_ACCEPTED):
        raise NotAcceptable(
            f"Accept: {accept!r} does not allow application/json, the only type Engram's MCP "
            "endpoint answers with (send Accept: application/json, text/event-stream)."
        )
    who = request.get(PRINCIPAL)
    if who is None:  # the middleware authenticates every MCP request
        raise Unauthorized("The MCP endpoint needs a credential.", code="unauthorized")
    access = access_of(who, request.headers)
    services = request.app[SERVICES]
    limit = min(MAX_BODY_BYTES, services.settings.server.max_body_bytes)
    raw = await body_read(request, _read(request, limit))
    if raw is None:
        too_large = RpcError(
            INVALID_REQUEST,
            f"Request body too large: Engram's MCP endpoint accepts at most {limit} bytes "
            "per message.",
        )
        return _response(Reply(413, error_message(None, too_large)))
    if not raw.strip():
        empty = RpcError(PARSE_ERROR, "Parse error: the body is empty; send one JSON-RPC message.")
        return _response(Reply(400, error_message(None, empty)))
    try:
        value = json_input.loads(raw)
    except json_input.TooDeep as exc:
        return _response(Reply(400, error_message(None, RpcError(INVALID_REQUEST, f"{exc}."))))
    except (ValueError, UnicodeDecodeError) as exc:
        bad = RpcError(PARSE_ERROR, f"Parse error: the body is not valid JSON ({exc}).")
        return _response(Reply(400, error_message(None, bad)))

    async def call(name: str, arguments: object) -> ToolResult:
        return await call_tool(services, access, name, arguments)

    return _response(await answer(value, request.headers, access, call))


async def _read(request: web.Request, limit: int) -> bytes | None:
    """The body, or None past ``limit`` bytes (declared or sent)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _response(reply: Reply) -> web.Response:
    if reply.body is None:
        return web.Response(status=reply.status)
    return web.Response(
        status=reply.status, body=encode_json(reply.body), content_type="application/json"
    )


async def no_oauth(request: web.Request) -> web.StreamResponse:
    raise NotFound(
        f"No OAuth here: Engram has no authorization server. Its MCP endpoint ({MCP_PATH}) "
        "takes the header the client is configured with: Authorization: Bearer <Engram key> "
        "(or the admin token).",
        code="no_oauth",
    )


def add_mcp_routes(app: web.Application) -> None:
    """Register the MCP endpoint and the OAuth-discovery 404s (before the ``/engram/{tail}``
    and pass-through catch-alls)."""
    app.router.add_route("*", MCP_PATH, mcp_handler)
    for path in OAUTH_DISCOVERY:
        app.router.add_route("*", path + "{tail:(/.*)?}", no_oauth)
