"""No cross-site writes (issue 12, row 3), with the headers a browser sends, through a real Engram.

A page on another origin can send "simple" requests (``text/plain``, form and multipart bodies)
without a CORS preflight. Before: its ``text/plain`` JSON chat was stored in user ``default``
and its ``POST /engram/api/consolidate`` ran. Now such requests get 403 on every route, a
non-JSON body on a chat or admin route gets 415 from anyone, and CORS headers go to configured
origins on the proxied routes only. tests/proxy/test_browser.py does the same from a real
Chromium.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from proxy.services import SERVICES
from testing.fake_upstream import FakeUpstream, RawReply
from testing.harness import Engram, settle, start_engram

pytestmark = pytest.mark.asyncio

CHAT = json.dumps({"messages": [{"role": "user", "content": "cross-site canary 7f3a"}]})
PAGE = "http://127.0.0.1:9999"  # another port on the same host: Sec-Fetch-Site says same-site
EVIL = "http://evil.example"
APP = "http://localhost:3000"  # a configured web app
JSON = {"Content-Type": "application/json"}


@pytest_asyncio.fixture
async def quiet(fake: FakeUpstream) -> AsyncIterator[Engram]:
    """Engram with no background upstream calls of its own, so every upstream request counts."""
    e = await start_engram(
        fake.url,
        summary={"enabled": False},
        # Consolidation would run at once if asked: nothing but a request could start it.
        consolidation={"budget_share": 0.5, "interval": 0, "max_tokens": 64},
    )
    try:
        yield e
    finally:
        await e.close()


async def stored(engram: Engram) -> int:
    """Turns in memory, every user's."""
    await settle(engram)
    return int(
        await engram.app[SERVICES].store.read(
            lambda c: c.execute("SELECT count(*) FROM turns").fetchone()[0]
        )
    )


def browser(origin: str | None, site: str, **more: str) -> dict[str, str]:
    """The headers Chromium sends on a fetch() from a page at ``origin``."""
    headers = {"Sec-Fetch-Site": site, "Sec-Fetch-Mode": "no-cors", **more}
    if origin is not None:
        headers["Origin"] = origin
    return headers


def upload() -> aiohttp.FormData:
    """A multipart audio upload, as /v1/audio/transcriptions takes."""
    form = aiohttp.FormData()
    form.add_field("file", b"RIFF....WAVE", filename="a.wav", content_type="audio/wav")
    return form


async def error_of(r: aiohttp.ClientResponse, status: int, code: str) -> str:
    assert r.status == status, await r.text()
    err = (await r.json())["error"]
    assert err["code"] == code and set(err) == {"message", "type", "param", "code"}
    assert not [h for h in r.headers if h.lower().startswith("access-control-")]
    return str(err["message"])


@pytest.mark.parametrize(
    "headers",
    [
        browser(PAGE, "same-site"),
        browser(EVIL, "cross-site"),
        browser("null", "cross-site"),
        {"Origin": PAGE},  # a browser without Sec-Fetch-*
        {"Origin": "null"},
    ],
)
async def test_a_page_elsewhere_cannot_chat_into_memory(
    quiet: Engram, fake: FakeUpstream, http: aiohttp.ClientSession, headers: dict[str, str]
) -> None:
    before = len(fake.requests)
    for ct in ("text/plain;charset=UTF-8", "application/json"):
        async with http.post(
            quiet.url + "/v1/chat/completions", data=CHAT, headers={**headers, "Content-Type": ct}
        ) as r:
            message = await error_of(r, 403, "cross_site_request")
            assert "server.cors_origins" in message
    assert await stored(quiet) == 0
    assert len(fake.requests) == before


