"""One chat turn: parse → memory stages (identify, place, recall, rewrite) → forward → archive.

The pipeline speaks to its chat API through an adapter (:mod:`proxy.chat.api`; OpenAI chat is
:mod:`proxy.chat.openai.adapter`). The body is opaque: only the messages (and ``tools`` when Engram
adds its own) may change; every other field, unknown vendor fields and nulls included, reaches
the upstream as sent. When nothing changed the client's exact bytes are forwarded. The reply is
relayed as it arrives and reassembled on the side by the adapter's reader. When the upstream
answered 200 the turn (the request's new messages and the reply) is archived durably once the
reply is whole and before the client's last byte is sent (:meth:`ChatPipeline._commit`); when
the client went away or the upstream died mid-stream, what arrived is archived in the
background. What was assembled then goes to the reply hooks, in the background.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
from aiohttp import web

from proxy import guard
from proxy.auth import ANONYMOUS, PRINCIPAL
from proxy.chat.api import ChatAPI, ContinuesReplies, ReplyTranslator
from proxy.chat.memory import TOO_MANY_MESSAGES, MemoryService
from proxy.chat.openai.adapter import OpenAIChat
from proxy.chat.turn import ChatTurn, MemoryTurn
from proxy.chat.wire import CostTap
from proxy.config import Settings
from proxy.errors import BadRequest, EngramError, UpstreamRejected
from proxy.idle import UpstreamActivity
from proxy.logs import event
from proxy.messages import content_text
from proxy.relay import UPSTREAM_DIED, encode_json, is_event_stream, is_ndjson, read_body, relay
from proxy.slots.dialect import Expands
from proxy.slots.loop import Expander, Outcome
from proxy.tasks import BackgroundTasks
from proxy.upstream import (
    CHAT_PATH,
    Upstream,
    check_target,
    forward_headers,
    path_unknown,
    response_headers,
    upstream_message,
)

log = logging.getLogger("engram.pipeline")

MEMORY_MODES = ("on", "off", "read-only", "write-only")
THREAD_CHARS = 20_000  # prompts longer than this have their tokens counted on a thread
SSE = "text/event-stream"


ReplyHook = Callable[[ChatTurn], Coroutine[Any, Any, None]]


def memory_mode(value: str | None) -> str:
    """The X-Engram-Memory header's mode (default on); anything else is a 400."""
    if value is None or not value.strip():
        return "on"
    mode = value.strip().lower()
    if mode not in MEMORY_MODES:
        raise BadRequest(
            f"X-Engram-Memory must be one of {', '.join(MEMORY_MODES)}; got {value!r}.",
            code="invalid_memory_mode",
            param="X-Engram-Memory",
        )
    return mode


