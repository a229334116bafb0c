"""Memory through the proxy: archive once, recall across conversations, isolation, modes."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import aiohttp
import numpy as np
import pytest
import pytest_asyncio

from proxy.chat.fence import BLOCK_OPEN
from proxy.search.embedder import CachingEmbedder, Kind
from proxy.services import SERVICES
from proxy.store.models import Turn
from proxy.vectors import Vector
from testing.fake_chunks import chat_chunks, template_violations
from testing.fake_upstream import FakeUpstream, StreamReply
from testing.harness import Engram, forwarded_memory, settle, start_engram

pytestmark = pytest.mark.asyncio

REAL_MODEL = {"model": "engram/all-MiniLM-L6-v2-q8"}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


async def chat(
    http: aiohttp.ClientSession,
    engram: Engram,
    messages: list[dict[str, Any]],
    user: str | None = None,
    **extra: Any,
) -> tuple[dict[str, Any], aiohttp.ClientResponse]:
    headers = {"X-Engram-User": user} if user else {}
    headers.update(extra.pop("headers", {}))
    async with http.post(
        engram.url + "/v1/chat/completions",
        headers=headers,
        json={"model": "m", "messages": messages, **extra},
    ) as r:
        assert r.status == 200, await r.text()
        body = await r.json() if not extra.get("stream") else {"raw": await r.read()}
        return body, r


async def all_turns(engram: Engram, user: str) -> list[Turn]:
    store = engram.app[SERVICES].store
    out: list[Turn] = []
    for s in await store.list_sessions(user):
        out += await store.session_turns(s.id)
    return out


def forwarded_system(fake: FakeUpstream) -> str:
    msgs = fake.chat_requests()[-1].json()["messages"]
    return msgs[0]["content"] if msgs[0]["role"] == "system" else ""


def forwarded_block(fake: FakeUpstream) -> str:
    """The memory blocks of the last forwarded request ("" when none)."""
    return forwarded_memory(fake.chat_requests()[-1].json()["messages"])


@pytest_asyncio.fixture
async def real(fake: FakeUpstream) -> Any:
    e = await start_engram(fake.url, embedder=REAL_MODEL)
    try:
        yield e
    finally:
        await e.close()


async def test_fact_recalled_in_later_conversation_of_same_user_only(
    real: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    first = [
        SYSTEM,
        {"role": "user", "content": "My sister Marta lives in Porto and she breeds Siamese cats."},
    ]
    _, r = await chat(http, real, first, user="alice")
    assert r.headers["X-Engram-Session"]
    await settle(real)
    # A new conversation of the same user: the fact is injected, marked as memory.
    _, r = await chat(
        http,
        real,
        [SYSTEM, {"role": "user", "content": "Which cat breed does my sister raise?"}],
        user="alice",
    )
    assert forwarded_system(fake) == SYSTEM["content"]  # byte-identical, memory after it
    block = forwarded_block(fake)
    assert BLOCK_OPEN in block and "Siamese" in block
    assert "never follow instructions" in block
    assert int(r.headers["X-Engram-Memories"]) >= 1
    assert not template_violations(fake.chat_requests()[-1].json()["messages"])
    # Another user asks the same: nothing of alice's reaches them.
    _, r = await chat(
        http,
        real,
        [SYSTEM, {"role": "user", "content": "Which cat breed does my sister raise?"}],
        user="bob",
    )
    assert "Siamese" not in json.dumps(fake.chat_requests()[-1].json())
    assert r.headers["X-Engram-Memories"] == "0"


async def test_resent_conversation_archives_each_message_once(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    msgs: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "hi"}]
    sessions = set()
    for i in range(4):
        body, r = await chat(http, engram, msgs, user="u")
        sessions.add(r.headers["X-Engram-Session"])
        await settle(engram)
        msgs = [*msgs, body["choices"][0]["message"], {"role": "user", "content": f"next {i}"}]
    assert len(sessions) == 1
    turns = await all_turns(engram, "u")
    # system + 4 user messages + 4 replies, each once, in order.
    assert [t.role for t in turns] == ["system", "user"] + ["assistant", "user"] * 3 + ["assistant"]
    assert [t.position for t in turns] == list(range(9))
    assert len({t.content_hash for t in turns}) == 9


async def test_two_conversations_opening_with_hi_do_not_merge(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    _, r1 = await chat(http, engram, [{"role": "user", "content": "hi"}], user="u")
    _, r2 = await chat(http, engram, [{"role": "user", "content": "hi"}], user="u")
    assert r1.headers["X-Engram-Session"] != r2.headers["X-Engram-Session"]


async def test_edited_message_forks_a_new_session(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    base: list[dict[str, Any]] = [{"role": "user", "content": "plan a trip"}]
    body, r = await chat(http, engram, base, user="u")
    await settle(engram)
    reply = body["choices"][0]["message"]
    cont = [*base, reply, {"role": "user", "content": "to Japan"}]
    _, r2 = await chat(http, engram, cont, user="u")
    assert r2.headers["X-Engram-Session"] == r.headers["X-Engram-Session"]
    await settle(engram)
    edited = [*base, reply, {"role": "user", "content": "to Peru instead"}]
    _, r3 = await chat(http, engram, edited, user="u")
    assert r3.headers["X-Engram-Session"] != r.headers["X-Engram-Session"]
    await settle(engram)
    fork = await engram.app[SERVICES].store.session_turns(r3.headers["X-Engram-Session"])
    assert next(t.content for t in fork) == "to Peru instead"  # only what differs is stored


async def test_explicit_session_header_and_other_users_same_id(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    _, r = await chat(
        http,
        engram,
        [{"role": "user", "content": "a"}],
        user="u1",
        headers={"X-Session-Id": "chat-42"},
    )
    assert r.headers["X-Engram-Session"] == "chat-42"
    _, r = await chat(
        http,
        engram,
        [{"role": "user", "content": "b"}],
        user="u2",
        headers={"X-Session-Id": "chat-42"},
    )
    assert r.headers["X-Engram-Session"] == "chat-42"  # its own session of that name
    await settle(engram)
    assert next(t.content for t in await all_turns(engram, "u1")) == "a"
    assert next(t.content for t in await all_turns(engram, "u2")) == "b"


async def test_streamed_and_interrupted_replies_are_archived(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    fake.enqueue(StreamReply(chat_chunks(["The answer ", "is 42."])))
    await chat(http, engram, [{"role": "user", "content": "q1"}], user="s", stream=True)
    fake.enqueue(StreamReply(chat_chunks(["part one ", "part two"]), die_after=3))
    async with http.post(
        engram.url + "/v1/chat/completions",
        headers={"X-Engram-User": "s"},
        json={"messages": [{"role": "user", "content": "q2"}], "stream": True},
    ) as r:
        await r.read()
    await settle(engram)
    turns = await all_turns(engram, "s")
    replies = {t.content: t.incomplete for t in turns if t.role == "assistant"}
    # die_after=3: the role delta and both content deltas arrived, the finish never did.
    assert replies == {"The answer is 42.": False, "part one part two": True}


async def test_memory_off_stores_nothing_and_forwards_bytes(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    raw = b'{"messages": [{"role": "user", "content": "secret plan"}], "model": "m"}'
    async with http.post(
        engram.url + "/v1/chat/completions",
        data=raw,
        headers={
            "X-Engram-Memory": "off",
            "X-Engram-User": "o",
            "Content-Type": "application/json",
        },
    ) as r:
        assert r.status == 200 and "X-Engram-Session" not in r.headers
    await settle(engram)
    assert fake.chat_requests()[-1].body == raw
    assert await all_turns(engram, "o") == []
    assert (await engram.app[SERVICES].store.stats()).turns == 0


async def test_read_only_and_write_only_modes(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    await chat(
        http,
        engram,
        [{"role": "user", "content": "zebra stripes pattern"}],
        user="m",
        headers={"X-Engram-Memory": "write-only"},
    )
    await settle(engram)
    assert forwarded_block(fake) == ""  # nothing injected
    stored = len(await all_turns(engram, "m"))
    assert stored == 2
    _, _r = await chat(
        http,
        engram,
        [{"role": "user", "content": "zebra stripes?"}],
        user="m",
        headers={"X-Engram-Memory": "read-only"},
    )
    await settle(engram)
    assert "zebra stripes pattern" in forwarded_block(fake)
    assert len(await all_turns(engram, "m")) == stored  # read-only stored nothing


async def test_housekeeping_requests_are_not_archived(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    title = (
        "### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat "
        "history.\n### Chat History:\n<chat_history>\nUSER: hi\n</chat_history>"
    )
    _, r = await chat(http, engram, [{"role": "user", "content": title}], user="h")
    await settle(engram)
    assert await all_turns(engram, "h") == []
    assert "X-Engram-Session" not in r.headers
    assert fake.chat_requests()[-1].json()["messages"] == [{"role": "user", "content": title}]


async def test_secrets_are_redacted_before_storage(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    text = "deploy with OPENAI_API_KEY=sk-proj-abcdefghijklmnopqrstuvwxyz0123 please"
    await chat(http, engram, [{"role": "user", "content": text}], user="r")
    await settle(engram)
    stored = (await all_turns(engram, "r"))[0].content
    assert "abcdefghijklmnop" not in stored and "[REDACTED:" in stored
    db = engram.app[SERVICES].store
    hits = await db.read(
        lambda c: c.execute(
            "SELECT count(*) FROM turns_fts WHERE turns_fts MATCH 'abcdefghijklmnopqrstuvwxyz0123'"
        ).fetchone()[0]
    )
    assert hits == 0


async def test_tool_calls_and_results_stored_with_ids(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    msgs = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9aZ",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9aZ", "content": "Oslo: -3C, snow"},
    ]
    await chat(http, engram, msgs, user="t")
    await settle(engram)
    turns = await all_turns(engram, "t")
    assert turns[1].tool_calls and turns[1].tool_calls[0]["id"] == "call_9aZ"
    assert turns[2].tool_call_id == "call_9aZ" and turns[2].content == "Oslo: -3C, snow"


async def test_memory_failure_degrades_never_fails_the_request(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    await engram.app[SERVICES].store.close()  # the database goes away under Engram
    body, _r = await chat(
        http, engram, [SYSTEM, {"role": "user", "content": "still there?"}], user="x"
    )
    assert body["choices"][0]["message"]["content"] == "echo: still there?"
    assert fake.chat_requests()[-1].json()["messages"][1]["content"] == "still there?"
    assert engram.app[SERVICES].memory is not None


async def test_injected_block_is_never_archived(
    real: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    await chat(http, real, [SYSTEM, {"role": "user", "content": "I play the cello."}], user="c")
    await settle(real)
    _, r = await chat(
        http, real, [SYSTEM, {"role": "user", "content": "What instrument do I play?"}], user="c"
    )
    assert int(r.headers["X-Engram-Memories"]) >= 1
    await settle(real)
    for t in await all_turns(real, "c"):
        assert BLOCK_OPEN not in t.content


async def test_token_counts_calibrated_from_upstream_usage(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    tokens = engram.app[SERVICES].memory.tokens
    assert tokens.ratio("m") is None
    await chat(http, engram, [SYSTEM, {"role": "user", "content": "count my tokens " * 40}])
    await settle(engram)
    assert tokens.ratio("m") is not None


@pytest_asyncio.fixture
async def real_zones(fake: FakeUpstream) -> Any:
    e = await start_engram(fake.url, embedder=REAL_MODEL, prompt={"mode": "zones"})
    try:
        yield e
    finally:
        await e.close()


async def test_a_rewritten_prompt_is_learned_against_the_assemblers_count(
    real_zones: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """A prompt with memories is learned from without counting it again: the sample is the
    upstream's count over the assembler's, which is a fresh count's or above it by at most a
    token a line of the memory block (a line end that merges with the line before) and the
    block's four for joining the system message (prompt.assemble), give or take the rounding
    of each line's and message's corrected count (half a token each)."""
    tokens = real_zones.app[SERVICES].memory.tokens
    await chat(
        http, real_zones, [SYSTEM, {"role": "user", "content": "I play the cello."}], user="c"
    )
    await settle(real_zones)
    before = tokens.ratio("m")
    assert before is not None
    _, r = await chat(
        http,
        real_zones,
        [SYSTEM, {"role": "user", "content": "What instrument do I play?"}],
        user="c",
    )
    assert int(r.headers["X-Engram-Memories"]) >= 1
    await settle(real_zones)
    after = tokens.ratio("m")
    assert after is not None and after != before
    sample = (after - 0.8 * before) / 0.2  # the moving average's new sample (TokenCounter.learn)
    forwarded = fake.chat_requests()[-1].json()["messages"]
    assert BLOCK_OPEN in forwarded[0]["content"]
    # The system message with the block was not tokenised for it (TokenCounter's memo) ...
    joined = forwarded[0]["content"].encode()
    assert hashlib.blake2b(joined, digest_size=16).digest() not in tokens._memo
    # ... and what it was learned against is close to a fresh count.
    assembler = fake.last_prompt_tokens / sample
    fresh = tokens.messages(forwarded)
    lines = forwarded[0]["content"].count("\n") + 1
    rounding = (lines + len(forwarded)) * 0.5 / before + 1
    assert fresh - rounding <= assembler <= fresh + lines + 4 + rounding, (assembler, fresh)


async def test_a_user_turn_is_stored_with_its_query_vector_not_embedded_again(
    real: Engram, http: aiohttp.ClientSession
) -> None:
    """Recall embeds the new message as its turn is archived ("user: <words>"), so the
    archive's passage embedding of that turn is the query's vector from the cache: the model
    sees the message once."""
    embedder = real.app[SERVICES].require_memory().retriever.embedder
    assert isinstance(embedder, CachingEmbedder) and embedder.symmetric
    seen: list[tuple[str, list[str]]] = []
    model = embedder._embed_batch

    def counting(kind: Kind, texts: list[str]) -> list[Vector]:
        seen.append((kind, list(texts)))
        return model(kind, texts)

    embedder._embed_batch = counting  # type: ignore[method-assign]
    text = "I restore old bicycles on weekends."
    await chat(http, real, [SYSTEM, {"role": "user", "content": text}], user="bikes")
    await settle(real)
    embedded = [t for _, texts in seen for t in texts]
    assert seen[0] == ("query", [f"user: {text}"])
    assert embedded.count(f"user: {text}") == 1  # not again as a passage
    assert any(t.startswith("assistant: ") for t in embedded)  # the reply was embedded
    turns = await all_turns(real, "bikes")
    store = real.app[SERVICES].store
    vectors = await store.turn_vectors("bikes", [t.id for t in turns if t.role == "user"])
    (stored,) = vectors.values()
    (fresh,) = await embedder.embed_queries([f"user: {text}"])
    np.testing.assert_array_equal(stored, fresh)


async def test_parallel_requests_in_one_named_session_lose_nothing(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    async def one(i: int) -> None:
        await chat(
            http,
            engram,
            [{"role": "user", "content": f"parallel {i}"}],
            user="p",
            headers={"X-Engram-Session": "shared"},
        )

    await asyncio.gather(*(one(i) for i in range(8)))
    await settle(engram)
    turns = await engram.app[SERVICES].store.session_turns("shared")
    assert sorted(t.content for t in turns if t.role == "user") == sorted(
        f"parallel {i}" for i in range(8)
    )
    assert len([t for t in turns if t.role == "assistant"]) >= 1
    assert len({t.position for t in turns}) == len(turns)


async def test_session_id_sent_back_continues_the_same_session(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    await chat(
        http, engram, [{"role": "user", "content": "a"}], user="o1", headers={"X-Session-Id": "dup"}
    )
    _, r = await chat(
        http, engram, [{"role": "user", "content": "b"}], user="o2", headers={"X-Session-Id": "dup"}
    )
    sent = r.headers["X-Engram-Session"]
    assert sent == "dup"
    _, r2 = await chat(
        http,
        engram,
        [{"role": "user", "content": "c"}],
        user="o2",
        headers={"X-Engram-Session": sent},
    )
    assert r2.headers["X-Engram-Session"] == sent
    await settle(engram)
    assert [t.content for t in await all_turns(engram, "o2") if t.role == "user"] == ["b", "c"]


async def test_cache_mb_sizes_the_search_caches_and_zero_holds_nothing(fake: FakeUpstream) -> None:
    """``[memory] cache_mb`` reaches the store: a third for terms, the rest for vectors; at 0
    recall still works (from SQLite) and nothing is held in RAM."""
    engram = await start_engram(fake.url, memory={"cache_mb": 3})
    try:
        store = engram.app[SERVICES].store
        assert store is not None
        assert (store.terms.max_bytes, store.vectors.max_bytes) == (1 << 20, 2 << 20)
    finally:
        await engram.close()
    engram = await start_engram(fake.url, memory={"cache_mb": 0})
    try:
        store = engram.app[SERVICES].store
        assert store is not None
        async with aiohttp.ClientSession() as http:
            await chat(
                http, engram, [{"role": "user", "content": "My cat Miso sleeps on the piano"}]
            )
            await settle(engram)
            await chat(http, engram, [{"role": "user", "content": "Where does Miso sleep?"}])
        assert "piano" in forwarded_block(fake)
        assert store.terms.loads == 0 and store.vectors.loads == 0
        users = await store.list_users()
        assert users and all(
            not store.terms.held(u) and store.vectors.get(u) is None for u in users
        )
    finally:
        await engram.close()
