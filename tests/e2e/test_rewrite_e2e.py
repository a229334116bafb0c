"""End to end with the real llama-server (-c 2048): a conversation three times the context
works through Engram, and the real model's summary is stored and used in a later prompt."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from proxy.chat.prompt import SUMMARY_OPEN
from proxy.services import SERVICES
from proxy.store.summaries import get_summary
from testing.fake_chunks import template_violations
from testing.harness import settle, start_engram
from tests.e2e.conftest import CTX, LlamaServer

pytestmark = pytest.mark.asyncio

TOPICS = [
    "the garden",
    "the old bicycle",
    "the bakery on Rue Cler",
    "the chess club",
    "the river trip",
    "the violin lessons",
]


def long_conversation() -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a friendly assistant."}]
    for i in range(50):
        topic = TOPICS[i % len(TOPICS)]
        msgs.append(
            {
                "role": "user",
                "content": f"Story part {i} about {topic}: "
                + "we walked along the quiet street and talked about many small things. " * 4,
            }
        )
        msgs.append(
            {
                "role": "assistant",
                "content": f"Thanks for part {i} about {topic}. "
                + "That sounds like a calm and pleasant afternoon with friends. " * 4,
            }
        )
    msgs.append({"role": "user", "content": "Which topics did my stories cover?"})
    return msgs


async def post(url: str, body: dict[str, Any], **headers: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        return r.status, await r.json()


async def test_three_times_the_context_then_a_real_summary(llama: LlamaServer) -> None:
    msgs = long_conversation()
    body = {"model": "smollm2", "messages": msgs, "max_tokens": 16, "temperature": 0}
    status, direct = await post(llama.url, body)
    assert status == 400 and direct["error"]["type"] == "exceed_context_size_error"
    assert direct["error"]["n_prompt_tokens"] > 3 * CTX

    engram = await start_engram(
        llama.url,
        summary={"budget_share": 1.0, "max_tokens": 96},
        prompt={"reply_reserve": 128, "mode": "zones"},  # the summary used at the next turn
    )
    try:
        status, reply = await post(engram.url, body, **{"X-Engram-User": "e2e-long"})
        assert status == 200, reply
        assert reply["usage"]["prompt_tokens"] < CTX
        await settle(engram, timeout=240)
        store = engram.app[SERVICES].store
        (session,) = await store.list_sessions("e2e-long")
        summary = await store.read(lambda c: get_summary(c, session.id))
        assert summary is not None and summary.upto > 10, "the real model made no summary"
        summarizer = engram.app[SERVICES].memory.summarizer
        assert summarizer is not None and summarizer.made >= 1

        nxt = [
            *msgs,
            reply["choices"][0]["message"],
            {"role": "user", "content": "And which one was first?"},
        ]
        status, reply2 = await post(
            engram.url, {**body, "messages": nxt}, **{"X-Engram-User": "e2e-long"}
        )
        assert status == 200, reply2
        _, last = engram.app[SERVICES].memory.last_requests[session.id]
        forwarded = json.dumps(last.messages)
        assert SUMMARY_OPEN in forwarded
        assert summary.content.splitlines()[0][:40] in json.loads(json.dumps(forwarded))
        assert any(p.source.startswith("summary") for p in last.parts)
        assert not template_violations(last.messages)
    finally:
        await engram.close()
