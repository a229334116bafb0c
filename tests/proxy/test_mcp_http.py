"""The MCP endpoint's protocol edges over raw HTTP (aiohttp as the client, a running Engram):
methods, notifications, revisions and their headers, malformed JSON-RPC, body limits, origins,
OAuth discovery, the admin token, identity headers, a trusted front-end, memory disabled."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from proxy.services import SERVICES
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, settle, start_engram

pytestmark = pytest.mark.asyncio

MCP = "/engram/mcp"
ACCEPT = {"Accept": "application/json, text/event-stream"}
MODERN = "2026-07-28"
META = {
    "io.modelcontextprotocol/protocolVersion": MODERN,
    "io.modelcontextprotocol/clientCapabilities": {},
    "io.modelcontextprotocol/clientInfo": {"name": "test", "version": "1"},
}


def request(method: str, params: dict[str, Any] | None = None, id: int = 1) -> dict[str, Any]:
    body: dict[str, Any] = {"jsonrpc": "2.0", "id": id, "method": method}
    if params is not None:
        body["params"] = params
    return body


def modern(method: str, params: dict[str, Any] | None = None, name: str | None = None) -> Any:
    """A 2026-07-28 request and its headers."""
    headers = {**ACCEPT, "MCP-Protocol-Version": MODERN, "Mcp-Method": method}
    if name is not None:
        headers["Mcp-Name"] = name
    return request(method, {**(params or {}), "_meta": META}), headers


async def post(
    http: aiohttp.ClientSession,
    engram: Engram,
    body: Any,
    headers: dict[str, str] | None = None,
    status: int = 200,
) -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = {"Content-Type": "application/json", **ACCEPT, **(headers or {})}
    async with http.post(engram.url + MCP, data=data, headers=sent) as r:
        raw = await r.read()
        assert r.status == status, raw
        if not raw:
            return None
        assert r.content_type == "application/json"
        return json.loads(raw)


def error_of(answer: Any) -> tuple[int, str]:
    assert answer["jsonrpc"] == "2.0" and "result" not in answer, answer
    return answer["error"]["code"], answer["error"]["message"]


async def test_only_post(engram: Engram, http: aiohttp.ClientSession) -> None:
    for method in ("GET", "DELETE", "PUT", "PATCH", "OPTIONS"):
        async with http.request(method, engram.url + MCP, headers=ACCEPT) as r:
            assert r.status == 405, method
            assert r.headers["Allow"] == "POST"
            assert (await r.json())["error"]["code"] == "method_not_allowed"


async def test_notifications_get_202_and_no_body(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    for method in ("notifications/initialized", "notifications/cancelled", "notifications/x"):
        note = {"jsonrpc": "2.0", "method": method, "params": {}}
        assert await post(http, engram, note, status=202) is None
    response = {"jsonrpc": "2.0", "id": 5, "result": {}}
    assert await post(http, engram, response, status=202) is None
    headers = {"MCP-Protocol-Version": MODERN}
    assert await post(http, engram, response, headers, status=400) is not None


async def test_the_handshake_negotiates_a_revision(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    for asked, got in (
        ("2025-06-18", "2025-06-18"),
        ("2025-11-25", "2025-11-25"),
        ("2025-03-26", "2025-11-25"),
        (MODERN, "2025-11-25"),  # 2026-07-28 has no handshake
        ("1999-01-01", "2025-11-25"),
    ):
        params = {"protocolVersion": asked, "capabilities": {}, "clientInfo": {"name": "t"}}
        answer = await post(http, engram, request("initialize", params))
        result = answer["result"]
        assert result["protocolVersion"] == got
        assert result["capabilities"] == {"tools": {"listChanged": False}}
        assert (
            result["serverInfo"]["name"] == "engram" and "engram_search" in result["instructions"]
        )
        assert "resultType" not in result
    code, says = error_of(await post(http, engram, request("initialize", {})))
    assert code == -32602 and "protocolVersion" in says
    assert (await post(http, engram, request("ping")))["result"] == {}
    # stateless: no initialize needed, no session id issued
    async with http.post(engram.url + MCP, json=request("tools/list"), headers=ACCEPT) as r:
        assert r.status == 200 and "Mcp-Session-Id" not in r.headers
        assert len((await r.json())["result"]["tools"]) == 5


async def test_the_version_header(engram: Engram, http: aiohttp.ClientSession) -> None:
    for version in ("2025-06-18", "2025-11-25"):
        answer = await post(http, engram, request("tools/list"), {"MCP-Protocol-Version": version})
        assert "tools" in answer["result"]
    for version in ("2025-03-26", "2024-11-05", "banana"):
        answer = await post(
            http, engram, request("tools/list"), {"MCP-Protocol-Version": version}, status=400
        )
        code, says = error_of(answer)
        assert code == -32022 and repr(version) in says
        assert answer["error"]["data"] == {
            "supported": ["2026-07-28", "2025-11-25", "2025-06-18"],
            "requested": version,
        }
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    await post(http, engram, note, {"MCP-Protocol-Version": "banana"}, status=400)


async def test_the_stateless_revision(engram: Engram, http: aiohttp.ClientSession) -> None:
    body, headers = modern("server/discover")
    result = (await post(http, engram, body, headers))["result"]
    assert result["supportedVersions"] == ["2026-07-28", "2025-11-25", "2025-06-18"]
    assert result["resultType"] == "complete" and result["cacheScope"] == "public"
    assert result["ttlMs"] > 0 and "engram_remember" in result["instructions"]
    assert result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "engram"

    body, headers = modern("tools/list")
    listed = (await post(http, engram, body, headers))["result"]
    assert listed["cacheScope"] == "private" and listed["resultType"] == "complete"

    arguments = {"name": "engram_sessions", "arguments": {}}
    body, headers = modern("tools/call", arguments, name="engram_sessions")
    result = (await post(http, engram, body, headers))["result"]
    assert result["resultType"] == "complete" and result["isError"] is False
    encoded = "=?base64?" + base64.b64encode(b"engram_sessions").decode() + "?="
    body, headers = modern("tools/call", arguments, name=encoded)
    assert (await post(http, engram, body, headers))["result"]["isError"] is False

    failures: list[tuple[dict[str, Any], dict[str, str], int, int]] = []
    body, headers = modern("tools/call", arguments, name="engram_search")
    failures.append((body, headers, 400, -32020))  # Mcp-Name says another tool
    body, headers = modern("tools/call", arguments)
    failures.append((body, headers, 400, -32020))  # no Mcp-Name
    body, headers = modern("tools/list")
    failures.append((body, {**headers, "Mcp-Method": "tools/call"}, 400, -32020))
    failures.append((body, {k: v for k, v in headers.items() if k != "Mcp-Method"}, 400, -32020))
    failures.append((request("tools/list", {"_meta": META}), ACCEPT, 400, -32020))  # no header
    failures.append((request("tools/list"), headers, 400, -32602))  # no _meta
    unsupported = {**META, "io.modelcontextprotocol/protocolVersion": "2025-11-25"}
    failures.append((request("tools/list", {"_meta": unsupported}), headers, 400, -32020))
    body, headers = modern("ping")
    failures.append((body, headers, 404, -32601))  # removed in 2026-07-28
    body, headers = modern("initialize", {"protocolVersion": MODERN})
    failures.append((body, headers, 404, -32601))
    body, headers = modern("resources/list")
    failures.append((body, headers, 404, -32601))
    body, headers = modern("tools/call", {"name": "nope"}, name="nope")
    failures.append((body, headers, 400, -32602))
    for body, headers, status, code in failures:
        answer = await post(http, engram, body, headers, status=status)
        assert error_of(answer)[0] == code, (body, headers, answer)
        assert answer["id"] == 1


async def test_malformed_json_rpc(engram: Engram, http: aiohttp.ClientSession) -> None:
    cases: list[tuple[bytes | Any, int, int, str]] = [
        (b"{not json", 400, -32700, "not valid JSON"),
        (b"", 400, -32700, "empty"),
        (b"[" * 200 + b"]" * 200, 400, -32600, "nested deeper"),
        ([request("ping"), request("ping", id=2)], 400, -32600, "Batches are not supported"),
        ([], 400, -32600, "Batches"),
        ("hello", 400, -32600, "one JSON-RPC 2.0 message"),
        ({"id": 1, "method": "ping"}, 400, -32600, '"jsonrpc" must be "2.0"'),
        ({"jsonrpc": "1.0", "id": 1, "method": "ping"}, 400, -32600, "jsonrpc"),
        ({"jsonrpc": "2.0", "id": None, "method": "ping"}, 400, -32600, "not null"),
        ({"jsonrpc": "2.0", "id": 1.5, "method": "ping"}, 400, -32600, '"id" must be'),
        ({"jsonrpc": "2.0", "id": True, "method": "ping"}, 400, -32600, '"id" must be'),
        ({"jsonrpc": "2.0", "id": 1}, 400, -32600, '"method" is required'),
        ({"jsonrpc": "2.0", "id": 1, "method": 7}, 400, -32600, '"method" is required'),
        (request("tools/list", [1, 2]), 400, -32602, '"params" of tools/list must be an object'),
        (request("resources/list"), 200, -32601, "Method not found: 'resources/list'"),
        (request("tools/call", {"arguments": {}}), 200, -32602, "params.name"),
        (request("tools/call", {"name": "engram_sessions", "arguments": [1]}), 200, -32602, ""),
        (request("tools/call", {"name": "rm_rf", "arguments": {}}), 200, -32602, "Unknown tool"),
    ]
    for body, status, code, says in cases:
        answer = await post(http, engram, body, status=status)
        got, message = error_of(answer)
        assert got == code and says in message, (body, answer)
    assert (await post(http, engram, request("ping", id="abc")))["id"] == "abc"


async def test_bodies_json_only_capped_and_accept(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    async with http.post(
        engram.url + MCP, data=json.dumps(request("ping")), headers={"Content-Type": "text/plain"}
    ) as r:
        assert r.status == 415
    big = json.dumps(
        request("tools/call", {"name": "engram_remember", "arguments": {"text": "x" * 2**20}})
    ).encode()

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the cap counts what comes
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    for data in (io.BytesIO(big), chunked()):
        async with http.post(
            engram.url + MCP, data=data, headers={"Content-Type": "application/json", **ACCEPT}
        ) as r:
            assert r.status == 413
            code, says = error_of(await r.json())
        assert code == -32600 and "at most 1048576 bytes" in says
    async with http.post(
        engram.url + MCP, json=request("ping"), headers={"Accept": "text/html"}
    ) as r:
        assert r.status == 406
    for accept in ("application/json", "*/*", "text/event-stream, application/json;q=0.9"):
        assert (await post(http, engram, request("ping"), {"Accept": accept}))["result"] == {}
    store = engram.app[SERVICES].store
    assert store is not None
    assert await store.read(lambda c: c.execute("SELECT count(*) FROM turns").fetchone()) == (0,)


async def test_pages_on_other_origins_are_refused_every_method(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    for method in ("GET", "POST", "DELETE", "OPTIONS"):
        for headers in (
            {"Origin": "http://evil.example"},
            {"Origin": "http://127.0.0.1:9999"},
            {"Origin": "null"},
            {"Sec-Fetch-Site": "same-site"},
            {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
        ):
            async with http.request(
                method, engram.url + MCP, json=request("ping"), headers=headers
            ) as r:
                assert r.status == 403, (method, headers)
                assert "Access-Control-Allow-Origin" not in r.headers
    own = engram.url.removeprefix("http://")
    answer = await post(http, engram, request("ping"), {"Origin": f"http://{own}"})
    assert answer["result"] == {}


async def test_no_oauth_discovery(
    fake: FakeUpstream, engram: Engram, http: aiohttp.ClientSession
) -> None:
    for path in (
        "/.well-known/oauth-protected-resource",
        "/.well-known/oauth-protected-resource/engram/mcp",
        "/.well-known/oauth-authorization-server",
        "/.well-known/oauth-authorization-server/engram/mcp",
        "/.well-known/openid-configuration",
    ):
        async with http.get(engram.url + path) as r:
            assert r.status == 404, path
            body = await r.json()
            assert body["error"]["code"] == "no_oauth" and "issuer" not in body
            assert "WWW-Authenticate" not in r.headers
    assert not [r for r in fake.requests if r.path.startswith("/.well-known")]
    async with http.get(engram.url + "/.well-known/other") as r:  # the rest still passes through
        assert r.status == 404
    assert [r.path for r in fake.requests if r.path.startswith("/.well-known")] == [
        "/.well-known/other"
    ]


async def call(
    http: aiohttp.ClientSession,
    engram: Engram,
    name: str,
    arguments: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    body = request("tools/call", {"name": name, "arguments": arguments})
    answer = await post(http, engram, body, headers)
    result: dict[str, Any] = answer["result"]
    return result


async def test_without_accounts_identity_headers_name_the_user(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    await call(
        http, engram, "engram_remember", {"text": "Pia likes oolong"}, {"X-Engram-User": "pia"}
    )
    for headers, user in (
        ({"X-Engram-User": "pia"}, "pia"),
        ({"X-OpenWebUI-User-Id": "pia"}, "pia"),
        ({}, "default"),
        ({"Authorization": "Bearer sk-no-key-required"}, "default"),
    ):
        listed = await call(http, engram, "engram_sessions", {}, headers)
        assert listed["structuredContent"]["user"] == user
        assert listed["structuredContent"]["total"] == (1 if user == "pia" else 0)
    # a client's own API key names a user of its own, as on the chat routes
    keyed = await call(http, engram, "engram_sessions", {}, {"Authorization": "Bearer sk-mine"})
    assert keyed["structuredContent"]["user"].startswith("key-")
    # without the admin token there is no `user` argument: a tool error the model reads
    refused = await call(http, engram, "engram_sessions", {"user": "pia"})
    assert refused["isError"] and "structuredContent" not in refused
    assert "Unknown argument 'user'" in refused["content"][0]["text"]


async def test_the_admin_token_names_the_user(engram: Engram, http: aiohttp.ClientSession) -> None:
    await call(
        http,
        engram,
        "engram_remember",
        {"text": "Quinn's bus is the 42"},
        {"X-Engram-User": "quinn"},
    )
    admin = {"Authorization": f"Bearer {engram.app[SERVICES].auth.admin_token}"}
    listed = (await post(http, engram, request("tools/list"), admin))["result"]["tools"]
    assert all("user" in t["inputSchema"]["properties"] for t in listed)
    found = await call(http, engram, "engram_search", {"query": "bus", "user": "quinn"}, admin)
    assert found["structuredContent"]["user"] == "quinn" and not found["isError"]
    default = await call(http, engram, "engram_sessions", {}, admin)
    assert default["structuredContent"]["user"] == "default"
    named = await call(http, engram, "engram_sessions", {}, {**admin, "X-Engram-User": "quinn"})
    assert named["structuredContent"]["user"] == "quinn"


async def test_a_trusted_front_end_must_name_the_user(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    secret = "front-end-secret-0123456789abcdef0123"
    engram = await start_engram(
        fake.url, auth={"mode": "keys", "loopback_admin": False, "trusted_proxy_secret": secret}
    )
    try:
        front = {"Authorization": f"Bearer {secret}"}
        async with http.post(engram.url + MCP, json=request("tools/list"), headers=front) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "user_required"
        named = {**front, "X-OpenWebUI-User-Id": "rosa"}
        listed = await call(http, engram, "engram_sessions", {}, named)
        assert listed["structuredContent"]["user"] == "rosa"
    finally:
        await engram.close()


async def test_with_memory_disabled_tools_say_so(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await start_engram(fake.url, memory={"enabled": False})
    try:
        assert len((await post(http, engram, request("tools/list")))["result"]["tools"]) == 5
        result = await call(http, engram, "engram_remember", {"text": "anything"})
        assert result["isError"] and "Memory is disabled" in result["content"][0]["text"]
        refused = await call(http, engram, "engram_remember", {})
        assert refused["isError"]  # bad arguments are still bad arguments, told first
        assert "text is required" in refused["content"][0]["text"]
    finally:
        await engram.close()


async def test_without_accounts_the_agents_chat_key_reaches_the_same_memory(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    """Claude Code sends its ANTHROPIC_API_KEY with every chat; the same value as the MCP
    client's bearer key is the same user, so the tools see what its chats told."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "The deploy key rotates on Fridays"}],
    }
    async with http.post(
        engram.base_url + "/chat/completions", json=body, headers={"x-api-key": "sk-local"}
    ) as r:
        assert r.status == 200
    await settle(engram)
    found = await call(
        http,
        engram,
        "engram_search",
        {"query": "deploy key Fridays", "mode": "fts"},
        {"Authorization": "Bearer sk-local"},
    )
    assert not found["isError"]
    assert (
        found["structuredContent"]["results"][0]["content"] == "The deploy key rotates on Fridays"
    )
    other = await call(
        http,
        engram,
        "engram_search",
        {"query": "deploy key Fridays", "mode": "fts"},
        {"Authorization": "Bearer sk-other"},
    )
    assert not other["isError"] and other["structuredContent"]["results"] == []


