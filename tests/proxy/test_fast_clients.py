"""Clients that send the next turn the instant a reply ends, many at once (issue 10, items 2, 4).

A turn is archived before the client gets the reply's last byte, so the next request of the
conversation always finds it: one conversation is one session at any speed, every message is
stored once and in order. Requests the upstream rejected are not archived; odd but accepted
input (lone surrogates, tool calls of the wrong shape) is archived, never silently dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.chat.archive import to_new_turns
from proxy.messages import canonical, chain_hashes, content_text, without_lone_surrogates
from proxy.services import SERVICES
from proxy.store.models import Turn
from testing.fake_chunks import chat_chunks, chat_completion
from testing.fake_upstream import FakeUpstream, JsonReply, RawReply, StreamReply
from testing.harness import Engram, settle, turns_as_sent

SYSTEM = {"role": "system", "content": "You are a terse assistant."}


async def user_turns(engram: Engram, user: str) -> dict[str, list[Turn]]:
    store = engram.app[SERVICES].store
    return {s.id: await turns_as_sent(engram, s.id) for s in await store.list_sessions(user)}


async def send(
    http: aiohttp.ClientSession,
    engram: Engram,
    messages: list[dict[str, Any]],
    headers: dict[str, str],
    stream: bool,
) -> tuple[str, str]:
    """One chat request read to its last byte: (the reply's text, X-Engram-Session)."""
    body = {"model": "m", "messages": messages, "stream": stream}
    async with http.post(engram.url + "/v1/chat/completions", json=body, headers=headers) as r:
        raw = await r.read()
        assert r.status == 200, raw
        session = r.headers["X-Engram-Session"]
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"], session
    text = ""
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += (choice.get("delta") or {}).get("content") or ""
    return text, session


async def conversation(
    http: aiohttp.ClientSession,
    engram: Engram,
    user: str,
    turns: int,
    *,
    session: str | None = None,
    streams: list[bool],
) -> tuple[list[dict[str, Any]], list[str]]:
    """A client that sends each next turn as soon as the last reply ended; returns the
    conversation as the client holds it and the session header of every reply."""
    headers = {"X-Engram-User": user}
    if session is not None:
        headers["X-Engram-Session"] = session
    messages: list[dict[str, Any]] = [SYSTEM]
    seen: list[str] = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"{user} asks question {i} of {turns}"})
        text, sid = await send(http, engram, messages, headers, streams[i % len(streams)])
        messages.append({"role": "assistant", "content": text})
        seen.append(sid)
    return messages, seen


