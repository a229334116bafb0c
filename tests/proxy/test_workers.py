"""Several ``engram serve`` processes on one database (issue 25's ``--workers`` on SQLite): real
processes, a real fake upstream, the official HTTP path.

- Two servers on one file, each conversation's turns alternating between them: one session
  per conversation, every message stored once and in order, and a fact told through one
  recalled through the other (its search caches follow the other's writes: proxy/store/changes).
- ``engram serve --workers 2``: one port, two workers; a worker killed is started again; SIGTERM
  stops them all; a port of 0 is refused with the reason.
- A forget through another process takes this one's in-memory views of it too.
- A server SIGKILLed during a hand-back leaves the job to the other, which does it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.services import SERVICES
from proxy.store import Store
from testing.fake_chunks import chat_completion
from testing.fake_upstream import FakeUpstream, JsonReply
from testing.harness import settle, start_engram
from tests.proxy.test_serve import start_serve

pytestmark = pytest.mark.asyncio

FACT = "my sister's tortoise is called Zanzibar and she eats dandelions"


def children(pid: int) -> set[int]:
    try:
        return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except OSError:
        return set()


async def stop(proc: asyncio.subprocess.Process) -> int:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
    return await proc.wait()


async def chat(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], **headers: str
) -> tuple[str, str]:
    """(the reply's text, the session it went to: "" for a read-only request)."""
    body = {"model": "m", "messages": messages}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        data: Any = await r.json()
        assert r.status == 200, data
        return data["choices"][0]["message"]["content"], r.headers.get("X-Engram-Session", "")


async def test_two_servers_on_one_database_serve_alternating_turns_as_one(
    tmp_path: Path,
) -> None:
    db = tmp_path / "engram.db"
    async with FakeUpstream() as fake:
        a, url_a = await start_serve("--upstream", fake.url, "--db", str(db), wait_s=30)
        b, url_b = await start_serve("--upstream", fake.url, "--db", str(db), wait_s=30)
        try:
            async with aiohttp.ClientSession() as http:

                async def conversation(c: int) -> tuple[str, list[str]]:
                    msgs: list[dict[str, str]] = []
                    sessions = []
                    for k in range(4):
                        said = FACT if (c, k) == (0, 0) else f"conversation {c} says thing {k}"
                        msgs.append({"role": "user", "content": said})
                        url = (url_a, url_b)[(c + k) % 2]  # every turn through the other one
                        reply, session = await chat(http, url, msgs)
                        msgs.append({"role": "assistant", "content": reply})
                        sessions.append(session)
                    assert len(set(sessions)) == 1, sessions
                    return sessions[0], [m["content"] for m in msgs]

                done = await asyncio.gather(*(conversation(c) for c in range(12)))
                # the fact went in through A (conversation 0, turn 0); B recalls it
                question = [{"role": "user", "content": "What is my sister's tortoise called?"}]
                t0, recalled = time.monotonic(), False
                while not recalled and time.monotonic() - t0 < 15:
                    await chat(http, url_b, question, **{"X-Engram-Memory": "read-only"})
                    recalled = "Zanzibar" in fake.chat_requests()[-1].body.decode()
                    await asyncio.sleep(0.2)
                assert recalled, "B never recalled what was told through A"
        finally:
            assert await stop(a) == 0 and await stop(b) == 0
    async with Store(db) as store:
        sessions = {s.id: s for s in await store.list_sessions("default")}
        assert len(sessions) == 12  # one per conversation, and none for the read-only question
        for session_id, said in done:
            turns = await store.session_turns(session_id)
            assert [t.content for t in turns if t.role != "system"] == said  # once, in order


async def test_workers_share_a_port_and_a_killed_worker_is_started_again(
    tmp_path: Path,
) -> None:
    db = tmp_path / "engram.db"
    async with FakeUpstream() as fake:
        proc, url = await start_serve(
            "--upstream", fake.url, "--db", str(db), "--workers", "2", wait_s=60
        )
        try:
            t0 = time.monotonic()
            while len(first := children(proc.pid)) < 2:
                assert time.monotonic() - t0 < 30, "the workers never started"
                await asyncio.sleep(0.1)
            assert len(first) == 2

            async def burst(n: int) -> None:
                connector = aiohttp.TCPConnector(force_close=True)  # a new connection each
                async with aiohttp.ClientSession(connector=connector) as http:
                    for i in range(n):
                        msgs = [{"role": "user", "content": f"burst message {i} at {time.time()}"}]
                        await chat(http, url, msgs)

            cpu = {p: _cpu(p) for p in first}
            await burst(30)
            assert all(_cpu(p) > cpu[p] for p in first), "one worker served nothing"
            victim = min(first)
            os.kill(victim, signal.SIGKILL)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 30:
                now = children(proc.pid)
                if len(now) == 2 and victim not in now:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"the killed worker was not replaced: {children(proc.pid)}")
            async with aiohttp.ClientSession() as http:  # the new one serves: health answers
                t0 = time.monotonic()
                while True:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.get(url + "/engram/health") as r:
                            if r.status == 200:
                                break
                    assert time.monotonic() - t0 < 30
                    await asyncio.sleep(0.1)
            await burst(10)
            workers = children(proc.pid)
        finally:
            rc = await stop(proc)
        assert rc == 0
        assert not any(alive(p) for p in workers)


