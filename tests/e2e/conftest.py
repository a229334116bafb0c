"""A real llama-server with a tiny real model (SmolLM2-135M), started once for the session.

`make test` builds llama-server (cached outside the checkout) and installs the model before the
suite runs, so a missing binary or model is a broken setup: the fixture fails, it does not skip.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from proxy import bundled as llama_server
from proxy.bundled.smoke import stop_process
from proxy.services import SERVICES
from proxy.store.models import Turn
from testing.harness import Engram, start_engram

REAL_EMBEDDER = {"model": "engram/all-MiniLM-L6-v2-q8"}
CTX = 2048
START_TIMEOUT_S = 90.0


@dataclass
class LlamaServer:
    """A running llama-server: its base URL (no `/v1`) and its log file."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def health_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            status: int = r.status
            return status
    except urllib.error.HTTPError as exc:  # 503 while the model loads
        return exc.code
    except OSError:
        return None


def start_llama_server(
    log_path: Path, ctx: int = CTX, extra: tuple[str, ...] = (), threads: int = 1
) -> LlamaServer:
    problem = None
    try:
        if llama_server.binary_path() is None:
            problem = (
                "llama-server is not built and verified on this CPU "
                f"(expected {llama_server.cached_binary()}); "
                "`make test` builds it (`python -m proxy.bundled build`), "
                f"or set {llama_server.BINARY_ENV}"
            )
        else:
            llama_server.model_path()
    except llama_server.SetupError as exc:
        problem = str(exc)
    if problem:
        pytest.fail(f"end-to-end setup is broken: {problem}", pytrace=False)
    port = free_port()
    # One thread: ggml's worker threads spin at their barriers, so two threads on a two-core
    # machine collapse (10-25 tokens/s instead of 80-145) as soon as anything else runs, and the
    # test process itself (Engram, the client) runs beside the server.
    cmd = llama_server.server_command(port, ctx=ctx, threads=threads, parallel=1, extra=extra)
    # /slots then also shows each slot's last prompt, detokenized: what the model really saw.
    env = {**os.environ, "LLAMA_SERVER_SLOTS_DEBUG": "1"}
    out = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
    )
    out.close()
    server = LlamaServer(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                "llama-server stopped while starting: "
                f"{llama_server.describe_exit(proc.returncode)} "
                f"({' '.join(cmd)}):\n{server.log_tail()}",
                pytrace=False,
            )
        if health_status(server.url) == 200:  # 503 until the model is loaded
            return server
        time.sleep(0.1)
    stop_process(proc)
    pytest.fail(
        f"llama-server did not answer GET /health with 200 within {START_TIMEOUT_S:.0f} s:\n"
        f"{server.log_tail()}",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def llama() -> Iterator[LlamaServer]:
    with tempfile.TemporaryDirectory(prefix="engram-llama-") as tmp:
        server = start_llama_server(Path(tmp) / "llama-server.log")
        try:
            yield server
        finally:
            stop_process(server.process)


@pytest_asyncio.fixture
async def engram(llama: LlamaServer) -> AsyncIterator[Engram]:
    """Engram in front of the real llama-server, with its own database and the hash embedder."""
    e = await start_engram(llama.url)
    try:
        yield e
    finally:
        await e.close()


@pytest_asyncio.fixture
async def engram_real(llama: LlamaServer) -> AsyncIterator[Engram]:
    """Engram in front of the real llama-server with the real embedding model (memory tests)."""
    e = await start_engram(llama.url, embedder=REAL_EMBEDDER)
    try:
        yield e
    finally:
        await e.close()


async def user_turns(engram: Engram, user: str) -> list[Turn]:
    store = engram.app[SERVICES].store
    out: list[Turn] = []
    for session in await store.list_sessions(user):
        out += await store.session_turns(session.id)
    return out


async def wait_idle(llama: LlamaServer, timeout: float) -> tuple[float, list[dict[str, Any]]]:
    """Poll llama-server's GET /slots until no slot is processing; return the time it took and
    the last /slots answer. Raise if a slot is still busy after `timeout` seconds."""
    started = time.monotonic()
    slots: list[dict[str, Any]] = []
    while True:
        slots = await asyncio.to_thread(llama.get_json, "/slots")
        elapsed = time.monotonic() - started
        if not any(s["is_processing"] for s in slots):
            return elapsed, slots
        if elapsed > timeout:
            raise AssertionError(f"llama-server still generating after {elapsed:.2f} s: {slots}")
        await asyncio.sleep(0.02)