@pytest.mark.asyncio
async def test_four_turns_back_to_back_stay_one_session(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    messages, seen = await conversation(http, engram, "solo", 4, streams=[False])
    assert len(set(seen)) == 1, seen
    await settle(engram)
    sessions = await user_turns(engram, "solo")
    assert list(sessions) == [seen[0]]
    assert [t.content for t in sessions[seen[0]]] == [m["content"] for m in messages]


@pytest.mark.asyncio
async def test_reply_is_stored_before_the_client_has_its_last_byte(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """No settle: the moment the client has read the whole reply, the turn is in the store
    (streamed with [DONE], streamed without it, small plain JSON, plain JSON past 64 kB)."""
    big = "x " * 40_000
    fake.enqueue(
        StreamReply(chat_chunks(["streamed ", "reply"]), delay=0.01),
        StreamReply(chat_chunks(["no ", "done"], done=False)),
        JsonReply(chat_completion("small plain reply")),
        RawReply(json.dumps(chat_completion(big)).encode(), content_type="application/json"),
    )
    expected = ["streamed reply", "no done", "small plain reply", big]
    for i, want in enumerate(expected):
        headers = {"X-Engram-User": "eager", "X-Engram-Session": f"eager-{i}"}
        msgs = [SYSTEM, {"role": "user", "content": f"question {i}"}]
        text, sid = await send(http, engram, msgs, headers, stream=i < 2)
        assert text == want
        stored = await turns_as_sent(engram, sid)  # no settle
        assert [t.content for t in stored] == [SYSTEM["content"], f"question {i}", want], i
        assert not stored[-1].incomplete


@pytest.mark.asyncio
async def test_many_clients_back_to_back_one_session_each_every_message_once(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    clients, turns = 8, 12
    jobs = [
        conversation(
            http,
            engram,
            f"client-{c}",
            turns,
            session=f"named-{c}" if c % 2 else None,
            streams=[c % 3 == 0, True, False][c % 3 :] or [True],
        )
        for c in range(clients)
    ]
    results = await asyncio.gather(*jobs)
    await settle(engram)
    for c, (messages, seen) in enumerate(results):
        user = f"client-{c}"
        assert len(set(seen)) == 1, (user, seen)
        sessions = await user_turns(engram, user)
        assert list(sessions) == [seen[0]], (user, list(sessions))
        stored = sessions[seen[0]]
        assert [t.content for t in stored] == [m["content"] for m in messages], user
        assert [t.position for t in stored] == list(range(len(messages))), user


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
async def test_concurrent_regenerations_keep_both_replies(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession, stream: bool
) -> None:
    """Two requests of one conversation at once (a regenerate while the first still runs):
    the second reply is not dropped on the first's position. The first placed holds the
    session's next position; the second is a fork from there, and its reply says so."""
    headers = {"X-Engram-User": "regen"}
    first = [SYSTEM, {"role": "user", "content": "name a colour"}]
    text, sid = await send(http, engram, first, headers, stream=False)
    history = [*first, {"role": "assistant", "content": text}]
    history.append({"role": "user", "content": "another one"})
    if stream:
        fake.enqueue(
            StreamReply(chat_chunks(["bl", "ue"]), delay=0.15), StreamReply(chat_chunks(["green"]))
        )
    else:
        fake.enqueue(
            JsonReply(chat_completion("blue"), delay=0.3), JsonReply(chat_completion("green"))
        )
    slow = asyncio.create_task(send(http, engram, history, headers, stream=stream))
    await asyncio.sleep(0.1)  # the slow one is placed and waiting on the upstream
    fast = await send(http, engram, history, headers, stream=stream)
    slow_reply = await slow
    assert (slow_reply[0], fast[0]) == ("blue", "green")
    assert slow_reply[1] == sid and fast[1] != sid  # named before either reply was stored
    await settle(engram)
    sessions = await user_turns(engram, "regen")
    assert set(sessions) == {sid, fast[1]}
    main = [t.content for t in sessions[sid]]
    assert main == [SYSTEM["content"], "name a colour", text, "another one", "blue"]
    fork = sessions[fast[1]]
    assert [(t.position, t.content) for t in fork] == [(3, "another one"), (4, "green")]
    # The conversation continued from the forked reply is recognised as the fork.
    follow = [*history, {"role": "assistant", "content": "green"}]
    follow.append({"role": "user", "content": "thanks"})
    _, follow_sid = await send(http, engram, follow, headers, stream=False)
    assert follow_sid == fast[1]


async def alike(
    http: aiohttp.ClientSession, engrams: list[Engram], user: str, n: int, turns: int
) -> tuple[list[dict[str, Any]], list[str]]:
    """Conversation ``n`` of ``user``: it opens as every other does, then goes its own way;
    each next turn sent the instant the reply ends, through each server in turn, streamed and
    not by turns. The conversation as the client holds it and each reply's X-Engram-Session."""
    headers = {"X-Engram-User": user}
    messages: list[dict[str, Any]] = []
    seen: list[str] = []
    for i in range(turns):
        text = "hello there" if i == 0 else f"conversation {n} says {i}"
        messages.append({"role": "user", "content": text})
        engram = engrams[(n + i) % len(engrams)]
        reply, sid = await send(http, engram, messages, headers, stream=(n + i) % 2 == 0)
        messages.append({"role": "assistant", "content": reply})
        seen.append(sid)
    return messages, seen


async def assert_each_reply_names_its_turns_session(
    engrams: list[Engram], results: list[tuple[list[dict[str, Any]], list[str]]]
) -> None:
    """Every reply's X-Engram-Session names a session that stores that turn: its user message
    and the reply, at their positions."""
    for engram in engrams:
        await settle(engram)
    for messages, seen in results:
        for i, sid in enumerate(seen):
            held = {t.position: t.content for t in await turns_as_sent(engrams[0], sid)}
            turn = (held.get(2 * i), held.get(2 * i + 1))
            assert turn == (messages[2 * i]["content"], messages[2 * i + 1]["content"]), (i, sid)


@pytest.mark.asyncio
@pytest.mark.parametrize("replies", ["sampled", "identical"])
async def test_conversations_opening_alike_at_once_each_reply_names_the_session_of_its_turn(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession, replies: str
) -> None:
    """Issue 39, item 1: sixteen new conversations of one user at once, all opening with the
    same message, no session id. Each reply names the session that holds its turn, from the
    first reply on. With a model that samples (a reply of its own for each), each conversation
    is one session under one id from its first reply to its last, every message stored once, in
    order. With identical replies the conversations are the same until their second message
    (nothing in them tells them apart): each goes on in one of the sessions opened alike, or
    in a fork of one when every one is held by another's request at that instant."""
    if replies == "sampled":
        count = itertools.count()
        fake.reply_text = lambda last: f"{last}, said once ({next(count)})"
    results = await asyncio.gather(*(alike(http, [engram], "alike", n, 8) for n in range(16)))
    await assert_each_reply_names_its_turns_session([engram], list(results))
    sessions = await user_turns(engram, "alike")
    if replies == "sampled":
        for messages, seen in results:
            assert len(set(seen)) == 1, seen
            assert [t.content for t in sessions[seen[0]]] == [m["content"] for m in messages]
        assert len(sessions) == 16
    else:  # each opened its own; each went on in one of them, or (all held) a fork of one
        assert sum(len(s) for s in sessions.values()) == 16 * 16  # every message once
        assert sum(len(s) == 16 for s in sessions.values()) >= 8, sessions


@pytest.mark.asyncio
async def test_rejected_request_is_not_archived(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    fake.enqueue(JsonReply({"error": {"message": "bad key"}}, status=401))
    body = {"model": "m", "messages": [SYSTEM, {"role": "user", "content": "secret plan"}]}
    headers = {"X-Engram-User": "rejected", "X-Engram-Session": "r"}
    async with http.post(engram.url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 401
        await r.read()
    await settle(engram)
    assert await turns_as_sent(engram, "r") == []
    text, _ = await send(http, engram, body["messages"], headers, stream=True)
    await settle(engram)
    stored = await turns_as_sent(engram, "r")
    assert [t.content for t in stored] == [SYSTEM["content"], "secret plan", text]


@pytest.mark.asyncio
async def test_client_gone_mid_stream_keeps_what_arrived(
    engram: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    fake.enqueue(StreamReply(chat_chunks(["part one ", "part two ", "part three"]), delay=0.3))
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "go on"}]}
    headers = {"X-Engram-User": "leaver", "X-Engram-Session": "leave"}
    async with http.post(engram.url + "/v1/chat/completions", json=body, headers=headers) as r:
        got = b""
        while b"part one" not in got:  # the first words, then the client goes away
            got += await r.content.readany()
    for _ in range(200):
        stored = await turns_as_sent(engram, "leave")
        if len(stored) == 2:
            break
        await asyncio.sleep(0.02)
    await settle(engram)
    stored = await turns_as_sent(engram, "leave")
    assert [t.content for t in stored] == ["go on", "part one "]
    assert stored[1].role == "assistant" and stored[1].incomplete


ODD_MESSAGES: list[tuple[str, list[dict[str, Any]] | str]] = [
    ("lone surrogate in content", '[{"role": "user", "content": "broken \\ud800 text"}]'),
    ("lone low surrogate", '[{"role": "user", "content": "\\udfff at the start"}]'),
    (
        "lone surrogate in a text part and a name",
        '[{"role": "user", "name": "ev\\ud83dil", "content": '
        '[{"type": "text", "text": "part \\udc00 here"}]}]',
    ),
    (
        "tool call whose function is a number",
        [
            {"role": "user", "content": "call something"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": 7}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "tool said 7"},
            {"role": "user", "content": "and now?"},
        ],
    ),
    (
        "tool calls of every wrong shape",
        [
            {"role": "user", "content": "odd"},
            {
                "role": "assistant",
                "content": {"not": "a string"},
                "tool_calls": [1, "x", None, {"function": None}, {"function": {"name": 3}}],
            },
            {"role": "tool", "tool_call_id": 5, "name": ["n"], "content": 12},
            {"role": "user", "content": "still here"},
        ],
    ),
]


@pytest.mark.parametrize(("case", "messages"), ODD_MESSAGES, ids=[c for c, _ in ODD_MESSAGES])
@pytest.mark.asyncio
async def test_odd_but_accepted_requests_are_archived(
    engram: Engram,
    fake: FakeUpstream,
    http: aiohttp.ClientSession,
    case: str,
    messages: list[dict[str, Any]] | str,
) -> None:
    listed = messages if isinstance(messages, str) else json.dumps(messages)
    raw = ('{"model": "m", "messages": ' + listed + "}").encode()
    headers = {
        "X-Engram-User": "odd",
        "X-Engram-Session": "odd",
        "Content-Type": "application/json",
    }
    async with http.post(engram.url + "/v1/chat/completions", data=raw, headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()
    await settle(engram)
    sent = json.loads(raw)["messages"]
    stored = await turns_as_sent(engram, "odd")
    assert len(stored) == len(sent) + 1, case  # every message and the reply
    for turn, msg in zip(stored, sent, strict=False):
        want = without_lone_surrogates(content_text(msg.get("content")))
        assert turn.content == want
        turn.content.encode("utf-8")  # what is stored is valid UTF-8
    assert stored[-1].role == "assistant" and stored[-1].content.startswith("echo:")
    # What reached the upstream parsed as JSON (the fake parses it, or it would have said 400).
    assert fake.chat_requests()[-1].json()["model"] == "m"


@pytest.mark.asyncio
async def test_lone_surrogate_in_the_body_user_names_a_user_and_is_archived(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    raw = b'{"model": "m", "user": "odd\\udfff", "messages": [{"role": "user", "content": "hi"}]}'
    headers = {"Content-Type": "application/json", "X-Engram-Session": "odd-user"}
    async with http.post(engram.url + "/v1/chat/completions", data=raw, headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()
    await settle(engram)
    store = engram.app[SERVICES].store
    stored = await turns_as_sent(engram, "odd-user")
    assert [t.content for t in stored] == ["hi", "echo: hi"]
    session = await store.get_session("odd-user")
    assert session is not None and session.user_id.startswith("h-")  # the cleaned name, hashed


JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(alphabet=st.characters(codec=None, min_codepoint=0, max_codepoint=0xFFFF)),
)
JSON_ANY = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system", "developer", "x"])},
    optional={
        "content": JSON_ANY,
        "name": JSON_ANY,
        "tool_call_id": JSON_ANY,
        "tool_calls": st.one_of(
            JSON_ANY,
            st.lists(
                st.fixed_dictionaries(
                    {},
                    optional={"id": JSON_ANY, "function": JSON_ANY, "type": JSON_ANY},
                ),
                max_size=3,
            ),
        ),
    },
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(MESSAGE, min_size=1, max_size=5), st.booleans())
def test_any_parsed_messages_hash_and_become_archive_rows(
    messages: list[dict[str, Any]], redact: bool
) -> None:
    """Whatever JSON a client sends as messages (once roles are strings, which the pipeline
    checks), hashing and making archive rows never raise, and the rows are valid UTF-8."""
    for m in messages:
        canonical(m)
    clean = without_lone_surrogates(messages)
    chains = chain_hashes(clean)
    assert chains == chain_hashes(clean)  # stable
    rows = to_new_turns(clean, chains, 0, redact, 0.0)
    for row in rows:
        row.content.encode("utf-8")
        json.dumps(row.tool_calls, ensure_ascii=False).encode("utf-8")
    if clean is messages:  # nothing replaced: nothing needed replacing
        json.dumps(messages, ensure_ascii=False).encode("utf-8")


def test_without_lone_surrogates_keeps_valid_text_and_identity() -> None:
    value = {"a": ["fine", "emoji \U0001f600"], "b": 1}
    assert without_lone_surrogates(value) is value
    broken = json.loads('{"a": ["x\\ud800y"], "\\udc01": 2}')
    fixed = without_lone_surrogates(broken)
    assert fixed == {"a": ["x\ufffdy"], "\ufffd": 2}
    json.dumps(fixed, ensure_ascii=False).encode("utf-8")
