"""The real coding agents through Engram, in front of the fake upstream (issue 22): each test one
row of what Claude Code, Codex, opencode, Qwen Code and aider showed, run as their users run them
(``claude -p``, ``codex exec``, ``opencode run``, ``qwen "…"``, ``aider --message``, a fact told in
one run and asked in a new one, ``--continue``).

- A fact told in one run is recalled in a new one, and nothing of the clients' scaffolding
  (system prompts, agent lists, ``<system-reminder>``, ``<environment_context>``) is recalled, or
  stored again per session (stored once per user).
- A multi-turn ``--continue`` keeps every message the client sent; a request with 32,000
  ``max_tokens`` still gets memories; tool definitions are counted (a request that fits
  without Engram fits with it, the fake enforcing its context with tools rendered).
- opencode's title request carries the conversation's session id: it is forwarded as sent and
  not archived into the conversation.
- What a client sends for itself — Qwen Code's memory extraction after each turn, aider's
  example conversation in every request, its history summary and commit message requests — is
  not archived as the user's words and gets no memories (issue 38).

The clients talk to a :class:`~testing.traffic.RecordingRelay` in front of Engram; with
``ENGRAM_RECORD_TRAFFIC=1`` what they sent is saved in ``tests/data/clients/`` (``via: engram``).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from proxy.chat.turn import ChatTurn
from proxy.messages import content_text
from proxy.services import SERVICES
from testing.agents import (
    Agents,
    make_home,
    run_aider,
    run_claude,
    run_codex,
    run_opencode,
    run_qwen,
)
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, forwarded_memory, settle, start_engram
from testing.traffic import RecordingRelay
from tests.agents.conftest import Record

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


@pytest_asyncio.fixture
async def relay(engram: Engram) -> AsyncIterator[RecordingRelay]:
    """In front of Engram: records what the client sent, and Engram's answer headers."""
    r = RecordingRelay(engram.url)
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


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
    block = "\n".join(re.findall(r"<memory-(\w+)>.*?</memory-\1>", text, re.S))
    assert block or "<memory" not in text
    for mark in ("Attribution", "environment_context", "Primary working directory", "agent"):
        assert mark not in block, (mark, block[:2000])


def assert_words_only(rows: list[tuple[str, str, str]]) -> None:
    for _, role, content in rows:
        for mark in SCAFFOLD_MARKS:
            assert mark not in content, (role, content[:300])


# ---- Claude Code -------------------------------------------------------------------------------


async def test_claude_code_recalls_a_fact_and_never_its_scaffolding(
    agents: Agents,
    engram: Engram,
    relay: RecordingRelay,
    record: Record,
    big: FakeUpstream,
    tmp_path: Path,
    work: Path,
) -> None:
    rec = record("claude", agents.versions["claude"], "engram", relay)
    home = make_home(relay.url, MODEL, parent=tmp_path)
    rec.run("new: the fact")
    run = await run_claude(relay.url, FACT, home=home, cwd=work, model=MODEL, agents=agents)
    assert run.ok, run.report()
    await settle(engram)
    one_session = await scaffold_bytes(engram)
    rec.run("new: the question")
    run = await run_claude(relay.url, QUESTION, home=home, cwd=work, model=MODEL, agents=agents)
    assert run.ok, run.report()
    assert memories(engram.turns[-1]) >= 1
    recalled = forwarded_memory(sent(big, "/v1/messages")[-1]["messages"])
    assert "Zorblax" in recalled
    assert_no_scaffolding_recalled(recalled)
    # --continue: every message Claude Code sent reaches the model.
    rec.run("continue")
    run = await run_claude(
        relay.url, "And what colour is she?", home=home, cwd=work, model=MODEL,
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
    agents: Agents,
    engram: Engram,
    relay: RecordingRelay,
    record: Record,
    big: FakeUpstream,
    tmp_path: Path,
) -> None:
    rec = record("codex", agents.versions["codex"], "engram", relay)
    old, new = tmp_path / "old-project", tmp_path / "new-project"
    old.mkdir()
    new.mkdir()
    home = make_home(relay.url, MODEL, parent=tmp_path)
    rec.run("new: the fact")
    run = await run_codex(relay.url, FACT, home=home, cwd=old, model=MODEL, agents=agents)
    assert run.ok, run.report()
    await settle(engram)
    rec.run("new: the question")
    run = await run_codex(relay.url, QUESTION, home=home, cwd=new, model=MODEL, agents=agents)
    assert run.ok, run.report()
    assert memories(engram.turns[-1]) >= 1
    body = json.dumps(sent(big, "/v1/responses")[-1])
    assert "Zorblax" in body
    assert str(new) in body and str(old) not in body  # the current environment, not the old
    assert_no_scaffolding_recalled(body)
    rec.run("resume")
    run = await run_codex(
        relay.url, "And her colour?", home=home, cwd=new, model=MODEL, resume=True,
        agents=agents,
    )  # fmt: skip
    assert run.ok, run.report()
    last = json.dumps(sent(big, "/v1/responses")[-1])
    assert QUESTION in last and "And her colour?" in last
    assert_words_only(await stored(engram))


