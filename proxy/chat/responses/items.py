"""Responses ``instructions`` and ``input`` items ↔ the neutral (chat-shaped) messages (pure).

    instructions + leading system/developer items   one ``system`` message (their texts joined)
    a user / system / developer ``message`` item    a message; ``input_text`` parts become ``text``
    assistant messages, ``function_call`` and       one ``assistant`` message per run: the output
      ``reasoning`` items in a row                    text as content, the calls as ``tool_calls``
                                                      (``id`` = the item's ``call_id``)
    ``function_call_output``                        a ``tool`` message (``tool_call_id`` = call_id)
    anything else (``item_reference``, a reasoning   opaque: it travels with the next message (or
      item alone, hosted or custom tool calls …)      the last one) and goes back as sent

The assistant run is the shape of an archived reply (:meth:`proxy.sse.AssembledReply.message`),
so a resent history hashes like the turns stored from it and its session is found again.

Every neutral message carries :data:`MARK`, naming the items it stands for (``s:…`` the system
message and the leading items merged into it, ``m:…`` the others). The memory stages copy
messages with their keys, so :func:`encode_input` knows where each forwarded message came from:
an unchanged one goes back as the client's items, byte for byte; a changed one (the memory block
after the system text, a tool output swapped for its slot reference, a leading block in a user
message) is rebuilt from its items with only the content replaced; one Engram made (the memory
block when there were no instructions, the summary) becomes new input. The system message goes
back as ``instructions`` — the client's text first, byte-identical — with the leading
system/developer items folded into it whenever Engram rewrites the request (whether or not it
changed the system message, so every rewritten request of a conversation folds them alike), so a
strict chat template never sees a second system message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = dict[str, Any]
Item = dict[str, Any]

MARK = "_responses_items"
"""The key on each neutral message that names its items (never forwarded, never stored)."""

SYSTEM_ROLES = ("system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")


def input_items(body: Mapping[str, Any]) -> list[Item]:
    """The ``input`` as items (a string is one user message)."""
    value = body.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def item_kind(item: Mapping[str, Any]) -> str:
    """``message`` (typed or an easy input message with a ``role``), else the item's ``type``."""
    kind = item.get("type")
    if kind == "message" or (kind is None and "role" in item):
        return "message"
    return kind if isinstance(kind, str) else ""


def _assistant_part(item: Mapping[str, Any]) -> bool:
    kind = item_kind(item)
    if kind == "message":
        return item.get("role") == "assistant"
    return kind in ("function_call", "reasoning")


def _text_only(content: Any) -> str | None:
    """The text of a content made of text alone (a string or text parts), else None."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        return None
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") not in TEXT_PARTS:
            return None
        text = part.get("text")
        if not isinstance(text, str):
            return None
        texts.append(text)
    return "\n".join(texts)


def neutral_content(content: Any) -> Any:
    """A message's or output's content in the neutral shape: text parts typed ``text``, every
    other part (images, files) and every other key as sent."""
    if not isinstance(content, list):
        return content
    return [
        {**p, "type": "text"}
        if isinstance(p, Mapping) and p.get("type") in ("input_text", "output_text")
        else p
        for p in content
    ]


def api_content(content: Any, role: str) -> Any:
    """Neutral content back in the Responses shape (``text`` parts become ``input_text``, or
    ``output_text`` for the assistant)."""
    if not isinstance(content, list):
        return content
    kind = "output_text" if role == "assistant" else "input_text"
    return [
        {**p, "type": kind} if isinstance(p, Mapping) and p.get("type") == "text" else p
        for p in content
    ]


def _leading_system(items: Sequence[Item]) -> list[int]:
    """Indices of the system/developer items that open the input (text alone: foldable)."""
    out = []
    for i, item in enumerate(items):
        if item_kind(item) != "message" or item.get("role") not in SYSTEM_ROLES:
            break
        if _text_only(item.get("content")) is None:
            break
        out.append(i)
    return out


def _mark(kind: str, indices: Sequence[int]) -> str:
    return kind + ":" + ",".join(str(i) for i in indices)


def _indices(mark: str) -> list[int]:
    tail = mark.partition(":")[2]
    return [int(i) for i in tail.split(",")] if tail else []


def _assistant(items: Sequence[Item], run: Sequence[int]) -> Message | None:
    """One assistant message for a run of assistant items; None for reasoning alone."""
    parts: list[Any] = []
    calls: list[dict[str, Any]] = []
    for i in run:
        item = items[i]
        kind = item_kind(item)
        if kind == "message":
            sent = item.get("content")
            if isinstance(sent, str):
                parts.append({"type": "text", "text": sent})
            elif isinstance(sent, list):
                parts += neutral_content(sent)
        elif kind == "function_call":
            fn = {"name": item.get("name"), "arguments": item.get("arguments")}
            calls.append({"id": item.get("call_id"), "type": "function", "function": fn})
    has_message = any(item_kind(items[i]) == "message" for i in run)
    if not has_message and not calls:
        return None
    content: Any = None
    if has_message:
        text = _text_only(parts) if parts else ""
        content = text if text is not None else parts
    msg: Message = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    return msg


def neutral_messages(body: Mapping[str, Any]) -> list[Message]:
    """The request's conversation in the neutral shape, each message marked (:data:`MARK`)."""
    items = input_items(body)
    instructions = body.get("instructions")
    out: list[Message] = []
    lead = _leading_system(items)
    texts = [instructions] if isinstance(instructions, str) and instructions else []
    texts += [_text_only(items[i].get("content")) or "" for i in lead]
    if texts:
        out.append({"role": "system", "content": "\n\n".join(texts), MARK: _mark("s", lead)})
    pending: list[int] = []  # opaque items waiting for the next message
    i = len(lead)
    while i < len(items):
        item = items[i]
        if _assistant_part(item):
            j = i
            while j < len(items) and _assistant_part(items[j]):
                j += 1
            msg = _assistant(items, range(i, j))
            if msg is None:
                pending += range(i, j)
            else:
                msg[MARK] = _mark("m", [*pending, *range(i, j)])
                out.append(msg)
                pending = []
            i = j
            continue
        kind = item_kind(item)
        if kind == "message":
            msg = {"role": item.get("role"), "content": neutral_content(item.get("content"))}
        elif kind == "function_call_output":
            msg = {
                "role": "tool",
                "tool_call_id": item.get("call_id"),
                "content": neutral_content(item.get("output")),
            }
        else:
            pending.append(i)
            i += 1
            continue
        msg[MARK] = _mark("m", [*pending, i])
        out.append(msg)
        pending = []
        i += 1
    if pending and out and out[-1][MARK].startswith("m"):
        last = out[-1]
        last[MARK] = _mark("m", [*_indices(last[MARK]), *pending])
    return out


