"""The real coding agents through Engram, in front of the fake upstream (issue 22): each test one
row of what Claude Code, Codex and opencode showed, run as their users run them (``claude -p``,
``codex exec``, ``opencode run``, a fact told in one run and asked in a new one, ``--continue``).

- A fact told in one run is recalled in a new one, and nothing of the clients' scaffolding
  (system prompts, agent lists, ``<system-reminder>``, ``<environment_context>``) is recalled, or
  stored again per session (stored once per user).
- A multi-turn ``--continue`` keeps every message the client sent; a request with 32,000
  ``max_tokens`` still gets memories; tool definitions are counted (a request that fits
  without Engram fits with it, the fake enforcing its context with tools rendered).
- opencode's title request carries the conversation's session id: it is forwarded as sent and
  not archived into the conversation.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from proxy.chat.turn import ChatTurn
from proxy.services import SERVICES
from testing.agents import Agents, make_home, run_claude, run_codex, run_opencode
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, forwarded_memory, settle, start_engram

pytestmark = pytest.mark.asyncio

MODEL = "smollm2"
FACT = "My cat is called Zorblax and she is orange."
QUESTION = "What is my cat called?"
SCAFFOLD_MARKS = ("<system-reminder>", "<environment_context>", "# Environment", "Generate a title")


@pytest.fixture
def work(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


def model_like(fake: FakeUpstream) -> FakeUpstream:
    """The fake answers as a model would, with the question's words (its plain echo would
    repeat the reminders the clients put before the question)."""
    fake.reply_text = lambda last: "echo: " + (last.strip().splitlines() or [""])[-1]
    return fake


@pytest_asyncio.fixture
async def big() -> AsyncIterator[FakeUpstream]:
    """A model server with room for the agents' prompts and memories (64k tokens)."""
    async with FakeUpstream(n_ctx=65536, model=MODEL) as fake:
        yield model_like(fake)


@pytest_asyncio.fixture
async def engram(big: FakeUpstream) -> AsyncIterator[Engram]:
    e = await start_engram(big.url)
    try:
        yield e
    finally:
        await e.close()


def memories(turn: ChatTurn) -> int:
    return int(turn.response_headers.get("X-Engram-Memories", "0").split(";")[0])


async def stored(engram: Engram) -> list[tuple[str, str, str]]:
    """(session, role, content) of every stored turn, every user's."""
    await settle(engram)
    rows = await engram.app[SERVICES].store.read(
        lambda c: c.execute("SELECT session_id, role, content FROM turns ORDER BY id").fetchall()
    )
    return [(str(s), str(r), str(t)) for s, r, t in rows]


async def scaffold_bytes(engram: Engram) -> int:
    (n,) = await engram.app[SERVICES].store.read(
        lambda c: c.execute("SELECT coalesce(sum(length(content)), 0) FROM scaffolds").fetchone()
    )
    return int(n)


def sent(fake: FakeUpstream, path: str) -> list[dict[str, Any]]:
    return [json.loads(r.body) for r in fake.requests if r.path == path]


def assert_no_scaffolding_recalled(text: str) -> None:
    """No memory block in ``text`` (a body, or blocks) holds an agent's scaffolding."""
    block = "\n".join(re.findall(r"<engram-memory-(\w+)>.*?</engram-memory-\1>", text, re.S))
    assert block or "<engram-memory" not in text
    for mark in ("Attribution", "environment_context", "Primary working directory", "agent"):
        assert mark not in block, (mark, block[:2000])


def assert_words_only(rows: list[tuple[str, str, str]]) -> None:
    for _, role, content in rows:
        for mark in SCAFFOLD_MARKS:
            assert mark not in content, (role, content[:300])


# ---- Claude Code -------------------------------------------------------------------------------


