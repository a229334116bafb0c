"""A prompt whose prefix never moves (DESIGN.md invariants 4 and 15), through a running Engram
with the real embedding model and a fake upstream that keeps a one-slot KV cache: each turn's
forwarded prompt extends the last byte for byte, a memory is laid once, before the message it
was recalled for, and stays there; a message that needs nothing gets nothing."""

from __future__ import annotations

import itertools
import json
import re
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from proxy.chat.fence import BLOCK_OPEN
from proxy.services import SERVICES
from testing.fake_chunks import template_violations
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, forwarded_memory, memory_blocks, settle, start_engram

pytestmark = pytest.mark.asyncio

REAL_MODEL = {"model": "engram/all-MiniLM-L6-v2-q8"}
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
EARLIER = [
    "My sister Marta lives in Porto and she breeds Siamese cats.",
    "The code of my garage door is 4711, and I keep forgetting it.",
    "Next month I fly to Kyoto for the cherry blossoms with my friend Jonas.",
]
CHAT = [
    "Good morning! I want to plan my week.",
    "On Monday I have a dentist appointment at nine.",
    "Which cat breed does my sister raise?",
    "Tuesday is free, maybe I go for a long run.",
    "thanks!",
    "On Wednesday I need to finish the quarterly report.",
    "ok",
    "Thursday evening I am cooking for friends.",
    "What should I cook for six people?",
    "thanks, that's all",
]


@pytest_asyncio.fixture
async def kv() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(kv_cache=True) as upstream:
        upstream.reply_text = lambda last: "Noted."  # no echo: a fact is stored once
        yield upstream


@pytest_asyncio.fixture
async def db() -> AsyncIterator[str]:
    with tempfile.TemporaryDirectory(prefix="engram-stable-") as tmp:
        yield str(Path(tmp) / "engram.db")


async def start(kv: FakeUpstream, db: str, **sections: dict[str, Any]) -> Engram:
    return await start_engram(kv.url, embedder=REAL_MODEL, memory={"db_path": db}, **sections)


async def send(
    http: aiohttp.ClientSession, engram: Engram, messages: list[dict[str, Any]], **extra: Any
) -> tuple[dict[str, Any], aiohttp.ClientResponse]:
    async with http.post(
        engram.url + "/v1/chat/completions",
        headers={"X-Engram-User": "alice"},
        json={"model": "m", "messages": messages, **extra},
    ) as r:
        assert r.status == 200, await r.text()
        return await r.json(), r


async def tell_earlier(http: aiohttp.ClientSession, engram: Engram) -> None:
    for text in EARLIER:
        await send(http, engram, [SYSTEM, {"role": "user", "content": text}])
    await settle(engram)


def extends(later: list[dict[str, Any]], earlier: list[dict[str, Any]]) -> bool:
    """Whether ``later`` starts with every message of ``earlier``, byte for byte as JSON."""
    return json.dumps(later[: len(earlier)]) == json.dumps(earlier)


async def test_each_turn_extends_the_last_and_a_memory_is_laid_once(
    kv: FakeUpstream, db: str, http: aiohttp.ClientSession
) -> None:
    engram = await start(kv, db)
    try:
        await tell_earlier(http, engram)
        messages: list[dict[str, Any]] = [SYSTEM]
        forwarded: list[list[dict[str, Any]]] = []
        counts: list[int] = []
        for text in CHAT:
            messages.append({"role": "user", "content": text})
            body, r = await send(http, engram, messages)
            counts.append(int(r.headers["X-Engram-Memories"].split(";")[0]))
            sent = kv.chat_requests()[-1].json()["messages"]
            assert not template_violations(sent)
            assert sent[0] == SYSTEM  # the system message byte-identical, nothing added to it
            forwarded.append(sent)
            messages.append(body["choices"][0]["message"])
            await settle(engram)
        for a, b in itertools.pairwise(forwarded):
            assert extends(b, a)  # the prefix never moved
        # The question about the sister got the fact, laid before it...
        asked = CHAT.index("Which cat breed does my sister raise?")
        assert counts[asked] >= 1
        assert "Siamese" in forwarded_memory([forwarded[asked][-1]])
        # ... still in front of the model at the last turn, shown there once, not injected again.
        last = forwarded[-1]
        assert sum("Siamese" in b for b in memory_blocks(last)) == 1
        assert "Siamese" in forwarded_memory([last[2 * asked + 1]])
        # Messages that need nothing got nothing.
        for i, text in enumerate(CHAT):
            if text in ("thanks!", "ok", "thanks, that's all"):
                assert counts[i] == 0, (text, counts)
        assert sum(counts) <= 6, counts
        # The model server reused the prefix: each later prompt computed only its new part.
        reports = [r.json() for r in kv.chat_requests()[-len(CHAT) :]]
        assert reports  # (the fake's cache is checked through its own replies below)
    finally:
        await engram.close()


