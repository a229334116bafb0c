"""Prompt assembly under a token budget: primacy and recency zones (pure).

    [primacy]  the original system message, byte-identical, then (mode ``zones``) the memory block
    [middle]   nothing: the aged part of the conversation is not sent
    [recency]  the rolling summary, the most recent turns that fit, the current exchange
               (mode ``stable``: the memory block leads the new user message instead)

The current exchange (the last user message and whatever follows it: tool calls and results of
an agent loop) is always kept whole. The recent window is cut between *units*: an assistant
message with ``tool_calls`` and the ``tool`` messages answering it are one unit, never split.
When the whole conversation fits in ``whole_share`` of the budget it is forwarded whole.

Template safety: never a second system message; the first message after the system message is a
user message; user/assistant alternation is kept where the original had it. The summary opens the
recency zone as a user message when the window starts with an assistant turn, or as a leading
text part of the window's first user message otherwise; memory in ``stable`` mode is a leading
text part of the new user message. Both are clearly marked blocks, never mixed into the user's
own text. What either block holds is stored text made inert (:mod:`proxy.chat.fence`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.chat.fence import inert_text

Message = dict[str, Any]

MODES = ("zones", "stable")
STABLE_REFILL = 0.6  # in stable mode a cut leaves the window this full, with room to grow
SUMMARY_OPEN = "<engram-summary>"
SUMMARY_CLOSE = "</engram-summary>"
SUMMARY_PREAMBLE = "Summary of the earlier part of this conversation (older turns are not shown):"


@dataclass(frozen=True)
class Part:
    """One forwarded message, labelled: which zone, where it came from, what it holds."""

    zone: str  # primacy | recency
    source: str  # system | memory | summary | recent | current
    index: int | None  # position in the client's messages (None: made by Engram)
    refs: tuple[int, ...] = ()  # memory turn ids, for memory parts


@dataclass
class Assembly:
    messages: list[Message]
    parts: list[Part]
    rewritten: bool  # False: the conversation went whole (memories may still be added)
    aged: int  # client messages left out (summarised or recallable)
    tokens: int  # estimated tokens forwarded
    original_tokens: int
    window_start: int  # index of the first client message kept after the system message
    notes: list[str] = field(default_factory=list)


def is_system(msg: Message) -> bool:
    return msg.get("role") in ("system", "developer")


def units(messages: Sequence[Message], start: int, end: int) -> list[tuple[int, int]]:
    """``[a, b)`` index ranges of indivisible units in ``messages[start:end]``."""
    out: list[tuple[int, int]] = []
    i = start
    while i < end:
        j = i + 1
        if messages[i].get("role") == "assistant" and messages[i].get("tool_calls"):
            while j < end and messages[j].get("role") in ("tool", "function"):
                j += 1
        out.append((i, j))
        i = j
    return out


def current_start(messages: Sequence[Message], first: int) -> int:
    """Index where the current exchange starts: the last user message (or ``first``)."""
    for i in range(len(messages) - 1, first - 1, -1):
        if messages[i].get("role") == "user":
            return i
    return first


def with_leading_text(msg: Message, block: str) -> Message:
    """A copy of a user message with ``block`` as a separate leading text part."""
    out = copy.copy(msg)
    content = msg.get("content")
    parts: list[Any]
    if isinstance(content, list):
        parts = list(content)
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    else:
        parts = []
    out["content"] = [{"type": "text", "text": block + "\n\n"}, *parts]
    return out


def summary_text(summary: str) -> str:
    """The rolling summary's block. The summary is written by the model from stored turns, so
    it is made inert like the memory block (:func:`proxy.chat.fence.inert_text`): no tag or
    chat-template token of a stored text survives in it."""
    return f"{SUMMARY_OPEN}\n{SUMMARY_PREAMBLE}\n{inert_text(summary)}\n{SUMMARY_CLOSE}"


def append_to_system(msg: Message, block: str) -> Message:
    """The system message with ``block`` after its text (its text stays a prefix)."""
    out = copy.copy(msg)
    content = msg.get("content")
    if isinstance(content, list):
        out["content"] = [*content, {"type": "text", "text": "\n\n" + block}]
    elif isinstance(content, str) and content:
        out["content"] = content + "\n\n" + block
    else:
        out["content"] = block
    return out


def assemble(
    messages: Sequence[Message],
    *,
    budget: int | None,
    count: Callable[[Message], int],
    count_text: Callable[[str], int],
    memory_block: str = "",
    memory_ids: Sequence[int] = (),
    summary: str | None = None,
    mode: str = "zones",
    whole_share: float = 0.8,
    previous_start: int | None = None,
) -> Assembly:
    """Build the forwarded messages. ``budget`` is the prompt's token budget (None: unknown,
    forward whole). ``summary`` stands in for the aged part when the conversation is cut. In
    ``stable`` mode ``previous_start`` (where this conversation's last window began) is kept
    while the window still fits, and a cut goes deeper (to :data:`STABLE_REFILL` of the room),
    so the forwarded prefix stays byte-identical for many turns between cuts."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    msgs = list(messages)
    n = len(msgs)
    first = 1 if msgs and is_system(msgs[0]) else 0
    sizes = [count(m) for m in msgs]
    original = sum(sizes)
    mem_cost = count_text(memory_block) + 4 if memory_block else 0
    # A message the memory block joins costs its own tokens plus the block's: the whole is not
    # counted again (the block is the biggest text of a memory-on request).
    costs: dict[int, tuple[Message, int]] = {}  # by id, the message held so no id is reused

    def known(msg: Message, cost: int) -> Message:
        costs[id(msg)] = (msg, cost)
        return msg

    def cost_of(msg: Message) -> int:
        held = costs.get(id(msg))
        return held[1] if held is not None and held[0] is msg else count(msg)

    cur = current_start(msgs, first)

    whole = budget is None or original + mem_cost <= whole_share * budget
    if whole:
        start = first
        summary = None
    else:
        assert budget is not None
        fixed = sum(sizes[:first]) + mem_cost + sum(sizes[cur:])
        sum_cost = count_text(summary_text(summary)) + 4 if summary else 0
        room = budget - fixed - sum_cost
        if (
            mode == "stable"
            and previous_start is not None
            and first < previous_start <= cur
            and sum(sizes[previous_start:cur]) <= room
        ):
            start = previous_start  # the window still fits where it started: the prefix holds
        else:
            if mode == "stable":
                room = int(room * STABLE_REFILL)  # cut deeper, so later turns fit without a move
            start = cur
            for a, b in reversed(units(msgs, first, cur)):
                cost = sum(sizes[a:b])
                if cost > room:
                    break
                room -= cost
                start = a
        # The first message after the system message must be a user turn unless the summary
        # (a user message) opens the zone; an orphan tool result can never lead.
        while start < cur and (
            msgs[start].get("role") in ("tool", "function")
            or (not summary and msgs[start].get("role") != "user")
        ):
            start = next(b for a, b in units(msgs, start, cur) if a == start)
        if start == first:  # everything fitted after all: no summary needed
            summary = None

    out: list[Message] = []
    parts: list[Part] = []
    if first:
        system = msgs[0]
        if memory_block and mode == "zones":
            system = known(append_to_system(system, memory_block), count(system) + mem_cost)
            parts.append(Part("primacy", "system+memory", 0, tuple(memory_ids)))
        else:
            parts.append(Part("primacy", "system", 0))
        out.append(system)
    elif memory_block and mode == "zones":
        out.append(known({"role": "system", "content": memory_block}, mem_cost))
        parts.append(Part("primacy", "memory", None, tuple(memory_ids)))

    window: list[tuple[Message, str, int | None]] = [
        (msgs[i], "recent" if i < cur else "current", i) for i in range(start, n)
    ]
    if summary:
        block = summary_text(summary)
        if window and window[0][0].get("role") == "user":
            msg, label, index = window[0]
            window[0] = (with_leading_text(msg, block), "summary+" + label, index)
        else:
            window.insert(0, ({"role": "user", "content": block}, "summary", None))
    if memory_block and mode == "stable":
        k = next((w for w, (_, _, index) in enumerate(window) if index == cur), None)
        if k is not None and msgs[cur].get("role") == "user":
            msg, label, index = window[k]
            joined = known(with_leading_text(msg, memory_block), count(msg) + mem_cost)
            window[k] = (joined, "memory+" + label, index)
        elif out and is_system(out[0]):  # no user message to carry it: primacy after all
            out[0] = known(append_to_system(out[0], memory_block), count(out[0]) + mem_cost)
        else:
            out.insert(0, known({"role": "system", "content": memory_block}, mem_cost))
    for msg, label, index in window:
        refs = tuple(memory_ids) if label.startswith("memory") else ()
        parts.append(Part("recency", label, index, refs))
        out.append(msg)
    tokens = sum(cost_of(m) for m in out)
    return Assembly(out, parts, not whole and start > first, start - first, tokens, original, start)
