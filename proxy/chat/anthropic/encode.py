"""Neutral messages back into an Anthropic Messages body (pure): the inverse of
:mod:`proxy.chat.anthropic.neutral`, for the messages the memory stages forward.

Every field of the body but ``system`` and ``messages`` goes as sent. A message whose neutral
pieces all came through unchanged goes as the client sent it (its thinking blocks, signatures,
``cache_control`` and unknown fields intact). One that changed is rebuilt from its own blocks in
their order: a rewritten text part replaces only that block's ``text``, a tool-result slot only
that ``tool_result`` block's ``content``, a part Engram added (the rolling summary, the memory
block in ``stable`` mode) becomes a text block where the stages put it, and a piece the window
left out leaves its blocks out. Messages Engram made (the summary when the window opens with an
assistant turn) are new messages.

A user message with ``tool_result`` blocks beside other blocks goes as two user messages, the
results first (:func:`split_results`): one turn to the Messages API, and the order of tool
pairing to llama-server, which would otherwise put the user's text between the tool calls and
their results.

The one system place is the top-level ``system``: the client's own, byte for byte first (a
string stays a string, blocks stay blocks), then the text of any role ``system`` messages that
were inside ``messages`` (Claude Code sends them; llama-server would make each a second system
message, which strict chat templates reject), each once, then what the memory stages appended
(the memory block): joined by blank lines in a string, or as text blocks after the client's.
"""

from __future__ import annotations

from typing import Any

from proxy.chat.anthropic.neutral import (
    ORIGIN,
    TOP_SYSTEM,
    AnthropicConversation,
    mixes_results,
    part_block,
)
from proxy.chat.api import Message
from proxy.messages import content_text

SystemPiece = str | list[dict[str, Any]]  # a string, or text blocks


def encode_body(conv: AnthropicConversation, messages: list[Message]) -> dict[str, Any]:
    """The client's body with ``messages`` (neutral) in its ``system`` and ``messages``."""
    body = conv.body
    sent: list[Any] = body["messages"]
    parsed: dict[int, list[Message]] = {}  # message index -> its neutral pieces, as parsed
    for m in conv.messages:
        k = _index(m.get(ORIGIN))
        if k is not None:
            parsed.setdefault(k, []).append(m)
    system: list[Message] = []
    groups: dict[int, list[Message]] = {}
    order: list[int | Message] = []
    for m in messages:
        if m.get("role") in ("system", "developer"):
            system.append(m)
            continue
        k = _index(m.get(ORIGIN))
        if k is None or not 0 <= k < len(sent):
            order.append(m)  # Engram's own (the summary as a user message)
        else:
            if k not in groups:
                groups[k] = []
                order.append(k)
            groups[k].append(m)
    out_messages: list[Any] = []
    for item in order:
        if isinstance(item, int):
            out_messages += split_results(_rebuild(sent[item], groups[item], parsed.get(item, [])))
        else:
            out_messages.append(_new_message(item))
    out = dict(body)
    place = system_place(conv, system)
    if place is not None:
        out["system"] = place
    out["messages"] = out_messages
    return out


