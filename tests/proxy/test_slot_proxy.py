"""Tool-result slots through the proxy: references in the forwarded prompt, the expansion loop,
the slot API, and Redis going away — against the fake upstream in strict-template mode, with the
same tests for the Redis backend (a real redis-server) and the embedded one."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio

from proxy.services import SERVICES
from proxy.slots.refs import REFERENCE, slot_id
from testing.fake_chunks import chat_chunks, chat_completion, make_usage, template_violations
from testing.fake_upstream import FakeUpstream, JsonReply, StreamReply
from testing.harness import Engram, settle, start_engram
from testing.redis_server import RedisServer

pytestmark = pytest.mark.asyncio

TOOL = "engram_expand"


def output(tag: str, lines: int = 120) -> str:
    """A file read: numbered source lines (about 1,000 tokens for 120 lines)."""
    return "\n".join(f"{n:4d}  def {tag}_{n}(x): return x * {n}  # {tag}" for n in range(lines))


def agent_chat(outputs: list[str], question: str = "and now?") -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for i, out in enumerate(outputs):
        cid = f"call{i:05d}"
        msgs += [
            {"role": "user", "content": f"look at module {i}"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": cid,
                        "type": "function",
                        "function": {
                            "name": "read_file",
                            "arguments": json.dumps({"path": f"src/mod{i}.py"}),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": cid, "content": out},
            {"role": "assistant", "content": f"Module {i} looks fine."},
        ]
    msgs.append({"role": "user", "content": question})
    return msgs


def expand_call(sid: str, call_id: str = "exp000001") -> dict[str, Any]:
    return {"id": call_id, "name": TOOL, "arguments": json.dumps({"slot_id": sid})}


def client_call(call_id: str = "cli000001") -> dict[str, Any]:
    return {"id": call_id, "name": "run_tests", "arguments": '{"path": "tests/"}'}


@pytest_asyncio.fixture
async def strict() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(strict_templates=True, n_ctx=32768) as fake:
        yield fake


@pytest_asyncio.fixture(params=["embedded", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[dict[str, Any]]:
    """The [slots] settings of each backend (the Redis one with a real server)."""
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        yield {"redis_url": server.url, "redis_retry": 0.2}
    else:
        yield {}


@pytest_asyncio.fixture
async def engram(strict: FakeUpstream, backend: dict[str, Any]) -> AsyncIterator[Engram]:
    e = await start_engram(strict.url, slots=backend)
    try:
        yield e
    finally:
        await e.close()


async def chat(
    http: aiohttp.ClientSession, engram: Engram, body: dict[str, Any], user: str = "alice"
) -> tuple[int, Any]:
    async with http.post(
        engram.url + "/v1/chat/completions", json=body, headers={"X-Engram-User": user}
    ) as r:
        return r.status, await r.json()


def forwarded(fake: FakeUpstream, n: int = -1) -> dict[str, Any]:
    body: dict[str, Any] = fake.chat_requests()[n].json()
    return body


def sdk(engram: Engram, user: str = "alice") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=engram.base_url,
        api_key="sk-test",
        max_retries=0,
        default_headers={"X-Engram-User": user},
    )


# --- references --------------------------------------------------------------------------------


async def test_old_outputs_become_references_and_the_tool_is_added(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    outs = [output("a"), output("b"), output("c")]
    msgs = agent_chat(outs)
    async with http.post(
        engram.url + "/v1/chat/completions",
        json={"model": "m", "messages": msgs},
        headers={"X-Engram-User": "alice"},
    ) as r:
        assert r.status == 200, await r.text()
        sent_tokens, original_tokens = map(int, r.headers["X-Engram-Prompt-Tokens"].split("/"))
    # The header compares with the client's own prompt, raw outputs included.
    assert original_tokens > max(3000, 5 * sent_tokens)
    sent = forwarded(strict)
    fwd = sent["messages"]
    assert template_violations(fwd) == []
    assert [m["role"] for m in fwd] == [m["role"] for m in msgs]
    for i, out in zip((3, 7, 11), outs, strict=True):
        assert fwd[i]["tool_call_id"] == msgs[i]["tool_call_id"]
        sid = slot_id("read_file", out)
        head, line = fwd[i]["content"].split("\n")
        assert head == f"[TOOL_RESULT:{sid}]"
        assert "read_file output" in line and "path: src/mod" in line
    assert [t["function"]["name"] for t in sent["tools"]] == [TOOL]
    # The slot is readable by its user through the API, and by nobody else.
    sid = slot_id("read_file", outs[0])
    async with http.get(
        f"{engram.url}/engram/api/slots/{sid}", headers={"X-Engram-User": "alice"}
    ) as r:
        assert r.status == 200
        got = await r.json()
        assert got["content"] == outs[0] and got["tool"] == "read_file"
    async with http.get(
        f"{engram.url}/engram/api/slots/{sid}", headers={"X-Engram-User": "mallory"}
    ) as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"]
    await settle(engram)


async def test_small_and_current_outputs_stay_raw(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    msgs = agent_chat(["tiny output", output("b")])
    # The last exchange is still going: its output is what the model needs now.
    del msgs[-2:]
    status, _ = await chat(http, engram, {"model": "m", "messages": msgs})
    assert status == 200
    sent = forwarded(strict)
    assert sent["messages"] == msgs  # nothing to replace: the client's messages as sent
    assert "tools" not in sent


async def test_references_are_byte_identical_across_turns_and_restarts(
    strict: FakeUpstream, backend: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    outs = [output("a"), output("b")]
    first = agent_chat(outs, "q1")
    e = await start_engram(strict.url, slots=backend)
    db = f"{e.tmp.name}/engram.db"
    try:
        assert (await chat(http, e, {"model": "m", "messages": first}))[0] == 200
        later = [*first, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "q2"}]
        assert (await chat(http, e, {"model": "m", "messages": later}))[0] == 200
        await settle(e)
        turn1, turn2 = (forwarded(strict, i)["messages"] for i in (0, 1))
        # (the system message gains recalled memories on the second turn; the rest is history)
        assert json.dumps(turn2[1 : len(turn1) - 1]) == json.dumps(turn1[1:-1])
        # A new Engram on the same database (and Redis) forwards the very same bytes, and the
        # slots it references are still there.
        e2 = await start_engram(strict.url, slots=backend, memory={"db_path": db})
        try:
            assert (await chat(http, e2, {"model": "m", "messages": later}))[0] == 200
            assert json.dumps(forwarded(strict)["messages"][1:]) == json.dumps(turn2[1:])
            for out in outs:
                assert (
                    await e2.app[SERVICES].slots.get("alice", slot_id("read_file", out)) is not None
                )
            await settle(e2)
        finally:
            await e2.close()
    finally:
        await e.close()


async def test_tool_choice_none_keeps_self_describing_references(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    msgs = agent_chat([output("a")])
    body = {"model": "m", "messages": msgs, "tool_choice": "none", "x_vendor": None}
    assert (await chat(http, engram, body))[0] == 200
    sent = forwarded(strict)
    assert "tools" not in sent and sent["tool_choice"] == "none" and sent["x_vendor"] is None
    assert REFERENCE.match(sent["messages"][3]["content"])


async def test_client_tools_come_first_and_keep_their_order(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    tools = [
        {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object"}}},
    ]
    body = {"model": "m", "messages": agent_chat([output("a")]), "tools": tools}
    assert (await chat(http, engram, body))[0] == 200
    assert forwarded(strict)["tools"][:2] == tools
    assert forwarded(strict)["tools"][2]["function"]["name"] == TOOL


async def test_an_output_that_cannot_be_stored_is_forwarded_raw(
    strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    e = await start_engram(strict.url)  # embedded backend only
    try:
        store = e.app[SERVICES].store
        assert store is not None
        # The embedded store breaks for real. Dropped through Engram's own SQLite library: a
        # second SQLite copy in one process (the stdlib's) shares neither its POSIX locks nor its
        # mmap bookkeeping, and a DROP TABLE under auto_vacuum shrinks the file (SIGBUS).
        await store.write(lambda c: c.execute("DROP TABLE slots"))
        msgs = agent_chat([output("a")])
        status, reply = await chat(http, e, {"model": "m", "messages": msgs})
        assert status == 200, reply
        sent = forwarded(strict)
        assert sent["messages"][3]["content"] == msgs[3]["content"]
        assert "tools" not in sent
        await settle(e)
    finally:
        await e.close()


# --- the expansion loop ------------------------------------------------------------------------


async def test_plain_expansion_is_answered_by_engram(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    outs = [output("a"), output("b")]
    sid = slot_id("read_file", outs[0])
    strict.enqueue(
        JsonReply(chat_completion(None, tool_calls=[expand_call(sid)], usage=make_usage(100, 7))),
        JsonReply(chat_completion("mod0 multiplies.", usage=make_usage(1200, 5))),
    )
    vendor = {"cache_prompt": True, "id_slot": None, "temperature": 0.2}
    status, reply = await chat(http, engram, {"model": "m", "messages": agent_chat(outs), **vendor})
    assert status == 200, reply
    msg = reply["choices"][0]["message"]
    assert msg["content"] == "mod0 multiplies." and "tool_calls" not in msg
    for req in strict.chat_requests():  # every other field, in every round, as the client sent it
        sent = req.json()
        assert {k: sent[k] for k in vendor} == vendor and sent["model"] == "m"
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"] == make_usage(1300, 12)
    reqs = strict.chat_requests()
    assert len(reqs) == 2
    second = reqs[1].json()["messages"]
    assert template_violations(second) == []
    call, answer = second[-2], second[-1]
    assert call["role"] == "assistant" and call["tool_calls"][0]["id"] == "exp000001"
    assert answer == {"role": "tool", "tool_call_id": "exp000001", "content": outs[0]}
    await settle(engram)
    # The archive holds what the client saw: no internal call.
    final = engram.turns[-1]
    assert final.reply is not None and final.reply.tool_calls == []
    assert final.expansions == 1
    async with http.get(engram.url + "/engram/metrics") as r:
        metrics = await r.text()
    assert "engram_expansion_round_trips_total 1\n" in metrics
    assert "engram_expansion_expanded_total 1\n" in metrics


async def test_streamed_expansion_is_invisible_to_the_sdk(
    engram: Engram, strict: FakeUpstream
) -> None:
    outs = [output("a"), output("b")]
    sid = slot_id("read_file", outs[1])
    strict.enqueue(
        StreamReply(
            chat_chunks([], tool_calls=[expand_call(sid)], usage=make_usage(100, 9), done=True)
        ),
        StreamReply(chat_chunks(["mod1 ", "multiplies."], usage=make_usage(1300, 4))),
    )
    client = sdk(engram)
    content, calls, finish, usage, ids = [], [], None, None, set()
    stream = await client.chat.completions.create(
        model="m",
        messages=agent_chat(outs),  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    await client.close()
    assert "".join(content) == "mod1 multiplies."
    assert calls == [] and finish == "stop"
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (1400, 13)
    assert len(ids) == 1
    second = strict.chat_requests()[1].json()["messages"]
    assert second[-1]["content"] == outs[1] and template_violations(second) == []
    await settle(engram)


@pytest.mark.parametrize("stream", [False, True])
async def test_client_calls_win_over_an_internal_call_in_the_same_reply(
    engram: Engram, strict: FakeUpstream, stream: bool
) -> None:
    outs = [output("a")]
    calls = [expand_call(slot_id("read_file", outs[0])), client_call()]
    if stream:
        strict.enqueue(StreamReply(chat_chunks(["Let me run them."], tool_calls=calls)))
    else:
        strict.enqueue(JsonReply(chat_completion("Let me run them.", tool_calls=calls)))
    client = sdk(engram)
    tools = [{"type": "function", "function": {"name": "run_tests", "parameters": {}}}]
    if stream:
        got: dict[int, dict[str, str]] = {}
        text, finish = "", None
        async for chunk in await client.chat.completions.create(
            model="m",
            messages=agent_chat(outs),  # type: ignore[arg-type]
            tools=tools,  # type: ignore[arg-type]
            stream=True,
        ):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
                for tc in choice.delta.tool_calls or []:
                    entry = got.setdefault(tc.index, {"id": "", "name": "", "args": ""})
                    entry["id"] += tc.id or ""
                    entry["name"] += (tc.function.name or "") if tc.function else ""
                    entry["args"] += (tc.function.arguments or "") if tc.function else ""
        assert list(got) == [0]
        assert got[0] == {"id": "cli000001", "name": "run_tests", "args": '{"path": "tests/"}'}
    else:
        resp = await client.chat.completions.create(
            model="m",
            messages=agent_chat(outs),  # type: ignore[arg-type]
            tools=tools,  # type: ignore[arg-type]
        )
        msg = resp.choices[0].message
        text, finish = msg.content or "", resp.choices[0].finish_reason
        assert [(c.id, c.function.name) for c in msg.tool_calls or []] == [
            ("cli000001", "run_tests")
        ]
    await client.close()
    assert text == "Let me run them." and finish == "tool_calls"
    assert len(strict.chat_requests()) == 1  # no round trip: the client runs its tools first
    await settle(engram)


@pytest.mark.parametrize("stream", [False, True])
async def test_an_expired_slot_gets_a_clear_answer(
    strict: FakeUpstream, backend: dict[str, Any], http: aiohttp.ClientSession, stream: bool
) -> None:
    e = await start_engram(strict.url, slots={**backend, "ttl_seconds": 1})
    try:
        old = output("gone")
        assert (await chat(http, e, {"model": "m", "messages": agent_chat([old])}))[0] == 200
        await asyncio.sleep(2.2)  # the slot's TTL passes
        sid = slot_id("read_file", old)
        assert await e.app[SERVICES].slots.get("alice", sid) is None
        # The client compacted its history; the model still asks for the old reference.
        msgs = agent_chat([output("new")])
        if stream:
            strict.enqueue(
                StreamReply(chat_chunks([], tool_calls=[expand_call(sid)])),
                StreamReply(chat_chunks(["I no longer have it."])),
            )
        else:
            strict.enqueue(
                JsonReply(chat_completion(None, tool_calls=[expand_call(sid)])),
                JsonReply(chat_completion("I no longer have it.")),
            )
        async with http.post(
            e.url + "/v1/chat/completions",
            json={"model": "m", "messages": msgs, "stream": stream},
            headers={"X-Engram-User": "alice"},
        ) as r:
            assert r.status == 200
            text = await r.text()
        assert "I no longer have it." in text and TOOL not in text
        answer = strict.chat_requests()[-1].json()["messages"][-1]
        assert answer["role"] == "tool" and "has expired or is unknown" in answer["content"]
        await settle(e)
    finally:
        await e.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_the_loop_stops_at_the_limit(
    strict: FakeUpstream, backend: dict[str, Any], http: aiohttp.ClientSession, stream: bool
) -> None:
    e = await start_engram(strict.url, slots={**backend, "max_expansions": 2})
    try:
        outs = [output("a")]
        sid = slot_id("read_file", outs[0])
        for n in range(3):  # the model never stops asking, even once the tool is gone
            call = expand_call(sid, f"exp00000{n}")
            strict.enqueue(
                StreamReply(chat_chunks(["..."], tool_calls=[call]))
                if stream
                else JsonReply(chat_completion("...", tool_calls=[call]))
            )
        async with http.post(
            e.url + "/v1/chat/completions",
            json={"model": "m", "messages": agent_chat(outs), "stream": stream},
        ) as r:
            assert r.status == 200
            text = await r.text()
        reqs = [q.json() for q in strict.chat_requests()]
        assert len(reqs) == 3  # two round trips, then once more without the tool
        assert [TOOL in json.dumps(q.get("tools")) for q in reqs] == [True, True, False]
        assert "tools" not in reqs[2]
        assert all(template_violations(q["messages"]) == [] for q in reqs)
        assert TOOL not in text and "exp00000" not in text
        if not stream:
            choice = json.loads(text)["choices"][0]
            assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        else:
            assert '"finish_reason": "stop"' in text or '"finish_reason":"stop"' in text
        await settle(e)
    finally:
        await e.close()


async def test_an_upstream_that_rejects_tools_gets_none(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    strict.enqueue(
        JsonReply(
            {"error": {"code": 500, "message": "tools param requires --jinja flag"}}, status=500
        )
    )
    msgs = agent_chat([output("a")])
    status, reply = await chat(http, engram, {"model": "m", "messages": msgs})
    assert status == 200, reply
    reqs = [q.json() for q in strict.chat_requests()]
    assert len(reqs) == 2 and "tools" in reqs[0] and "tools" not in reqs[1]
    assert REFERENCE.match(reqs[1]["messages"][3]["content"])
    # Later requests for that model go without the tool straight away.
    assert (await chat(http, engram, {"model": "m", "messages": msgs}))[0] == 200
    assert len(strict.chat_requests()) == 3 and "tools" not in forwarded(strict)
    await settle(engram)


async def test_an_upstream_error_on_the_round_trip_reaches_the_client(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    outs = [output("a")]
    strict.enqueue(
        JsonReply(chat_completion(None, tool_calls=[expand_call(slot_id("read_file", outs[0]))])),
        JsonReply({"error": {"code": 503, "message": "Loading model"}}, status=503),
    )
    status, reply = await chat(http, engram, {"model": "m", "messages": agent_chat(outs)})
    assert status == 503 and reply["error"]["message"] == "Loading model"
    await settle(engram)


# --- Redis going away --------------------------------------------------------------------------


async def test_redis_killed_mid_test_falls_back_and_recovers(
    strict: FakeUpstream, redis_server: RedisServer, http: aiohttp.ClientSession
) -> None:
    e = await start_engram(strict.url, slots={"redis_url": redis_server.url, "redis_retry": 0.2})
    try:
        slots = e.app[SERVICES].slots
        a, b, c = output("a"), output("b"), output("c")
        assert (await chat(http, e, {"model": "m", "messages": agent_chat([a])}))[0] == 200
        assert slots.backend == "redis"
        redis_server.kill()
        # No request fails; new outputs go to the embedded store and are expandable.
        for _ in range(2):
            status, reply = await chat(http, e, {"model": "m", "messages": agent_chat([a, b])})
            assert status == 200, reply
        assert slots.backend == "embedded"
        async with http.get(e.url + "/engram/health") as r:
            assert (await r.json())["slots"] == "embedded"
        assert REFERENCE.match(forwarded(strict)["messages"][7]["content"])
        strict.enqueue(
            JsonReply(chat_completion(None, tool_calls=[expand_call(slot_id("read_file", b))])),
            JsonReply(chat_completion("done")),
        )
        status, reply = await chat(http, e, {"model": "m", "messages": agent_chat([a, b])})
        assert status == 200 and reply["choices"][0]["message"]["content"] == "done"
        assert forwarded(strict)["messages"][-1]["content"] == b
        # Redis comes back: Engram notices and uses it again.
        redis_server.start()
        for _ in range(100):
            if slots.backend == "redis":
                break
            await asyncio.sleep(0.05)
        assert slots.backend == "redis"
        async with http.get(e.url + "/engram/health") as r:
            assert (await r.json())["slots"] == "redis"
        assert (await chat(http, e, {"model": "m", "messages": agent_chat([a, b, c])}))[0] == 200
        assert REFERENCE.match(forwarded(strict)["messages"][11]["content"])
        stats = await slots.stats()
        assert stats["redis"]["slots"] >= 1
        await settle(e)
    finally:
        await e.close()


async def test_one_user_cannot_expand_another_users_slot(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    secret = output("alice_secret")
    assert (await chat(http, engram, {"model": "m", "messages": agent_chat([secret])}))[0] == 200
    strict.enqueue(
        JsonReply(chat_completion(None, tool_calls=[expand_call(slot_id("read_file", secret))])),
        JsonReply(chat_completion("nothing")),
    )
    bob = agent_chat([output("bob")])
    status, _ = await chat(http, engram, {"model": "m", "messages": bob}, user="bob")
    assert status == 200
    answer = forwarded(strict)["messages"][-1]
    assert answer["role"] == "tool" and "has expired or is unknown" in answer["content"]
    assert "alice_secret" not in json.dumps(forwarded(strict))
    await settle(engram)


async def test_upstream_dying_in_the_round_trip_reaches_the_sdk_as_an_error(
    engram: Engram, strict: FakeUpstream
) -> None:
    outs = [output("a")]
    strict.enqueue(
        StreamReply(chat_chunks([], tool_calls=[expand_call(slot_id("read_file", outs[0]))])),
        StreamReply(chat_chunks(["partial ", "answer ", "never ends"]), die_after=2),
    )
    client = sdk(engram)
    got = []
    with pytest.raises(openai.APIError):
        async for chunk in await client.chat.completions.create(
            model="m",
            messages=agent_chat(outs),  # type: ignore[arg-type]
            stream=True,
        ):
            got += [c.delta.content or "" for c in chunk.choices]
    await client.close()
    assert "".join(got) == "partial "
    await settle(engram)
    turn = engram.turns[-1]
    assert turn.upstream_failed and turn.reply is not None and not turn.reply.complete
    assert turn.reply.content == "partial "


async def test_text_protocol_results_become_references_when_enabled(
    strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    e = await start_engram(strict.url, slots={"detect_text_results": True})
    try:
        body = output("cline")
        msgs = [
            {"role": "system", "content": "You are Cline."},
            {"role": "user", "content": "<task>fix mod.py</task>"},
            {"role": "assistant", "content": "<read_file><path>mod.py</path></read_file>"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"[read_file for 'mod.py'] Result:\n{body}"},
                    {"type": "text", "text": "<environment_details>x</environment_details>"},
                ],
            },
            {"role": "assistant", "content": "The file looks fine."},
            {"role": "user", "content": "Now run the tests."},
        ]
        assert (await chat(http, e, {"model": "m", "messages": msgs}))[0] == 200
        part = forwarded(strict)["messages"][3]["content"][0]["text"]
        sid = slot_id("read_file", body)
        assert part.startswith(f"[read_file for 'mod.py'] Result:\n[TOOL_RESULT:{sid}]")
        assert body not in part
        assert await e.app[SERVICES].slots.get("alice", sid) is not None
        await settle(e)
    finally:
        await e.close()


async def test_stable_prompt_mode_and_round_keeping_work_with_slots(
    strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    e = await start_engram(strict.url, prompt={"mode": "stable"}, slots={"keep_recent": "round"})
    try:
        outs = [output("a"), output("b")]
        msgs = agent_chat(outs)[:-2]  # mid agent loop: the last output answers the latest call
        assert msgs[-1]["role"] == "tool"
        extra = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "callmore1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "c.py"}'},
                }
            ],
        }
        loop = [
            *msgs[:-1],
            msgs[-1],
            extra,
            {"role": "tool", "tool_call_id": "callmore1", "content": output("c")},
        ]
        assert (await chat(http, e, {"model": "m", "messages": loop}))[0] == 200
        fwd = forwarded(strict)["messages"]
        assert template_violations(fwd) == []
        assert REFERENCE.match(fwd[3]["content"]) and REFERENCE.match(fwd[7]["content"])
        assert fwd[-1]["content"] == output("c")  # the latest round stays raw
        await settle(e)
    finally:
        await e.close()


async def test_a_client_gone_during_the_round_trip_stops_the_upstream(
    engram: Engram, strict: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    outs = [output("a")]
    strict.enqueue(
        StreamReply(chat_chunks([], tool_calls=[expand_call(slot_id("read_file", outs[0]))])),
        StreamReply(chat_chunks([f"w{i} " for i in range(200)]), delay=0.05),
    )
    body = {"model": "m", "messages": agent_chat(outs), "stream": True}
    resp = await http.post(engram.url + "/v1/chat/completions", json=body)
    seen = b""
    while b"w1 " not in seen:  # the second round is streaming
        seen += await resp.content.readany()
    closed_at = time.monotonic()
    resp.close()
    for _ in range(100):
        if strict.disconnects:
            break
        await asyncio.sleep(0.005)
    assert strict.disconnects, "the upstream never saw the disconnect"
    assert strict.disconnects[0][1] - closed_at < 0.1
    await settle(engram)
    turn = engram.turns[-1]
    assert turn.client_gone and turn.reply is not None and not turn.reply.complete
    assert (turn.reply.content or "").startswith("w0 w1 ") and TOOL.encode() not in seen


async def test_slot_api_rejects_malformed_ids(engram: Engram, http: aiohttp.ClientSession) -> None:
    for bad in ("a" * 81, "x y", "%27%3B--"):
        async with http.get(f"{engram.url}/engram/api/slots/{bad}") as r:
            assert r.status == 400, bad
            assert (await r.json())["error"]["code"] == "invalid_slot_id"
    async with http.get(f"{engram.url}/engram/api/slots/read_file-000000000000") as r:
        assert r.status == 404
