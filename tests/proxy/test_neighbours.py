"""retrieval.neighbours: a recalled turn brings its same-session neighbours into memory;
retrieval.question_neighbours: so do a question's best memories, when the turn beside says
something."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from proxy.chat.fence import BLOCK_OPEN
from proxy.search.retrieval import Hit
from proxy.services import SERVICES
from proxy.store.queries import turns_at
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, forwarded_memory, settle, start_engram
from tests.proxy.test_memory import SYSTEM, chat
from tests.proxy.test_memory import forwarded_block as forwarded_system

pytestmark = pytest.mark.asyncio

# The question names the topic; the answer sits in the next turn and shares no word with the
# question, so only the neighbour rule brings it in (top_k=1 keeps the search to one hit).
PAST: list[dict[str, Any]] = [
    SYSTEM,
    {"role": "user", "content": "Guess what my ferret Biscuit loves most."},
    {"role": "assistant", "content": "Probably a tangerine squeaky octopus toy."},
    {"role": "user", "content": "Right! Unrelated: gloomy drizzle again today."},
]
QUESTION = {"role": "user", "content": "What toy does Biscuit the ferret love?"}
ANSWER = "octopus"
ASKED = {"X-Engram-Memory": "read-only"}  # the question is not archived


async def engram_with(fake: FakeUpstream, neighbours: int, question_neighbours: int = 0) -> Engram:
    return await start_engram(
        fake.url,
        retrieval={
            "top_k": 1,
            "neighbours": neighbours,
            "question_neighbours": question_neighbours,
        },
    )


@pytest_asyncio.fixture
async def near(fake: FakeUpstream) -> AsyncIterator[Engram]:
    e = await engram_with(fake, 1)
    try:
        yield e
    finally:
        await e.close()


async def remember(http: aiohttp.ClientSession, engram: Engram, user: str = "alice") -> None:
    await chat(http, engram, PAST, user=user)
    await settle(engram)


async def test_next_turn_of_a_recalled_turn_is_injected(
    near: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    await remember(http, near)
    _, r = await chat(http, near, [SYSTEM, QUESTION], user="alice")
    system = forwarded_system(fake)
    assert BLOCK_OPEN in system and "Biscuit" in system and ANSWER in system
    # The neighbour follows its hit; the turn two away (beyond neighbours=1) stays out.
    assert system.index("Biscuit") < system.index(ANSWER)
    assert "drizzle" not in system
    assert r.headers["X-Engram-Memories"] == "2"


async def test_no_neighbours_when_both_settings_are_0(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    engram = await engram_with(fake, 0)
    try:
        await remember(http, engram)
        _, r = await chat(http, engram, [SYSTEM, QUESTION], user="alice")
        system = forwarded_system(fake)
        assert "Biscuit" in system and ANSWER not in system
        assert r.headers["X-Engram-Memories"] == "1"
    finally:
        await engram.close()


async def test_neighbour_already_in_the_window_is_not_injected(
    near: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    await remember(http, near)
    answer = PAST[2]
    _, r = await chat(
        http, near, [SYSTEM, {"role": "user", "content": "hello"}, answer, QUESTION], user="alice"
    )
    sent = fake.chat_requests()[-1].json()["messages"]
    assert "Biscuit" in forwarded_memory(sent) and ANSWER not in forwarded_memory(sent)
    assert sum(ANSWER in m["content"] for m in sent) == 1  # the client's own copy only
    assert r.headers["X-Engram-Memories"] == "1"


async def test_other_users_turns_never_come_as_neighbours(
    near: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    await remember(http, near, user="alice")
    await chat(
        http,
        near,
        [SYSTEM, {"role": "user", "content": "My ferret Biscuit hates baths."}],
        user="bob",
    )
    await settle(near)
    await chat(http, near, [SYSTEM, QUESTION], user="bob")
    assert ANSWER not in json.dumps(fake.chat_requests()[-1].json())
    # The read itself is bounded by user: alice's session at bob's name finds nothing.
    store = near.app[SERVICES].store
    (alice_session,) = await store.list_sessions("alice")
    places = [(alice_session.id, 2)]
    assert await store.read(lambda c: turns_at(c, "bob", places)) == {}
    found = await store.read(lambda c: turns_at(c, "alice", places))
    assert ANSWER in found[(alice_session.id, 2)].content


async def test_subagent_neighbours_stay_in_its_own_session(
    near: Engram, fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    await remember(http, near)  # the parent's own history holds the octopus answer
    _, r = await chat(http, near, [{"role": "user", "content": "coordinate the pets research"}])
    parent = r.headers["X-Engram-Session"]
    await settle(near)
    sub = {"X-Engram-Parent": parent}
    # A long sub-agent conversation (beyond the fake's 4,096-token context): its first turns
    # leave the forwarded window, so they can only come back as memories.
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "Note: Biscuit the ferret sleeps somewhere odd."},
        {"role": "assistant", "content": "Noted: inside a walnut drawer."},
    ]
    for i in range(30):
        history.append({"role": "user", "content": f"Step {i}: " + "lorem ipsum " * 60})
        history.append({"role": "assistant", "content": f"Done {i}: " + "dolor sit " * 60})
    history.append({"role": "user", "content": "carry on"})
    body, r = await chat(http, near, history, headers=sub)
    own = r.headers["X-Engram-Session"]
    await settle(near)
    _, r = await chat(http, near, [*history, body["choices"][0]["message"], QUESTION], headers=sub)
    assert r.headers["X-Engram-Session"] == own
    sent = fake.chat_requests()[-1].json()["messages"]
    assert not any("Noted: inside" in m["content"] for m in sent[1:])  # out of the window
    text = json.dumps(sent)
    assert "walnut" in text  # its own hit's neighbour came back
    assert ANSWER not in text and "Guess what" not in text  # never the parent's turns


async def test_a_questions_best_memory_brings_the_turn_beside_it_by_default(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """With the defaults (neighbours 0, question_neighbours 3) a question's hit brings the
    turn after it; the turn two away does not come, nor a turn beside a hit that only asks or
    says nothing ("ok!"), nor any for a hit that holds every word the question asks about (its
    answer, as far as the store can tell), nor any for a question about the user's own life
    ("my ferret"), nor any for a message that does not ask."""
    engram = await start_engram(fake.url, retrieval={"top_k": 1})
    try:
        await remember(http, engram)
        await chat(
            http,
            engram,
            [
                SYSTEM,
                {"role": "user", "content": "Tell me a fun fact, can you?"},
                {"role": "assistant", "content": "Parrots like Kiwi whistle anthems at dawn."},
                {"role": "user", "content": "ok!"},
            ],
            user="alice",
        )
        await settle(engram)
        fake.reply_text = lambda last: ""  # the fake's replies are not archived as turns

        async def ask(text: str) -> tuple[str, str]:
            message = {"role": "user", "content": text}
            _, r = await chat(http, engram, [SYSTEM, message], user="alice", headers=ASKED)
            return forwarded_system(fake), r.headers["X-Engram-Memories"]

        block, count = await ask(QUESTION["content"])
        assert "Biscuit" in block and ANSWER in block and "drizzle" not in block
        assert count == "2"
        # the turns beside the hit only ask, or say nothing ("ok!"): the hit alone
        block, count = await ask("What does Kiwi whistle at sunrise?")
        assert "anthems" in block and "ok!" not in block and "fun fact" not in block
        assert count == "1"
        # a hit that holds every word the question asks about is its answer: no neighbours
        block, count = await ask("Who is the ferret Biscuit?")
        assert "Biscuit loves most" in block and ANSWER not in block
        # a question about the user's own life: beside the user's words sit a model's replies
        block, count = await ask("What toy does my ferret Biscuit love?")
        assert "Biscuit loves most" in block and ANSWER not in block
        # a statement: its memory comes alone
        block, count = await ask("Guess what: my ferret Biscuit loves most toys.")
        assert "Biscuit loves most" in block and ANSWER not in block
    finally:
        await engram.close()


async def test_a_neighbour_the_conversation_already_shows_is_not_laid_again(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """Once per conversation: a second question's hit next to a turn an earlier block of the
    same conversation shows does not bring that turn again."""
    engram = await start_engram(fake.url, retrieval={"top_k": 1})
    try:
        fake.reply_text = lambda last: ""  # no reply stored: the drizzle turn ends the chat
        await remember(http, engram)
        fake.reply_text = lambda last: "Noted, a fine question."
        messages = [SYSTEM, QUESTION]
        body, _ = await chat(http, engram, messages, user="alice")
        assert ANSWER in forwarded_system(fake)
        messages += [
            body["choices"][0]["message"],
            {"role": "user", "content": "And the gloomy drizzle, what was unrelated today?"},
        ]
        await chat(http, engram, messages, user="alice")
        sent = json.dumps(fake.chat_requests()[-1].json()["messages"])
        assert "drizzle again today" in sent  # the new hit, beside the octopus turn
        assert sent.count(ANSWER) == 1  # laid once, with the first question
    finally:
        await engram.close()


async def test_neighbours_read_what_the_read_ahead_lacks(
    fake: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """A question's neighbours are read ahead for its best hits before the gate; a place the
    read ahead lacks (the gate admitted a hit further down) is read then, and a place read
    ahead and found empty is not read again."""
    engram = await start_engram(fake.url, retrieval={"top_k": 1})
    try:
        await remember(http, engram)
        recall = engram.app[SERVICES].require_memory().memory.recall
        store = recall.store
        rows = await store.read(
            lambda c: c.execute(
                "SELECT session_id, position FROM turns WHERE content LIKE 'Guess what%'"
            ).fetchall()
        )
        session, at = rows[0]
        found = await recall.turns_at("alice", [(session, at), ("no such session", 0)])
        assert found[("no such session", 0)] is None
        guess = found[(session, at)]
        assert guess is not None
        hit = Hit(guess, 1.0, {})
        chat_turns = lambda role, content: role in ("user", "assistant")  # noqa: E731
        calls: list[str] = []
        real = store.read

        async def counted(fn: Any) -> Any:
            calls.append("read")
            return await real(fn)

        store.read = counted  # type: ignore[method-assign]
        try:

            async def beside(ahead: Any = None) -> list[str]:
                near = await recall.neighbours("alice", [hit], 1, chat_turns, (), ahead)
                return [m.content for m in near.get(guess.id, [])]

            answer = [PAST[2]["content"]]  # the turn before is the system prompt: not wanted
            assert await beside() == answer and calls == ["read"]
            places = [(session, at + 1), (session, at - 1)]
            ahead = await real(lambda c: turns_at(c, "alice", places))
            calls.clear()
            assert await beside(ahead) == answer and calls == []  # all read ahead
            assert await beside({places[1]: ahead[places[1]]}) == answer and calls == ["read"]
            calls.clear()
            assert await beside(dict.fromkeys(places)) == [] and calls == []  # read: empty
        finally:
            store.read = real  # type: ignore[method-assign]
    finally:
        await engram.close()
