"""What the model server computed and reused of each prompt, shown by the inspector and counted in
/engram/metrics: through a running Engram, a fake llama-server that reports its KV cache as the
real one does (``timings``, ``usage.prompt_tokens_details``), plain and streamed replies, and a
chat API it lacks (Ollama's ``/api/chat``, translated: the figures are the upstream's own)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from testing.fake_chunks import chat_chunks
from testing.fake_upstream import FakeUpstream, StreamReply
from testing.harness import Engram, settle, start_engram

pytestmark = pytest.mark.asyncio

ADMIN = "prompt-cost-admin-token-" + "x" * 24
SESSION = {"X-Engram-Session": "cost-talk"}


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(kv_cache=True) as upstream:
        yield upstream


@pytest_asyncio.fixture
async def engram(fake: FakeUpstream) -> AsyncIterator[Engram]:
    e = await start_engram(fake.url, memory={"admin_token": ADMIN}, auth={"loopback_admin": False})
    try:
        yield e
    finally:
        await e.close()


@pytest_asyncio.fixture
async def signed(engram: Engram) -> AsyncIterator[aiohttp.ClientSession]:
    """A browser's session, signed in to the inspector with the admin token."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        async with s.post(
            engram.url + "/engram/signin", data={"token": ADMIN}, allow_redirects=False
        ) as r:
            assert r.status == 303, await r.text()
        yield s


async def page_text(s: aiohttp.ClientSession, engram: Engram, path: str) -> str:
    async with s.get(engram.url + "/engram" + path) as r:
        html = await r.text()
        assert r.status == 200, html[:500]
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def timings_of(raw: bytes, streamed: bool) -> dict[str, Any]:
    """The ``timings`` the upstream sent (relayed to the client as they came)."""
    if not streamed:
        found: dict[str, Any] = json.loads(raw)["timings"]
        return found
    for line in raw.decode().splitlines():
        if line.startswith("data: {") and '"timings"' in line:
            found = json.loads(line[len("data: ") :])["timings"]
    return found


async def chat(
    http: aiohttp.ClientSession, engram: Engram, messages: list[dict[str, Any]], stream: bool
) -> tuple[str, bytes]:
    body = {"model": "m", "messages": messages, "stream": stream}
    async with http.post(engram.base_url + "/chat/completions", json=body, headers=SESSION) as r:
        raw = await r.read()
        assert r.status == 200, raw
        return r.headers["X-Engram-Request-Id"], raw


def line(computed: int, reused: int) -> str:
    pct = f"{reused / (computed + reused) * 100:.1f}"
    return (
        f"model server: computed {computed} prompt tokens, reused {reused} from its cache ({pct} %)"
    )


async def test_the_request_page_overview_and_metrics_show_what_the_server_reused(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession, signed: aiohttp.ClientSession
) -> None:
    history = [{"role": "user", "content": "My bicycle is a green Brompton with six gears."}]
    first, raw = await chat(http, engram, history, stream=False)
    t1 = timings_of(raw, streamed=False)
    reply = json.loads(raw)["choices"][0]["message"]["content"]
    history += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "How many gears did I say it has?"},
    ]
    second, raw = await chat(http, engram, history, stream=True)
    t2 = timings_of(raw, streamed=True)
    assert t1["cache_n"] == 0 and t2["cache_n"] > 0  # the second extends the first's prompt
    await settle(engram)

    text = await page_text(signed, engram, f"/requests/{first}")
    assert line(t1["prompt_n"], 0) in text, text
    text = await page_text(signed, engram, f"/requests/{second}")
    assert line(t2["prompt_n"], t2["cache_n"]) + " (from its " in text, text

    computed = t1["prompt_n"] + t2["prompt_n"]
    reused = t1["cache_n"] + t2["cache_n"]
    overview = await page_text(signed, engram, "/")
    share = f"{reused / (computed + reused) * 100:.1f}"
    assert (
        f"reused {share} % of the prompt tokens over the 2 recent requests that reported it: "
        f"computed {computed}, reused {reused}"
    ) in overview, overview

    # A streamed reply without usage or timings: said so, and left out of the share.
    fake.enqueue(StreamReply(chat_chunks(["plain"])))
    third, _ = await chat(http, engram, [{"role": "user", "content": "something else"}], True)
    await settle(engram)
    text = await page_text(signed, engram, f"/requests/{third}")
    assert "model server: not reported by the upstream" in text
    assert "over the 2 recent requests" in await page_text(signed, engram, "/")

    async with http.get(
        engram.url + "/engram/metrics", headers={"Authorization": f"Bearer {ADMIN}"}
    ) as r:
        metrics = await r.text()
    assert f"engram_upstream_prompt_tokens_computed_total {computed}\n" in metrics
    assert f"engram_upstream_prompt_tokens_reused_total {reused}\n" in metrics
    assert "engram_upstream_prompt_reports_total 2\n" in metrics


@pytest.mark.parametrize("stream", [False, True])
async def test_beneath_a_translation_the_figures_are_the_upstreams_own(
    engram: Engram,
    fake: FakeUpstream,
    http: aiohttp.ClientSession,
    signed: aiohttp.ClientSession,
    stream: bool,
) -> None:
    """Ollama's /api/chat on llama-server (no such route: translated to chat completions). The
    Ollama reply has only ``prompt_eval_count``; the page shows the split llama-server sent.
    The second request resends the first's prompt: most of it is reused."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}],
        "stream": stream,
    }
    ids = []
    for _ in range(2):
        async with http.post(engram.url + "/api/chat", json=body, headers=SESSION) as r:
            raw = await r.read()
            assert r.status == 200, raw
            assert b"timings" not in raw and b"prompt_eval_count" in raw  # Ollama's shape
            ids.append(r.headers["X-Engram-Request-Id"])
    await settle(engram)
    assert [q.path for q in fake.requests if q.method == "POST"][-1] == "/v1/chat/completions"
    assert fake.kv_cache is not None and fake.kv_cache.last is not None
    computed, reused = fake.kv_cache.last
    assert reused > 0
    text = await page_text(signed, engram, f"/requests/{ids[-1]}")
    assert line(computed, reused) in text, text
