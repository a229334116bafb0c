"""Anthropic Messages requests in the neutral (OpenAI chat) shape that the memory stages read.

Pure functions. What each part of a ``POST /v1/messages`` body becomes::

    top-level ``system`` (a string or text blocks)  the first message, role ``system``: its text
                                                    (blocks joined as llama-server joins them)
    ``messages[k]`` with string content             a user or assistant message with that string
    ``messages[k]``, role user, content blocks      one ``tool`` message per ``tool_result`` block
                                                    (``tool_call_id`` = ``tool_use_id``, its
                                                    content a string or parts), then one user
                                                    message with the other blocks as parts
                                                    (``text``; ``image`` as ``image_url``; any
                                                    other block as it is)
    ``messages[k]``, role assistant, blocks         one assistant message: its ``text`` blocks as
                                                    parts, its ``tool_use`` blocks as
                                                    ``tool_calls`` (``input`` as JSON arguments);
                                                    ``thinking``, ``redacted_thinking`` and server
                                                    tool blocks are not read (they stay in the
                                                    body, in place)
    ``messages[k]``, role system (Claude Code)      a system message in its place: hashed and
                                                    archived where it was sent; on the way out it
                                                    joins the one system place
                                                    (:mod:`proxy.chat.anthropic.encode`)

Tool results come first in the neutral order (they answer the previous assistant's calls, as the
tool pairing of chat templates wants), whatever their order among the message's blocks.

Every neutral message and part carries :data:`ORIGIN`, where in the client's body it came from
(``"system"``; ``k``; ``[k, b]`` for the ``tool_result`` block ``b`` of message ``k``; a part's
block index). The memory stages copy messages and parts with every key (``{**msg, ...}``), so the
encoder knows what each rewritten piece was; what Engram makes itself has none.

Claude Code's system prompt opens with a billing line whose ``cch=`` stamp changes on every
request; the neutral text has it fixed (as llama-server does), so the conversation's hash chain
holds from one request to the next. The client's bytes keep the stamp.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from proxy.chat.api import Conversation, Message

ORIGIN = "_anthropic"  # where a neutral message or part came from in the client's body
TOP_SYSTEM = "system"  # ORIGIN of the neutral message made from the top-level ``system``

_BILLING = "x-anthropic-billing-header:"
_CCH = re.compile(r"(cch=)[^;\s]{5}(;)")


@dataclass
class AnthropicConversation(Conversation):
    """A Messages request: the neutral conversation, and what encoding it back needs."""

    system_text: str | None = None  # the neutral text of the top-level ``system`` (None: none)
    # ``reshape`` (on Conversation) is set when the body has role ``system`` messages inside
    # ``messages`` (they go to the one system place) or a user message with tool results beside
    # other blocks (split, results first): a strict chat template needs it re-encoded.


def normalize_billing(text: str) -> str:
    """Claude Code's billing line with its per-request ``cch`` stamp fixed to ``fffff``."""
    if not text.startswith(_BILLING):
        return text
    return _CCH.sub(r"\1fffff\2", text, count=1)


def system_text(system: Any) -> str | None:
    """The top-level ``system`` as the model reads it: a string, or its text blocks joined (as
    llama-server joins them); None when there is none (absent, null, empty)."""
    if isinstance(system, str):
        text = system
    elif isinstance(system, list):
        text = "".join(
            b["text"]
            for b in system
            if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        )
    else:
        return None
    return normalize_billing(text) if text else None


def arguments(value: Any) -> str:
    """A ``tool_use`` block's ``input`` as chat-completions ``arguments`` (one spelling for the
    request's blocks and the reassembled reply, so their hashes agree)."""
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def tool_call(block: dict[str, Any]) -> dict[str, Any]:
    """A ``tool_use`` block as a chat-completions tool call."""
    return {
        "id": block.get("id"),
        "type": "function",
        "function": {"name": block.get("name"), "arguments": arguments(block.get("input"))},
    }


def image_url(block: dict[str, Any]) -> str | None:
    """An ``image`` block's picture as a URL (``data:`` for base64), None for other sources."""
    source = block.get("source")
    if not isinstance(source, dict):
        return None
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type") if isinstance(source.get("media_type"), str) else None
        return f"data:{media or 'image/jpeg'};base64,{source['data']}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    return None


