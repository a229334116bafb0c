"""The real coding agents against the fake upstream directly (no Engram): the harness of
``testing.agents`` works before Engram is put between them.

Each client sends its own API to its path (Claude Code ``POST /v1/messages?beta=true``, Codex
``POST /v1/responses``, opencode ``POST /v1/chat/completions`` with a title request first),
streams, prints the fake's echo of the prompt, sends the earlier turn back when told to continue
(``--continue``, ``exec resume --last``), and tries to reach nothing outside loopback. The limits
given to Claude Code and opencode become their ``max_tokens``. The harness itself: the refusing
proxy records what tries to go out while loopback bypasses it, and a run past its timeout has
its whole process group killed and reports what it printed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from testing.agents import (
    Agents,
    Limits,
    make_home,
    run_claude,
    run_codex,
    run_isolated,
    run_opencode,
)
from testing.fake_upstream import FakeUpstream, RecordedRequest

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


async def test_claude_code(fake: FakeUpstream, agents: Agents, home: Path, work: Path) -> None:
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


async def test_codex(fake: FakeUpstream, agents: Agents, home: Path, work: Path) -> None:
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


async def test_opencode(fake: FakeUpstream, agents: Agents, home: Path, work: Path) -> None:
    prompt = 'remember the "pineapple"\nplease'  # quotes and a newline arrive as typed
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
