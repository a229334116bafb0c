"""Scaffolding and housekeeping are not memory (issue 22), through a real Engram in front of the
fake upstream, with the shapes Claude Code, Codex and opencode send: what a client sends again and
again is stored once per user and never recalled; what it asks for itself (a title) is forwarded
as sent and not archived into the conversation whose session header it carries."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from proxy.chat.recall import query_text
from proxy.services import SERVICES
from proxy.store.models import Turn
from testing.fake_anthropic import anthropic_message
from testing.fake_chunks import chat_completion
from testing.fake_responses import message_item, response
from testing.fake_upstream import FakeUpstream, JsonReply
from testing.harness import Engram, forwarded_memory, settle, start_engram, turns_as_sent

pytestmark = pytest.mark.asyncio

AGENT_PROMPT = "\n\n".join(
    f"Rule {i}: you are an agent working with the user; " + "use the tools carefully. " * 8
    for i in range(30)
)  # ~7 KB of system prompt, 30 paragraphs
AGENT_LIST = "Available agent types for the Agent tool:\n" + "\n".join(
    f"- agent{i}: does task {i} very well" for i in range(40)
)


def environment(cwd: str, date: str) -> str:
    return (
        f"# Environment\nYou have been invoked in the following environment:\n"
        f" - Primary working directory: {cwd}\n - Platform: linux\n\nToday's date is {date}."
    )


REMINDER = (
    "<system-reminder>\nAttribution for git commits and pull requests you create from here on:\n"
    "- End git commit messages with: Co-Authored-By: Claude Code\n</system-reminder>\n"
)


def claude_code(
    question: str, cwd: str = "/home/me/app", date: str = "2026-12-01"
) -> dict[str, Any]:
    """A ``claude -p`` request: billing line and system prompt on top, the reminder and the
    question as one user message's blocks, the environment and agent list as a role "system"
    message after it."""
    return {
        "model": "m",
        "max_tokens": 32000,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.5a8;"},
            {"type": "text", "text": AGENT_PROMPT},
        ],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": REMINDER}, {"type": "text", "text": question}],
            },
            {"role": "system", "content": environment(cwd, date) + "\n\n" + AGENT_LIST},
        ],
    }


@pytest_asyncio.fixture
async def big() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(n_ctx=65536) as fake:
        yield fake


@pytest_asyncio.fixture
async def engram(big: FakeUpstream) -> AsyncIterator[Engram]:
    e = await start_engram(big.url)
    try:
        yield e
    finally:
        await e.close()


async def post(
    http: aiohttp.ClientSession, engram: Engram, path: str, body: dict[str, Any], **headers: str
) -> aiohttp.ClientResponse:
    async with http.post(
        engram.url + path, json=body, headers={"X-Engram-User": "u", **headers}
    ) as r:
        await r.read()
        assert r.status == 200, await r.text()
        return r


async def all_turns(engram: Engram, as_sent: bool = False) -> dict[str, list[Turn]]:
    store = engram.app[SERVICES].store
    out = {}
    for s in await store.list_sessions("u"):
        out[s.id] = await (turns_as_sent(engram, s.id) if as_sent else store.session_turns(s.id))
    return out


async def stored_bytes(engram: Engram) -> tuple[int, int]:
    """(bytes of turn content, bytes of scaffolding) the user's memory holds."""
    store = engram.app[SERVICES].store

    def run(c: Any) -> tuple[int, int]:
        (words,) = c.execute(
            "SELECT coalesce(sum(length(content)), 0) FROM turns WHERE user_id = 'u'"
        ).fetchone()
        (pieces,) = c.execute(
            "SELECT coalesce(sum(length(content)), 0) FROM scaffolds WHERE user_id = 'u'"
        ).fetchone()
        return int(words), int(pieces)

    return await store.read(run)


def last_system(fake: FakeUpstream) -> str:
    body = json.loads(fake.requests[-1].body)
    system = body.get("system")
    if isinstance(system, list):
        return "".join(b.get("text", "") for b in system)
    return str(system or "")


