"""Real coding agents — Claude Code, Codex, opencode and Qwen Code from the npm registry, aider
from PyPI — run one non-interactive turn at a time against a base URL on loopback (Engram, or the
fake upstream).

    home = make_home(fake.url, "fake-model", parent=tmp_path)   # isolated HOME, configs written
    run = await run_claude(fake.url, "hi", home=home, cwd=work, model="fake-model")
    assert run.ok and "echo: hi" in run.stdout, run.report()
    run = await run_claude(fake.url, "and now?", home=home, cwd=work, model="fake-model",
                           continue_=True)                     # the same conversation

The clients and their versions are pinned in ``testing/agents.pins``; :mod:`testing.agents_install`
(``make agents-deps``) installs them with npm into a cache folder outside the checkout and finds
them there (``ENGRAM_AGENTS_DIR`` overrides). Each ``run_*`` writes its client's config for the URL,
model and limits it is given, so one home can hold all the clients, each keeping its own
sessions for ``continue_`` / ``resume`` (aider keeps its chat history in ``cwd``).

Isolation: each run gets an environment built from scratch (only ``PATH`` comes from ours) with
``HOME``, ``XDG_*``, ``CODEX_HOME`` and ``TMPDIR`` inside the given home, every switch that stops
update checks, telemetry, plugin and model-list downloads, and ``HTTP(S)_PROXY`` set to a loopback
proxy that refuses everything and records what was asked (``AgentRun.outside``); loopback
bypasses it. A run that outlives its timeout has its process group killed; it reports what it
printed so far.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from testing.agents_install import Agents, AgentsMissing, agents_dir, find_agents, read_pins

__all__ = [
    "AgentRun",
    "Agents",
    "AgentsMissing",
    "Limits",
    "RefusingProxy",
    "agents_dir",
    "find_agents",
    "make_home",
    "run_aider",
    "run_claude",
    "run_codex",
    "run_isolated",
    "run_opencode",
    "run_qwen",
]

API_KEY = "sk-test"


@dataclass(frozen=True)
class Limits:
    """The model's window and output cap as a client is told them (Codex takes only the window)."""

    context: int
    output: int


