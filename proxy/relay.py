"""Relaying: read a client's body within the size and time limits, stream an upstream response
back.

Every read of a request's body goes through :func:`body_read` (the chat and pass-through routes
by :func:`read_body`, the admin API, the MCP endpoint and the inspector's forms directly): it gives
the body ``limits.body_timeout`` to arrive, and a body that breaks on the way (a bad chunk, a
length the connection closes short of) or comes too late is Engram's 400 or 408, after which the
connection is closed, never a handler waiting on bytes that will not come.

Bytes go back as they arrive, chunk by chunk, unbuffered. A ``tap`` sees a copy of every chunk
(the chat pipeline reassembles the reply from it). When the client goes away the upstream
response is closed at once, so the model stops generating; when the upstream dies mid-stream an
SSE client gets an error event (the openai SDK raises on it) and any other client a truncated body.

A ``finish`` hook runs once the reply is whole and before the client gets its last bytes (the
chat pipeline archives the turn there, so the client's next request finds it stored): an event
stream is held back from the chunk in which ``tap`` saw its end (``[DONE]``) or, without one,
only its end (the terminating chunk); any other body by its last chunk.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.errors import (
    BodyTimeout,
    BodyUnreadable,
    PayloadTooLarge,
    UpstreamUnavailable,
    sse_error_event,
)
from proxy.upstream import response_headers

T = TypeVar("T")

BODY_TIMEOUT = web.AppKey("body_timeout", float)
"""``limits.body_timeout`` of the app (:func:`proxy.app.create_app` sets it; absent: no limit)."""

# While a body is late, how often to look whether aiohttp's parser has given up on it.
_PARSER_WATCH = 0.1


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole request body, or PayloadTooLarge past ``limit`` bytes (and :func:`body_read`'s
    errors)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise PayloadTooLarge(_too_large(declared, limit))
    try:
        return await body_read(request, request.read())
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(_too_large(None, limit)) from None


async def body_read(request: web.Request, reading: Awaitable[T]) -> T:
    """What ``reading`` (``request.read()``, ``request.post()``, a loop over
    ``request.content``) returns, within ``limits.body_timeout`` of now: past it a
    :class:`~proxy.errors.BodyTimeout` (408), and a :class:`~proxy.errors.BodyUnreadable` (400)
    as soon as the body cannot be read. Both close the connection once answered (``closes``).

    A body already whole (the usual case: it came with the headers) is read at once. One still
    on its way is read in a task, watched: aiohttp 3.14's C parser, meeting a bad chunk size in
    a body that arrives after the headers, drops the body without ending the stream the handler
    reads from; it only queues the error as the connection's next message, answered after this
    handler ends, so the read would wait until the client gave up (:func:`_parser_error`)."""
    content = request.content
    if content.is_eof():
        try:
            return await reading
        except _BROKEN as exc:
            raise _unreadable(exc) from None
    loop = asyncio.get_running_loop()
    timeout = request.app.get(BODY_TIMEOUT, 0.0)
    deadline = loop.time() + timeout if timeout > 0 else None
    task = asyncio.ensure_future(reading)
    try:
        while True:
            wait = _PARSER_WATCH if deadline is None else min(_PARSER_WATCH, deadline - loop.time())
            done, _ = await asyncio.wait((task,), timeout=max(wait, 0.0))
            if done:
                return task.result()
            broken = _parser_error(request)
            if broken is not None:
                raise _unreadable(broken)
            if deadline is not None and loop.time() >= deadline:
                raise BodyTimeout(
                    f"The request body did not arrive within {timeout:g} s (setting "
                    "limits.body_timeout); the connection is closed."
                )
    except _BROKEN as exc:
        raise _unreadable(exc) from None
    finally:
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()  # seen: never logged as an exception nobody retrieved


# What reading a body raises when the body breaks: aiohttp's parser errors (a bad chunk, a
# length the stream ended short of), a body that does not decompress, the client gone mid-body.
_BROKEN = (HttpProcessingError, web.RequestPayloadError, ConnectionResetError)


def _unreadable(exc: BaseException) -> BodyUnreadable:
    """The 400 for a body that broke, saying why in aiohttp's words, on one line."""
    cause = exc.__cause__ if isinstance(exc.__cause__, HttpProcessingError) else exc
    why = cause.message if isinstance(cause, HttpProcessingError) else str(cause)
    why = re.sub(r"^\d{3}, message:\s*", "", why.strip()).split("\n", 1)[0].strip().rstrip(":")
    why = why or type(exc).__name__
    return BodyUnreadable(f"The request body could not be read ({why}); the connection is closed.")


