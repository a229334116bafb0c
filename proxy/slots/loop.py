"""The I/O half of the expansion loop (:mod:`proxy.slots.expand` holds the pure half and the
contract).

:meth:`Expander.run` sends the request with the expansion tool, answers the model's calls to it
from the slot store, re-sends, and relays to the client only what belongs to the final reply. It
fills an :class:`Outcome` as it goes (status, reply, outcome flags, as the plain relay reports
them), so archiving and metrics see what the client saw, and awaits ``finish`` (the turn's
archive) once the final reply is whole, before the client gets its last bytes. It knows nothing
of the chat pipeline, and of chat APIs only what its :class:`~proxy.slots.dialect.ExpansionDialect`
says (the tool's shape, the calls, the follow-up body, the stream's events).
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

from proxy.chat.api import ReplyReader
from proxy.config import SlotsSettings
from proxy.relay import encode_json
from proxy.slots.dialect import ExpansionDialect, StreamRound
from proxy.slots.expand import (
    MIN_EXPANSION_TOKENS,
    ToolRejections,
    add_usage,
    answer_text,
    mentions_tools,
    requested_slot,
)
from proxy.slots.store import SlotStore
from proxy.sse import AssembledReply, SSEEvent
from proxy.upstream import Upstream, forward_headers, path_unknown, response_headers

log = logging.getLogger("engram.expand")

UPSTREAM_CLOSED = "The upstream model server closed the connection before the reply was done."
# Writes the event that tells the client its stream broke off (the adapter's ``stream_error``).
StreamError = Callable[[str], bytes | None]


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
    """Runs one chat API's requests whose forwarded prompt holds slot references."""

    def __init__(
        self,
        settings: SlotsSettings,
        slots: SlotStore,
        upstream: Upstream,
        keep_cors: bool,
        dialect: ExpansionDialect,
        stream_error: StreamError,
    ) -> None:
        self.settings = settings
        self.slots = slots
        self.upstream = upstream
        self.keep_cors = keep_cors
        self.dialect = dialect
        self.stream_error = stream_error
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
        the client's response, or none when the upstream rejected the tool or lacks the API's
        path (send it the plain way). ``finish`` runs once the final reply is whole, before its
        last bytes are sent."""
        name = self.settings.expand_tool
        body = self.dialect.with_tool(base, name)
        up = await self._send(request, body)
        out.status = up.status
        if up.status != 200:
            data = await _read_all(up)
            model = base.get("model") if isinstance(base.get("model"), str) else None
            if up.status == 404 and path_unknown(data):
                return out  # the plain way finds out and translates
            if mentions_tools(up.status, data):
                self.rejections.add(model)
                return out
            out.reply = self._reassembled(data)
            out.response = self._whole(up, out, data)
            return out
        loop = _Loop(self, request, out, user, room, base, body, finish)
        out.response = await (
            loop.stream(up) if self.dialect.streams(up.content_type) else loop.plain(up)
        )
        return out

    async def _send(self, request: web.Request, body: dict[str, Any]) -> aiohttp.ClientResponse:
        # Engram reads these replies, so it asks for them uncompressed.
        headers = forward_headers(request.headers, drop=("accept-encoding",))
        return await self.upstream.send(request.method, request.raw_path, headers, _dumps(body))

    def _reassembled(self, data: bytes) -> AssembledReply:
        reader = self.dialect.reader(False)
        reader.feed(data)
        return reader.finish(ended_cleanly=True)

    def _whole(self, up: aiohttp.ClientResponse, out: Outcome, data: bytes) -> web.Response:
        headers = response_headers(up.headers, keep_cors=self.keep_cors)
        headers.popall("Content-Length", None)
        headers.update(out.headers)
        return web.Response(status=up.status, reason=up.reason, body=data, headers=headers)

    async def answers(
        self, calls: Sequence[dict[str, Any]], user: str, room: int | None
    ) -> tuple[list[str], int | None]:
        """The tool results' texts for ``calls``, and the context room left after them."""
        out: list[str] = []
        for call in calls:
            sid = requested_slot(self.dialect.call_arguments(call))
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
        self.dialect = ex.dialect
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

    async def _next_body(self, text: str | None, calls: list[dict[str, Any]]) -> None:
        answers, self.room = await self.ex.answers(calls, self.user, self.room)
        self.rounds += 1
        self.out.expansions = self.rounds
        self.ex.counts["round_trips"] += 1
        body = self.dialect.follow_up(self.body, text, calls, answers)
        if not self._may_round_trip():  # the last request: without the tool, so it must answer
            body = self.dialect.last_body(body, self.base)
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
                self.out.reply = self.ex._reassembled(data)
                return self.ex._whole(up, self.out, data)
            first_id = first_id or (obj.get("id") if isinstance(obj.get("id"), str) else None)
            usage = add_usage(usage, self.dialect.usage(obj))
            internal, client, text = self.dialect.plain_calls(obj, self.name)
            if internal and not client and self._may_round_trip():
                await self._next_body(text, internal)
                up = await self.ex._send(self.request, self.body)
                continue
            if self.rounds or internal:
                data = _dumps(self.dialect.final(obj, self.name, usage, first_id))
            self.out.status = up.status
            self.out.reply = self.ex._reassembled(data)
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
        reader = self.dialect.reader(True)
        ended_cleanly = False
        current = up
        rnd: StreamRound | None = None
        try:
            total: dict[str, Any] | None = None
            while True:
                rnd = self.dialect.stream_round(self.name, self._may_round_trip(), rnd)
                result = await self._relay_round(current, resp, rnd, reader)
                if result == "client_gone":
                    out.client_gone = True
                    return resp
                if result == "failed":
                    out.upstream_failed = True
                    await _write_quietly(resp, self.ex.stream_error(UPSTREAM_CLOSED))
                    return resp
                total = add_usage(total, rnd.usage)
                if not rnd.round_trip:
                    await self._finish(resp, rnd, total, reader)
                    ended_cleanly = True
                    return resp
                current.release()
                if self.dialect.progress:
                    await resp.write(self.dialect.progress)
                await self._next_body(rnd.text(), rnd.calls())
                current = await self.ex._send(self.request, self.body)
                if current.status != 200 or not self.dialect.streams(current.content_type):
                    data = await _read_all(current)
                    out.upstream_failed = True
                    await _write_quietly(
                        resp,
                        self.ex.stream_error(
                            f"The upstream model server answered {current.status} to Engram's "
                            f"expansion round trip: {data[:500].decode('utf-8', 'replace')}"
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
            out.reply = reader.finish(ended_cleanly=ended_cleanly)
            if ended_cleanly:
                current.release()
            else:
                current.close()  # drop the connection: the upstream stops generating

    async def _relay_round(
        self,
        up: aiohttp.ClientResponse,
        resp: web.StreamResponse,
        rnd: StreamRound,
        reader: ReplyReader,
    ) -> str:
        """Relay one round's events; 'done', 'failed' (upstream died) or 'client_gone'."""
        parser = self.dialect.parser()
        while True:
            try:
                chunk = await up.content.readany()
            except (TimeoutError, aiohttp.ClientError):
                return "failed"
            if not chunk:
                break
            try:
                await _write_events(parser.feed(chunk), resp, rnd, reader)
            except ConnectionResetError:
                return "client_gone"
        await _write_events(parser.close(), resp, rnd, reader)
        return "done"

    async def _finish(
        self,
        resp: web.StreamResponse,
        rnd: StreamRound,
        total: dict[str, Any] | None,
        reader: ReplyReader,
    ) -> None:
        tail = rnd.tail(total)
        reader.feed(tail)
        if self.finish is not None:
            self.out.reply = reader.finish(ended_cleanly=True)
            await self.finish()
        if tail:
            await resp.write(tail)
        await resp.write_eof()


async def _write_events(
    events: list[SSEEvent], resp: web.StreamResponse, rnd: StreamRound, reader: ReplyReader
) -> None:
    out = [data for data in (rnd.feed(ev) for ev in events) if data is not None]
    if out:
        data = b"".join(out)
        reader.feed(data)
        await resp.write(data)


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


async def _write_quietly(resp: web.StreamResponse, data: bytes | None) -> None:
    try:
        if data is not None:
            await resp.write(data)
        await resp.write_eof()
    except ConnectionResetError:
        pass
