"""Deep JSON and odd request targets are bad input (issue 12, row 11): a 400 in OpenAI's error
shape that changes nothing, on the chat route, the pass-through routes and the admin API, and a
per-line error in ``engram import``; never a 500 with a traceback.

A request body that breaks or stalls after the headers (issue 39) is bad input too: a bad chunk
sent a moment after the headers gets a 400 at once, a body that stops short or trickles past
``limits.body_timeout`` a 408 then; each in OpenAI's error shape, the connection closed after
it, nothing forwarded or stored."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from proxy import json_input
from proxy.cli.main import main
from proxy.services import SERVICES
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, settle, start_engram

DEEP = b"[" * 10_000 + b"]" * 10_000


def nested(depth: int) -> object:
    """``depth`` arrays, one inside the other."""
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


def test_loads_refuses_nesting_over_the_limit() -> None:
    limit = json_input.MAX_DEPTH
    assert json_input.loads(json.dumps(nested(limit))) == nested(limit)
    assert json_input.loads(json.dumps({"a": [nested(limit - 2)]}).encode())
    for text in (json.dumps(nested(limit + 1)), json.dumps({"k": nested(limit)}), DEEP):
        with pytest.raises(json_input.TooDeep):
            json_input.loads(text)
    with pytest.raises(ValueError):
        json_input.loads("{not json")
    # Many brackets side by side are wide, not deep.
    wide = json.dumps([[i] for i in range(5 * limit)])
    assert len(json_input.loads(wide)) == 5 * limit


async def raw_request(url: str, request_line: str, body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 request written byte for byte on a socket: (status, body)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"{request_line}\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def openai_error(body: bytes, code: str) -> dict[str, object]:
    err: dict[str, object] = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == code
    return err


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/v1/embeddings")],
)
async def test_absolute_form_target_is_400(
    engram: Engram, fake: FakeUpstream, method: str, path: str
) -> None:
    before = len(fake.requests)
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    status, body = await raw_request(
        engram.url,
        f"{method} http://evil.example{path} HTTP/1.1",
        chat if method == "POST" else b"",
    )
    assert status == 400
    assert "not a forward proxy" in str(openai_error(body, "invalid_request_target")["message"])
    assert len(fake.requests) == before  # nothing was forwarded
    # The same request in origin-form goes through.
    status, _ = await raw_request(
        engram.url, f"{method} {path} HTTP/1.1", chat if method == "POST" else b""
    )
    assert status != 400 and len(fake.requests) == before + 1


@pytest.mark.asyncio
async def test_deep_json_is_400_on_the_chat_route_and_the_admin_api(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    before = len(fake.requests)
    too_deep = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "extra": nested(json_input.MAX_DEPTH)}
    ).encode()
    for body in (b'{"messages": ' + DEEP + b"}", DEEP, too_deep):
        async with http.post(
            engram.url + "/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json", "X-Engram-User": "u"},
        ) as r:
            assert r.status == 400
            openai_error(await r.read(), "json_too_deep")
        async with http.post(
            engram.url + "/engram/api/feedback",
            data=body,
            headers={"Content-Type": "application/json", "X-Engram-User": "u"},
        ) as r:
            assert r.status == 400
            openai_error(await r.read(), "json_too_deep")
    assert len(fake.requests) == before
    await settle(engram)
    assert await engram.app[SERVICES].store.list_users() == []
    # Nesting within the limit reaches the upstream unchanged.
    fine = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "extra": nested(json_input.MAX_DEPTH - 2)}
    ).encode()
    async with http.post(
        engram.url + "/v1/chat/completions",
        data=fine,
        headers={"Content-Type": "application/json", "X-Engram-User": "u"},
    ) as r:
        assert r.status == 200
    assert fake.chat_requests()[-1].json()["extra"] == nested(json_input.MAX_DEPTH - 2)


def test_deep_json_line_is_an_import_error_and_the_rest_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ENGRAM_EMBEDDER_MODEL", "hash")
    src = tmp_path / "in.jsonl"
    good = {"user": "u", "session": "s", "role": "user", "content": "kept"}
    src.write_bytes(
        json.dumps(good).encode()
        + b"\n"
        + DEEP
        + b"\n"
        + b'{"user": "u", "session": "s", "role": "user", "content": '
        + json.dumps(nested(200)).encode()
        + b"}\n"
        + json.dumps({**good, "content": "also kept"}).encode()
        + b"\n"
    )
    db = tmp_path / "engram.db"
    assert main(["import", str(src), "--db", str(db)]) == 0
    out = capsys.readouterr()
    assert f"{src}:2: JSON nested deeper than {json_input.MAX_DEPTH} levels" in out.err
    assert f"{src}:3: JSON nested deeper than {json_input.MAX_DEPTH} levels" in out.err
    assert "imported 2 turns" in out.out


# --- bodies that break or stall after the headers (issue 39) -------------------------------------

CHUNKED_HEAD = (
    "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ctype}\r\n"
    "X-Engram-User: u\r\nTransfer-Encoding: chunked\r\n\r\n"
)
SHORT_HEAD = (
    "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ctype}\r\n"
    "X-Engram-User: u\r\nContent-Length: 100\r\n\r\n"
)
# Each kind of route that reads a body: chat, pass-through, the admin API, MCP, an inspector form.
BODY_PATHS = [
    "/v1/chat/completions",
    "/v1/embeddings",
    "/engram/api/feedback",
    "/engram/mcp",
    "/engram/signin",
]


def content_type(path: str) -> str:
    return "application/x-www-form-urlencoded" if path == "/engram/signin" else "application/json"


async def late_body(
    url: str, head: str, path: str, parts: Sequence[tuple[float, bytes]], patience: float = 15
) -> tuple[float, int, dict[str, str], bytes]:
    """Headers at once, then each part after its delay, on one socket: (seconds until Engram
    closed the connection, status, headers, body). The client waits ``patience`` seconds, as a
    real one would, for an answer and the connection's end; the parts still to send when the
    server closes are dropped."""
    host = url.removeprefix("http://")
    reader, writer = await asyncio.open_connection(*host.split(":"))
    start = time.monotonic()
    writer.write(head.format(path=path, host=host, ctype=content_type(path)).encode())

    async def send() -> None:
        for delay, data in parts:
            await asyncio.sleep(delay)
            if writer.is_closing():
                return
            writer.write(data)
            await writer.drain()

    sending = asyncio.create_task(send())
    try:
        data = await asyncio.wait_for(reader.read(), patience)  # to EOF: the connection closed
    except TimeoutError:
        raise AssertionError(f"no answer and no close within {patience} s") from None
    finally:
        elapsed = time.monotonic() - start
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
        writer.close()
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head_bytes.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return elapsed, int(status_line.split()[1]), headers, body


async def memory_of(engram: Engram) -> list[Any]:
    """Every user's stored items, to compare before and after."""
    await settle(engram)
    store = engram.app[SERVICES].store
    assert store is not None
    return [
        (user, [item async for item in store.export(user)]) for user in await store.list_users()
    ]


