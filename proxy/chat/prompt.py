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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.chat.fence import inert_text, says_derived, without_preamble
from proxy.config import RetrievalSettings
from proxy.messages import current_turn_start

Message = dict[str, Any]

MODES = ("zones", "stable")
STABLE_REFILL = 0.6  # in stable mode a cut leaves the window this full, with room to grow
SUMMARY_OPEN = "<engram-summary>"
SUMMARY_CLOSE = "</engram-summary>"
SUMMARY_PREAMBLE = "Summary of the earlier part of this conversation (older turns are not shown):"
# Assembly notes: what the assembler had to do (see :func:`assemble`).
OVER_BUDGET = "over-budget"
NO_ROOM = "no-room"  # memories were found, but the prompt left no room for any of them
MEMORY_DROPPED = "memory-dropped"


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
    costs: list[int] = field(default_factory=list)  # tokens of each forwarded message
    memory_tokens: int = 0  # of which the memory block's (in the message it joined)


def is_system(msg: Message) -> bool:
    return msg.get("role") in ("system", "developer")


def whole_within(mode: str, whole_share: float) -> float:
    """The share of the budget a conversation goes whole within: ``whole_share`` in mode zones
    (rewriting starts when it pays), all of it in mode stable (a cut, or a tool output swapped
    for a reference, moves the prefix and the model server recomputes all after it: it waits
    until the conversation no longer fits)."""
    return 1.0 if mode == "stable" else whole_share


def memory_room(retrieval: RetrievalSettings, budget: int | None) -> int:
    """Tokens the memory block may take: its cap (``retrieval.budget_tokens``), and a share of
    the prompt budget (``retrieval.budget_share``)."""
    if budget is None:
        return retrieval.budget_tokens
    return max(0, min(retrieval.budget_tokens, int(retrieval.budget_share * budget)))


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
    """Index where the current turn starts (:func:`proxy.messages.current_turn_start`)."""
    return current_turn_start(messages, first)


def fixed_tokens(messages: Sequence[Message], count: Callable[[Message], int]) -> int:
    """Tokens of what no cut ever leaves out: every system message and the current turn."""
    first = 1 if messages and is_system(messages[0]) else 0
    cur = current_start(messages, first)
    return sum(count(m) for i, m in enumerate(messages) if i >= cur or is_system(m))