async def test_a_page_elsewhere_cannot_run_the_admin_api(
    quiet: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    # Something for consolidation to do, and the traffic to pay for it: a request flagged
    # unhelpful, by a real client.
    filler = json.dumps({"messages": [{"role": "user", "content": "Let us talk. " * 300}]})
    async with http.post(quiet.url + "/v1/chat/completions", data=filler, headers=JSON) as r:
        assert r.status == 200
    async with http.post(quiet.url + "/v1/chat/completions", data=CHAT, headers=JSON) as r:
        assert r.status == 200
        request_id = r.headers["X-Engram-Request-Id"]
    await settle(quiet)
    body = {"request_id": request_id, "helpful": False}
    async with http.post(quiet.url + "/engram/api/feedback", json=body) as r:
        assert r.status == 200 and (await r.json())["queued"]
    before, turns = len(fake.requests), await stored(quiet)
    attempts: list[tuple[str, str, dict[str, str], Any]] = [
        ("POST", "/engram/api/consolidate", browser(PAGE, "same-site"), None),
        ("POST", "/engram/api/consolidate", {"Origin": EVIL}, b""),
        ("POST", "/engram/api/consolidate", browser(EVIL, "cross-site"), {"a": "b"}),  # a form
        ("DELETE", "/engram/api/sessions/x", browser(PAGE, "same-site"), None),
        ("GET", "/engram/api/export", browser(PAGE, "same-site"), None),
        ("POST", "/engram/api/consolidate", browser(APP, "cross-site"), None),  # configured
    ]
    for method, path, headers, data in attempts:
        async with http.request(method, quiet.url + path, headers=headers, data=data) as r:
            await error_of(r, 403, "cross_site_request")
    assert len(fake.requests) == before  # no consolidation call reached the model
    assert await stored(quiet) == turns
    async with http.get(quiet.url + "/engram/api/stats") as r:
        assert (await r.json())["queue"]["pending"] == 1


async def test_a_page_elsewhere_cannot_reach_the_upstream(
    quiet: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    for headers in (browser(PAGE, "same-site"), {"Origin": EVIL}):
        before = len(fake.requests)
        async with http.post(
            quiet.url + "/v1/audio/transcriptions", data=upload(), headers=headers
        ) as r:
            await error_of(r, 403, "cross_site_request")
        async with http.options(
            quiet.url + "/v1/models",
            headers={**headers, "Access-Control-Request-Method": "POST"},
        ) as r:
            await error_of(r, 403, "cross_site_request")
        websocket = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13"}
        websocket["Sec-WebSocket-Key"] = "dGhlIHNhbXBsZSBub25jZQ=="
        async with http.get(quiet.url + "/v1/realtime", headers={**headers, **websocket}) as r:
            await error_of(r, 403, "cross_site_request")
        assert len(fake.requests) == before


async def test_non_browser_clients_and_own_pages_keep_working(
    quiet: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    # A multipart upload passed through untouched, from curl and from Engram's own origin.
    own = quiet.url  # http://127.0.0.1:<port>
    for headers in ({}, browser(own, "same-origin"), {"Origin": own}):
        fake.enqueue(RawReply(b'{"text": "hi"}'), path="/v1/audio/transcriptions")
        async with http.post(
            quiet.url + "/v1/audio/transcriptions", data=upload(), headers=headers
        ) as r:
            assert r.status == 200 and await r.json() == {"text": "hi"}
        sent = fake.requests[-1]
        assert sent.path == "/v1/audio/transcriptions" and b"RIFF....WAVE" in sent.body
        assert sent.headers["Content-Type"].startswith("multipart/form-data")
    # Chat from the SDKs (no browser headers) and from the own origin.
    for headers in ({}, browser(own, "same-origin"), {"Origin": own}):
        async with http.post(
            quiet.url + "/v1/chat/completions", data=CHAT, headers={**JSON, **headers}
        ) as r:
            assert r.status == 200
    assert await stored(quiet) == 6  # three turns, each a user message and a reply
    async with http.post(quiet.url + "/engram/api/consolidate") as r:  # no body, no type
        assert r.status == 200
    # A cross-site GET of a harmless read is left to the browser, which hides the answer.
    async with http.get(quiet.url + "/engram/health", headers=browser(EVIL, "cross-site")) as r:
        assert r.status == 200


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=xyz",
        "application/octet-stream",
        None,
    ],
)
@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/chat/completions", "/engram/api/feedback"]
)
async def test_json_routes_take_json_only(
    quiet: Engram,
    fake: FakeUpstream,
    http: aiohttp.ClientSession,
    path: str,
    content_type: str | None,
) -> None:
    before = len(fake.requests)
    skip = () if content_type else ("Content-Type",)
    headers = {"Content-Type": content_type} if content_type else {}
    async with http.post(
        quiet.url + path, data=CHAT.encode(), headers=headers, skip_auto_headers=skip
    ) as r:
        message = await error_of(r, 415, "unsupported_media_type")
        assert "application/json" in message
        assert (await r.json())["error"]["type"] == "invalid_request_error"
    assert await stored(quiet) == 0
    assert len(fake.requests) == before


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "application/x+json"]
)
async def test_json_in_its_forms_is_accepted(
    quiet: Engram, http: aiohttp.ClientSession, content_type: str
) -> None:
    async with http.post(
        quiet.url + "/v1/chat/completions", data=CHAT, headers={"Content-Type": content_type}
    ) as r:
        assert r.status == 200
    assert await stored(quiet) == 2


async def test_cors_for_configured_origins_on_proxied_routes_only(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await start_engram(
        fake.url, server={"cors_origins": [APP]}, summary={"enabled": False}
    )
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x"}
    try:
        # The configured web app: a preflight, then its JSON chat, both with CORS headers.
        headers = {"Origin": APP, "Sec-Fetch-Site": "cross-site", **preflight}
        async with http.options(engram.url + "/v1/chat/completions", headers=headers) as r:
            assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == APP
        headers = {"Origin": APP, "Sec-Fetch-Site": "cross-site", **JSON}
        async with http.post(engram.url + "/v1/chat/completions", data=CHAT, headers=headers) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == APP
            assert "Origin" in r.headers["Vary"]
        # ... but never on /engram/, whatever the method.
        for method in ("OPTIONS", "GET", "POST"):
            headers = {"Origin": APP, "Sec-Fetch-Site": "cross-site"}
            if method == "OPTIONS":
                headers.update(preflight)
            async with http.request(method, engram.url + "/engram/api/stats", headers=headers) as r:
                await error_of(r, 403, "cross_site_request")
        async with http.get(engram.url + "/engram/health", headers={"Origin": APP}) as r:
            assert r.status == 200
            assert not [h for h in r.headers if h.lower().startswith("access-control-")]
        # Another origin gets no preflight, and not the upstream's own "*" either.
        headers = {"Origin": EVIL, "Sec-Fetch-Site": "cross-site", **preflight}
        async with http.options(engram.url + "/v1/chat/completions", headers=headers) as r:
            await error_of(r, 403, "cross_site_request")
        fake.enqueue(RawReply(b"{}", headers={"Access-Control-Allow-Origin": "*"}), path="/v1/m")
        async with http.get(engram.url + "/v1/m", headers={"Origin": EVIL}) as r:
            assert r.status == 200
            assert not [h for h in r.headers if h.lower().startswith("access-control-")]
    finally:
        await engram.close()
