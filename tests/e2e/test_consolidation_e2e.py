"""End to end with the real llama-server and tiny model: a flagged request is consolidated.

The 135M model is far too small to be relied on for facts: whatever it answers, consolidation
must either store parseable facts that the normal search then finds, or store nothing at all; its
spend is what llama-server reports and stays within its share.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from proxy.services import SERVICES
from testing.harness import Engram, settle, start_engram
from tests.e2e.conftest import LlamaServer

pytestmark = pytest.mark.asyncio

HEADERS = {"X-Engram-User": "e2e-facts"}


async def chat(http: aiohttp.ClientSession, e: Engram, text: str, session: str) -> str:
    async with http.post(
        e.url + "/v1/chat/completions",
        headers={**HEADERS, "X-Engram-Session": session},
        json={"messages": [{"role": "user", "content": text}], "max_tokens": 24},
    ) as r:
        assert r.status == 200, await r.text()
        return r.headers["X-Engram-Request-Id"]


async def rows(e: Engram) -> dict[str, int]:
    def count(c: Any) -> dict[str, int]:
        return {
            t: int(c.execute(f"SELECT count(*) FROM {t}").fetchone()[0])
            for t in ("sessions", "turns", "turns_fts", "turn_vec")
        }

    return await e.app[SERVICES].store.read(count)


async def test_real_model_consolidation_stores_facts_or_nothing(llama: LlamaServer) -> None:
    e = await start_engram(
        llama.url,
        summary={"enabled": False},
        consolidation={"budget_share": 0.5, "max_tokens": 96, "top_k": 4, "neighbours": 1},
    )
    try:
        async with aiohttp.ClientSession() as http:
            await chat(http, e, "My sister Ilse moved to Tromso in March 2023.", "story")
            for i in range(6):  # traffic, so that half of it pays for one consolidation
                await chat(http, e, f"Tell me a short fact about the number {i}.", "chatter")
            rid = await chat(http, e, "Where does my sister Ilse live now?", "question")
            await settle(e, timeout=120)
            async with http.post(
                e.url + "/engram/api/feedback",
                headers=HEADERS,
                json={"request_id": rid, "helpful": False, "note": "Ilse moved"},
            ) as r:
                assert r.status == 200
            before = await rows(e)
            async with http.post(e.url + "/engram/api/consolidate", headers=HEADERS) as r:
                assert r.status == 200
                report = await r.json()
            c = e.app[SERVICES].consolidator
            print(
                f"\nreal-model consolidation: {report}; spent {c.tokens_spent} of "
                f"{c.tokens_proxied} proxied"
            )
            facts = await e.app[SERVICES].store.read(
                lambda c: c.execute(
                    "SELECT speaker, content FROM turns WHERE role = 'fact'"
                ).fetchall()
            )
            print(f"facts: {facts}")
            assert report["processed"] == 1 and c.calls == 1
            assert 0 < c.tokens_spent <= 0.5 * c.tokens_proxied
            if report["facts"]:  # each is found by the normal search from now on
                assert len(facts) == report["facts"]
                for speaker, content in facts:
                    async with http.get(
                        e.url + "/engram/api/search",
                        headers=HEADERS,
                        params={"q": f"{speaker} {content}", "k": "20"},
                    ) as r:
                        hits = (await r.json())["results"]
                    assert any(h["role"] == "fact" and h["content"] == content for h in hits)
            else:  # junk: nothing written, the request waits for another try
                assert report["retried"] == 1
                assert await rows(e) == before
    finally:
        await e.close()
