"""End to end: the ``ollama`` Python client -> Engram ``/api/chat`` -> a real llama-server, which
has no ``/api/chat`` (a 404): Engram translates to ``/v1/chat/completions`` and back, and the
client gets Ollama's replies, plain and streamed. A fact told through chat completions is in the
prompt the model runs when asked later through Ollama's API, and the other way round."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import ollama
import pytest
from openai import AsyncOpenAI

from proxy.chat.fence import BLOCK_OPEN
from testing.harness import Engram, settle
from tests.e2e.conftest import LlamaServer, user_turns

pytestmark = pytest.mark.asyncio

MODEL = "smollm2"  # llama-server serves its one model whatever the name
OPTIONS = {"num_predict": 16, "temperature": 0}  # short replies, deterministic
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


@asynccontextmanager
async def client(engram: Engram, user: str) -> AsyncIterator[ollama.AsyncClient]:
    async with ollama.AsyncClient(host=engram.url, headers={"X-Engram-User": user}) as c:
        yield c


async def test_the_ollama_client_gets_real_replies_through_translation(
    engram: Engram, llama: LlamaServer
) -> None:
    async with client(engram, "olga") as c:
        plain = await c.chat(
            model=MODEL,
            messages=[SYSTEM, {"role": "user", "content": "Name three fruits."}],
            options=OPTIONS,
        )
        parts = [
            p
            async for p in await c.chat(
                model=MODEL,
                messages=[SYSTEM, {"role": "user", "content": "Name three colours."}],
                options=OPTIONS,
                stream=True,
            )
        ]
    assert plain.done and plain.done_reason in ("stop", "length")
    assert plain.message.role == "assistant" and (plain.message.content or "").strip()
    assert plain.prompt_eval_count and 0 < (plain.eval_count or 0) <= 16
    streamed = "".join(p.message.content or "" for p in parts)
    assert streamed.strip() and len(parts) > 2
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert parts[-1].eval_count and parts[-1].prompt_eval_count
    await settle(engram)
    turns = await user_turns(engram, "olga")
    replies = [t.content for t in turns if t.role == "assistant"]
    assert sorted(replies) == sorted([plain.message.content, streamed])
    assert {t.api for t in turns} == {"ollama-chat"}


async def test_memory_crosses_from_chat_completions_to_ollama_and_back(
    engram_real: Engram, llama: LlamaServer
) -> None:
    engram = engram_real
    oa = AsyncOpenAI(
        base_url=engram.base_url,
        api_key="sk-e2e",
        max_retries=0,
        default_headers={"X-Engram-User": "pavel"},
    )
    try:
        await oa.chat.completions.create(
            model=MODEL,
            messages=[SYSTEM, {"role": "user", "content": "My bicycle is a green Bianchi."}],
            max_tokens=4,
        )
        await settle(engram)
        async with client(engram, "pavel") as c:
            await c.chat(
                model=MODEL,
                messages=[SYSTEM, {"role": "user", "content": "What colour is my bicycle?"}],
                options={"num_predict": 4},
            )
            prompt = (await asyncio.to_thread(llama.get_json, "/slots"))[0]["prompt"]
            assert BLOCK_OPEN in prompt and "Bianchi" in prompt
            await c.chat(
                model=MODEL,
                messages=[SYSTEM, {"role": "user", "content": "My cat is named Pumpernickel."}],
                options={"num_predict": 4},
            )
        await settle(engram)
        await oa.chat.completions.create(
            model=MODEL,
            messages=[SYSTEM, {"role": "user", "content": "What is my cat's name?"}],
            max_tokens=4,
        )
        prompt = (await asyncio.to_thread(llama.get_json, "/slots"))[0]["prompt"]
        assert BLOCK_OPEN in prompt and "Pumpernickel" in prompt
    finally:
        await oa.close()
