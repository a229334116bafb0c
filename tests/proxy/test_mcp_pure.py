"""The MCP endpoint's pure parts without a server: JSON-RPC parsing, revisions and the
2026-07-28 envelope, the schema checks (against the ``jsonschema`` package on the same
schemas), the tool definitions, note texts and the guard's rules for ``/engram/mcp``."""

from __future__ import annotations

import base64
from typing import Any

import jsonschema
import pytest

from proxy import guard
from proxy.auth import ANONYMOUS, Principal
from proxy.errors import BadRequest
from proxy.mcp import protocol, render, tools
from proxy.mcp.access import Access, access_of
from proxy.mcp.calls import note_text
from proxy.mcp.protocol import Message, RpcError
from proxy.mcp.schema import ArgumentError, validate

META = {protocol.VERSION_KEY: "2026-07-28", protocol.CAPABILITIES_KEY: {}}


def test_messages() -> None:
    m = protocol.parse_message({"jsonrpc": "2.0", "id": "a", "method": "tools/list"})
    assert (m.kind, m.id, m.method, m.params) == ("request", "a", "tools/list", {})
    n = protocol.parse_message({"jsonrpc": "2.0", "method": "notifications/x", "params": None})
    assert (n.kind, n.id) == ("notification", None)
    r = protocol.parse_message({"jsonrpc": "2.0", "id": 3, "result": {}})
    assert r.kind == "response"
    for bad, code in (
        ([], protocol.INVALID_REQUEST),
        ({"jsonrpc": "2.0", "id": [1], "method": "x"}, protocol.INVALID_REQUEST),
        ({"jsonrpc": "2.0", "id": 1, "method": ""}, protocol.INVALID_REQUEST),
        ({"jsonrpc": "2.0", "id": 1, "method": "x", "params": "p"}, protocol.INVALID_PARAMS),
    ):
        with pytest.raises(RpcError) as raised:
            protocol.parse_message(bad)
        assert raised.value.code == code
    assert protocol.error_message(None, RpcError(-1, "m", {"d": 1})) == {
        "jsonrpc": "2.0",
        "id": None,
        "error": {"code": -1, "message": "m", "data": {"d": 1}},
    }


def test_eras_and_statuses() -> None:
    plain = Message("request", "tools/list", 1)
    stamped = Message("request", "tools/list", 1, {"_meta": META})
    assert protocol.era_of(plain, None) == "legacy"
    assert protocol.era_of(stamped, None) == "modern"  # then its missing header is a mismatch
    assert protocol.era_of(stamped, "2025-06-18") == "legacy"
    assert protocol.era_of(plain, "2026-07-28") == "modern"
    with pytest.raises(RpcError) as raised:
        protocol.era_of(plain, "2025-03-26")
    assert raised.value.code == protocol.UNSUPPORTED_VERSION
    assert [protocol.negotiate(v) for v in ("2025-06-18", "2025-11-25", "2026-07-28", 3)] == [
        "2025-06-18",
        "2025-11-25",
        "2025-11-25",
        "2025-11-25",
    ]
    assert protocol.error_status(protocol.METHOD_NOT_FOUND, "modern") == 404
    assert protocol.error_status(protocol.METHOD_NOT_FOUND, "legacy") == 200
    assert protocol.error_status(protocol.INVALID_PARAMS, "modern") == 400
    assert protocol.error_status(protocol.PARSE_ERROR, "legacy") == 400