async def test_tool_errors_in_every_revision(engram: Engram, http: aiohttp.ClientSession) -> None:
    """Issue 39, on the wire, in each revision served (2025-06-18, 2025-11-25, 2026-07-28):
    arguments a known tool refuses are a result with isError (SEP-1303), a search that finds
    nothing is a result without it, and only an unknown tool or a malformed tools/call is a
    JSON-RPC error (-32602)."""

    def send(
        revision: str, name: object, arguments: object, status: int = 200
    ) -> tuple[dict[str, Any], dict[str, str], int]:
        params = {"name": name, "arguments": arguments}
        if revision == MODERN:
            body, headers = modern("tools/call", params, name=str(name))
            return body, headers, status
        return request("tools/call", params), {"MCP-Protocol-Version": revision}, status

    for revision in ("2025-06-18", "2025-11-25", MODERN):
        for name, arguments, says in (
            ("engram_search", {"query": "cat", "k": 101}, "k must be an integer from 1 to 100"),
            ("engram_search", {"query": "cat", "colour": "red"}, "Unknown argument 'colour'"),
            ("engram_remember", {"text": 7}, "text must be a string; got an integer"),
            ("engram_remember", {"text": "x" * 8001}, "text is 8001 characters; at most 8000"),
            ("engram_session", {}, "session is required"),
        ):
            body, headers, status = send(revision, name, arguments)
            answer = await post(http, engram, body, headers, status=status)
            result = answer["result"]
            assert result["isError"] is True and "structuredContent" not in result, answer
            told = result["content"][0]["text"]
            assert told.startswith(f"Invalid arguments for {name}: ") and says in told, told
            assert ("resultType" in result) is (revision == MODERN)

        body, headers, status = send(revision, "engram_search", {"query": "zeppelin"})
        result = (await post(http, engram, body, headers, status=status))["result"]
        assert result["isError"] is False and result["structuredContent"]["results"] == []
        assert result["content"][0]["text"].startswith("Nothing in memory matches 'zeppelin'")

        protocol_status = 400 if revision == MODERN else 200
        malformed: list[tuple[str, object, str]] = [
            ("engram_nope", {}, "Unknown tool 'engram_nope'"),
            ("engram_search", [1], "params.arguments of engram_search must be an object"),
            ("engram_search", "query=cat", "must be an object"),
        ]
        for name, arguments, says in malformed:
            body, headers, status = send(revision, name, arguments, protocol_status)
            answer = await post(http, engram, body, headers, status=status)
            code, message = error_of(answer)
            assert code == -32602 and says in message, (revision, answer)
    store = engram.app[SERVICES].store
    assert store is not None
    assert await store.read(lambda c: c.execute("SELECT count(*) FROM turns").fetchone()) == (0,)
