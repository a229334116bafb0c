"""The MCP snippets of docs/mcp.md for Claude Code and Codex, run with the real clients (the
versions in
``testing/agents.pins``) against a running Engram with accounts: the client connects with the
configured bearer key, and the five tools and Engram's instructions reach the model's prompt. A
wrong key is refused with a plain 401, and Claude Code does not fall back to OAuth.
Marked ``agents``: skipped where the clients are not installed (``make agents-deps``)."""

from __future__ import annotations

import re
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from proxy.keys import new_key
from proxy.services import SERVICES
from proxy.store.keys import insert_key
from testing.agents import Agents, _base_env, claude_env, run_isolated, write_codex_config
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, start_engram

pytestmark = [pytest.mark.asyncio, pytest.mark.agents]

TOOLS = ["engram_forget", "engram_remember", "engram_search", "engram_session", "engram_sessions"]
INSTRUCTIONS = "Engram is this user's long-term memory"


@pytest_asyncio.fixture
async def keyed(fake: FakeUpstream) -> AsyncIterator[tuple[Engram, str]]:
    engram = await start_engram(fake.url, auth={"mode": "keys", "loopback_admin": False})
    try:
        store = engram.app[SERVICES].store
        assert store is not None
        key = new_key()
        await store.write(lambda c: insert_key(c, key.id, "ana", key.secret_hash, False, "", 0.0))
        yield engram, key.key
    finally:
        await engram.close()


def prompts(fake: FakeUpstream) -> str:
    return b"\n".join(r.body for r in fake.requests if r.method == "POST").decode(
        "utf-8", "replace"
    )


async def test_claude_code(
    agents: Agents, fake: FakeUpstream, keyed: tuple[Engram, str], tmp_path: Path
) -> None:
    engram, key = keyed
    url = engram.url + "/engram/mcp"
    for secret, connected in (
        (key, True),
        (key[:-4] + ("AAAA" if key[-4:] != "AAAA" else "BBBB"), False),
    ):
        home = Path(tempfile.mkdtemp(prefix="mcp-claude-", dir=tmp_path))
        env = _base_env(home) | claude_env(engram.url, "m", limits=None, api_key=key)
        claude = str(agents["claude"])
        add = [claude, "mcp", "add", "--transport", "http", "engram", url]
        add += ["--header", f"Authorization: Bearer {secret}", "--scope", "user"]
        run = await run_isolated(add, cwd=tmp_path, env=env, timeout=60)
        assert run.ok, run.report()
        run = await run_isolated([claude, "mcp", "list"], cwd=tmp_path, env=env, timeout=90)
        line = next(ln for ln in run.stdout.splitlines() if ln.startswith("engram:"))
        if connected:
            assert "Connected" in line and "Failed" not in line, run.report()
            fake.requests.clear()
            run = await run_isolated([claude, "-p"], cwd=tmp_path, env=env, stdin="hi", timeout=120)
            assert run.ok, run.report()
            sent = prompts(fake)
            assert sorted(set(re.findall(r"mcp__engram__(engram_[a-z]+)", sent))) == TOOLS
            assert INSTRUCTIONS in sent
        else:
            assert "Failed" in line and "401" in line, run.report()
        assert run.outside == []


async def test_codex(
    agents: Agents, fake: FakeUpstream, keyed: tuple[Engram, str], tmp_path: Path
) -> None:
    engram, key = keyed
    home = Path(tempfile.mkdtemp(prefix="mcp-codex-", dir=tmp_path))
    config = write_codex_config(home, engram.url, "m", limits=None)
    config.write_text(
        config.read_text()
        + f'\n[mcp_servers.engram]\nurl = "{engram.url}/engram/mcp"\n'
        + 'bearer_token_env_var = "ENGRAM_API_KEY"\n'
    )
    env = _base_env(home) | {
        "CODEX_HOME": str(home / ".codex"),
        "ENGRAM_AGENT_API_KEY": key,  # the model provider's key (testing.agents)
        "ENGRAM_API_KEY": key,  # the MCP server's
    }
    codex = str(agents["codex"])
    run = await run_isolated([codex, "mcp", "list"], cwd=tmp_path, env=env, timeout=60)
    assert run.ok and re.search(r"engram\s+http\S+/engram/mcp\s+ENGRAM_API_KEY", run.stdout), (
        run.report()
    )
    fake.requests.clear()
    argv = [codex, "exec", "--skip-git-repo-check", "-"]
    run = await run_isolated(argv, cwd=tmp_path, env=env, stdin="hi", timeout=120)
    assert run.ok, run.report()
    sent = prompts(fake)
    assert (
        sorted(set(re.findall(r"\b(engram_(?:search|remember|forget|sessions?))\b", sent))) == TOOLS
    )
    assert INSTRUCTIONS in sent and run.outside == []
