"""JSON-RPC 2.0 as MCP's Streamable HTTP transport uses it, pure: the message forms, the protocol
revisions served, which era a POST belongs to, the 2026-07-28 request envelope checks, and the
HTTP status of each answer.

Revisions: the handshake ("legacy") ones, 2025-06-18 and 2025-11-25 (``initialize`` negotiates
one; a later POST says it in ``MCP-Protocol-Version``), and the stateless ("modern") 2026-07-28,
where every request carries its revision in ``params._meta`` and in headers, and no handshake
happens. One POST is one message: batches (removed in 2025-06-18) are refused.

The era of a POST, as the official SDK routes it: an ``MCP-Protocol-Version`` header naming a
handshake revision, or no header at all, is legacy; a header naming anything else, or (without
a header) a body whose ``_meta`` names a revision, is modern and goes through the envelope
checks (:func:`check_modern`), first failure wins: ``_meta`` with the revision and the client's
capabilities (-32602), headers matching the body (``MCP-Protocol-Version``, ``Mcp-Method``,
``Mcp-Name``: -32020), a revision served (-32022, naming the served ones).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
HEADER_MISMATCH = -32020
UNSUPPORTED_VERSION = -32022

LEGACY_VERSIONS = ("2025-06-18", "2025-11-25")  # oldest first
MODERN_VERSIONS = ("2026-07-28",)
SUPPORTED_VERSIONS = (*reversed(MODERN_VERSIONS), *reversed(LEGACY_VERSIONS))  # newest first

VERSION_KEY = "io.modelcontextprotocol/protocolVersion"
CAPABILITIES_KEY = "io.modelcontextprotocol/clientCapabilities"
SERVER_INFO_KEY = "io.modelcontextprotocol/serverInfo"

VERSION_HEADER = "MCP-Protocol-Version"
METHOD_HEADER = "Mcp-Method"
NAME_HEADER = "Mcp-Name"

Era = Literal["legacy", "modern"]
RequestId = str | int

_B64 = re.compile(r"=\?base64\?(?P<payload>.*)\?=")
_MODERN_STATUS = {
    PARSE_ERROR: 400,
    INVALID_REQUEST: 400,
    INVALID_PARAMS: 400,
    HEADER_MISMATCH: 400,
    UNSUPPORTED_VERSION: 400,
    METHOD_NOT_FOUND: 404,
    INTERNAL_ERROR: 500,
}
_LEGACY_STATUS = {
    PARSE_ERROR: 400,
    INVALID_REQUEST: 400,
    HEADER_MISMATCH: 400,
    UNSUPPORTED_VERSION: 400,
}


class RpcError(Exception):
    """A JSON-RPC error answer: its code, message and optional data."""

    def __init__(
        self, code: int, message: str, data: Any = None, request_id: RequestId | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self.request_id = request_id  # where the message was read far enough to have one


@dataclass(frozen=True)
class Message:
    """One JSON-RPC message a client sent. ``kind``: a request (has an id), a notification (has
    none) or a response (to a request of the server's; Engram sends none)."""

    kind: Literal["request", "notification", "response"]
    method: str = ""
    id: RequestId | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def meta(self) -> dict[str, Any] | None:
        meta = self.params.get("_meta")
        return meta if isinstance(meta, dict) else None


# --- messages -------------------------------------------------------------------------------------


def parse_message(value: Any) -> Message:
    """The message a decoded POST body holds, or an :class:`RpcError` (-32600, -32602)."""
    if isinstance(value, list):
        raise RpcError(
            INVALID_REQUEST,
            "Batches are not supported (MCP removed JSON-RPC batching in 2025-06-18): send one "
            "JSON-RPC message per POST.",
        )
    if not isinstance(value, dict):
        raise RpcError(INVALID_REQUEST, "The body must be one JSON-RPC 2.0 message (an object).")
    if value.get("jsonrpc") != "2.0":
        raise RpcError(INVALID_REQUEST, 'Not a JSON-RPC 2.0 message: "jsonrpc" must be "2.0".')
    has_id = "id" in value
    request_id = value.get("id")
    if has_id and (
        isinstance(request_id, bool) or not isinstance(request_id, str | int) or request_id is None
    ):
        raise RpcError(
            INVALID_REQUEST, f'"id" must be a string or an integer (not null); got {request_id!r}.'
        )
    method = value.get("method")
    if method is None and has_id and ("result" in value or "error" in value):
        return Message("response", id=request_id)
    if not isinstance(method, str) or not method:
        raise RpcError(INVALID_REQUEST, '"method" is required: a non-empty string.')
    params = value.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RpcError(INVALID_PARAMS, f'"params" of {method} must be an object.', None, request_id)
    kind: Literal["request", "notification"] = "request" if has_id else "notification"
    return Message(kind, method, request_id, params)


def result_message(request_id: RequestId, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def error_message(request_id: RequestId | None, error: RpcError) -> dict[str, Any]:
    body: dict[str, Any] = {"code": error.code, "message": error.message}
    if error.data is not None:
        body["data"] = error.data
    return {"jsonrpc": "2.0", "id": request_id, "error": body}


def error_status(code: int, era: Era) -> int:
    """The HTTP status of a JSON-RPC error: the 2026-07-28 table (400s, 404 for an unknown
    method); the handshake revisions answer a well-formed request's errors with 200."""
    table = _MODERN_STATUS if era == "modern" else _LEGACY_STATUS
    return table.get(code, 200)


# --- revisions ------------------------------------------------------------------------------------


def unsupported(requested: object) -> RpcError:
    return RpcError(
        UNSUPPORTED_VERSION,
        f"Unsupported protocol version {requested!r}: Engram serves "
        f"{', '.join(SUPPORTED_VERSIONS)} (2025-* through initialize).",
        {"supported": list(SUPPORTED_VERSIONS), "requested": requested},
    )


def era_of(message: Message, version_header: str | None) -> Era:
    """Which era a POST belongs to (module docstring). An ``MCP-Protocol-Version`` naming a
    revision Engram does not serve is a :func:`unsupported` error."""
    if version_header is None:
        meta = message.meta
        return "modern" if meta is not None and VERSION_KEY in meta else "legacy"
    if version_header in LEGACY_VERSIONS:
        return "legacy"
    if version_header in MODERN_VERSIONS:
        return "modern"
    raise unsupported(version_header)


def negotiate(requested: object) -> str:
    """The handshake revision ``initialize`` answers: the client's when served, else the newest
    handshake revision (the client then decides whether it can speak it)."""
    if isinstance(requested, str) and requested in LEGACY_VERSIONS:
        return requested
    return LEGACY_VERSIONS[-1]


def check_modern(message: Message, headers: Mapping[str, str]) -> str:
    """The revision of a 2026-07-28 request, after its envelope checks (module docstring)."""
    meta = message.meta
    missing = [k for k in (VERSION_KEY, CAPABILITIES_KEY) if meta is None or k not in meta]
    if meta is None or missing:
        raise RpcError(
            INVALID_PARAMS,
            f"params._meta must carry {' and '.join(repr(k) for k in missing)} on every request "
            "of protocol version 2026-07-28.",
        )
    version = meta[VERSION_KEY]
    mismatch = header_mismatch(message, headers, version)
    if mismatch is not None:
        raise RpcError(HEADER_MISMATCH, mismatch)
    if not isinstance(version, str):
        raise RpcError(INVALID_PARAMS, f"{VERSION_KEY} must be a string; got {version!r}.")
    if version not in MODERN_VERSIONS:
        raise unsupported(version)
    return version


def header_mismatch(message: Message, headers: Mapping[str, str], version: object) -> str | None:
    """What disagrees between a modern request's headers and its body, or None."""
    given = headers.get(VERSION_HEADER)
    if given is None or given != version:
        return (
            f"Header mismatch: {VERSION_HEADER} ({given!r}) must be sent and equal "
            f"params._meta[{VERSION_KEY!r}] ({version!r})."
        )
    method = headers.get(METHOD_HEADER)
    if method != message.method:
        return (
            f"Header mismatch: {METHOD_HEADER} ({method!r}) must be sent and equal the "
            f"body's method ({message.method!r})."
        )
    if message.method == "tools/call":
        name = message.params.get("name")
        sent = headers.get(NAME_HEADER)
        if name is not None and decode_header_value(sent) != name:
            return (
                f"Header mismatch: {NAME_HEADER} ({sent!r}) must be sent and equal the body's "
                f"params.name ({name!r})."
            )
    return None


def decode_header_value(value: str | None) -> str | None:
    """A header value, its ``=?base64?…?=`` form decoded (None when malformed)."""
    if value is None:
        return None
    m = _B64.fullmatch(value)
    if m is None:
        return value
    payload = m.group("payload")
    try:
        raw = base64.b64decode(payload, validate=True)
        if base64.b64encode(raw).decode("ascii") != payload:
            return None
        return raw.decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
