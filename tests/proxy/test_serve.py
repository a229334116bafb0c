"""`engram serve` as a real process: start-up, and graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest

from proxy.store.store import Store
from testing.fake_chunks import chat_chunks
from testing.fake_upstream import FakeUpstream, StreamReply

pytestmark = pytest.mark.asyncio


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_serve(
    *args: str, env_extra: dict[str, str] | None = None, wait_s: float = 10.0
) -> tuple[asyncio.subprocess.Process, str]:
    port = free_port()
    # Each process gets its own database (never the user's) and the fast fake embedder.
    env = {
        "ENGRAM_MEMORY_DB_PATH": os.path.join(tempfile.mkdtemp(prefix="engram-serve-"), "e.db"),
        "ENGRAM_EMBEDDER_MODEL": "hash",
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        **(env_extra or {}),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy",
        "serve",
        "--port",
        str(port),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(int(wait_s / 0.05)):
            try:
                async with http.get(url + "/engram/health") as r:
                    if r.status == 200:
                        return proc, url
            except aiohttp.ClientError:
                pass
            if proc.returncode is not None:
                break
            await asyncio.sleep(0.05)
    proc.kill()
    out = await proc.stdout.read() if proc.stdout else b""
    raise AssertionError(f"engram serve did not start:\n{out.decode()}")


async def test_sigterm_drains_in_flight_stream() -> None:
    async with FakeUpstream() as fake:
        proc, url = await start_serve("--upstream", fake.url)
        try:
            fake.enqueue(StreamReply(chat_chunks([f"zqxbody{i} " for i in range(10)]), delay=0.1))
            async with (
                aiohttp.ClientSession() as http,
                http.post(
                    url + "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "x"}], "stream": True},
                ) as r,
            ):
                first = await r.content.readany()
                proc.send_signal(signal.SIGTERM)
                rest = await r.read()
            body = first + rest
            assert b"zqxbody9 " in body and body.endswith(b"data: [DONE]\n\n")
            assert await asyncio.wait_for(proc.wait(), 15) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        log = (await proc.stdout.read()).decode() if proc.stdout else ""
        assert "listening on" in log and "upstream configured" in log
        # Bodies and keys are never logged.
        assert "zqxbody" not in log


async def test_startup_without_any_upstream_says_so() -> None:
    # Ports 8080/11434 may be taken on a developer machine; only check the message when free.
    busy = []
    for port in (8080, 11434):
        with socket.socket() as s:
            busy.append(s.connect_ex(("127.0.0.1", port)) == 0)
    if any(busy):
        pytest.skip("a server runs on 8080 or 11434 here; auto-detection would find it")
    proc, url = await start_serve(env_extra={"ENGRAM_UPSTREAM_BUNDLED": "false"})
    try:
        async with aiohttp.ClientSession() as http, http.get(url + "/engram/health") as r:
            health = await r.json()
        assert health["upstream"]["found_by"] == "fallback"
        assert health["status"] == "degraded"
    finally:
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        assert time.monotonic() - start < 15
    log = (await proc.stdout.read()).decode() if proc.stdout else ""
    assert "no upstream found" in log


async def test_sigkill_during_burst_leaves_an_intact_database(tmp_path: Path) -> None:
    db = tmp_path / "engram.db"
    async with FakeUpstream() as fake:
        proc, url = await start_serve("--upstream", fake.url, "--db", str(db), wait_s=30)

        async def one(i: int, http: aiohttp.ClientSession) -> None:
            msgs = [{"role": "user", "content": f"fact number {i}: the code is {i * 7}"}]
            with contextlib.suppress(aiohttp.ClientError):
                async with http.post(
                    url + "/v1/chat/completions",
                    json={"messages": msgs},
                    headers={"X-Engram-User": f"user{i % 3}"},
                ) as r:
                    await r.read()

        token = (tmp_path / "engram.db.admin-token").read_text().strip()
        admin = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession() as http:
            burst = asyncio.gather(*(one(i, http) for i in range(300)))
            for _ in range(400):  # kill it mid-burst, once it has archived something
                async with http.get(url + "/engram/metrics", headers=admin) as r:
                    if "engram_turns_archived_total 0\n" not in await r.text():
                        break
                await asyncio.sleep(0.025)
            proc.kill()  # SIGKILL: no cleanup at all
            await burst
        await proc.wait()

        store = Store(db)
        await store.open()
        try:
            check = await store.read(lambda c: c.execute("PRAGMA integrity_check").fetchall())
            assert check == [("ok",)]
            await store.write(
                lambda c: c.execute("INSERT INTO turns_fts(turns_fts) VALUES('integrity-check')")
            )
            stats = await store.stats()
            assert stats.turns > 0
            orphans = await store.read(
                lambda c: c.execute(
                    "SELECT count(*) FROM turn_vec WHERE turn_id NOT IN (SELECT id FROM turns)"
                ).fetchone()[0]
            )
            assert orphans == 0
        finally:
            await store.close()

        proc, url = await start_serve("--upstream", fake.url, "--db", str(db), wait_s=30)
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.post(
                    url + "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "what is the code?"}]},
                    headers={"X-Engram-User": "user1"},
                ) as r,
            ):
                assert r.status == 200
        finally:
            proc.send_signal(signal.SIGTERM)
            await proc.wait()
