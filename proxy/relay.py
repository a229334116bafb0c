"""Relaying: read a client's body within the size limit, stream an upstream response back.

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
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from proxy.errors import PayloadTooLarge, UpstreamUnavailable, sse_error_event
from proxy.upstream import response_headers


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole request body, or PayloadTooLarge past ``limit`` bytes."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise PayloadTooLarge(_too_large(declared, limit))
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(_too_large(None, limit)) from None


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
) -> tuple[web.StreamResponse, RelayOutcome]:
    """Stream ``upstream`` back to the client. Always closes or releases ``upstream``.

    ``tap(chunk)`` returns True for the chunk that ends an event stream's (or NDJSON stream's)
    reply; ``finish`` runs (and must not raise) before the bytes from there on, or the body's last
    chunk, are sent. ``translate``: the client gets ``translate.feed`` of each upstream chunk
    (``tap`` still sees the upstream's own bytes) and its ``finish`` at the end."""
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
            if tap is not None and tap(chunk):
                ended = True
            if translate is not None:
                chunk = translate.feed(chunk)
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
            held += translate.finish()
        try:
            if outcome.upstream_failed:
                if held:
                    await resp.write(held)
                await _report_upstream_death(request, resp, sse and translate is None)
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
    if tap is not None:
        tap(body)
    headers = response_headers(upstream.headers, keep_cors=keep_cors)
    headers.popall("Content-Length", None)
    if translate is not None:
        body = translate.feed(body) + translate.finish()
        headers["Content-Type"] = translate.content_type
    if extra_headers:
        headers.update(extra_headers)
    outcome.ended_cleanly = True
    return web.Response(status=upstream.status, reason=upstream.reason, body=body, headers=headers)


async def _report_upstream_death(request: web.Request, resp: web.StreamResponse, sse: bool) -> None:
    if sse:
        try:
            await resp.write(
                sse_error_event(
                    "The upstream model server closed the connection before the reply was done.",
                    code="upstream_disconnected",
                )
            )
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return
    # Anything else: end the connection without completing the body, as the upstream did.
    if request.transport is not None:
        request.transport.close()
