"""Chat messages as data: their text, their canonical form, and the hash chain over them.

Pure functions over OpenAI-chat-shaped messages (``role``, ``content`` as a string or parts,
``tool_calls``, ``tool_call_id``, ``name``), the shape every chat API is brought into. They take
whatever JSON a client sent without raising: a content of another type reads as no text, a tool
call of the wrong shape hashes by what it has, and a lone surrogate (legal in JSON, not in UTF-8)
still hashes. ``H_k`` (:func:`chain_hashes`) covers messages ``0..k``, so a conversation resent
with one more turn shares every earlier hash with what is stored, and an edited or regenerated
message changes every hash after it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any


def content_text(content: Any) -> str:
    """A message's content as plain text: strings as they are, text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping):
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif part.get("type") in ("image_url", "input_image"):
                    parts.append("[image]")
                elif part.get("type") in ("input_audio", "audio"):
                    parts.append("[audio]")
                elif part.get("type") == "file":
                    parts.append("[file]")
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return ""


def canonical(message: Mapping[str, Any]) -> str:
    """What identifies a message across resends: role, text, tool calls and ids."""
    role = message.get("role")
    if role == "developer":
        role = "system"
    data: dict[str, Any] = {"r": role, "c": " ".join(content_text(message.get("content")).split())}
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        data["t"] = [_call_key(c) for c in calls if isinstance(c, Mapping)]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            data[key] = message[key]
    return json.dumps(data, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _call_key(call: Mapping[str, Any]) -> list[Any]:
    """A tool call's id, name and arguments, whatever types the client sent them as."""
    fn = call.get("function")
    if not isinstance(fn, Mapping):
        fn = {}
    return [call.get("id"), fn.get("name"), fn.get("arguments")]


def _digest(text: str) -> str:
    # surrogatepass: a lone surrogate (legal in JSON, not in UTF-8) still hashes, stably.
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def chain_hashes(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """``H_1..H_n``: hash i covers messages 0..i (so ``chain[i]`` belongs to ``messages[i]``)."""
    out: list[str] = []
    prev = ""
    for msg in messages:
        prev = _digest(prev + canonical(msg))
        out.append(prev)
    return out


def extend_chain(prev: str, message: Mapping[str, Any]) -> str:
    return _digest(prev + canonical(message))


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def without_lone_surrogates(value: Any) -> Any:
    """``value`` (parsed JSON) with every lone surrogate replaced by U+FFFD, or ``value`` itself
    when it holds none. JSON may spell ``"\\ud800"``; UTF-8, SQLite and tokenizers cannot hold it.
    (``json.loads`` joins valid pairs, so any surrogate left in a string is a lone one.)"""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value) if _LONE_SURROGATE.search(value) else value
    if isinstance(value, list):
        items = [without_lone_surrogates(v) for v in value]
        changed = any(a is not b for a, b in zip(items, value, strict=True))
        return items if changed else value
    if isinstance(value, dict):
        pairs = {without_lone_surrogates(k): without_lone_surrogates(v) for k, v in value.items()}
        changed = len(pairs) != len(value) or any(
            pairs.get(k, _MISSING) is not v for k, v in value.items()
        )
        return pairs if changed else value
    return value


_MISSING = object()


def anchor_length(messages: Sequence[Mapping[str, Any]]) -> int | None:
    """How many leading messages form the anchor: through the first assistant reply.

    None when there is no assistant message yet (a conversation's first request), so two
    conversations that both open with "hi" are never matched on that alone.
    """
    for i, msg in enumerate(messages):
        if msg.get("role") == "assistant":
            return i + 1
    return None


# Requests that chat front-ends make for housekeeping (titles, tags, follow-ups, autocomplete):
# answered as usual but neither archived nor given memories.


def last_user_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The text of the last user message, stripped ("" when there is none)."""
    for msg in reversed(messages):
        if msg.get("role") == "user":
            return content_text(msg.get("content")).strip()
    return ""


def current_turn_start(messages: Sequence[Mapping[str, Any]], first: int | None = None) -> int:
    """Index where the current turn starts: everything after the last assistant message that
    precedes the last user message. A client may send several messages at once (an environment
    block, then the question), and an agent loop's calls and results after the user message
    belong to its turn. ``first``: where the conversation starts (after a leading system
    message, by default)."""
    if first is None:
        first = 1 if messages and messages[0].get("role") in ("system", "developer") else 0
    after_reply = first
    last_user: int | None = None
    for i in range(len(messages) - 1, first - 1, -1):
        role = messages[i].get("role")
        if role == "user" and last_user is None:
            last_user = i
        if role == "assistant" and last_user is not None:
            after_reply = i + 1
            break
    return min(after_reply, last_user) if last_user is not None else after_reply
