"""Open WebUI — the chat app, from PyPI — run as its users run it, against a base URL on loopback
(Engram, or the fake upstream directly), and driven through its own web UI in a real headless
Chromium (:mod:`testing.browser`), so what reaches the model server is what its UI sends.

    async with RecordingRelay(engram.url) as relay, OpenWebUIServer.start(
        install, relay.url + "/v1", tmp_path / "owui"
    ) as owui, Chromium.start() as browser:
        admin = await owui.signup("Admin", "admin@example.com")  # the first user: the admin
        ada = await owui.add_user(admin, "Ada", "ada@example.com")
        ui = await OpenWebUIPage.open(browser, owui, ada)        # signed in, at a new chat
        reply = await ui.send("My sister's tortoise is called Zanzibar.")
        await relay.quiet()   # its title, tags and follow-ups requests answered too
        await ui.regenerate()
        await ui.edit_last_user_message("and now?")
        await ui.new_chat()
        relay.exchanges   # every request Open WebUI sent: path, body, headers, the answer's
        [side_kind(e) for e in relay.chats()]   # "title", "chat", "follow_ups", "tags"…

The relay is this module's own (:class:`RecordingRelay`: it also keeps each answer's body and
says when every request is answered); :func:`traffic_line` writes an exchange in
:mod:`testing.traffic`'s format.

:mod:`testing.openwebui_install` (``make openwebui-deps``) installs the version pinned in
``testing/openwebui.pins`` into its own virtualenv in a cache folder outside the checkout.

Isolation: each server gets a fresh data folder (its SQLite, uploads, caches, ``HOME``), an
environment built from scratch (``testing.openwebui_install.offline_env``: offline mode, no model
downloads, no update check, no telemetry, Ollama off, the one OpenAI connection given) and
``HTTP(S)_PROXY`` set to a loopback proxy that refuses everything and records what was asked
(``OpenWebUIServer.outside``); loopback bypasses it. It runs in its own process group, stopped
(SIGTERM, then SIGKILL) on exit.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from testing.agents import RefusingProxy
from testing.browser import Chromium, Page
from testing.openwebui_install import (
    OpenWebUI,
    OpenWebUIMissing,
    find_openwebui,
    free_port,
    health,
    offline_env,
    serve_command,
    stop_group,
)
from testing.traffic import TRANSPORT

__all__ = [
    "Exchange",
    "OpenWebUI",
    "OpenWebUIMissing",
    "OpenWebUIPage",
    "OpenWebUIServer",
    "RecordingRelay",
    "User",
    "find_openwebui",
    "side_kind",
    "task_first_line",
    "traffic_line",
]

START_TIMEOUT_S = 300.0
PASSWORD = "engram-test-password"
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "host",
}


# ---- the recording relay --------------------------------------------------------------------


@dataclass
class Exchange:
    """One request relayed, and the answer's status and headers (its body as text: the
    concatenated SSE lines of a streamed reply)."""

    method: str
    path: str
    query: str
    request_headers: dict[str, str]
    body: bytes
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    response_body: str = ""
    started: float = 0.0  # time.time() when it arrived
    seconds: float = 0.0
    done: bool = False  # answered to the end (or failed)
    error: str = ""

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    @property
    def messages(self) -> list[dict[str, Any]]:
        body = self.json()
        return list(body.get("messages") or []) if isinstance(body, dict) else []

    def reply_text(self) -> str:
        """The assistant's text in the answer, streamed (SSE deltas) or not."""
        text = []
        for line in self.response_body.splitlines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            with suppress(ValueError):
                for choice in json.loads(line[5:]).get("choices") or []:
                    text.append((choice.get("delta") or {}).get("content") or "")
        if text:
            return "".join(text)
        with suppress(ValueError, AttributeError, IndexError, TypeError, KeyError):
            reply = json.loads(self.response_body)
            return str(reply["choices"][0]["message"]["content"] or "")
        return ""


