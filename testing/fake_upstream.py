"""A scriptable fake model server: a real aiohttp app on a real port that mimics llama.cpp's
llama-server (``flavor="llamacpp"``) or Ollama (``flavor="ollama"``) and records every request.

    fake = FakeUpstream(strict_templates=True)
    url = await fake.start()
    fake.enqueue(StreamReply(chat_chunks(["Hel", "lo"]), delay=0.05, die_after=2))
    ...  # drive the proxy at url
    assert fake.chat_requests()[0].json()["messages"] == [...]
    await fake.stop()

Enqueued replies are one-shot and consumed first-in first-out per path; with the queue empty
each route answers deterministically (chat replies echo the last user message). ``DropReply()``
closes the connection unanswered; ``FakeUpstream(close_after_stream=0.05)`` closes every
connection that shortly after a streamed reply, reading nothing more on it, as llama-server does;
``FakeUpstream(cors=True)`` answers CORS as llama-server does (preflights on any path, and the
request's Origin allowed on every answer); ``FakeUpstream(kv_cache=True)`` reports on chat
completions what it computed and reused of each prompt, as llama-server does (``timings``,
``usage.prompt_tokens_details``; :mod:`testing.fake_cache`).

Standalone, for benchmarks: ``python -m testing.fake_upstream --port 8081 [--flavor ollama]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from testing import fake_ollama
from testing.fake_anthropic import messages_routes
from testing.fake_cache import KVCache, on_last_chunk, rendered, timings, with_report
from testing.fake_chunks import (
    chat_chunks,
    chat_completion,
    completion_chunks,
    completion_object,
    embedding,
    last_user_text,
    llamacpp_error,
    make_usage,
    openai_error,
    rough_tokens,
    static_bodies,
    template_violations,
    text_of,
    words,
)
from testing.fake_responses import PATHS as RESPONSES_PATHS
from testing.fake_responses import FakeResponses

__all__ = [
    "DropReply",
    "FakeUpstream",
    "JsonReply",
    "RawReply",
    "RecordedRequest",
    "Reply",
    "StreamReply",
    "chat_chunks",
    "chat_completion",
    "llamacpp_error",
    "openai_error",
    "template_violations",
]

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
# What llama-server answers a CORS preflight with, on any path (besides the Origin granted).
LLAMACPP_PREFLIGHT = {
    "Access-Control-Allow-Credentials": "true",
    "Access-Control-Allow-Methods": "GET, POST",
    "Access-Control-Allow-Headers": "*",
}
MAX_BODY = 256 * 1024 * 1024


@dataclass
class RecordedRequest:
    method: str
    path: str
    query_string: str
    headers: CIMultiDict[str]
    body: bytes  # exactly as received
    received_at: float  # time.monotonic() when the request arrived

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Reply:
    """Base of the one-shot replies that :meth:`FakeUpstream.enqueue` takes."""


@dataclass
class JsonReply(Reply):
    body: Any
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # seconds to wait before answering (a slow non-streamed reply)


@dataclass
class RawReply(Reply):
    body: bytes
    status: int = 200
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0


@dataclass
class StreamReply(Reply):
    """Writes each element of ``events`` as-is, ``delay`` seconds apart. With ``die_after=N``
    the connection is aborted after N elements, with no terminating chunk."""

    events: list[bytes]
    delay: float = 0.0
    status: int = 200
    content_type: str = "text/event-stream"
    die_after: int | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class DropReply(Reply):
    """Reads the whole request, then closes the connection without sending a byte: a server
    that dropped the request (or died on it) before answering."""


Handler = Callable[[web.Request, bytes], Awaitable[web.StreamResponse]]


class FakeUpstream:
    def __init__(
        self,
        *,
        flavor: str = "llamacpp",
        n_ctx: int = 4096,
        strict_templates: bool = False,
        enforce_ctx: bool = False,
        renders_tools: bool = True,
        model: str = "fake-model",
        record: bool = True,
        close_after_stream: float | None = None,
        cors: bool = False,
        kv_cache: bool = False,
    ) -> None:
        if flavor not in ("llamacpp", "ollama"):
            raise ValueError(f"unknown flavor {flavor!r}")
        self.flavor = flavor
        self.n_ctx = n_ctx
        self.strict_templates = strict_templates
        # llamacpp: 400 exceed_context_size_error past n_ctx, tool definitions counted (every
        # chat API: chat completions, Messages, Responses)
        self.enforce_ctx = enforce_ctx
        # Whether the chat template renders tool definitions into the prompt (SmolLM2's does
        # not): counted in the context and in the usage reported, or in neither.
        self.renders_tools = renders_tools
        self.last_prompt_tokens = 0  # of the last chat request, as counted against n_ctx
        # What a chat reply says, given the last user message's text (chat completions,
        # Messages, Responses): its echo, unless a test wants a model's words.
        self.reply_text: Callable[[str], str] = lambda last: f"echo: {last}"
        self.model = model
        self.record = record
        # Like llama-server: after each streamed reply, read nothing more on that connection and
        # close it this many seconds later, while advertising keep-alive (None: keep it open).
        self.close_after_stream = close_after_stream
        # Like llama-server: every answer grants CORS to the request's Origin, and a CORS
        # preflight on any path is a 200 that allows everything (off: OPTIONS is a 404).
        self.cors = cors
        # Like llama-server: chat completions report the prompt tokens computed and reused.
        self.kv_cache = KVCache() if kv_cache else None
        self.requests: list[RecordedRequest] = []
        self.disconnects: list[tuple[str, float]] = []
        self.url = ""
        self._queues: dict[str, deque[Reply]] = {}
        self._runner: web.AppRunner | None = None
        self._stopping = False
        self._routes: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/chat/completions"): self._chat,
            ("POST", "/v1/embeddings"): self._embeddings,
            ("POST", "/v1/completions"): self._completions,
        }
        self._routes.update(messages_routes(self))
        self.responses = FakeResponses(self)  # /v1/responses (testing.fake_responses)
        self._routes.update({("POST", path): self.responses.handle for path in RESPONSES_PATHS})
        if flavor == "llamacpp":
            self._routes[("POST", "/tokenize")] = self._tokenize
            self._routes[("POST", "/apply-template")] = self._apply_template
        else:
            self._routes[("POST", "/api/chat")] = self._ollama_chat

    # ---- public API -------------------------------------------------------------------------

    def enqueue(self, *replies: Reply, path: str = "/v1/chat/completions") -> None:
        self._queues.setdefault(path, deque()).extend(replies)

    def chat_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path in CHAT_PATHS]

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        app.on_response_prepare.append(self._grant_cors)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.25
        )
        self._stopping = False
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            self._stopping = True  # handlers cancelled by the shutdown are no disconnects
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeUpstream:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- plumbing ---------------------------------------------------------------------------

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        received_at = time.monotonic()
        body = await request.read()
        if self.record:
            headers = CIMultiDict(request.headers)
            self.requests.append(
                RecordedRequest(
                    request.method, request.path, request.query_string, headers, body, received_at
                )
            )
        queue = self._queues.get(request.path)
        if queue:
            return await self._send(request, queue.popleft())
        if self.cors and request.method == "OPTIONS":
            return web.Response(body=b"", content_type="text/html", headers=LLAMACPP_PREFLIGHT)
        handler = self._routes.get((request.method, request.path))
        if handler is not None:
            return await handler(request, body)
        static = static_bodies(self.flavor, self.model, self.n_ctx)
        if (request.method, request.path) in static:
            return web.json_response(static[(request.method, request.path)])
        missing = "File Not Found" if self.flavor == "llamacpp" else "404 page not found"
        return self._error(404, missing, "not_found_error")

    async def _grant_cors(self, request: web.Request, resp: web.StreamResponse) -> None:
        """llama-server's middleware: ``Access-Control-Allow-Origin`` is the request's Origin."""
        origin = request.headers.get("Origin")
        if self.cors and origin is not None:
            resp.headers["Access-Control-Allow-Origin"] = origin

    @contextlib.contextmanager
    def _watch(self, path: str) -> Iterator[None]:
        """Record a client disconnect noticed while answering."""
        try:
            yield
        except (asyncio.CancelledError, ConnectionResetError):
            if not self._stopping:
                self.disconnects.append((path, time.monotonic()))
            raise

    async def _send(self, request: web.Request, reply: Reply) -> web.StreamResponse:
        if isinstance(reply, StreamReply):
            return await self._stream(request, reply)
        if isinstance(reply, DropReply):
            if request.transport is not None:
                request.transport.abort()
            await asyncio.Event().wait()  # cancelled: the connection is gone
        if isinstance(reply, JsonReply | RawReply) and reply.delay:
            with self._watch(request.path):
                await asyncio.sleep(reply.delay)
        if isinstance(reply, JsonReply):
            return web.json_response(reply.body, status=reply.status, headers=reply.headers)
        if isinstance(reply, RawReply):
            headers = {"Content-Type": reply.content_type, **reply.headers}
            return web.Response(body=reply.body, status=reply.status, headers=headers)
        raise TypeError(f"not a reply: {reply!r}")

    async def _stream(self, request: web.Request, reply: StreamReply) -> web.StreamResponse:
        headers = {"Content-Type": reply.content_type, "Cache-Control": "no-cache"}
        if self.close_after_stream is not None:
            headers["Keep-Alive"] = "timeout=5, max=100"  # what llama-server says, and breaks
        resp = web.StreamResponse(status=reply.status, headers={**headers, **reply.headers})
        with self._watch(request.path):
            await resp.prepare(request)
            for i, event in enumerate(reply.events):
                if reply.die_after is not None and i >= reply.die_after:
                    break
                if i and reply.delay:
                    await asyncio.sleep(reply.delay)
                await resp.write(event)
            if reply.die_after is not None:  # upstream died mid-stream: no terminating chunk
                if request.transport is not None:
                    request.transport.abort()
                return resp
            await resp.write_eof()
        if self.close_after_stream is not None and request.transport is not None:
            self._close_later(request.transport, self.close_after_stream)
        return resp

    @staticmethod
    def _close_later(transport: asyncio.BaseTransport, delay: float) -> None:
        """Stop reading the connection (a request sent on it is never answered) and close it
        ``delay`` seconds later: what llama-server does about 0.1 ms after a streamed reply."""
        if isinstance(transport, asyncio.ReadTransport):
            transport.pause_reading()
        asyncio.get_running_loop().call_later(delay, transport.close)

    def prompt_tokens(self, messages_tokens: int, payload: dict[str, Any]) -> int:
        """The prompt's tokens: the messages', plus the tool definitions' when the chat template
        renders them (``renders_tools``), as ``usage`` reports them."""
        tools = payload.get("tools")
        rendered = rough_tokens(json.dumps(tools)) if tools and self.renders_tools else 0
        self.last_prompt_tokens = messages_tokens + rendered
        return self.last_prompt_tokens

    def over_context(self, prompt_tokens: int, payload: dict[str, Any]) -> web.Response | None:
        """With ``enforce_ctx``, llama-server's 400 for a prompt (:meth:`prompt_tokens`: tools
        counted where rendered) past ``n_ctx``."""
        if not self.enforce_ctx or self.flavor != "llamacpp":
            return None
        n = self.prompt_tokens(prompt_tokens, payload)
        if n <= self.n_ctx:
            return None
        return self._error(
            400,
            f"request ({n} tokens) exceeds the available context size ({self.n_ctx} tokens), "
            "try increasing it",
            "exceed_context_size_error",
            n_prompt_tokens=n,
            n_ctx=self.n_ctx,
        )

    def _error(self, status: int, message: str, type_: str, **extra: int) -> web.Response:
        if self.flavor == "llamacpp":
            body = llamacpp_error(message, status, type_, **extra)
        else:
            body = openai_error(message, type_)
        return web.json_response(body, status=status)

    def _parse(self, body: bytes) -> dict[str, Any] | web.Response:
        try:
            payload = json.loads(body)
        except ValueError as exc:
            return self._error(400, f"Failed to parse JSON: {exc}", "invalid_request_error")
        if not isinstance(payload, dict):
            return self._error(400, "request body must be a JSON object", "invalid_request_error")
        return payload

    # ---- OpenAI-compatible routes -----------------------------------------------------------

    async def _chat(self, request: web.Request, body: bytes) -> web.StreamResponse:
        payload = self._parse(body)
        if isinstance(payload, web.Response):
            return payload
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return self._error(400, "'messages' is required", "invalid_request_error")
        if self.strict_templates and (problems := template_violations(messages)):
            return self._error(500, "; ".join(problems), "server_error")
        prompt_tokens = sum(
            rough_tokens(text_of(m.get("content"))) for m in messages if isinstance(m, dict)
        )
        if (over := self.over_context(prompt_tokens, payload)) is not None:
            return over
        text = self.reply_text(last_user_text(messages))
        model = str(payload.get("model") or self.model)
        usage = make_usage(self.prompt_tokens(prompt_tokens, payload), rough_tokens(text))
        report: dict[str, Any] = {}
        if self.kv_cache is not None:
            tools = payload.get("tools") if self.renders_tools else None
            computed, reused = self.kv_cache.use(rendered(messages, tools), usage["prompt_tokens"])
            usage = with_report(usage, reused)
            report["timings"] = timings(computed, reused, usage["completion_tokens"])
        if payload.get("stream"):
            opts = payload.get("stream_options") or {}
            with_usage = usage if isinstance(opts, dict) and opts.get("include_usage") else None
            events = on_last_chunk(chat_chunks(words(text), model=model, usage=with_usage), report)
            return await self._stream(request, StreamReply(events))
        return web.json_response({**chat_completion(text, usage=usage, model=model), **report})

    async def _embeddings(self, request: web.Request, body: bytes) -> web.StreamResponse:
        payload = self._parse(body)
        if isinstance(payload, web.Response):
            return payload
        inputs = payload.get("input", "")
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        data = [
            {"object": "embedding", "index": i, "embedding": embedding(item)}
            for i, item in enumerate(inputs)
        ]
        n = sum(rough_tokens(x) if isinstance(x, str) else len(x) for x in inputs)
        usage = {"prompt_tokens": n, "total_tokens": n}
        model = payload.get("model") or self.model
        return web.json_response({"object": "list", "data": data, "model": model, "usage": usage})

    async def _completions(self, request: web.Request, body: bytes) -> web.StreamResponse:
        payload = self._parse(body)
        if isinstance(payload, web.Response):
            return payload
        prompt = payload.get("prompt", "")
        if isinstance(prompt, list):
            prompt = "".join(p for p in prompt if isinstance(p, str))
        text = f"echo: {prompt}"
        model = str(payload.get("model") or self.model)
        if payload.get("stream"):
            return await self._stream(
                request, StreamReply(completion_chunks(words(text), model=model))
            )
        usage = make_usage(rough_tokens(str(prompt)), rough_tokens(text))
        return web.json_response(completion_object(text, model=model, usage=usage))

    async def _tokenize(self, request: web.Request, body: bytes) -> web.StreamResponse:
        payload = self._parse(body)
        if isinstance(payload, web.Response):
            return payload
        n = rough_tokens(str(payload.get("content", "")))
        return web.json_response({"tokens": list(range(1, n + 1))})

    async def _apply_template(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """llama-server's ``/apply-template``: the prompt its template makes (tools only when
        ``renders_tools``)."""
        payload = self._parse(body)
        if isinstance(payload, web.Response):
            return payload
        tools = payload.get("tools") if self.renders_tools else None
        return web.json_response({"prompt": rendered(payload.get("messages") or [], tools)})

    async def _ollama_chat(self, request: web.Request, body: bytes) -> web.StreamResponse:
        return await fake_ollama.chat(request, body, self.model)


async def _serve(host: str, port: int, flavor: str) -> None:
    fake = FakeUpstream(flavor=flavor, record=False)
    url = await fake.start(host, port)
    print(f"listening on {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await fake.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve the fake model server.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--flavor", choices=("llamacpp", "ollama"), default="llamacpp")
    args = parser.parse_args()
    asyncio.run(_serve(args.host, args.port, args.flavor))


if __name__ == "__main__":
    main()
