"""Archiving a turn before the client's last byte: what the commit costs, and whether
back-to-back clients still split a conversation (issue 10).

    .venv/bin/python -m bench.archive [--quick] [--parts ab] [--json out.json]
    PYTHONSAFEPATH=1 PYTHONPATH=/tmp/engram-before:$PWD \
        .venv/bin/python -m bench.archive --parts b                  # another checkout's code

(a) The commit's cost per request. First the write transaction alone, as the pipeline runs it:
    ``Store.write(lambda c: commit_turns(c, placement, rows, now))`` with ``rows`` the request's
    new user message and the reply (fresh synthetic text, 12-60 and 40-220 words), the
    placement made by :func:`proxy.chat.sessions.place` in its own write first (untimed), as before
    forwarding; conversations of 1-8 turns, half named by the client (``X-Engram-Session``),
    half recognised by their hash chain; into a database already holding 0, 10k and 100k turns.
    Then from the pipeline's side: ``python -m proxy serve`` (hash embedder) in front of the fake
    upstream (in this process), one request at a time: the time from the upstream's last byte
    (after its ``write_eof``) to the client's last byte (its ``read()`` returning), memory on
    (the commit runs in between) against ``X-Engram-Memory: off`` (a pure relay), same bodies.
    Then the same through an in-process Engram whose archive steps are wrapped and timed
    (``commit_turns``, the ``Store.write`` around it, ``MemoryService.commit``,
    ``ChatPipeline._commit``), to show where the time goes.
(b) Sessions per conversation under back-to-back clients: 16 concurrent clients x 25 turns,
    each sending its next turn the instant the previous reply ended, half with
    ``X-Engram-Session``, half without, half of each streamed and half plain, each its own
    ``X-Engram-User``; then counted in the database once Engram is idle: sessions per
    conversation, messages stored more than once, messages missing, order. Then one client
    without a header, 4 turns back to back: the distinct session ids in the reply headers.
    Engram runs as ``python -m proxy serve`` (``--in-process``: ``testing.harness.start_engram``,
    the tests' way), with the hash embedder (``--embedder model``: the configured MiniLM, whose
    slower archiving widened the old code's race).

Run it from the repository root. The code measured is whichever ``proxy`` package Python imports
(printed first, as "measuring <commit> (<path>)"); plainly run, that is this checkout's. To measure
another checkout (a ``git worktree`` of an older commit), run from this root with that checkout
first on ``PYTHONPATH`` and this root after it, and ``PYTHONSAFEPATH=1`` (Python 3.11's ``-P``):
``python -m`` otherwise puts the current folder ahead of ``PYTHONPATH``, and this checkout's
``proxy`` would win. The other checkout then provides ``proxy`` (also for ``python -m proxy
serve``, started in its folder) and its own in-process Engram: its ``testing.harness``, or its
``tests.conftest`` in checkouts from before the ``testing`` package; this root provides ``bench``
and, when the other checkout has none, ``testing`` (the fake upstream). A checkout that has its
own ``bench`` package runs its own copy of this benchmark. Part (a) needs ``commit_turns``
(commit 56d4a5c and later).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import itertools
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
from aiohttp import web

import proxy
from bench.common import machine, machine_lines
from proxy.store import Store, queries
from proxy.store.sqlite.db import connect
from testing.fake_upstream import FakeUpstream

CODE_ROOT = Path(proxy.__file__).resolve().parent.parent  # the tree whose code is measured
COMMIT_TARGET_MS = 1.0  # "well under a millisecond"
MODEL = "fake-model"


# ---- synthetic text ----------------------------------------------------------------------

_SYLLABLES = (
    *("ka", "lo", "mi", "ren", "to", "sa", "vel", "qui", "dor", "an", "be", "ti"),
    *("mor", "ul", "pre", "sto", "na", "ri", "gal", "fe", "xo", "bru", "en", "is"),
)


class TextGen:
    """Fresh prose-like text: pseudo-words drawn with a Zipf-like skew, in sentences."""

    def __init__(self, seed: int, vocabulary: int = 20_000) -> None:
        self.rng = random.Random(seed)
        words: dict[str, None] = {}
        while len(words) < vocabulary:
            n = self.rng.randint(1, 4)
            words["".join(self.rng.choice(_SYLLABLES) for _ in range(n))] = None
        self.words = list(words)
        self.cum = list(itertools.accumulate(1.0 / (r + 2.7) for r in range(vocabulary)))

    def text(self, lo: int, hi: int) -> str:
        picked = self.rng.choices(self.words, cum_weights=self.cum, k=self.rng.randint(lo, hi))
        out: list[str] = []
        while picked:
            n = self.rng.randint(6, 14)
            sentence, picked = picked[:n], picked[n:]
            out.append(" ".join(sentence).capitalize() + ".")
        return " ".join(out)

    def user(self) -> str:
        return self.text(12, 60)

    def reply(self) -> str:
        return self.text(40, 220)


def ms_stats(seconds: Sequence[float]) -> dict[str, float]:
    """p50 / p95 / p99 / max of seconds, in milliseconds."""
    if not seconds:
        return {"n": 0, "p50": float("nan"), "p95": float("nan"), "p99": float("nan"), "max": 0}
    q = (
        statistics.quantiles(seconds, n=100, method="inclusive")
        if len(seconds) > 1
        else [seconds[0]] * 99
    )
    return {
        "n": len(seconds),
        "p50": q[49] * 1000,
        "p95": q[94] * 1000,
        "p99": q[98] * 1000,
        "max": max(seconds) * 1000,
    }


def code_label() -> str:
    """The commit of the measured tree, and whether its proxy/ differs from it."""
    try:
        rev = subprocess.run(
            ["git", "-C", str(CODE_ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(CODE_ROOT), "status", "--porcelain", "--", "proxy"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return str(CODE_ROOT)
    return rev + (" + uncommitted changes in proxy/" if dirty else "")


# ---- (a) the commit alone ----------------------------------------------------------------


def checkpoint(path: Path | None) -> None:
    """Fold the WAL into the database, so that each measurement starts from an empty log."""
    assert path is not None, "a SQLite store"
    conn = connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    finally:
        conn.close()


async def prefill(store: Store, gen: TextGen, user: str, start: int, n: int) -> float:
    """Add ``n`` turns to ``user`` in sessions of 20 (no vectors; marked embedded, as an
    archive the indexer has caught up with). Returns seconds."""
    from proxy.store.models import NewTurn

    t0 = time.perf_counter()
    per_session, per_write = 20, 1000
    now = time.time() - 86400.0
    for first in range(start, start + n, per_write):
        count = min(per_write, start + n - first)

        def job(c: Any, first: int = first, count: int = count) -> None:
            for s0 in range(first, first + count, per_session):
                sid = f"fill{start}-{s0 // per_session}"
                queries.get_or_create_session(
                    c, user, sid, parent_id=None, agent=None, fingerprint=None, indexed=True,
                    now=now,
                )  # fmt: skip
                rows = [
                    NewTurn(
                        position=p,
                        role="user" if p % 2 == 0 else "assistant",
                        content=gen.text(10, 30) if p % 2 == 0 else gen.text(20, 120),
                        timestamp=now,
                    )
                    for p in range(min(per_session, first + count - s0))
                ]
                queries.insert_turns(c, sid, user, rows, None, now)
            c.execute("UPDATE turns SET embed_hash = 'prefill' WHERE embed_hash IS NULL")

        await store.write(job)
    checkpoint(store.path)
    return time.perf_counter() - t0


def _place(conn: Any, req: Any, now: float) -> Any:
    from proxy.chat.sessions import place

    return place(conn, req, now)


async def commit_cost(store: Store, gen: TextGen, user: str, requests: int) -> dict[str, Any]:
    """Time ``requests`` commits (plus a warm-up of 50), conversations of 1-8 turns."""
    from proxy.chat.archive import to_new_turns
    from proxy.chat.sessions import PlacementRequest as Request
    from proxy.chat.sessions import commit_turns
    from proxy.messages import anchor_length, chain_hashes, extend_chain

    timed: dict[str, list[float]] = {"new": [], "continued": []}
    inner: dict[str, list[float]] = {"new": [], "continued": []}
    rows_per: Counter[int] = Counter()
    conv = 0
    done = -50  # warm-up
    while done < requests:
        conv += 1
        explicit = f"named-{user}-{conv}" if conv % 2 == 0 else None
        messages: list[dict[str, Any]] = []
        for _ in range(gen.rng.randint(1, 8)):
            if done >= requests:
                break
            messages.append({"role": "user", "content": gen.user()})
            now = time.time()
            chains = chain_hashes(messages)
            req = Request(user, explicit, chains, anchor_length(messages))
            placement = await store.read(functools.partial(_place, req=req, now=now))
            first = placement.matched
            rows = to_new_turns(
                messages[first:], chains[first:], placement.next_position, True, now
            )
            reply = {"role": "assistant", "content": gen.reply()}
            position = placement.next_position + len(messages) - first
            rows += to_new_turns([reply], [extend_chain(chains[-1], reply)], position, True, now)
            spent: list[float] = []

            def job(
                c: Any,
                placement: Any = placement,
                rows: Any = rows,
                now: float = now,
                spent: list[float] = spent,
            ) -> Any:
                t = time.perf_counter()
                try:
                    return commit_turns(c, placement, rows, now)
                finally:
                    spent.append(time.perf_counter() - t)

            t0 = time.perf_counter()
            session, inserted = await store.write(job)
            seconds = time.perf_counter() - t0
            if len(inserted) != len(rows) or session.id != placement.session.id:
                raise RuntimeError(f"commit stored {len(inserted)} of {len(rows)} rows")
            messages.append(reply)
            if done >= 0:
                kind = "new" if placement.created else "continued"
                timed[kind].append(seconds)
                inner[kind].append(spent[0])
                rows_per[len(rows)] += 1
            done += 1
    every = timed["new"] + timed["continued"]
    every_inner = inner["new"] + inner["continued"]
    return {
        "conversations": conv,
        "rows_per_commit": dict(rows_per),
        "write": {k: ms_stats(v) for k, v in (*timed.items(), ("all", every))},
        "commit_turns": {k: ms_stats(v) for k, v in (*inner.items(), ("all", every_inner))},
    }


async def part_a_direct(sizes: Sequence[int], requests: int, tmp: Path) -> list[dict[str, Any]]:
    gen = TextGen(1)
    out: list[dict[str, Any]] = []
    async with Store(tmp / "commit.db") as store:
        for size in sizes:
            turns = await store.read(lambda c: c.execute("SELECT count(*) FROM turns").fetchone())
            if size > turns[0]:  # top up to ``size``, counting what earlier commits stored
                seconds = await prefill(store, gen, "bench", turns[0], size - turns[0])
                print(f"(a) filled up to {size} turns in {seconds:.0f} s", file=sys.stderr)
                turns = await store.read(
                    lambda c: c.execute("SELECT count(*) FROM turns").fetchone()
                )
            load = os.getloadavg()[0]
            row = await commit_cost(store, gen, "bench", requests)
            row.update(size=size, db_turns=int(turns[0]), load=load)
            out.append(row)
            w = row["write"]["all"]
            print(f"(a) {size}: Store.write p50 {w['p50']:.3f} ms", file=sys.stderr)
            checkpoint(store.path)
    return out


# ---- running Engram ----------------------------------------------------------------------


class TimedUpstream(FakeUpstream):
    """The fake upstream, noting when a chat reply's last byte left it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.last_byte = 0.0

    async def _chat(self, request: web.Request, body: bytes) -> web.StreamResponse:
        resp = await super()._chat(request, body)
        if not resp.prepared:  # a whole JSON reply: send it here, to know when it has gone
            await resp.prepare(request)
            await resp.write_eof()
        self.last_byte = time.perf_counter()
        return resp


