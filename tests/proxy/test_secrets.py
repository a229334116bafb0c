"""Secrets through the real proxy (issue 12, rows 9 and 10): a tool output's AWS secret is
redacted in the turns, the slots (SQLite table and Redis) and the database files; summaries,
facts and request records are redacted; logs never print a secret; ``/engram/health``, start-up
logs and upstream errors show no credentials."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from proxy import logs
from proxy.services import SERVICES
from proxy.store.feedback import get_request
from testing.fake_chunks import chat_completion
from testing.fake_upstream import FakeUpstream, JsonReply
from testing.harness import Engram, settle, start_engram
from testing.redis_server import RedisServer
from tests.proxy.test_consolidation import flagged, no_usage, search
from tests.proxy.test_consolidation import post as api_post
from tests.proxy.test_consolidation import start as start_consolidating
from tests.proxy.test_memory import all_turns
from tests.proxy.test_rewrite import long_chat
from tests.proxy.test_serve import start_serve
from tests.proxy.test_slot_proxy import agent_chat, output
from tests.proxy.test_summary import post as summary_post
from tests.proxy.test_summary import start as start_summarising
from tests.proxy.test_summary import summary_of
from tests.unit.test_redact import AWS_ID, AWS_SECRET, p, rnd


def aws_output() -> str:
    """A tool output (``cat ~/.aws/credentials`` amid a file listing), about 1,000 tokens."""
    return (
        output("before", 60)
        + f"\n[default]\naws_access_key_id = {AWS_ID}\naws_secret_access_key = {AWS_SECRET}\n"
        + output("after", 60)
    )


def db_bytes(engram: Engram) -> bytes:
    """Every byte of the database and its -wal/-shm files."""
    folder = Path(engram.tmp.name)
    return b"".join(f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file())


async def redis_values(url: str) -> str:
    client = aioredis.from_url(url)
    try:
        values = [await client.hgetall(key) for key in await client.keys("*")]
    finally:
        await client.aclose()
    return json.dumps(
        [{k.decode(): v.decode(errors="replace") for k, v in h.items()} for h in values]
    )


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["embedded", "redis"])
async def test_a_tool_outputs_aws_secret_is_stored_redacted_everywhere(
    backend: str, http: aiohttp.ClientSession, request: pytest.FixtureRequest
) -> None:
    slots: dict[str, Any] = {}
    if backend == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        slots = {"redis_url": server.url}
    async with FakeUpstream(strict_templates=True, n_ctx=32768) as fake:
        engram = await start_engram(fake.url, slots=slots)
        try:
            msgs = agent_chat([aws_output(), output("b")])
            async with http.post(
                engram.url + "/v1/chat/completions",
                json={"messages": msgs},
                headers={"X-Engram-User": "alice"},
            ) as r:
                assert r.status == 200
            await settle(engram)
            forwarded = json.dumps(fake.chat_requests()[-1].json()["messages"])
            assert "[TOOL_RESULT:" in forwarded  # the output became a slot
            assert AWS_SECRET not in forwarded
            turns = json.dumps([t.content for t in await all_turns(engram, "alice")])
            store = engram.app[SERVICES].store
            table = await store.read(
                lambda c: json.dumps([list(r) for r in c.execute("SELECT * FROM slots")])
            )
            held = await redis_values(slots["redis_url"]) if backend == "redis" else table
            assert "aws_secret_access_key" in held  # the slot is there
            # The secret is nowhere: not in the turns, the slot, the database's files.
            assert AWS_SECRET not in turns
            assert AWS_SECRET not in held and AWS_ID not in held
            assert AWS_SECRET.encode() not in db_bytes(engram)
            assert "[REDACTED:aws-secret]" in turns and "[REDACTED:aws-secret]" in held
            if backend == "redis":
                assert table == "[]"
        finally:
            await engram.close()


@pytest.mark.asyncio
async def test_a_summary_holding_a_secret_is_stored_redacted(http: aiohttp.ClientSession) -> None:
    password = rnd("summary-pw", 18)
    summary = (
        "The user asked forty numbered questions about lorem ipsum and shared the staging "
        f"database postgres://app:{password}@db.internal:5432/app for question 3."
    )
    async with FakeUpstream(n_ctx=2048, strict_templates=True, enforce_ctx=True) as fake:
        engram = await start_summarising(fake)
        try:
            fake.enqueue(
                JsonReply(chat_completion("Question 3 was about lorem.")),
                *[JsonReply(chat_completion(summary)) for _ in range(30)],
            )
            await summary_post(http, engram, long_chat(40))
            await settle(engram)
            stored = await summary_of(engram)
            assert stored is not None and "staging database" in stored.content
            assert password not in stored.content
            assert "[REDACTED:url-password]" in stored.content
        finally:
            await engram.close()


@pytest.mark.asyncio
async def test_a_fact_and_a_request_record_holding_secrets_are_stored_redacted(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    key = p("sk", "-proj-") + rnd("fact-key", 48)
    password = rnd("record-pw", 14)
    e = await start_consolidating(fake, budget_share=0.5, max_tokens=64)
    try:
        # The request record keeps the question: it holds a JSON password.
        question = f'Where does my sister live now? My config is {{"password": "{password}"}}'
        async with http.post(
            e.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": question}]},
            headers={"X-Engram-User": "rec", "X-Engram-Session": "rec-q"},
        ) as r:
            rid = r.headers["X-Engram-Request-Id"]
        await settle(e)
        record = await e.app[SERVICES].store.read(lambda c: get_request(c, rid))
        assert record is not None and "sister" in record.query
        assert password not in record.query and "[REDACTED:password]" in record.query
        # A fact the model distilled, holding a key (as one from an old archive could).
        await flagged(http, e, **{"X-Engram-Session": "q"})
        fact = {"subject": "Ilse", "fact": f"Ilse in Tromso uses the aquarium key {key}"}
        fake.enqueue(no_usage(json.dumps(fact)))
        report = await api_post(http, e, "consolidate")
        assert report["facts"] == 1
        facts = [h["content"] for h in await search(http, e, "Ilse Tromso") if h["role"] == "fact"]
        assert len(facts) == 1 and "Tromso" in facts[0]
        assert key not in facts[0] and "[REDACTED:openai-key]" in facts[0]
        # The same fact again is known (compared as stored): nothing is added.
        await settle(e)
        rid, _ = await _flag_again(http, e)
        fake.enqueue(no_usage(json.dumps(fact)))
        assert (await api_post(http, e, "consolidate"))["facts"] == 0
    finally:
        await e.close()


async def _flag_again(http: aiohttp.ClientSession, e: Engram) -> tuple[str, None]:
    async with http.post(
        e.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Where is Ilse?"}]},
        headers={"X-Engram-User": "u", "X-Engram-Session": "again"},
    ) as r:
        rid = r.headers["X-Engram-Request-Id"]
    await settle(e)
    await api_post(http, e, "feedback", {"request_id": rid, "helpful": False})
    return rid, None


# --- what Engram shows -----------------------------------------------------------------------


def with_credentials(url: str, password: str, key: str) -> str:
    return url.replace("http://", f"http://engram:{password}@") + f"/?api_key={key}"


@pytest.mark.asyncio
async def test_health_and_upstream_errors_show_no_credentials(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    password, key = rnd("health-pw", 16), rnd("health-key", 24)
    engram = await start_engram(with_credentials(fake.url, password, key))
    try:
        async with http.get(engram.url + "/engram/health") as r:
            text = await r.text()
        body = json.loads(text)
        assert body["upstream"]["url"] == fake.url + "/"
        assert body["upstream"]["reachable"] is True
        for secret in (password, key, "engram:"):
            assert secret not in text
    finally:
        await engram.close()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    engram = await start_engram(with_credentials(dead, password, key))
    try:
        async with http.post(
            engram.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
        ) as r:
            assert r.status == 502
            text = await r.text()
        assert dead in text and password not in text and key not in text
    finally:
        await engram.close()


@pytest.mark.asyncio
async def test_serve_logs_the_upstream_without_credentials(fake: FakeUpstream) -> None:
    password, key = rnd("serve-pw", 16), rnd("serve-key", 24)
    proc, url = await start_serve("--upstream", with_credentials(fake.url, password, key))
    try:
        async with aiohttp.ClientSession() as http, http.get(url + "/engram/health") as r:
            assert password not in await r.text()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
    text = out.decode()
    assert fake.url.split("//")[1] in text  # the upstream line is there
    assert password not in text and key not in text


@pytest.fixture
def engram_logger() -> Iterator[logging.Logger]:
    """The 'engram' logger, restored after :func:`proxy.logs.setup` changed it."""
    root = logging.getLogger("engram")
    saved = (root.handlers[:], root.level, root.propagate)
    yield root
    root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_logs_never_print_a_secret(
    fmt: str, engram_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    token, password = p("gh", "p_") + rnd("log-gh", 36), rnd("log-pw", 15)
    body = json.dumps({"messages": [{"role": "user", "content": f"my token is {token}"}]})
    listener = logs.setup("debug", fmt)
    try:
        log = logging.getLogger("engram.test")
        logs.event(
            log,
            logging.ERROR,
            "upstream failed",
            error=f"401 from postgres://app:{password}@db/app",
            body=body,
        )
        log.warning("request body %s", body)
        try:
            raise RuntimeError(f"bad credentials {token}")
        except RuntimeError:
            log.exception("it failed")
    finally:
        listener.stop()
    err = capsys.readouterr().err
    assert "upstream failed" in err and "it failed" in err and "request body" in err
    assert token not in err and password not in err
    assert "[REDACTED:github-token]" in err and "[REDACTED:url-password]" in err
    if fmt == "json":
        for line in err.splitlines():
            if line.startswith("{"):
                json.loads(line)
