"""Engram's added latency on every chat API, memory off and on.

    python -m bench.apis [--requests N | --quick] [--warmup N] [--embedder NAME] [--json out.json]

For each API Engram serves through its memory pipeline (OpenAI chat completions, Anthropic
Messages, OpenAI Responses, Ollama's ``/api/chat``), the same requests go straight to the fake
upstream and through Engram, alternating (order flipped every round) at concurrency 1, so both
see the same machine conditions: the whole reply (non-streamed) and the time to the first body
bytes (streamed), median and p95, with ``X-Engram-Memory: off`` and with memory on.

Memory-on requests are what users send: each one a NEW conversation (a distinct user message,
one of four users), through the real default embedder unless ``--embedder`` says otherwise,
into a database that a warm-up of conversations has filled first, so recall has something to
search. Between memory-on requests the load generator waits (untimed) until Engram's background
work (archiving, embedding) is done, as it is by the time a person sends the next message.

The fake upstream and Engram run in their own processes (bench.proxy's helpers): a llama-server
flavoured fake behind one Engram for chat completions, Messages and Responses (llama-server
serves all three), an Ollama flavoured fake behind another for ``/api/chat``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import machine, machine_lines
from bench.proxy import pct, start_engram, start_fake, stop

SYSTEM = "You are a helpful assistant. Answer briefly."
MODEL = "fake-model"
USERS = 4
BASE_HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench-not-a-key"}


@dataclass(frozen=True)
class Api:
    name: str
    path: str
    flavor: str  # the fake upstream that serves it natively
    headers: dict[str, str]
    body: Callable[[str, bool], dict[str, Any]]  # (user text, stream) -> request body


def _chat(text: str, stream: bool) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    return {"model": MODEL, "messages": messages, "max_tokens": 64, "stream": stream}


def _messages(text: str, stream: bool) -> dict[str, Any]:
    messages = [{"role": "user", "content": text}]
    return {"model": MODEL, "max_tokens": 64, "system": SYSTEM, "messages": messages,
            "stream": stream}  # fmt: skip


def _responses(text: str, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "instructions": SYSTEM, "input": text, "max_output_tokens": 64,
            "store": False, "stream": stream}  # fmt: skip


def _ollama(text: str, stream: bool) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    return {"model": MODEL, "messages": messages, "stream": stream}


ANTHROPIC = {"anthropic-version": "2023-06-01"}
APIS = [
    Api("chat completions", "/v1/chat/completions", "llamacpp", {}, _chat),
    Api("Anthropic Messages", "/v1/messages", "llamacpp", ANTHROPIC, _messages),
    Api("OpenAI Responses", "/v1/responses", "llamacpp", {}, _responses),
    Api("Ollama /api/chat", "/api/chat", "ollama", {}, _ollama),
]

_THINGS = ["bicycle", "laptop", "garden", "violin", "camera", "kayak", "telescope", "piano"]
_PLACES = ["in the garage", "at my sister's", "in the attic", "at the office", "by the window"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_COLOURS = ["red", "green", "blue", "yellow", "black", "silver", "orange"]


def user_text(i: int) -> str:
    """A distinct first message of a new conversation (a fact and a question)."""
    thing, place = _THINGS[i % len(_THINGS)], _PLACES[(i // 3) % len(_PLACES)]
    day, colour = _DAYS[(i // 7) % len(_DAYS)], _COLOURS[(i // 5) % len(_COLOURS)]
    return (
        f"Note {i}: my {colour} {thing} is {place} and I use it every {day}. "
        f"What should I check on the {thing} before {day}?"
    )


# ---- timing ------------------------------------------------------------------------------

Timer = Callable[
    [aiohttp.ClientSession, str, dict[str, str], bytes], Awaitable[tuple[float, str | None]]
]


async def _check(resp: aiohttp.ClientResponse) -> None:
    if resp.status != 200:
        raise RuntimeError(f"{resp.url} answered {resp.status}: {(await resp.text())[:300]}")


async def whole(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes
) -> tuple[float, str | None]:
    """Seconds until the whole reply has been read, and X-Engram-Memories."""
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as resp:
        await _check(resp)
        await resp.read()
    return time.perf_counter() - t0, resp.headers.get("X-Engram-Memories")


async def first_chunk(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes
) -> tuple[float, str | None]:
    """Seconds until the first body bytes arrive (the rest is drained, untimed)."""
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as resp:
        await _check(resp)
        if not await resp.content.readany():
            raise RuntimeError(f"{url}: empty stream")
        elapsed = time.perf_counter() - t0
        await resp.read()
    return elapsed, resp.headers.get("X-Engram-Memories")


@dataclass
class Engram:
    url: str
    token: str

    async def counters(self, session: aiohttp.ClientSession) -> dict[str, float]:
        headers = {"Authorization": f"Bearer {self.token}"}
        async with session.get(self.url + "/engram/metrics", headers=headers) as resp:
            await _check(resp)
            text = await resp.text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    async def settle(self, session: aiohttp.ClientSession, timeout: float = 60.0) -> None:
        """Wait until Engram's background work (archiving, embedding) is done."""
        deadline = time.monotonic() + timeout
        while (await self.counters(session)).get("engram_background_tasks", 0) > 0:
            if time.monotonic() > deadline:
                raise RuntimeError("Engram's background work did not finish")
            await asyncio.sleep(0.002)