def last_user_index(messages: Sequence[Message], first: int) -> int | None:
    """Index of the last user message at or after ``first``, if any."""
    for i in range(len(messages) - 1, first - 1, -1):
        if messages[i].get("role") == "user":
            return i
    return None


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
    laid: Mapping[int, str] | None = None,
) -> Assembly:
    """Build the forwarded messages. ``budget`` is the prompt's token budget (None: unknown,
    forward whole). ``summary`` stands in for the aged part when the conversation is cut. In
    ``stable`` mode ``previous_start`` (where this conversation's last window began) is kept
    while the window still fits, and a cut goes deeper (to :data:`STABLE_REFILL` of the room),
    so the forwarded prefix stays byte-identical for many turns between cuts. ``laid`` (mode
    ``stable``): the blocks earlier requests laid before earlier user messages, by index, laid
    there again exactly so (:mod:`proxy.chat.laying`); they go wherever their message goes.

    Memory never makes the request worse than none: when the system messages and the current
    turn alone exceed the budget the messages go as sent, without memory (note
    :data:`OVER_BUDGET`). The history is never cut to nothing unless the summary stands for it:
    such a cut forwards the conversation whole instead, leaving the memory block out if it does
    not fit beside (:data:`MEMORY_DROPPED`: the caller may offer a smaller one), and as sent,
    without memory, when even that does not fit (:data:`OVER_BUDGET`): the upstream then takes
    or refuses it as it would without Engram."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    msgs = list(messages)
    n = len(msgs)
    first = 1 if msgs and is_system(msgs[0]) else 0
    sizes = [count(m) for m in msgs]
    original = sum(sizes)
    earlier = {i: b for i, b in (laid or {}).items() if b and 0 <= i < n}
    if mode != "stable":
        earlier = {}
    own_sizes = list(sizes)
    for i, b in earlier.items():  # a message goes with its block: they cost as one
        sizes[i] += count_text(b) + 4
    laid_cost = sum(sizes) - original
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
    # System messages inside the history (Claude Code's environment) are the client's
    # instructions, not history: never aged out.
    history_systems = [i for i in range(first, cur) if is_system(msgs[i])]
    fixed = sum(sizes[:first]) + sum(sizes[i] for i in history_systems) + sum(sizes[cur:])
    notes: list[str] = []

    def as_sent() -> Assembly:
        sent = [
            Part("primacy" if i < first else "recency", "system" if i < first else "sent", i)
            for i in range(n)
        ]
        return Assembly(msgs, sent, False, 0, original, original, first, [OVER_BUDGET], own_sizes)

    if budget is not None and fixed > budget:  # nothing Engram could do makes it fit
        return as_sent()
    history = any(not is_system(msgs[i]) for i in range(first, cur))

    whole = budget is None or original + laid_cost + mem_cost <= whole_share * budget
    start = first
    if not whole:
        assert budget is not None
        start = _window_start(
            msgs, sizes, first, cur, history_systems, budget - fixed - mem_cost,
            count_text, summary, mode, previous_start,
        )  # fmt: skip
        kept_history = any(not is_system(msgs[i]) for i in range(start, cur))
        if history and not kept_history and not summary:
            # Nothing of the history would be left and nothing stands for it.
            if original + laid_cost + mem_cost <= budget:
                whole, start = True, first
            elif original + laid_cost <= budget:
                whole, start, memory_block, mem_cost = True, first, "", 0
                notes.append(MEMORY_DROPPED)
            elif original <= budget:  # not even the earlier blocks fit beside it
                whole, start, memory_block, mem_cost = True, first, "", 0
                earlier, sizes = {}, own_sizes
                notes.append(MEMORY_DROPPED)
            else:
                return as_sent()
    if whole or start == first:  # nothing aged (or everything fitted after all): no summary
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

    kept = [i for i in history_systems if i < start]
    kept += range(start, n)

    # The first block the window holds says the preamble; later ones go without it (a cut
    # that leaves the first block out is a move of the prefix anyway), and say what "derived"
    # means only where no block before them did.
    first_laid = min((i for i in kept if i in earlier), default=None)
    shown: dict[int, str] = {}
    derived_said = False
    for i in kept:
        if i in earlier:
            block = earlier[i] if i == first_laid else without_preamble(earlier[i], derived_said)
            derived_said = derived_said or says_derived(block)
            shown[i] = block

    def laid_again(i: int) -> Message:
        if i not in shown:
            return msgs[i]
        return known(with_leading_text(msgs[i], shown[i]), sizes[i])

    window: list[tuple[Message, str, int | None]] = [
        (laid_again(i), "system" if is_system(msgs[i]) else "recent" if i < cur else "current", i)
        for i in kept
    ]
    if summary:
        block = summary_text(summary)
        w = next((k for k, (m, _, _) in enumerate(window) if not is_system(m)), len(window))
        if w < len(window) and window[w][0].get("role") == "user":
            msg, label, index = window[w]
            window[w] = (with_leading_text(msg, block), "summary+" + label, index)
        else:
            window.insert(w, ({"role": "user", "content": block}, "summary", None))
    if memory_block and mode == "stable":
        target = last_user_index(msgs, cur)
        k = next((w for w, (_, _, index) in enumerate(window) if index == target), None)
        if k is not None and target is not None:
            if first_laid is not None:  # an earlier block in the window said the preamble
                memory_block = without_preamble(memory_block, derived_said)
                mem_cost = count_text(memory_block) + 4
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
    forwarded = [cost_of(m) for m in out]
    aged = sum(1 for i in range(first, start) if not is_system(msgs[i]))
    held = mem_cost if memory_block and any(p.refs for p in parts) else 0
    return Assembly(
        out,
        parts,
        not whole and start > first,
        aged,
        sum(forwarded),
        original,
        start,
        notes,
        forwarded,
        held,
    )


def _window_start(
    msgs: Sequence[Message],
    sizes: Sequence[int],
    first: int,
    cur: int,
    systems: Sequence[int],
    room: int,
    count_text: Callable[[str], int],
    summary: str | None,
    mode: str,
    previous_start: int | None,
) -> int:
    """Where the recent window begins: as many whole units before the current turn as fit in
    ``room`` (less the summary), never opening on a tool result, nor on anything but a user
    message unless the summary (a user message) opens the zone."""
    if summary:
        room -= count_text(summary_text(summary)) + 4
    skip = set(systems)  # already counted in the fixed part

    def cost(a: int, b: int) -> int:
        return sum(sizes[i] for i in range(a, b) if i not in skip)

    if (
        mode == "stable"
        and previous_start is not None
        and first < previous_start <= cur
        and cost(previous_start, cur) <= room
    ):
        start = previous_start  # the window still fits where it started: the prefix holds
    else:
        if mode == "stable":
            room = int(room * STABLE_REFILL)  # cut deeper, so later turns fit without a move
        start = cur
        for a, b in reversed(units(msgs, first, cur)):
            c = cost(a, b)
            if c > room:
                break
            room -= c
            start = a
    while start < cur and (
        msgs[start].get("role") in ("tool", "function")
        or is_system(msgs[start])
        or (not summary and msgs[start].get("role") != "user")
    ):
        start = next(b for a, b in units(msgs, start, cur) if a == start)
    return start
