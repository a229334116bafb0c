"""Conversations a client resends otherwise than it sent them (issue 38): found by what was said.

aider moves its file-context exchange after the history on every request, and restores a chat
from its history file without the instructions it sent; Qwen Code's ``--continue`` drops the date
reminder from the first message. The chain over the messages as sent finds none of them; the
chain over what was said (:mod:`proxy.said`) does: one session, every message stored once. What
was said otherwise (an edit) is still a conversation of its own, storing only what differs.
The requests are aider's and Qwen Code's own, as recorded (``tests/data/clients``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.services import SERVICES
from proxy.store import queries
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, settle, turns_as_sent
from tests.proxy.test_fast_clients import send

CLIENTS = Path(__file__).resolve().parents[1] / "data" / "clients"


def recorded(client: str, run: str, system: str) -> list[dict[str, Any]]:
    """The messages of the first request of ``run`` through Engram whose system message starts
    with ``system``."""
    with (CLIENTS / client).open() as f:
        for line in f:
            rec = json.loads(line)
            msgs = (rec.get("body") or {}).get("messages") or []
            head = json.dumps(msgs[0].get("content")) if msgs else ""
            if rec["via"] == "engram" and rec["run"] == run and system in head:
                return list(msgs)
    raise AssertionError(f"no {run!r} request in {client}")


def echo(last: str) -> str:
    """The fake model's reply: what was typed (aider's instructions after it left out)."""
    return "echo: " + last.split("\n\nTo suggest changes")[0]


AIDER = "aider-0.86.2.jsonl"
QWEN = "qwen-0.24.4.jsonl"


def aider_request(
    done: list[tuple[str, str]], typed: str, first: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A request as aider 0.86 lays it: its system message and example exchange, the chat so far
    (``done``), its file-context exchange, then the message typed with its instructions."""
    preamble, context, last = first[:5], first[5:7], first[-1]["content"]
    instructions = last[last.index("\n\nTo suggest changes") :]
    history = [
        {"role": role, "content": text}
        for said, reply in done
        for role, text in (("user", said), ("assistant", reply))
    ]
    return [*preamble, *history, *context, {"role": "user", "content": typed + instructions}]


async def said_in(engram: Engram, user: str) -> dict[str, list[str]]:
    """What each of the user's sessions holds that someone said (the words of user and
    assistant turns), in order."""
    await settle(engram)
    store = engram.app[SERVICES].store
    assert store is not None
    out: dict[str, list[str]] = {}
    for session in await store.list_sessions(user):
        turns = await store.read(lambda c, sid=session.id: queries.session_turns(c, sid))
        out[session.id] = [t.content for t in turns if t.role != "system" and t.content]
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("named", [False, True], ids=["by-messages", "named"])
async def test_aider_in_one_process_is_one_session_each_message_stored_once(
    engram: Engram, http: aiohttp.ClientSession, fake: FakeUpstream, named: bool
) -> None:
    fake.reply_text = echo
    first = recorded(AIDER, "2 new: the question", "Act as an expert")
    headers = {"X-Engram-User": "aider"} | ({"X-Engram-Session": "work"} if named else {})
    done: list[tuple[str, str]] = []
    seen = []
    for typed in ("What is my cat called?", "And what colour is she?", "She likes boxes."):
        reply, sid = await send(http, engram, aider_request(done, typed, first), headers, False)
        done.append((typed, reply))
        seen.append(sid)
    assert len(set(seen)) == 1, seen
    held = await said_in(engram, "aider")
    assert list(held) == [seen[0]] if not named else len(held) == 1, held
    words = next(iter(held.values()))
    # The chat, each message once; aider's example exchange and its "Ok." to its file context
    # are its own, replies included (stored as scaffolding: no words).
    typed_and_replies = [w.strip() for w in words]
    assert typed_and_replies == [
        "What is my cat called?",
        "echo: What is my cat called?",
        "And what colour is she?",
        "echo: And what colour is she?",
        "She likes boxes.",
        "echo: She likes boxes.",
    ], words
    # Its file-context exchange, moved after the history each turn, is stored once.
    turns = await turns_as_sent(engram, seen[0])
    assert sum("I am not sharing any files" in t.content for t in turns) == 1
    assert sum(t.content.startswith("Ok, I will:") for t in turns) == 1  # as sent, still
    positions = [t.position for t in turns]
    assert positions == list(range(len(turns))), positions


@pytest.mark.asyncio
async def test_aider_restoring_its_history_file_continues_the_session(
    engram: Engram, http: aiohttp.ClientSession, fake: FakeUpstream
) -> None:
    """``--restore-chat-history``: the history file's text (no instructions, the reply's white
    space changed) finds the conversation it came from."""
    fake.reply_text = echo
    first = recorded(AIDER, "2 new: the question", "Act as an expert")
    headers = {"X-Engram-User": "aider"}
    _, sid = await send(http, engram, first, headers, False)
    restored = recorded(AIDER, "3 continue", "Act as an expert")
    assert restored[5]["content"] == "What is my cat called?  \n"  # as the history file has it
    _, again = await send(http, engram, restored, headers, False)
    assert again == sid
    held = await said_in(engram, "aider")
    assert len(held) == 1
    assert sum("What is my cat called?" in w for w in held[sid] if "echo" not in w) == 1


