"""Memory never makes a request worse than none (issue 22), through a real Engram in front of the
fake upstream, each test one row of what the real agents showed:

- opencode (chat completions, ``max_tokens: 32000``): the whole 32,000 were kept for the reply,
  the prompt budget was 0: no memories, and a five-message ``--continue`` went as one message;
- Claude Code (Messages, 64 KB of tools): tools were not counted, and memories plus history
  pushed a request that fits directly past the context (the upstream's 400);
- Codex (Responses): a new session's current ``<environment_context>`` item was dropped from
  the window while the previous run's was recalled;
- a request whose system prompt, tools and current turn alone overflow goes as sent.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from proxy.services import SERVICES
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, settle, start_engram
from testing.harness import turns_as_sent as turns

pytestmark = pytest.mark.asyncio

FACT = "My sister Marta lives in Porto and breeds Siamese cats."
QUESTION = "Where does my sister Marta live?"
ADMIN = "budget-admin-token-" + "x" * 24


@pytest_asyncio.fixture
async def fake8k() -> AsyncIterator[FakeUpstream]:
    """llama-server with an 8,192-token context that refuses longer prompts, tools counted."""
    async with FakeUpstream(n_ctx=8192, enforce_ctx=True, strict_templates=True) as fake:
        yield fake


@pytest_asyncio.fixture
async def engram(fake8k: FakeUpstream) -> AsyncIterator[Engram]:
    e = await start_engram(fake8k.url)
    try:
        yield e
    finally:
        await e.close()


def tool(name: str, size: int) -> dict[str, Any]:
    """An OpenAI function tool whose definition is about ``size`` characters of JSON."""
    doc = ("Runs the " + name + " tool on the files of the project. ") * (size // 50)
    params = {"type": "object", "properties": {"path": {"type": "string"}}}
    return {
        "type": "function",
        "function": {"name": name, "description": doc, "parameters": params},
    }


def anthropic_tool(name: str, size: int) -> dict[str, Any]:
    fn = tool(name, size)["function"]
    return {"name": name, "description": fn["description"], "input_schema": fn["parameters"]}


def memories(r: aiohttp.ClientResponse) -> tuple[int, str]:
    count, _, note = r.headers["X-Engram-Memories"].partition(";")
    return int(count), note.strip()


async def chat(
    http: aiohttp.ClientSession, engram: Engram, body: dict[str, Any], **headers: str
) -> tuple[int, dict[str, Any], aiohttp.ClientResponse]:
    async with http.post(
        engram.url + "/v1/chat/completions", json=body, headers={"X-Engram-User": "u", **headers}
    ) as r:
        return r.status, await r.json(), r


async def tell_the_fact(http: aiohttp.ClientSession, engram: Engram) -> None:
    status, _, _ = await chat(
        http, engram, {"model": "m", "messages": [{"role": "user", "content": FACT}]}
    )
    assert status == 200
    await settle(engram)


# --- the reply's room ---------------------------------------------------------------------------


async def test_a_32000_token_reply_ceiling_still_leaves_room_for_memories(
    engram: Engram, fake8k: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    await tell_the_fact(http, engram)
    question = {"role": "user", "content": QUESTION}
    bodies = {
        "/v1/chat/completions": {"model": "m", "max_tokens": 32000, "messages": [question]},
        "/v1/messages": {"model": "m", "max_tokens": 32000, "messages": [question]},
        "/v1/responses": {"model": "m", "max_output_tokens": 32000, "input": QUESTION},
    }
    for path, body in bodies.items():
        async with http.post(engram.url + path, json=body, headers={"X-Engram-User": "u"}) as r:
            assert r.status == 200, await r.text()
            assert memories(r)[0] >= 1, (path, r.headers["X-Engram-Memories"])
        assert "Porto" in fake8k.requests[-1].body.decode(), path


async def test_ollama_num_predict_is_capped_the_same(http: aiohttp.ClientSession) -> None:
    async with FakeUpstream(flavor="ollama", n_ctx=8192) as fake:
        engram = await start_engram(fake.url)
        try:
            await tell_the_fact(http, engram)
            body = {
                "model": "m",
                "stream": False,
                "options": {"num_predict": 32000},
                "messages": [{"role": "user", "content": QUESTION}],
            }
            headers = {"X-Engram-User": "u"}
            async with http.post(engram.url + "/api/chat", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                assert memories(r)[0] >= 1
            assert "Porto" in fake.requests[-1].body.decode()
        finally:
            await engram.close()


async def test_continue_keeps_every_message_the_client_sent(
    engram: Engram, fake8k: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """opencode's third ``run --continue``: five messages of about 2,350 tokens, max_tokens
    32000, an 8,192-token context: forwarded as the five (before: as one)."""
    system = {"role": "system", "content": "You are opencode. " + "Follow the rules. " * 300}
    msgs = [
        system,
        {"role": "user", "content": "My cat is called Zorblax. " + "It likes boxes. " * 200},
        {"role": "assistant", "content": "Noted: Zorblax. " * 100},
        {"role": "user", "content": "It is orange. " * 100},
        {"role": "assistant", "content": "An orange cat. " * 50},
        {"role": "user", "content": "What is my cat called?"},
    ]
    body = {"model": "m", "max_tokens": 32000, "stream": False, "messages": msgs}
    status, _, _ = await chat(http, engram, body, **{"X-Session-Id": "ses_1"})
    assert status == 200
    forwarded = fake8k.chat_requests()[-1].json()["messages"]
    assert forwarded[1:] == msgs[1:]
    assert forwarded[0]["content"].startswith(system["content"])


# --- what the upstream renders besides the messages ---------------------------------------------


async def test_tool_definitions_count_so_a_request_that_fits_directly_fits_through_engram(
    engram: Engram, fake8k: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """Claude Code's shape: 20 KB of tool definitions, a long history, memories available."""
    for i in range(6):  # memories to offer: long facts the question matches
        fact = f"Fact {i} about Marta in Porto: " + "she keeps Siamese cats and notes. " * 40
        status, _, _ = await chat(
            http, engram, {"model": "m", "messages": [{"role": "user", "content": fact}]}
        )
        assert status == 200
    await settle(engram)
    tools = [anthropic_tool(f"tool{i}", 5000) for i in range(4)]  # ~5,000 tokens
    history: list[dict[str, Any]] = []
    for i in range(4):
        history += [
            {"role": "user", "content": f"Step {i}: " + "please look at the code. " * 40},
            {"role": "assistant", "content": f"Done {i}: " + "looked at it. " * 40},
        ]
    body = {
        "model": "m",
        "max_tokens": 32000,
        "system": "You are Claude Code. " * 20,
        "tools": tools,
        "messages": [*history, {"role": "user", "content": "Where does Marta live?"}],
    }
    async with http.post(fake8k.url + "/v1/messages", json=body) as r:  # directly: it fits
        assert r.status == 200, await r.text()
    headers = {"X-Engram-User": "u"}
    async with http.post(engram.url + "/v1/messages", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
    forwarded = fake8k.requests[-1].json()
    assert forwarded["tools"] == tools
    question = forwarded["messages"][-1]  # every word of the current turn reaches the upstream
    assert question["role"] == "user"
    content = question["content"]  # as sent, or after a memory block that found room
    assert content == "Where does Marta live?" or content[-1] == {
        "type": "text",
        "text": "Where does Marta live?",
    }


async def test_a_request_whose_own_parts_overflow_goes_exactly_as_sent(
    engram: Engram, fake8k: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    await tell_the_fact(http, engram)
    body = {
        "model": "agent",  # a model whose token counts Engram has not corrected yet
        "max_tokens": 32000,
        # ~7,000 tokens of tools: past Engram's 5,800-token prompt budget (8,192 less the
        # reply's room), within the 8,192 the upstream takes.
        "tools": [tool(f"t{i}", 6000) for i in range(5)],
        "messages": [
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": QUESTION},
        ],
    }
    raw = json.dumps(body).encode()
    headers = {"X-Engram-User": "u", "Content-Type": "application/json"}
    async with http.post(engram.url + "/v1/chat/completions", data=raw, headers=headers) as r:
        await r.read()
        assert memories(r) == (0, "over-budget")
    assert fake8k.chat_requests()[-1].body == raw  # byte for byte
    async with http.get(engram.url + "/engram/metrics") as r:
        assert "engram_over_budget_total 1" in await r.text()
    await settle(engram)
    # It is still a turn of the conversation.
    store = engram.app[SERVICES].store
    texts = [t.content for s in await store.list_sessions("u") for t in await turns(engram, s.id)]
    assert QUESTION in texts


# --- a Responses request's new items ------------------------------------------------------------


def codex_input(cwd: str, question: str) -> list[dict[str, Any]]:
    env = (
        f"<environment_context>\n  <cwd>{cwd}</cwd>\n  <shell>bash</shell>\n</environment_context>"
    )
    return [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "You are a coding agent. " + "Be precise. " * 700}
        ]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": env}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": question}
        ]},
    ]  # fmt: skip


