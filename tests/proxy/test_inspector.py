"""The inspector at /engram/ in a real browser (issue 23): headless Chromium (Debian's package)
driven over the DevTools protocol against a running Engram with real SQLite, a real upstream
HTTP server (the fake), and chats sent through /v1/chat/completions.

Each test writes screenshots under ``build/screenshots/`` (``$ENGRAM_SCREENSHOTS`` to choose);
docs/inspector.md shows the overview's. Chromium missing: skipped with the reason, a failure under
CI.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from proxy.cli.main import main as engram_main
from proxy.services import SERVICES
from testing.browser import Chromium, Page, chromium_or_skip
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, settle, start_engram

pytestmark = pytest.mark.asyncio

ADMIN = "inspector-admin-token-" + "x" * 24
SHOTS = Path(os.environ.get("ENGRAM_SCREENSHOTS", Path(__file__).parents[2] / "build/screenshots"))
REAL_MODEL = {"model": "engram/all-MiniLM-L6-v2-q8"}
PAGES = ("/", "/sessions", "/search?q=sister", "/requests", "/memory", "/slots")


@pytest.fixture
def chromium() -> str:
    return chromium_or_skip()


@pytest_asyncio.fixture
async def browser(chromium: str) -> AsyncIterator[Chromium]:
    async with Chromium.start(chromium) as b:
        yield b


async def chat(
    http: aiohttp.ClientSession,
    engram: Engram,
    text: str,
    headers: dict[str, str] | None = None,
) -> aiohttp.ClientResponse:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    async with http.post(
        engram.base_url + "/chat/completions", json=body, headers=headers or {}
    ) as r:
        await r.read()
        assert r.status == 200, await r.text()
        return r


async def sign_in(page: Page, engram: Engram, token: str) -> None:
    await page.goto(engram.url + "/engram/")
    assert (await page.url()).endswith("/engram/signin")  # not signed in: to the sign-in page
    await page.evaluate(f"document.getElementById('token').value = {json.dumps(token)}")
    await page.act("document.getElementById('signin').submit()")
    assert (await page.url()).rstrip("/").endswith("/engram"), await page.text()


async def open_page(page: Page, engram: Engram, path: str) -> str:
    await page.goto(engram.url + "/engram" + path)
    return await page.text()


def forwarded_text(fake: FakeUpstream) -> str:
    """What the last chat request forwarded to the upstream held."""
    return json.dumps(fake.chat_requests()[-1].json())


def file_bytes(engram: Engram) -> bytes:
    """The database's files, as they lie on disk."""
    paths = Path(engram.tmp.name).glob("engram.db*")
    return b"".join(p.read_bytes() for p in paths if p.is_file())


async def turn_rows(engram: Engram, sql: str, *args: Any) -> list[Any]:
    return await engram.app[SERVICES].store.read(lambda c: c.execute(sql, args).fetchall())


async def seeded(fake: FakeUpstream, http: aiohttp.ClientSession, **sections: Any) -> Engram:
    engram = await start_engram(
        fake.url,
        memory={"admin_token": ADMIN},
        auth={"loopback_admin": False},
        **sections,
    )
    for text in (
        "My sister Marta lives in Porto and breeds Siamese cats.",
        "I am planning a trip to Kyoto in the spring.",
        "Remind me that the garage code is walrus-4411.",
    ):
        await chat(http, engram, text)
    await settle(engram)
    return engram