@dataclass
class Running:
    url: str
    db: Path
    settle: Callable[[], Awaitable[None]]
    close: Callable[[], Awaitable[None]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def start_serve(upstream: str, tmp: Path, name: str, model: bool = False) -> Running:
    """``python -m proxy serve`` of the measured tree, its own database; the hash embedder, or
    with ``model`` the configured default (MiniLM)."""
    db, log_path = tmp / f"{name}.db", tmp / f"{name}.log"
    port = _free_port()
    env = {**os.environ, "ENGRAM_SERVER_LOG_LEVEL": "warning"}
    if not model:
        env["ENGRAM_EMBEDDER_MODEL"] = "hash"
    log = log_path.open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--upstream", upstream,
        "--host", "127.0.0.1", "--port", str(port), "--db", str(db),
        cwd=CODE_ROOT, stdout=log, stderr=log, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    async def close() -> None:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        log.close()

    async def settle() -> None:
        """Idle when the stored turns have not changed for a second; then stop Engram (it
        finishes its background work on the way out)."""
        last, still = -1, 0.0
        while still < 1.0:
            await asyncio.sleep(0.1)
            n = count_turns(db)
            still = still + 0.1 if n == last else 0.0
            last = n
        await close()

    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/engram/health") as resp:
                    if resp.status == 200:
                        break
            if time.monotonic() > deadline or proc.returncode is not None:
                await close()
                raise RuntimeError(f"Engram did not start; see {log_path}")
            await asyncio.sleep(0.1)
    return Running(url, db, settle, close)


def harness() -> ModuleType:
    """The measured tree's in-process Engram (``start_engram``, ``settle``): its
    ``testing.harness``, or ``tests.conftest`` in checkouts from before the ``testing`` package."""
    has_testing = (CODE_ROOT / "testing" / "harness.py").is_file()
    return importlib.import_module("testing.harness" if has_testing else "tests.conftest")


async def start_in_process(upstream: str, model: bool = False) -> Running:
    from proxy.search.embedder import DEFAULT_MODEL

    h = harness()
    engram = await h.start_engram(upstream, embedder={"model": DEFAULT_MODEL if model else "hash"})

    async def wait() -> None:
        await h.settle(engram, 120.0)

    return Running(engram.url, Path(engram.tmp.name) / "engram.db", wait, engram.close)


def count_turns(db: Path) -> int:
    conn = connect(db, readonly=True)
    try:
        return int(conn.execute("SELECT count(*) FROM turns").fetchone()[0])
    finally:
        conn.close()


# ---- a chat client -----------------------------------------------------------------------


def sse_text(data: bytes) -> str:
    parts: list[str] = []
    for line in data.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if isinstance(content, str):
                parts.append(content)
    return "".join(parts)


@dataclass
class Answer:
    text: str
    session: str | None
    done: float  # perf_counter when the last byte was read


async def chat(
    http: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    messages: list[dict[str, Any]],
    stream: bool,
) -> Answer:
    body = {"model": MODEL, "messages": messages, "stream": stream, "max_tokens": 512}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        data = await resp.read()
        done = time.perf_counter()
        if resp.status != 200:
            raise RuntimeError(f"chat answered {resp.status}: {data[:300]!r}")
        session = resp.headers.get("X-Engram-Session")
    text = sse_text(data) if stream else json.loads(data)["choices"][0]["message"]["content"]
    return Answer(text, session, done)


# ---- (a) from the pipeline's side --------------------------------------------------------


async def on_off_pairs(
    url: str, fake: TimedUpstream, pairs: int, gap_s: float, gen: TextGen
) -> dict[str, Any]:
    """``pairs`` pairs of the same request with memory on and off (order alternating), one at
    a time, streamed and plain alternating by pair, conversations of 1-8 turns; the time from
    the upstream's last byte to the client's, and the whole request, by (transport, mode)."""
    gaps: dict[tuple[str, str], list[float]] = {}
    totals: dict[tuple[str, str], list[float]] = {}
    async with aiohttp.ClientSession() as http:
        messages: list[dict[str, Any]] = []
        left = 0
        for i in range(pairs + 20):  # the first 20 pairs warm up
            if left == 0:
                messages, left = [], gen.rng.randint(1, 8)
            left -= 1
            messages.append({"role": "user", "content": gen.user()})
            stream = i % 2 == 0
            transport = "stream" if stream else "plain"
            order = ("on", "off") if (i // 2) % 2 == 0 else ("off", "on")
            kept: dict[str, str] = {}
            for mode in order:
                headers = {"X-Engram-User": "pipeline", "X-Engram-Memory": mode}
                t0 = time.perf_counter()
                answer = await chat(http, url, headers, messages, stream)
                if i >= 20:
                    gaps.setdefault((transport, mode), []).append(answer.done - fake.last_byte)
                    totals.setdefault((transport, mode), []).append(answer.done - t0)
                kept[mode] = answer.text
                await asyncio.sleep(gap_s)
            messages.append({"role": "assistant", "content": kept["on"]})
    rows = []
    for transport in ("stream", "plain"):
        on, off = gaps[(transport, "on")], gaps[(transport, "off")]
        rows.append(
            {
                "transport": transport,
                "n": len(on),
                "on": ms_stats(on),
                "off": ms_stats(off),
                "total_on": ms_stats(totals[(transport, "on")]),
                "total_off": ms_stats(totals[(transport, "off")]),
            }
        )
    return {"pairs": pairs, "gap_ms": gap_s * 1000, "rows": rows}


async def part_a_pipeline(pairs: int, gap_s: float, tmp: Path) -> dict[str, Any]:
    """Upstream's last byte -> client's last byte through ``python -m proxy serve``."""
    fake = TimedUpstream(n_ctx=32768, record=False)
    await fake.start()
    try:
        engram = await start_serve(fake.url, tmp, "pipeline")
        try:
            load = os.getloadavg()[0]
            out = await on_off_pairs(engram.url, fake, pairs, gap_s, TextGen(2))
        finally:
            await engram.close()
    finally:
        await fake.stop()
    out["load"] = load
    return out


class _Probe:
    """Times the archive's steps inside an in-process Engram by wrapping them."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self.local = threading.local()

    def note(self, key: str, seconds: float) -> None:
        self.seconds.setdefault(key, []).append(seconds)

    def wrap_async(self, owner: Any, name: str, key: str) -> Callable[[], None]:
        original = getattr(owner, name)

        async def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                self.note(key, time.perf_counter() - t0)

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)

    def wrap_sync(
        self, owner: Any, name: str, key: Callable[[dict[str, Any]], str], mark: bool = False
    ) -> Callable[[], None]:
        """``key`` names the figure from the call's keyword arguments; ``mark`` flags the
        transaction it runs in (see :meth:`wrap_store_write`)."""
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.note(key(kwargs), time.perf_counter() - t0)
                if mark:
                    self.local.hit = True

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)

    def wrap_store_write(self) -> Callable[[], None]:
        """Store.write, timed only when the transaction ran commit_turns."""
        original = Store.write
        probe = self

        async def write(self: Store, fn: Callable[[Any], Any], *, transaction: bool = True) -> Any:
            ran: list[bool] = []

            def marked(conn: Any) -> Any:
                probe.local.hit = False
                try:
                    return fn(conn)
                finally:
                    ran.append(bool(probe.local.hit))

            t0 = time.perf_counter()
            try:
                return await original(self, marked, transaction=transaction)
            finally:
                if ran and ran[0]:
                    probe.note("Store.write (commit)", time.perf_counter() - t0)

        Store.write = write  # type: ignore[method-assign]
        return lambda: setattr(Store, "write", original)


async def part_a_breakdown(pairs: int, gap_s: float) -> dict[str, Any]:
    """The same pairs through an in-process Engram (hash embedder), its archive steps timed."""
    import proxy.chat.archive
    import proxy.chat.memory
    import proxy.chat.pipeline

    probe = _Probe()
    undo = [
        probe.wrap_sync(  # the commit makes the reply's row (incomplete= given) on the way
            proxy.chat.archive,
            "to_new_turns",
            lambda kw: "to_new_turns (reply)" if "incomplete" in kw else "to_new_turns (request)",
        ),
        probe.wrap_sync(proxy.chat.archive, "commit_turns", lambda kw: "commit_turns", mark=True),
        probe.wrap_store_write(),
        probe.wrap_async(proxy.chat.memory.MemoryService, "commit", "MemoryService.commit"),
        probe.wrap_async(proxy.chat.pipeline.ChatPipeline, "_commit", "ChatPipeline._commit"),
    ]
    fake = TimedUpstream(n_ctx=32768, record=False)
    await fake.start()
    try:
        engram = await harness().start_engram(fake.url)
        try:
            load = os.getloadavg()[0]
            out = await on_off_pairs(engram.url, fake, pairs, gap_s, TextGen(4))
        finally:
            await engram.close()
    finally:
        await fake.stop()
        for u in undo:
            u()
    warm = 20  # as on_off_pairs: the warm-up pairs' figures are left out
    out["steps"] = {k: ms_stats(v[warm:]) for k, v in probe.seconds.items()}
    out["load"] = load
    return out


# ---- (b) back-to-back clients ------------------------------------------------------------


@dataclass
class Conversation:
    user: str
    explicit: str | None
    stream: bool
    messages: list[dict[str, Any]]
    header_sessions: list[str | None]


async def run_client(
    http: aiohttp.ClientSession, url: str, conv: Conversation, turns: int, gen: TextGen
) -> None:
    headers = {"X-Engram-User": conv.user}
    if conv.explicit:
        headers["X-Engram-Session"] = conv.explicit
    for _ in range(turns):
        conv.messages.append({"role": "user", "content": gen.user()})
        answer = await chat(http, url, headers, conv.messages, conv.stream)
        conv.header_sessions.append(answer.session)
        conv.messages.append({"role": "assistant", "content": answer.text})


def check(conn: Any, conv: Conversation) -> dict[str, Any]:
    """How the conversation's messages were stored."""
    expected = {(m["role"], m["content"]): i for i, m in enumerate(conv.messages)}
    if len(expected) != len(conv.messages):
        raise RuntimeError("a conversation repeated a message; the check needs unique texts")
    rows = conn.execute(
        "SELECT session_id, position, role, content FROM turns WHERE user_id = ? AND position >= 0"
        " ORDER BY session_id, position",
        (conv.user,),
    ).fetchall()
    sessions = conn.execute(
        "SELECT count(*) FROM sessions WHERE user_id = ?", (conv.user,)
    ).fetchone()[0]
    counts: Counter[int] = Counter()
    by_session: dict[str, list[tuple[int, int]]] = {}
    unexpected = 0
    for sid, position, role, content in rows:
        idx = expected.get((role, content))
        if idx is None:
            unexpected += 1
            continue
        counts[idx] += 1
        by_session.setdefault(sid, []).append((position, idx))
    ordered = all(
        all(b[1] > a[1] and b[0] > a[0] for a, b in itertools.pairwise(items))
        for items in by_session.values()
    )
    exact = len(by_session) == 1 and [(p, i) for p, i in next(iter(by_session.values()))] == [
        (i, i) for i in range(len(conv.messages))
    ]
    return {
        "user": conv.user,
        "explicit": conv.explicit is not None,
        "stream": conv.stream,
        "messages": len(conv.messages),
        "sessions": len(by_session),
        "sessions_in_db": int(sessions),
        "stored_rows": len(rows),
        "duplicated": sum(1 for n in counts.values() if n > 1),
        "extra_copies": sum(n - 1 for n in counts.values() if n > 1),
        "missing": len(conv.messages) - len(counts),
        "unexpected": unexpected,
        "ordered": ordered,
        "exact": exact,
        "header_sessions": len(set(conv.header_sessions)),
        "headers_name_stored": set(conv.header_sessions) == set(by_session),
        "session_sizes": sorted((len(v) for v in by_session.values()), reverse=True),
    }


async def part_b(
    clients: int, turns: int, rounds: int, trials: int, in_process: bool, model: bool, tmp: Path
) -> dict[str, Any]:
    gen = TextGen(3)
    fake = FakeUpstream(n_ctx=32768, record=False)
    await fake.start()
    engram = (
        await start_in_process(fake.url, model)
        if in_process
        else await start_serve(fake.url, tmp, "b2b", model)
    )
    convs: list[Conversation] = []
    b2b: list[Conversation] = []
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            for r in range(rounds):
                batch = [
                    Conversation(
                        f"b2b-{r}-{i}",
                        f"conv-{r}-{i}" if i % 2 == 0 else None,
                        (i // 2) % 2 == 0,
                        [{"role": "system", "content": "You are agent " + gen.text(8, 20)}],
                        [],
                    )
                    for i in range(clients)
                ]
                await asyncio.gather(*(run_client(http, engram.url, c, turns, gen) for c in batch))
                convs += batch
            for t in range(trials):  # one client, no header, 4 turns back to back
                c = Conversation(f"four-{t}", None, t % 2 == 0, [], [])
                await run_client(http, engram.url, c, 4, gen)
                b2b.append(c)
        seconds = time.perf_counter() - t0
        await engram.settle()
        conn = connect(engram.db, readonly=True)
        try:
            results = [check(conn, c) for c in convs]
            fours = [check(conn, c) for c in b2b]
        finally:
            conn.close()
    finally:
        await engram.close()
        await fake.stop()
    return {
        "clients": clients,
        "turns": turns,
        "rounds": rounds,
        "in_process": in_process,
        "embedder": "default model" if model else "hash",
        "seconds": seconds,
        "load": load,
        "conversations": results,
        "four": fours,
    }


# ---- report ------------------------------------------------------------------------------


def _med_max(values: Sequence[int]) -> str:
    return f"{statistics.median(values):g} / {max(values)}"


def report_b(out: dict[str, Any], label: str) -> list[str]:
    how = "in-process" if out["in_process"] else "python -m proxy serve"
    lines = [
        f"Back-to-back clients: {out['clients']} concurrent x {out['turns']} turns, "
        f"{out['rounds']} round(s) ({how}, {out['embedder']} embedder, {out['seconds']:.1f} s, "
        f"load {out['load']:.1f})",
        "",
        "| code | group | conversations | sessions per conversation median / max | split "
        "| messages stored more than once | extra copies | messages missing | order correct "
        "| stored exactly once, in order, one session "
        "| session ids in reply headers median / max | headers name the stored sessions |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: list[tuple[str, Callable[[dict[str, Any]], bool]]] = [
        ("X-Engram-Session", lambda r: r["explicit"]),
        ("  streamed", lambda r: r["explicit"] and r["stream"]),
        ("  plain", lambda r: r["explicit"] and not r["stream"]),
        ("no header", lambda r: not r["explicit"]),
        ("  streamed", lambda r: not r["explicit"] and r["stream"]),
        ("  plain", lambda r: not r["explicit"] and not r["stream"]),
    ]
    for name, keep in groups:
        rows = [r for r in out["conversations"] if keep(r)]
        if not rows:
            continue
        lines.append(
            f"| {label} | {name.strip() if not name.startswith(' ') else '… ' + name.strip()} "
            f"| {len(rows)} | {_med_max([r['sessions'] for r in rows])} "
            f"| {sum(r['sessions'] > 1 for r in rows)} "
            f"| {sum(r['duplicated'] for r in rows)} | {sum(r['extra_copies'] for r in rows)} "
            f"| {sum(r['missing'] for r in rows)} | {sum(r['ordered'] for r in rows)}/{len(rows)} "
            f"| {sum(r['exact'] for r in rows)}/{len(rows)} "
            f"| {_med_max([r['header_sessions'] for r in rows])} "
            f"| {sum(r['headers_name_stored'] for r in rows)}/{len(rows)} |"
        )
    fours = out["four"]
    if fours:
        lines += [
            "",
            "One client, no header, 4 turns back to back (streamed and plain alternate by trial)",
            "",
            "| code | trials | distinct session ids in reply headers median / max "
            "| trials with more than one | sessions stored median / max | duplicates | missing |",
            "|---|---|---|---|---|---|---|",
            f"| {label} | {len(fours)} | {_med_max([r['header_sessions'] for r in fours])} "
            f"| {sum(r['header_sessions'] > 1 for r in fours)} "
            f"| {_med_max([r['sessions'] for r in fours])} "
            f"| {sum(r['duplicated'] for r in fours)} | {sum(r['missing'] for r in fours)} |",
        ]
    odd = [
        r
        for r in out["conversations"] + fours
        if r["sessions"] > 1
        or r["duplicated"]
        or r["missing"]
        or r["unexpected"]
        or not r["headers_name_stored"]
    ]
    if odd:
        lines += ["", "Conversations not stored whole in one session:"]
        for r in odd:
            lines.append(
                f"- {r['user']} ({'header' if r['explicit'] else 'no header'}, "
                f"{'stream' if r['stream'] else 'plain'}): {r['sessions']} sessions "
                f"{r['session_sizes']}, {r['duplicated']} duplicated, {r['missing']} missing, "
                f"{r['unexpected']} unexpected, order {'ok' if r['ordered'] else 'WRONG'}, "
                f"reply headers {'name' if r['headers_name_stored'] else 'do NOT name'} "
                "the sessions stored"
            )
    return lines


def _last_byte_table(pipe: dict[str, Any]) -> list[str]:
    lines = [
        "| reply | memory off p50 / p95 | memory on p50 / p95 | added p50 / p95 "
        "| whole request off / on p50 |",
        "|---|---|---|---|---|",
    ]
    for row in pipe["rows"]:
        on, off = row["on"], row["off"]
        lines.append(
            f"| {row['transport']} | {off['p50']:.3f} / {off['p95']:.3f} "
            f"| {on['p50']:.3f} / {on['p95']:.3f} "
            f"| {on['p50'] - off['p50']:+.3f} / {on['p95'] - off['p95']:+.3f} "
            f"| {row['total_off']['p50']:.2f} / {row['total_on']['p50']:.2f} |"
        )
    return lines


STEPS = (  # the archive's steps, innermost first
    ("commit_turns", "commit_turns (inside the transaction)"),
    ("Store.write (commit)", "Store.write(commit_turns): + BEGIN/COMMIT, writer thread hops"),
    ("to_new_turns (reply)", "to_new_turns for the reply (redaction, hashes)"),
    ("MemoryService.commit", "MemoryService.commit (all of the above + indexer.submit)"),
    ("ChatPipeline._commit", "ChatPipeline._commit (+ task spawn, shield)"),
    ("to_new_turns (request)", "to_new_turns for the request (beside the upstream call)"),
)


def report_a(
    direct: list[dict[str, Any]], pipe: dict[str, Any], breakdown: dict[str, Any]
) -> list[str]:
    lines: list[str] = []
    if direct:
        lines += [
            "The commit's write transaction alone (Store.write(commit_turns), ms; "
            "rows: the new user message and the reply)",
            "",
            "| DB turns before | conversation | commits | Store.write p50 | p95 | p99 | max "
            "| commit_turns p50 / p95 | target | pass/fail | load |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in direct:
            for kind in ("new", "continued", "all"):
                w, c = row["write"][kind], row["commit_turns"][kind]
                ok = None if kind != "all" else max(w["p50"], w["p95"]) < COMMIT_TARGET_MS
                verdict = {True: "PASS", False: "FAIL", None: "-"}[ok]
                target = f"p50 and p95 < {COMMIT_TARGET_MS:g} ms" if kind == "all" else "-"
                lines.append(
                    f"| {row['db_turns']:,} | {kind} | {w['n']} | {w['p50']:.3f} | {w['p95']:.3f} "
                    f"| {w['p99']:.3f} | {w['max']:.2f} | {c['p50']:.3f} / {c['p95']:.3f} "
                    f"| {target} | {verdict} | {row['load']:.1f} |"
                )
    lines += [
        "",
        "From the pipeline's side, python -m proxy serve (hash embedder): upstream's last byte "
        f"-> client's last byte, ms ({pipe['pairs']} pairs, {pipe['gap_ms']:.0f} ms apart, "
        f"load {pipe['load']:.1f})",
        "",
        *_last_byte_table(pipe),
        "",
        "Where it goes: the same pairs through an in-process Engram (client, fake upstream and "
        f"Engram on one event loop), its archive steps timed, ms (load {breakdown['load']:.1f})",
        "",
        *_last_byte_table(breakdown),
        "",
        "| step (per memory-on request) | p50 | p95 | p99 |",
        "|---|---|---|---|",
    ]
    for key, name in STEPS:
        st = breakdown["steps"].get(key)
        if st:
            lines.append(f"| {name} | {st['p50']:.3f} | {st['p95']:.3f} | {st['p99']:.3f} |")
    return lines


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "machine": machine(),
        "code": code_label(),
        "proxy": proxy.__file__,
    }
    print(f"measuring {out['code']} ({out['proxy']})", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="engram-bench-archive-") as name:
        tmp = Path(name)
        if "a" in args.parts:
            sizes = [0, 10_000] if args.quick else [0, 10_000, 100_000]
            out["direct"] = await part_a_direct(sizes, args.commits, tmp)
            out["pipeline"] = await part_a_pipeline(args.pairs, args.gap_ms / 1000, tmp)
            out["breakdown"] = await part_a_breakdown(args.pairs, args.gap_ms / 1000)
        if "b" in args.parts:
            out["b"] = await part_b(
                args.clients,
                args.turns,
                args.rounds,
                args.trials,
                args.in_process,
                args.embedder == "model",
                tmp,
            )
    out["load_end"] = [round(x, 2) for x in os.getloadavg()]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (0 and 10k only)")
    parser.add_argument("--parts", default="ab", help="a, b or ab (default)")
    parser.add_argument("--commits", type=int, default=2000, help="(a) commits per DB size")
    parser.add_argument("--pairs", type=int, default=600, help="(a) on/off request pairs")
    parser.add_argument("--gap-ms", type=float, default=20.0, help="(a) pause between requests")
    parser.add_argument("--clients", type=int, default=16, help="(b) concurrent clients")
    parser.add_argument("--turns", type=int, default=25, help="(b) turns per client")
    parser.add_argument("--rounds", type=int, default=4, help="(b) times the clients run")
    parser.add_argument("--trials", type=int, default=40, help="(b) 4-turn single clients")
    parser.add_argument("--in-process", action="store_true", help="(b) Engram in this process")
    parser.add_argument(
        "--embedder",
        choices=("hash", "model"),
        default="hash",
        help="(b) Engram's embedder: hash (default) or the configured model (MiniLM)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.commits, args.pairs, args.rounds, args.trials = 300, 100, 1, 10
    out = asyncio.run(run(args))
    m = out["machine"]
    print("\n".join(machine_lines(m)))
    print(f"Code: {out['code']} ({out['proxy']}); load average at the end {out['load_end']}")
    if "direct" in out:
        print("\n" + "\n".join(report_a(out["direct"], out["pipeline"], out["breakdown"])))
    if "b" in out:
        print("\n" + "\n".join(report_b(out["b"], out["code"].split(" ")[0])))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