def test_the_2026_envelope() -> None:
    call = Message("request", "tools/call", 1, {"name": "engram_search", "_meta": META})
    headers = {
        "MCP-Protocol-Version": "2026-07-28",
        "Mcp-Method": "tools/call",
        "Mcp-Name": "engram_search",
    }
    assert protocol.check_modern(call, headers) == "2026-07-28"
    b64 = "=?base64?" + base64.b64encode(b"engram_search").decode() + "?="
    assert protocol.check_modern(call, {**headers, "Mcp-Name": b64}) == "2026-07-28"
    old = {**META, protocol.VERSION_KEY: "2025-11-25"}
    for message, sent, code in (
        (Message("request", "tools/call", 1, {"name": "x"}), headers, protocol.INVALID_PARAMS),
        (call, {**headers, "Mcp-Name": "engram_forget"}, protocol.HEADER_MISMATCH),
        (call, {**headers, "Mcp-Name": "=?base64?!!?="}, protocol.HEADER_MISMATCH),
        (call, {**headers, "Mcp-Method": "tools/list"}, protocol.HEADER_MISMATCH),
        (call, {**headers, "MCP-Protocol-Version": "2025-11-25"}, protocol.HEADER_MISMATCH),
        (
            Message("request", "tools/list", 1, {"_meta": old}),
            {"MCP-Protocol-Version": "2025-11-25", "Mcp-Method": "tools/list"},
            protocol.UNSUPPORTED_VERSION,
        ),
    ):
        with pytest.raises(RpcError) as raised:
            protocol.check_modern(message, sent)
        assert raised.value.code == code, (message, sent)
    assert protocol.decode_header_value("=?base64?aGk=?=") == "hi"
    assert protocol.decode_header_value("=?base64?aGk?=") is None  # not canonical base64
    assert protocol.decode_header_value("plain") == "plain"


def test_the_schemas_are_valid_json_schema_and_enforced_the_same() -> None:
    samples: list[tuple[str, dict[str, Any]]] = [
        ("engram_search", {"query": "cat"}),
        ("engram_search", {"query": "cat", "k": 100, "mode": "fts", "session": "a"}),
        ("engram_search", {"query": ""}),
        ("engram_search", {"query": "cat", "k": 0}),
        ("engram_search", {"query": "cat", "k": True}),
        ("engram_search", {"query": "cat", "mode": "x"}),
        ("engram_search", {"q": "cat"}),
        ("engram_remember", {"text": "t", "tags": ["a", "b c"]}),
        ("engram_remember", {"text": "t", "tags": ["a(b)"]}),
        ("engram_remember", {"text": "t", "tags": ["a", "a"]}),
        ("engram_remember", {"text": "t" * 8001}),
        ("engram_forget", {"ids": [1, 2]}),
        ("engram_forget", {"ids": [2**53]}),
        ("engram_forget", {"ids": [1, 1]}),
        ("engram_forget", {"ids": "1"}),
        ("engram_sessions", {}),
        ("engram_sessions", {"limit": 201}),
        ("engram_session", {"session": "s", "offset": 0, "limit": 100}),
        ("engram_session", {"session": "s", "offset": 1.5}),
    ]
    for admin in (False, True):
        for tool in tools.tool_list(admin):
            jsonschema.Draft202012Validator.check_schema(tool["inputSchema"])
            jsonschema.Draft202012Validator.check_schema(tool["outputSchema"])
    for name, args in samples:
        schema = tools.definition(name, False)["inputSchema"]
        theirs = jsonschema.Draft202012Validator(schema).is_valid(args)
        try:
            validate(schema, args)
            ours = True
        except ArgumentError:
            ours = False
        assert ours == theirs, (name, args)


def test_schema_messages_and_cleaning() -> None:
    schema = tools.definition("engram_search", False)["inputSchema"]
    assert validate(schema, {"query": "a\x00b\ud800", "k": 5.0}) == {"query": "a b?", "k": 5}
    assert validate(schema, {"query": "a", "session": None}) == {"query": "a"}
    for args, says in (
        ({}, "query is required: What to look for, in words (a question or key terms)."),
        ({"query": "a", "x": 1, "y": 2}, "Unknown arguments 'x', 'y': this tool takes query, k"),
        ({"query": "a", "k": 2.5}, "k must be an integer; got a number 2.5."),
        ([], "arguments must be an object; got an array."),
    ):
        with pytest.raises(ArgumentError) as raised:
            validate(schema, args)
        assert raised.value.message.startswith(says), raised.value.message