def _parser_error(request: web.Request) -> HttpProcessingError | None:
    """The parse error aiohttp met in this request's unfinished body, else None.

    aiohttp queues a parse error as an error message on the connection (the private
    ``RequestHandler._messages``); while this request's body is unfinished the parser cannot
    have reached another request, so a queued error is this body's. Should aiohttp change that
    queue, this finds nothing and such a body meets ``limits.body_timeout`` instead."""
    if request.content.is_eof():
        return None
    queued = getattr(request.protocol, "_messages", None) or ()
    for item in tuple(queued):
        exc = getattr(item[0], "exc", None) if isinstance(item, tuple) and item else None
        if isinstance(exc, HttpProcessingError):
            return exc
    return None


def _too_large(size: int | None, limit: int) -> str:
    got = f" ({size} bytes)" if size is not None else ""
    return (
        f"Request body too large{got}: Engram accepts at most {limit} bytes "
        "(setting server.max_body_bytes)."
    )


def encode_json(obj: Any) -> bytes:
    """``obj`` as UTF-8 JSON. A string holding a lone surrogate (legal in JSON as ``\\ud800``,
    not encodable in UTF-8) makes the whole document go out ASCII-escaped: the same JSON value
    the client sent, never an encoding error."""
    try:
        return json.dumps(obj, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(obj).encode()


def is_event_stream(resp: aiohttp.ClientResponse) -> bool:
    return resp.content_type == "text/event-stream"


def is_ndjson(resp: aiohttp.ClientResponse) -> bool:
    """Ollama's streams: one JSON object a line."""
    return resp.content_type in ("application/x-ndjson", "application/ndjson")


class Translation(Protocol):
    """Rewrites the upstream's bytes for the client (:class:`proxy.chat.api.ReplyTranslator`)."""

    content_type: str

    def feed(self, chunk: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


@dataclass
class RelayOutcome:
    """How a relay ended."""

    ended_cleanly: bool = False  # the upstream finished and the client got everything
    upstream_failed: bool = False  # the upstream connection died mid-body
    client_gone: bool = False  # the client went away


async def relay(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    *,
    keep_cors: bool,
    extra_headers: Mapping[str, str] | None = None,
    tap: Callable[[bytes], bool | None] | None = None,
    finish: Callable[[], Awaitable[None]] | None = None,
    translate: Translation | None = None,
    death_event: bytes | None = None,
) -> tuple[web.StreamResponse, RelayOutcome]:
    """Stream ``upstream`` back to the client. Always closes or releases ``upstream``.

    ``tap(chunk)`` returns True for the chunk that ends an event stream's (or NDJSON stream's)
    reply; ``finish`` runs (and must not raise) before the bytes from there on, or the body's last
    chunk, are sent. ``translate``: the client gets ``translate.feed`` of each upstream chunk and
    its ``finish`` at the end, and ``tap`` sees those translated bytes (what the client got).
    ``death_event``: what to write when the upstream dies mid-body (the client API's error
    event); without it an event stream gets OpenAI's and any other body is cut."""
    outcome = RelayOutcome()
    try:
        if _small_and_whole(upstream):
            whole = await _relay_small(upstream, outcome, keep_cors, extra_headers, tap, translate)
            if finish is not None and outcome.ended_cleanly:
                await finish()
            return whole, outcome
        headers = response_headers(upstream.headers, keep_cors=keep_cors)
        if translate is not None:
            headers.popall("Content-Length", None)
            headers["Content-Type"] = translate.content_type
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        if extra_headers:
            resp.headers.update(extra_headers)
        await resp.prepare(request)
        sse = is_event_stream(upstream)
        streams = sse or is_ndjson(upstream)  # held back from the end marker, not chunk by chunk
        held = b""  # what waits for ``finish``
        ended = False  # the event stream's end was seen: everything from there on is held
        while True:
            try:
                chunk = await upstream.content.readany()
            except (TimeoutError, aiohttp.ClientError):
                outcome.upstream_failed = True
                break
            if not chunk:
                break
            if translate is not None:
                chunk = translate.feed(chunk)
            if tap is not None and chunk and tap(chunk):
                ended = True
            if finish is not None and (ended or not streams):
                chunk, held = (b"", held + chunk) if ended else (held, chunk)
            if not chunk:
                continue
            try:
                await resp.write(chunk)
            except ConnectionResetError:
                outcome.client_gone = True
                return resp, outcome
        if translate is not None and not outcome.upstream_failed:
            tail = translate.finish()
            if tap is not None and tail:
                tap(tail)
            held += tail
        try:
            if outcome.upstream_failed:
                if held:
                    await resp.write(held)
                await _report_upstream_death(request, resp, sse, death_event)
                return resp, outcome
            if finish is not None:
                await finish()
            if held:
                await resp.write(held)
            await resp.write_eof()
        except ConnectionResetError:
            outcome.client_gone = True
            return resp, outcome
        outcome.ended_cleanly = True
        return resp, outcome
    except asyncio.CancelledError:
        outcome.client_gone = True  # aiohttp cancels the handler when the client disconnects
        raise
    finally:
        if outcome.ended_cleanly:
            upstream.release()
        else:
            upstream.close()  # drop the connection: the upstream stops generating


# A reply whose declared length is at most this is read whole and sent as one write (headers
# and body together): it is already complete at the upstream, so nothing waits on it, and one
# syscall instead of two is a sixth of the proxy's CPU per small request.
SMALL_BODY = 64 * 1024


def _small_and_whole(upstream: aiohttp.ClientResponse) -> bool:
    length = upstream.content_length
    return length is not None and length <= SMALL_BODY and not is_event_stream(upstream)


async def _relay_small(
    upstream: aiohttp.ClientResponse,
    outcome: RelayOutcome,
    keep_cors: bool,
    extra_headers: Mapping[str, str] | None,
    tap: Callable[[bytes], bool | None] | None,
    translate: Translation | None,
) -> web.Response:
    try:
        body = await upstream.read()
    except (TimeoutError, aiohttp.ClientError):
        outcome.upstream_failed = True
        raise UpstreamUnavailable(
            "The upstream model server closed the connection before its reply was complete."
        ) from None
    headers = response_headers(upstream.headers, keep_cors=keep_cors)
    headers.popall("Content-Length", None)
    if translate is not None:
        body = translate.feed(body) + translate.finish()
        headers["Content-Type"] = translate.content_type
    if tap is not None:
        tap(body)
    if extra_headers:
        headers.update(extra_headers)
    outcome.ended_cleanly = True
    return web.Response(status=upstream.status, reason=upstream.reason, body=body, headers=headers)


UPSTREAM_DIED = "The upstream model server closed the connection before the reply was done."


async def _report_upstream_death(
    request: web.Request, resp: web.StreamResponse, sse: bool, event: bytes | None
) -> None:
    """An error event the client's SDK raises on (``event``: the chat API's own; else OpenAI's
    for an event stream), or, for any other body, the connection cut as the upstream's was."""
    if event is None and sse:
        event = sse_error_event(UPSTREAM_DIED, code="upstream_disconnected")
    if event is not None:
        try:
            await resp.write(event)
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return
    # Anything else: end the connection without completing the body, as the upstream did.
    if request.transport is not None:
        request.transport.close()
