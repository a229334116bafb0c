"""What was said: a conversation as its people's words, to recognise it when a client resends
its history otherwise than it sent it (pure).

The chain over the messages as sent (:func:`proxy.messages.chain_hashes`) recognises a
conversation resent with one more turn. Some clients resend theirs changed: Qwen Code's
``--continue`` drops the date reminder from the first message; aider puts its file-context
exchange after the history every turn (so each request moves it), and ``--restore-chat-history``
sends the history file's text: no instructions after the user's messages, white space changed.
The *said* chain covers only what people said, so it stays the same through all of that:

- system and developer messages say nothing;
- a user message says its words (:func:`proxy.scaffold.split`: reminder, environment and
  instruction blocks, and whole messages a client writes in the user's place, left out), with
  its white space collapsed; a message of no words says nothing, and the replies to context a
  client wrote in the user's place say nothing either (aider's example exchange, its "Ok." to
  each file-context message: :func:`client_reply`, archived as scaffolding); a reply to a
  retry or a hand-over is the model's work and says what it says;
- an assistant message says its text (white space collapsed) and its tool calls, a tool message
  its call id and output.

``said_chain(messages)[i]`` is the hash over every said message through ``i`` (None where message
``i`` says nothing), so a conversation's said hashes are its prefixes, as with the chain as sent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy import scaffold
from proxy.messages import content_text


@dataclass(frozen=True, slots=True)
class Said:
    """Where a said chain stands after some messages: its last hash ("" before any said
    message), and whether the last user message was context a client wrote in the user's place
    (its replies say nothing either)."""

    last: str = ""
    quiet: bool = False


def _calls(message: Mapping[str, Any]) -> list[Any]:
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return []
    out: list[Any] = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping):
            out.append([fn.get("name"), fn.get("arguments")])
    return out


def said_key(message: Mapping[str, Any], quiet: bool) -> tuple[str | None, bool]:
    """What ``message`` says, as text to hash (None: nothing), and whether the replies after
    it say nothing (``quiet``: the user message they answer was a client's own context)."""
    role = message.get("role")
    if role in scaffold.SYSTEM_ROLES:
        return None, quiet
    text = content_text(message.get("content"))
    if role == "user":
        cut = scaffold.split("user", text) if text else scaffold.Split("")
        words = " ".join(cut.words.split())
        if not words:
            return None, any(p.kind == "context" for p in cut.pieces)
        return json.dumps({"r": "user", "c": words}, ensure_ascii=False), False
    if quiet:
        return None, True
    data: dict[str, Any] = {"r": role, "c": " ".join(text.split())}
    calls = _calls(message)
    if calls:
        data["t"] = calls
    if isinstance(message.get("tool_call_id"), str):
        data["id"] = message["tool_call_id"]
    if not data["c"] and len(data) == 2:
        return None, quiet
    return json.dumps(data, ensure_ascii=False, sort_keys=True), False


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def step(state: Said, message: Mapping[str, Any]) -> tuple[Said, str | None]:
    """The state after ``message``, and its said hash (None: it says nothing)."""
    key, quiet = said_key(message, state.quiet)
    if key is None:
        return Said(state.last, quiet), None
    last = _digest(state.last + key)
    return Said(last, quiet), last


def said_chain(
    messages: Sequence[Mapping[str, Any]], state: Said | None = None
) -> tuple[list[str | None], Said]:
    """Each message's said hash (None where it says nothing), and the state after the last."""
    state = state or Said()
    out: list[str | None] = []
    for message in messages:
        state, h = step(state, message)
        out.append(h)
    return out, state


def client_reply(message: Mapping[str, Any], said_hash: str | None) -> bool:
    """Whether ``message``, whose said hash is ``said_hash``, is a reply to context a client
    wrote in the user's place (the client's, archived as scaffolding): an assistant message
    that says nothing."""
    return said_hash is None and message.get("role") == "assistant"


def said_anchor(messages: Sequence[Mapping[str, Any]], said: Sequence[str | None]) -> int | None:
    """The index of the first assistant message that says something: a match by what was said
    must reach it (two conversations both opening with "hi" are not one), None when there is
    none."""
    for i, (message, h) in enumerate(zip(messages, said, strict=True)):
        if h is not None and message.get("role") == "assistant":
            return i
    return None


def unmatched_history(messages: Sequence[Mapping[str, Any]], matched: int) -> bool:
    """Whether the messages after the first ``matched`` hold a reply: history that the chain as
    sent did not find stored (the case for matching by what was said)."""
    return any(m.get("role") == "assistant" for m in messages[matched:])
