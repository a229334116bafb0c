"""Engram's own errors and their one rendering: OpenAI's error shape.

    EngramError                    any error Engram itself raises (status, type, code, param)
    ├── BadRequest                 400 invalid_request_error: the client sent something unusable
    │   ├── NestingLimitExceeded   400 a sub-agent nested deeper than sessions.max_depth
    │   └── BodyUnreadable         400 a request body that broke on the way (then closed)
    ├── Unauthorized               401 no credential, or one Engram does not know (auth)
    ├── Forbidden                  403 a Host header or origin Engram refuses; a key that may
    │                                  not do what it asks
    ├── NotFound                   404 an Engram route or object that does not exist
    │   └── ParentNotFound         404 X-Engram-Parent names no session of this user
    ├── BodyTimeout                408 a request body slower than limits.body_timeout (then
    │                                  closed)
    ├── PayloadTooLarge            413 a body over server.max_body_bytes
    ├── UpstreamUnavailable        502 the model server cannot be reached (not retryable)
    └── ServiceUnavailable         503 a part of Engram that is switched off (memory, slots)

Upstream errors are never wrapped: they are relayed with the status and body the upstream sent.
An error that ``closes`` the connection (the request's body was not read to its end, so nothing
more can be read from it) is answered with ``Connection: close``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web


class EngramError(Exception):
    """An error with an HTTP status, rendered in OpenAI's error shape."""

    status = 500
    type = "server_error"
    code: str | None = None
    closes = False  # answered with Connection: close (proxy.app closes it after the answer)

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param
        self.headers = headers or {}


class BadRequest(EngramError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(EngramError):
    status = 401
    type = "authentication_error"


class Forbidden(EngramError):
    status = 403
    type = "permission_error"


class NotFound(EngramError):
    status = 404
    type = "not_found_error"


class NestingLimitExceeded(BadRequest):
    code = "nesting_limit_exceeded"


class ParentNotFound(NotFound):
    code = "parent_not_found"


class BodyUnreadable(BadRequest):
    """The request's body broke after its headers (a bad chunk, a wrong length, a connection
    cut mid-body, a compressed body that does not decompress)."""

    code = "unreadable_body"
    closes = True


class BodyTimeout(EngramError):
    """The request's body did not arrive within ``limits.body_timeout``."""

    status = 408
    type = "invalid_request_error"
    code = "body_timeout"
    closes = True


class PayloadTooLarge(EngramError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UpstreamRejected(EngramError):
    """The upstream's error to a request Engram translated to chat completions (the client's
    API lacks a route there), re-shaped into the client's API with the upstream's status."""

    type = "api_error"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"The upstream model server answered {status}: {message}")
        self.status = status
        self.code = "upstream_error"


class ServiceUnavailable(EngramError):
    status = 503
    type = "server_error"


class UpstreamUnavailable(EngramError):
    status = 502
    type = "upstream_error"
    code = "upstream_unavailable"

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        # Retrying cannot help while the server is down, and a retried chat request could be
        # archived twice.
        self.headers.setdefault("x-should-retry", "false")


def error_body(
    message: str, type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


ErrorShape = Callable[[int, str, str, str | None, str | None], dict[str, Any]]
"""(status, type, message, code, param) -> an API's error body (``ChatAPI.error_body``)."""


def error_response(exc: EngramError, shape: ErrorShape | None = None) -> web.Response:
    """Render an EngramError as an HTTP response, in OpenAI's shape unless ``shape`` is given
    (the error shape of the chat API whose path was asked)."""
    if shape is not None:
        body = shape(exc.status, exc.type, exc.message, exc.code, exc.param)
    else:
        body = error_body(exc.message, exc.type, exc.code, exc.param)
    response = web.Response(
        status=exc.status,
        body=json.dumps(body).encode(),
        content_type="application/json",
        headers=exc.headers,
    )
    if exc.closes:
        response.force_close()  # aiohttp sends Connection: close and keeps no connection alive
    return response


def sse_error_event(message: str, type: str = "upstream_error", code: str | None = None) -> bytes:
    """A mid-stream error event; the openai SDK raises on a data object with an `error` key."""
    return b"data: " + json.dumps(error_body(message, type, code)).encode() + b"\n\n"
