"""End to end, the OpenAI Responses API on a real llama-server (SmolLM2) through Engram, with the
``openai`` SDK's ``client.responses`` as the client: real replies, plain and streamed, archived;
a fact told through chat completions is in the prompt the model runs for a later Responses
conversation (in ``instructions``, after the client's own), and the other way round.

The bundled llama-server answers ``previous_response_id`` with a 400 and streams its events
without ``output_index`` (the SDK's ``responses.stream()`` helper rejects them even without
Engram), so these tests send whole histories and read streams with ``create(stream=True)``."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from proxy.chat.fence import BLOCK_OPEN
from testing.harness import Engram, settle
from tests.e2e.conftest import LlamaServer, user_turns

pytestmark = pytest.mark.asyncio

MODEL = "smollm2"
MAX = 12
INSTRUCTIONS = "You are a helpful assistant."


def sdk(engram: Engram, user: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=engram.base_url,
        api_key="sk-no-key-required",
        max_retries=0,
        default_headers={"X-Engram-User": user},
    )


async def test_the_sdk_gets_real_replies_and_they_are_archived(engram: Engram) -> None:
    async with sdk(engram, "carol") as client:
        first = await client.responses.create(
            model=MODEL, instructions=INSTRUCTIONS, input="Say hello.", max_output_tokens=MAX
        )
        assert first.status in ("completed", "incomplete") and first.output_text
        # The reply's items go back as the next request's history (assistant items typed, as
        # llama-server needs them), with a developer item that Engram folds into instructions.
        history: list[Any] = [
            {"type": "message", "role": "developer", "content": "Answer in English."},
            {"role": "user", "content": "Say hello."},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"role": "user", "content": "Now say goodbye."},
        ]
        stream = await client.responses.create(
            model=MODEL,
            instructions=INSTRUCTIONS,
            input=history,
            max_output_tokens=MAX,
            stream=True,
        )
        kinds: list[str] = []
        text = ""
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert text
    await settle(engram)
    turns = await user_turns(engram, "carol")
    replies = [t.content for t in turns if t.role == "assistant"]
    assert first.output_text in replies and text in replies
    assert {t.api for t in turns} == {"openai-responses"}


async def prompt_run(llama: LlamaServer) -> str:
    """The prompt llama-server last ran, detokenized (LLAMA_SERVER_SLOTS_DEBUG)."""
    slots = await asyncio.to_thread(llama.get_json, "/slots")
    prompt: str = slots[0]["prompt"]
    return prompt


async def test_a_fact_crosses_between_chat_completions_and_responses(
    engram_real: Engram, llama: LlamaServer
) -> None:
    engram = engram_real
    async with sdk(engram, "alice") as client:
        await client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": INSTRUCTIONS},
                {
                    "role": "user",
                    "content": "My sister Marta lives in Porto and breeds Siamese cats.",
                },
            ],
            max_tokens=MAX,
        )
        await settle(engram)
        question = "Which cat breed does my sister raise?"
        raw = await client.responses.with_raw_response.create(
            model=MODEL, instructions=INSTRUCTIONS, input=question, max_output_tokens=MAX
        )
        assert raw.status_code == 200 and raw.parse().output_text
        assert int(raw.headers["X-Engram-Memories"]) >= 1
        prompt = await prompt_run(llama)
        assert BLOCK_OPEN in prompt and "Siamese" in prompt and question in prompt
        assert prompt.index(INSTRUCTIONS) < prompt.index(BLOCK_OPEN)
        # Told through Responses, found through chat completions.
        await client.responses.create(
            model=MODEL,
            input="My bicycle is a green Gazelle from 1987.",
            max_output_tokens=MAX,
        )
        await settle(engram)
        later = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Which bicycle do I ride?"}],
            max_tokens=MAX,
        )
        assert int(later.headers["X-Engram-Memories"]) >= 1
        assert "green Gazelle" in await prompt_run(llama)
