"""A pooled upstream connection that the upstream has closed is no 502.

llama-server closes its connection about 0.1 ms after every streamed reply while advertising
``Keep-Alive: timeout=5, max=100``. Before: Engram's pool took the connection back, the next POST
went out on it and died with "Server disconnected", a 502 (10 of 10 when the POST followed the
stream at once). Now a request whose pooled connection dies before any response byte arrived is
sent once more on a new connection; a connect failure (nothing listening) is still one fast 502.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import socket
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from proxy.config import UpstreamSettings
from proxy.errors import UpstreamUnavailable
from proxy.upstream import Upstream, UpstreamInfo
from testing.fake_upstream import DropReply, FakeUpstream, RawReply
from testing.harness import Engram, start_engram

pytestmark = pytest.mark.asyncio

CLOSE_AFTER = 0.05  # seconds after a streamed reply that the fake closes its connection
PAIRS = 12
RETRY_LOG = "sending it again"


def chat(text: str, *, stream: bool = False) -> dict[str, object]:
    return {"model": "m", "stream": stream, "messages": [{"role": "user", "content": text}]}


@pytest_asyncio.fixture
async def closing() -> AsyncIterator[FakeUpstream]:
    """A fake upstream that closes each connection shortly after a streamed reply."""
    async with FakeUpstream(close_after_stream=CLOSE_AFTER) as upstream:
        yield upstream


@pytest_asyncio.fixture
async def engram(closing: FakeUpstream) -> AsyncIterator[Engram]:
    e = await start_engram(closing.url, summary={"enabled": False})
    try:
        yield e
    finally:
        await e.close()


async def read_streamed(r: aiohttp.ClientResponse) -> bytes:
    assert r.status == 200, await r.text()
    body = await r.read()
    assert b"data: [DONE]" in body
    return body


async def test_the_fake_really_closes_after_a_stream(closing: FakeUpstream) -> None:
    """Directly, without Engram: the fake advertises keep-alive, answers nothing more on the
    connection after a streamed reply, and closes it ``CLOSE_AFTER`` seconds later."""
    host, port = closing.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        body = json.dumps(chat("hi", stream=True)).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        writer.write(head.encode() + body)
        got = b""
        while not got.endswith(b"0\r\n\r\n"):  # the last chunk of a chunked reply
            part = await asyncio.wait_for(reader.read(65536), 5)
            assert part, got
            got += part
        ended = time.monotonic()
        headers = got.split(b"\r\n\r\n", 1)[0].lower()
        assert b"keep-alive: timeout=5, max=100" in headers and b"connection: close" not in headers
        # A second request on the same connection, at once: never answered, the socket closes.
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            rest = await asyncio.wait_for(reader.read(65536), 5)
        except ConnectionResetError:
            rest = b""  # closed with the request unread: a reset instead of a clean end
        assert rest == b""
        assert time.monotonic() - ended >= CLOSE_AFTER * 0.5
    finally:
        writer.close()
    assert [r.path for r in closing.requests] == ["/v1/chat/completions"]


async def test_a_post_right_after_a_stream_succeeds(
    engram: Engram, closing: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="engram.upstream")
    statuses: list[int] = []
    async with aiohttp.ClientSession() as http:
        for i in range(PAIRS):
            async with http.post(
                engram.url + "/v1/chat/completions", json=chat(f"streamed {i}", stream=True)
            ) as r:
                await read_streamed(r)
            # At once, through the same Engram: a pass-through POST and a chat POST by turns.
            payload: dict[str, object]
            if i % 2:
                path, payload = "/v1/completions", {"prompt": f"p{i}"}
            else:
                path, payload = "/v1/chat/completions", chat(f"plain {i}")
            async with http.post(engram.url + path, json=payload) as r:
                statuses.append(r.status)
                assert r.status == 200, await r.text()
                await r.read()
    assert statuses == [200] * PAIRS
    # The stale connection was really met (and the retry said so in the debug log).
    assert any(RETRY_LOG in r.getMessage() for r in caplog.records)


async def test_a_dropped_request_is_sent_exactly_once_more(
    engram: Engram, closing: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    # A first request leaves a connection in Engram's pool ...
    async with http.get(engram.url + "/v1/models") as r:
        assert r.status == 200
    # ... on which the upstream then drops the next request unanswered.
    closing.enqueue(DropReply())
    before = len(closing.requests)
    payload = json.dumps(chat("dropped once")).encode()
    async with http.post(
        engram.url + "/v1/chat/completions",
        data=payload,
        headers={"Content-Type": "application/json", "X-Custom": "kept"},
    ) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["choices"][0]["message"]["content"] == "echo: dropped once"
    sent = closing.requests[before:]
    assert [(s.method, s.path) for s in sent] == [("POST", "/v1/chat/completions")] * 2
    assert sent[0].body == sent[1].body
    assert sent[0].headers["X-Custom"] == sent[1].headers["X-Custom"] == "kept"


async def test_a_large_body_is_sent_whole_again(
    engram: Engram, closing: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """A body over 1 MiB goes as a stream; the second attempt sends all of it again."""
    async with http.get(engram.url + "/v1/models") as r:
        assert r.status == 200
    body = bytes(range(256)) * (3 * 4096)  # 3 MiB
    closing.enqueue(DropReply(), RawReply(b'{"ok": true}'), path="/upload")
    async with http.post(engram.url + "/upload", data=io.BytesIO(body)) as r:
        assert r.status == 200 and await r.json() == {"ok": True}
    sent = [s for s in closing.requests if s.path == "/upload"]
    assert len(sent) == 2 and sent[0].body == sent[1].body == body


async def test_a_request_dropped_twice_is_one_502(
    engram: Engram, closing: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    async with http.get(engram.url + "/v1/models") as r:
        assert r.status == 200
    closing.enqueue(DropReply(), DropReply(), DropReply())
    before = len(closing.requests)
    async with http.post(engram.url + "/v1/chat/completions", json=chat("dropped")) as r:
        assert r.status == 502, await r.text()
        assert r.headers["x-should-retry"] == "false"
    assert len(closing.requests) - before == 2  # the request and one retry, no more


async def test_a_dead_upstream_is_one_fast_502(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    engram = await start_engram(url, summary={"enabled": False})
    caplog.set_level(logging.DEBUG, logger="engram.upstream")
    try:
        for path, payload in (("/v1/chat/completions", chat("hi")), ("/v1/completions", {})):
            start = time.monotonic()
            async with http.post(engram.url + path, json=payload) as r:
                assert r.status == 502
                assert r.headers["x-should-retry"] == "false"
                assert url in (await r.json())["error"]["message"]
            assert time.monotonic() - start < 2
    finally:
        await engram.close()
    assert not [r for r in caplog.records if RETRY_LOG in r.getMessage()]


async def test_a_new_connection_that_drops_the_request_is_not_retried(
    closing: FakeUpstream,
) -> None:
    """Only a pooled connection can be stale: when a connection opened for the request dies
    under it, the upstream itself failed on it, and a second try could repeat a crash or a
    long generation."""
    upstream = Upstream(
        UpstreamSettings(url=closing.url), UpstreamInfo(closing.url, "llamacpp", "x")
    )
    closing.enqueue(DropReply(), path="/v1/completions")
    try:
        with pytest.raises(UpstreamUnavailable, match="Server disconnected"):
            await upstream.send("POST", "/v1/completions", {}, b"{}")
    finally:
        await upstream.close()
    assert [r.path for r in closing.requests] == ["/v1/completions"]