async def test_claude_code_recalls_a_fact_and_never_its_scaffolding(
    agents: Agents, engram: Engram, big: FakeUpstream, tmp_path: Path, work: Path
) -> None:
    home = make_home(engram.url, MODEL, parent=tmp_path)
    run = await run_claude(engram.url, FACT, home=home, cwd=work, model=MODEL, agents=agents)
    assert run.ok, run.report()
    await settle(engram)
    one_session = await scaffold_bytes(engram)
    run = await run_claude(engram.url, QUESTION, home=home, cwd=work, model=MODEL, agents=agents)
    assert run.ok, run.report()
    assert memories(engram.turns[-1]) >= 1
    recalled = forwarded_memory(sent(big, "/v1/messages")[-1]["messages"])
    assert "Zorblax" in recalled
    assert_no_scaffolding_recalled(recalled)
    # --continue: every message Claude Code sent reaches the model.
    run = await run_claude(
        engram.url, "And what colour is she?", home=home, cwd=work, model=MODEL,
        continue_=True, agents=agents,
    )  # fmt: skip
    assert run.ok, run.report()
    turn = engram.turns[-1]
    forwarded = turn.forwarded if turn.forwarded is not None else turn.conv.messages
    texts = json.dumps(forwarded)
    for m in turn.conv.messages:
        for part in m.get("content") if isinstance(m.get("content"), list) else [m]:
            text = part.get("text") if isinstance(part, dict) else None
            assert text is None or json.dumps(text)[1:-1] in texts
    rows = await stored(engram)
    assert_words_only(rows)
    # Three runs, two sessions: the system prompt and agent list are stored once.
    assert len({s for s, _, _ in rows}) == 2
    assert await scaffold_bytes(engram) < one_session + 2000


async def test_claude_codes_tools_are_counted_so_what_fits_directly_fits_through_engram(
    agents: Agents, tmp_path: Path, work: Path
) -> None:
    """Claude Code's ~12,000-token request (8,000 of them tools) against a model server whose
    context it fills to the brim, tools rendered: directly it fits, and through Engram, with a
    memory to offer, it still does (before: the memories went on top, and the server's 400)."""
    async with FakeUpstream(n_ctx=65536, model=MODEL) as probe:
        home = make_home(probe.url, MODEL, parent=tmp_path)
        run = await run_claude(probe.url, QUESTION, home=home, cwd=work, model=MODEL, agents=agents)
        assert run.ok, run.report()
        size = probe.last_prompt_tokens
    async with FakeUpstream(n_ctx=size + 40, enforce_ctx=True, model=MODEL) as fake:
        model_like(fake)
        home = make_home(fake.url, MODEL, parent=tmp_path)
        direct = await run_claude(
            fake.url, QUESTION, home=home, cwd=work, model=MODEL, agents=agents
        )
        assert direct.ok and "echo:" in direct.stdout, direct.report()
        engram = await start_engram(fake.url)
        try:
            for prompt in (FACT, QUESTION):
                home = make_home(engram.url, MODEL, parent=tmp_path)  # a new conversation each
                run = await run_claude(
                    engram.url, prompt, home=home, cwd=work, model=MODEL, agents=agents
                )
                assert run.ok and "echo:" in run.stdout, run.report()
                await settle(engram)
            assert all(t.status == 200 for t in engram.turns)
        finally:
            await engram.close()


# ---- Codex -------------------------------------------------------------------------------------


async def test_codex_keeps_its_current_environment_and_recalls_the_fact(
    agents: Agents, engram: Engram, big: FakeUpstream, tmp_path: Path
) -> None:
    old, new = tmp_path / "old-project", tmp_path / "new-project"
    old.mkdir()
    new.mkdir()
    home = make_home(engram.url, MODEL, parent=tmp_path)
    run = await run_codex(engram.url, FACT, home=home, cwd=old, model=MODEL, agents=agents)
    assert run.ok, run.report()
    await settle(engram)
    run = await run_codex(engram.url, QUESTION, home=home, cwd=new, model=MODEL, agents=agents)
    assert run.ok, run.report()
    assert memories(engram.turns[-1]) >= 1
    body = json.dumps(sent(big, "/v1/responses")[-1])
    assert "Zorblax" in body
    assert str(new) in body and str(old) not in body  # the current environment, not the old
    assert_no_scaffolding_recalled(body)
    run = await run_codex(
        engram.url, "And her colour?", home=home, cwd=new, model=MODEL, resume=True,
        agents=agents,
    )  # fmt: skip
    assert run.ok, run.report()
    last = json.dumps(sent(big, "/v1/responses")[-1])
    assert QUESTION in last and "And her colour?" in last
    assert_words_only(await stored(engram))