@dataclass
class AgentRun:
    """One finished (or killed) client process."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    wall: float  # seconds from start to exit (or kill)
    timed_out: bool
    pid: int  # also its process group, killed by now
    outside: list[str] = field(default_factory=list)  # requests the refusing proxy got

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def report(self) -> str:
        how = "timed out" if self.timed_out else f"exited {self.returncode}"
        return (
            f"{' '.join(self.argv[:3])} {how} after {self.wall:.1f} s; outside: {self.outside}\n"
            f"--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-4000:]}"
        )


# ---- isolated homes and each client's configuration -------------------------------------------


def make_home(
    url: str,
    model: str,
    *,
    parent: Path | None = None,
    limits: Limits | None = None,
    api_key: str = API_KEY,
) -> Path:
    """A fresh home folder (a temporary one under ``parent``) with Codex's, opencode's, Qwen
    Code's and aider's config files in it (Claude Code's is its environment, :func:`claude_env`).
    ``url`` is the server's root (``fake.url``, ``engram.url``); each client adds its own
    ``/v1``."""
    home = Path(tempfile.mkdtemp(prefix="engram-agent-home-", dir=parent))
    write_codex_config(home, url, model, limits=limits)
    write_opencode_config(home, url, model, limits=limits, api_key=api_key)
    write_qwen_config(home, model, limits=limits)
    write_aider_metadata(home, model, limits=limits)
    return home


def _base_env(home: Path) -> dict[str, str]:
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return {
        "HOME": str(home),
        "PATH": os.environ.get("PATH", os.defpath),  # node (Codex's launcher), git, bash
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "TMPDIR": str(home / "tmp"),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "XDG_CACHE_HOME": str(home / ".cache"),
    }


def claude_env(url: str, model: str, *, limits: Limits | None, api_key: str) -> dict[str, str]:
    env = {
        "ANTHROPIC_BASE_URL": url.rstrip("/"),  # it posts to /v1/messages?beta=true
        "ANTHROPIC_API_KEY": api_key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_DISABLE_OFFICIAL_MARKETPLACE_AUTOINSTALL": "1",
        "CLAUDE_CODE_IDE_SKIP_AUTO_INSTALL": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_UPDATES": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_INSTALLATION_CHECKS": "1",
    }
    for name in ("MODEL", "SMALL_FAST_MODEL", "DEFAULT_HAIKU_MODEL", "DEFAULT_SONNET_MODEL"):
        env[f"ANTHROPIC_{name}"] = model
    env["ANTHROPIC_DEFAULT_OPUS_MODEL"] = env["CLAUDE_CODE_SUBAGENT_MODEL"] = model
    if limits is not None:  # the window must hold its ~12k-token system prompt and tools
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(limits.context)
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(limits.output)
    return env


def write_codex_config(home: Path, url: str, model: str, *, limits: Limits | None) -> Path:
    """``$CODEX_HOME/config.toml`` (``home/.codex``); every key is one ``--strict-config``
    accepts. Without ``features.plugins = false`` it fetches github.com/openai/plugins, without
    ``analytics``/``otel`` off it posts metrics to ab.chatgpt.com."""
    path = home / ".codex" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    window = f"model_context_window = {limits.context}\n" if limits else ""
    path.write_text(
        f"model = {json.dumps(model)}\n"
        'model_provider = "engram"\n'
        "check_for_update_on_startup = false\n"
        f"{window}\n"
        "[model_providers.engram]\n"
        'name = "Engram"\n'
        f"base_url = {json.dumps(url.rstrip('/') + '/v1')}\n"
        'wire_api = "responses"\n'
        'env_key = "ENGRAM_AGENT_API_KEY"\n\n'
        "[analytics]\nenabled = false\n\n"
        "[feedback]\nenabled = false\n\n"
        '[otel]\nexporter = "none"\nmetrics_exporter = "none"\n\n'
        "[features]\nplugins = false\nremote_plugin = false\napps = false\n"
    )
    return path


def write_opencode_config(
    home: Path, url: str, model: str, *, limits: Limits | None, api_key: str
) -> Path:
    """``~/.config/opencode/opencode.json``, and the stub that stops opencode installing
    ``@opencode-ai/plugin`` from the npm registry into that folder (it holds the first turn for
    about 5 s, or until the registry answers): a ``node_modules`` and a lockfile that lists it."""
    folder = home / ".config" / "opencode"
    (folder / "node_modules").mkdir(parents=True, exist_ok=True)
    dep = {"@opencode-ai/plugin": read_pins()["opencode"].version}
    (folder / "package.json").write_text(json.dumps({"dependencies": dep}) + "\n")
    lock = {"lockfileVersion": 3, "packages": {"": {"dependencies": dep}}}
    (folder / "package-lock.json").write_text(json.dumps(lock) + "\n")
    entry: dict[str, Any] = {"name": model}
    if limits is not None:
        entry["limit"] = {"context": limits.context, "output": limits.output}
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "engram": {
                "npm": "@ai-sdk/openai-compatible",  # bundled in the binary
                "name": "Engram",
                "options": {"baseURL": url.rstrip("/") + "/v1", "apiKey": api_key},
                "models": {model: entry},
            }
        },
        "model": f"engram/{model}",
        "small_model": f"engram/{model}",  # the title request
        "enabled_providers": ["engram"],
        "autoupdate": False,
        "share": "disabled",
    }
    path = folder / "opencode.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


OPENCODE_ENV = {
    f"OPENCODE_{name}": "1"
    for name in (
        "DISABLE_AUTOUPDATE",
        "DISABLE_MODELS_FETCH",  # models.dev
        "DISABLE_DEFAULT_PLUGINS",
        "PURE",  # no external plugins
        "DISABLE_LSP_DOWNLOAD",
        "DISABLE_SHARE",
        "DISABLE_EXTERNAL_SKILLS",
        "DISABLE_CLAUDE_CODE",  # never reads ~/.claude (Claude Code's, in a shared home)
        "DISABLE_EMBEDDED_WEB_UI",
    )
}


def write_qwen_config(home: Path, model: str, *, limits: Limits | None) -> Path:
    """``~/.qwen/settings.json``: the OpenAI-compatible auth (its URL and key come from the
    environment, :func:`qwen_env`), the model, and no usage statistics (without
    ``privacy.usageStatisticsEnabled = false`` it posts them to an aliyuncs.com RUM endpoint),
    telemetry or update checks. ``limits`` become ``contextWindowSize`` and ``max_tokens``
    (without them it asks for 32,000)."""
    entry: dict[str, Any] = {"name": model}
    if limits is not None:
        entry["generationConfig"] = {
            "contextWindowSize": limits.context,
            "samplingParams": {"max_tokens": limits.output},
        }
    settings = {
        "$version": 4,
        "security": {"auth": {"selectedType": "openai"}},
        "model": entry,
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"enableAutoUpdate": False},
    }
    path = home / ".qwen" / "settings.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2) + "\n")
    return path


def qwen_env(url: str, api_key: str) -> dict[str, str]:
    return {"OPENAI_BASE_URL": url.rstrip("/") + "/v1", "OPENAI_API_KEY": api_key}


def write_aider_metadata(home: Path, model: str, *, limits: Limits | None) -> Path:
    """``~/.aider.model.metadata.json`` for ``openai/<model>``: with an entry for its model,
    aider does not fetch litellm's price list from raw.githubusercontent.com (once a day, else).
    ``limits`` become its ``max_input_tokens`` / ``max_output_tokens`` (sizing the repository
    map and when it summarizes the chat history); aider sends no ``max_tokens``."""
    entry: dict[str, Any] = {
        "litellm_provider": "openai",
        "mode": "chat",
        "input_cost_per_token": 0,
        "output_cost_per_token": 0,
    }
    if limits is not None:
        entry |= {
            "max_input_tokens": limits.context,
            "max_output_tokens": limits.output,
            "max_tokens": limits.output,
        }
    path = home / ".aider.model.metadata.json"
    path.write_text(json.dumps({f"openai/{model}": entry}, indent=2) + "\n")
    return path


def aider_env(url: str, api_key: str) -> dict[str, str]:
    return {
        "OPENAI_API_BASE": url.rstrip("/") + "/v1",
        "OPENAI_API_KEY": api_key,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm's own copy, not GitHub's
        # Its commits (``git=True``): aider asks git for an author.
        "GIT_AUTHOR_NAME": "Engram Test",
        "GIT_AUTHOR_EMAIL": "test@engram.invalid",
        "GIT_COMMITTER_NAME": "Engram Test",
        "GIT_COMMITTER_EMAIL": "test@engram.invalid",
    }


AIDER_FLAGS = (
    "--yes-always",
    "--no-check-update",
    "--no-analytics",
    "--no-show-model-warnings",
    "--no-show-release-notes",
)


# ---- running ------------------------------------------------------------------------------------


class RefusingProxy:
    """A loopback HTTP(S) proxy that answers every request 403 and records its request line
    (``CONNECT api.anthropic.com:443``), so a client that tries to go out fails fast
    and the test can see that it tried."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> RefusingProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with suppress(
            OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError
        ):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            line = head.split(b"\r\n", 1)[0].decode("latin-1")
            self.requests.append(line.rsplit(" HTTP/", 1)[0])
            writer.write(
                b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            await writer.drain()
        writer.close()

    def env(self) -> dict[str, str]:
        names = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
        env = {n: self.url for n in names} | {n.lower(): self.url for n in names}
        return env | {"NO_PROXY": "127.0.0.1,localhost,::1", "no_proxy": "127.0.0.1,localhost,::1"}


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _read(f: IO[bytes]) -> str:
    f.seek(0)
    return f.read().decode("utf-8", "replace")


async def run_isolated(
    argv: Sequence[str], *, cwd: Path, env: dict[str, str], stdin: str = "", timeout: float
) -> AgentRun:
    """Run ``argv`` in its own process group with exactly ``env`` (plus the refusing proxy),
    ``stdin`` as its input and its output in files (a grandchild that keeps them open blocks
    nothing); the group is killed at the end, or at ``timeout`` (SIGTERM, then SIGKILL)."""
    async with RefusingProxy() as proxy:
        with ExitStack() as stack:
            inp, out, err = (stack.enter_context(tempfile.TemporaryFile()) for _ in range(3))
            inp.write(stdin.encode())
            inp.seek(0)
            start = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=inp,
                stdout=out,
                stderr=err,
                cwd=cwd,
                env=env | proxy.env(),
                start_new_session=True,
            )
            timed_out = False
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                timed_out = True
                _signal_group(proc.pid, signal.SIGTERM)
                with suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 3)
            finally:
                _signal_group(proc.pid, signal.SIGKILL)  # and whatever it left running
                await proc.wait()
            wall = time.monotonic() - start
            stdout, stderr = await asyncio.to_thread(lambda: (_read(out), _read(err)))
    assert proc.returncode is not None
    return AgentRun(
        list(argv), proc.returncode, stdout, stderr, wall, timed_out, proc.pid, proxy.requests
    )


