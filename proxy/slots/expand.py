"""The expansion loop: Engram answers the model's calls to its own tool, the client never sees them.

When a forwarded prompt holds ``[TOOL_RESULT:<id>]`` references, Engram appends one function tool
(``slots.expand_tool``, default ``engram_expand``, argument ``slot_id``) to ``tools``. If the
model's reply calls it, Engram answers the call with the slot's content (or a clear "expired"
message), re-sends the conversation with that exchange appended, and repeats, at most
``slots.max_expansions`` times; the request after the last one goes without the tool, so the
model has to answer. The client sees one reply: no internal tool call (no chunk of one), ``usage``
summed over the round trips, and ``finish_reason`` as it applies to what the client got.

Streams stay streams: content deltas are relayed as they arrive in every round (text the model
wrote before an expansion call has already reached the client, and the next round's text
follows it); only the internal calls' deltas, and a round's ending (finish chunk, usage,
``[DONE]``) when a round trip follows, are held back.

When one reply holds both the client's tool calls and an internal one, **the client's calls
win**: Engram drops the internal calls (unanswered, unseen), renumbers the client's calls from 0
and returns the reply as it is (``finish_reason: "tool_calls"``). The client runs its tools and
sends the results in its next request, where the model can ask for the slot again. Answering
only the internal call would leave the client's calls unanswered in the re-sent conversation
(chat templates reject that), and holding them back would change what the client executes.

With ``tool_choice`` ``"none"`` or naming a function (or ``"required"`` without tools of the
client's own), a client tool of the same name, legacy ``functions``, ``n > 1``, or
an upstream that rejects tools (a 4xx/5xx that mentions tools: the request is re-sent once without
the tool, and tools stay off for that model for a while), nothing is added and the references
stay self-describing.
"""

from __future__ import annotations

import json
import logging
import secrets
import string
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.slots.model import Slot
from proxy.slots.refs import REFERENCE, SLOT_ID

log = logging.getLogger("engram.expand")

DESCRIPTION = (
    "Return the full text of an earlier tool result that this conversation shows only as "
    "[TOOL_RESULT:<slot_id>] plus a one-line description. Call it only when you need that "
    "content to answer."
)
# How long an upstream that rejected tools is not offered one again.
REJECT_TTL = 600.0
MIN_EXPANSION_TOKENS = 256
_ID_CHARS = string.ascii_letters + string.digits


def tool_definition(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": DESCRIPTION,
            "parameters": {
                "type": "object",
                "properties": {
                    "slot_id": {
                        "type": "string",
                        "description": "The id inside [TOOL_RESULT:...], e.g. "
                        "read_file-0a1b2c3d4e5f",
                    }
                },
                "required": ["slot_id"],
            },
        },
    }


def can_add_tool(body: Mapping[str, Any], name: str) -> bool:
    """Whether the expansion tool may join this request's ``tools``."""
    if "functions" in body:
        return False
    n = body.get("n")
    if n is not None and n != 1:
        return False
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        return False
    choice = body.get("tool_choice")
    # "none" forbids tools; a named function forces that one; "required" with no tool of the
    # client's own would force the model into Engram's tool on every round.
    if choice not in (None, "auto") and not (choice == "required" and tools):
        return False
    return not any(_tool_name(t) == name for t in tools or [])


def _tool_name(tool: Any) -> str | None:
    if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
        name = tool["function"].get("name")
        return name if isinstance(name, str) else None
    return None


