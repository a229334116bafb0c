"""The real coding agents against the fake upstream directly (no Engram): the harness of
``testing.agents`` works before Engram is put between them.

Each client sends its own API to its path (Claude Code ``POST /v1/messages?beta=true``, Codex
``POST /v1/responses``, opencode ``POST /v1/chat/completions`` with a title request first, Qwen
Code chat completions with a memory-extraction request after each turn, aider chat completions
with its example conversation first, a commit message request after an edit in a git repository
and a summary of a long history), streams, prints the fake's echo of the prompt, sends the
earlier turn back when told to continue (``--continue``, ``exec resume --last``,
``--restore-chat-history``), and tries to reach nothing outside loopback. The limits given to
Claude Code, opencode and Qwen Code become their ``max_tokens``. The harness itself: the
refusing proxy records what tries to go out while loopback bypasses it, and a run past its
timeout has its whole process group killed and reports what it printed.

With ``ENGRAM_RECORD_TRAFFIC=1`` each client's requests are saved in
``tests/data/clients/<client>-<version>.jsonl`` (:mod:`testing.traffic`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from testing.agents import (
    Agents,
    Limits,
    make_home,
    run_aider,
    run_claude,
    run_codex,
    run_isolated,
    run_opencode,
    run_qwen,
)
from testing.fake_upstream import FakeUpstream, RecordedRequest
from tests.agents.conftest import Record

pytestmark = pytest.mark.asyncio

MODEL = "fake-model"
LIMITS = Limits(context=64_000, output=1024)  # Claude Code's own prompt is ~12k tokens
TITLE = "Generate a title for this conversation:"


@pytest.fixture
def work(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


@pytest.fixture
def home(tmp_path: Path, fake: FakeUpstream) -> Path:
    return make_home(fake.url, MODEL, parent=tmp_path)


def calls(fake: FakeUpstream) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in fake.requests]


def user_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The text of each user message (string content, or its text / input_text parts)."""
    out = []
    for m in messages:
        if m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append(str(content))
    return out


def assistant_texts(messages: list[dict[str, Any]]) -> list[str]:
    out = []
    for m in messages:
        if m.get("role") == "assistant":
            content = m.get("content")
            out.append(content if isinstance(content, str) else json.dumps(content))
    return out


# ---- Claude Code: Anthropic Messages ----------------------------------------------------------


async def test_claude_code(
    fake: FakeUpstream, agents: Agents, home: Path, work: Path, record: Record
) -> None:
    rec = record("claude", agents.versions["claude"], "direct", fake)
    rec.run("new")
    first = await run_claude(
        fake.url, "remember the pineapple", home=home, cwd=work, model=MODEL, agents=agents
    )
    assert first.ok, first.report()
    assert "echo:" in first.stdout and "remember the pineapple" in first.stdout, first.report()
    assert first.outside == []
    assert calls(fake) and set(calls(fake)) == {("POST", "/v1/messages")}, calls(fake)
    turn: RecordedRequest = fake.requests[-1]
    body = turn.json()
    assert turn.query_string == "beta=true"
    assert turn.headers["x-api-key"] == "sk-test"
    assert turn.headers["anthropic-version"] == "2023-06-01"
    assert turn.headers["User-Agent"].startswith(f"claude-cli/{agents.versions['claude']}")
    assert body["stream"] is True and body["model"] == MODEL and body["max_tokens"] == 32000
    assert body["tools"] and body["system"]
    assert user_texts(body["messages"])[-1].endswith("remember the pineapple")

    seen = len(fake.requests)
    rec.run("continue")
    second = await run_claude(
        fake.url,
        "which fruit?",
        home=home,
        cwd=work,
        model=MODEL,
        continue_=True,
        limits=LIMITS,
        agents=agents,
    )
    assert second.ok, second.report()
    assert "echo: which fruit?" in second.stdout, second.report()
    assert second.outside == []
    body = fake.requests[-1].json()
    assert len(fake.requests) > seen and body["max_tokens"] == LIMITS.output
    said = user_texts(body["messages"])
    assert said[0].endswith("remember the pineapple") and said[-1] == "which fruit?"
    assert any("remember the pineapple" in a for a in assistant_texts(body["messages"]))


# ---- Codex: OpenAI Responses ---------------------------------------------------------------------