async def run_claude(
    url: str,
    prompt: str,
    *,
    home: Path,
    cwd: Path,
    model: str,
    continue_: bool = False,
    limits: Limits | None = None,
    api_key: str = API_KEY,
    timeout: float = 120.0,
    agents: Agents | None = None,
) -> AgentRun:
    """``claude -p [--continue]``, the prompt on stdin; ``--continue`` resumes the last
    conversation of ``cwd``. It prints the reply's text."""
    binary = (agents or find_agents())["claude"]
    argv = [str(binary), "-p", *(["--continue"] if continue_ else [])]
    env = _base_env(home) | claude_env(url, model, limits=limits, api_key=api_key)
    return await run_isolated(argv, cwd=cwd, env=env, stdin=prompt, timeout=timeout)


async def run_codex(
    url: str,
    prompt: str,
    *,
    home: Path,
    cwd: Path,
    model: str,
    resume: bool = False,
    limits: Limits | None = None,
    api_key: str = API_KEY,
    timeout: float = 120.0,
    agents: Agents | None = None,
) -> AgentRun:
    """``codex exec [resume --last] --skip-git-repo-check -`` (``-``: the prompt on stdin);
    ``resume --last`` continues the newest session recorded for ``cwd``. It prints a banner and
    the transcript on stderr and the final reply on stdout."""
    binary = (agents or find_agents())["codex"]
    write_codex_config(home, url, model, limits=limits)
    sub = ["resume", "--last"] if resume else []
    argv = [str(binary), "exec", *sub, "--skip-git-repo-check", "-"]
    env = _base_env(home) | {
        "CODEX_HOME": str(home / ".codex"),
        "ENGRAM_AGENT_API_KEY": api_key,  # sent as Authorization: Bearer
    }
    return await run_isolated(argv, cwd=cwd, env=env, stdin=prompt, timeout=timeout)


