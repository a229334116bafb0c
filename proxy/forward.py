"""Relaying: read a client's body within the size limit, stream an upstream response back.

Bytes go back as they arrive, chunk by chunk, unbuffered. A ``tap`` sees a copy of every chunk
(the chat pipeline reassembles the reply from it). When the client goes away the upstream
response is closed at once, so the model stops generating; when the upstream dies mid-stream an
SSE client gets an error event (the openai SDK raises on it) and any other client a truncated body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

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


def is_event_stream(resp: aiohttp.ClientResponse) -> bool:
    return resp.content_type == "text/event-stream"


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
    tap: Callable[[bytes], None] | None = None,
) -> tuple[web.StreamResponse, RelayOutcome]:
    """Stream ``upstream`` back to the client. Always closes or releases ``upstream``."""
    outcome = RelayOutcome()
    try:
        if _small_and_whole(upstream):
            return await _relay_small(upstream, outcome, keep_cors, extra_headers, tap), outcome
        resp = web.StreamResponse(
            status=upstream.status,
            reason=upstream.reason,
            headers=response_headers(upstream.headers, keep_cors=keep_cors),
        )
        if extra_headers:
            resp.headers.update(extra_headers)
        await resp.prepare(request)
        while True:
            try:
                chunk = await upstream.content.readany()
            except (TimeoutError, aiohttp.ClientError):
                outcome.upstream_failed = True
                break
            if not chunk:
                break
            if tap is not None:
                tap(chunk)
            try:
                await resp.write(chunk)
            except ConnectionResetError:
                outcome.client_gone = True
                return resp, outcome
        if outcome.upstream_failed:
            await _report_upstream_death(request, resp, is_event_stream(upstream))
        else:
            await resp.write_eof()
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
    tap: Callable[[bytes], None] | None,
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