def with_tool(body: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``body`` with the expansion tool appended to ``tools`` (the client's come first)."""
    tools = body.get("tools")
    return {**body, "tools": [*(tools if isinstance(tools, list) else []), tool_definition(name)]}


def split_calls(
    calls: Sequence[Any], name: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(internal, client) tool calls of one reply."""
    internal: list[dict[str, Any]] = []
    client: list[dict[str, Any]] = []
    for call in calls:
        if not isinstance(call, dict):
            continue
        (internal if _call_name(call) == name else client).append(call)
    return internal, client


def _call_name(call: Mapping[str, Any]) -> str | None:
    fn = call.get("function")
    return fn.get("name") if isinstance(fn, dict) else None


def requested_slot(arguments: Any) -> str | None:
    """The slot id a call asks for: ``{"slot_id": "..."}``, tolerating the bracketed form."""
    value: Any = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            value = arguments
    if isinstance(value, dict):
        value = value.get("slot_id", value.get("id"))
    if not isinstance(value, str):
        return None
    value = value.strip()
    found = REFERENCE.search(value)
    if found:
        return found.group(1)
    return value if SLOT_ID.fullmatch(value) else None


def answer_text(
    slot_id: str | None, slot: Slot | None, room_tokens: int | None, tool_name: str
) -> str:
    """What the expansion tool answers: the slot's content (cut to ``room_tokens``), or why not."""
    if slot_id is None:
        return (
            f"{tool_name} needs a slot_id: the id inside a [TOOL_RESULT:<slot_id>] reference "
            "shown in this conversation."
        )
    if slot is None:
        return (
            f"[TOOL_RESULT:{slot_id}] has expired or is unknown: its content is no longer "
            "available. Answer from what the conversation shows, or ask for the tool to be run "
            "again."
        )
    content = slot.content
    if room_tokens is not None and slot.tokens > room_tokens:
        keep = max(1, len(content) * room_tokens // max(slot.tokens, 1))
        content = (
            content[:keep] + f"\n[cut by Engram: about {room_tokens} of {slot.tokens} tokens "
            "shown; the rest does not fit the model's context]"
        )
    return content


def add_usage(total: dict[str, Any] | None, usage: Any) -> dict[str, Any] | None:
    """``usage`` added into ``total`` (numbers summed, nested details too)."""
    if not isinstance(usage, dict):
        return total
    if total is None:
        copy: dict[str, Any] = json.loads(json.dumps(usage))  # a deep copy
        return copy
    out = dict(total)
    for key, value in usage.items():
        old = out.get(key)
        if isinstance(value, bool) or value is None:
            out[key] = value if old is None else old
        elif isinstance(value, int | float) and isinstance(old, int | float):
            out[key] = old + value
        elif isinstance(value, dict) and isinstance(old, dict):
            out[key] = add_usage(old, value)
        else:
            out[key] = value
    return out


def call_id() -> str:
    """A 9-character alphanumeric id (Mistral's templates accept no other)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


def round_trip_messages(
    content: str | None, calls: Sequence[dict[str, Any]], answers: Sequence[str]
) -> list[dict[str, Any]]:
    """The assistant message with the internal calls, and one tool message answering each."""
    fixed = [
        {**c, "id": c.get("id") or call_id(), "type": c.get("type") or "function"} for c in calls
    ]
    out: list[dict[str, Any]] = [
        {"role": "assistant", "content": content or None, "tool_calls": fixed}
    ]
    out += [
        {"role": "tool", "tool_call_id": c["id"], "content": text}
        for c, text in zip(fixed, answers, strict=True)
    ]
    return out


def final_completion(
    obj: dict[str, Any], tool_name: str, usage: dict[str, Any] | None, first_id: str | None
) -> dict[str, Any]:
    """A plain completion as the client gets it: internal calls dropped, usage summed."""
    out = dict(obj)
    if first_id:
        out["id"] = first_id
    if usage is not None:
        out["usage"] = usage
    choices = out.get("choices")
    if not isinstance(choices, list):
        return out
    fixed = []
    for choice in choices:
        msg = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(msg, dict) or not isinstance(msg.get("tool_calls"), list):
            fixed.append(choice)
            continue
        internal, client = split_calls(msg["tool_calls"], tool_name)
        if not internal:
            fixed.append(choice)
            continue
        new_msg = {k: v for k, v in msg.items() if k != "tool_calls"}
        if client:
            new_msg["tool_calls"] = client
        new_choice = {**choice, "message": new_msg}
        if not client and choice.get("finish_reason") == "tool_calls":
            new_choice["finish_reason"] = "stop"
        fixed.append(new_choice)
    out["choices"] = fixed
    return out


@dataclass
class StreamRound:
    """One streamed round: what to relay now, and the internal calls held back.

    ``feed`` takes each ``chat.completion.chunk`` and returns the chunk to relay (possibly
    rewritten) or None. Once the round's finish arrives with internal calls only, the rest of the
    round (finish, usage, ``[DONE]``) is held: :attr:`round_trip` says a round trip follows.
    """

    tool_name: str
    may_round_trip: bool  # False on the last allowed round: internal calls are only dropped
    first_id: str | None = None  # the id the client saw first (later rounds are rewritten to it)
    content: list[str] = field(default_factory=list)
    internal: dict[int, dict[str, Any]] = field(default_factory=dict)
    client_index: dict[int, int] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    usage_chunk: dict[str, Any] | None = None
    round_trip: bool = False
    done: bool = False  # the round's [DONE] arrived

    def feed(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        if "error" in chunk:
            return chunk
        out = dict(chunk)
        changed = False
        if self.first_id and isinstance(out.get("id"), str) and out["id"] != self.first_id:
            out["id"] = self.first_id
            changed = True
        choices = out.get("choices")
        if isinstance(out.get("usage"), dict):
            self.usage = add_usage(self.usage, out.pop("usage"))
            changed = True
            if not choices:  # the usage chunk: the summed usage goes out at the very end
                self.usage_chunk = chunk
                return None
        if isinstance(choices, list):
            kept = []
            for choice in choices:
                new = self._choice(choice) if isinstance(choice, dict) else choice
                if new is not choice:
                    changed = True
                if new is not None:
                    kept.append(new)
            if not kept and choices:
                return None  # every choice of this chunk was internal or held back
            if changed:
                out["choices"] = kept
        return out if changed else chunk

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        if choice.get("index", 0) != 0:
            return choice
        if self.round_trip:
            return None  # after a round-trip finish: nothing more of this round reaches the client
        delta = choice.get("delta")
        new_delta = delta
        if isinstance(delta, dict):
            if isinstance(delta.get("content"), str):
                self.content.append(delta["content"])
            calls = delta.get("tool_calls")
            if isinstance(calls, list):
                kept = [c for c in (self._call(p, c) for p, c in enumerate(calls)) if c is not None]
                new_delta = {k: v for k, v in delta.items() if k != "tool_calls"}
                if kept:
                    new_delta["tool_calls"] = kept
        finish = choice.get("finish_reason")
        new = choice if new_delta is delta else {**choice, "delta": new_delta}
        if finish:
            if self.internal and not self.client_index:
                if self.may_round_trip:
                    self.round_trip = True
                    return None
                if finish == "tool_calls":
                    new = {**new, "finish_reason": "stop"}
        elif new_delta is not delta and not _has_payload(new_delta):
            return None
        return new

    def _call(self, pos: int, call: Any) -> dict[str, Any] | None:
        if not isinstance(call, dict):
            return call  # type: ignore[no-any-return]
        index = call.get("index", pos)
        if index in self.internal:
            _merge_call(self.internal[index], call)
            return None
        if index not in self.client_index:
            if _call_name(call) == self.tool_name:
                self.internal[index] = {
                    "id": "",
                    "type": "function",
                    "function": {"name": self.tool_name, "arguments": ""},
                }
                _merge_call(self.internal[index], call)
                return None
            self.client_index[index] = len(self.client_index)
        renumbered = self.client_index[index]
        return call if renumbered == index else {**call, "index": renumbered}

    def calls(self) -> list[dict[str, Any]]:
        return [self.internal[i] for i in sorted(self.internal)]


def _merge_call(slot: dict[str, Any], call: Mapping[str, Any]) -> None:
    if call.get("id") and not slot["id"]:
        slot["id"] = call["id"]
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        slot["function"]["arguments"] += fn["arguments"]


def _has_payload(delta: Any) -> bool:
    if not isinstance(delta, dict):
        return True
    return any(v not in (None, "", [], {}) for v in delta.values())


class ToolRejections:
    """Models whose upstream rejected a request with tools: not offered the tool for a while."""

    def __init__(self, ttl: float = REJECT_TTL) -> None:
        self.ttl = ttl
        self._until: dict[str | None, float] = {}

    def rejected(self, model: str | None) -> bool:
        until = self._until.get(model)
        return until is not None and until > time.monotonic()

    def add(self, model: str | None) -> None:
        self._until[model] = time.monotonic() + self.ttl
        log.warning(
            "the upstream rejected a request with tools; no expansion tool for model %r "
            "for %.0f s (references stay self-describing)",
            model,
            self.ttl,
        )


def mentions_tools(status: int, body: bytes) -> bool:
    """An error reply that looks like "this server/model does not take tools"."""
    return status in (400, 422, 500, 501) and b"tool" in body.lower()
