"""The MCP endpoint (issue 24) through the official ``mcp`` SDK as the client, over streamable
HTTP against a running Engram on a real port: the handshake revisions and 2026-07-28, every
tool, memory shared with the chat routes both ways, two users' keys kept apart, refusals, a
100-way concurrent remember, and bad input that stores nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, TextContent

import proxy
from proxy.api.actions import MAX_NOTE_CHARS
from proxy.api.views import MAX_QUERY_CHARS
from proxy.keys import new_key
from proxy.services import SERVICES
from proxy.store.keys import insert_key
from proxy.store.sqlite.db import connect
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, settle, start_engram

pytestmark = pytest.mark.asyncio

MCP = "/engram/mcp"
REAL_MODEL = {"model": "engram/all-MiniLM-L6-v2-q8"}
TOOLS = ["engram_search", "engram_remember", "engram_forget", "engram_sessions", "engram_session"]
MODES = ["legacy", "auto"]  # auto: the SDK probes server/discover and speaks 2026-07-28


@asynccontextmanager
async def mcp_client(
    engram: Engram, headers: dict[str, str] | None = None, mode: str = "legacy"
) -> AsyncIterator[Client]:
    async with (
        httpx2.AsyncClient(headers=headers or {}) as http,
        Client(streamable_http_client(engram.url + MCP, http_client=http), mode=mode) as client,
    ):
        yield client


def text(result: CallToolResult) -> str:
    block = result.content[0]
    assert isinstance(block, TextContent)
    return block.text


def rows(engram: Engram, sql: str = "SELECT count(*) FROM turns") -> list[tuple[Any, ...]]:
    """Rows read from the database file itself, by another connection. Through the SQLite
    library Engram uses: a second SQLite library in one process (the standard ``sqlite3``) does
    not see the first's POSIX locks, and closing its file can pull the WAL index from under the
    other (a SIGBUS, seen once in CI)."""
    conn = connect(f"{engram.tmp.name}/engram.db", readonly=True)
    try:
        return [tuple(r) for r in conn.execute(sql).fetchall()]
    finally:
        conn.close()


async def make_key(engram: Engram, user: str, admin: bool = False) -> str:
    store = engram.app[SERVICES].store
    assert store is not None
    key = new_key()
    await store.write(lambda c: insert_key(c, key.id, user, key.secret_hash, admin, "test", 0.0))
    return key.key


def leaves(group: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups."""
    if isinstance(group, BaseExceptionGroup):
        return [leaf for e in group.exceptions for leaf in leaves(e)]
    return [group]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def chat(
    http: aiohttp.ClientSession, engram: Engram, content: str, headers: dict[str, str]
) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    async with http.post(engram.base_url + "/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        reply: dict[str, Any] = await r.json()
        reply["session"] = r.headers["X-Engram-Session"]
        return reply


# --- the protocol, as the SDK speaks it ---------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_initialize_and_the_tools_in_each_revision(engram: Engram, mode: str) -> None:
    async with mcp_client(engram, {"X-Engram-User": "alice"}, mode) as client:
        assert client.protocol_version == ("2025-11-25" if mode == "legacy" else "2026-07-28")
        info = client.server_info
        assert info is not None and info.name == "engram" and info.version == proxy.__version__
        assert client.server_capabilities.tools is not None
        instructions = client.instructions or ""
        assert "engram_search" in instructions and "engram_remember" in instructions
        listed = (await client.list_tools()).tools
        assert [t.name for t in listed] == TOOLS
        for tool in listed:
            assert tool.description and "Call it" in tool.description, tool.name
            assert tool.input_schema["additionalProperties"] is False
            assert "user" not in tool.input_schema["properties"]  # not an admin
            assert tool.output_schema is not None
            hints = tool.annotations
            assert hints is not None and hints.open_world_hint is False
            assert hints.read_only_hint is (
                tool.name in {"engram_search", "engram_sessions", "engram_session"}
            )
            assert hints.destructive_hint is (tool.name == "engram_forget")


@pytest.mark.parametrize("mode", MODES)
async def test_each_tool(engram: Engram, http: aiohttp.ClientSession, mode: str) -> None:
    alice = {"X-Engram-User": "alice"}
    for line in ("My bike is a green Brompton", "I park it at the Ostbahnhof", "Thanks"):
        await chat(http, engram, line, {**alice, "X-Engram-Session": "bikes"})
    await settle(engram)
    async with mcp_client(engram, alice, mode) as client:
        note = await client.call_tool(
            "engram_remember",
            {"text": "The bike lock code is 3141", "tags": ["bike", "codes"], "session": "bikes"},
        )
        assert not note.is_error and note.structured_content is not None
        note_id = note.structured_content["id"]
        assert note.structured_content["content"] == (
            "The bike lock code is 3141\n(tags: bike, codes; session: bikes)"
        )
        assert note.structured_content["session"] == "notes~alice"
        assert f"turn {note_id}" in text(note)

        found = await client.call_tool("engram_search", {"query": "bike lock code", "k": 3})
        assert not found.is_error and found.structured_content is not None
        hits = found.structured_content["results"]
        assert hits[0]["id"] == note_id and hits[0]["session"] == "notes~alice"
        assert hits[0]["ranks"]["fts"] == 1 and hits[0]["api"] == "note"
        assert "The bike lock code is 3141" in text(found) and "full-text #1" in text(found)
        only = await client.call_tool(
            "engram_search", {"query": "Brompton", "session": "bikes", "mode": "fts"}
        )
        assert only.structured_content is not None
        assert {h["session"] for h in only.structured_content["results"]} == {"bikes"}
        none = await client.call_tool("engram_search", {"query": "zeppelin", "mode": "fts"})
        assert not none.is_error and "Nothing in memory matches 'zeppelin'" in text(none)

        listed = await client.call_tool("engram_sessions", {"limit": 10})
        assert listed.structured_content is not None
        by_id = {s["id"]: s for s in listed.structured_content["sessions"]}
        assert set(by_id) == {"bikes", "notes~alice"}
        assert by_id["bikes"]["first_line"] == "My bike is a green Brompton"
        assert by_id["bikes"]["turns"] == 6 and "bikes · 6 turn(s)" in text(listed)

        page = await client.call_tool("engram_session", {"session": "bikes", "limit": 4})
        assert page.structured_content is not None
        turns = page.structured_content["turns"]
        assert [t["content"] for t in turns][:2] == [
            "My bike is a green Brompton",
            "echo: My bike is a green Brompton",
        ]
        assert len(turns) == 4 and page.structured_content["total"] == 6
        rest = await client.call_tool(
            "engram_session", {"session": "bikes", "offset": page.structured_content["next_offset"]}
        )
        assert rest.structured_content is not None
        assert [t["content"] for t in rest.structured_content["turns"]] == [
            "Thanks",
            "echo: Thanks",
        ]
        assert rest.structured_content["next_offset"] is None
        missing = await client.call_tool("engram_session", {"session": "nope"})
        assert missing.is_error and "engram_sessions lists" in text(missing)

        gone = await client.call_tool("engram_forget", {"ids": [note_id, 987654]})
        assert not gone.is_error and gone.structured_content is not None
        assert [f["id"] for f in gone.structured_content["forgotten"]] == [note_id]
        assert [m["id"] for m in gone.structured_content["not_found"]] == [987654]
        after = await client.call_tool("engram_search", {"query": "bike lock code 3141"})
        assert after.structured_content is not None
        assert note_id not in [h["id"] for h in after.structured_content["results"]]
        whole = await client.call_tool("engram_forget", {"session": "bikes"})
        assert not whole.is_error and "Forgot session bikes and its 6 turn(s)" in text(whole)
        again = await client.call_tool("engram_forget", {"session": "bikes"})
        assert again.is_error
    await settle(engram)
    assert rows(engram, "SELECT count(*) FROM turns WHERE user_id = 'alice'") == [(0,)]


# --- one memory for chats and tools ------------------------------------------------------------


async def test_memory_is_shared_with_the_chat_routes(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """What an agent remembers through MCP reaches a new chat's prompt, and what a chat told is
    found by engram_search (the real embedding model)."""
    engram = await start_engram(fake.url, embedder=REAL_MODEL)
    try:
        carol = {"X-Engram-User": "carol"}
        async with mcp_client(engram, carol) as client:
            note = await client.call_tool(
                "engram_remember", {"text": "Carol's dentist is Dr. Okonkwo on Harbour Street"}
            )
            assert not note.is_error
        fake.requests.clear()
        await chat(http, engram, "Who is my dentist again?", carol)
        forwarded = str(fake.chat_requests()[-1].json()["messages"])
        assert "Dr. Okonkwo on Harbour Street" in forwarded

        await chat(http, engram, "My sister Ines moved to Lisbon last spring", carol)
        await settle(engram)
        async with mcp_client(engram, carol, "auto") as client:
            found = await client.call_tool(
                "engram_search", {"query": "which city does my sister live in", "mode": "vec"}
            )
        assert found.structured_content is not None
        top = [h["content"] for h in found.structured_content["results"][:3]]
        assert "My sister Ines moved to Lisbon last spring" in top
    finally:
        await engram.close()


# --- accounts -----------------------------------------------------------------------------------


async def keyed(fake: FakeUpstream) -> Engram:
    return await start_engram(fake.url, auth={"mode": "keys", "loopback_admin": False})


async def test_two_users_keys_never_see_each_other(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await keyed(fake)
    try:
        alice, bob = await make_key(engram, "alice"), await make_key(engram, "bob")
        said = await chat(http, engram, "My passport number is P-77001", bearer(alice))
        await settle(engram)
        async with mcp_client(engram, bearer(alice)) as client:
            note = await client.call_tool("engram_remember", {"text": "Alice's PIN is 9090"})
            assert note.structured_content is not None
            note_id = note.structured_content["id"]
            mine = await client.call_tool("engram_search", {"query": "passport PIN"})
            assert (
                mine.structured_content is not None and len(mine.structured_content["results"]) >= 2
            )
        before = rows(engram, "SELECT id FROM turns WHERE user_id = 'alice' ORDER BY id")
        alice_ids = [r[0] for r in before]

        # bob claims to be alice every way there is; each tool answers for bob alone
        for headers in ({}, {"X-Engram-User": "alice"}, {"X-OpenWebUI-User-Id": "alice"}):
            async with mcp_client(engram, {**bearer(bob), **headers}, "auto") as client:
                for query in ("passport", "PIN 9090", "P-77001"):
                    r = await client.call_tool("engram_search", {"query": query})
                    assert not r.is_error and r.structured_content is not None
                    assert r.structured_content["results"] == []
                    assert r.structured_content["user"] == "bob"
                listed = await client.call_tool("engram_sessions", {})
                assert listed.structured_content == {"user": "bob", "total": 0, "sessions": []}
                for name in (said["session"], "notes~alice"):
                    peek = await client.call_tool("engram_session", {"session": name})
                    assert peek.is_error and "for user 'bob'" in text(peek)
                guessed = await client.call_tool("engram_forget", {"ids": alice_ids})
                assert guessed.is_error and guessed.structured_content is not None
                assert guessed.structured_content["forgotten"] == []
                whole = await client.call_tool("engram_forget", {"session": said["session"]})
                assert whole.is_error
                # no `user` argument for a user's key: the model is told, nothing is read
                refused = await client.call_tool("engram_search", {"query": "PIN", "user": "alice"})
                assert refused.is_error and refused.structured_content is None
                assert "Unknown argument 'user'" in text(refused)
        assert rows(engram, "SELECT id FROM turns WHERE user_id = 'alice' ORDER BY id") == before

        # the admin token acts for the user its `user` argument names
        token = engram.app[SERVICES].auth.admin_token
        async with mcp_client(engram, bearer(token)) as client:
            schema = (await client.list_tools()).tools[0].input_schema
            assert "user" in schema["properties"]
            r = await client.call_tool(
                "engram_search", {"query": "PIN", "user": "alice", "mode": "fts"}
            )
            assert r.structured_content is not None
            assert [h["id"] for h in r.structured_content["results"]] == [note_id]
            r = await client.call_tool("engram_search", {"query": "PIN"})  # user "default"
            assert not r.is_error and r.structured_content is not None
            assert r.structured_content["user"] == "default"
            assert r.structured_content["results"] == []
    finally:
        await engram.close()


async def test_no_key_wrong_key_and_foreign_pages_are_refused(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await keyed(fake)
    try:
        key = await make_key(engram, "alice")
        wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
        init = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {}},
        }
        cases = [
            ({}, 401),
            (bearer(wrong), 401),
            (bearer("sk-no-key-required"), 401),
            ({**bearer(key), "Origin": "http://evil.example"}, 403),
            ({**bearer(key), "Origin": "null"}, 403),
            ({**bearer(key), "Sec-Fetch-Site": "cross-site"}, 403),
        ]
        for headers, status in cases:
            async with http.post(engram.url + MCP, json=init, headers=headers) as r:
                assert r.status == status, headers
                assert "WWW-Authenticate" not in r.headers
                assert (await r.json())["error"]["code"] in (
                    "missing_api_key",
                    "invalid_api_key",
                    "cross_site_request",
                )
        for headers in ({}, bearer(wrong)):  # the SDK gives up at once (no OAuth to try)
            with pytest.raises(BaseExceptionGroup) as failed:
                async with mcp_client(engram, headers):
                    pass
            assert [type(e) for e in leaves(failed.value)] == [MCPError]
        async with mcp_client(engram, bearer(key)) as client:  # the same key, sent right
            assert [t.name for t in (await client.list_tools()).tools] == TOOLS
        # no OAuth discovery of Engram's: 401 without a key, 404 with one; never a document
        for path in (
            "/.well-known/oauth-protected-resource",
            "/.well-known/oauth-protected-resource/engram/mcp",
            "/.well-known/oauth-authorization-server",
            "/.well-known/openid-configuration",
        ):
            for headers, status in (({}, 401), (bearer(key), 404)):
                async with http.get(engram.url + path, headers=headers) as r:
                    assert r.status == status, (path, headers)
                    assert "issuer" not in await r.text()
        assert not [r for r in fake.requests if r.path.startswith("/.well-known")]
    finally:
        await engram.close()


# --- concurrency and bad input ------------------------------------------------------------------


async def test_a_hundred_concurrent_remembers_lose_and_duplicate_nothing(engram: Engram) -> None:
    async with mcp_client(engram, {"X-Engram-User": "dora"}, "auto") as client:
        results = await asyncio.gather(
            *(
                client.call_tool("engram_remember", {"text": f"Concurrent note number {i:03d}"})
                for i in range(100)
            )
        )
    ids = []
    for r in results:
        assert not r.is_error and r.structured_content is not None
        ids.append(r.structured_content["id"])
    stored = rows(engram, "SELECT id, content FROM turns WHERE user_id = 'dora' ORDER BY id")
    assert sorted(ids) == [row[0] for row in stored]
    assert sorted(row[1] for row in stored) == [
        f"Concurrent note number {i:03d}" for i in range(100)
    ]
    positions = rows(engram, "SELECT count(DISTINCT position) FROM turns WHERE user_id = 'dora'")
    assert positions == [(100,)]


@pytest.mark.parametrize("mode", MODES)
async def test_bad_arguments_are_tool_errors_the_model_reads_and_store_nothing(
    engram: Engram, mode: str
) -> None:
    """Issue 39: arguments a tool's schema refuses are a CallToolResult with isError and a
    message naming the argument (SEP-1303), not a JSON-RPC error the SDK raises and the model
    never sees; an unknown tool is still -32602."""
    bad: list[tuple[str, dict[str, Any], str]] = [
        ("engram_remember", {"text": "x" * (MAX_NOTE_CHARS + 1)}, f"at most {MAX_NOTE_CHARS}"),
        ("engram_remember", {"text": "   "}, "text must not be empty"),
        ("engram_remember", {}, "text is required"),
        ("engram_remember", {"text": 42}, "text must be a string; got an integer"),
        ("engram_remember", {"text": "ok", "tags": ["a,b"]}, "tags[0] 'a,b' is not accepted"),
        ("engram_remember", {"text": "ok", "tags": ["t"] * 11}, "at most 10"),
        ("engram_remember", {"text": "ok", "tags": ["t", "t"]}, "more than once"),
        (
            "engram_remember",
            {"text": "y" * MAX_NOTE_CHARS, "tags": ["long"]},
            "text with its tags and session is",
        ),
        (
            "engram_remember",
            {"text": "ok", "colour": "red"},
            "Unknown argument 'colour': this tool takes text, tags, session",
        ),
        ("engram_search", {"query": "q" * (MAX_QUERY_CHARS + 1)}, f"at most {MAX_QUERY_CHARS}"),
        ("engram_search", {"query": "cat", "k": 101}, "k must be an integer from 1 to 100"),
        ("engram_search", {"query": "cat", "k": 0}, "from 1 to 100"),
        ("engram_search", {"query": "cat", "k": "5"}, "k must be an integer; got a string"),
        ("engram_search", {"query": "cat", "mode": "semantic"}, "hybrid, fts, vec"),
        ("engram_search", {"query": " "}, "query must not be blank"),
        ("engram_forget", {"ids": list(range(1, 102))}, "at most 100"),
        ("engram_forget", {"ids": [0]}, "ids[0] must be an integer from 1"),
        ("engram_forget", {"ids": ["7"]}, "ids[0] must be an integer"),
        ("engram_forget", {}, "Give ids"),
        ("engram_forget", {"ids": []}, "at least 1"),
        ("engram_sessions", {"limit": 1000}, "from 1 to 200"),
        ("engram_session", {}, "session is required"),
        ("engram_session", {"session": "s", "limit": 101}, "from 1 to 100"),
        ("engram_session", {"session": "s", "offset": -1}, "offset must be an integer from 0"),
    ]
    async with mcp_client(engram, {"X-Engram-User": "erin"}, mode) as client:
        for name, arguments, says in bad:
            result = await client.call_tool(name, arguments)  # no exception: a result
            assert result.is_error is True, (name, arguments)
            assert result.structured_content is None
            told = text(result)
            assert told.startswith(f"Invalid arguments for {name}: "), told
            assert says in told and told.endswith("call it again."), (told, says)
        with pytest.raises(MCPError) as raised:
            await client.call_tool("engram_recall_everything", {})
        assert raised.value.error.code == -32602
        assert "Unknown tool 'engram_recall_everything'" in raised.value.error.message
        # the model corrects its call and it goes through
        fixed = await client.call_tool("engram_search", {"query": "cat", "k": 100})
        assert not fixed.is_error
    assert rows(engram) == [(0,)]


@pytest.mark.parametrize("mode", MODES)
async def test_a_search_that_finds_nothing_is_an_answer_not_an_error(
    engram: Engram, mode: str
) -> None:
    """Issue 39: finding nothing is a valid answer; clients show isError results as errors."""
    async with mcp_client(engram, {"X-Engram-User": "fay"}, mode) as client:
        searches: list[dict[str, Any]] = [
            {"query": "zeppelin"},  # an empty memory
            {"query": "zeppelin", "mode": "fts"},  # words nothing has
            {"query": "zeppelin", "mode": "fts", "session": "notes~fay"},
        ]
        for i, arguments in enumerate(searches):
            if i == 1:
                note = await client.call_tool("engram_remember", {"text": "Fay's cat is Miso"})
                assert not note.is_error
            none = await client.call_tool("engram_search", arguments)
            assert none.is_error is False, arguments
            assert none.structured_content is not None
            assert none.structured_content["results"] == []
            assert none.structured_content["user"] == "fay"
            told = text(none)
            assert told.startswith(f"Nothing in memory matches {arguments['query']!r}"), told
            assert "Try other or fewer words" in told
        assert "no session filter" in told  # the last one had a session filter
        found = await client.call_tool("engram_search", {"query": "Miso", "mode": "fts"})
        assert not found.is_error and found.structured_content is not None
        assert len(found.structured_content["results"]) == 1