class Texts:
    """Distinct user messages, numbered across the whole run."""

    def __init__(self) -> None:
        self.next = 0

    def take(self) -> tuple[str, dict[str, str]]:
        i, self.next = self.next, self.next + 1
        return user_text(i), {"X-Engram-User": f"bench-user-{i % USERS}"}


async def measure(
    session: aiohttp.ClientSession,
    api: Api,
    upstream: str,
    engram: Engram,
    timer: Timer,
    memory: bool,
    n: int,
    texts: Texts,
) -> tuple[list[float], list[float], list[str]]:
    """``n`` paired timings (direct, through Engram) and Engram's X-Engram-Memories values."""
    direct: list[float] = []
    through: list[float] = []
    injected: list[str] = []
    stream = timer is first_chunk
    fixed = json.dumps(api.body(user_text(0), stream)).encode()
    for i in range(n):
        headers = {**BASE_HEADERS, **api.headers}
        body = fixed
        if memory:
            text, who = texts.take()
            headers.update(who)
            body = json.dumps(api.body(text, stream)).encode()
        else:
            headers["X-Engram-Memory"] = "off"
        order = [(upstream, direct), (engram.url, through)]
        for base, out in order if i % 2 == 0 else reversed(order):
            elapsed, memories = await timer(session, base + api.path, headers, body)
            out.append(elapsed)
            if base == engram.url and memory:
                injected.append(memories or "")
        if memory:
            await engram.settle(session)
    return direct, through, injected


async def warm_up(
    session: aiohttp.ClientSession, apis: list[Api], engram: Engram, n: int, texts: Texts
) -> None:
    """``n`` memory-on conversations through Engram, round robin over ``apis``, archived."""
    for i in range(n):
        api = apis[i % len(apis)]
        text, who = texts.take()
        body = json.dumps(api.body(text, i % 2 == 1)).encode()
        await whole(session, engram.url + api.path, {**BASE_HEADERS, **api.headers, **who}, body)
    await engram.settle(session, timeout=600.0)


# ---- report ------------------------------------------------------------------------------


def _count(value: str) -> int:
    head = value.split(";", 1)[0].strip()
    return int(head) if head.isdigit() else 0