async def test_codex(
    fake: FakeUpstream, agents: Agents, home: Path, work: Path, record: Record
) -> None:
    rec = record("codex", agents.versions["codex"], "direct", fake)
    rec.run("new")
    first = await run_codex(
        fake.url, "remember the pineapple", home=home, cwd=work, model=MODEL, agents=agents
    )
    assert first.ok, first.report()
    assert first.stdout.strip() == "echo: remember the pineapple", first.report()
    assert first.outside == []
    assert calls(fake) and set(calls(fake)) == {("POST", "/v1/responses")}, calls(fake)
    turn = fake.requests[-1]
    body = turn.json()
    assert turn.headers["Authorization"] == "Bearer sk-test"
    assert turn.headers["User-Agent"].startswith(f"codex_exec/{agents.versions['codex']}")
    assert body["stream"] is True and body["model"] == MODEL and body["tools"]
    assert user_texts(body["input"])[-1] == "remember the pineapple"

    rec.run("resume")
    second = await run_codex(
        fake.url, "which fruit?", home=home, cwd=work, model=MODEL, resume=True, agents=agents
    )
    assert second.ok, second.report()
    assert second.stdout.strip() == "echo: which fruit?", second.report()
    assert second.outside == []
    items = fake.requests[-1].json()["input"]
    assert user_texts(items)[-2:] == ["remember the pineapple", "which fruit?"]
    assert any("echo: remember the pineapple" in a for a in assistant_texts(items))


# ---- opencode: OpenAI chat completions -----------------------------------------------------------


async def test_opencode(
    fake: FakeUpstream, agents: Agents, home: Path, work: Path, record: Record
) -> None:
    prompt = 'remember the "pineapple"\nplease'  # quotes and a newline arrive as typed
    rec = record("opencode", agents.versions["opencode"], "direct", fake)
    rec.run("new")
    first = await run_opencode(fake.url, prompt, home=home, cwd=work, model=MODEL, agents=agents)
    assert first.ok, first.report()
    assert first.stdout.strip() == f"echo: {prompt}", first.report()
    assert first.outside == []
    assert calls(fake) and set(calls(fake)) == {("POST", "/v1/chat/completions")}, calls(fake)
    bodies = [r.json() for r in fake.requests]
    titles = [b for b in bodies if TITLE in "".join(user_texts(b["messages"]))]
    turns = [b for b in bodies if b not in titles]
    assert len(titles) == 1 and len(turns) == 1, bodies
    assert user_texts(titles[0]["messages"])[-1] == prompt and not titles[0].get("tools")
    turn = turns[0]
    assert turn["stream"] is True and turn["model"] == MODEL and turn["max_tokens"] == 32000
    assert turn["tools"] and user_texts(turn["messages"]) == [prompt]
    headers = fake.requests[-1].headers
    assert headers["Authorization"] == "Bearer sk-test"
    assert headers["User-Agent"].startswith(f"opencode/{agents.versions['opencode']}")

    seen = len(fake.requests)
    rec.run("continue")
    second = await run_opencode(
        fake.url,
        "which fruit?",
        home=home,
        cwd=work,
        model=MODEL,
        continue_=True,
        limits=LIMITS,
        agents=agents,
    )
    assert second.ok, second.report()
    assert second.stdout.strip() == "echo: which fruit?", second.report()
    assert second.outside == []
    body = fake.requests[-1].json()
    assert len(fake.requests) > seen and body["max_tokens"] == LIMITS.output
    assert user_texts(body["messages"]) == [prompt, "which fruit?"]
    assert assistant_texts(body["messages"]) == [f"echo: {prompt}"]


# ---- Qwen Code: OpenAI chat completions ----------------------------------------------------------

QWEN_MEMORY = "You are now acting as the managed memory extraction subagent"


def typed(last: str) -> str:
    """What the user typed, from the last user message's text: after the reminders Qwen Code
    puts before it, before the instructions aider puts after it."""
    return last.rsplit("</system-reminder>", 1)[-1].strip().split("\n\n", 1)[0]


def system_text(body: dict[str, Any]) -> str:
    first = body["messages"][0]
    return str(first["content"]) if first["role"] == "system" else ""


