"""A chat completions stream as Responses API events, for an upstream without
``/v1/responses`` (pure), in the order the ``openai`` SDK's ``responses.stream()`` checks::

    response.created, response.in_progress
    per output item (reasoning, the message, each function call, in the order they start):
        response.output_item.added [, response.content_part.added]
        response.reasoning_text.delta | response.output_text.delta
            | response.function_call_arguments.delta ...
    at the end, per item: the matching ``.done`` events, response.output_item.done
    response.completed (response.incomplete at the length limit; an upstream error or a stream
        cut short: an ``error`` event and response.failed)
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from proxy.chat.responses.translate import (
    call_item,
    message_item,
    new_id,
    reasoning_item,
    response_object,
    responses_usage,
    status_of,
)
from proxy.sse import SSEParser


class StreamTranslator:
    """``chat.completion.chunk`` events as Responses events."""

    content_type = "text/event-stream"

    def __init__(self, body: Mapping[str, Any]) -> None:
        self.body = body
        self.parser = SSEParser()
        self.rid = new_id("resp")
        self.model: Any = body.get("model")
        self.created = int(time.time())
        self.seq = 0
        self.started = False
        self.ended = False
        self.items: list[dict[str, Any]] = []  # open or done, in output order
        self.text: dict[str, Any] | None = None  # the message item, once started
        self.reasoning: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # by the chat tool call index
        self.finish_reason: Any = None
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> bytes:
        out: list[bytes] = []
        for event in self.parser.feed(chunk):
            out += self._event(event.data)
        return b"".join(out)

    def finish(self) -> bytes:
        out: list[bytes] = []
        for event in self.parser.close():
            out += self._event(event.data)
        if not self.ended:
            if self.finish_reason is not None:
                out += self._complete()
            else:
                out += self._fail(
                    "upstream_disconnected", "The upstream's reply ended before it was complete."
                )
        return b"".join(out)

    # ---- events ---------------------------------------------------------------------------

    def _emit(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        text = json.dumps(data, ensure_ascii=False)
        return f"event: {kind}\ndata: {text}\n\n".encode()

    def _response(self, status: str, **extra: Any) -> dict[str, Any]:
        output = [self._final(i) for i in self.items] if status != "in_progress" else []
        return response_object(
            self.body, self.rid, self.model, self.created, status, output, **extra
        )

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        return [
            self._emit("response.created", response=self._response("in_progress")),
            self._emit("response.in_progress", response=self._response("in_progress")),
        ]

    def _event(self, data: str) -> list[bytes]:
        if self.ended:
            return []
        if data.strip() == "[DONE]":
            return [*self._start(), *self._complete()]
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            return []
        if not isinstance(obj, dict):
            return []
        if isinstance(obj.get("model"), str):
            self.model = obj["model"]
        out = self._start()
        if "error" in obj:
            err = obj["error"] if isinstance(obj["error"], Mapping) else {"message": obj["error"]}
            code = err.get("code")
            return [*out, *self._fail(str(code) if code else "server_error", err.get("message"))]
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or []:
            if not isinstance(choice, Mapping) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, Mapping):
                out += self._delta(delta)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _open(self, item: dict[str, Any]) -> bytes:
        item["_index"] = len(self.items)
        self.items.append(item)
        shown = {k: v for k, v in item.items() if not k.startswith("_")}
        return self._emit("response.output_item.added", output_index=item["_index"], item=shown)

    def _delta(self, delta: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            if self.reasoning is None:
                self.reasoning = {**reasoning_item(""), "content": [], "_text": ""}
                out.append(self._open(self.reasoning))
                out.append(self._part("added", self.reasoning, "reasoning_text", ""))
            self.reasoning["_text"] += reasoning
            out.append(self._on(self.reasoning, "response.reasoning_text.delta", delta=reasoning))
        content = delta.get("content")
        if isinstance(content, str) and content:
            if self.text is None:
                self.text = {**message_item("", "in_progress"), "content": [], "_text": ""}
                out.append(self._open(self.text))
                out.append(self._part("added", self.text, "output_text", ""))
            self.text["_text"] += content
            out.append(
                self._on(self.text, "response.output_text.delta", delta=content, logprobs=[])
            )
        for pos, call in enumerate(delta.get("tool_calls") or []):
            if isinstance(call, Mapping):
                out += self._call(pos, call)
        return out

    def _call(self, pos: int, call: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        index = call.get("index", pos)
        fn = call.get("function") if isinstance(call.get("function"), Mapping) else {}
        assert isinstance(fn, Mapping)
        item = self.calls.get(index)
        if item is None:
            item = call_item({"id": call.get("id"), "function": {"name": fn.get("name")}})
            item["status"] = "in_progress"
            self.calls[index] = item
            out.append(self._open(item))
        elif fn.get("name") and not item["name"]:
            item["name"] = fn["name"]
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            item["arguments"] += args
            out.append(self._on(item, "response.function_call_arguments.delta", delta=args))
        return out

    def _on(self, item: Mapping[str, Any], kind: str, **fields: Any) -> bytes:
        where: dict[str, Any] = {"item_id": item["id"], "output_index": item["_index"]}
        if item["type"] != "function_call":
            where["content_index"] = 0
        return self._emit(kind, **where, **fields)

    def _part(self, when: str, item: Mapping[str, Any], kind: str, text: str) -> bytes:
        part: dict[str, Any] = {"type": kind, "text": text}
        if kind == "output_text":
            part = {**part, "annotations": [], "logprobs": []}
        return self._on(item, f"response.content_part.{when}", part=part)

    def _final(self, item: Mapping[str, Any]) -> dict[str, Any]:
        """An item as done."""
        if item["type"] == "message":
            return message_item(item["_text"], iid=item["id"])
        if item["type"] == "reasoning":
            return reasoning_item(item["_text"], iid=item["id"])
        return {**{k: v for k, v in item.items() if not k.startswith("_")}, "status": "completed"}

    def _close_items(self) -> list[bytes]:
        out: list[bytes] = []
        for item in self.items:
            if item["type"] == "message":
                text = item["_text"]
                out.append(self._on(item, "response.output_text.done", text=text, logprobs=[]))
                out.append(self._part("done", item, "output_text", text))
            elif item["type"] == "reasoning":
                text = item["_text"]
                out.append(self._on(item, "response.reasoning_text.done", text=text))
                out.append(self._part("done", item, "reasoning_text", text))
            else:
                out.append(
                    self._on(
                        item,
                        "response.function_call_arguments.done",
                        arguments=item["arguments"],
                        name=item["name"],
                    )
                )
            out.append(
                self._emit(
                    "response.output_item.done",
                    output_index=item["_index"],
                    item=self._final(item),
                )
            )
        return out

    def _complete(self) -> list[bytes]:
        self.ended = True
        if not self.items:  # an empty reply is still a message
            self.text = {**message_item("", "in_progress"), "content": [], "_text": ""}
            opened = [self._open(self.text), self._part("added", self.text, "output_text", "")]
        else:
            opened = []
        status = status_of(self.finish_reason)
        usage = responses_usage(self.usage)
        return [
            *opened,
            *self._close_items(),
            self._emit(f"response.{status}", response=self._response(status, usage=usage)),
        ]

    def _fail(self, code: str, message: Any) -> list[bytes]:
        self.ended = True
        text = str(message or "The upstream model server failed.")
        error = {"code": code, "message": text}
        return [
            *self._start(),
            self._emit("error", code=code, message=text, param=None),
            self._emit("response.failed", response=self._response("failed", error=error)),
        ]