# ---- opencode ----------------------------------------------------------------------------------


async def test_opencode_gets_memories_keeps_its_history_and_its_titles_stay_out(
    agents: Agents, engram: Engram, big: FakeUpstream, tmp_path: Path, work: Path
) -> None:
    home = make_home(engram.url, MODEL, parent=tmp_path)
    run = await run_opencode(engram.url, FACT, home=home, cwd=work, model=MODEL, agents=agents)
    assert run.ok, run.report()
    await settle(engram)
    chats = sent(big, "/v1/chat/completions")
    assert chats and all(c.get("max_tokens") == 32000 for c in chats)
    # A new session asks: max_tokens 32,000 and still memories.
    other = tmp_path / "other"
    other.mkdir()
    run = await run_opencode(engram.url, QUESTION, home=home, cwd=other, model=MODEL, agents=agents)
    assert run.ok, run.report()
    turn = next(t for t in reversed(engram.turns) if "title generator" not in json.dumps(
        t.conv.messages[:1]))  # fmt: skip
    assert memories(turn) >= 1
    assert "Zorblax" in json.dumps(turn.forwarded)
    # Two continues: every message opencode sends is forwarded.
    for prompt in ("She likes boxes.", "What does she like?"):
        run = await run_opencode(
            engram.url, prompt, home=home, cwd=other, model=MODEL, continue_=True,
            agents=agents,
        )  # fmt: skip
        assert run.ok, run.report()
    turn = engram.turns[-1]
    forwarded = turn.forwarded if turn.forwarded is not None else turn.conv.messages
    assert len(forwarded) == len(turn.conv.messages)
    assert [m["role"] for m in forwarded] == [m["role"] for m in turn.conv.messages]
    # Titles: forwarded as sent, not archived; the fact stored once.
    titles = [t for t in engram.turns if "Generate a title" in json.dumps(t.conv.messages)]
    assert titles and all(t.forwarded is None and memories(t) == 0 for t in titles)
    rows = await stored(engram)
    assert_words_only(rows)
    assert sum(FACT in c for _, r, c in rows if r == "user") == 1
    per_session: dict[str, list[str]] = {}
    for s, role, _ in rows:
        per_session.setdefault(s, []).append(role)
    assert sorted(len(v) for v in per_session.values()) == [3, 7]  # 1 + 3 runs, 3 turns each


async def test_opencode_continue_in_a_small_context_keeps_every_message(
    agents: Agents, tmp_path: Path, work: Path
) -> None:
    """The row as seen: an 8,192-token context, opencode's 32,000 max_tokens: the third
    ``--continue`` was forwarded as one message. Its 20 KB of tools leave Engram no room now,
    so it goes exactly as opencode sent it."""
    async with FakeUpstream(n_ctx=8192, model=MODEL) as fake:
        model_like(fake)
        engram = await start_engram(fake.url)
        try:
            home = make_home(engram.url, MODEL, parent=tmp_path)
            for i, prompt in enumerate((FACT, "She likes boxes.", "What is she called?")):
                run = await run_opencode(
                    engram.url, prompt, home=home, cwd=work, model=MODEL, continue_=i > 0,
                    agents=agents,
                )  # fmt: skip
                assert run.ok, run.report()
            turn = engram.turns[-1]
            assert turn.forwarded is None  # as sent
            assert fake.chat_requests()[-1].body == turn.raw
            assert len(turn.conv.messages) == 6  # system + three user turns and two replies
        finally:
            await engram.close()
