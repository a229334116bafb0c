"""Backpressure: another user's small request alone, and beside one request of 4,001 messages.

    python -m bench.backpressure [--messages 4001] [--small 30] [--every 0.5] [--json out.json]

The fake upstream (``python -m testing.fake_upstream``) and Engram (``python -m proxy serve``,
the real MiniLM embedder, a fresh database) each run in their own process; this process sends
the requests. First ``--small`` small requests one at a time (each a new user, a new question):
the latency alone. Then one request of ``--messages`` messages (about 350 characters each,
1.4 MB at 4,001) from user ``big``, and, from the moment its reply arrived, one small request of
another user every ``--every`` seconds, ``--small`` of them, each sent without waiting for the
others (open loop): their latencies beside the big one. Then the time from the big request's
reply until Engram's background work (indexing its turns) is done.

Run twice per code: with the default ``[limits]`` (a request over ``max_messages`` goes as sent,
without memory) and with ``--uncapped`` (``ENGRAM_LIMITS_MAX_MESSAGES=0``: the big request is
archived and indexed, the real pressure). Code before ``[limits]`` has no caps; run it from a
worktree, its checkout first on the path::

    git worktree add /tmp/engram-before 967ad3f
    PYTHONSAFEPATH=1 PYTHONPATH=/tmp/engram-before:$PWD .venv/bin/python -m bench.backpressure
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

import proxy
from bench.common import machine, machine_lines, pct
from bench.proxy import start_engram, start_fake, stop
from proxy.config import sections
from testing.conversations import WORDS, long_conversation


async def chat(
    http: aiohttp.ClientSession, url: str, user: str, messages: list[dict[str, Any]]
) -> tuple[float, str]:
    """Seconds for one request (whole reply read) and its X-Engram-Memories header."""
    body = json.dumps({"model": "fake-model", "messages": messages}).encode()
    t0 = time.perf_counter()
    async with http.post(
        url + "/v1/chat/completions",
        data=io.BytesIO(body),
        headers={"Content-Type": "application/json", "X-Engram-User": user},
    ) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{user}: {resp.status}")
        return time.perf_counter() - t0, resp.headers.get("X-Engram-Memories", "")


def question(i: int) -> list[dict[str, Any]]:
    rnd = random.Random(1000 + i)
    words = " ".join(rnd.choice(WORDS) for _ in range(6))
    return [{"role": "user", "content": f"question {i}: what did I say about {words}?"}]


async def drained(http: aiohttp.ClientSession, url: str, limit: float) -> float | None:
    """Seconds until Engram's background tasks are done (None: not within ``limit``)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit:
        async with http.get(url + "/engram/health") as resp:
            if (await resp.json())["background_tasks"] == 0:
                return time.perf_counter() - t0
        await asyncio.sleep(0.5)
    return None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    env: dict[str, str] = {}
    if args.uncapped and "limits" in sections():
        env["ENGRAM_LIMITS_MAX_MESSAGES"] = "0"
    os.environ.update(env)
    with tempfile.TemporaryDirectory(prefix="engram-bp-") as tmp:
        log = tempfile.TemporaryFile()  # noqa: SIM115 - closed below
        fake, fake_url = await start_fake(log)
        engram, url = await start_engram(fake_url, ["--db", f"{tmp}/engram.db"], log)
        try:
            timeout = aiohttp.ClientTimeout(total=args.timeout)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                for i in range(5):  # warm-up: model, pools, caches
                    await chat(http, url, f"warm{i}", question(-1 - i))
                alone = []
                for i in range(args.small):
                    alone.append((await chat(http, url, f"alone{i}", question(i)))[0])
                    await asyncio.sleep(0.05)
                big = long_conversation(args.messages)
                big_took, _ = await chat(http, url, "big", big)
                replied = time.perf_counter()

                async def later(i: int) -> tuple[float, str]:
                    await asyncio.sleep(i * args.every)
                    return await chat(http, url, f"beside{i}", question(10_000 + i))

                beside = await asyncio.gather(*(later(i) for i in range(args.small)))
                backlog = await drained(http, url, args.timeout)
                if backlog is not None:  # from the big request's reply
                    backlog = time.perf_counter() - replied
        finally:
            await stop(engram)
            await stop(fake)
            log.close()
    caps = "none" if "limits" not in sections() else "off (max_messages 0)" if env else "default"
    waits = [t for t, _ in beside]
    notes = [h.split(";", 1)[1].strip() for _, h in beside if ";" in h]
    return {
        "code": args.code or code_label(),
        "caps": caps,
        "big_bytes": len(json.dumps(big)),
        "big_messages": len(big),
        "big_request_s": big_took,
        "alone_ms": {"p50": statistics.median(alone) * 1000, "p95": pct(alone, 95)},
        "beside_ms": {
            "first": waits[0] * 1000,
            "p50": statistics.median(waits) * 1000,
            "p95": pct(waits, 95),
            "max": max(waits) * 1000,
        },
        "beside_notes": {n: notes.count(n) for n in sorted(set(notes))},
        "backlog_s": backlog,
        "load_end": [round(x, 2) for x in os.getloadavg()],
    }


def code_label() -> str:
    """The commit of the ``proxy`` package measured (it may come from another worktree)."""
    where = Path(proxy.__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(where), "log", "-1", "--format=%h"],
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--", "proxy"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return str(where)


def table(r: dict[str, Any]) -> str:
    a, b = r["alone_ms"], r["beside_ms"]
    notes = ", ".join(f"{k} {v}" for k, v in r["beside_notes"].items()) or "-"
    backlog = f"{r['backlog_s']:.1f}" if r["backlog_s"] is not None else "> timeout"
    return (
        "| code | caps | small alone p50 / p95 (ms) | beside: first | p50 | p95 | max (ms) "
        "| degraded | big request (s) | its indexing done after (s) | load at end |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
        f"| {r['code']} | {r['caps']} | {a['p50']:.1f} / {a['p95']:.1f} | {b['first']:.0f} "
        f"| {b['p50']:.0f} | {b['p95']:.0f} | {b['max']:.0f} | {notes} "
        f"| {r['big_request_s']:.2f} | {backlog} | {' / '.join(map(str, r['load_end']))} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=4001)
    parser.add_argument("--small", type=int, default=30, help="small requests, alone and beside")
    parser.add_argument("--every", type=float, default=0.5, help="seconds between them, beside")
    parser.add_argument("--uncapped", action="store_true", help="limits.max_messages = 0")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--code", help="label of the code measured (default: its commit)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    m = machine()
    print("\n".join(machine_lines(m)))
    result = asyncio.run(run(args))
    print(
        f"\n{result['big_messages']} messages, {result['big_bytes']:,} bytes in the big request; "
        f"{args.small} small requests alone, then {args.small} beside it, one every "
        f"{args.every:g} s (open loop)\n"
    )
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps({"machine": m, **result}, indent=2) + "\n")


if __name__ == "__main__":
    main()
