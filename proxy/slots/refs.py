"""Which tool outputs become ``[TOOL_RESULT:<id>]`` references, and how they read (pure).

A tool output is replaced when it is longer than ``min_tokens`` and older than what
``keep_recent`` protects. Its slot id is the tool's name plus a short hash of the output, so the
same output gets the same reference on every turn and after a restart, and a forwarded prompt
repeats the same bytes turn after turn (the upstream's prompt cache keeps working). The reference
is self-describing: ``[TOOL_RESULT:<id>]`` and one line saying what it was (tool, size, path or
first line). The message keeps its role, ``tool_call_id``, name and place.

Text-protocol agents (Cline, Roo Code's XML mode) put tool results in *user* messages as
``[read_file for 'src/app.py'] Result:`` blocks; with ``detect_text`` the body of such a block is
replaced the same way (its header line stays).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.messages import content_text
from proxy.slots.model import Slot

SLOT_ID = re.compile(r"[A-Za-z0-9_.\-]{1,80}")
REFERENCE = re.compile(rf"\[TOOL_RESULT:({SLOT_ID.pattern})\]")
TOOL_ROLES = frozenset({"tool", "function"})
# Argument names whose value says best what a tool call read or ran.
HINT_KEYS = (
    "path",
    "file_path",
    "filepath",
    "file",
    "filename",
    "target_file",
    "url",
    "command",
    "cmd",
    "query",
    "pattern",
    "regex",
)
HINT_CHARS = 120
# A text-protocol tool result header: "[read_file for 'src/app.py'] Result:".
TEXT_RESULT = re.compile(
    r"^\[([A-Za-z_][\w.-]{0,63})(?: for '([^'\n]{0,400})')?\] Result:[ \t]*$", re.M
)


@dataclass(frozen=True)
class Candidate:
    """One output to replace: message ``index``; ``part``/``start``/``end`` locate a text-protocol
    block inside a user message (part None: the whole content; -1: a string content)."""

    index: int
    slot: Slot
    part: int | None = None
    start: int = 0
    end: int = 0


def slot_id(tool: str, content: str) -> str:
    """``<tool>-<12 hex of sha256(content)>``: the same output, the same id, always."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", tool).strip("_.-")[:40] or "tool"
    return f"{name}-{hashlib.sha256(content.encode()).hexdigest()[:12]}"


def reference(slot: Slot) -> str:
    return f"[TOOL_RESULT:{slot.id}]\n{slot.description}"


def reference_text(tool: str, tokens: int, content: str, hint: str | None) -> str:
    """One line: what the output was, how big, and its path (or first line)."""
    if hint:
        where = _clip(hint)
    else:
        first = next((line.strip() for line in content.splitlines() if line.strip()), "")
        where = f"first line: {_clip(first)}" if first else "empty"
    return f"{tool} output, {tokens} tokens, stored by Engram; {where}"


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= HINT_CHARS else text[: HINT_CHARS - 1] + "…"