async def test_claude_codes_scaffolding_is_stored_once_and_never_recalled(
    engram: Engram, big: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    # A model's replies (the fake's echo would repeat the reminder back).
    for text in ("Noted: Zorblax.", "Your cat is Zorblax.", "Zorblax, still."):
        big.enqueue(JsonReply(anthropic_message(text)), path="/v1/messages")
    await post(http, engram, "/v1/messages", claude_code("My cat is called Zorblax."))
    await settle(engram)
    first = await stored_bytes(engram)
    for day in ("2026-12-02", "2026-12-03"):
        await post(http, engram, "/v1/messages", claude_code("What is my cat called?", date=day))
        await settle(engram)
    _, pieces = await stored_bytes(engram)
    # Each new session adds its words and a changed environment paragraph, not the prompts.
    assert pieces - first[1] < 2 * len(environment("/home/me/app", "2026-12-02")) + 10
    assert pieces >= len(AGENT_PROMPT) - 200  # stored once, nothing lost
    sessions = await all_turns(engram)
    assert len(sessions) == 3
    for turns in sessions.values():
        assert [t.role for t in turns][:3] == ["system", "user", "system"]
        assert turns[0].content == "" and turns[2].content == ""
        assert turns[1].content in ("My cat is called Zorblax.", "What is my cat called?")
    # The fact is recalled; the reminder, the agent list and the environment never are.
    block = forwarded_memory(json.loads(big.requests[-1].body)["messages"])
    assert "Zorblax" in block
    assert "Attribution" not in block and "agent3" not in block and "/home/me" not in block
    # Nothing is lost: the archive gives every message back as it was sent.
    whole = [t.content for turns in (await all_turns(engram, as_sent=True)).values() for t in turns]
    assert any(t.startswith(REMINDER) and t.endswith("Zorblax.") for t in whole)
    assert any(AGENT_LIST in t and "2026-12-03" in t for t in whole)


async def test_recall_searches_for_the_questions_words_not_the_reminder() -> None:
    msgs = claude_code("What is my cat called?")["messages"]
    neutral = [{"role": "user", "content": msgs[0]["content"]}, msgs[1]]
    assert query_text(neutral) == "What is my cat called?"
    assert query_text([{"role": "user", "content": "Output token limit hit. Resume"}]) == ""


async def test_codex_environment_is_scaffolding_and_its_retries_are_not_words(
    engram: Engram, big: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    def codex(cwd: str, *texts: str) -> dict[str, Any]:
        env = f"<environment_context>\n  <cwd>{cwd}</cwd>\n</environment_context>"
        items: list[dict[str, Any]] = [
            {"role": "developer", "content": [{"type": "input_text", "text": AGENT_PROMPT}]},
            {"role": "user", "content": [{"type": "input_text", "text": env}]},
        ]
        items += [{"role": "user", "content": [{"type": "input_text", "text": t}]} for t in texts]
        return {"model": "m", "input": items}

    for i, text in enumerate(("Noted: Rex.", "Resumed.", "Your dog is Rex.")):
        reply = response([message_item(text)], model="m", rid=f"resp_{i}")
        big.enqueue(JsonReply(reply), path="/v1/responses")
    await post(http, engram, "/v1/responses", codex("/old/dir", "My dog is called Rex."))
    await post(
        http, engram, "/v1/responses", codex("/old/dir", "Output token limit hit. Resume directly")
    )
    await settle(engram)
    words = [
        t.content
        for turns in (await all_turns(engram)).values()
        for t in turns
        if t.role != "assistant"  # the fake's echo repeats what it was sent
    ]
    assert "My dog is called Rex." in words
    assert not any("/old/dir" in w or "Output token" in w for w in words)
    await post(http, engram, "/v1/responses", codex("/new/dir", "What is my dog called?"))
    sent = big.requests[-1].body.decode()
    assert "Rex" in sent and "/new/dir" in sent
    assert "/old/dir" not in sent and "Output token limit" not in sent


async def test_a_paragraph_sent_in_every_session_becomes_scaffolding(
    engram: Engram, big: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """Aider-style: a repository map pasted into every session is nobody's words after the
    second session, and not recalled from the first either."""
    repo_map = "Here is the repository map of my project: " + " ".join(
        f"src/module{i}.py defines Widget{i}" for i in range(30)
    )
    for _ in range(4):
        big.enqueue(JsonReply(chat_completion("Done.")))
    for question in ("Why does Widget3 crash?", "Rename Widget7 please", "Document Widget9"):
        msgs = [{"role": "user", "content": f"{repo_map}\n\n{question}"}]
        await post(http, engram, "/v1/chat/completions", {"model": "m", "messages": msgs})
        await settle(engram)
    sessions = sorted((await all_turns(engram)).values(), key=lambda turns: turns[0].id)
    users = [t.content for turns in sessions for t in turns if t.role == "user"]
    assert users[0].startswith(repo_map)  # the first time it was the user's words
    assert users[1:] == ["Rename Widget7 please", "Document Widget9"]
    r = await post(
        http,
        engram,
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "which module defines Widget21"}]},
    )
    sent = big.requests[-1].body.decode()
    assert "module21" not in sent, r.headers["X-Engram-Memories"]