def split_results(msg: dict[str, Any]) -> list[dict[str, Any]]:
    """A user message with tool results beside other blocks as two: the results, then the rest.

    llama-server makes the other blocks a user message placed before the results' tool
    messages, which breaks the tool pairing strict chat templates check; two user messages in a
    row are one turn to the Messages API, and to llama-server the results (tool messages only)
    followed by the user's message."""
    if not mixes_results(msg):
        return [msg]
    content = msg["content"]
    results = [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
    rest = [b for b in content if not (isinstance(b, dict) and b.get("type") == "tool_result")]
    return [{**msg, "content": results}, {"role": "user", "content": rest}]


def _index(origin: Any) -> int | None:
    if isinstance(origin, list) and origin and isinstance(origin[0], int):
        return origin[0]
    if isinstance(origin, int) and not isinstance(origin, bool):
        return origin
    return None


# --- the system place --------------------------------------------------------------------------


def system_place(conv: AnthropicConversation, pieces: list[Message]) -> SystemPiece | None:
    """The top-level ``system`` for these neutral system messages; None: leave it as sent."""
    body = conv.body
    top = body.get("system")
    kept_top: Any = top
    after: list[SystemPiece] = []  # the content of the role system messages inside messages
    added: list[str] = []
    parsed = {m.get(ORIGIN): m for m in conv.messages if m.get("role") == "system"}
    for m in pieces:
        origin = m.get(ORIGIN)
        text = content_text(m.get("content"))
        if origin == TOP_SYSTEM:
            base = conv.system_text or ""
            if text.startswith(base):
                added.append(text[len(base) :])
            else:  # rewritten as a whole (no stage does that today): its text replaces it
                kept_top = None
                added.append(text)
            continue
        k = _index(origin)
        original = body["messages"][k] if k is not None and 0 <= k < len(body["messages"]) else None
        if original is None or not isinstance(origin, int):
            added.append(text)  # the memory block, when the client sent no system
            continue
        was = parsed.get(origin)
        base = content_text(was.get("content")) if was is not None else ""
        if m != was and not text.startswith(base):
            after.append(text)
            continue
        content = original.get("content")
        if isinstance(content, str | list) and content:
            after.append(content if isinstance(content, str) else _text_blocks(content))
        if m != was:
            added.append(text[len(base) :])
    extra: list[SystemPiece] = [a.lstrip("\n") for a in added if a.strip()]
    if not after and not extra and kept_top is top:
        return None
    return _join(kept_top, _unique(after) + extra)


def _text_blocks(content: list[Any]) -> list[dict[str, Any]]:
    return [b for b in content if isinstance(b, dict) and b.get("type") == "text"]


def _unique(pieces: list[SystemPiece]) -> list[SystemPiece]:
    """Each text once (Claude Code repeats the same reminder turn after turn)."""
    seen: set[str] = set()
    out: list[SystemPiece] = []
    for p in pieces:
        text = p if isinstance(p, str) else "".join(b.get("text", "") for b in p)
        if text.strip() and text not in seen:
            seen.add(text)
            out.append(p)
    return out


def _join(top: Any, rest: list[SystemPiece]) -> SystemPiece:
    """The client's system (kept first, as sent) and the rest after it, blank-line separated."""
    head: SystemPiece | None = top if isinstance(top, str | list) and top else None
    if all(isinstance(p, str) for p in rest) and not isinstance(head, list):
        strings = [head] if isinstance(head, str) else []
        return "\n\n".join(strings + [p for p in rest if isinstance(p, str)])
    blocks: list[dict[str, Any]] = (
        list(head) if isinstance(head, list) else [{"type": "text", "text": head}] if head else []
    )
    for p in rest:
        new = [{"type": "text", "text": p}] if isinstance(p, str) else list(p)
        if blocks and new and isinstance(new[0].get("text"), str):
            new[0] = {**new[0], "text": "\n\n" + new[0]["text"]}
        blocks += new
    return blocks


# --- messages -----------------------------------------------------------------------------------


def _rebuild(sent: dict[str, Any], pieces: list[Message], parsed: list[Message]) -> dict[str, Any]:
    """``messages[k]`` from its neutral pieces as forwarded (``parsed``: as they were parsed)."""
    if len(pieces) == len(parsed) and all(
        a is b or a == b for a, b in zip(pieces, parsed, strict=True)
    ):
        return sent  # unchanged: as the client sent it
    content = sent.get("content")
    main = next((p for p in pieces if p.get("role") != "tool"), None)
    if not isinstance(content, list):
        new = main.get("content") if main is not None else content
        if isinstance(new, list):
            new = [_part_to_block(None, p) for p in new if isinstance(p, dict)]
        return {**sent, "content": new}
    tools: dict[int, Message] = {}
    for p in pieces:
        origin = p.get(ORIGIN)
        if p.get("role") == "tool" and isinstance(origin, list) and len(origin) == 2:
            tools[origin[1]] = p
    was = {p[ORIGIN][1]: p for p in parsed if isinstance(p.get(ORIGIN), list)}
    parts = list(main["content"]) if main is not None and isinstance(main["content"], list) else []
    if main is not None and isinstance(main.get("content"), str):
        parts = [{"type": "text", "text": main["content"]}]
    assistant = sent.get("role") == "assistant"
    blocks: list[Any] = []
    i = 0
    for b, block in enumerate(content):
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "tool_result" and not assistant:
            piece = tools.get(b)
            if piece is not None:
                blocks.append(_tool_block(block, piece, was.get(b)))
            continue
        if assistant and kind != "text":
            blocks.append(block)  # thinking, tool_use, server tools: as sent, in place
            continue
        while i < len(parts) and not isinstance(parts[i].get(ORIGIN), int):
            blocks.append(part_block(parts[i]))  # what Engram put before this block
            i += 1
        if i < len(parts) and parts[i].get(ORIGIN) == b:
            blocks.append(_part_to_block(block, parts[i]))
            i += 1
    blocks += [part_block(p) for p in parts[i:] if isinstance(p, dict)]
    return {**sent, "content": blocks}


def _part_to_block(block: dict[str, Any] | None, part: dict[str, Any]) -> dict[str, Any]:
    """A forwarded part as a block: the client's ``block`` with a rewritten text put in, or a
    new block for a part Engram made."""
    if block is None or not isinstance(part.get(ORIGIN), int):
        return part_block(part)
    if block.get("type") == "text" and part.get("text") != block.get("text"):
        return {**block, "text": part.get("text", "")}
    return block


def _tool_block(block: dict[str, Any], piece: Message, was: Message | None) -> dict[str, Any]:
    """A ``tool_result`` block with its forwarded content (a slot reference, when replaced)."""
    if was is not None and (piece is was or piece == was):
        return block
    new = piece.get("content")
    old = block.get("content")
    if isinstance(new, str) and isinstance(old, list):
        new = [{"type": "text", "text": new}]  # a reference, in the shape the client used
    elif isinstance(new, list):
        olds = old if isinstance(old, list) else []
        new = [
            _part_to_block(olds[p[ORIGIN]] if _has(olds, p.get(ORIGIN)) else None, p)
            for p in new
            if isinstance(p, dict)
        ]
    return {**block, "content": new}


def _has(items: list[Any], index: Any) -> bool:
    return isinstance(index, int) and 0 <= index < len(items) and isinstance(items[index], dict)


def _new_message(m: Message) -> dict[str, Any]:
    """A message Engram made (the summary opening the window)."""
    content = m.get("content")
    if isinstance(content, list):
        content = [part_block(p) for p in content if isinstance(p, dict)]
    return {"role": m.get("role"), "content": content}
