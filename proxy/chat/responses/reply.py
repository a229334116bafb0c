"""A Responses API reply, streamed or whole, reassembled for the archive (pure).

The reply's ``output`` items become one assistant message, the shape its items take when the
client sends them back (:mod:`proxy.chat.responses.items`): the text of its ``output_text``
parts, one per line; each ``function_call`` as a tool call whose id is its ``call_id``;
reasoning text aside. A stream's items are rebuilt from ``response.output_item.added``, the
text and argument deltas and ``response.output_item.done`` (the final word on an item), keyed
by ``item_id`` where a server leaves out ``output_index`` (llama-server does). The reply ends at
``response.completed``, ``response.incomplete`` or ``response.failed``; an ``error`` event
marks it incomplete. Usage is reported in chat completions' terms (``prompt_tokens``, …).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from proxy.chat.wire import WholeBodyReader
from proxy.costs import from_responses_usage, from_timings, pick
from proxy.sse import AssembledReply, SSEParser

TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def chat_usage(usage: Any) -> dict[str, Any] | None:
    """Responses usage (``input_tokens``, ``output_tokens``) in chat completions' terms."""
    if not isinstance(usage, Mapping):
        return None
    out: dict[str, Any] = {}
    for ours, theirs in (
        ("prompt_tokens", "input_tokens"),
        ("completion_tokens", "output_tokens"),
        ("total_tokens", "total_tokens"),
    ):
        if isinstance(usage.get(theirs), int):
            out[ours] = usage[theirs]
    return out or None


def reply_from_output(
    output: Any, status: str | None, reply: AssembledReply | None = None
) -> AssembledReply:
    """The assistant message of a response's ``output`` items."""
    reply = reply or AssembledReply()
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in output if isinstance(output, list) else []:
        if not isinstance(item, Mapping):
            continue
        kind = item.get("type")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, str):
                texts.append(content)
            for part in content if isinstance(content, list) else []:
                if isinstance(part, Mapping) and part.get("type") == "output_text":
                    texts.append(str(part.get("text") or ""))
        elif kind == "function_call":
            fn = {"name": item.get("name") or "", "arguments": item.get("arguments") or ""}
            calls.append({"id": item.get("call_id") or "", "type": "function", "function": fn})
        elif kind == "reasoning":
            reasoning += _reasoning_texts(item)
    reply.content = "\n".join(texts) if texts else None
    reply.reasoning_content = "\n".join(reasoning) if reasoning else None
    reply.tool_calls = calls
    if status == "incomplete":
        reply.finish_reason = "length"
    elif status in ("completed", None) and (texts or calls):
        reply.finish_reason = "tool_calls" if calls else "stop"
    return reply


def _reasoning_texts(item: Mapping[str, Any]) -> list[str]:
    out = []
    for key in ("content", "summary"):
        for part in item.get(key) or []:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                out.append(part["text"])
        if out:
            break
    return out


def _head(reply: AssembledReply, response: Mapping[str, Any]) -> None:
    if isinstance(response.get("id"), str):
        reply.id = response["id"]
    if isinstance(response.get("model"), str):
        reply.model = response["model"]
    usage = chat_usage(response.get("usage"))
    if usage is not None:
        reply.usage = usage
    cost = from_responses_usage(response.get("usage"))
    if cost is not None:
        reply.cost = cost
    if response.get("error"):
        reply.error = response["error"]


def reply_from_response(obj: Any) -> AssembledReply:
    """An AssembledReply from a whole Responses API body (a response, or an error)."""
    reply = AssembledReply()
    if not isinstance(obj, Mapping):
        return reply
    if "error" in obj and obj.get("object") != "response":
        reply.error = obj["error"]
        return reply
    _head(reply, obj)
    reply.cost = pick(reply.cost, from_timings(obj.get("timings")))
    status = obj.get("status") if isinstance(obj.get("status"), str) else None
    reply_from_output(obj.get("output"), status, reply)
    reply.complete = status in ("completed", "incomplete") and reply.error is None
    return reply


