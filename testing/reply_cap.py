"""A relay in front of a real model server that caps every reply's length: agents ask for 32,000
tokens, and a tiny model takes them all (minutes of rambling on a CPU). A real aiohttp app on a
real port; every request goes on unchanged except that a JSON body's reply ceiling
(``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``, ``n_predict``, Ollama's
``options.num_predict``) is lowered to ``cap``; the answer comes back chunk by chunk, a reply
cut by the cap marked as finished (``stop_reason: "end_turn"``, ``finish_reason: "stop"``, a
Responses ``completed``), or agents take the cut for their own limit and retry ("Output token
limit hit…") until they give up.

    relay = ReplyCap(llama.url, cap=64)
    url = await relay.start()     # point Engram (or a client) at url
    await relay.stop()
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from aiohttp import web

CEILINGS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict")
# How each API says "cut at the ceiling", and what a finished reply says instead.
FINISHED = (
    (b'"stop_reason":"max_tokens"', b'"stop_reason":"end_turn"'),
    (b'"stop_reason": "max_tokens"', b'"stop_reason": "end_turn"'),
    (b'"finish_reason":"length"', b'"finish_reason":"stop"'),
    (b'"finish_reason": "length"', b'"finish_reason": "stop"'),
    (b"response.incomplete", b"response.completed"),
    (b'"status":"incomplete"', b'"status":"completed"'),
    (b'"status": "incomplete"', b'"status": "completed"'),
)


def finished(chunk: bytes) -> bytes:
    """``chunk`` with every "cut at the ceiling" said as "finished"."""
    for old, new in FINISHED:
        chunk = chunk.replace(old, new)
    return chunk


HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
)


def capped(body: bytes, cap: int) -> bytes:
    """``body`` with its reply ceilings at most ``cap`` (chat's and Responses' set to ``cap``
    when none is); anything that is not a JSON object goes as it is."""
    try:
        data: Any = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict):
        return body
    present = [k for k in CEILINGS if isinstance(data.get(k), int)]
    for key in present or ["max_tokens", "max_output_tokens"]:
        value = data.get(key)
        data[key] = min(value, cap) if isinstance(value, int) else cap
    options = data.get("options")
    if isinstance(options, dict):
        options["num_predict"] = min(options.get("num_predict") or cap, cap)
    return json.dumps(data).encode()


class ReplyCap:
    def __init__(self, upstream: str, cap: int = 64) -> None:
        self.upstream = upstream.rstrip("/")
        self.cap = cap
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        if request.method == "POST" and body:
            body = capped(body, self.cap)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with self._session.request(
            request.method, self.upstream + request.raw_path, headers=headers, data=body or None
        ) as up:
            out = {k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP}
            resp = web.StreamResponse(status=up.status, headers=out)
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(finished(chunk))
            await resp.write_eof()
            return resp