class RecordingRelay:
    """A loopback HTTP relay to ``target`` (a base URL without ``/v1``) that records every
    exchange: put between a client and the server it talks to, it lists what the client sent
    and what came back, streaming relayed as it arrives."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.exchanges: list[Exchange] = []
        self.url = ""
        self._last = time.monotonic()
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RecordingRelay:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), auto_decompress=False
        )
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.25)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    def chats(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.path.endswith("/chat/completions")]

    async def quiet(self, idle: float = 0.6, timeout: float = 120.0) -> None:
        """Wait until every request is answered and none came for ``idle`` seconds (Open WebUI
        sends its side requests, title, tags and follow-ups, after the reply is shown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = any(not e.done for e in self.exchanges)
            if not busy and time.monotonic() - self._last >= idle:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"requests still in flight after {timeout:.0f} s")

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        assert self._http is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        exchange = Exchange(
            request.method, request.path, request.query_string, headers, body, started=time.time()
        )
        self.exchanges.append(exchange)
        self._last = time.monotonic()
        start = time.monotonic()
        url = self.target + request.path_qs
        try:
            async with self._http.request(request.method, url, headers=headers, data=body) as up:
                exchange.status = up.status
                exchange.response_headers = dict(up.headers)
                out_headers = CIMultiDict(
                    (k, v) for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP
                )
                resp = web.StreamResponse(status=up.status, headers=out_headers)
                await resp.prepare(request)
                seen = bytearray()
                async for chunk in up.content.iter_any():
                    seen += chunk
                    await resp.write(chunk)
                await resp.write_eof()
                exchange.response_body = seen.decode("utf-8", "replace")
        except (aiohttp.ClientError, ConnectionError, asyncio.CancelledError) as exc:
            exchange.error = repr(exc)
            raise
        finally:
            exchange.seconds = time.monotonic() - start
            exchange.done = True
            self._last = time.monotonic()
        return resp


# ---- what Open WebUI sends ------------------------------------------------------------------

# The first line of each of Open WebUI's task prompts (its default templates, in
# open_webui/config.py), and the kind of side request it makes.
TASK_PROMPTS = {
    "title": "Generate a concise title summarizing the chat history.",
    "tags": "Generate 1-3 broad tags categorizing the main themes of the chat history",
    "follow_ups": "Predict 3-5 useful messages this user might naturally send next",
    "autocomplete": "You are an autocompletion system.",
    "queries": "Analyze the chat history to determine the necessity of generating search queries",
    "image_prompt": "Generate a detailed prompt for am image generation task",
    "emoji": "Your task is to reflect the speaker's likely facial expression",
    "tools": "Available Tools:",
    "moa": "You have been provided with a set of responses from various models",
}


def side_kind(exchange: Exchange) -> str:
    """``chat`` for a conversation's own request, else the kind of Open WebUI's side request
    (``title``, ``tags``, ``follow_ups``, ``autocomplete``…, from its task prompt), else
    ``other``; ``models`` and the like for requests that are no chat at all."""
    if not exchange.path.endswith("/chat/completions"):
        return exchange.path.rsplit("/", 1)[-1] or exchange.path
    messages = exchange.messages
    if not messages:
        return "other"
    last = messages[-1]
    text = last.get("content") if isinstance(last.get("content"), str) else json.dumps(last)
    for kind, marker in TASK_PROMPTS.items():
        if marker.lower() in str(text).lower():
            return kind
    if str(text).lstrip().startswith("### Task:"):
        return "task"
    return "chat"


def task_first_line(exchange: Exchange) -> str:
    """The first line of a side request's task prompt (its last message), for reports."""
    messages = exchange.messages
    if not messages:
        return ""
    text = str(messages[-1].get("content") or "")
    lines = [line for line in text.splitlines() if line.strip() and line.strip() != "### Task:"]
    return lines[0].strip() if lines else ""


