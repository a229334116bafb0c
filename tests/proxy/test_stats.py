"""The feedback loop's figures: GET /engram/api/stats, `engram stats`, counters across restarts."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.cli.main import main
from proxy.services import SERVICES
from testing.fake_chunks import chat_completion
from testing.fake_upstream import FakeUpstream, JsonReply
from testing.harness import Engram, settle, start_engram
from tests.proxy.test_subagents import HANDBACK

FILLER = "Let us talk about the weather and nothing in particular. " * 150


async def chat(
    http: aiohttp.ClientSession, e: Engram, text: str, user: str = "u", **headers: str
) -> dict[str, str]:
    async with http.post(
        e.url + "/v1/chat/completions",
        headers={"X-Engram-User": user, **headers},
        json={"messages": [{"role": "user", "content": text}]},
    ) as r:
        assert r.status == 200
        return dict(r.headers)


async def api(
    http: aiohttp.ClientSession,
    e: Engram,
    method: str,
    path: str,
    body: Any = None,
    user: str = "u",
) -> Any:
    async with http.request(
        method, f"{e.url}/engram/api/{path}", headers={"X-Engram-User": user}, json=body
    ) as r:
        assert r.status < 300, await r.text()
        return await r.json()


async def start(fake: FakeUpstream, db: Path) -> Engram:
    return await start_engram(
        fake.url,
        memory={"db_path": str(db)},
        summary={"enabled": False, "budget_share": 0.5},
        consolidation={"budget_share": 0.5, "max_tokens": 64, "interval": 0},
    )


@pytest.mark.asyncio
async def test_stats_endpoint_cli_and_restart(
    fake: FakeUpstream,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in list(os.environ):
        if name.startswith("ENGRAM_"):
            monkeypatch.delenv(name)
    db = tmp_path / "engram.db"
    e = await start(fake, db)
    try:
        top = (await chat(http, e, "My sister Ilse moved to Tromso."))["X-Engram-Session"]
        await chat(http, e, FILLER, **{"X-Engram-Session": "filler"})
        kid = (await chat(http, e, "reading the tracker", **{"X-Engram-Parent": top}))[
            "X-Engram-Session"
        ]
        bad = (await chat(http, e, "Where does Ilse live?"))["X-Engram-Request-Id"]
        worse = (await chat(http, e, "And her job?"))["X-Engram-Request-Id"]
        good = (await chat(http, e, "thanks"))["X-Engram-Request-Id"]
        await settle(e)
        fake.enqueue(JsonReply(chat_completion(HANDBACK)))
        await api(http, e, "POST", f"sessions/{kid}/complete")
        await settle(e)
        for rid, helpful in ((bad, False), (good, True)):
            await api(http, e, "POST", "feedback", {"request_id": rid, "helpful": helpful})
        fake.enqueue(JsonReply(chat_completion("Ilse: lives in Tromso since 2023")))
        report = await api(http, e, "POST", "consolidate")
        assert report["facts"] == 1
        await api(http, e, "POST", "feedback", {"request_id": worse, "helpful": False})
        stats = await api(http, e, "GET", "stats")
        tokens = stats["tokens"]
        assert tokens["proxied"] > 1000 and tokens["summaries"] > 0
        assert 0 < tokens["consolidation"] <= 0.5 * tokens["proxied"]
        assert tokens["consolidation_share"] == round(
            tokens["consolidation"] / tokens["proxied"], 6
        )
        assert tokens["consolidation_budget_share"] == 0.5
        assert tokens["summaries_budget_share"] == 0.5
        assert {k: stats[k] for k in ("handbacks", "facts", "feedback", "queue")} == {
            "handbacks": 1,
            "facts": 1,
            "feedback": {"unhelpful": 2, "helpful": 1},
            "queue": {"pending": 1, "done": 1, "failed": 0},
        }
        assert stats["requests"] == 6
        other = await api(http, e, "GET", "stats", user="someone-else")
        assert other["tokens"] == tokens  # the server's figures; the counts are the user's
        assert (other["facts"], other["handbacks"], other["queue"]["done"]) == (0, 0, 0)
        live = e.app[SERVICES].counters.current()
    finally:
        await e.close()  # the counters are saved at shutdown

    capsys.readouterr()
    assert await asyncio.to_thread(main, ["stats", "--db", str(db), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tokens"]["proxied"] == live["tokens_proxied"]
    assert data["tokens"]["summaries"] == live["tokens_summaries"]
    assert data["tokens"]["consolidation"] == live["tokens_consolidation"]
    assert (data["handbacks"], data["facts"], data["queue"]["pending"]) == (1, 1, 1)
    assert await asyncio.to_thread(main, ["stats", "--db", str(db)]) == 0
    text = capsys.readouterr().out
    assert f"tokens proxied  {live['tokens_proxied']}" in text
    # (the budget shown is the one configured where the command runs: the default here)
    assert f"consolidation {live['tokens_consolidation']} (" in text and "budget 5%)" in text
    assert "hand-backs      1" in text and "facts           1" in text
    assert "queue           1 pending, 1 done, 0 failed" in text
    assert "feedback        2 flagged, 1 helpful" in text

    # A restarted server goes on from the saved totals (and its budget with them).
    e = await start(fake, db)
    try:
        assert e.app[SERVICES].counters.current() == live
        await chat(http, e, "one more")
        await settle(e)
        grown = (await api(http, e, "GET", "stats"))["tokens"]
        assert grown["proxied"] > live["tokens_proxied"]
    finally:
        await e.close()
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["stats", "--db", str(db), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"]["proxied"] == grown["proxied"]
