"""The I/O half of the expansion loop (:mod:`proxy.slots.expand` holds the pure half and the
contract).

:meth:`Expander.run` sends the request with the expansion tool, answers the model's calls to it
from the slot store, re-sends, and relays to the client only what belongs to the final reply. It
fills an :class:`Outcome` as it goes (status, reply, outcome flags, as the plain relay reports
them), so archiving and metrics see what the client saw, and awaits ``finish`` (the turn's
archive) once the final reply is whole, before the client gets its last bytes. It knows nothing
of the chat pipeline.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from proxy.config import SlotsSettings
from proxy.errors import sse_error_event
from proxy.relay import encode_json, is_event_stream
from proxy.slots.expand import (
    MIN_EXPANSION_TOKENS,
    StreamRound,
    ToolRejections,
    add_usage,
    answer_text,
    final_completion,
    mentions_tools,
    requested_slot,
    round_trip_messages,
    split_calls,
    with_tool,
)
from proxy.slots.store import SlotStore
from proxy.sse import AssembledReply, ChatAssembler, SSEEvent, SSEParser, reply_from_completion
from proxy.upstream import Upstream, forward_headers, response_headers

log = logging.getLogger("engram.expand")


@dataclass
class Outcome:
    """What became of a request sent with the expansion tool, filled in as it happens (so the
    caller sees how far it got even when the client went away mid-way)."""

    headers: Mapping[str, str]  # Engram's response headers for the client
    response: web.StreamResponse | None = None  # None: the upstream rejected the tool
    status: int | None = None  # the upstream's status
    reply: AssembledReply | None = None  # what the client got, reassembled
    client_gone: bool = False
    upstream_failed: bool = False
    expansions: int = 0  # round trips Engram made answering its own tool


def _dumps(obj: Any) -> bytes:
    return encode_json(obj)


class Expander:
    """Runs chat requests whose forwarded prompt holds slot references."""

    def __init__(
        self, settings: SlotsSettings, slots: SlotStore, upstream: Upstream, keep_cors: bool
    ) -> None:
        self.settings = settings
        self.slots = slots
        self.upstream = upstream
        self.keep_cors = keep_cors
        self.rejections = ToolRejections()
        self.counts: Counter[str] = Counter()  # round_trips, expanded, expired

    def offered(self, model: str | None) -> bool:
        return self.settings.expand and not self.rejections.rejected(model)

    async def run(
        self,
        request: web.Request,
        base: dict[str, Any],
        out: Outcome,
        user: str,
        room: int | None,
        finish: Callable[[], Awaitable[None]] | None = None,
    ) -> Outcome:
        """Send ``base`` with the tool and answer the model's calls to it; ``out`` (returned) has
        the client's response, or none when the upstream rejected the tool (send it the plain
        way). ``finish`` runs once the final reply is whole, before its last bytes are sent."""
        name = self.settings.expand_tool
        body = with_tool(base, name)
        up = await self._send(request, body)
        out.status = up.status
        if up.status != 200:
            data = await _read_all(up)
            model = base.get("model") if isinstance(base.get("model"), str) else None
            if mentions_tools(up.status, data):
                self.rejections.add(model)
                return out
            out.reply = reply_from_completion(_json_or_none(data))
            out.response = self._whole(up, out, data)
            return out
        loop = _Loop(self, request, out, user, room, base, body, finish)
        out.response = await (loop.stream(up) if is_event_stream(up) else loop.plain(up))
        return out

    async def _send(self, request: web.Request, body: dict[str, Any]) -> aiohttp.ClientResponse:
        # Engram reads these replies, so it asks for them uncompressed.
        headers = forward_headers(request.headers, drop=("accept-encoding",))
        return await self.upstream.send(request.method, request.raw_path, headers, _dumps(body))

    def _whole(self, up: aiohttp.ClientResponse, out: Outcome, data: bytes) -> web.Response:
        headers = response_headers(up.headers, keep_cors=self.keep_cors)
        headers.popall("Content-Length", None)
        headers.update(out.headers)
        return web.Response(status=up.status, reason=up.reason, body=data, headers=headers)

    async def answers(
        self, calls: Sequence[dict[str, Any]], user: str, room: int | None
    ) -> tuple[list[str], int | None]:
        """The tool messages' texts for ``calls``, and the context room left after them."""
        out: list[str] = []
        for call in calls:
            fn = call.get("function") if isinstance(call.get("function"), dict) else {}
            sid = requested_slot(fn.get("arguments") if isinstance(fn, dict) else None)
            slot = await self.slots.get(user, sid) if sid else None
            self.counts["expanded" if slot is not None else "expired"] += 1
            out.append(answer_text(sid, slot, room, self.settings.expand_tool))
            if room is not None and slot is not None:
                room = max(MIN_EXPANSION_TOKENS, room - min(room, slot.tokens))
        return out, room