async def test_sign_in_then_every_page_and_search_ranks(
    browser: Chromium, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await seeded(fake, http, embedder=REAL_MODEL)
    try:
        page = await browser.open("about:blank")
        await sign_in(page, engram, ADMIN)
        for path in PAGES:
            text = await open_page(page, engram, path)
            assert "server time" in text and "Sign in to" not in text, (path, text[:300])
            name = path.strip("/").split("?")[0] or "overview"
            await page.screenshot(SHOTS / f"inspector-{name}.png")
        overview = await open_page(page, engram, "/")
        assert "reachable" in overview and "default" in overview
        # Search, explained: the hit, its rank on each path, its fusion features.
        await page.goto(engram.url + "/engram/search?q=where+does+my+sister+live&mode=hybrid")
        hit = await page.evaluate(
            "(() => { const h = document.querySelector('.hit');"
            " return {text: h.querySelector('pre').innerText,"
            " fts: h.querySelector('.rank-fts').innerText,"
            " vec: h.querySelector('.rank-vec').innerText,"
            " features: [...h.querySelectorAll('.features td')].length,"
            " link: h.querySelector('.session-link').getAttribute('href')}; })()"
        )
        assert "Marta" in hit["text"]
        # the user's words or the model's echo of them: ranked on both paths
        assert hit["vec"] in ("1", "2") and hit["fts"] in ("1", "2"), hit
        assert hit["features"] == 8  # fts, vec, speaker, session, neighbour, length, time, when
        await page.screenshot(SHOTS / "inspector-search-explained.png")
        await page.goto(engram.url + hit["link"])
        assert "Marta" in await page.text()
    finally:
        await engram.close()


async def test_a_request_drawn_as_zones_adds_up(
    browser: Chromium, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await seeded(fake, http)
    try:
        r = await chat(http, engram, "Where does my sister Marta live?")
        request_id = r.headers["X-Engram-Request-Id"]
        forwarded = int(r.headers["X-Engram-Prompt-Tokens"].split("/")[0])
        page = await browser.open("about:blank")
        await sign_in(page, engram, ADMIN)
        await open_page(page, engram, "/requests")
        await page.act(f"document.querySelector('tr[data-request=\"{request_id}\"] a').click()")
        zones = await page.evaluate(
            "Object.fromEntries([...document.querySelectorAll('.zone-row')].map("
            "r => [r.dataset.zone, +r.querySelector('.tokens').innerText]))"
        )
        total = int(await page.evaluate("document.getElementById('total-tokens').innerText"))
        assert sum(zones.values()) == total == forwarded, (zones, total, forwarded)
        assert zones.get("memory", 0) > 0 and zones.get("current", 0) > 0
        bar = await page.evaluate(
            "[...document.querySelectorAll('svg.zonebar rect.zone')].map(r => +r.dataset.tokens)"
        )
        assert sum(bar) == total
        why = await page.evaluate(
            "[...document.querySelectorAll('#memories .turn')].map(d => d.innerText)"
        )
        assert any("Marta" in w and "why: search" in w for w in why), why
        await page.screenshot(SHOTS / "inspector-request.png")
        # helpful / not helpful posts feedback
        await page.act("document.getElementById('not-helpful').click()")
        assert "Feedback recorded" in await page.text()
        rows = await turn_rows(
            engram, "SELECT helpful FROM feedback WHERE request_id = ?", request_id
        )
        assert rows == [(0,)]
    finally:
        await engram.close()


# Where the page scrolls sideways and which chart (an svg, or the figure holding it) leaves
# the card it is drawn in (its section, or its table cell in a list).
CHARTS_FIT = """(() => {
  const root = document.documentElement;
  const out = {scroll: root.scrollWidth, width: root.clientWidth, charts: [], outside: []};
  for (const chart of document.querySelectorAll('main svg, main figure')) {
    const box = chart.getBoundingClientRect();
    if (box.width === 0) continue;
    const card = chart.closest('td, section') || chart.closest('main');
    const edge = card.getBoundingClientRect();
    const name = chart.tagName.toLowerCase() + '.' + (chart.getAttribute('class') || '')
      + ' in ' + card.tagName.toLowerCase() + '#' + (card.id || '');
    out.charts.push(name);
    if (box.left < edge.left - 0.5 || box.right > edge.right + 0.5) {
      out.outside.push({name, chart: [box.left, box.right], card: [edge.left, edge.right]});
    }
  }
  return out;
})()"""


async def test_charts_fit_their_cards_at_1280_and_800_pixels(
    browser: Chromium, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """Issue 39: the overview's sent-and-forwarded chart ran past its card at 1280 pixels and
    the whole page scrolled sideways. Every page with charts, at 1280 and at 800 pixels: no
    sideways scroll, every chart inside its card."""
    engram = await seeded(fake, http)
    try:
        for i in range(4):
            r = await chat(http, engram, f"Where does my sister Marta live? Asked {i} times.")
        request_id = r.headers["X-Engram-Request-Id"]
        await settle(engram)
        page = await browser.open("about:blank")
        await sign_in(page, engram, ADMIN)
        for width in (1280, 800):
            await page.viewport(width, 900)
            for path, name in (
                ("/", "overview"),
                ("/requests", "requests"),
                (f"/requests/{request_id}", "request"),
            ):
                await open_page(page, engram, path)
                await page.screenshot(SHOTS / f"inspector-{name}-{width}.png")
                fit = await page.evaluate(CHARTS_FIT)
                where = (name, width, fit)
                assert fit["scroll"] <= fit["width"], where  # no sideways scroll
                assert fit["outside"] == [], where
                drawn = " ".join(fit["charts"])
                if name == "overview":
                    assert "svg.saved in section#tokens" in drawn, where
                    assert "svg.spark in section#latency" in drawn, where
                    # Memories made the prompts bigger than the clients' here: said, not a
                    # negative saving.
                    text = await page.text()
                    assert "added: memories" in text and "-" not in text.split(" saved")[0][-8:]
                else:
                    assert "svg.zonebar" in drawn, where
    finally:
        await engram.close()


async def test_forget_a_turn_gone_from_page_search_and_file(
    browser: Chromium, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await seeded(fake, http)
    try:
        page = await browser.open("about:blank")
        await sign_in(page, engram, ADMIN)
        # The user's message and the model's echo of it: each forgotten from the page.
        forgotten = []
        for _ in range(2):
            await page.goto(engram.url + "/engram/search?q=garage+code+walrus&mode=fts")
            await page.evaluate("window.confirm = () => true")
            turn_id = await page.evaluate("document.querySelector('.hit').dataset.turn")
            await page.act(
                "(() => { const f = document.querySelector('.hit form[action$=\"forget-turn\"]');"
                " f.querySelector('input[name=confirm]').checked = true;"
                " f.querySelector('button').click(); })()"
            )
            assert f"Forgot turn {turn_id}" in await page.text()
            forgotten.append(turn_id)
        await page.screenshot(SHOTS / "inspector-forgot.png")
        await page.goto(engram.url + "/engram/search?q=walrus")
        assert "walrus-4411" not in await page.text()
        await page.goto(engram.url + "/engram/sessions")
        await page.act("document.querySelector('#sessions a').click()")
        assert "walrus" not in await page.text()
        rows = await turn_rows(engram, "SELECT id FROM turns WHERE content LIKE '%walrus%'")
        assert rows == []
        await settle(engram)  # the scrub
        await engram.runner.cleanup()
        assert b"walrus-4411" not in await asyncio.to_thread(file_bytes, engram)
    finally:
        await engram.close()


async def test_a_note_added_is_recalled_in_the_next_chat(
    browser: Chromium, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await seeded(fake, http)
    try:
        page = await browser.open("about:blank")
        await sign_in(page, engram, ADMIN)
        await open_page(page, engram, "/memory")
        await page.evaluate(
            "document.getElementById('note-text').value = "
            "'I moved to Lisbon in March and my new street is Rua das Flores.'"
        )
        await page.act("document.getElementById('add-note-button').click()")
        assert "Noted (turn" in await page.text()
        await page.screenshot(SHOTS / "inspector-note.png")
        await chat(http, engram, "Which street did I move to in Lisbon?")
        assert "Rua das Flores" in forwarded_text(fake)
        # Pinned: in an unrelated chat too; muted: never, even asked word for word.
        note_id = await page.evaluate("document.querySelector('.note').dataset.turn")
        await page.act("document.querySelector('.note button.pin').click()")
        await chat(http, engram, "Tell me a joke about compilers.")
        assert "Rua das Flores" in forwarded_text(fake)
        await page.act("document.querySelector('.note button.mute').click()")
        await chat(http, engram, "Which street did I move to in Lisbon? Rua das Flores?")
        assert forwarded_text(fake).count("Rua das Flores") == 1  # the question itself only
        rows = await turn_rows(engram, "SELECT recall FROM turns WHERE id = ?", int(note_id))
        assert rows == [(-1,)]
    finally:
        await engram.close()


async def make_key(engram: Engram, user: str, capsys: pytest.CaptureFixture[str]) -> str:
    db = f"{engram.tmp.name}/engram.db"
    code = await asyncio.to_thread(engram_main, ["keys", "create", "--user", user, "--db", db])
    assert code == 0
    return capsys.readouterr().out.strip().splitlines()[-1]


async def test_another_users_key_sees_and_changes_nothing(
    browser: Chromium,
    fake: FakeUpstream,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    engram = await start_engram(fake.url, auth={"mode": "keys", "loopback_admin": False})
    try:
        alice, bob = [await make_key(engram, u, capsys) for u in ("alice", "bob")]
        r = await chat(
            http, engram, "My locker code is quokka-7731", {"Authorization": f"Bearer {alice}"}
        )
        alice_session = r.headers["X-Engram-Session"]
        await chat(http, engram, "I like tea", {"Authorization": f"Bearer {bob}"})
        await settle(engram)
        (alice_turn,) = await turn_rows(
            engram, "SELECT id FROM turns WHERE content LIKE '%quokka%' AND role = 'user'"
        )
        page = await browser.open("about:blank")
        await sign_in(page, engram, bob)
        assert "bob" in await page.evaluate("document.getElementById('signed-user').innerText")
        for path in (*PAGES, "/search?q=quokka+locker"):
            text = await open_page(page, engram, path)
            assert "quokka" not in text and "alice" not in text, path
        await page.screenshot(SHOTS / "inspector-other-user.png")
        # Editing ids and names: alice's session, alice as the user, alice's turn.
        text = await open_page(page, engram, f"/sessions/{alice_session}")
        assert "404" in text and "quokka" not in text
        text = await open_page(page, engram, "/sessions?user=alice")
        assert "403" in text and "quokka" not in text
        for action, fields in (
            ("forget-turn", {"id": alice_turn[0], "confirm": "yes"}),
            ("recall", {"id": alice_turn[0], "recall": "muted"}),
            ("fact-delete", {"id": alice_turn[0], "confirm": "yes"}),
            ("forget-session", {"name": alice_session, "confirm": "yes"}),
            ("forget-all", {"confirm_user": "alice", "user": "alice"}),
        ):
            await open_page(page, engram, "/memory")
            await page.act(
                "(() => { const f = document.createElement('form'); f.method = 'post';"
                f" f.action = '/engram/actions/{action}';"
                " const fields = Object.assign({csrf: document.querySelector("
                f"'input[name=csrf]').value}}, {json.dumps(fields)});"
                " for (const [k, v] of Object.entries(fields)) { const i ="
                " document.createElement('input'); i.name = k; i.value = v; f.appendChild(i); }"
                " document.body.appendChild(f); f.submit(); })()"
            )
            text = await page.text()
            assert re.search(r"\b(403|404)\b", text), (action, text[:300])
        rows = await turn_rows(engram, "SELECT recall FROM turns WHERE id = ?", alice_turn[0])
        assert rows == [(0,)]  # still there, not muted
    finally:
        await engram.close()


async def test_nothing_works_without_signing_in(
    browser: Chromium, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await seeded(fake, http)
    try:
        # In the browser: every page leads to the sign-in page; a wrong token is refused.
        page = await browser.open("about:blank")
        for path in PAGES:
            await page.goto(engram.url + "/engram" + path)
            assert (await page.url()).endswith("/engram/signin"), path
        await page.evaluate("document.getElementById('token').value = 'not-the-token'")
        await page.act("document.getElementById('signin').submit()")
        assert "That is not the admin token" in await page.text()
        assert await page.evaluate("document.cookie") == ""
        await page.screenshot(SHOTS / "inspector-signin-refused.png")
        for path in (*PAGES, "/sessions/x", "/requests/x", "/sessions/x/export"):
            async with http.get(engram.url + "/engram" + path, allow_redirects=False) as r:
                assert r.status == 303 and r.headers["Location"] == "/engram/signin", path
        for action in ("note", "forget-turn", "forget-all", "recall", "fact-edit", "feedback"):
            async with http.post(
                engram.url + f"/engram/actions/{action}",
                data={"text": "x", "id": "1", "confirm": "yes"},
            ) as r:
                assert r.status == 401, action
        async with http.post(engram.url + "/engram/signin", data={"token": "wrong"}) as r:
            assert r.status == 401 and "Set-Cookie" not in r.headers
        # A sign-in, then a form without its token: refused; signing out ends it.
        jar = aiohttp.CookieJar(unsafe=True)
        async with aiohttp.ClientSession(cookie_jar=jar) as signed:
            async with signed.post(
                engram.url + "/engram/signin", data={"token": ADMIN}, allow_redirects=False
            ) as r:
                cookie = r.headers["Set-Cookie"]
                assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Max-Age=" in cookie
                assert ADMIN not in cookie
            async with signed.post(engram.url + "/engram/actions/note", data={"text": "x"}) as r:
                assert r.status == 403
            async with signed.get(engram.url + "/engram/memory") as r:
                html = await r.text()
                assert r.headers["Cache-Control"] == "no-store"
                assert "script-src 'self'" in r.headers["Content-Security-Policy"]
            csrf = re.findall(r'name="csrf" value="([^"]+)"', html)[0]
            async with signed.post(
                engram.url + "/engram/signout", data={"csrf": csrf}, allow_redirects=False
            ) as r:
                assert r.status == 303
            async with signed.get(engram.url + "/engram/", allow_redirects=False) as r:
                assert r.status == 303
        notes = await turn_rows(engram, "SELECT count(*) FROM turns WHERE api = 'note'")
        assert notes == [(0,)]
    finally:
        await engram.close()


ATTACK = """<!doctype html><html><body>
<form id="note" method="post" action="{engram}/engram/actions/note">
<input name="text" value="ATTACKER NOTE"><input name="csrf" value="guess"></form>
<form id="wipe" method="post" action="{engram}/engram/actions/forget-all" target="f2">
<input name="confirm_user" value="default"></form><iframe name="f2"></iframe>
<script>
async function attack() {{
  const out = {{}};
  for (const path of ["/engram/actions/note", "/engram/actions/forget-all"]) {{
    try {{
      const r = await fetch("{engram}" + path, {{method: "POST", credentials: "include",
        mode: "no-cors", body: new URLSearchParams({{text: "ATTACKER NOTE",
        confirm_user: "default"}})}});
      out[path] = r.type;
    }} catch (e) {{ out[path] = String(e); }}
  }}
  try {{
    const r = await fetch("{engram}/engram/sessions", {{credentials: "include"}});
    out.read = await r.text();
  }} catch (e) {{ out.read = "blocked: " + e; }}
  document.getElementById("wipe").submit();
  return out;
}}
</script></body></html>"""


async def test_a_page_on_another_origin_makes_the_inspector_do_nothing(
    browser: Chromium, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await seeded(fake, http)
    port = int(engram.url.rsplit(":", 1)[1])

    async def attack_page(request: web.Request) -> web.Response:
        return web.Response(
            text=ATTACK.format(engram=f"http://localhost:{port}"), content_type="text/html"
        )

    app = web.Application()
    app.router.add_get("/attack.html", attack_page)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        before = await turn_rows(engram, "SELECT id, content FROM turns ORDER BY id")
        page = await browser.open("about:blank")
        # The victim is signed in, on the name the attack page targets.
        await page.goto(f"http://localhost:{port}/engram/")
        await page.evaluate(f"document.getElementById('token').value = {json.dumps(ADMIN)}")
        await page.act("document.getElementById('signin').submit()")
        assert "Overview" in await page.text()
        evil = await browser.open(f"http://127.0.0.1:{runner.addresses[0][1]}/attack.html")
        out = await evil.evaluate("attack()")
        assert "Marta" not in json.dumps(out)  # nothing of memory readable
        await evil.act("document.getElementById('note').submit()")
        await asyncio.sleep(0.5)  # the framed form post
        await settle(engram)
        after = await turn_rows(engram, "SELECT id, content FROM turns ORDER BY id")
        assert after == before  # no note, nothing forgotten
        await page.goto(f"http://localhost:{port}/engram/memory")
        assert "ATTACKER" not in await page.text()
    finally:
        await runner.cleanup()
        await engram.close()


async def test_a_tool_result_slot_shows_on_every_page_that_names_it(
    browser: Chromium, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """An old bulky tool output becomes a slot: the Slots page lists it, the request that
    referenced it shows it, and the overview counts the put."""
    engram = await seeded(fake, http)
    listing = "\n".join(
        f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(400)
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "notes.txt"}'},
    }
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "Read notes.txt please."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": listing},
            {"role": "assistant", "content": "I read the file."},
            {"role": "user", "content": "Thanks. What does its last line say?"},
        ],
    }
    try:
        async with http.post(engram.base_url + "/chat/completions", json=body) as r:
            assert r.status == 200
            request_id = r.headers["X-Engram-Request-Id"]
        await settle(engram)
        jar = aiohttp.CookieJar(unsafe=True)
        async with aiohttp.ClientSession(cookie_jar=jar) as signed:
            async with signed.post(engram.url + "/engram/signin", data={"token": ADMIN}) as r:
                assert r.status == 200
            async with signed.get(engram.url + "/engram/slots") as r:
                slots = await r.text()
            async with signed.get(engram.url + f"/engram/requests/{request_id}") as r:
                request = await r.text()
            async with signed.get(engram.url + "/engram/") as r:
                overview = await r.text()
        # the reference in the forwarded prompt (the expansion tool's description names it too)
        slot_id = re.findall(r"\[TOOL_RESULT:([A-Za-z0-9][A-Za-z0-9_.-]*)\]", forwarded_text(fake))[
            -1
        ]
        assert slot_id in slots and "read_file" in slots
        assert f"[TOOL_RESULT:{slot_id}]" in request and "expired or forgotten" not in request
        puts = re.findall(r'class="slot-puts">(\d+)<', overview)
        assert puts and sum(map(int, puts)) >= 1, overview
        page = await browser.open("about:blank")
        await sign_in(page, engram, ADMIN)
        assert slot_id in await open_page(page, engram, "/slots")
        await page.screenshot(SHOTS / "inspector-slots-listed.png")
    finally:
        await engram.close()


async def test_bad_parameters_get_a_clear_page_and_change_nothing(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await seeded(fake, http)
    try:
        before = await turn_rows(engram, "SELECT id, content, recall FROM turns ORDER BY id")
        jar = aiohttp.CookieJar(unsafe=True)
        async with aiohttp.ClientSession(cookie_jar=jar) as signed:
            async with signed.post(engram.url + "/engram/signin", data={"token": ADMIN}) as r:
                assert r.status == 200
                csrf = re.findall(r'name="csrf" value="([^"]+)"', await r.text())[0]
            for path, status, says in (
                ("/sessions?page=abc", 400, "page must be a number"),
                ("/sessions?page=0", 400, "page must be a number"),
                ("/sessions?from=2026-13-45", 400, "from must be a date"),
                ("/search?q=x&k=500", 400, "k must be from 1 to 100"),
                ("/search?q=x&mode=semantic", 400, "mode must be one of"),
                ("/sessions/no-such-session", 404, "No session"),
                ("/requests/no-such-request", 404, "No request"),
            ):
                async with signed.get(engram.url + "/engram" + path) as r:
                    assert r.status == status, path
                    assert says in await r.text(), path
            # Hostile search strings: an answer, never an error.
            for q in ('"', "*", "NEAR(", "a AND OR", "\x00<script>", "' OR 1=1 --", "é" * 1000):
                async with signed.get(engram.url + "/engram/search", params={"q": q}) as r:
                    assert r.status == 200, q
                    assert "<script>" not in await r.text()
            for action, fields, says in (
                ("note", {"text": "   "}, "must not be empty"),
                ("note", {"text": "x" * 9000}, "at most 8000"),
                ("recall", {"id": "1", "recall": "always"}, "recall must be one of"),
                ("forget-turn", {"id": "abc", "confirm": "yes"}, "turn id"),
                ("forget-turn", {"id": "1"}, "confirmation box"),
                ("forget-all", {"confirm_user": "someone-else"}, "Type the user"),
                ("fact-edit", {"id": "999999", "text": "x"}, "No turn 999999"),
            ):
                async with signed.post(
                    engram.url + f"/engram/actions/{action}", data={"csrf": csrf, **fields}
                ) as r:
                    assert r.status in (400, 404), action
                    assert says in await r.text(), (action, fields)
        after = await turn_rows(engram, "SELECT id, content, recall FROM turns ORDER BY id")
        assert after == before
    finally:
        await engram.close()