class StreamReader:
    """``response.*`` events; the reply ends at its terminal event."""

    def __init__(self) -> None:
        self.parser = SSEParser()
        self.reply = AssembledReply()
        self.items: dict[str, dict[str, Any]] = {}  # by item id (or output index), in order
        self.by_index: dict[int, str] = {}  # output index -> item key
        self.status: str | None = None
        self.final: list[Any] | None = None  # the terminal event's output, when it has one
        self.timings: Any = None  # llama-server's, beside the terminal event's response
        self.done = False

    def feed(self, chunk: bytes) -> bool:
        was_done = self.done
        for event in self.parser.feed(chunk):
            self._event(event.data)
        return self.done and not was_done

    def finish(self, ended_cleanly: bool) -> AssembledReply:
        for event in self.parser.close():
            self._event(event.data)
        output = self.final if self.final else list(self.items.values())
        reply = reply_from_output(output, self.status, self.reply)
        reply.cost = pick(reply.cost, from_timings(self.timings))
        reply.complete = (
            ended_cleanly and self.status in ("completed", "incomplete") and reply.error is None
        )
        return reply

    def _event(self, data: str) -> None:
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            return  # not ours to judge: relayed as sent, just not assembled
        if not isinstance(obj, dict):
            return
        kind = obj.get("type")
        if kind == "error" or (kind is None and "error" in obj):
            self.reply.error = obj.get("error") or {
                k: obj.get(k) for k in ("code", "message", "param")
            }
            return
        response = obj.get("response")
        if isinstance(obj.get("timings"), dict):
            self.timings = obj["timings"]
        if isinstance(response, Mapping):
            _head(self.reply, response)
            if kind in TERMINAL:
                self.done = True
                self.status = response.get("status") or kind.rpartition(".")[2]
                if isinstance(response.get("output"), list) and response["output"]:
                    self.final = response["output"]
            return
        item = obj.get("item")
        if kind in ("response.output_item.added", "response.output_item.done"):
            if isinstance(item, Mapping):
                index = obj.get("output_index")
                key = item["id"] if isinstance(item.get("id"), str) else f"#{index}"
                if isinstance(index, int):
                    key = self.by_index.setdefault(index, key)
                self.items[key] = dict(item)
            return
        if kind == "response.output_text.delta":
            self._text(obj, "delta")
        elif kind == "response.function_call_arguments.delta":
            slot = self._slot(obj)
            if slot is not None and isinstance(obj.get("delta"), str):
                slot["arguments"] = str(slot.get("arguments") or "") + obj["delta"]
        elif kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            slot = self._slot(obj)
            if slot is not None and isinstance(obj.get("delta"), str):
                parts = slot.setdefault("content", [])
                if not parts:
                    parts.append({"type": "reasoning_text", "text": ""})
                parts[-1] = {**parts[-1], "text": parts[-1].get("text", "") + obj["delta"]}

    def _key(self, obj: Mapping[str, Any]) -> str | None:
        """The key of the item a delta is for: its ``item_id``, else its output index."""
        item_id = obj.get("item_id")
        if isinstance(item_id, str) and item_id in self.items:
            return item_id
        index = obj.get("output_index")
        return self.by_index.get(index) if isinstance(index, int) else None

    def _slot(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        key = self._key(obj)
        return self.items.get(key) if key is not None else None

    def _text(self, obj: Mapping[str, Any], field: str) -> None:
        slot = self._slot(obj)
        if slot is None or not isinstance(obj.get(field), str):
            return
        content = slot.get("content")
        if not isinstance(content, list):
            content = slot["content"] = []
        index = obj.get("content_index")
        index = index if isinstance(index, int) else max(len(content) - 1, 0)
        while len(content) <= index:
            content.append({"type": "output_text", "text": ""})
        part = content[index]
        content[index] = {**part, "text": str(part.get("text") or "") + obj[field]}


class WholeReader(WholeBodyReader):
    """A whole response body (or an error body)."""

    def __init__(self) -> None:
        super().__init__(reply_from_response)