async def test_the_fake_cache_computes_only_what_is_new(
    kv: FakeUpstream, db: str, http: aiohttp.ClientSession
) -> None:
    """What the model server reports: through Engram, turns 2..n compute about what a direct
    chat computes plus the memory newly laid, nothing of the prefix again."""
    engram = await start(kv, db)
    try:
        await tell_earlier(http, engram)
        messages: list[dict[str, Any]] = [SYSTEM]
        computed: list[int] = []
        reused: list[int] = []
        for text in CHAT[:6]:
            messages.append({"role": "user", "content": text})
            body, _ = await send(http, engram, messages)
            details = body["usage"]["prompt_tokens_details"]
            reused.append(details["cached_tokens"])
            computed.append(body["usage"]["prompt_tokens"] - details["cached_tokens"])
            messages.append(body["choices"][0]["message"])
            await settle(engram)
        assert all(r > 0 for r in reused[1:]), reused
        # each later turn reuses everything the turn before sent
        totals = [c + r for c, r in zip(computed, reused, strict=True)]
        for i in range(1, len(totals)):
            assert reused[i] >= totals[i - 1] - 1, (reused, totals)
    finally:
        await engram.close()


async def test_a_tool_loop_and_a_regenerated_reply_get_the_same_block(
    kv: FakeUpstream, db: str, http: aiohttp.ClientSession
) -> None:
    engram = await start(kv, db)
    try:
        await tell_earlier(http, engram)
        tools = [
            {
                "type": "function",
                "function": {"name": "calendar", "parameters": {"type": "object"}},
            }
        ]
        opening = [SYSTEM, {"role": "user", "content": "Let's sort out my travel plans."}]
        body, _ = await send(http, engram, opening, tools=tools)
        await settle(engram)
        ask = [
            *opening,
            body["choices"][0]["message"],
            {"role": "user", "content": "When do I fly to Kyoto with Jonas?"},
        ]
        _, r1 = await send(http, engram, ask, tools=tools)
        first = kv.chat_requests()[-1].json()["messages"]
        assert "Kyoto" in forwarded_memory(first)
        await settle(engram)
        # regenerate (the conversation forks there): the same prompt byte for byte, no search
        _, r2 = await send(http, engram, ask, tools=tools)
        assert kv.chat_requests()[-1].json()["messages"] == first
        assert r2.headers["X-Engram-Memories"] == r1.headers["X-Engram-Memories"]
        await settle(engram)
        loop = [
            *ask,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "calendar", "arguments": '{"month": "next"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "No entries next month."},
        ]
        await send(http, engram, loop, tools=tools)
        follow = kv.chat_requests()[-1].json()["messages"]
        assert extends(follow, first)
        assert follow[len(first) :] == loop[len(ask) :]
    finally:
        await engram.close()


async def test_a_restart_lays_the_same_blocks_and_forgetting_takes_a_memory_out(
    kv: FakeUpstream, db: str, http: aiohttp.ClientSession
) -> None:
    engram = await start(kv, db)
    messages: list[dict[str, Any]] = [
        SYSTEM,
        {"role": "user", "content": "What is the code of my garage door?"},
    ]
    try:
        await tell_earlier(http, engram)
        body, _ = await send(http, engram, messages)
        before = kv.chat_requests()[-1].json()["messages"]
        assert "4711" in forwarded_memory(before)
        messages.append(body["choices"][0]["message"])
        await settle(engram)
        store = engram.app[SERVICES].store
        turns = [
            t for s in await store.list_sessions("alice") for t in await store.session_turns(s.id)
        ]
        recalled = next(t for t in turns if "4711" in t.content and t.role == "user")
    finally:
        await engram.close()
    engram = await start(kv, db)  # another process on the same database
    try:
        messages.append({"role": "user", "content": "Fine. Tuesday I go running."})
        body, _ = await send(http, engram, messages)
        after = kv.chat_requests()[-1].json()["messages"]
        assert extends(after, before)
        messages.append(body["choices"][0]["message"])
        await settle(engram)
        async with http.delete(
            f"{engram.url}/engram/api/turns/{recalled.id}", headers={"X-Engram-User": "alice"}
        ) as r:
            assert r.status == 200, await r.text()
        messages.append({"role": "user", "content": "And on Wednesday I swim."})
        await send(http, engram, messages)
        forgotten = kv.chat_requests()[-1].json()["messages"]
        assert "4711" not in forwarded_memory(forgotten)
        assert BLOCK_OPEN not in json.dumps(forgotten[1])  # its block held only that memory
    finally:
        await engram.close()