async def run_opencode(
    url: str,
    prompt: str,
    *,
    home: Path,
    cwd: Path,
    model: str,
    continue_: bool = False,
    limits: Limits | None = None,
    api_key: str = API_KEY,
    timeout: float = 180.0,
    agents: Agents | None = None,
) -> AgentRun:
    """``opencode run [--continue]``, the prompt on stdin (as arguments, opencode puts quotes
    around any word with a space in it). Without ``limits`` it asks for max_tokens 32000. A new
    session also sends a title request ("Generate a title for this conversation:")."""
    binary = (agents or find_agents())["opencode"]
    write_opencode_config(home, url, model, limits=limits, api_key=api_key)
    argv = [str(binary), "run", *(["--continue"] if continue_ else [])]
    env = _base_env(home) | OPENCODE_ENV
    return await run_isolated(argv, cwd=cwd, env=env, stdin=prompt, timeout=timeout)


async def run_qwen(
    url: str,
    prompt: str,
    *,
    home: Path,
    cwd: Path,
    model: str,
    continue_: bool = False,
    limits: Limits | None = None,
    api_key: str = API_KEY,
    timeout: float = 180.0,
    agents: Agents | None = None,
) -> AgentRun:
    """``qwen [--continue] <prompt>``: a prompt given as its argument runs one turn and exits
    (on stdin it gets two newlines appended); ``--continue`` resumes the newest session of
    ``cwd``. It prints the reply's text. After each turn it sends its memory-extraction request
    ("You are now acting as the managed memory extraction subagent…"), with the conversation
    in it."""
    binary = (agents or find_agents())["qwen"]
    write_qwen_config(home, model, limits=limits)
    argv = [str(binary), *(["--continue"] if continue_ else []), prompt]
    env = _base_env(home) | qwen_env(url, api_key)
    return await run_isolated(argv, cwd=cwd, env=env, timeout=timeout)


async def run_aider(
    url: str,
    prompt: str,
    *,
    home: Path,
    cwd: Path,
    model: str,
    continue_: bool = False,
    git: bool = False,
    limits: Limits | None = None,
    api_key: str = API_KEY,
    extra: Sequence[str] = (),
    timeout: float = 180.0,
    agents: Agents | None = None,
) -> AgentRun:
    """``aider --model openai/<model> --message <prompt>`` with every question answered yes and
    no update check, analytics or model warnings; ``--no-git`` unless ``git`` (``cwd`` a git
    repository: then it sends a repository map, and a commit message request after each edit it
    applies). ``continue_``: ``--restore-chat-history``, the earlier turns read back from
    ``cwd``'s ``.aider.chat.history.md``. ``extra`` adds flags (``--max-chat-history-tokens``).
    It prints a banner, the reply and what it did."""
    found = agents or find_agents()
    write_aider_metadata(home, model, limits=limits)
    argv = [*found.command("aider"), "--model", f"openai/{model}", *AIDER_FLAGS]
    argv += [*([] if git else ["--no-git"]), *(["--restore-chat-history"] if continue_ else [])]
    argv += [*extra, "--message", prompt]
    env = _base_env(home) | aider_env(url, api_key)
    return await run_isolated(argv, cwd=cwd, env=env, timeout=timeout)
