"""Cross-site writes from a real browser (issue 12, row 3): headless Chromium (Debian's package)
loads a hostile page from another port — once as ``127.0.0.1`` (same-site to Engram: only the
port differs) and once as ``localhost`` (cross-site) — whose script posts to Engram: ``text/plain``
JSON chat (no preflight), ``application/json`` chat (preflight), a text/plain <form> whose body
parses as JSON, a chat from a sandboxed frame (``Origin: null``), ``/engram/api/consolidate`` by
fetch and by <form>, a multipart upload and a text/plain post to pass-through routes.

Before the change the text/plain chat was stored in ``default`` and consolidation ran. Now
nothing is stored, the flagged request is still waiting, and Engram's access log shows each chat
and admin request arrived and got a 403. The pass-through posts reach the model server, as they
would without Engram: nothing of Engram's is behind those routes (``proxy.guard``). A web app
whose origin is listed in ``server.cors_origins`` still chats through CORS (and reads Engram's
headers), but never reaches the admin API.

Chromium missing: skipped with the reason; under CI (``CI=true``) that is a failure, since
``make test`` installs it (see the Makefile).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from proxy.services import SERVICES
from testing.browser import Chromium, chromium_or_skip
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, settle, start_engram

pytestmark = pytest.mark.asyncio

PAGE = Path(__file__).parent / "browser" / "attack.html"
CHAT = {"messages": [{"role": "user", "content": "a legitimate question"}]}
# Enough traffic to pay for a consolidation call at budget_share 0.5.
FILLER = {"messages": [{"role": "user", "content": "Let us talk about the weather. " * 150}]}


@pytest.fixture
def chromium() -> str:
    return chromium_or_skip()


@pytest_asyncio.fixture
async def attacker() -> AsyncIterator[int]:
    """The hostile page, served by a real aiohttp server on its own port."""

    async def page(request: web.Request) -> web.Response:
        return web.Response(body=PAGE.read_bytes(), content_type="text/html")

    app = web.Application()
    app.router.add_get("/attack.html", page)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def memory_state(engram: Engram, http: aiohttp.ClientSession) -> dict[str, Any]:
    """What a write would change: the turns (every user's) and the consolidation queue."""
    await settle(engram)
    turns = await engram.app[SERVICES].store.read(
        lambda c: [str(r[0]) for r in c.execute("SELECT content FROM turns")]
    )
    async with http.get(engram.url + "/engram/api/stats") as r:
        assert r.status == 200
        queue = (await r.json())["queue"]
    return {"turns": sorted(turns), "queue": queue}


async def test_a_page_on_another_origin_writes_nothing(
    chromium: str,
    attacker: int,
    fake: FakeUpstream,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="engram.access")
    engram = await start_engram(
        fake.url,
        server={"access_log": True},
        summary={"enabled": False},
        # Consolidation would run at once if asked: nothing but the attack could start it.
        consolidation={"budget_share": 0.5, "interval": 0, "max_tokens": 64},
    )
    try:
        # Before: a legitimate client chats, and flags an answer for consolidation.
        async with http.post(engram.url + "/v1/chat/completions", json=FILLER) as r:
            assert r.status == 200
        async with http.post(engram.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
            request_id = r.headers["X-Engram-Request-Id"]
        feedback = {"request_id": request_id, "helpful": False}
        async with http.post(engram.url + "/engram/api/feedback", json=feedback) as r:
            assert r.status == 200 and (await r.json())["queued"]
        before = await memory_state(engram, http)
        assert before["queue"]["pending"] == 1 and len(before["turns"]) == 4
        upstream_before = len(fake.requests)

        results: dict[str, Any] = {}
        seen: dict[str, list[tuple[str, str, int]]] = {}
        async with Chromium.start(chromium) as browser:
            for host in ("127.0.0.1", "localhost"):  # same-site, then cross-site
                caplog.clear()
                page = await browser.open(f"http://{host}:{attacker}/attack.html")
                results[host] = await page.evaluate(f"attack({json.dumps(engram.url)})", 60)
                await settle(engram)
                seen[host] = [
                    (r.fields["method"], r.fields["path"], r.fields["status"])  # type: ignore[attr-defined]
                    for r in caplog.records
                    if r.name == "engram.access"
                ]
        print(f"\nbrowser results: {json.dumps(results, indent=1)}")

        # After: nothing stored, nothing consolidated; only the pass-through posts reached the
        # model server, once from each page.
        assert await memory_state(engram, http) == before
        reached = sorted((r.method, r.path) for r in fake.requests[upstream_before:])
        passed = [("POST", "/v1/audio/transcriptions"), ("POST", "/v1/completions")]
        assert reached == sorted(passed * 2), reached
        for host, out in results.items():
            # Every attempt reached Engram (the browser did send them) ...
            assert {path for _, path, _ in seen[host]} == {
                "/v1/chat/completions",
                "/engram/api/consolidate",
                "/v1/audio/transcriptions",
                "/v1/completions",
            }, (host, seen[host])
            # ... the chat and admin ones got a 403, the pass-through ones the upstream's answer.
            guarded = [(m, p, st) for m, p, st in seen[host] if (m, p) not in passed]
            assert guarded and all(st == 403 for _, _, st in guarded), (host, seen[host])
            relayed = sorted((p, st) for m, p, st in seen[host] if (m, p) in passed)
            assert relayed == [("/v1/audio/transcriptions", 404), ("/v1/completions", 200)], (
                host,
                seen[host],
            )
            # ... the JSON chat stopped at its preflight ...
            assert ("OPTIONS", "/v1/chat/completions", 403) in seen[host]
            assert out["json_chat"] == "blocked TypeError", (host, out)
            # ... and the others were sent, their answers hidden from the page.
            assert out["plain_chat"] == "sent opaque 0", (host, out)
            assert out["sandboxed_chat"] == "sent opaque", (host, out)
            assert out["form_chat"] == out["form_consolidate"] == "submitted", (host, out)
        # The legitimate client still works.
        async with http.post(engram.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
    finally:
        await engram.close()


async def test_a_configured_web_app_chats_through_cors_but_never_reaches_the_admin_api(
    chromium: str, attacker: int, fake: FakeUpstream
) -> None:
    app = f"http://localhost:{attacker}"
    engram = await start_engram(
        fake.url, server={"cors_origins": [app]}, summary={"enabled": False}
    )
    try:
        async with Chromium.start(chromium) as browser:
            page = await browser.open(app + "/attack.html")
            out = await page.evaluate(f"friend({json.dumps(engram.url)})", 60)
            assert out["chat"] == "200 echo: a configured app's question", out
            assert out["memories"] == "0", out  # Engram's headers are exposed to it
            assert out["stats"] == "blocked TypeError", out  # 403, and no CORS headers
            # The same page from an origin not listed (127.0.0.1: same-site) is refused.
            page = await browser.open(f"http://127.0.0.1:{attacker}/attack.html")
            other = await page.evaluate(f"friend({json.dumps(engram.url)})", 60)
            assert other["chat"] == "blocked TypeError", other
        await settle(engram)
        turns = await engram.app[SERVICES].store.read(
            lambda c: [str(r[0]) for r in c.execute("SELECT content FROM turns")]
        )
        assert sorted(turns) == ["a configured app's question", "echo: a configured app's question"]
    finally:
        await engram.close()