@pytest_asyncio.fixture
async def body_engram(fake: FakeUpstream) -> AsyncIterator[Engram]:
    """Engram with a 1 s ``limits.body_timeout`` and one stored turn (user ``u``)."""
    e = await start_engram(fake.url, limits={"body_timeout": 1.0})
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                e.url + "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "remember me"}]},
                headers={"X-Engram-User": "u"},
            ) as r,
        ):
            assert r.status == 200
        yield e
    finally:
        await e.close()


def body_error(status: int, headers: dict[str, str], body: bytes, expected: int, code: str) -> str:
    assert status == expected, body
    assert headers["connection"] == "close"
    assert headers["content-type"].startswith("application/json")
    return str(openai_error(body, code)["message"])


@pytest.mark.asyncio
@pytest.mark.parametrize("path", BODY_PATHS)
async def test_a_bad_chunk_sent_late_is_400_at_once_and_closes(
    engram: Engram, fake: FakeUpstream, path: str
) -> None:
    before, forwarded = await memory_of(engram), len(fake.requests)
    elapsed, status, headers, body = await late_body(
        engram.url, CHUNKED_HEAD, path, [(0.3, b"zz\r\n{}\r\n0\r\n\r\n")]
    )
    message = body_error(status, headers, body, 400, "unreadable_body")
    assert "could not be read" in message  # and why, in aiohttp's words
    assert elapsed < 2  # answered at once (the default body_timeout is 60 s)
    assert len(fake.requests) == forwarded
    assert await memory_of(engram) == before