def traffic_line(
    exchange: Exchange, *, version: str, via: str, run: str, seq: int, **extra: Any
) -> dict[str, Any]:
    """One exchange as a line of ``tests/data/clients/openwebui-<version>.jsonl``, in
    :mod:`testing.traffic`'s format (the request as sent, its status and Engram's ``X-Engram-*``
    answer headers), with ``kind`` (:func:`side_kind`), the reply's text and ``extra``."""
    try:
        body: Any = json.loads(exchange.body) if exchange.body else None
    except ValueError:
        body = exchange.body.decode("utf-8", "replace")
    line: dict[str, Any] = {
        "client": "openwebui",
        "version": version,
        "via": via,
        "run": run,
        "seq": seq,
        "method": exchange.method,
        "path": exchange.path,
        "query": exchange.query,
        "headers": {
            k: v for k, v in exchange.request_headers.items() if k.lower() not in TRANSPORT
        },
        "body": body,
        "status": exchange.status,
        "engram": {
            k: v for k, v in exchange.response_headers.items() if k.lower().startswith("x-engram-")
        },
        "kind": side_kind(exchange),
    }
    if exchange.path.endswith("/chat/completions"):
        line["reply"] = exchange.reply_text()
    return line | extra


# ---- the server -----------------------------------------------------------------------------


@dataclass
class User:
    """An Open WebUI account: its id, name, email, role and session token."""

    id: str
    name: str
    email: str
    role: str
    token: str


