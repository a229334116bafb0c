"""Engram's own upstream calls wait for an idle upstream (proxy/idle.py), through a running
Engram in front of the fake upstream: a summary is not sent while a user's streamed reply is in
flight, and goes ``upstream.own_calls_idle`` seconds after it ended."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import pytest

from proxy.services import SERVICES
from testing.fake_chunks import chat_chunks, chat_completion
from testing.fake_upstream import FakeUpstream, JsonReply, StreamReply
from testing.harness import Engram, settle, start_engram
from tests.proxy.test_rewrite import long_chat

SUMMARY = "The user asked forty numbered questions about lorem ipsum; question 3 concerned lorem."
QUIET = 0.5  # upstream.own_calls_idle in these tests
STREAM_PARTS = 8
STREAM_GAP = 0.15  # the slow reply takes about STREAM_PARTS * STREAM_GAP seconds


async def start(fake: FakeUpstream, **upstream: Any) -> Engram:
    return await start_engram(
        fake.url,
        # zones: the over-budget first turn's window cut schedules a summary at once (these
        # tests are about when it reaches the upstream, not about what schedules it)
        prompt={"reply_reserve": 256, "mode": "zones"},
        summary={"budget_share": 1.0},
        upstream={"own_calls_idle": QUIET, **upstream},
    )


async def chat_then_slow_stream(http: aiohttp.ClientSession, engram: Engram) -> float:
    """A long chat whose window is cut (a summary is due), then at once another chat whose
    streamed reply is slow; returns when (monotonic) the client had the stream's last byte."""
    async with http.post(
        engram.url + "/v1/chat/completions",
        json={"messages": long_chat(40)},
        headers={"X-Engram-User": "own", "X-Engram-Session": "long"},
    ) as r:
        assert r.status == 200, await r.text()
        await r.read()
    async with http.post(
        engram.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Tell me a story."}], "stream": True},
        headers={"X-Engram-User": "own", "X-Engram-Session": "story"},
    ) as r:
        assert r.status == 200
        body = await r.read()
    assert b"[DONE]" in body
    return time.monotonic()


def summary_requests(fake: FakeUpstream) -> list[float]:
    """When each of Engram's summary requests reached the upstream."""
    return [
        req.received_at
        for req in fake.chat_requests()
        if "running summary" in str(req.json()["messages"][0].get("content"))
    ]


@pytest.mark.asyncio
async def test_summary_waits_for_the_streamed_reply_and_the_quiet_time(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeUpstream(n_ctx=2048) as fake:
        fake.enqueue(
            JsonReply(chat_completion("Question 3 was about lorem.")),
            StreamReply(chat_chunks(["Once"] * STREAM_PARTS), delay=STREAM_GAP),
            *[JsonReply(chat_completion(SUMMARY)) for _ in range(30)],
        )
        engram = await start(fake)
        try:
            stream_ended = await chat_then_slow_stream(http, engram)
            await settle(engram)
            sent = summary_requests(fake)
            assert sent, "the summary was never made"
            # Nothing of Engram's own reached the upstream while the reply streamed, nor in
            # the quiet time after it (the upstream's clock and ours are both monotonic).
            assert min(sent) >= stream_ended + QUIET - 0.1, (min(sent), stream_ended)
            requests = fake.chat_requests()
            assert "running summary" not in str(requests[1].json()["messages"][0])
            activity = engram.app[SERVICES].activity
            assert activity.delayed >= 1 and activity.forced == 0
            assert activity.in_flight == 0
            async with http.get(engram.url + "/engram/metrics") as r:
                metrics = await r.text()
            assert "engram_own_calls_delayed_total" in metrics
            assert "engram_upstream_requests_in_flight 0" in metrics
        finally:
            await engram.close()


@pytest.mark.asyncio
async def test_without_the_wait_the_summary_lands_mid_stream(
    http: aiohttp.ClientSession,
) -> None:
    """The same conversation with ``own_calls_max_wait = 0`` (never wait): the summary reaches
    the upstream while the user's reply still streams, which is what the wait prevents."""
    async with FakeUpstream(n_ctx=2048) as fake:
        fake.enqueue(
            JsonReply(chat_completion("Question 3 was about lorem.")),
            StreamReply(chat_chunks(["Once"] * STREAM_PARTS), delay=STREAM_GAP),
            *[JsonReply(chat_completion(SUMMARY)) for _ in range(30)],
        )
        engram = await start(fake, own_calls_max_wait=0.0)
        try:
            stream_ended = await chat_then_slow_stream(http, engram)
            await settle(engram)
            sent = summary_requests(fake)
            assert sent and min(sent) < stream_ended
        finally:
            await engram.close()