def row(
    api: str, memory: bool, metric: str, times: tuple[list[float], list[float]], injected: list[str]
) -> dict[str, Any]:
    d, e = times
    r: dict[str, Any] = {"api": api, "memory": "on" if memory else "off", "metric": metric}
    for p in (50, 95):
        r[f"direct_p{p}"] = round(pct(d, p), 3)
        r[f"engram_p{p}"] = round(pct(e, p), 3)
        r[f"added_p{p}"] = round(pct(e, p) - pct(d, p), 3)
    counts = [_count(v) for v in injected]
    r["memories_median"] = statistics.median(counts) if counts else None
    r["fts_only"] = sum("fts-only" in v for v in injected)
    return r


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| API | memory | metric | direct p50 | Engram p50 | added p50 | direct p95 | Engram p95 "
        "| added p95 | memories injected (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["api"], r["memory"], r["metric"]]
        for p in (50, 95):
            cells += [f"{r[f'direct_p{p}']:.2f} ms", f"{r[f'engram_p{p}']:.2f} ms"]
            cells.append(f"{r[f'added_p{p}']:+.2f} ms")
        m = r["memories_median"]
        cells.append("-" if m is None else f"{m:g}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------


async def _start(
    flavor: str, db: Path, stack: contextlib.ExitStack, procs: list[asyncio.subprocess.Process]
) -> tuple[str, Engram]:
    """A fake upstream of ``flavor`` and an Engram (database ``db``) in front of it."""
    fake_log = stack.enter_context(tempfile.TemporaryFile())  # noqa: SIM115 (closed by stack)
    engram_log = stack.enter_context(tempfile.TemporaryFile())  # noqa: SIM115
    fake, upstream = await start_fake(fake_log, flavor)
    procs.append(fake)
    proxy, url = await start_engram(upstream, ["--db", str(db)], engram_log)
    procs.append(proxy)
    token = await asyncio.to_thread(Path(f"{db}.admin-token").read_text)
    return upstream, Engram(url, token.strip())


async def cases(
    session: aiohttp.ClientSession, setups: dict[str, tuple[str, Engram]], args: Any
) -> tuple[list[dict[str, Any]], int]:
    """The warm-up, then every (API, memory, metric) case; the rows and conversations sent."""
    texts = Texts()
    for flavor, (_, engram) in setups.items():
        apis = [a for a in APIS if a.flavor == flavor]
        await warm_up(session, apis, engram, args.warmup, texts)
    rows = []
    for api in APIS:
        upstream, engram = setups[api.flavor]
        for memory in (False, True):
            for metric, timer in (("whole reply", whole), ("TTFC, stream", first_chunk)):
                case = (session, api, upstream, engram, timer, memory)
                await measure(*case, args.pairs, texts)  # untimed warm-up of this case
                direct, through, injected = await measure(*case, args.requests, texts)
                rows.append(row(api.name, memory, metric, (direct, through), injected))
                added = rows[-1]["added_p50"]
                note = f"  {api.name}, memory {rows[-1]['memory']}, {metric}: added p50"
                print(f"{note} {added:+.2f} ms", file=sys.stderr)
    return rows, texts.next


async def run(args: argparse.Namespace) -> dict[str, Any]:
    procs: list[asyncio.subprocess.Process] = []
    counters: dict[str, dict[str, float]] = {}
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="engram-bench-apis-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        try:
            setups = {}
            for flavor in sorted({a.flavor for a in APIS}):
                setups[flavor] = await _start(flavor, Path(tmp) / f"{flavor}.db", stack, procs)
            connector = aiohttp.TCPConnector(limit=16)
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                rows, stored = await cases(session, setups, args)
                for flavor, (_, engram) in setups.items():
                    counters[flavor] = await engram.counters(session)
        finally:
            for proc in reversed(procs):
                await stop(proc)
    config = {
        "requests": args.requests,
        "warmup_conversations": args.warmup,
        "embedder": args.embedder or "default (engram/all-MiniLM-L6-v2-int8)",
        "conversations_stored": stored,
        "seconds": round(time.monotonic() - started, 1),
    }
    return {"machine": args.machine, "config": config, "rows": rows, "counters": counters}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="timed pairs per case")
    parser.add_argument("--warmup", type=int, default=200, help="conversations stored first")
    parser.add_argument("--quick", action="store_true", help="smoke run: 30 pairs, 20 warm-up")
    parser.add_argument(
        "--embedder", default="", help='Engram\'s embedder (default: its default model; "hash")'
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.warmup = 30, 20
    args.pairs = max(5, min(30, args.requests // 10))
    if args.embedder:
        os.environ["ENGRAM_EMBEDDER_MODEL"] = args.embedder  # read by the `proxy serve` child
    args.machine = machine()  # load average before the run starts
    results = asyncio.run(run(args))
    c = results["config"]
    print("\n".join(machine_lines(results["machine"])))
    print(
        f"{c['requests']} timed pairs per case (direct and through Engram alternating, c=1); "
        f"embedder {c['embedder']}; {c['warmup_conversations']} warm-up conversations, "
        f"{c['conversations_stored']} stored in all; {c['seconds']} s; load generator, fake "
        "upstreams and Engrams share this machine.\n"
    )
    print(table(results["rows"]))
    fts = sum(r["fts_only"] for r in results["rows"])
    if fts:
        print(f"\n{fts} memory-on requests recalled by full-text search alone (recall deadline)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
