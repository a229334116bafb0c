"""No cross-site writes to memory (issue 12, row 3), and CORS transparency where Engram protects
nothing, with the headers a browser sends, through a real Engram.

A page on another origin can send "simple" requests (``text/plain``, form and multipart bodies)
without a CORS preflight. Before: its ``text/plain`` JSON chat was stored in user ``default``
and its ``POST /engram/api/consolidate`` ran. Now such requests get 403 on chat routes while
memory is on and on Engram's own routes, a non-JSON body on a chat or admin route gets 415 from
anyone, and CORS headers go to configured origins on those guarded routes only.

Where there is nothing to protect — a pass-through route, or a chat route with memory disabled
for the whole server, and Engram adds no credential (no ``upstream.api_key`` without accounts) —
Engram is transparent: preflights are answered by the upstream, cross-site requests go through,
the upstream's CORS headers come back unchanged (llama.cpp's own CORS tests, through Engram).
tests/proxy/test_browser.py does the same from a real Chromium.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from proxy.chat.apis import chat_apis
from proxy.cli.main import main as engram_main
from proxy.guard import CHAT_PATHS
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


LLAMA_PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "Authorization",
}
# tools/server/tests/unit/test_security.py::test_cors_options in llama.cpp
LLAMA_CORS_ROWS = [
    ("localhost", "Access-Control-Allow-Origin", "localhost"),
    ("web.mydomain.fr", "Access-Control-Allow-Origin", "web.mydomain.fr"),
    ("origin", "Access-Control-Allow-Credentials", "true"),
    ("web.mydomain.fr", "Access-Control-Allow-Methods", "GET, POST"),
    ("web.mydomain.fr", "Access-Control-Allow-Headers", "*"),
]


def cors_headers(r: aiohttp.ClientResponse) -> dict[str, str]:
    return {k.lower(): v for k, v in r.headers.items() if k.lower().startswith("access-control-")}


@pytest_asyncio.fixture
async def llama() -> AsyncIterator[FakeUpstream]:
    """A fake upstream that answers CORS as llama-server does."""
    async with FakeUpstream(cors=True) as upstream:
        yield upstream


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


async def test_a_page_elsewhere_reaches_pass_through_routes_as_it_would_the_upstream(
    quiet: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """Nothing of Engram's is behind a pass-through route: what the page may do there is the
    upstream's to decide, and the upstream's answer (CORS headers included) comes back."""
    for headers in (browser(PAGE, "same-site"), {"Origin": EVIL}):
        before = len(fake.requests)
        fake.enqueue(
            RawReply(b'{"text": "hi"}', headers={"Access-Control-Allow-Origin": "*"}),
            path="/v1/audio/transcriptions",
        )
        async with http.post(
            quiet.url + "/v1/audio/transcriptions", data=upload(), headers=headers
        ) as r:
            assert r.status == 200 and await r.json() == {"text": "hi"}
            assert r.headers.getall("Access-Control-Allow-Origin") == ["*"]
        # The preflight goes to the upstream, whose answer (here the fake's 404) is relayed.
        async with http.options(
            quiet.url + "/v1/models",
            headers={**headers, "Access-Control-Request-Method": "POST"},
        ) as r:
            assert r.status == 404 and "File Not Found" in await r.text()
        websocket = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13"}
        websocket["Sec-WebSocket-Key"] = "dGhlIHNhbXBsZSBub25jZQ=="
        async with http.get(quiet.url + "/v1/realtime", headers={**headers, **websocket}) as r:
            assert r.status == 404  # the upstream's answer, not Engram's refusal
        sent = [(q.method, q.path) for q in fake.requests[before:]]
        assert sent == [
            ("POST", "/v1/audio/transcriptions"),
            ("OPTIONS", "/v1/models"),
            ("GET", "/v1/realtime"),
        ]
        assert b"RIFF....WAVE" in fake.requests[before].body
    assert await stored(quiet) == 0


async def test_with_an_upstream_key_a_page_elsewhere_cannot_reach_the_upstream(
    http: aiohttp.ClientSession,
) -> None:
    """``upstream.api_key`` without accounts: every request would carry Engram's key, so a page
    may not borrow it, on any route (today's rule): no write, no preflight forwarded."""
    async with FakeUpstream(cors=True) as fake:
        engram = await start_engram(
            fake.url, upstream={"api_key": "sk-upstream-secret"}, summary={"enabled": False}
        )
        try:
            before = len(fake.requests)
            for headers in (browser(PAGE, "same-site"), {"Origin": EVIL}):
                async with http.post(
                    engram.url + "/v1/audio/transcriptions", data=upload(), headers=headers
                ) as r:
                    await error_of(r, 403, "cross_site_request")
                async with http.post(
                    engram.url + "/completions",
                    data=json.dumps({"prompt": "x"}),
                    headers={**headers, **JSON},
                ) as r:
                    await error_of(r, 403, "cross_site_request")
                for path in ("/v1/models", "/completions"):
                    async with http.options(
                        engram.url + path, headers={**headers, **LLAMA_PREFLIGHT}
                    ) as r:
                        await error_of(r, 403, "cross_site_request")
                websocket = {"Upgrade": "websocket", "Connection": "Upgrade"}
                websocket.update({"Sec-WebSocket-Version": "13", "Sec-WebSocket-Key": "x"})
                async with http.get(
                    engram.url + "/v1/realtime", headers={**headers, **websocket}
                ) as r:
                    await error_of(r, 403, "cross_site_request")
            assert len(fake.requests) == before
            # Clients that are not browsers still get through, with Engram's key.
            async with http.post(engram.url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200
            assert fake.requests[-1].headers["Authorization"] == "Bearer sk-upstream-secret"
        finally:
            await engram.close()


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
        # Another origin gets no preflight on a chat route while memory is on.
        headers = {"Origin": EVIL, "Sec-Fetch-Site": "cross-site", **preflight}
        async with http.options(engram.url + "/v1/chat/completions", headers=headers) as r:
            await error_of(r, 403, "cross_site_request")
        # A pass-through route is the upstream's: its own CORS headers, as sent, to any origin,
        # and none of Engram's, configured origin or not; the preflight goes to the upstream.
        for origin in (EVIL, APP):
            fake.enqueue(
                RawReply(b"{}", headers={"Access-Control-Allow-Origin": "*"}), path="/v1/m"
            )
            async with http.get(engram.url + "/v1/m", headers={"Origin": origin}) as r:
                assert r.status == 200
                assert cors_headers(r) == {"access-control-allow-origin": "*"}
                assert "Vary" not in r.headers
            before = len(fake.requests)
            async with http.options(
                engram.url + "/v1/models", headers={"Origin": origin, **preflight}
            ) as r:
                assert r.status == 404 and cors_headers(r) == {}  # the fake's answer
            assert [(q.method, q.path) for q in fake.requests[before:]] == [
                ("OPTIONS", "/v1/models")
            ]
    finally:
        await engram.close()


# --- transparency: llama.cpp's own CORS tests through Engram -------------------------------------


@pytest.mark.parametrize(
    ("memory", "path"),
    [
        (True, "/completions"),
        (False, "/completions"),
        (False, "/v1/chat/completions"),
    ],
)
@pytest.mark.parametrize(("origin", "cors_header", "cors_header_value"), LLAMA_CORS_ROWS)
async def test_llama_cpp_cors_options(
    llama: FakeUpstream,
    http: aiohttp.ClientSession,
    memory: bool,
    path: str,
    origin: str,
    cors_header: str,
    cors_header_value: str,
) -> None:
    engram = await start_engram(llama.url, memory={"enabled": memory}, summary={"enabled": False})
    try:
        # Direct and through Engram: the same answer.
        for base in (llama.url, engram.url):
            async with http.options(
                base + path, headers={"Origin": origin, **LLAMA_PREFLIGHT}
            ) as r:
                assert r.status == 200, await r.text()
                assert r.headers[cors_header] == cors_header_value
                assert r.headers["Access-Control-Allow-Origin"] == origin
                assert len(cors_headers(r)) == 4  # the upstream's four, none of Engram's
        sent = [(q.method, q.path) for q in llama.requests if q.method == "OPTIONS"]
        assert sent == [("OPTIONS", path)] * 2
    finally:
        await engram.close()


async def test_a_cross_site_post_to_a_pass_through_route_goes_through(
    llama: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await start_engram(llama.url, summary={"enabled": False})
    try:
        for headers in (browser(EVIL, "cross-site"), {"Origin": EVIL}, browser("null", "x")):
            origin = headers["Origin"]
            for ct in ("text/plain;charset=UTF-8", "application/json"):
                async with http.post(
                    engram.url + "/v1/completions",
                    data=json.dumps({"prompt": "hello"}),
                    headers={**headers, "Content-Type": ct},
                ) as r:
                    assert r.status == 200, await r.text()
                    assert "echo: hello" in await r.text()
                    assert cors_headers(r) == {"access-control-allow-origin": origin}
                    assert llama.requests[-1].path == "/v1/completions"
        assert await stored(engram) == 0
    finally:
        await engram.close()


async def test_a_cross_site_chat_with_memory_on_is_still_refused(
    llama: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """An upstream that allows every origin changes nothing for memory."""
    engram = await start_engram(llama.url, summary={"enabled": False})
    try:
        before = len(llama.requests)
        for path in sorted(CHAT_PATHS):
            # (each in its own API's error shape)
            async with http.options(
                engram.url + path, headers={"Origin": EVIL, **LLAMA_PREFLIGHT}
            ) as r:
                assert r.status == 403 and "Cross-site request refused" in await r.text()
                assert cors_headers(r) == {}
            async with http.post(
                engram.url + path, data=CHAT, headers={"Origin": EVIL, **JSON}
            ) as r:
                assert r.status == 403 and "Cross-site request refused" in await r.text()
                assert cors_headers(r) == {}
        assert len(llama.requests) == before
        assert await stored(engram) == 0
    finally:
        await engram.close()


async def test_every_chat_route_is_guarded() -> None:
    """guard.CHAT_PATHS names every path a chat adapter serves: one left out would be a
    pass-through route to the guard, open to any page, while the pipeline stores its turns."""
    assert {path for api in chat_apis() for path in api.paths} == CHAT_PATHS


async def test_with_memory_disabled_a_page_may_chat_but_not_reach_engram(
    llama: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await start_engram(llama.url, memory={"enabled": False})
    try:
        async with http.post(
            engram.url + "/v1/chat/completions",
            data=CHAT,
            headers={**browser(EVIL, "cross-site"), **JSON},
        ) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"][0]["message"]["content"].startswith("echo: ")
        # Chat routes still take JSON only (from anyone).
        async with http.post(
            engram.url + "/v1/chat/completions",
            data=CHAT,
            headers={"Origin": EVIL, "Content-Type": "text/plain"},
        ) as r:
            await error_of(r, 415, "unsupported_media_type")
        before = len(llama.requests)
        # Engram's own routes answer their own origin only, memory or not.
        for method, path in (("GET", "/engram/api/stats"), ("POST", "/engram/api/consolidate")):
            async with http.request(
                method, engram.url + path, headers=browser(EVIL, "cross-site")
            ) as r:
                await error_of(r, 403, "cross_site_request")
        async with http.options(
            engram.url + "/engram/api/search", headers={"Origin": EVIL, **LLAMA_PREFLIGHT}
        ) as r:
            await error_of(r, 403, "cross_site_request")
        assert len(llama.requests) == before
        # ... and the Host allow-list holds for every request.
        async with http.options(
            engram.url + "/completions",
            headers={"Origin": EVIL, "Host": "evil.example", **LLAMA_PREFLIGHT},
        ) as r:
            await error_of(r, 403, "host_not_allowed")
        assert len(llama.requests) == before
    finally:
        await engram.close()


async def test_with_memory_disabled_a_chat_carries_the_upstreams_cors_headers(
    llama: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await start_engram(llama.url, memory={"enabled": False})
    try:
        async with http.post(
            engram.url + "/v1/chat/completions", data=CHAT, headers={"Origin": EVIL, **JSON}
        ) as r:
            assert r.status == 200
            assert cors_headers(r) == {"access-control-allow-origin": EVIL}
    finally:
        await engram.close()


async def test_with_accounts_a_preflight_needs_no_key_but_the_request_does(
    llama: FakeUpstream, http: aiohttp.ClientSession, capsys: pytest.CaptureFixture[str]
) -> None:
    """``auth.mode = "keys"`` (an ``upstream.api_key`` too): Engram adds no credential a page
    could borrow, since a request must show one of Engram's keys first. A preflight, which a
    browser never sends with credentials, goes to the upstream without one."""
    engram = await start_engram(
        llama.url,
        auth={"mode": "keys", "loopback_admin": False},
        upstream={"api_key": "sk-upstream-secret"},
        summary={"enabled": False},
    )
    try:
        argv = ["keys", "create", "--user", "alice", "--db", f"{engram.tmp.name}/engram.db"]
        assert await asyncio.to_thread(engram_main, argv) == 0
        key = capsys.readouterr().out.strip().splitlines()[-1]
        async with http.options(
            engram.url + "/completions", headers={"Origin": EVIL, **LLAMA_PREFLIGHT}
        ) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == EVIL
        body = json.dumps({"prompt": "hi"})
        async with http.post(
            engram.url + "/v1/completions", data=body, headers={"Origin": EVIL, **JSON}
        ) as r:
            await error_of(r, 401, "missing_api_key")
        auth = {"Authorization": f"Bearer {key}"}
        async with http.post(
            engram.url + "/v1/completions", data=body, headers={"Origin": EVIL, **JSON, **auth}
        ) as r:
            assert r.status == 200 and cors_headers(r) == {"access-control-allow-origin": EVIL}
        assert llama.requests[-1].headers["Authorization"] == "Bearer sk-upstream-secret"
        # Chat with memory on stays Engram's: no preflight forwarded, key or not.
        async with http.options(
            engram.url + "/v1/chat/completions", headers={"Origin": EVIL, **LLAMA_PREFLIGHT}
        ) as r:
            await error_of(r, 403, "cross_site_request")
    finally:
        await engram.close()