def block_part(index: int, block: dict[str, Any]) -> dict[str, Any]:
    """One content block as a neutral content part (with its ORIGIN)."""
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "text": block.get("text", ""), ORIGIN: index}
    if kind == "image":
        url = image_url(block)
        if url is not None:
            return {"type": "image_url", "image_url": {"url": url}, ORIGIN: index}
    return {**block, ORIGIN: index}


def part_block(part: dict[str, Any]) -> dict[str, Any]:
    """A neutral part Engram made (no ORIGIN) as an Anthropic content block."""
    if part.get("type") == "image_url":
        img = part.get("image_url")
        url = img.get("url") if isinstance(img, dict) else None
        if isinstance(url, str):
            if url.startswith("data:") and ";base64," in url:
                media, _, data = url[5:].partition(";base64,")
                src = {"type": "base64", "media_type": media or "image/jpeg", "data": data}
                return {"type": "image", "source": src}
            return {"type": "image", "source": {"type": "url", "url": url}}
    if part.get("type") == "text" or (isinstance(part.get("text"), str) and "type" not in part):
        return {"type": "text", "text": part.get("text", "")}
    return {k: v for k, v in part.items() if k != ORIGIN}


def tool_content(content: Any) -> Any:
    """A ``tool_result``'s content in the neutral shape: a string, or parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return [block_part(j, b) for j, b in enumerate(content) if isinstance(b, dict)]
    return ""


def message_pieces(k: int, msg: dict[str, Any]) -> list[Message]:
    """The neutral messages that ``messages[k]`` becomes."""
    role = msg.get("role")
    content = msg.get("content")
    if not isinstance(content, list):
        return [{"role": role, "content": content, ORIGIN: k}]
    blocks = [(b, block) for b, block in enumerate(content) if isinstance(block, dict)]
    if role == "assistant":
        texts = [block_part(b, x) for b, x in blocks if x.get("type") == "text"]
        calls = [tool_call(x) for _, x in blocks if x.get("type") == "tool_use"]
        out: Message = {"role": "assistant", "content": texts or None, ORIGIN: k}
        if calls:
            out["tool_calls"] = calls
        return [out]
    if role != "user":  # system (and, unvalidated, anything else): its text parts
        texts = [block_part(b, x) for b, x in blocks if x.get("type") == "text"]
        return [{"role": role, "content": texts, ORIGIN: k}]
    pieces: list[Message] = []
    rest: list[dict[str, Any]] = []
    for b, block in blocks:
        if block.get("type") == "tool_result":
            pieces.append(
                {
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id"),
                    "content": tool_content(block.get("content")),
                    ORIGIN: [k, b],
                }
            )
        else:
            rest.append(block_part(b, block))
    if rest or not pieces:
        pieces.append({"role": "user", "content": rest, ORIGIN: k})
    return pieces


def mixes_results(msg: Any) -> bool:
    """Whether a user message holds ``tool_result`` blocks beside other blocks."""
    content = msg.get("content") if isinstance(msg, dict) else None
    if msg.get("role") != "user" or not isinstance(content, list):
        return False
    kinds = {b.get("type") == "tool_result" for b in content if isinstance(b, dict)}
    return len(kinds) == 2


def neutral_messages(body: dict[str, Any]) -> tuple[list[Message], str | None, bool]:
    """The request's neutral messages, the neutral text of its top-level system, and whether
    the body must be re-encoded for a strict chat template (:attr:`AnthropicConversation.
    reshape`)."""
    out: list[Message] = []
    top = system_text(body.get("system"))
    if top is not None:
        out.append({"role": "system", "content": top, ORIGIN: TOP_SYSTEM})
    reshape = False
    for k, msg in enumerate(body["messages"]):
        reshape = reshape or msg.get("role") == "system" or mixes_results(msg)
        out.extend(message_pieces(k, msg))
    return out, top, reshape


def strip_origins(msg: Message) -> Message:
    """A neutral message without ORIGIN keys (in it and its parts), for chat completions."""
    out = {k: v for k, v in msg.items() if k != ORIGIN}
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = [
            {k: v for k, v in p.items() if k != ORIGIN} if isinstance(p, dict) else p
            for p in content
        ]
    return out