def call_hint(arguments: Any) -> str | None:
    """``path: src/app.py`` from a tool call's JSON arguments, when one names what it read."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    for key in HINT_KEYS:
        value = arguments.get(key)
        if isinstance(value, str) and value.strip():
            return f"{key}: {value.strip()}"
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return f"{key}: {' '.join(value)}"
    return None


def protected_from(messages: Sequence[Mapping[str, Any]], keep_recent: str) -> int:
    """Index of the first message whose tool outputs stay raw."""
    n = len(messages)
    if keep_recent == "none":
        return n
    roles = [m.get("role") for m in messages]
    if keep_recent == "round":
        last = max((i for i, r in enumerate(roles) if r == "assistant"), default=-1)
    else:  # "exchange": everything after the last user message
        last = max((i for i, r in enumerate(roles) if r == "user"), default=-1)
    return last + 1


def _calls_by_id(messages: Sequence[Mapping[str, Any]]) -> dict[str, tuple[str, Any]]:
    out: dict[str, tuple[str, Any]] = {}
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") != "assistant" or not isinstance(calls, list):
            continue
        for call in calls:
            if not isinstance(call, dict) or not isinstance(call.get("id"), str):
                continue
            fn = call.get("function")
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                out[call["id"]] = (fn["name"], fn.get("arguments"))
    return out


def find(
    messages: Sequence[Mapping[str, Any]],
    *,
    min_tokens: int,
    keep_recent: str,
    count: Callable[[str], int],
    detect_text: bool = False,
    clean: Callable[[str], str] | None = None,
) -> list[Candidate]:
    """The outputs to replace, in message order. ``count`` gives a text's tokens (it must be
    deterministic: the description holds the count). ``clean`` (secret redaction) rewrites an
    output and its description before they become a slot: what is stored is what it returns."""
    stop = protected_from(messages, keep_recent)
    calls = _calls_by_id(messages)
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    out: list[Candidate] = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role in TOOL_ROLES and i < stop:
            found = _tool_candidate(i, msg, calls, min_tokens, count, clean)
            if found is not None:
                out.append(found)
        elif role == "user" and detect_text and i < min(stop, last_user):
            out.extend(_text_candidates(i, msg, min_tokens, count, clean))
    return out


def _tool_candidate(
    i: int,
    msg: Mapping[str, Any],
    calls: Mapping[str, tuple[str, Any]],
    min_tokens: int,
    count: Callable[[str], int],
    clean: Callable[[str], str] | None,
) -> Candidate | None:
    content = msg.get("content")
    if not isinstance(content, str | list):
        return None
    text = content_text(content)
    if _too_small(text, min_tokens) or REFERENCE.fullmatch(text.split("\n", 1)[0]):
        return None
    text = clean(text) if clean is not None else text
    tokens = count(text)
    if tokens <= min_tokens:
        return None
    tool, hint = "tool", None
    call_id = msg.get("tool_call_id")
    if isinstance(call_id, str) and call_id in calls:
        tool, arguments = calls[call_id]
        hint = call_hint(arguments)
    elif isinstance(msg.get("name"), str):
        tool = msg["name"]
    if hint is not None and clean is not None:
        hint = clean(hint)
    return Candidate(i, _slot(tool, text, tokens, hint))


def _text_candidates(
    i: int,
    msg: Mapping[str, Any],
    min_tokens: int,
    count: Callable[[str], int],
    clean: Callable[[str], str] | None,
) -> list[Candidate]:
    content = msg.get("content")
    if isinstance(content, str):
        parts: list[tuple[int, str]] = [(-1, content)]
    elif isinstance(content, list):
        parts = [
            (p, part["text"])
            for p, part in enumerate(content)
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ]
    else:
        return []
    out: list[Candidate] = []
    for p, text in parts:
        heads = list(TEXT_RESULT.finditer(text))
        for h, head in enumerate(heads):
            start = head.end()
            end = heads[h + 1].start() if h + 1 < len(heads) else len(text)
            body = text[start:end].strip("\n")
            if _too_small(body, min_tokens) or REFERENCE.search(body[:200]):
                continue
            body = clean(body) if clean is not None else body
            tokens = count(body)
            if tokens <= min_tokens:
                continue
            hint = f"for: {head.group(2)}" if head.group(2) else None
            if hint is not None and clean is not None:
                hint = clean(hint)
            out.append(Candidate(i, _slot(head.group(1), body, tokens, hint), p, start, end))
    return out


def _too_small(text: str, min_tokens: int) -> bool:
    # A token is at least one byte (UTF-8), so a short text cannot be over the limit.
    return len(text) <= min_tokens and len(text.encode()) <= min_tokens


def _slot(tool: str, content: str, tokens: int, hint: str | None) -> Slot:
    return Slot(
        slot_id(tool, content), tool, content, tokens, reference_text(tool, tokens, content, hint)
    )


def apply(messages: Sequence[dict[str, Any]], replace: Sequence[Candidate]) -> list[dict[str, Any]]:
    """``messages`` with each candidate's output swapped for its reference. Untouched messages
    are the same objects; a replaced one is a copy with only its content changed."""
    by_index: dict[int, list[Candidate]] = {}
    for c in replace:
        by_index.setdefault(c.index, []).append(c)
    out = list(messages)
    for i, found in by_index.items():
        msg = messages[i]
        if found[0].part is None:
            out[i] = {**msg, "content": reference(found[0].slot)}
            continue
        content = msg.get("content")
        if isinstance(content, str):
            out[i] = {**msg, "content": _swap_blocks(content, found)}
        elif isinstance(content, list):
            parts = list(content)
            for p in {c.part for c in found}:
                assert p is not None
                part = parts[p]
                blocks = [c for c in found if c.part == p]
                parts[p] = {**part, "text": _swap_blocks(part["text"], blocks)}
            out[i] = {**msg, "content": parts}
    return out


def _swap_blocks(text: str, blocks: Sequence[Candidate]) -> str:
    for c in sorted(blocks, key=lambda c: c.start, reverse=True):
        text = text[: c.start] + "\n" + reference(c.slot) + "\n\n" + text[c.end :].lstrip("\n")
    return text


def references(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Slot ids referenced in ``messages``, first appearance first."""
    seen: dict[str, None] = {}
    for m in messages:
        for sid in REFERENCE.findall(content_text(m.get("content"))):
            seen.setdefault(sid, None)
    return list(seen)
