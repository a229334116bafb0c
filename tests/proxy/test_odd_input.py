"""Deep JSON and odd request targets are bad input (issue 12, row 11): a 400 in OpenAI's error
shape that changes nothing, on the chat route, the pass-through routes and the admin API, and a
per-line error in ``engram import``; never a 500 with a traceback."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from proxy import json_input
from proxy.cli.main import main
from proxy.services import SERVICES
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, settle

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