async def test_forgetting_a_session_forgets_the_scaffolding_only_it_used(
    engram: Engram, http: aiohttp.ClientSession
) -> None:
    await post(http, engram, "/v1/messages", claude_code("first", cwd="/a"))
    await post(http, engram, "/v1/messages", claude_code("second", cwd="/b"))
    await settle(engram)
    store = engram.app[SERVICES].store
    sessions = await store.list_sessions("u")
    assert len(sessions) == 2
    before = await stored_bytes(engram)
    newest = sessions[0]
    assert await store.delete_session(newest.id, user_id="u")
    _, pieces = await stored_bytes(engram)
    assert 0 < pieces < before[1]  # the shared prompt stays, /b's environment is gone

    def env_b(c: Any) -> int:
        return int(
            c.execute(
                "SELECT count(*) FROM scaffolds WHERE content LIKE '%directory: /b%'"
            ).fetchone()[0]
        )

    assert await store.read(env_b) == 0
    [left] = await store.list_sessions("u")
    assert await store.delete_session(left.id, user_id="u")
    assert await stored_bytes(engram) == (0, 0)


async def test_export_gives_the_text_as_sent_and_import_stores_it_as_words_again(
    engram: Engram, http: aiohttp.ClientSession, tmp_path: Any
) -> None:
    await post(http, engram, "/v1/messages", claude_code("My cat is called Zorblax."))
    await settle(engram)
    lines = []
    async with http.get(engram.url + "/engram/api/export", headers={"X-Engram-User": "u"}) as r:
        assert r.status == 200
        lines = [json.loads(x) for x in (await r.text()).splitlines() if x.strip()]
    texts = [x["content"] for x in lines if x.get("type") == "turn"]
    assert any(t.startswith(REMINDER) for t in texts)
    assert any(AGENT_LIST in t for t in texts)
    # Into another user: the same words and the scaffolding once.
    for x in lines:
        x["user"] = "v"
    dump = tmp_path / "dump.jsonl"
    dump.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    from proxy.cli.importer import import_records

    store = engram.app[SERVICES].store
    records = enumerate((json.loads(x) for x in dump.read_text().splitlines()), start=1)
    report = await import_records(store, None, records, 64)
    assert report.imported == len(texts)
    [session] = await store.list_sessions("v")
    turns = await store.session_turns(session.id)
    assert [t.content for t in turns if t.role == "user"] == ["My cat is called Zorblax."]
    again = await turns_as_sent(engram, session.id)
    assert [t.content for t in again] == texts


# --- housekeeping ---------------------------------------------------------------------------


async def test_opencodes_title_request_stays_out_of_its_session(
    engram: Engram, big: FakeUpstream, http: aiohttp.ClientSession
) -> None:
    """opencode sends its title request with the conversation's own x-session-id: forwarded
    as sent (its instruction kept), no memories, nothing archived (before: 7 turns a session,
    the fact stored twice)."""
    await post(
        http,
        engram,
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "My sister lives in Porto."}]},
    )
    await settle(engram)
    title = {
        "model": "m",
        "max_tokens": 32000,
        "messages": [
            {
                "role": "system",
                "content": "You are a title generator. You output ONLY a thread "
                "title. Nothing else.",
            },
            {"role": "user", "content": "Generate a title for this conversation:\n"},
            {"role": "user", "content": '"Where does my sister live?"'},
        ],
    }
    raw = json.dumps(title).encode()
    headers = {"X-Engram-User": "u", "X-Session-Id": "ses_x", "Content-Type": "application/json"}
    async with http.post(engram.url + "/v1/chat/completions", data=raw, headers=headers) as r:
        assert r.status == 200
        assert r.headers["X-Engram-Memories"] == "0"
    assert big.chat_requests()[-1].body == raw
    turn = {
        "model": "m",
        "max_tokens": 32000,
        "messages": [
            {"role": "system", "content": "You are opencode."},
            {"role": "user", "content": '"Where does my sister live?"'},
        ],
    }
    await post(http, engram, "/v1/chat/completions", turn, **{"X-Session-Id": "ses_x"})
    await settle(engram)
    store = engram.app[SERVICES].store
    session = await store.read(
        lambda c: c.execute("SELECT id FROM sessions WHERE name = 'ses_x'").fetchone()
    )
    turns = await store.session_turns(str(session[0]))
    assert [t.role for t in turns] == ["system", "user", "assistant"]
    assert not any("title" in t.content for t in turns)
