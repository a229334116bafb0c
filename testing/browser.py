"""A real headless Chromium for tests, driven over the Chrome DevTools Protocol with aiohttp's
WebSocket client (no Selenium, no chromedriver needed).

    async with Chromium.start() as browser:          # ChromiumMissing if none is installed
        page = await browser.open("http://127.0.0.1:9999/attack.html")
        result = await page.evaluate("attack()")     # awaits a promise, returns its JSON value

Each browser gets a fresh profile in a temporary folder and is stopped (its process group) on
exit. Chromium comes from Debian's packages (``apt-get install chromium``); ``find_chromium``
looks for it on PATH.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--remote-debugging-port=0",
    "--remote-debugging-address=127.0.0.1",
)


class ChromiumMissing(RuntimeError):
    """No Chromium on PATH."""


class DevToolsError(RuntimeError):
    """Chromium answered a DevTools command with an error, or a page's script threw."""


def chromium_or_skip() -> str:
    """Chromium's path for a test; skipped with the reason when there is none, and failed under
    CI (``CI=true``), since ``make test`` installs it."""
    import pytest

    binary = find_chromium()
    if binary is None:
        reason = (
            "no Chromium on PATH; install Debian's (apt-get install chromium), as `make test` does"
        )
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)
    return binary


def find_chromium() -> str | None:
    for name in NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class Page:
    """One tab, attached in flat mode to the browser's DevTools connection."""

    browser: Chromium
    session_id: str

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        return await self.browser.send(method, session_id=self.session_id, **params)

    async def evaluate(self, expression: str, timeout: float = 30.0) -> Any:
        """Run ``expression`` in the page, await the promise it returns, give its JSON value."""
        reply = await asyncio.wait_for(
            self.send(
                "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
            ),
            timeout,
        )
        if "exceptionDetails" in reply:
            raise DevToolsError(f"the page's script threw: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def goto(self, url: str, timeout: float = 30.0) -> None:
        """Navigate this tab to ``url`` and wait for its load event."""
        loaded = self.browser.expect("Page.loadEventFired", self.session_id)
        navigated = await self.send("Page.navigate", url=url)
        if navigated.get("errorText"):
            raise DevToolsError(f"could not open {url}: {navigated['errorText']}")
        await asyncio.wait_for(loaded, timeout)

    async def act(self, expression: str, timeout: float = 30.0) -> None:
        """Run ``expression`` (a click, a form's submit) and wait for the page it loads."""
        loaded = self.browser.expect("Page.loadEventFired", self.session_id)
        await self.evaluate(expression, timeout)
        await asyncio.wait_for(loaded, timeout)

    async def viewport(self, width: int, height: int) -> None:
        """Lay the tab out as a desktop window of ``width`` x ``height`` CSS pixels."""
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    async def text(self) -> str:
        """The page's visible text."""
        return str(await self.evaluate("document.body.innerText"))

    async def url(self) -> str:
        return str(await self.evaluate("location.href"))

    async def screenshot(self, path: Path) -> Path:
        """The tab as a PNG at ``path`` (its folder made if needed)."""
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        data = base64.b64decode(shot["data"])

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

        await asyncio.to_thread(write)
        return path


@dataclass
class Chromium:
    """A running headless Chromium and its DevTools WebSocket."""

    process: asyncio.subprocess.Process
    http: aiohttp.ClientSession
    ws: aiohttp.ClientWebSocketResponse
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _waiting: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    _events: dict[tuple[str, str | None], list[asyncio.Future[dict[str, Any]]]] = field(
        default_factory=dict
    )
    _reader: asyncio.Task[None] | None = None

    @classmethod
    @asynccontextmanager
    async def start(
        cls, binary: str | None = None, timeout: float = 30.0
    ) -> AsyncIterator[Chromium]:
        binary = binary or find_chromium()
        if binary is None:
            raise ChromiumMissing(f"no Chromium on PATH (looked for {', '.join(NAMES)})")
        with tempfile.TemporaryDirectory(prefix="engram-chromium-") as profile:
            log_path = Path(profile) / "chromium.log"
            log = open(log_path, "wb")  # noqa: ASYNC230, SIM115 - a local file, closed below
            process = await asyncio.create_subprocess_exec(
                binary,
                *FLAGS,
                f"--user-data-dir={profile}/data",
                "about:blank",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
            try:
                try:
                    url = await _devtools_url(Path(profile) / "data", process, timeout)
                except DevToolsError as exc:
                    tail = log_path.read_bytes()[-2000:].decode(errors="replace")
                    raise DevToolsError(f"{exc}; its output ended:\n{tail}") from None
                async with aiohttp.ClientSession() as http:
                    ws = await http.ws_connect(url, max_msg_size=0)
                    browser = cls(process, http, ws)
                    browser._reader = asyncio.create_task(browser._read())
                    try:
                        yield browser
                    finally:
                        await browser._close()
            finally:
                await _stop(process)
                log.close()

    async def send(
        self, method: str, session_id: str | None = None, **params: Any
    ) -> dict[str, Any]:
        """One DevTools command; its result."""
        ident = next(self._ids)
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session_id is not None:
            message["sessionId"] = session_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = future
        await self.ws.send_json(message)
        reply = await future
        if "error" in reply:
            raise DevToolsError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    def expect(self, method: str, session_id: str | None = None) -> asyncio.Future[dict[str, Any]]:
        """A future for the next event ``method`` (of one page's session)."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._events.setdefault((method, session_id), []).append(future)
        return future

    async def open(self, url: str, timeout: float = 30.0) -> Page:
        """A new tab showing ``url``, its load event fired."""
        target = await self.send("Target.createTarget", url="about:blank")
        attached = await self.send(
            "Target.attachToTarget", targetId=target["targetId"], flatten=True
        )
        page = Page(self, attached["sessionId"])
        await page.send("Page.enable")
        loaded = self.expect("Page.loadEventFired", page.session_id)
        navigated = await page.send("Page.navigate", url=url)
        if navigated.get("errorText"):
            raise DevToolsError(f"could not open {url}: {navigated['errorText']}")
        await asyncio.wait_for(loaded, timeout)
        return page

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = msg.json()
            if "id" in data:
                future = self._waiting.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
                continue
            for future in self._events.pop((data.get("method"), data.get("sessionId")), []):
                if not future.done():
                    future.set_result(data.get("params", {}))
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(DevToolsError("Chromium closed its DevTools connection"))

    async def _close(self) -> None:
        with suppress(DevToolsError, TimeoutError, ConnectionError):
            await asyncio.wait_for(self.send("Browser.close"), 5)
        await self.ws.close()
        if self._reader is not None:
            self._reader.cancel()


async def _devtools_url(profile: Path, process: asyncio.subprocess.Process, timeout: float) -> str:
    """The browser's DevTools WebSocket URL, from the DevToolsActivePort file it writes."""
    marker = profile / "DevToolsActivePort"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if process.returncode is not None:
            raise DevToolsError(f"Chromium exited at start with status {process.returncode}")
        try:
            port, path = marker.read_text().split()[:2]
            return f"ws://127.0.0.1:{port}{path}"
        except (FileNotFoundError, ValueError):
            await asyncio.sleep(0.05)
    raise DevToolsError(f"Chromium did not open its DevTools port within {timeout:g} s")


async def _stop(process: asyncio.subprocess.Process) -> None:
    """End Chromium and its helper processes (its own process group)."""
    if process.returncode is None:
        with suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), 5)
    if process.returncode is None:
        os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
    else:
        # Helpers (renderer, GPU, zygote) that outlived the browser process.
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