YEARLESS_DAY = re.compile(r"^\d{1,2} [A-Z][a-z]{2}:$", re.MULTILINE)  # "5 Dec:"
DAY_WITH_YEAR = re.compile(r"^\d{1,2} [A-Z][a-z]{2} \d{4}:$", re.MULTILINE)  # "5 Dec 2025:"


async def test_a_block_laid_again_keeps_the_year_it_was_laid_in(
    kv: FakeUpstream, db: str, http: aiohttp.ClientSession
) -> None:
    engram = await start(kv, db)
    asked = {"role": "user", "content": "What is the code of my garage door?"}
    messages: list[dict[str, Any]] = [SYSTEM, asked]
    try:
        await tell_earlier(http, engram)
        body, _ = await send(http, engram, messages)
        block = forwarded_memory(kv.chat_requests()[-1].json()["messages"])
        assert "4711" in block and YEARLESS_DAY.search(block) and not DAY_WITH_YEAR.search(block)
        messages.append(body["choices"][0]["message"])
        await settle(engram)

        def a_year_ago(c: Any) -> None:  # the memories said and the block laid a year ago
            c.execute("UPDATE turns SET timestamp = timestamp - 366 * 86400")
            c.execute("UPDATE prompt_blocks SET created_at = created_at - 366 * 86400")

        await engram.app[SERVICES].store.write(a_year_ago)
    finally:
        await engram.close()
    engram = await start(kv, db)
    try:
        messages.append({"role": "user", "content": "Fine. Tuesday I go running."})
        await send(http, engram, messages)
        again = forwarded_memory(kv.chat_requests()[-1].json()["messages"][:2])
        assert "4711" in again and YEARLESS_DAY.search(again) and not DAY_WITH_YEAR.search(again)
        # a block laid now, in a new conversation, names that year
        await send(http, engram, [SYSTEM, {"role": "user", "content": "My garage door code?"}])
        fresh = forwarded_memory(kv.chat_requests()[-1].json()["messages"])
        assert "4711" in fresh and DAY_WITH_YEAR.search(fresh), fresh
    finally:
        await engram.close()


async def test_tool_outputs_stay_raw_until_the_prompt_fills_then_go_at_once(
    kv: FakeUpstream, db: str, http: aiohttp.ClientSession
) -> None:
    """slots.replace = when-full (the default): an agent loop's bulky outputs stay as sent while
    the conversation fits (each request extends the last), and become references all at once
    when it no longer does."""
    kv.n_ctx = 4096
    engram = await start(kv, db, slots={"replace": "when-full", "min_tokens": 200})
    try:
        messages: list[dict[str, Any]] = [
            SYSTEM,
            {"role": "user", "content": "Read the files and tell me what they do."},
        ]
        sent: list[list[dict[str, Any]]] = []
        for i in range(12):
            call = {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"f{i}.py"})},
            }
            listing = "\n".join(f"def f_{i}_{n}(x): return x * {n}" for n in range(60))
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": listing},
            ]
            await send(http, engram, messages)
            sent.append(kv.chat_requests()[-1].json()["messages"])
            await settle(engram)
            if i % 3 == 2:  # a new user turn now and then: earlier outputs become old
                messages += [
                    {"role": "assistant", "content": f"Read {i + 1} files."},
                    {"role": "user", "content": "Go on with the next ones."},
                ]
        refs = ["[TOOL_RESULT:" in json.dumps(s) for s in sent]
        assert not refs[0] and refs[-1], refs  # raw at first, references once full
        first = refs.index(True)
        assert all(refs[first:]), refs  # and from then on
        for a, b in itertools.pairwise(sent[:first]):
            assert extends(b, a)  # until then, each request extended the last
    finally:
        await engram.close()


async def test_a_tool_loop_from_the_first_message_keeps_its_block(
    kv: FakeUpstream, db: str, http: aiohttp.ClientSession
) -> None:
    """An agent's first message starts a tool loop; its calls were stored otherwise (here: the
    fake's reply is not the call the client sends on), so Engram places the follow-up in a new
    session, and the first message's block is laid again all the same. The same question sent
    alone again, as a new conversation, is decided afresh."""
    engram = await start(kv, db)
    try:
        await tell_earlier(http, engram)
        ask = [SYSTEM, {"role": "user", "content": "Which cat breed does my sister raise?"}]
        _, r1 = await send(http, engram, ask)
        first = kv.chat_requests()[-1].json()["messages"]
        assert "Siamese" in forwarded_memory(first)
        await settle(engram)
        call = {"id": "c1", "type": "function", "function": {"name": "notes", "arguments": "{}"}}
        loop = [
            *ask,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "(no notes)"},
        ]
        _, r2 = await send(http, engram, loop)
        follow = kv.chat_requests()[-1].json()["messages"]
        assert r2.headers["X-Engram-Session"] != r1.headers["X-Engram-Session"]  # (a fork)
        assert extends(follow, first)
    finally:
        await engram.close()