class _Loop:
    """One request's rounds."""

    def __init__(
        self,
        ex: Expander,
        request: web.Request,
        out: Outcome,
        user: str,
        room: int | None,
        base: dict[str, Any],
        body: dict[str, Any],
        finish: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.ex = ex
        self.finish = finish
        self.request = request
        self.out = out
        self.user = user
        self.room = None if room is None else max(MIN_EXPANSION_TOKENS, room)
        self.base = base
        self.body = body
        self.rounds = 0
        self.name = ex.settings.expand_tool

    def _may_round_trip(self) -> bool:
        return self.rounds < self.ex.settings.max_expansions

    async def _next_body(self, content: str | None, calls: Sequence[dict[str, Any]]) -> None:
        answers, self.room = await self.ex.answers(calls, self.user, self.room)
        messages = [*self.body["messages"], *round_trip_messages(content, calls, answers)]
        self.rounds += 1
        self.out.expansions = self.rounds
        self.ex.counts["round_trips"] += 1
        body = {**self.body, "messages": messages}
        if not self._may_round_trip():  # the last request: without the tool, so it must answer
            if "tools" in self.base:
                body["tools"] = self.base["tools"]
            else:
                body.pop("tools", None)
        self.body = body

    # --- plain -------------------------------------------------------------------------------

    async def plain(self, up: aiohttp.ClientResponse) -> web.StreamResponse:
        usage: dict[str, Any] | None = None
        first_id: str | None = None
        while True:
            data = await _read_all(up)
            obj = _json_or_none(data)
            if up.status != 200 or not isinstance(obj, dict):
                self.out.status = up.status
                self.out.reply = reply_from_completion(obj)
                return self.ex._whole(up, self.out, data)
            first_id = first_id or (obj.get("id") if isinstance(obj.get("id"), str) else None)
            usage = add_usage(usage, obj.get("usage"))
            msg = _first_message(obj)
            calls = msg.get("tool_calls")
            internal, client = split_calls(calls if isinstance(calls, list) else [], self.name)
            if internal and not client and self._may_round_trip():
                content = msg.get("content") if isinstance(msg.get("content"), str) else None
                await self._next_body(content, internal)
                up = await self.ex._send(self.request, self.body)
                continue
            if self.rounds or internal:
                data = _dumps(final_completion(obj, self.name, usage, first_id))
                obj = json.loads(data)
            self.out.status = up.status
            self.out.reply = reply_from_completion(obj)
            if self.finish is not None:
                await self.finish()
            return self.ex._whole(up, self.out, data)

    # --- streamed ----------------------------------------------------------------------------

    async def stream(self, up: aiohttp.ClientResponse) -> web.StreamResponse:
        out = self.out
        headers = response_headers(up.headers, keep_cors=self.ex.keep_cors)
        headers.update(out.headers)
        resp = web.StreamResponse(status=up.status, reason=up.reason, headers=headers)
        await resp.prepare(self.request)
        assembler = ChatAssembler()
        ended_cleanly = False
        current = up
        try:
            total: dict[str, Any] | None = None
            first_id: str | None = None
            while True:
                rnd = StreamRound(self.name, self._may_round_trip(), first_id)
                result = await self._relay_round(current, resp, rnd, assembler)
                first_id = rnd.first_id
                if result == "client_gone":
                    out.client_gone = True
                    return resp
                if result == "failed":
                    out.upstream_failed = True
                    await _write_quietly(
                        resp,
                        sse_error_event(
                            "The upstream model server closed the connection before the reply "
                            "was done.",
                            code="upstream_disconnected",
                        ),
                    )
                    return resp
                total = add_usage(total, rnd.usage)
                if not rnd.round_trip:
                    await self._finish(resp, rnd, total, assembler)
                    ended_cleanly = True
                    return resp
                current.release()
                await resp.write(b": engram is expanding a tool result\n\n")
                await self._next_body("".join(rnd.content) or None, rnd.calls())
                current = await self.ex._send(self.request, self.body)
                if current.status != 200 or not is_event_stream(current):
                    data = await _read_all(current)
                    out.upstream_failed = True
                    await _write_quietly(
                        resp,
                        sse_error_event(
                            f"The upstream model server answered {current.status} to Engram's "
                            f"expansion round trip: {data[:500].decode('utf-8', 'replace')}",
                            code="expansion_failed",
                        ),
                    )
                    return resp
        except ConnectionResetError:
            out.client_gone = True
            return resp
        except asyncio.CancelledError:
            out.client_gone = True
            raise
        finally:
            out.reply = assembler.finish(ended_cleanly=ended_cleanly)
            if ended_cleanly:
                current.release()
            else:
                current.close()  # drop the connection: the upstream stops generating

    async def _relay_round(
        self,
        up: aiohttp.ClientResponse,
        resp: web.StreamResponse,
        rnd: StreamRound,
        assembler: ChatAssembler,
    ) -> str:
        """Relay one round's events; 'done', 'failed' (upstream died) or 'client_gone'."""
        parser = SSEParser()
        while True:
            try:
                chunk = await up.content.readany()
            except (TimeoutError, aiohttp.ClientError):
                return "failed"
            if not chunk:
                break
            try:
                await self._write_events(parser.feed(chunk), resp, rnd, assembler)
            except ConnectionResetError:
                return "client_gone"
        await self._write_events(parser.close(), resp, rnd, assembler)
        return "done"

    async def _write_events(
        self,
        events: list[SSEEvent],
        resp: web.StreamResponse,
        rnd: StreamRound,
        assembler: ChatAssembler,
    ) -> None:
        out: list[bytes] = []
        for ev in events:
            data = ev.data.strip()
            if ev.event is not None:
                out.append(f"event: {ev.event}\ndata: {ev.data}\n\n".encode())
                continue
            if data == "[DONE]":
                rnd.done = True  # sent by _finish, after the summed usage
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                out.append(f"data: {ev.data}\n\n".encode())
                continue
            if not isinstance(obj, dict):
                out.append(f"data: {ev.data}\n\n".encode())
                continue
            if rnd.first_id is None and isinstance(obj.get("id"), str):
                rnd.first_id = obj["id"]
            new = rnd.feed(obj)
            if new is None:
                continue
            assembler.add_chunk(new)
            text = ev.data if new is obj else json.dumps(new, ensure_ascii=False)
            out.append(f"data: {text}\n\n".encode())
        if out:
            await resp.write(b"".join(out))

    async def _finish(
        self,
        resp: web.StreamResponse,
        rnd: StreamRound,
        total: dict[str, Any] | None,
        assembler: ChatAssembler,
    ) -> None:
        tail: list[bytes] = []
        if total is not None:
            chunk = (
                dict(rnd.usage_chunk)
                if rnd.usage_chunk is not None
                else {
                    "id": rnd.first_id,
                    "object": "chat.completion.chunk",
                    "choices": [],
                }
            )
            if rnd.first_id:
                chunk["id"] = rnd.first_id
            chunk["usage"] = total
            assembler.add_chunk(chunk)
            tail.append(b"data: " + _dumps(chunk) + b"\n\n")
        if rnd.done:
            assembler.done = True
            tail.append(b"data: [DONE]\n\n")
        if self.finish is not None:
            self.out.reply = assembler.finish(ended_cleanly=True)
            await self.finish()
        if tail:
            await resp.write(b"".join(tail))
        await resp.write_eof()


async def _read_all(up: aiohttp.ClientResponse) -> bytes:
    try:
        return await up.read()
    finally:
        up.release()


def _json_or_none(data: bytes) -> Any:
    try:
        return json.loads(data) if data else None
    except (ValueError, UnicodeDecodeError):
        return None


def _first_message(obj: dict[str, Any]) -> dict[str, Any]:
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        msg = choices[0].get("message")
        if isinstance(msg, dict):
            return msg
    return {}


async def _write_quietly(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
        await resp.write_eof()
    except ConnectionResetError:
        pass