# ---- opencode ----------------------------------------------------------------------------------


async def test_opencode_gets_memories_keeps_its_history_and_its_titles_stay_out(
    agents: Agents,
    engram: Engram,
    relay: RecordingRelay,
    record: Record,
    big: FakeUpstream,
    tmp_path: Path,
    work: Path,
) -> None:
    rec = record("opencode", agents.versions["opencode"], "engram", relay)
    home = make_home(relay.url, MODEL, parent=tmp_path)
    rec.run("new: the fact")
    run = await run_opencode(relay.url, FACT, home=home, cwd=work, model=MODEL, agents=agents)
    assert run.ok, run.report()
    await settle(engram)
    chats = sent(big, "/v1/chat/completions")
    assert chats and all(c.get("max_tokens") == 32000 for c in chats)
    # A new session asks: max_tokens 32,000 and still memories.
    other = tmp_path / "other"
    other.mkdir()
    rec.run("new: the question")
    run = await run_opencode(relay.url, QUESTION, home=home, cwd=other, model=MODEL, agents=agents)
    assert run.ok, run.report()
    turn = next(t for t in reversed(engram.turns) if "title generator" not in json.dumps(
        t.conv.messages[:1]))  # fmt: skip
    assert memories(turn) >= 1
    assert "Zorblax" in json.dumps(turn.forwarded)
    # Two continues: every message opencode sends is forwarded.
    for prompt in ("She likes boxes.", "What does she like?"):
        rec.run("continue")
        run = await run_opencode(
            relay.url, prompt, home=home, cwd=other, model=MODEL, continue_=True,
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


# ---- Qwen Code ---------------------------------------------------------------------------------

QWEN_MEMORY = "You are now acting as the managed memory extraction subagent"


def typed(last: str) -> str:
    """What the user typed, from the last user message's text: after the reminders Qwen Code
    puts before it, before the instructions aider puts after it."""
    return last.rsplit("</system-reminder>", 1)[-1].strip().split("\n\n", 1)[0]


def system_of(turn: ChatTurn) -> str:
    first = turn.conv.messages[0] if turn.conv.messages else {}
    return content_text(first.get("content")) if first.get("role") == "system" else ""


def sessions_of(rows: list[tuple[str, str, str]]) -> dict[str, list[str]]:
    """Each stored session's roles, in order."""
    out: dict[str, list[str]] = {}
    for s, role, _ in rows:
        out.setdefault(s, []).append(role)
    return out


def session_holding(rows: list[tuple[str, str, str]], words: str) -> str:
    return next(s for s, role, content in rows if role == "user" and words in content)


def assert_untouched(turns: list[ChatTurn]) -> None:
    """Forwarded exactly as sent, with no memories."""
    assert turns
    for t in turns:
        assert t.forwarded is None and memories(t) == 0, (t.response_headers, system_of(t)[:80])


async def test_qwen_code_recalls_a_fact_keeps_its_history_and_its_memory_extraction_stays_out(
    agents: Agents,
    engram: Engram,
    relay: RecordingRelay,
    record: Record,
    big: FakeUpstream,
    tmp_path: Path,
    work: Path,
) -> None:
    """Every run first (the traffic recorded whole), then what Engram made of it."""
    big.reply_text = lambda last: f"echo: {typed(last)}"
    rec = record("qwen", agents.versions["qwen"], "engram", relay)
    home = make_home(relay.url, MODEL, parent=tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    runs = [
        ("new: the fact", FACT, work, False),
        ("new: the question", QUESTION, other, False),
        ("continue", "And what colour is she?", other, True),
    ]
    own: list[ChatTurn] = []  # each run's last turn that is not its memory extraction
    for label, prompt, cwd, continue_ in runs:
        rec.run(label)
        run = await run_qwen(
            relay.url, prompt, home=home, cwd=cwd, model=MODEL, continue_=continue_,
            agents=agents,
        )  # fmt: skip
        assert run.ok, run.report()
        await settle(engram)
        own.append([t for t in engram.turns if not system_of(t).startswith(QWEN_MEMORY)][-1])
    # The question, in a new conversation: the fact recalled, nothing of Qwen Code's own.
    asked = own[1]
    assert QUESTION in json.dumps(asked.conv.messages[-1])
    assert memories(asked) >= 1, asked.response_headers
    recalled = forwarded_memory(asked.forwarded or [])
    assert "Zorblax" in recalled
    assert_no_scaffolding_recalled(recalled)
    assert "Managed memory" not in recalled
    # --continue: every message Qwen Code sent is forwarded.
    turn = own[2]
    forwarded = turn.forwarded if turn.forwarded is not None else turn.conv.messages
    assert [m["role"] for m in forwarded] == [m["role"] for m in turn.conv.messages]
    # Its memory extraction after each turn (the conversation, then its instruction as the
    # user's message): forwarded as sent, no memories, not archived.
    extractions = [t for t in engram.turns if system_of(t).startswith(QWEN_MEMORY)]
    assert len(extractions) == 3
    assert_untouched(extractions)
    rows = await stored(engram)
    assert_words_only(rows)
    for _, _, content in rows:
        assert "Managed memory has TWO directories" not in content
        assert QWEN_MEMORY not in content
    assert sum(FACT in c for _, r, c in rows if r == "user") == 1
    # Two conversations: the fact's, and the question's continued (--continue resends the first
    # user message without its date reminder: found by what was said, proxy.said), each its
    # system message and then every message once.
    assert session_holding(rows, QUESTION) == session_holding(rows, "And what colour is she?")
    assert sorted(sessions_of(rows).values()) == [
        ["system", "user", "assistant"],
        ["system", "user", "assistant", "user", "assistant"],
    ]


# ---- aider -------------------------------------------------------------------------------------

AIDER_SUMMARY = "*Briefly* summarize this partial conversation about programming."
AIDER_COMMIT = "You are an expert software engineer that generates concise, one-line Git commit"
# What aider writes in the user's place (and the replies to it): its example conversation (every
# request), the
# instructions after each message, the hand-over of a summarized history, its repository map
# and the files it added.
AIDER_OWN = (
    "Change the greeting to be more casual",
    "Switch the greeting text from",  # the example's reply
    "I switched to a new code base",
    "I am not sharing any files that you can edit yet",
    "To suggest changes to a file you MUST return",
    "I spoke to you previously about a number of things",
    "Here are summaries of some files present in my git repository",
    "I have *added these files to the chat*",
    "Don't try and edit any existing code without asking me",
)


def assert_nothing_of_aiders_own(text: str) -> None:
    for mark in (*AIDER_OWN, AIDER_SUMMARY, AIDER_COMMIT):
        assert mark not in text, (mark, text[:2000])


async def test_aider_recalls_a_fact_keeps_its_history_and_its_own_words_stay_out(
    agents: Agents,
    engram: Engram,
    relay: RecordingRelay,
    record: Record,
    big: FakeUpstream,
    tmp_path: Path,
    work: Path,
) -> None:
    """Every run first (the traffic recorded whole), then what Engram made of it."""
    big.reply_text = lambda last: f"echo: {typed(last)}"
    rec = record("aider", agents.versions["aider"], "engram", relay)
    home = make_home(relay.url, MODEL, parent=tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    # The last run's history is past --max-chat-history-tokens: aider summarizes it first.
    summarize = ["--max-chat-history-tokens", "20"]
    runs = [
        ("new: the fact", FACT, work, False, []),
        ("new: the question", QUESTION, other, False, []),
        ("continue", "And what colour is she?", other, True, []),
        ("continue, history summarized", "She likes boxes.", other, True, summarize),
    ]
    firsts: list[int] = []  # each run's first turn
    for label, prompt, cwd, continue_, extra in runs:
        rec.run(label)
        firsts.append(len(engram.turns))
        run = await run_aider(
            relay.url, prompt, home=home, cwd=cwd, model=MODEL, continue_=continue_,
            extra=extra, agents=agents,
        )  # fmt: skip
        assert run.ok, run.report()
        await settle(engram)
    # The question, in a new chat: the fact recalled, nothing of aider's own.
    asked = engram.turns[firsts[1]]
    assert memories(asked) >= 1, asked.response_headers
    recalled = forwarded_memory(asked.forwarded or [])
    assert "Zorblax" in recalled
    assert_nothing_of_aiders_own(recalled)
    # --restore-chat-history: every message aider sent is forwarded.
    turn = engram.turns[firsts[2]]
    forwarded = turn.forwarded if turn.forwarded is not None else turn.conv.messages
    assert [m["role"] for m in forwarded] == [m["role"] for m in turn.conv.messages]
    # Its summary of the history: left alone.
    summaries = [t for t in engram.turns[firsts[3] :] if system_of(t).startswith(AIDER_SUMMARY)]
    assert len(summaries) == 1
    assert_untouched(summaries)
    rows = await stored(engram)
    for _, _, content in rows:
        assert_nothing_of_aiders_own(content)
    assert sum(FACT in c for _, r, c in rows if r == "user") == 1
    # The question's chat, continued from its history file (no instructions, replies re-wrapped:
    # found by what was said, proxy.said), is one conversation, each message stored once.
    asked = session_holding(rows, QUESTION)
    assert asked == session_holding(rows, "And what colour is she?")
    assert sum(QUESTION in c for s, r, c in rows if s == asked and r == "user") == 1


def git(repo: Path, *args: str) -> str:
    config = ["-c", "user.name=t", "-c", "user.email=t@t.invalid"]
    done = subprocess.run(["git", *config, *args], cwd=repo, check=True, capture_output=True)
    return done.stdout.decode()


@pytest.fixture
def repo(work: Path) -> Path:
    """A git repository with one committed file."""
    (work / "hello.py").write_text("def greet(name):\n    return 'hi ' + name\n")
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        git(work, *args)
    return work


EDIT = "Renamed.\n\nhello.py\n```\ndef salute(name):\n    return 'hi ' + name\n```\n"


async def test_aiders_commit_messages_and_repository_map_stay_out(
    agents: Agents,
    engram: Engram,
    relay: RecordingRelay,
    record: Record,
    big: FakeUpstream,
    tmp_path: Path,
    repo: Path,
) -> None:
    """In a git repository: its repository map in every request, and the commit message it
    asks for after applying an edit (the request and the diff quoted): neither is archived
    as the user's words or recalled; the commit message request gets no memories."""

    def reply(last: str) -> str:
        said = typed(last)
        return EDIT if said.startswith("Rename greet") else f"echo: {said}"

    big.reply_text = reply
    rec = record("aider", agents.versions["aider"], "engram-git", relay)
    home = make_home(relay.url, MODEL, parent=tmp_path)
    rec.run("new: edit and commit")
    run = await run_aider(
        relay.url, "Rename greet to salute in hello.py, my favourite file.", home=home,
        cwd=repo, model=MODEL, git=True, agents=agents,
    )  # fmt: skip
    assert run.ok, run.report()
    assert "def salute" in (repo / "hello.py").read_text(), run.report()
    await settle(engram)
    rec.run("new: a question")
    run = await run_aider(
        relay.url, "Which file is my favourite?", home=home, cwd=repo, model=MODEL, git=True,
        agents=agents,
    )  # fmt: skip
    assert run.ok, run.report()
    await settle(engram)
    commits = [t for t in engram.turns if system_of(t).startswith(AIDER_COMMIT)]
    assert len(commits) == 1
    assert_untouched(commits)
    asked = engram.turns[-1]
    assert memories(asked) >= 1, asked.response_headers
    recalled = forwarded_memory(asked.forwarded or [])
    assert "favourite file" in recalled
    assert_nothing_of_aiders_own(recalled)
    assert "+def salute" not in recalled
    rows = await stored(engram)
    for _, _, content in rows:
        assert_nothing_of_aiders_own(content)
    assert git(repo, "log", "--format=%s").splitlines()[0].startswith("echo:")