@pytest.mark.asyncio
@pytest.mark.parametrize("path", BODY_PATHS)
async def test_a_body_that_stops_short_is_408_after_body_timeout_and_closes(
    body_engram: Engram, fake: FakeUpstream, path: str
) -> None:
    before, forwarded = await memory_of(body_engram), len(fake.requests)
    assert before and before[0][0] == "u"
    elapsed, status, headers, body = await late_body(
        body_engram.url, SHORT_HEAD, path, [(0.1, b'{"model": "m", "messages": [')]
    )
    message = body_error(status, headers, body, 408, "body_timeout")
    assert "limits.body_timeout" in message
    assert 0.9 < elapsed < 3
    assert len(fake.requests) == forwarded
    assert await memory_of(body_engram) == before


@pytest.mark.asyncio
async def test_a_body_that_trickles_past_body_timeout_is_408(
    body_engram: Engram, fake: FakeUpstream
) -> None:
    """Each chunk comes soon after the last, but the whole body takes too long."""
    before, forwarded = await memory_of(body_engram), len(fake.requests)
    trickle = [(0.2, b"1\r\n \r\n")] * 25 + [(0.2, b"0\r\n\r\n")]
    elapsed, status, headers, body = await late_body(
        body_engram.url, CHUNKED_HEAD, "/v1/chat/completions", trickle
    )
    body_error(status, headers, body, 408, "body_timeout")
    assert 0.9 < elapsed < 3
    assert len(fake.requests) == forwarded
    assert await memory_of(body_engram) == before


@pytest.mark.asyncio
async def test_a_body_sent_late_but_whole_is_answered(
    body_engram: Engram, fake: FakeUpstream
) -> None:
    """A body that arrives in pieces within ``limits.body_timeout`` goes through."""
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "late"}]}).encode()
    parts = [(0.3, b"%x\r\n%s\r\n" % (len(chat) // 2, chat[: len(chat) // 2]))]
    parts.append(
        (0.3, b"%x\r\n%s\r\n0\r\n\r\n" % (len(chat) - len(chat) // 2, chat[len(chat) // 2 :]))
    )
    head = CHUNKED_HEAD.replace("\r\n\r\n", "\r\nConnection: close\r\n\r\n")
    _, status, _, body = await late_body(body_engram.url, head, "/v1/chat/completions", parts)
    assert status == 200, body
    last = fake.chat_requests()[-1].json()["messages"][-1]  # "late", a memory block before it
    assert last["content"][-1] == {"type": "text", "text": "late"}


@pytest.mark.asyncio
@pytest.mark.parametrize("path", BODY_PATHS)
async def test_a_body_that_does_not_decompress_is_400(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession, path: str
) -> None:
    """aiohttp inflates a gzip body as it reads it; one that is not gzip cannot be read."""
    before, forwarded = await memory_of(engram), len(fake.requests)
    headers = {"Content-Type": content_type(path), "Content-Encoding": "gzip", "X-Engram-User": "u"}
    async with http.post(engram.url + path, data=b"not gzip at all", headers=headers) as r:
        lower = {k.lower(): v for k, v in r.headers.items()}
        message = body_error(r.status, lower, await r.read(), 400, "unreadable_body")
    assert "content-encoding" in message
    assert len(fake.requests) == forwarded
    assert await memory_of(engram) == before