def test_tool_definitions() -> None:
    assert tools.NAMES == (
        "engram_search",
        "engram_remember",
        "engram_forget",
        "engram_sessions",
        "engram_session",
    )
    for tool in tools.tool_list(False):
        assert "user" not in tool["inputSchema"]["properties"]
        assert set(tool["annotations"]) == {
            "title",
            "readOnlyHint",
            "destructiveHint",
            "idempotentHint",
            "openWorldHint",
        }
        assert "Call it" in tool["description"]
    assert all("user" in t["inputSchema"]["properties"] for t in tools.tool_list(True))
    assert "user" not in tools.definition("engram_search", False)["inputSchema"]["properties"]


def test_notes_keep_their_tags_and_session_in_their_text() -> None:
    assert note_text("Buy milk", [], None) == "Buy milk"
    assert note_text("Buy milk", ["home", "errands"], None) == "Buy milk\n(tags: home, errands)"
    assert note_text("Buy milk", ["home"], "week-12") == "Buy milk\n(tags: home; session: week-12)"
    assert note_text("Buy milk", [], "week-12") == "Buy milk\n(session: week-12)"


def test_readable_texts() -> None:
    assert render.first_line("\n\n  Hello there  \nmore") == "Hello there"
    assert len(render.first_line("x" * 500)) == render.FIRST_LINE_CHARS
    assert render.cut("abc", 2) == "ab… (1 more characters in structuredContent)"
    hit = {
        "id": 7,
        "session": "s1",
        "role": "user",
        "speaker": "Ana",
        "content": "line one\nline two",
        "timestamp_iso": "2025-01-01T00:00:00.000Z",
        "score": 0.5,
        "ranks": {"fts": 1, "vec": None},
        "api": "openai-chat",
    }
    text = render.hits_text("q", "hybrid", [hit])
    assert "turn 7 · session s1 · user (Ana)" in text and "full-text #1)" in text
    assert "   line one\n   line two" in text


def test_access() -> None:
    assert access_of(ANONYMOUS, {"X-Engram-User": "ana"}) == Access("ana", False)
    assert access_of(ANONYMOUS, {}) == Access("default", False)
    key = Principal("bo", False, "key", "k1")
    assert access_of(key, {"X-Engram-User": "ana"}) == Access("bo", False)
    admin_key = Principal("bo", True, "key", "k2")
    assert access_of(admin_key, {}) == Access("bo", True)
    token = Principal(None, True, "admin-token")
    assert access_of(token, {"X-Engram-User": "ana"}) == Access("ana", True)
    assert Access("bo", True).acting_for("ana") == "ana"
    assert Access("bo", False).acting_for("ana") == "bo"
    with pytest.raises(BadRequest):
        access_of(Principal(None, False, "trusted-proxy"), {})


def test_the_guard_treats_the_mcp_endpoint_like_the_admin_api() -> None:
    assert guard.json_only("POST", "/engram/mcp")
    assert not guard.json_only("GET", "/engram/mcp")
    for method in ("GET", "HEAD", "POST", "DELETE"):
        error = guard.request_error(
            method,
            "/engram/mcp",
            {"Origin": "http://evil.example", "Host": "127.0.0.1:8787"},
            frozenset({"http://evil.example"}),  # configured CORS origins do not extend to it
            has_body=False,
            memory_enabled=True,
            adds_credential=False,
        )
        assert error is not None and error.status == 403, method
    own = guard.request_error(
        "POST",
        "/engram/mcp",
        {"Origin": "http://127.0.0.1:8787", "Host": "127.0.0.1:8787"},
        frozenset(),
        has_body=True,
        memory_enabled=True,
        adds_credential=False,
    )
    assert own is not None and own.status == 415  # no Content-Type: JSON only
