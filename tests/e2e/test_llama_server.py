"""End to end: the official openai SDK -> Engram -> a real llama-server running SmolLM2-135M.

Real sockets everywhere. Generations are short (16-32 tokens, temperature 0) to keep the suite
fast on two cores; the one long generation is aborted after its first chunks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from proxy.chat.fence import BLOCK_OPEN
from proxy.services import SERVICES
from testing.harness import Engram, settle
from tests.e2e.conftest import CTX, LlamaServer, user_turns, wait_idle

pytestmark = pytest.mark.asyncio

MODEL = "smollm2"  # llama-server serves its one model whatever the name
MAX_TOKENS = 24  # short replies, temperature 0: fast and deterministic


@asynccontextmanager
async def sdk(base_url: str, **headers: str) -> AsyncIterator[AsyncOpenAI]:
    client = AsyncOpenAI(
        base_url=base_url, api_key="sk-e2e", max_retries=0, default_headers=headers
    )
    try:
        yield client
    finally:
        await client.close()


def ask(text: str) -> list[ChatCompletionMessageParam]:
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": text},
    ]


async def test_plain_and_streamed_chat_are_well_formed_and_archived(engram: Engram) -> None:
    async with sdk(engram.base_url, **{"X-Engram-User": "ann"}) as client:
        plain = await client.chat.completions.create(
            model=MODEL, messages=ask("Name three fruits."), max_tokens=MAX_TOKENS, temperature=0
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=ask("Name three colours."),
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        chunks = [chunk async for chunk in stream]

    choice = plain.choices[0]
    assert plain.object == "chat.completion" and plain.id
    assert choice.message.role == "assistant"
    assert choice.message.content and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert plain.usage is not None
    assert plain.usage.prompt_tokens > 0 and 0 < plain.usage.completion_tokens <= MAX_TOKENS
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens

    with_choices = [c for c in chunks if c.choices]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert with_choices[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert streamed.strip()
    finishes = [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")
    last = chunks[-1]  # include_usage: a final chunk with no choices and the usage
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens > 0 and 0 < last.usage.completion_tokens <= MAX_TOKENS

    await settle(engram)
    turns = await user_turns(engram, "ann")
    assert {(t.role, t.content) for t in turns} >= {
        ("user", "Name three fruits."),
        ("user", "Name three colours."),
    }
    replies = sorted((t.content, t.incomplete) for t in turns if t.role == "assistant")
    assert replies == sorted([(choice.message.content, False), (streamed, False)])


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/health", None),
        ("GET", "/props", None),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"content": "Hello world, this is Engram.", "with_pieces": True}),
    ],
)
async def test_llama_endpoints_through_engram_equal_direct(
    engram: Engram, llama: LlamaServer, method: str, path: str, body: dict[str, Any] | None
) -> None:
    async def fetch(base: str) -> tuple[int, str, Any]:
        async with (
            aiohttp.ClientSession() as http,
            http.request(method, base + path, json=body) as r,
        ):
            return r.status, r.content_type, await r.json()

    direct, proxied = await fetch(llama.url), await fetch(engram.url)
    assert direct[0] == 200
    if path == "/v1/models":  # `created` is the current time, in seconds
        for answer in (direct[2], proxied[2]):
            for model in answer["data"]:
                model.pop("created", None)
    assert proxied == direct
    if path == "/props":
        assert direct[2]["default_generation_settings"]["n_ctx"] == CTX


async def test_fact_from_one_conversation_is_injected_into_a_later_one(
    engram_real: Engram, llama: LlamaServer
) -> None:
    engram = engram_real
    fact = "My sister Marta lives in Porto and she breeds Siamese cats."
    question = "Which cat breed does my sister raise?"
    async with sdk(engram.base_url, **{"X-Engram-User": "alice"}) as client:
        first = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=ask(fact), max_tokens=MAX_TOKENS, temperature=0
        )
        assert first.headers["X-Engram-Memories"] == "0"
        await settle(engram)
        # The fact is archived, and the retriever, asked directly, ranks it first.
        hits = await engram.app[SERVICES].retriever.search("alice", question, 3)
        assert hits and hits[0].turn.content == fact and hits[0].turn.role == "user"
        later = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=ask(question), max_tokens=MAX_TOKENS, temperature=0
        )
    assert later.status_code == 200
    assert int(later.headers["X-Engram-Memories"]) >= 1
    assert later.headers["X-Engram-Session"] != first.headers["X-Engram-Session"]
    reply = later.parse()
    assert reply.choices[0].message.content and reply.choices[0].finish_reason
    # What llama-server actually ran: /slots shows the last task's prompt, detokenized.
    slots = await asyncio.to_thread(llama.get_json, "/slots")
    prompt = slots[0]["prompt"]
    assert BLOCK_OPEN in prompt and "Siamese" in prompt and question in prompt
    assert prompt.index("You are a helpful assistant.") < prompt.index(BLOCK_OPEN)
    # Another user asking the same gets none of it.
    async with sdk(engram.base_url, **{"X-Engram-User": "bob"}) as client:
        other = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=ask(question), max_tokens=MAX_TOKENS, temperature=0
        )
    assert other.headers["X-Engram-Memories"] == "0"
    slots = await asyncio.to_thread(llama.get_json, "/slots")
    assert "Siamese" not in slots[0]["prompt"] and BLOCK_OPEN not in slots[0]["prompt"]


async def test_client_disconnect_mid_stream_stops_llama_server(
    engram: Engram, llama: LlamaServer
) -> None:
    async with sdk(engram.base_url, **{"X-Engram-User": "dan"}) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=ask("Tell me a very long story about a lighthouse keeper."),
            stream=True,
            max_tokens=2000,
            temperature=0,
            extra_body={"ignore_eos": True},  # llama.cpp: no early stop, 2000 tokens is ~15 s
        )
        received = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
                if received == 5:
                    break
        busy = (await asyncio.to_thread(llama.get_json, "/slots"))[0]
        assert busy["is_processing"], busy  # still generating while the client reads
        assert busy["next_token"][0]["n_remain"] > 1000  # far from done: ~15 s of work left
        await stream.close()  # the client goes away mid-stream
        await wait_idle(llama, timeout=1.0)
    # It stays idle: the generation was cancelled, not paused.
    await asyncio.sleep(0.3)
    assert not (await asyncio.to_thread(llama.get_json, "/slots"))[0]["is_processing"]
    # The part that was streamed is archived, marked incomplete.
    await settle(engram)
    replies = [t for t in await user_turns(engram, "dan") if t.role == "assistant"]
    assert len(replies) == 1 and replies[0].incomplete and replies[0].content.strip()


async def test_memory_off_reaches_llama_server_identically(
    engram: Engram, llama: LlamaServer
) -> None:
    messages = ask("What is the capital of France?")
    # llama.cpp: no reuse of the KV cache, so both runs compute the same thing from scratch
    # (a reused prefix changes `cached_tokens` and, in principle, the floating-point sums).
    fresh = {"cache_prompt": False}
    results = []
    for base, headers in (
        (llama.url + "/v1", {}),
        (engram.base_url, {"X-Engram-Memory": "off", "X-Engram-User": "eve"}),
    ):
        async with sdk(base, **headers) as client:
            plain = await client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=messages,
                seed=7,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body=fresh,
            )
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                seed=7,
                extra_body=fresh,
                stream=True,
                stream_options={"include_usage": True},
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            chunks = [chunk async for chunk in stream]
        body = plain.parse()
        assert "X-Engram-Session" not in plain.headers
        results.append(
            (
                plain.status_code,
                body.model,
                body.choices[0].message.content,
                body.choices[0].finish_reason,
                body.usage.model_dump() if body.usage else None,
                "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                chunks[-1].usage.completion_tokens if chunks[-1].usage else None,
            )
        )
    direct, proxied = results
    assert direct[2]  # a real reply
    assert proxied == direct
    await settle(engram)
    assert (await engram.app[SERVICES].store.stats()).turns == 0


@pytest.mark.parametrize("mode", ["off", "on"])
async def test_context_overflow_error_is_relayed_unchanged(
    engram: Engram, llama: LlamaServer, mode: str
) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 300  # ~3000 tokens > n_ctx 2048
    raw = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    ).encode()

    async def post(url: str, headers: dict[str, str]) -> tuple[int, str, bytes]:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                url + "/v1/chat/completions",
                data=raw,
                headers={"Content-Type": "application/json", **headers},
            ) as r,
        ):
            return r.status, r.content_type, await r.read()

    direct = await post(llama.url, {})
    proxied = await post(engram.url, {"X-Engram-Memory": mode, "X-Engram-User": "fay"})
    assert direct[0] == 400
    error = json.loads(direct[2])["error"]
    assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == CTX
    assert error["n_prompt_tokens"] > CTX
    assert proxied == direct  # status, content type and llama.cpp's exact bytes
    await settle(engram)


async def test_serve_without_upstream_starts_the_bundled_model() -> None:
    """`make run` on a machine with no model server: Engram brings up the tiny model itself."""
    import signal
    import socket

    from tests.proxy.test_serve import start_serve

    for port in (8080, 11434):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                pytest.fail(f"port {port} is taken: auto-detection would find that server")
    proc, url = await start_serve(wait_s=120)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/engram/health") as r:
                health = await r.json()
            assert health["upstream"]["found_by"] == "bundled"
            assert health["upstream"]["reachable"] is True
            assert health["upstream"]["context_size"] == 2048
            async with http.post(
                url + "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Say hi."}],
                    "max_tokens": 8,
                    "temperature": 0,
                },
            ) as r:
                assert r.status == 200
                assert (await r.json())["choices"][0]["message"]["content"] is not None
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    # The bundled server went with it.
    with socket.socket() as s:
        port = int(health["upstream"]["url"].rsplit(":", 1)[1])
        assert s.connect_ex(("127.0.0.1", port)) != 0