@pytest.mark.asyncio
async def test_qwen_continue_without_its_date_reminder_continues_the_session(
    engram: Engram, http: aiohttp.ClientSession, fake: FakeUpstream
) -> None:
    fake.reply_text = lambda last: "echo: " + last.rsplit("</system-reminder>", 1)[-1].strip()
    first = recorded(QWEN, "2 new: the question", "You are Qwen Code")
    headers = {"X-Engram-User": "qwen"}
    _, sid = await send(http, engram, first, headers, False)
    resumed = recorded(QWEN, "3 continue", "You are Qwen Code")
    assert len(resumed[1]["content"]) == len(first[1]["content"]) - 1  # no date reminder
    _, again = await send(http, engram, resumed, headers, False)
    assert again == sid
    held = await said_in(engram, "qwen")
    assert list(held) == [sid]
    assert [w.strip() for w in held[sid]] == [
        "What is my cat called?",
        "echo: What is my cat called?",
        "And what colour is she?",
        "echo: And what colour is she?",
    ]


@pytest.mark.asyncio
async def test_what_was_said_otherwise_is_a_conversation_of_its_own_storing_what_differs(
    engram: Engram, http: aiohttp.ClientSession, fake: FakeUpstream
) -> None:
    """An edited message in aider's layout: a session of its own from there (the messages
    before it are not stored again); a conversation whose first message said something else
    is not joined to anything."""
    fake.reply_text = echo
    first = recorded(AIDER, "2 new: the question", "Act as an expert")
    headers = {"X-Engram-User": "aider"}
    done: list[tuple[str, str]] = []
    for typed in ("What is my cat called?", "And what colour is she?"):
        reply, sid = await send(http, engram, aider_request(done, typed, first), headers, False)
        done.append((typed, reply))
    edited = aider_request(done[:1], "And how old is she?", first)
    _, fork = await send(http, engram, edited, headers, False)
    other = aider_request([("What is my dog called?", "echo: Rex")], "Is he old?", first)
    _, new = await send(http, engram, other, headers, False)
    assert len({sid, fork, new}) == 3
    held = await said_in(engram, "aider")
    assert [w.strip() for w in held[fork]] == ["And how old is she?", "echo: And how old is she?"]
    assert "What is my cat called?" in [w.strip() for w in held[sid]]
    assert "What is my dog called?" in held[new]


@pytest.mark.asyncio
async def test_a_system_prompt_that_changed_overnight_keeps_the_conversation(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    """A client whose system prompt carries the date, resuming a chat the next day; a chat
    that opens alike but whose first reply differs stays a conversation of its own."""
    headers = {"X-Engram-User": "dated"}
    friday = {"role": "system", "content": "You are helpful. Today is Friday."}
    saturday = {"role": "system", "content": "You are helpful. Today is Saturday."}
    opening = {"role": "user", "content": "My sister lives in Porto."}
    reply, sid = await send(http, engram, [friday, opening], headers, False)
    history = [opening, {"role": "assistant", "content": reply}]
    ask = {"role": "user", "content": "Where does she live?"}
    _, again = await send(http, engram, [saturday, *history, ask], headers, False)
    assert again == sid
    other = [opening, {"role": "assistant", "content": "Lovely city!"}, ask]
    _, apart = await send(http, engram, [saturday, *other], headers, False)
    assert apart != sid
    held = await said_in(engram, "dated")
    assert held[sid] == [opening["content"], reply, ask["content"], f"echo: {ask['content']}"]
    assert held[apart] == [opening["content"], "Lovely city!", ask["content"], held[sid][-1]]


@pytest.mark.asyncio
async def test_a_reply_to_a_retry_is_stored_when_placed_by_what_was_said(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    """Resent otherwise with a retry and the model's continuation in its history: the
    continuation is the model's work and is stored; the retry, the client's, is not."""
    headers = {"X-Engram-User": "retried"}
    system = {"role": "system", "content": "You are helpful. Today is Friday."}
    opening = {"role": "user", "content": "Tell me about Porto."}
    reply, sid = await send(http, engram, [system, opening], headers, False)
    resent = [
        {"role": "system", "content": "You are helpful. Today is Saturday."},
        opening,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Continue from where you left off."},
        {"role": "assistant", "content": "Its bridges are famous too."},
        {"role": "user", "content": "And its food?"},
    ]
    _, again = await send(http, engram, resent, headers, False)
    assert again == sid
    held = await said_in(engram, "retried")
    assert held[sid][2:] == ["Its bridges are famous too.", "And its food?", "echo: And its food?"]
