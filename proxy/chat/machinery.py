"""A client's machinery told from its user by what a request is, not by its wording.

Chat apps send requests of their own beside the user's turns: a title for the chat, tags,
follow-up suggestions, search queries, autocompletion. Each asks the model about a conversation
by quoting it, its latest turns verbatim, inside one message of a request that carries no
conversation of its own (no reply in it). A person's turn does not: a conversation's next turn
carries the conversation as messages, and a new chat's first message is the person's words.
So a single-shot request (no reply among its messages) whose message quotes the latest turns
of a conversation the same user is having now (its last exchange, the user's words and the
model's reply both, verbatim) is about that conversation: forwarded as sent, no memory, not
archived, placed in no session (:meth:`proxy.chat.memory.MemoryService.before_forward`).

The known prompt texts of :mod:`proxy.clients` stay as a second line (a title asked for a chat
before anything of it is stored, autocompletion of a first message), and users add their own
(``memory.housekeeping_patterns``).

Why this does not catch a person: it needs the model's own reply, verbatim, next to the
person's words of the same exchange, in a new single message, within the hour the conversation
was live. Pasting a document twice quotes no reply; a person who pastes the last exchange of a
live chat into a new one repeats words Engram has stored already (in the conversation quoted).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.messages import content_text

LIVE_S = 3600.0
"""A conversation last active this long ago is still live: its latest turns may be quoted."""
MAX_SESSIONS = 8
"""How many of the user's most recently active conversations are checked."""
RECENT_TURNS = 4
"""How many of a conversation's latest turns (user and assistant) are looked for."""
PROBE_CHARS = 160
"""How much of each turn's start is looked for (clients cut long turns when they quote them;
a reply is also looked for by its end)."""
MIN_USER_CHARS = 2
"""The user's message of the exchange is looked for if it has this much (after folding)."""
MIN_REPLY_CHARS = 16
"""The reply must have this much to count (a bare "Sure!" could be anyone's words)."""
MAX_TEXT_CHARS = 200_000
"""How much of the request's message is searched."""


def single_shot(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the request carries no conversation of its own: no reply, one user message."""
    roles = [m.get("role") for m in messages]
    return "assistant" not in roles and "tool" not in roles and roles.count("user") == 1


def fold(text: str) -> str:
    """The text with every run of white space one space (quoting re-wraps lines)."""
    return " ".join(text.split())


def request_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The single-shot request's words as searched: its user message, folded."""
    for m in messages:
        if m.get("role") == "user":
            return fold(content_text(m.get("content"))[:MAX_TEXT_CHARS])
    return ""


def quotes(text: str, turns: Sequence[tuple[str, str]]) -> bool:
    """Whether ``text`` (folded) quotes a conversation whose latest ``turns`` are these
    ((role, content), newest first): its last user message and its last reply both, each found
    by its start."""
    last: dict[str, str] = {}
    for role, content in turns[:RECENT_TURNS]:
        if role in ("user", "assistant") and role not in last:
            last[role] = content
    if len(last) < 2:
        return False
    said = fold(last["user"])
    for role, content in last.items():
        least = MIN_REPLY_CHARS if role == "assistant" else MIN_USER_CHARS
        probes = [said[:PROBE_CHARS]]
        if role == "assistant":  # the model's own words: not a part that repeats the user's
            probes = [p for p in _probes(content) if p not in said]
        if not any(len(p) >= least and p in text for p in probes):
            return False
    return True


# A block a model opens its reply with and a chat app leaves out of the history it quotes
# (Open WebUI drops <details> blocks, which is what it makes of <think> and <reasoning>).
_CLOSED_BLOCK = re.compile(r"</[A-Za-z][\w:-]*>")


def _probes(reply: str) -> list[str]:
    """Where a quoted reply is looked for: its start, its end (a quote cut in the middle keeps
    both), and the end of what follows its last closed tag (a reasoning block left out)."""
    folded = fold(reply)
    out = [folded[:PROBE_CHARS], folded[-PROBE_CHARS:]]
    tags = list(_CLOSED_BLOCK.finditer(folded))
    if tags:
        out.append(folded[tags[-1].end() :].strip()[-PROBE_CHARS:])
    return out


def quotes_any(text: str, conversations: Sequence[Sequence[tuple[str, str]]]) -> bool:
    """Whether ``text`` quotes any of these live conversations (see :func:`quotes`)."""
    return bool(text) and any(quotes(text, turns) for turns in conversations)