async def test_qwen_code(
    fake: FakeUpstream, agents: Agents, home: Path, work: Path, record: Record
) -> None:
    fake.reply_text = lambda last: f"echo: {typed(last)}"
    rec = record("qwen", agents.versions["qwen"], "direct", fake)
    rec.run("new")
    first = await run_qwen(
        fake.url, "remember the pineapple", home=home, cwd=work, model=MODEL, agents=agents
    )
    assert first.ok, first.report()
    assert first.stdout.strip() == "echo: remember the pineapple", first.report()
    assert first.outside == []
    assert calls(fake) and set(calls(fake)) == {("POST", "/v1/chat/completions")}, calls(fake)
    bodies = [r.json() for r in fake.requests]
    turns = [b for b in bodies if system_text(b).startswith("You are Qwen Code")]
    extractions = [b for b in bodies if system_text(b).startswith(QWEN_MEMORY)]
    assert len(turns) == 1 and len(extractions) == 1 and len(bodies) == 2, bodies
    turn = turns[0]
    assert turn["stream"] is True and turn["model"] == MODEL and turn["max_tokens"] == 32000
    assert turn["tools"] and len(turn["messages"]) == 2
    # One user message: the skills, the environment and the deferred tools as reminders, then
    # what was typed, each a text part.
    parts = turn["messages"][1]["content"]
    assert parts[-1] == {"type": "text", "text": "remember the pineapple"}
    assert all(p["text"].startswith("<system-reminder>") for p in parts[:-1])
    # The extraction: the conversation so far, then its own instruction as the user's message.
    said = user_texts(extractions[0]["messages"])
    assert said[0].endswith("remember the pineapple")
    assert said[-1].startswith("Managed memory has TWO directories")
    assert assistant_texts(extractions[0]["messages"]) == ["echo: remember the pineapple"]
    headers = fake.requests[0].headers
    assert headers["Authorization"] == "Bearer sk-test"
    assert headers["User-Agent"].startswith(f"QwenCode/{agents.versions['qwen']}")

    seen = len(fake.requests)
    rec.run("continue")
    second = await run_qwen(
        fake.url, "which fruit?", home=home, cwd=work, model=MODEL, continue_=True,
        limits=LIMITS, agents=agents,
    )  # fmt: skip
    assert second.ok, second.report()
    assert second.stdout.strip() == "echo: which fruit?", second.report()
    assert second.outside == []
    bodies = [r.json() for r in fake.requests[seen:]]
    turn = next(b for b in bodies if system_text(b).startswith("You are Qwen Code"))
    assert turn["max_tokens"] == LIMITS.output
    said = user_texts(turn["messages"])
    assert said[0].endswith("remember the pineapple") and said[-1].endswith("which fruit?")
    assert assistant_texts(turn["messages"]) == ["echo: remember the pineapple"]


# ---- aider: OpenAI chat completions, from PyPI ---------------------------------------------------

AIDER_SYSTEM = "Act as an expert software developer."
AIDER_COMMIT = "You are an expert software engineer that generates concise, one-line Git commit"
AIDER_SUMMARY = "*Briefly* summarize this partial conversation about programming."
EDIT = "Renamed.\n\nhello.py\n```\ndef salute(name):\n    return 'hi ' + name\n```\n"


async def test_aider(
    fake: FakeUpstream, agents: Agents, home: Path, work: Path, record: Record
) -> None:
    fake.reply_text = lambda last: f"echo: {typed(last)}"
    rec = record("aider", agents.versions["aider"], "direct", fake)
    rec.run("new")
    first = await run_aider(
        fake.url, "remember the pineapple", home=home, cwd=work, model=MODEL, agents=agents
    )
    assert first.ok, first.report()
    assert "echo: remember the pineapple" in first.stdout, first.report()
    assert first.outside == []
    assert calls(fake) == [("POST", "/v1/chat/completions")], calls(fake)
    turn = fake.requests[0]
    body = turn.json()
    assert body == {"model": MODEL, "messages": body["messages"], "stream": True, "temperature": 0}
    assert system_text(body).startswith(AIDER_SYSTEM)
    said = user_texts(body["messages"])
    # Its example conversation first, written as the user's and the model's turns.
    assert said[:2] == [
        "Change the greeting to be more casual",
        "I switched to a new code base. Please don't consider the above files or try to edit "
        "them any longer.",
    ]
    assert said[-2] == "I am not sharing any files that you can edit yet."
    assert said[-1].startswith("remember the pineapple\n\nTo suggest changes to a file")
    assert turn.headers["Authorization"] == "Bearer sk-test"
    assert turn.headers["User-Agent"].startswith("OpenAI/Python")  # litellm's OpenAI client

    # --restore-chat-history: the earlier turn as its markdown history file gives it back.
    rec.run("continue")
    second = await run_aider(
        fake.url, "which fruit?", home=home, cwd=work, model=MODEL, continue_=True,
        agents=agents,
    )  # fmt: skip
    assert second.ok, second.report()
    assert "echo: which fruit?" in second.stdout, second.report()
    assert second.outside == [] and len(fake.requests) == 2
    messages = fake.requests[-1].json()["messages"]
    said = user_texts(messages)
    assert "remember the pineapple  \n" in said  # not as sent: as its history file says
    assert said[-1].startswith("which fruit?\n\n")
    assert "\necho: remember the pineapple\n\n" in assistant_texts(messages)

    # A history past --max-chat-history-tokens: summarized first (not streamed), and the
    # summary then stands for the earlier turns.
    rec.run("continue, history summarized")
    third = await run_aider(
        fake.url, "and its colour?", home=home, cwd=work, model=MODEL, continue_=True,
        extra=["--max-chat-history-tokens", "20"], agents=agents,
    )  # fmt: skip
    assert third.ok, third.report()
    summary, turn3 = (r.json() for r in fake.requests[2:])
    assert system_text(summary).startswith(AIDER_SUMMARY) and "stream" not in summary
    assert user_texts(summary["messages"])[0].startswith("# USER\nremember the pineapple")
    said = user_texts(turn3["messages"])
    assert any(s.startswith("I spoke to you previously about") for s in said)
    assert not any(s.startswith("remember the pineapple") for s in said)


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