async def test_a_conversation_that_fits_goes_whole_and_memory_takes_the_room_left(
    kv: FakeUpstream, db: str, http: aiohttp.ClientSession
) -> None:
    """A cut moves the prefix: mode stable cuts only a conversation that no longer fits (zones
    starts rewriting at prompt.whole_share, 80 %, and kept the memory's whole room free), and a
    memory block takes what room the conversation leaves."""
    kv.n_ctx = 4096
    engram = await start(kv, db)
    try:
        await tell_earlier(http, engram)
        messages: list[dict[str, Any]] = [SYSTEM]
        forwarded: list[list[dict[str, Any]]] = []
        filler = "We talked about the garden, the weather and the new fence next door. " * 5
        question = "Which cat breed does my sister raise?"
        asked = cut = None
        for i in range(60):
            share = 0.0
            if forwarded:
                mt = engram.turns[-1].memory
                assert mt is not None and mt.budget and mt.assembly is not None
                share = mt.assembly.tokens / mt.budget
            text = question if asked is None and share > 0.85 else f"Note {i}. {filler}"
            messages.append({"role": "user", "content": text})
            body, r = await send(http, engram, messages, max_tokens=256)
            mt = engram.turns[-1].memory
            assert mt is not None and mt.budget and mt.assembly is not None
            sent = kv.chat_requests()[-1].json()["messages"]
            if mt.assembly.rewritten:
                cut = mt.assembly
                break
            if text == question:
                asked = len(forwarded)
                assert int(r.headers["X-Engram-Memories"].split(";")[0]) >= 1
                assert "Siamese" in forwarded_memory([sent[-1]])
            forwarded.append(sent)
            messages.append(body["choices"][0]["message"])
            await settle(engram)
        assert asked is not None and cut is not None
        for a, b in itertools.pairwise(forwarded):
            assert extends(b, a)  # whole, and the block laid within, until it no longer fit
        mt = engram.turns[-1].memory
        assert mt is not None and mt.budget is not None
        # the cut came when the conversation and its laid block no longer fitted, not before
        last_whole = engram.turns[-2].memory
        assert last_whole is not None and last_whole.assembly is not None
        assert last_whole.assembly.tokens > 0.9 * mt.budget
        assert cut.tokens <= mt.budget
        # past the cut the window leaves the memory its room again
        messages += [
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "What is the code of my garage door?"},
        ]
        _, r = await send(http, engram, messages, max_tokens=256)
        sent = kv.chat_requests()[-1].json()["messages"]
        assert int(r.headers["X-Engram-Memories"].split(";")[0]) >= 1
        assert "4711" in forwarded_memory([sent[-1]])
        mt = engram.turns[-1].memory
        assert mt is not None and mt.assembly is not None and mt.assembly.rewritten
    finally:
        await engram.close()


async def test_a_chats_statements_get_no_memory_that_only_sounds_like_a_chat(
    kv: FakeUpstream, db: str, http: aiohttp.ClientSession
) -> None:
    """In a chat app's archive every turn of the user is embedded as "user: …", and on short
    texts that start alone makes much of the cosine (bench.prefix's chats drew the user's
    "let's keep it simple" for "Okay, let's keep going."): a memory must be closer to the
    message than an empty turn of its speaker, and a statement's must share a word with it."""
    engram = await start(kv, db)
    try:
        for text in (
            "I'm a bit tired today, so let's keep it simple.",
            "My favourite dish is bibimbap, I could eat it every day.",
            "I usually cook it on Thursday evenings.",
            "We adopted a cat last week! We called it Ziggy.",
        ):
            await send(http, engram, [SYSTEM, {"role": "user", "content": text}])
        await settle(engram)
        got: dict[str, str] = {}
        for text in (
            "Okay, let's keep going.",
            "For Wednesday, suggest a dinner I can make in twenty minutes.",
            "Which dish did I say was my favourite?",
        ):
            await send(http, engram, [SYSTEM, {"role": "user", "content": text}])
            got[text] = forwarded_memory(kv.chat_requests()[-1].json()["messages"])
        assert got["Okay, let's keep going."] == ""
        assert got["For Wednesday, suggest a dinner I can make in twenty minutes."] == ""
        recalled = got["Which dish did I say was my favourite?"]
        assert "bibimbap" in recalled and "Ziggy" not in recalled
    finally:
        await engram.close()
