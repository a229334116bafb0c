"""Who is asking and which conversation this is: headers, body fields, key hash, fingerprints.

Pure functions. The user namespace comes from explicit headers or body fields, else a hash of the
API key (never the key), else ``default``. The session comes from an explicit id, else from a
hash chain over the canonicalised messages: ``H_k`` covers messages ``0..k-1``, so a conversation
resent with one more turn shares every earlier ``H_k`` with what is stored, and an edited or
regenerated message changes every hash after it (a fork). Matching the chain against stored turns
happens in the store (``Store.resolve_session``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

USER_HEADERS = ("X-Engram-User", "X-OpenWebUI-User-Id")
SESSION_HEADERS = ("X-Engram-Session", "X-OpenWebUI-Chat-Id", "X-Session-Id")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:@/+=~-]{1,200}$")


@dataclass(frozen=True)
class Identity:
    user: str
    explicit_session: str | None
    user_source: str  # header | body | api-key | default
    parent: str | None = None  # X-Engram-Parent: this is a sub-agent of that session
    agent: str | None = None  # X-Engram-Agent: the sub-agent's label


def _clean_id(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    text: str = value.strip()
    if not text:
        return None
    if _SAFE_ID.match(text):
        return text
    # Anything else (spaces, unicode, very long) is kept stable but made safe.
    return "h-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def identify(headers: Mapping[str, str], body: Mapping[str, Any]) -> Identity:
    """User namespace and explicit session id (if the client sent one)."""
    user, source = None, "default"
    for name in USER_HEADERS:
        user = _clean_id(headers.get(name))
        if user:
            source = "header"
            break
    if not user:
        for key in ("user", "safety_identifier"):
            user = _clean_id(body.get(key))
            if user:
                source = "body"
                break
    if not user:
        secret = api_key(headers)
        if secret:
            user = "key-" + hashlib.sha256(secret.encode()).hexdigest()[:16]
            source = "api-key"
    session = None
    for name in SESSION_HEADERS:
        session = _clean_id(headers.get(name))
        if session:
            break
    if not session:
        meta = body.get("metadata")
        if isinstance(meta, Mapping):
            session = _clean_id(meta.get("session_id")) or _clean_id(meta.get("sessionId"))
    agent = headers.get("X-Engram-Agent", "").strip()[:100] or None
    return Identity(
        user or "default", session, source, _clean_id(headers.get("X-Engram-Parent")), agent
    )


def api_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    else:
        key = headers.get("X-Api-Key", "").strip()
    # Placeholder keys that local clients send carry no identity.
    if not key or key.lower() in {
        "sk-no-key-required",
        "no-key",
        "none",
        "null",
        "ollama",
        "sk-xxx",
        "dummy",
        "empty",
        "-",
    }:
        return None
    return key


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


def message_hash(message: Mapping[str, Any]) -> str:
    return _digest(canonical(message))


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
HOUSEKEEPING_PATTERNS = (
    r"### Task:\s*\n\s*(Generate|Suggest|Analyze|Create|Based on|You are an autocompletion)",
    r"Generate a concise, 3-5 word title",
    r"Generate 1-3 broad tags",
    r"Suggest 3-5 relevant follow-up",
    r"generate a concise,? 5-word-or-less title",
    r"Please generate a (concise )?title for (this|the) conversation",
    r"You are an autocompletion system",
    r"<chat_history>[\s\S]*</chat_history>[\s\S]*(title|tags|follow-up)",
)
_HOUSEKEEPING = re.compile("|".join(f"(?:{p})" for p in HOUSEKEEPING_PATTERNS), re.IGNORECASE)


def is_housekeeping(
    messages: Sequence[Mapping[str, Any]], extra: re.Pattern[str] | None = None
) -> bool:
    """Whether the last user (or system) message is a client's housekeeping prompt."""
    for msg in reversed(messages):
        if msg.get("role") in ("user", "system", "developer"):
            text = content_text(msg.get("content"))[:4000]
            if _HOUSEKEEPING.search(text) or (extra is not None and extra.search(text)):
                return True
            if msg.get("role") == "user":
                return False
    return False