def system_text(msg: Mapping[str, Any]) -> str:
    """A neutral system message's text, for ``instructions`` (text parts joined as written:
    :func:`proxy.chat.prompt.append_to_system` puts its separator inside the part)."""
    content = msg.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return ""


def _rebuilt(items: Sequence[Item], indices: Sequence[int], msg: Mapping[str, Any]) -> list[Item]:
    """The message's items with its (changed) content in place of theirs."""
    out = []
    for i in indices:
        item = items[i]
        kind = item_kind(item)
        if kind == "message" and item.get("role") != "assistant":
            out.append({**item, "content": api_content(msg.get("content"), str(item.get("role")))})
        elif kind == "function_call_output":
            out.append({**item, "output": api_content(msg.get("content"), "tool")})
        else:
            out.append(item)  # assistant runs, reasoning, opaque items: no stage changes them
    return out


def new_item(msg: Mapping[str, Any]) -> Item:
    """An input item for a message Engram made (the summary, a memory message)."""
    role = str(msg.get("role"))
    if role == "tool":
        content = msg.get("content")
        output = content if isinstance(content, str) else api_content(content, "tool")
        return {
            "type": "function_call_output",
            "call_id": msg.get("tool_call_id"),
            "output": output,
        }
    return {"type": "message", "role": role, "content": api_content(msg.get("content"), role)}


def encode_input(
    body: Mapping[str, Any], original: Sequence[Message], forwarded: Sequence[Message]
) -> dict[str, Any]:
    """The client's body with the forwarded neutral messages back in ``instructions`` and
    ``input``; every other field as sent. ``original``: the messages :func:`neutral_messages`
    gave (what the stages started from)."""
    items = input_items(body)
    by_mark = {m[MARK]: m for m in original if isinstance(m.get(MARK), str)}
    covered = {i for mark in by_mark for i in _indices(mark)}
    out: list[Item] = []
    instructions: str | None = None  # None: as sent
    # Engram rewrote something: leading system items fold into the instructions (always alike,
    # so every rewritten request of a conversation sends the same instructions).
    rewritten = len(forwarded) != len(original) or any(
        by_mark.get(m.get(MARK)) != m for m in forwarded
    )
    for msg in forwarded:
        mark = msg.get(MARK)
        if not isinstance(mark, str):
            if msg.get("role") in SYSTEM_ROLES and not out and instructions is None:
                instructions = system_text(msg)  # the memory block, where there was no system
            else:
                out.append(new_item(msg))
            continue
        same = by_mark.get(mark) == msg
        indices = _indices(mark)
        if mark.startswith("s"):
            one = not indices or (len(indices) == 1 and not body.get("instructions"))
            if same and (one or not rewritten):  # as sent
                out += [items[i] for i in indices]
            else:  # the client's text first, then the leading items' and Engram's
                instructions = system_text(msg)
            continue
        out += [items[i] for i in indices] if same else _rebuilt(items, indices, msg)
    out += [item for i, item in enumerate(items) if i not in covered]
    new = dict(body)
    if instructions is not None:
        new["instructions"] = instructions
    new["input"] = _as_sent(body.get("input"), items, out)
    return new


def _as_sent(sent: Any, items: Sequence[Item], out: list[Item]) -> Any:
    """A string input stays a string while it is still one user message of text alone."""
    if not isinstance(sent, str):
        return out
    if len(out) == 1 and out[0] is items[0]:
        return sent
    if len(out) == 1 and out[0].get("role") == "user" and _text_only(out[0].get("content")):
        return system_text(out[0])  # its text parts, joined as written
    return out
