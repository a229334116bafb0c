"""The fake upstream's OpenAI Responses API (``POST /v1/responses``), as llama-server serves it,
in the shapes the ``openai`` SDK accepts (its ``responses.stream()`` helper included).

    fake = FakeUpstream(strict_templates=True)
    fake.responses.reject_previous = True          # as the bundled llama-server does
    fake.enqueue(JsonReply(function_call_response("get_weather", '{"city":"Paris"}')),
                 path="/v1/responses")
    fake.responses.chat_messages(fake.requests[-1].json())   # what the template would see

The request becomes chat messages as llama-server converts it (``instructions`` the first system
message, each system or developer item another one; an assistant item needs ``"type":
"message"``); strict templates (``strict_templates``) check those. The default reply echoes the
last user text. Responses are stored by id unless ``store`` is false, so ``previous_response_id``
continues one (unless ``reject_previous``). :func:`without_responses` makes the route answer 404,
as a server without the API does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from testing.fake_chunks import (
    CREATED,
    last_user_text,
    rough_tokens,
    sse,
    template_violations,
    words,
)

if TYPE_CHECKING:
    from testing.fake_upstream import FakeUpstream

PATHS = ("/v1/responses", "/responses")


class BadInput(ValueError):
    """What llama-server answers 400 to."""


def without_responses(fake: FakeUpstream) -> None:
    """The fake answers 404 on the Responses paths, as a server without the API does."""
    for path in PATHS:
        fake._routes.pop(("POST", path), None)


def response_id(seed: bytes) -> str:
    """A response id that is the same for the same request (tests compare bytes)."""
    return "resp_" + hashlib.sha256(seed).hexdigest()[:24]


def message_item(text: str, *, iid: str = "msg_fake", status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": iid,
        "status": status,
        "role": "assistant",
        "content": content if status == "completed" else [],
    }


def call_item(name: str, arguments: str, call_id: str, *, iid: str = "fc_fake") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": iid,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def response(
    output: list[dict[str, Any]],
    *,
    model: str = "fake-model",
    rid: str = "resp_fake",
    status: str = "completed",
    input_tokens: int = 1,
) -> dict[str, Any]:
    """A ``response`` object."""
    out_tokens = sum(rough_tokens(json.dumps(i)) for i in output) if status == "completed" else 0
    usage = {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": out_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + out_tokens,
    }
    return {
        "id": rid,
        "object": "response",
        "created_at": CREATED,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": output if status != "in_progress" else [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage if status != "in_progress" else None,
    }


def function_call_response(
    name: str, arguments: str, call_id: str = "call_fake1", **kwargs: Any
) -> dict[str, Any]:
    """A whole response that calls one function."""
    return response([call_item(name, arguments, call_id)], **kwargs)


def events(resp: Mapping[str, Any], parts: list[str] | None = None) -> list[bytes]:
    """A whole response as its stream of events, text in ``parts`` (default: by words)."""
    seq = iter(range(1_000_000))

    def ev(kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, "sequence_number": next(seq), **fields}, event=kind)

    start = {**resp, "status": "in_progress", "output": [], "usage": None}
    out = [ev("response.created", response=start), ev("response.in_progress", response=start)]
    for index, item in enumerate(resp["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            out.append(
                ev(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "content": [], "status": "in_progress"},
                )
            )
            text = "".join(p["text"] for p in item["content"])
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(ev("response.content_part.added", **where, content_index=0, part=part))
            for piece in parts if parts is not None else words(text):
                out.append(
                    ev(
                        "response.output_text.delta",
                        **where,
                        content_index=0,
                        delta=piece,
                        logprobs=[],
                    )
                )
            out.append(
                ev("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
            )
            done_part = {**part, "text": text}
            out.append(ev("response.content_part.done", **where, content_index=0, part=done_part))
        elif item["type"] == "function_call":
            added = {**item, "arguments": "", "status": "in_progress"}
            out.append(ev("response.output_item.added", output_index=index, item=added))
            for piece in words(item["arguments"]) or [""]:
                out.append(ev("response.function_call_arguments.delta", **where, delta=piece))
            out.append(
                ev(
                    "response.function_call_arguments.done",
                    **where,
                    arguments=item["arguments"],
                    name=item["name"],
                )
            )
        else:
            out.append(ev("response.output_item.added", output_index=index, item=item))
        out.append(ev("response.output_item.done", output_index=index, item=item))
    out.append(ev(f"response.{resp['status']}", response=dict(resp)))
    return out


def chat_messages(payload: Mapping[str, Any], history: list[Any] | None = None) -> list[Any]:
    """The request as llama-server's chat template sees it (:class:`BadInput` where it says
    400): ``instructions`` first, then each item (``history`` items before the input's)."""
    out: list[dict[str, Any]] = []
    if isinstance(payload.get("instructions"), str):
        out.append({"role": "system", "content": payload["instructions"]})
    items = payload.get("input")
    if items is None:
        raise BadInput("'input' is required")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in [*(history or []), *items]:
        if not isinstance(item, dict):
            raise BadInput("input item must be an object")
        kind = item.get("type")
        if kind in ("message", None) and "role" in item:
            if kind is None and item["role"] == "assistant":
                raise BadInput("Cannot determine type of 'item'")
            out.append({"role": item["role"], "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and last.get("content"):
                last["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": _text(item.get("output")),
                }
            )
        elif kind is None:
            raise BadInput("Cannot determine type of 'item'")
        # reasoning, item_reference, …: not rendered
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


class FakeResponses:
    """``/v1/responses`` of one :class:`~testing.fake_upstream.FakeUpstream`."""

    def __init__(self, fake: FakeUpstream) -> None:
        self.fake = fake
        self.reject_previous = False  # answer previous_response_id with 400, as llama-server
        self.stored: dict[str, list[Any]] = {}  # response id -> the history it continues

    def requests(self) -> list[Any]:
        return [r for r in self.fake.requests if r.path in PATHS]

    def chat_messages(self, payload: Mapping[str, Any]) -> list[Any]:
        previous = payload.get("previous_response_id")
        return chat_messages(payload, self.stored.get(previous) if previous else None)

    async def handle(self, request: web.Request, body: bytes) -> web.StreamResponse:
        payload = self.fake._parse(body)
        if isinstance(payload, web.Response):
            return payload
        previous = payload.get("previous_response_id")
        if previous is not None and self.reject_previous:
            return self._bad("llama.cpp does not support 'previous_response_id'.")
        if previous is not None and previous not in self.stored:
            return self._bad(f"Previous response with id '{previous}' not found.")
        try:
            messages = self.chat_messages(payload)
        except BadInput as exc:
            return self._bad(str(exc))
        if self.fake.strict_templates and (problems := template_violations(messages)):
            return self.fake._error(500, "; ".join(problems), "server_error")
        text = self.fake.reply_text(last_user_text(messages))
        model = str(payload.get("model") or self.fake.model)
        prompt = sum(rough_tokens(_text(m.get("content"))) for m in messages)
        if (over := self.fake.over_context(prompt, payload)) is not None:
            return over
        rid = response_id(body)
        tokens = self.fake.prompt_tokens(prompt, payload)
        resp = response([message_item(text)], model=model, rid=rid, input_tokens=tokens)
        if payload.get("store") is not False:
            items = payload["input"]
            items = [{"role": "user", "content": items}] if isinstance(items, str) else items
            earlier = self.stored.get(previous, []) if isinstance(previous, str) else []
            self.stored[rid] = [*earlier, *items, *resp["output"]]
        if payload.get("stream"):
            from testing.fake_upstream import StreamReply  # (it imports this module)

            return await self.fake._stream(request, StreamReply(events(resp)))
        return web.json_response(resp)

    def _bad(self, message: str) -> web.Response:
        return self.fake._error(400, message, "invalid_request_error")