async def test_a_new_codex_session_keeps_its_current_environment_not_the_old_one(
    http: aiohttp.ClientSession,
) -> None:
    # Two user items in a row (as Codex sends them): not for a strict template.
    async with FakeUpstream(n_ctx=8192, enforce_ctx=True) as fake8k:
        engram = await start_engram(fake8k.url)
        try:
            await _codex_sessions(engram, fake8k, http)
        finally:
            await engram.close()


async def _codex_sessions(
    engram: Engram, fake8k: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    headers = {"X-Engram-User": "u"}
    first = {"model": "m", "input": codex_input("/home/me/old-project", "hello there")}
    async with http.post(engram.url + "/v1/responses", json=first, headers=headers) as r:
        assert r.status == 200
    await settle(engram)
    body = {
        "model": "m",
        "prompt_cache_key": "codex-2",
        "tools": [tool(f"t{i}", 4000) for i in range(3)],
        "input": codex_input("/home/me/new-project", "Which directory am I working in?"),
    }
    async with http.post(engram.url + "/v1/responses", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
    sent = fake8k.requests[-1].body.decode()
    assert "/home/me/new-project" in sent
    assert "/home/me/old-project" not in sent


async def test_a_template_that_leaves_tools_out_is_learned_and_memories_come_back(
    http: aiohttp.ClientSession,
) -> None:
    """SmolLM2's chat template renders no tools: Claude Code's 8,000 tokens of them are not in
    its prompt. Engram counts them until the upstream's usage says otherwise, then the same
    request gets memories."""
    async with FakeUpstream(n_ctx=8192, enforce_ctx=True, renders_tools=False) as fake:
        engram = await start_engram(fake.url)
        try:
            await tell_the_fact(http, engram)
            body = {
                "model": "m",
                "max_tokens": 32000,
                "tools": [anthropic_tool(f"tool{i}", 8000) for i in range(4)],  # ~8,000 tokens
                "messages": [{"role": "user", "content": QUESTION}],
            }
            got = []
            for _ in range(2):
                headers = {"X-Engram-User": "u"}
                async with http.post(engram.url + "/v1/messages", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    got.append(memories(r))
            assert got[0] == (0, "over-budget")  # tools counted: no room
            assert got[1][0] >= 1 and "Porto" in fake.requests[-1].body.decode()
        finally:
            await engram.close()


def webui_request(stream: bool) -> dict[str, Any]:
    """Open WebUI 0.12.4's shape: its built-in tools (36 definitions, about 25 KB of JSON) with
    every chat request, streamed without asking for usage."""
    return {
        "model": "m",
        "stream": stream,
        "tools": [tool(f"builtin_{i}", 700) for i in range(36)],
        "messages": [{"role": "user", "content": QUESTION}],
    }


async def test_the_upstream_counts_the_tools_its_template_renders_before_the_first_reply(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 38, item 4: a template that leaves tools out (SmolLM2's), and a client that never
    asks for usage. llama-server says what its template makes of the tools (/apply-template,
    /tokenize): the very first request gets its memories."""
    caplog.set_level(logging.INFO, "engram.rewrite")
    async with FakeUpstream(n_ctx=8192, enforce_ctx=True, renders_tools=False) as fake:
        engram = await start_engram(fake.url)
        try:
            await tell_the_fact(http, engram)
            headers = {"X-Engram-User": "u"}
            for stream in (True, False):
                body = webui_request(stream)
                async with http.post(
                    engram.url + "/v1/chat/completions", json=body, headers=headers
                ) as r:
                    assert r.status == 200, await r.text()
                    assert memories(r)[0] >= 1, r.headers["X-Engram-Memories"]
                    await r.read()
                assert "Porto" in fake.chat_requests()[-1].body.decode()
            asked = [r.path for r in fake.requests if r.path in ("/apply-template", "/tokenize")]
            assert asked == ["/apply-template", "/tokenize"] * 2  # once: with and without tools
        finally:
            await engram.close()
    assert "renders 0 % of" in caplog.text


async def test_memories_left_out_for_room_are_said_so(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A template that renders the tools, in a context they nearly fill: the memories found do
    not fit, and the reply says why (X-Engram-Memories: 0; no-room), once in the log per
    conversation, and on the inspector's request page."""
    async with FakeUpstream(n_ctx=8192, enforce_ctx=True) as fake:
        engram = await start_engram(fake.url, memory={"admin_token": ADMIN})
        try:
            await tell_the_fact(http, engram)
            caplog.clear()
            body = webui_request(True)
            body["tools"] = [tool(f"builtin_{i}", 570) for i in range(36)]  # all but a memory
            headers = {"X-Engram-User": "u", "X-Engram-Session": "webui-chat"}
            notes = []
            for then in ("Does she still live there?", "And her cats, Siamese?"):
                async with http.post(
                    engram.url + "/v1/chat/completions", json=body, headers=headers
                ) as r:
                    assert r.status == 200, await r.text()
                    notes.append(memories(r))
                    request_id = r.headers["X-Engram-Request-Id"]
                    await r.read()
                body["messages"] += [
                    fake.chat_requests()[-1].json()["messages"][-1] | {"role": "assistant"},
                    {"role": "user", "content": then},
                ]
            assert notes == [(0, "no-room")] * 2
            said = [m for m in caplog.messages if "left out" in m]
            assert len(said) == 1, said  # once for the conversation
            async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as web:
                await web.post(engram.url + "/engram/signin", data={"token": ADMIN})
                page = await web.get(f"{engram.url}/engram/requests/{request_id}?user=u")
                html = await page.text()
                assert "no-room" in html, re.sub(r"<[^>]+>", " ", html)
            metrics = await (await http.get(engram.url + "/engram/metrics")).text()
            assert "engram_no_room_total 2" in metrics
        finally:
            await engram.close()
