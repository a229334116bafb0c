"""Limits and backpressure (issue 12, row 7), through the real proxy and the fake upstream.

Before: one request of 4,001 messages, then another user's small request: the small one waited
55 s (one embedder thread shared by queries and archive batches, no bound on indexing, recall
waiting for its query vector without a deadline, no cap on a request or a user). Here: a small
request beside a big one stays fast (the real MiniLM embedder, a real backlog), each cap of
``[limits]`` does what its setting says, recall keeps to its deadline and says so in
``X-Engram-Memories``.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import random
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from proxy.limits import cut_note
from proxy.services import SERVICES
from proxy.slots.refs import REFERENCE
from proxy.store import indexing
from proxy.store.quota import user_turn_count
from testing.conversations import WORDS, long_conversation
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, forwarded_memory, settle, start_engram, turns_as_sent

pytestmark = pytest.mark.asyncio

REAL_MODEL = {"model": "engram/all-MiniLM-L6-v2-q8"}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


async def post(
    http: aiohttp.ClientSession,
    engram: Engram,
    user: str,
    messages: list[dict[str, Any]],
    timeout: float = 60.0,
    **headers: str,
) -> tuple[int, float, dict[str, str]]:
    """Status, seconds and response headers of one chat request."""
    t0 = time.perf_counter()
    body = json.dumps({"model": "m", "messages": messages}).encode()
    async with http.post(
        engram.url + "/v1/chat/completions",
        data=io.BytesIO(body),  # a big body as bytes makes aiohttp warn
        headers={"X-Engram-User": user, "Content-Type": "application/json", **headers},
        timeout=aiohttp.ClientTimeout(total=timeout),
    ) as r:
        await r.read()
        return r.status, time.perf_counter() - t0, dict(r.headers)


def memories(headers: dict[str, str]) -> tuple[int, str | None]:
    """X-Engram-Memories as (count, note): the count leads, as it always did."""
    value = headers["X-Engram-Memories"]
    count = int(value.split(";")[0])
    note = value.split(";", 1)[1].strip() if ";" in value else None
    return count, note


class LogRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def count(self, text: str) -> int:
        return sum(1 for r in self.records if text in r.getMessage())


@pytest.fixture
def logs() -> Iterator[LogRecords]:
    logger = logging.getLogger("engram")
    handler, level = LogRecords(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


async def user_turns(engram: Engram, user: str) -> int:
    store = engram.app[SERVICES].store
    return await store.read(lambda c: user_turn_count(c, user))


# --- backpressure -------------------------------------------------------------------------------


async def test_a_small_request_beside_a_4001_message_one_is_not_held_up(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """The issue's probe, uncapped (max_messages 0), so the big request is archived and its
    4,001 turns go through indexing and the real embedder: other users' small requests, sent
    right after it and while its turns are being embedded, each answer within 2 s (they took
    55 s): their query embeddings have a lane of their own, indexing is chunked."""
    engram = await start_engram(
        fake.url,
        embedder=REAL_MODEL,
        limits={"max_messages": 0, "recall_deadline": 0.5},
        server={"shutdown_timeout": 1.0},
    )
    try:
        status, alone, _ = await post(http, engram, "warm", [{"role": "user", "content": "hi"}])
        assert status == 200
        big = long_conversation(4001)
        assert len(json.dumps(big)) > 1_400_000
        status, took, _ = await post(http, engram, "big", big)
        assert status == 200
        # The big request's rows are committed with its reply (only indexing waits).
        assert await user_turns(engram, "big") == len(big) + 1
        waits = []
        for i, delay in enumerate((0.0, 0.3, 0.5, 1.0)):
            await asyncio.sleep(delay)
            question = [{"role": "user", "content": f"question {i} about the {WORDS[i]} river"}]
            status, took, headers = await post(http, engram, f"small{i}", question, timeout=10)
            assert status == 200
            memories(headers)  # the header still parses
            waits.append(took)
        indexer = engram.app[SERVICES].require_memory().memory.indexer
        assert indexer is not None and indexer.queued > 0, "the backlog was gone: no pressure"
        print(f"\nsmall request alone {alone * 1000:.0f} ms, beside the big one (s): {waits}")
        assert max(waits) < 2.0, waits
    finally:
        await engram.close()


async def test_a_small_commit_is_indexed_between_chunks_of_a_big_one(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """A 1,001-turn commit, then a small one of another user: the small one is searchable
    while most of the big one still waits (before, the big one's full-text rows were written in
    one transaction that the small one waited behind)."""
    engram = await start_engram(fake.url, limits={"max_messages": 0})
    try:
        store = engram.app[SERVICES].store
        assert (await post(http, engram, "big", long_conversation(1000, chars=200)))[0] == 200
        status, _, headers = await post(
            http, engram, "small", [{"role": "user", "content": "a lighthouse keeper"}]
        )
        assert status == 200
        small = {t.id for t in await store.session_turns(headers["X-Engram-Session"])}
        for _ in range(2000):
            pending = set(await store.read(lambda c: indexing.pending_index_ids(c, 5000)))
            if not small & pending:
                break
            await asyncio.sleep(0.002)
        assert not small & pending
        assert len(pending) > 500, f"only {len(pending)} big turns left when the small was done"
        await settle(engram, timeout=60)
    finally:
        await engram.close()


async def test_turns_past_the_indexing_queue_are_deferred_then_caught_up(
    fake: FakeUpstream, http: aiohttp.ClientSession, logs: LogRecords
) -> None:
    engram = await start_engram(fake.url, limits={"index_queue_turns": 8})
    try:
        msgs = long_conversation(20, chars=60)
        msgs[5]["content"] += " zebracorn"  # past the bound: deferred, then found
        assert (await post(http, engram, "u", msgs))[0] == 200
        services = engram.app[SERVICES]
        indexer = services.require_memory().memory.indexer
        assert indexer is not None
        await settle(engram)
        assert indexer.deferred == len(msgs) + 1 - 8
        assert logs.count("indexing queue full") == 1
        store = services.store
        assert await store.read(lambda c: indexing.pending_index_ids(c, 100)) == []
        assert await store.turns_without_vectors(None, 100) == []
        async with http.get(
            f"{engram.url}/engram/api/search", params={"q": "zebracorn", "user": "u"}
        ) as r:
            assert r.status == 200
            found = (await r.json())["results"]
        assert found and "zebracorn" in found[0]["content"]
    finally:
        await engram.close()


# --- caps ---------------------------------------------------------------------------------------


async def test_a_request_over_max_messages_goes_as_sent_without_memory(
    fake: FakeUpstream, http: aiohttp.ClientSession, logs: LogRecords
) -> None:
    engram = await start_engram(fake.url, limits={"max_messages": 5})
    try:
        msgs = long_conversation(7, chars=40)
        raw = json.dumps({"model": "m", "messages": msgs}).encode()
        for _ in range(2):
            async with http.post(
                engram.url + "/v1/chat/completions",
                data=raw,
                headers={"X-Engram-User": "long", "Content-Type": "application/json"},
            ) as r:
                assert r.status == 200
                assert r.headers["X-Engram-Memories"] == "0; too-many-messages"
            assert fake.chat_requests()[-1].body == raw  # byte-identical, as with memory off
        await settle(engram)
        assert await user_turns(engram, "long") == 0
        assert logs.count("over limits.max_messages") == 1  # once per user per interval
        # At the cap, memory works as always.
        status, _, headers = await post(http, engram, "long", msgs[:5])
        assert status == 200 and memories(headers)[1] is None
        await settle(engram)
        assert await user_turns(engram, "long") == 6
        async with http.get(f"{engram.url}/engram/metrics") as r:
            assert "engram_too_many_messages_total 2" in await r.text()
    finally:
        await engram.close()


async def test_a_message_past_max_message_bytes_is_stored_cut_and_forwarded_whole(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await start_engram(fake.url, limits={"max_message_bytes": 4096})
    try:
        secret = "sk-" + "Q7" * 20  # real keys hold digits (the rule checks for one)
        text = "é" * 2000 + "x" * 77 + " " + secret + " tail" * 2000  # the secret straddles the cut
        total = len(text.encode())
        msgs = [SYSTEM, {"role": "user", "content": text}]
        status, _, headers = await post(http, engram, "cut", msgs)
        assert status == 200
        assert fake.chat_requests()[-1].json()["messages"][-1]["content"] == text
        turns = await turns_as_sent(engram, headers["X-Engram-Session"])
        stored = turns[1].content
        assert stored.startswith("é" * 2000)
        assert "sk-Q7Q7" not in stored  # redaction read past the cut
        kept, note = stored.split("\n[…", 1)
        assert len(kept.encode()) <= 4096
        assert "\n[…" + note == cut_note(total, len(kept.encode()))
        assert turns[0].content == SYSTEM["content"]  # short ones whole
    finally:
        await engram.close()


async def test_a_user_over_max_turns_gets_replies_but_no_new_turns(
    fake: FakeUpstream, http: aiohttp.ClientSession, logs: LogRecords
) -> None:
    engram = await start_engram(fake.url, limits={"max_turns_per_user": 4})
    try:
        for i in range(4):
            question = [{"role": "user", "content": f"note number {i}"}]
            status, _, _ = await post(
                http, engram, "heavy", question, **{"X-Engram-Session": f"c{i}"}
            )
            assert status == 200
        await settle(engram)
        assert await user_turns(engram, "heavy") == 4  # two requests of two turns each
        assert logs.count("over limits.max_turns_per_user") == 1
        status, _, _ = await post(http, engram, "light", [{"role": "user", "content": "hello"}])
        await settle(engram)
        assert status == 200 and await user_turns(engram, "light") == 2
        async with http.get(f"{engram.url}/engram/metrics") as r:
            assert "engram_turns_over_cap_total 4" in await r.text()
    finally:
        await engram.close()


def tool_chat(outputs: list[str]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for i, out in enumerate(outputs):
        cid = f"call{i:05d}"
        call = {"name": "read_file", "arguments": json.dumps({"path": f"src/m{i}.py"})}
        msgs += [
            {"role": "user", "content": f"look at module {i}"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": cid, "type": "function", "function": call}],
            },
            {"role": "tool", "tool_call_id": cid, "content": out},
            {"role": "assistant", "content": f"Module {i} looks fine."},
        ]
    return [*msgs, {"role": "user", "content": "and now?"}]


def source(tag: str, lines: int) -> str:
    return "\n".join(f"{n:4d}  def {tag}_{n}(x): return x * {n}  # {tag}" for n in range(lines))


def slotted(fake: FakeUpstream) -> list[bool]:
    """For each tool message forwarded: was it replaced by a reference?"""
    sent = fake.chat_requests()[-1].json()["messages"]
    return [bool(REFERENCE.match(m["content"])) for m in sent if m["role"] == "tool"]


async def test_slot_caps_leave_outputs_raw() -> None:
    async with FakeUpstream(strict_templates=True, n_ctx=32768) as fake:
        small, large = source("a", 80), source("b", 140)
        assert len(small) < 4096 < len(large)
        engram = await start_engram(fake.url, limits={"max_slot_bytes": 4096})
        try:
            async with aiohttp.ClientSession() as http:
                assert (await post(http, engram, "u", tool_chat([large, small])))[0] == 200
                assert slotted(fake) == [False, True]  # the large one raw, not slotted
        finally:
            await engram.close()
        engram = await start_engram(fake.url, limits={"max_slots_per_user": 2})
        try:
            async with aiohttp.ClientSession() as http:
                outs = [source(t, 80) for t in "cde"]
                assert (await post(http, engram, "u", tool_chat(outs)))[0] == 200
                assert slotted(fake) == [True, True, False]
                # Held slots stay slotted; the third still has no room. Another user has.
                assert (await post(http, engram, "u", tool_chat(outs)))[0] == 200
                assert slotted(fake) == [True, True, False]
                assert (await post(http, engram, "v", tool_chat(outs)))[0] == 200
                assert slotted(fake) == [True, True, False]
                async with http.get(f"{engram.url}/engram/metrics") as r:
                    text = await r.text()
                assert 'engram_slots_refused_total{cap="max_slots_per_user"} 3' in text
        finally:
            await engram.close()


async def test_last_prompts_are_bounded_by_bytes(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await start_engram(fake.url, limits={"last_prompts_bytes": 0})
    try:
        status, _, headers = await post(http, engram, "v", [{"role": "user", "content": "hi"}])
        assert status == 200
        sid = headers["X-Engram-Session"]
        async with http.get(
            f"{engram.url}/engram/api/sessions/{sid}/requests/last", headers={"X-Engram-User": "v"}
        ) as r:
            assert r.status == 404
        memory = engram.app[SERVICES].require_memory().memory
        assert len(memory.last_requests) == 0
    finally:
        await engram.close()


# --- the recall deadline ------------------------------------------------------------------------


async def test_recall_past_its_deadline_goes_fts_only_then_without(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """The query lane made slow for real by a big batch of long queries in it: the request's
    query vector is late, so its memories come from full-text search alone; with a deadline
    nothing can meet, none are injected. Each says so after the count."""
    # One job of long queries in the query lane, sized to take about a second on this machine
    # (batch_size 512: one job): the request's query waits behind all of it.
    engram = await start_engram(
        fake.url, embedder={**REAL_MODEL, "batch_size": 512}, limits={"recall_deadline": 0.2}
    )
    try:
        note = [SYSTEM, {"role": "user", "content": "My sister Marta breeds Siamese cats."}]
        assert (await post(http, engram, "alice", note))[0] == 200
        await settle(engram)
        embedder = engram.app[SERVICES].require_memory().memory.embedder
        assert embedder is not None
        rnd = random.Random(2)

        def texts(n: int) -> list[str]:
            return [" ".join(rnd.choice(WORDS) for _ in range(220)) for _ in range(n)]

        t0 = time.perf_counter()
        await embedder.embed_queries(texts(4))
        per_text = (time.perf_counter() - t0) / 4
        busy = asyncio.create_task(embedder.embed_queries(texts(min(512, int(1.0 / per_text)))))
        await asyncio.sleep(0.01)
        question = [SYSTEM, {"role": "user", "content": "Which cat breed does my sister raise?"}]
        status, _, headers = await post(http, engram, "alice", question)
        assert not busy.done(), "the batch ended first: the lane was not busy"
        busy.cancel()
        assert status == 200
        count, why = memories(headers)
        assert why == "fts-only" and count >= 1
        assert "Siamese" in forwarded_memory(fake.chat_requests()[-1].json()["messages"])
        await asyncio.gather(busy, return_exceptions=True)
    finally:
        await engram.close()
    engram = await start_engram(fake.url, limits={"recall_deadline": 1e-6})
    try:
        assert (await post(http, engram, "bob", note))[0] == 200
        await settle(engram)
        status, _, headers = await post(http, engram, "bob", question)
        assert status == 200
        assert headers["X-Engram-Memories"] == "0; recall-timeout"
        assert "Siamese" not in fake.chat_requests()[-1].json()["messages"][0]["content"]
        async with http.get(f"{engram.url}/engram/metrics") as r:
            assert "engram_recall_timeout_total 2" in await r.text()  # the note's request too
    finally:
        await engram.close()