async def test_workers_refuse_a_port_of_zero(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--port", "0", "--workers", "2",
        "--db", str(tmp_path / "e.db"), "--upstream", "http://127.0.0.1:9",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"needs a fixed port" in out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _cpu(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


async def test_a_forget_through_another_process_takes_this_ones_views_too() -> None:
    """The inspector's recent requests and last prompts are held per process: a session
    forgotten through another process (here a second Store on the file, as ``engram forget``
    or another worker holds one) leaves them within about a second, with no search to wake
    this one (the periodic read of the changes log)."""
    async with FakeUpstream() as fake:
        engram = await start_engram(fake.url)
        try:
            async with aiohttp.ClientSession() as http:
                msgs = [{"role": "user", "content": "remember the vault code 4417"}]
                _, session = await chat(http, engram.url, msgs)
                await settle(engram)
            parts = engram.app[SERVICES].parts
            assert parts is not None
            memory = parts.memory
            assert memory.recent.of_user("default", 10)[1] == 1
            assert session in memory.last_requests
            async with Store(parts.store.path) as other:
                assert await other.delete_session(session, user_id="default")
            t0 = time.monotonic()
            while memory.recent.of_user("default", 10)[1] or session in memory.last_requests:
                assert time.monotonic() - t0 < 5, "the views of the forgotten session stayed"
                await asyncio.sleep(0.05)
            assert time.monotonic() - t0 < 2.5
        finally:
            await engram.close()


async def handed_back(db: Path, parent: str) -> list[str]:
    async with Store(db) as store:
        turns = await store.session_turns(parent, from_position=-100)
    return [t.content for t in turns if t.position < 0]


HANDBACK = (
    "Task: read the issue tracker.\nOutcome: found the crash cause.\nKey facts: the crash is in "
    "parser.py line 42, caused by an empty header.\nOpen problems: none."
)


async def test_a_server_killed_during_a_hand_back_leaves_it_to_the_other_once(
    tmp_path: Path,
) -> None:
    """Two servers on one file; A starts a sub-agent's hand-back (the summary call hangs at the
    upstream) and is SIGKILLed. B may not start it while A's lease lives; once it expired
    (``memory.job_lease`` = 2 s) B hands it back: one hand-back item in the parent, not two."""
    db = tmp_path / "engram.db"
    env = {"ENGRAM_SUMMARY_BUDGET_SHARE": "1.0", "ENGRAM_SUMMARY_MAX_TOKENS": "64",
           "ENGRAM_MEMORY_JOB_LEASE": "2"}  # fmt: skip
    async with FakeUpstream() as fake:
        a, url_a = await start_serve("--upstream", fake.url, "--db", str(db), env_extra=env)
        b, url_b = await start_serve("--upstream", fake.url, "--db", str(db), env_extra=env)
        try:
            token = (tmp_path / "engram.db.admin-token").read_text().strip()
            admin = {"Authorization": f"Bearer {token}", "X-Engram-User": "u"}
            user = {"X-Engram-User": "u"}
            async with aiohttp.ClientSession() as http:
                big = [{"role": "user", "content": "investigate the crash " + "context " * 400}]
                for url in (url_a, url_b):  # each server's own traffic: its summary budget
                    _, top = await chat(http, url, big, **user)
                kid_msgs = [{"role": "user", "content": "The crash is in parser.py."}]
                _, kid = await chat(http, url_a, kid_msgs, **user, **{"X-Engram-Parent": top})
                fake.enqueue(JsonReply(chat_completion(HANDBACK), delay=120))  # A's call hangs
                calls = len(fake.chat_requests())
                async with http.post(f"{url_a}/engram/api/sessions/{kid}/complete",
                                     headers=admin) as r:  # fmt: skip
                    assert r.status == 202
                t0 = time.monotonic()
                while len(fake.chat_requests()) == calls:  # A's summary call is in flight
                    assert time.monotonic() - t0 < 15, "A never asked for the hand-back"
                    await asyncio.sleep(0.05)
                a.kill()
                await a.wait()
                fake.enqueue(JsonReply(chat_completion(HANDBACK)))
                t0 = time.monotonic()
                while True:
                    async with http.post(f"{url_b}/engram/api/sessions/{kid}/complete",
                                         headers=admin) as r:  # fmt: skip
                        assert r.status == 202
                    if await handed_back(db, top):
                        break
                    if time.monotonic() - t0 > 20:
                        b.kill()
                        out = (await b.communicate())[0].decode()
                        raise AssertionError(f"B never handed it back:\n{out[-3000:]}")
                    await asyncio.sleep(0.3)
                assert time.monotonic() - t0 >= 1.0  # not while A's lease was alive
        finally:
            if a.returncode is None:
                a.kill()
                await a.wait()
            assert await stop(b) == 0
    assert ["parser.py line 42" in text for text in await handed_back(db, top)] == [True]
