"""One MCP message answered: its era (:func:`proxy.mcp.protocol.era_of`), its method, the
JSON-RPC answer and the HTTP status it goes out with. No aiohttp here; the tools are run by the
``call`` function it is given (:func:`proxy.mcp.calls.call_tool` on a server).

    handshake revisions (2025-06-18, 2025-11-25)   initialize, ping, tools/list, tools/call
    2026-07-28                                     server/discover, tools/list, tools/call;
                                                   every result with resultType and serverInfo

Notifications (``notifications/initialized`` and any other) and, before 2026-07-28, responses
are accepted with a 202 and no body: Engram sends no requests and keeps no session, so there is
nothing for them to change. Every session is stateless: a ``tools/call`` needs no ``initialize``
first, and no ``Mcp-Session-Id`` is issued or asked for.

A ``tools/call`` answers a JSON-RPC error (-32602) only for what the model cannot fix: an
unknown tool, or a request that breaks ``CallToolRequest`` (``name`` missing or not a string,
``arguments`` not an object). Arguments a known tool's input schema refuses are a result with
``isError: true`` (:func:`proxy.mcp.calls.call_tool`), in every revision served: 2025-11-25 and
2026-07-28 say so (SEP-1303: input validation errors are tool execution errors, so the model
sees them and corrects its call); 2025-06-18 lists both "invalid arguments" (protocol error) and
"invalid input data" (tool error), and SEP-1303 settled that ambiguity the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from proxy import __version__
from proxy.mcp import tools
from proxy.mcp.access import Access
from proxy.mcp.calls import ToolResult
from proxy.mcp.protocol import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    LEGACY_VERSIONS,
    METHOD_NOT_FOUND,
    SERVER_INFO_KEY,
    SUPPORTED_VERSIONS,
    VERSION_HEADER,
    Era,
    Message,
    RpcError,
    check_modern,
    era_of,
    error_message,
    error_status,
    negotiate,
    parse_message,
    result_message,
)

log = logging.getLogger("engram.mcp")

SERVER_INFO = {"name": "engram", "title": "Engram memory", "version": __version__}
CAPABILITIES = {"tools": {"listChanged": False}}
TTL_MS = 3_600_000
"""How long a client may keep the tool list (2026-07-28 caching hints): it changes only with
Engram's version."""
_METHODS = {
    "legacy": ("initialize", "ping", "tools/list", "tools/call"),
    "modern": ("server/discover", "tools/list", "tools/call"),
}

ToolCall = Callable[[str, Any], Awaitable[ToolResult]]


@dataclass(frozen=True)
class Reply:
    """An HTTP answer: its status and JSON body (None: no body, as for a 202)."""

    status: int
    body: dict[str, Any] | None = None


async def answer(value: Any, headers: Mapping[str, str], access: Access, call: ToolCall) -> Reply:
    """The answer to one decoded POST body. ``headers``: the request's (case-insensitive)."""
    try:
        message = parse_message(value)
    except RpcError as exc:
        return Reply(error_status(exc.code, "modern"), error_message(exc.request_id, exc))
    try:
        era = era_of(message, headers.get(VERSION_HEADER))
    except RpcError as exc:  # an MCP-Protocol-Version Engram does not serve
        return Reply(400, error_message(message.id, exc))
    if message.kind == "notification":
        return Reply(202)
    if message.kind == "response":
        if era == "legacy":
            return Reply(202)
        refused = RpcError(INVALID_REQUEST, "2026-07-28 clients send no JSON-RPC responses.")
        return Reply(400, error_message(message.id, refused))
    assert message.id is not None
    try:
        if era == "modern":
            check_modern(message, headers)
        result = await _method(message, era, access, call)
    except RpcError as exc:
        return Reply(error_status(exc.code, era), error_message(message.id, exc))
    except Exception:
        log.exception("MCP %s failed", message.method)
        internal = RpcError(INTERNAL_ERROR, "Engram hit an internal error; see its log.")
        return Reply(error_status(INTERNAL_ERROR, era), error_message(message.id, internal))
    if era == "modern":
        result = {**result, "resultType": "complete", "_meta": {SERVER_INFO_KEY: SERVER_INFO}}
    return Reply(200, result_message(message.id, result))


async def _method(message: Message, era: Era, access: Access, call: ToolCall) -> dict[str, Any]:
    method, params = message.method, message.params
    if method == "tools/list":
        listed: dict[str, Any] = {"tools": tools.tool_list(access.may_name_user)}
        if era == "modern":  # differs by credential (the admin's `user` argument)
            listed.update(ttlMs=TTL_MS, cacheScope="private")
        return listed
    if method == "tools/call":
        return await _tools_call(params, call)
    if era == "legacy" and method == "initialize":
        return initialize(params)
    if era == "legacy" and method == "ping":
        return {}
    if era == "modern" and method == "server/discover":
        return discover()
    if era == "modern" and method == "initialize":
        raise RpcError(
            METHOD_NOT_FOUND,
            "initialize is the handshake of protocol versions "
            f"{', '.join(LEGACY_VERSIONS)}; 2026-07-28 has none. Send it without "
            "MCP-Protocol-Version, or call server/discover.",
        )
    raise RpcError(
        METHOD_NOT_FOUND,
        f"Method not found: {method!r}. Engram's MCP server answers "
        f"{', '.join(_METHODS[era])} (it serves tools only).",
    )


def initialize(params: dict[str, Any]) -> dict[str, Any]:
    """The handshake's answer: the negotiated revision, tools, who Engram is, when to use it."""
    requested = params.get("protocolVersion")
    if not isinstance(requested, str):
        raise RpcError(INVALID_PARAMS, "initialize needs params.protocolVersion (a string).")
    return {
        "protocolVersion": negotiate(requested),
        "capabilities": CAPABILITIES,
        "serverInfo": SERVER_INFO,
        "instructions": tools.INSTRUCTIONS,
    }


def discover() -> dict[str, Any]:
    """``server/discover`` (2026-07-28): the revisions served, the same for everyone."""
    return {
        "supportedVersions": list(SUPPORTED_VERSIONS),
        "capabilities": CAPABILITIES,
        "instructions": tools.INSTRUCTIONS,
        "ttlMs": TTL_MS,
        "cacheScope": "public",
    }


async def _tools_call(params: dict[str, Any], call: ToolCall) -> dict[str, Any]:
    name = params.get("name")
    if not isinstance(name, str):
        raise RpcError(INVALID_PARAMS, "tools/call needs params.name: the tool's name.")
    if name not in tools.NAMES:
        raise RpcError(
            INVALID_PARAMS,
            f"Unknown tool {name!r}: Engram's tools are {', '.join(tools.NAMES)}.",
            {"tool": name},
        )
    arguments = params.get("arguments")
    if arguments is not None and not isinstance(arguments, dict):
        raise RpcError(INVALID_PARAMS, f"params.arguments of {name} must be an object.")
    result = await call(name, arguments)  # arguments the tool refuses: an isError result
    return result.wire()
