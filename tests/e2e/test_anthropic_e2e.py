"""End to end: the ``anthropic`` SDK -> Engram -> a real llama-server (SmolLM2-135M, a ChatML
template), which serves ``/v1/messages`` itself. The SDK gets real replies, plain and streamed;
a fact told through chat completions is in the prompt the model runs for a later Messages
conversation (and the other way round); Claude Code's role ``system`` messages reach the
template as one system turn."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anthropic
import pytest
from openai import AsyncOpenAI

from proxy.chat.fence import BLOCK_OPEN
from testing.harness import Engram, settle
from tests.e2e.conftest import LlamaServer, user_turns

pytestmark = pytest.mark.asyncio

MODEL = "smollm2"
MAX_TOKENS = 16


@asynccontextmanager
async def sdk(engram: Engram, user: str) -> AsyncIterator[anthropic.AsyncAnthropic]:
    client = anthropic.AsyncAnthropic(
        base_url=engram.url,
        api_key="sk-ant-e2e",
        max_retries=0,
        default_headers={"X-Engram-User": user},
    )
    try:
        yield client
    finally:
        await client.close()


async def last_prompt(llama: LlamaServer) -> str:
    slots = await asyncio.to_thread(llama.get_json, "/slots")
    prompt: str = slots[0]["prompt"]  # detokenized: what the model really ran
    return prompt


async def test_the_sdk_gets_real_replies_and_they_are_archived(
    engram: Engram, llama: LlamaServer
) -> None:
    async with sdk(engram, "ann") as c:
        msg = await c.messages.create(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            extra_body={"temperature": 0},
            system="You are a helpful assistant.",
            messages=[{"role": "user", "content": "Name three fruits."}],
        )
        async with c.messages.stream(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            extra_body={"temperature": 0},
            messages=[{"role": "user", "content": "Name three colours."}],
        ) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content and msg.content[-1].type == "text" and msg.content[-1].text.strip()
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 0 < msg.usage.output_tokens <= MAX_TOKENS and msg.usage.input_tokens > 0
    assert text.strip() and final.stop_reason in ("end_turn", "max_tokens")
    await settle(engram)
    stored = await user_turns(engram, "ann")
    assert {t.api for t in stored} == {"anthropic-messages"}
    replies = [t.content for t in stored if t.role == "assistant"]
    assert msg.content[-1].text in replies and text in replies
    assert all(t.reply is not None and t.reply.complete for t in engram.turns)


async def test_memory_crosses_apis_into_the_prompt_the_model_runs(
    engram_real: Engram, llama: LlamaServer
) -> None:
    chat = AsyncOpenAI(
        base_url=engram_real.base_url,
        api_key="sk-e2e",
        max_retries=0,
        default_headers={"X-Engram-User": "bea"},
    )
    async with chat, sdk(engram_real, "bea") as c:
        await chat.chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": "My zebrafinch is called Quillon."}],
        )
        await settle(engram_real)
        r = await c.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=4,
            system="You are a helpful assistant.",
            messages=[{"role": "user", "content": "What is my zebrafinch called?"}],
        )
        assert int(r.headers["X-Engram-Memories"].split(";")[0]) >= 1
        prompt = await last_prompt(llama)
        assert BLOCK_OPEN in prompt and "Quillon" in prompt
        # the system prompt first, as sent; the memory before the question
        system, block = prompt.index("You are a helpful assistant."), prompt.index(BLOCK_OPEN)
        assert system < block < prompt.index("What is my zebrafinch called?")
        # The other way: told through Messages, recalled through chat completions.
        await c.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": "My canoe is painted ochre."}],
        )
        await settle(engram_real)
        await chat.chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What colour is my canoe?"},
            ],
        )
        assert "ochre" in await last_prompt(llama)


async def test_role_system_messages_reach_the_template_as_one_system_turn(
    engram_real: Engram, llama: LlamaServer
) -> None:
    async with sdk(engram_real, "cy") as c:
        await c.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": "My tortoise is named Brambleton."}],
        )
        await settle(engram_real)
        await c.messages.create(
            model=MODEL,
            max_tokens=4,
            system="You are a helpful assistant.",
            messages=[
                {"role": "user", "content": "What is my tortoise named?"},
                {"role": "system", "content": "Available agents: none."},  # type: ignore[list-item]
            ],
        )
    prompt = await last_prompt(llama)
    assert prompt.count("<|im_start|>system") == 1, prompt
    assert "Available agents: none." in prompt and "Brambleton" in prompt