@dataclass
class OpenWebUIServer:
    """A running Open WebUI (``open-webui serve``) on a loopback port."""

    url: str
    install: OpenWebUI
    process: subprocess.Popen[bytes]
    log_path: Path
    started_in: float
    proxy: RefusingProxy
    users: list[User] = field(default_factory=list)

    @property
    def outside(self) -> list[str]:
        """What it asked the internet for (refused)."""
        return self.proxy.requests

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        install: OpenWebUI,
        openai_base_url: str,
        data_dir: Path,
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = START_TIMEOUT_S,
    ) -> AsyncIterator[OpenWebUIServer]:
        """Open WebUI from ``install`` with its data in ``data_dir`` and the one OpenAI-compatible
        connection ``openai_base_url`` (ending in ``/v1``); ``env`` adds or overrides settings
        (``{"ENABLE_FORWARD_USER_INFO_HEADERS": "true"}``). Ready when ``GET /health`` says 200."""
        data_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - at start
        port = free_port()
        async with RefusingProxy() as proxy:
            full = offline_env(data_dir, openai_base_url, port, **dict(env or {})) | proxy.env()
            log_path = data_dir / "openwebui.log"
            start = time.monotonic()
            with open(log_path, "wb") as log:  # noqa: ASYNC230 - a local file, at start
                process = subprocess.Popen(  # noqa: ASYNC220 - stopped by stop_group, below
                    serve_command(install.python, port),
                    env=full,
                    cwd=data_dir,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            url = f"http://127.0.0.1:{port}"
            try:
                while True:
                    if process.poll() is not None:
                        raise RuntimeError(
                            f"Open WebUI exited at start ({process.returncode}); its log ended:\n"
                            + log_path.read_text(errors="replace")[-4000:]
                        )
                    if await asyncio.to_thread(health, url) == 200:
                        break
                    if time.monotonic() - start > timeout:
                        raise RuntimeError(
                            f"Open WebUI did not answer GET /health within {timeout:.0f} s; "
                            "its log ended:\n" + log_path.read_text(errors="replace")[-4000:]
                        )
                    await asyncio.sleep(0.25)
                server = cls(url, install, process, log_path, time.monotonic() - start, proxy)
                yield server
            finally:
                await asyncio.to_thread(stop_group, process)

    async def api(self, method: str, path: str, token: str | None = None, body: Any = None) -> Any:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with (
            aiohttp.ClientSession() as http,
            http.request(method, self.url + path, json=body, headers=headers) as reply,
        ):
            text = await reply.text()
            if reply.status >= 400:
                raise RuntimeError(f"{method} {path}: {reply.status} {text[:500]}")
            return json.loads(text) if text else None

    async def signup(self, name: str, email: str) -> User:
        """The first account (it becomes the admin, and sign-up closes), signed in."""
        data = await self.api(
            "POST",
            "/api/v1/auths/signup",
            body={"name": name, "email": email, "password": PASSWORD},
        )
        user = User(data["id"], data["name"], data["email"], data["role"], data["token"])
        self.users.append(user)
        return user

    async def add_user(self, admin: User, name: str, email: str) -> User:
        """Another account, made by ``admin`` (Admin Panel > Users > Add User), signed in."""
        body = {"name": name, "email": email, "password": PASSWORD, "role": "user"}
        await self.api("POST", "/api/v1/auths/add", admin.token, body)
        data = await self.api(
            "POST", "/api/v1/auths/signin", body={"email": email, "password": PASSWORD}
        )
        user = User(data["id"], data["name"], data["email"], data["role"], data["token"])
        self.users.append(user)
        return user


# ---- the browser driver ---------------------------------------------------------------------

# The chat's DOM in Open WebUI's Svelte frontend (0.12): the input is a contenteditable
# ``#chat-input``; each message a ``#message-<id>`` (``.user-message`` for the user's), an
# assistant's text in its ``#response-content-container``; a finished reply shows its toolbar
# (``Regenerate`` among it), and a reply being generated does not.
JS_HELPERS = r"""
window.__engram = window.__engram || {
  visible(el) {
    return !!(el && (el.offsetWidth || el.offsetHeight || el.getClientRects().length));
  },
  input() { return document.querySelector('#chat-input'); },
  container() { return document.querySelector('#messages-container'); },
  all(sel) { const c = this.container(); return c ? [...c.querySelectorAll(sel)] : []; },
  assistants() {
    return this.all('[id^="message-"]').filter(el => /^message-[0-9a-f-]{36}$/.test(el.id)
      && !el.classList.contains('user-message'));
  },
  users() { return this.all('.user-message'); },
  replyText(el) {
    const c = el.querySelector('#response-content-container'); return c ? c.innerText.trim() : '';
  },
  userText(el) {
    const p = el.querySelector('.markdown-prose'); return p ? p.innerText.trim() : '';
  },
  finished(el) { return !!el.querySelector('button[aria-label="Regenerate"]'); },
  button(text) {
    return [...document.querySelectorAll('button')].find(
      b => (b.innerText || '').trim() === text && this.visible(b));
  },
};
true
"""


@dataclass
class OpenWebUIPage:
    """One signed-in user's tab on Open WebUI, driven as a person would: clicks and key presses
    through DevTools' Input domain (real trusted events), text typed with ``Input.insertText``."""

    page: Page
    server: OpenWebUIServer
    user: User
    shots: Path | None = None
    prefix: str = "openwebui"
    _shot: int = 0

    @classmethod
    async def open(
        cls,
        browser: Chromium,
        server: OpenWebUIServer,
        user: User,
        shots: Path | None = None,
        prefix: str = "openwebui",
    ) -> OpenWebUIPage:
        """A tab signed in as ``user`` (its session token where the app keeps it, as its sign-in
        page does), at a new chat, the "what's new" dialog closed."""
        page = await browser.open(server.url + "/auth")
        await page.viewport(1280, 900)
        await page.evaluate(f"localStorage.setItem('token', {json.dumps(user.token)}); true")
        ui = cls(page, server, user, shots, prefix)
        # Open WebUI shows an admin its "What's New" dialog on their first visit.
        await ui.new_chat(dialog_wait=8.0 if user.role == "admin" else 0.0)
        return ui

    async def js(self, expression: str, timeout: float = 30.0) -> Any:
        await self.page.evaluate(JS_HELPERS)
        return await self.page.evaluate(expression, timeout)

    async def wait_for(self, condition: str, timeout: float, what: str) -> Any:
        """Poll the page until ``condition`` (JS) is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.js(condition)
            if value:
                return value
            if time.monotonic() > deadline:
                shot = await self.screenshot("timeout")
                raise TimeoutError(f"waited {timeout:.0f} s for {what} (screenshot: {shot})")
            await asyncio.sleep(0.2)

    async def screenshot(self, name: str) -> Path | None:
        """The tab as ``<shots>/<prefix>-<n>-<name>.png`` (None without a shots folder)."""
        if self.shots is None:
            return None
        self._shot += 1
        return await self.page.screenshot(self.shots / f"{self.prefix}-{self._shot:02d}-{name}.png")

    # The primitives.

    async def click(self, element_js: str, what: str, timeout: float = 30.0) -> None:
        """A real mouse click at the centre of the element ``element_js`` finds, once it is
        there, visible and enabled."""
        box = await self.wait_for(
            f"""(() => {{ const el = {element_js};
              if (!el || !window.__engram.visible(el) || el.disabled) return null;
              el.scrollIntoView({{block: 'center'}});
              const r = el.getBoundingClientRect();
              return {{x: r.x + r.width / 2, y: r.y + r.height / 2}}; }})()""",
            timeout,
            what,
        )
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            await self.page.send(
                "Input.dispatchMouseEvent",
                type=kind,
                x=box["x"],
                y=box["y"],
                button="none" if kind == "mouseMoved" else "left",
                clickCount=0 if kind == "mouseMoved" else 1,
            )

    async def type_text(self, text: str) -> None:
        await self.page.send("Input.insertText", text=text)

    async def press(self, key: str, code: int) -> None:
        for kind in ("keyDown", "keyUp"):
            await self.page.send(
                "Input.dispatchKeyEvent",
                type=kind,
                key=key,
                code=key,
                windowsVirtualKeyCode=code,
                nativeVirtualKeyCode=code,
                text="\r" if kind == "keyDown" and key == "Enter" else "",
            )

    # What a user does.

    async def new_chat(self, dialog_wait: float = 0.0) -> None:
        """A new chat: the app's start page, as the sidebar's "New Chat" opens it."""
        await self.page.goto(self.server.url + "/")
        await self.wait_for(
            "window.__engram.visible(window.__engram.input())", 60, "the chat input"
        )
        await self.dismiss_dialogs(dialog_wait)
        await self.pick_model()

    async def dismiss_dialogs(self, wait: float) -> None:
        """Close the "What's New" dialog a new account is shown, if it comes up within
        ``wait`` seconds (or is there)."""
        deadline = time.monotonic() + wait
        while True:
            if await self.js('!!window.__engram.button("Okay, Let\'s Go!")'):
                await self.click('window.__engram.button("Okay, Let\'s Go!")', "Okay, Let's Go!")
                await self.wait_for(
                    '!window.__engram.button("Okay, Let\'s Go!")', 10, "the dialog to close"
                )
                return
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.2)

    async def model(self) -> str:
        """The model the chat will use, as its model selector shows it."""
        return str(
            await self.js(
                "(document.querySelector('#model-selector-model-button') || {}).innerText || ''"
            )
        ).strip()

    async def pick_model(self, name: str | None = None) -> str:
        """Choose ``name`` (else the first model offered) in the model selector, unless it shows
        it already (Open WebUI picks the only model by itself); the model chosen."""
        shown = str(
            await self.wait_for(
                "(document.querySelector('#model-selector-model-button') || {}).innerText",
                30,
                "the model selector",
            )
        ).strip()
        if shown and "Select a model" not in shown and name in (None, shown):
            return shown
        await self.click("document.querySelector('#model-selector-model-button')", "the models")
        option = "#model-selector-list [role=option]" + (
            f"[data-value={json.dumps(name)}]" if name else ""
        )
        await self.click(f"document.querySelector({json.dumps(option)})", f"model {name or '#1'}")
        return str(
            await self.wait_for(
                f"""(() => {{ const t = document.querySelector('#model-selector-model-button')
                  .innerText.trim(); return t && !t.includes('Select a model')
                  && {json.dumps(name)} in {{null: 1, [t]: 1}} ? t : null; }})()""",
                10,
                "the model chosen",
            )
        )

    async def chat_id(self) -> str | None:
        """The open chat's id (the address is ``/c/<id>``); None before its first message."""
        href = await self.page.url()
        return href.rsplit("/c/", 1)[1].split("?")[0].split("#")[0] if "/c/" in href else None

    async def replies(self) -> list[str]:
        """The assistant replies shown, in order (the selected version of each)."""
        return list(
            await self.js("window.__engram.assistants().map(m => window.__engram.replyText(m))")
        )

    async def user_messages(self) -> list[str]:
        return list(await self.js("window.__engram.users().map(m => window.__engram.userText(m))"))

    async def wait_reply(self, count: int, timeout: float, not_text: str | None = None) -> str:
        """Wait until ``count`` replies are shown, the last one finished (its toolbar shown) and
        not empty (nor ``not_text``), and its text the same on two reads 0.3 s apart (the page
        can show the toolbar before it renders a fast stream's last chunks: once, under load,
        a finished "echo:" whose words came a moment later); the last one's text."""
        avoid = json.dumps(not_text) if not_text is not None else "null"
        condition = f"""(() => {{ const m = window.__engram.assistants();
                  if (m.length < {count}) return null;
                  const last = m[m.length - 1]; const t = window.__engram.replyText(last);
                  return window.__engram.finished(last) && t && t !== {avoid} ? t : null; }})()"""
        deadline = time.monotonic() + timeout
        text = str(await self.wait_for(condition, timeout, f"reply {count} to finish"))
        while True:
            await asyncio.sleep(0.3)
            again = str(await self.wait_for(condition, timeout, f"reply {count} to finish"))
            if again == text or time.monotonic() > deadline:
                return again
            text = again

    async def send(self, text: str, timeout: float = 180.0) -> str:
        """Type ``text`` in the chat input and press Enter; the whole reply's text."""
        before = len(await self.replies())
        await self.click("window.__engram.input()", "the chat input")
        await self.type_text(text)
        await self.wait_for(
            f"window.__engram.input().innerText.includes({json.dumps(text[:30])})",
            10,
            "the typed text in the input",
        )
        await self.press("Enter", 13)
        reply = await self.wait_reply(before + 1, timeout)
        return reply

    async def regenerate(self, timeout: float = 180.0) -> str:
        """The last reply's "Regenerate" button, then "Try Again"; the new reply's text."""
        versions = await self.versions()
        await self.click(
            "window.__engram.all('button[aria-label=\"Regenerate\"]').pop()", "Regenerate"
        )
        await self.click("window.__engram.button('Try Again')", "Try Again")
        await self.wait_for(
            f"""(() => {{ const m = window.__engram.assistants().pop(); const n = {versions + 1};
              return m && new RegExp('\\\\b' + n + '\\\\s*/\\\\s*' + n + '\\\\b').test(m.innerText);
            }})()""",
            timeout,
            f"reply version {versions + 1}",
        )
        reply = await self.wait_reply(1, timeout)
        return reply

    async def versions(self) -> int:
        """How many versions the last reply has (its "n/n" pager; 1 without one)."""
        found = await self.js(
            r"""(() => { const m = window.__engram.assistants().pop(); if (!m) return 0;
              const v = m.innerText.match(/\b(\d+)\s*\/\s*(\d+)\b/); return v ? +v[2] : 1; })()"""
        )
        return int(found)

    async def edit_last_user_message(self, text: str, timeout: float = 180.0) -> str:
        """The last user message's "Edit" button, its text replaced by ``text``, "Send"; the
        new reply's text."""
        count = len(await self.replies())
        await self.click(
            "window.__engram.users().pop().querySelector('button[aria-label=\"Edit\"]')",
            "Edit on the last user message",
        )
        await self.wait_for(
            "!!document.querySelector('textarea[id^=\"message-edit-\"]')", 10, "the edit box"
        )
        await self.js(
            """(() => { const t = document.querySelector('textarea[id^="message-edit-"]');
              t.focus(); t.select(); return true; })()"""
        )
        await self.type_text(text)
        await self.wait_for(
            "document.querySelector('textarea[id^=\"message-edit-\"]').value === "
            + json.dumps(text),
            10,
            "the edited text",
        )
        await self.screenshot("editing")
        await self.click("document.querySelector('#confirm-edit-message-button')", "Send (edit)")
        await self.wait_for(
            "window.__engram.users().some(m => window.__engram.userText(m) === "
            + f"{json.dumps(text)})",
            timeout,
            "the edited message",
        )
        reply = await self.wait_reply(count, timeout)
        return reply