async def test_aider_in_a_git_repository(
    fake: FakeUpstream, agents: Agents, home: Path, repo: Path, record: Record
) -> None:
    """In a git repository: a repository map in every request, and a commit message request
    (not streamed, the diff in it) after it applied an edit."""

    def reply(last: str) -> str:
        return EDIT if last.startswith("rename greet") else "feat: rename greet to salute"

    fake.reply_text = reply
    rec = record("aider", agents.versions["aider"], "direct-git", fake)
    rec.run("new, edit and commit")
    run = await run_aider(
        fake.url, "rename greet to salute in hello.py", home=home, cwd=repo, model=MODEL,
        git=True, agents=agents,
    )  # fmt: skip
    assert run.ok, run.report()
    assert run.outside == []
    assert "def salute" in (repo / "hello.py").read_text(), run.report()
    assert git(repo, "log", "--format=%s").splitlines()[0] == "feat: rename greet to salute"
    turn, commit = (r.json() for r in fake.requests)
    said = user_texts(turn["messages"])
    assert any(s.startswith("Here are summaries of some files present in my git repository.")
               for s in said)  # fmt: skip
    assert any(s.startswith("I have *added these files to the chat*") for s in said)
    assert system_text(commit).startswith(AIDER_COMMIT) and "stream" not in commit
    assert "rename greet to salute in hello.py" in user_texts(commit["messages"])[0]
    assert "+def salute(name):" in user_texts(commit["messages"])[0]


# ---- the harness itself (no agents needed) -------------------------------------------------------

FETCH = """
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1] + "/health", timeout=10).status, flush=True)
urllib.request.urlopen("https://example.com/", timeout=10)
"""


async def test_outside_requests_are_refused_and_recorded(
    fake: FakeUpstream, tmp_path: Path
) -> None:
    env = {"PATH": os.environ.get("PATH", os.defpath)}
    run = await run_isolated(
        [sys.executable, "-c", FETCH, fake.url], cwd=tmp_path, env=env, timeout=60
    )
    assert run.stdout.strip() == "200", run.report()  # loopback: straight to the server
    assert ("GET", "/health") in calls(fake)
    assert run.returncode != 0 and "403" in run.stderr, run.report()
    assert run.outside == ["CONNECT example.com:443"]


async def test_timeout_kills_the_process_group(tmp_path: Path) -> None:
    script = "sleep 300 & echo $! > child; echo started; sleep 300"
    env = {"PATH": os.environ.get("PATH", os.defpath)}
    run = await run_isolated(["bash", "-c", script], cwd=tmp_path, env=env, timeout=1)
    assert run.timed_out and not run.ok and run.wall < 10
    assert run.stdout == "started\n"
    child = int((tmp_path / "child").read_text())
    for pid in (run.pid, child):  # the group's leader and the child it left in the background
        assert not alive(pid), pid


def alive(pid: int) -> bool:
    """Running (a zombie its new parent has not reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