class ChatPipeline:
    """Handles one chat API's requests (``api``; OpenAI chat completions by default)."""

    def __init__(
        self,
        settings: Settings,
        upstream: Upstream,
        tasks: BackgroundTasks,
        memory: MemoryService | None = None,
        api: ChatAPI | None = None,
        activity: UpstreamActivity | None = None,
    ) -> None:
        self.api: ChatAPI = api or OpenAIChat()
        self.settings = settings
        # Requests in flight, for Engram's own calls to wait on (proxy.idle); one per process.
        self.activity = activity or UpstreamActivity(0.0, 0.0)
        self.upstream = upstream
        self.tasks = tasks
        self.memory = memory
        self.reply_hooks: list[ReplyHook] = []
        self.counts: Counter[str] = Counter()  # for /engram/metrics
        if memory is not None:
            self.reply_hooks.append(self._learn_tokens)
        api = self.api
        # The upstream's CORS headers reach the client where Engram grants CORS itself, or
        # leaves it to the upstream (memory disabled, no credential of Engram's: proxy.guard).
        self.keep_cors = bool(settings.server.cors_origins) or guard.transparent(
            api.paths[0],
            memory_enabled=settings.memory.enabled,
            adds_credential=guard.adds_credential(settings.upstream.api_key, settings.auth.mode),
        )
        self.expander = (
            Expander(
                settings.slots,
                memory.slots,
                upstream,
                self.keep_cors,
                api.expansion_dialect(),
                lambda message: api.stream_error(message),
            )
            if memory is not None
            and memory.slots is not None
            and api.expansion
            and isinstance(api, Expands)
            else None
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """One chat request, counted in flight from its start to its reply's end (or failure):
        Engram's own upstream calls wait until none is (:mod:`proxy.idle`)."""
        with self.activity.request():
            return await self._handle(request)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        check_target(request.raw_path)  # before any work: a 400 for an absolute-form target
        raw = await read_body(request, self.settings.server.max_body_bytes)
        mode = memory_mode(request.headers.get("X-Engram-Memory"))
        request_id = uuid.uuid4().hex
        if mode == "off":
            self.counts["chat_off"] += 1
            # Pure pass-through: nothing parsed, nothing stored, the client's bytes forwarded.
            return await self._forward_raw(request, raw, request_id)
        conv = self.api.parse(raw)
        conv.api = self.api.name
        turn = ChatTurn(request_id=request_id, mode=mode, conv=conv, raw=raw)
        turn.response_headers["X-Engram-Request-Id"] = request_id
        if self.memory is not None:
            await self._remember(request, turn)
        try:
            forwarded = turn.forwarded
            if forwarded is None and conv.reshape:
                forwarded = turn.forwarded = conv.messages
            payload = self.api.encode(conv, forwarded) if forwarded is not None else raw
            response = await self._forward(request, turn, payload)
        finally:
            self._release(turn)
        return self._named(response, turn)

    def _release(self, turn: ChatTurn, committed: bool = False) -> None:
        """Give back the session position the request held (:mod:`proxy.chat.claims`), in the
        background: when it will not be archived, or (``committed``) after its commit, which
        gives it back itself unless it stored nothing or failed."""
        mt = turn.memory
        if self.memory is None or mt is None or mt.claim is None or mt.claim.released:
            return
        if not committed and (mt.committed or self._archives(turn)):
            return  # its commit, under way or to come, gives it back
        self.tasks.spawn(self.memory.release(mt), name=f"release:{turn.request_id}")

    @staticmethod
    def _named(response: web.StreamResponse, turn: ChatTurn) -> web.StreamResponse:
        """A reply whose headers are not sent yet (a plain JSON reply, committed before) names
        the session its commit stored the turn in, should that differ from the placement's."""
        mt = turn.memory
        named = "X-Engram-Session" in response.headers and not response.prepared
        if named and mt is not None and mt.placement is not None:
            response.headers["X-Engram-Session"] = mt.placement.session.name
        return response

    async def _forward_raw(
        self, request: web.Request, raw: bytes, request_id: str
    ) -> web.StreamResponse:
        up = await self.upstream.send(
            request.method, request.raw_path, forward_headers(request.headers), raw
        )
        resp, _ = await relay(
            request, up, keep_cors=self.keep_cors, extra_headers={"X-Engram-Request-Id": request_id}
        )
        return resp

    async def _forward(
        self, request: web.Request, turn: ChatTurn, payload: bytes
    ) -> web.StreamResponse:
        if turn.expand and self.expander is not None and turn.memory is not None:
            response = await self._expand(request, turn, self.expander, turn.memory)
            if response is not None:
                return response
            # The upstream rejected the tool: the request goes as the plain rewrite.
        translate: ReplyTranslator | None = None
        tap: CostTap | None = None  # the upstream's own report, beneath a translation
        up: aiohttp.ClientResponse | None = None
        if self.api.name not in self.upstream.missing_apis:
            up = await self.upstream.send(
                request.method, request.raw_path, forward_headers(request.headers), payload
            )
            if up.status == 404 and self.api.name != OpenAIChat.name:
                answer = await self._maybe_missing(up, turn)
                if answer is not None:
                    return answer
                up = None
        if up is None:  # the upstream lacks this API: chat completions, translated both ways
            up, translated = await self._translated(request, turn)
            translate = tap = CostTap(translated, is_event_stream(up))
        turn.status = up.status
        # The reply is read as the client gets it (translated or not), in this API's shape.
        sse = translate.content_type == SSE if translate is not None else is_event_stream(up)
        reader = self.api.reader(sse)
        streamed = sse or is_ndjson(up) or turn.conv.stream

        async def finish() -> None:
            """The reply is whole: archive the turn before the client gets the last bytes."""
            turn.reply = reader.finish(ended_cleanly=True)
            await self._commit(turn)

        ended_cleanly = False
        try:
            resp, outcome = await relay(
                request,
                up,
                keep_cors=self.keep_cors,
                extra_headers=turn.response_headers,
                tap=reader.feed,
                finish=finish if self._archives(turn) else None,
                translate=translate,
                death_event=self.api.stream_error(UPSTREAM_DIED) if streamed else None,
            )
            ended_cleanly = outcome.ended_cleanly
            turn.client_gone = outcome.client_gone
            turn.upstream_failed = outcome.upstream_failed
            return resp
        except asyncio.CancelledError:
            turn.client_gone = True  # the client disconnected; what arrived is still archived
            raise
        finally:
            turn.reply = reader.finish(ended_cleanly=ended_cleanly)
            if tap is not None:  # not the translation's made-up figures: the upstream's own
                turn.reply.cost = tap.cost
            self._after_reply(turn)

    async def _maybe_missing(
        self, up: aiohttp.ClientResponse, turn: ChatTurn
    ) -> web.StreamResponse | None:
        """A 404 on this API's path: None when it says the path is unknown (remembered for this
        upstream, said once in the log); else the upstream's answer, relayed as sent."""
        body = await up.read()
        up.release()
        if not path_unknown(body):  # e.g. Ollama's "model not found": relayed as sent
            turn.status = 404
            headers = response_headers(up.headers, keep_cors=self.keep_cors)
            headers.popall("Content-Length", None)
            headers.update(turn.response_headers)
            return web.Response(status=404, body=body, headers=headers)
        self.upstream.missing_apis.add(self.api.name)
        event(
            log,
            logging.WARNING,
            "the upstream has no route for this chat API: its requests are translated to "
            "chat completions and back from now on",
            api=self.api.name,
            path=self.api.paths[0],
        )
        return None

    async def _translated(
        self, request: web.Request, turn: ChatTurn
    ) -> tuple[aiohttp.ClientResponse, ReplyTranslator]:
        """The request sent as chat completions; the upstream's error re-shaped into this API's
        (raised), or the response with the translator of its reply."""
        messages = turn.forwarded if turn.forwarded is not None else turn.conv.messages
        body = encode_json(self.api.to_chat(turn.conv, messages))
        up = await self.upstream.send(
            "POST", CHAT_PATH, forward_headers(request.headers, drop=("Accept",)), body
        )
        if up.status != 200:
            error = await up.read()
            up.release()
            raise UpstreamRejected(up.status, upstream_message(error))
        return up, self.api.from_chat(turn.conv, is_event_stream(up))

    async def _remember(self, request: web.Request, turn: ChatTurn) -> None:
        """The memory stages before forwarding. A failure degrades memory, never the request."""
        assert self.memory is not None
        try:
            principal = request.get(PRINCIPAL, ANONYMOUS)
            mt = await self.memory.before_forward(request.headers, turn.conv, turn.mode, principal)
        except EngramError:
            raise  # the request itself is wrong (e.g. a sub-agent nested too deep): a 4xx
        except Exception:
            self.counts["memory_failures"] += 1
            log.exception("memory stages failed; forwarding the request unchanged (not archived)")
            return
        turn.memory = mt
        try:
            self.memory.record_request(turn.request_id, mt)
        except Exception:
            log.exception("recording the request for feedback failed")
        if mt.placement is not None:  # the client's own id for it (a name within its user)
            turn.response_headers["X-Engram-Session"] = mt.placement.session.name
        note = f"; {mt.memory_note}" if mt.memory_note else ""  # e.g. "3; fts-only"
        if mt.memory_note:  # fts_only, recall_timeout, too_many_messages: for /engram/metrics
            self.counts[mt.memory_note.replace("-", "_")] += 1
        turn.response_headers["X-Engram-Memories"] = f"{len(mt.injected)}{note}"
        if mt.assembly is not None:
            a = mt.assembly
            turn.response_headers["X-Engram-Prompt-Tokens"] = f"{a.tokens}/{a.original_tokens}"
        if mt.forward_messages is not None:
            turn.forwarded = mt.forward_messages
        ex = self.expander
        if (
            mt.slot_refs
            and ex is not None
            and ex.offered(mt.model)
            and self.api.name not in self.upstream.missing_apis  # translated: no tool of ours
        ):
            turn.expand = ex.dialect.can_add_tool(turn.conv.body, ex.settings.expand_tool)

    async def _learn_tokens(self, turn: ChatTurn) -> None:
        """Calibrate token counts for this model from what the upstream reported."""
        assert self.memory is not None
        usage = turn.reply.usage if turn.reply else None
        if self.memory.summarizer is not None:
            self.memory.summarizer.account_reply(usage)
        reported = usage.get("prompt_tokens") if usage else None
        cost = turn.reply.cost if turn.reply else None
        if not isinstance(reported, int) and cost is not None and cost.source == "timings":
            reported = cost.total  # llama-server says it in every reply, asked for usage or not
        messages = turn.forwarded if turn.forwarded is not None else turn.conv.messages
        if turn.status != 200 or not isinstance(reported, int):
            return
        if turn.expansions or turn.conv.partial:
            return  # usage summed over round trips, or of history Engram never saw
        if turn.memory is not None and turn.memory.skipped == TOO_MANY_MESSAGES:
            return  # a request over limits.max_messages costs nothing more than its forwarding
        tokens = self.memory.tokens
        mt = turn.memory
        if mt is not None and mt.raw_tokens is not None and messages is mt.forward_messages:
            estimated = mt.raw_tokens  # the assembler's count: the memory block is not counted
            # again (a new text every request: a tenth of the event loop's time at 16 clients)
        else:
            # A thread only for a long prompt: the hop cost more than counting a short one here.
            chars = sum(len(content_text(m.get("content"))) for m in messages)
            estimated = (
                await asyncio.to_thread(tokens.messages, messages)
                if chars > THREAD_CHARS
                else tokens.messages(messages)
            )
        tools = turn.conv.rendered
        rendered = await self.memory.rewriter.rendered_raw(tools) if tools else 0
        tokens.learn(turn.conv.model, estimated, reported, rendered)

    async def _expand(
        self, request: web.Request, turn: ChatTurn, expander: Expander, mt: MemoryTurn
    ) -> web.StreamResponse | None:
        """The request with Engram's expansion tool (:mod:`proxy.slots.loop`); None when the
        upstream rejected the tool."""
        room = mt.budget - mt.assembly.tokens if mt.budget and mt.assembly else None
        out = Outcome(turn.response_headers)

        def settle() -> None:  # what the loop saw becomes the turn's, for archive and metrics
            turn.status, turn.reply, turn.expansions = out.status, out.reply, out.expansions
            turn.client_gone, turn.upstream_failed = out.client_gone, out.upstream_failed

        async def finish() -> None:
            settle()
            await self._commit(turn)

        try:
            body = turn.conv.body
            if turn.forwarded is not None:  # the rewritten body, in this API's shape
                body = json.loads(self.api.encode(turn.conv, turn.forwarded))
            await expander.run(request, body, out, mt.identity.user, room, finish=finish)
        except BaseException:
            settle()
            if turn.status is not None:  # the upstream answered: archive what came
                self._after_reply(turn)
            raise
        settle()
        if out.response is not None:
            self._after_reply(turn)
        return out.response

    def _archives(self, turn: ChatTurn) -> bool:
        """Whether this turn is archived: it was placed in a session (memory on or write-only,
        not housekeeping) and the upstream accepted it."""
        mt = turn.memory
        return (
            self.memory is not None
            and mt is not None
            and mt.placement is not None
            and turn.mode in ("on", "write-only")  # read-only recalls, it never stores
            and not mt.committed
            and turn.status == 200
        )

    async def _commit(self, turn: ChatTurn) -> None:
        """Archive the turn (request messages and reply) durably, once; never raises. Shielded:
        a client that goes away meanwhile does not interrupt the write."""
        if not self._archives(turn):
            return
        assert self.memory is not None and turn.memory is not None
        reply = turn.reply.message() if turn.reply is not None else None
        complete = turn.reply.complete if turn.reply is not None else False
        job = self.tasks.spawn(
            self.memory.commit(turn.memory, reply, complete), name=f"archive:{turn.request_id}"
        )
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            raise
        except Exception:  # logged by the task set; the reply still goes out
            self.counts["archive_failures"] += 1
            self._release(turn, committed=True)
            return
        self._release(turn, committed=True)  # unless the commit gave it back (it stored rows)
        placement = turn.memory.placement
        if isinstance(self.api, ContinuesReplies) and turn.reply and placement is not None:
            self.api.replied(turn.conv, turn.reply, placement.session.name)

    def _after_reply(self, turn: ChatTurn) -> None:
        """Archive what arrived if the relay did not (the client went away, the upstream died
        mid-stream), then hand the finished turn to the hooks, in the background."""
        if self._archives(turn):
            self.tasks.spawn(self._commit_then_hooks(turn), name=f"reply:{turn.request_id}")
        else:
            self._run_hooks(turn)

    async def _commit_then_hooks(self, turn: ChatTurn) -> None:
        await self._commit(turn)
        self._run_hooks(turn)

    def _run_hooks(self, turn: ChatTurn) -> None:
        if self.memory is not None and turn.memory is not None:
            # recorded only if accepted
            self.memory.settle(turn.memory, turn.status, turn.expansions)
        counts = self.counts
        counts[f"chat_{turn.mode}"] += 1
        counts["client_disconnects"] += turn.client_gone
        counts["upstream_failures"] += turn.upstream_failed
        counts["memories_injected"] += len(turn.memory.injected) if turn.memory else 0
        self._note_cost(turn)
        for hook in self.reply_hooks:
            self.tasks.spawn(hook(turn), name=f"reply-hook:{turn.request_id}")

    def _note_cost(self, turn: ChatTurn) -> None:
        """What the model server said it computed and reused of the prompt: for the inspector
        and /engram/metrics (only where it said both)."""
        cost = turn.reply.cost if turn.reply is not None and turn.status == 200 else None
        if cost is not None and cost.computed is not None and cost.reused is not None:
            self.counts["upstream_prompt_reports"] += 1
            self.counts["upstream_prompt_tokens_computed"] += cost.computed
            self.counts["upstream_prompt_tokens_reused"] += cost.reused
        if self.memory is not None:
            self.memory.recent.reported(turn.request_id, cost)
