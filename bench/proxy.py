"""Engram's overhead: the same requests sent straight to a fake upstream and through Engram.

    python -m bench.proxy [--requests N | --quick] [--json results.json]

The fake upstream (``python -m testing.fake_upstream``) and Engram (``python -m proxy serve``)
each run in their own process; this process is the load generator (one pooled aiohttp
ClientSession with keep-alive). Requests are ``POST /v1/chat/completions`` with
``X-Engram-Memory: off``, so this measures the proxy's memory-off path. Concurrency-1 figures
alternate direct and Engram requests so that both see the same machine conditions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
PATH = "/v1/chat/completions"
HEADERS = {
    "Content-Type": "application/json",
    "Authorization": "Bearer sk-bench-not-a-key",
    "X-Engram-Memory": "off",
}
_CHAT = {
    "model": "fake-model",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": "What is the capital of France? Answer in one word."},
    ],
    "temperature": 0.7,
    "max_tokens": 64,
}
BODY = json.dumps(_CHAT).encode()
STREAM_BODY = json.dumps({**_CHAT, "stream": True}).encode()

Timer = Callable[[aiohttp.ClientSession, str, bytes], Awaitable[float]]


# ---- child processes ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _tail(log: IO[bytes]) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-3000:]


async def start_fake(
    log: IO[bytes], flavor: str = "llamacpp"
) -> tuple[asyncio.subprocess.Process, str]:
    """The fake upstream in its own process (``flavor``: "llamacpp" or "ollama")."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "testing.fake_upstream", "--host", "127.0.0.1", "--port", "0",
        "--flavor", flavor,
        cwd=ROOT, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=log,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
    except TimeoutError:
        line = b""
    if not line.startswith(b"listening on "):
        await stop(proc)
        raise RuntimeError(f"fake upstream did not start: {line!r}\n{_tail(log)}")
    return proc, line.decode().split()[-1]


async def start_engram(
    upstream: str, extra: list[str], log: IO[bytes]
) -> tuple[asyncio.subprocess.Process, str]:
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--upstream", upstream,
        "--port", str(port), "--host", "127.0.0.1", *extra,
        cwd=ROOT, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline and proc.returncode is None:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{url}/engram/health") as resp:
                    if resp.status == 200:
                        return proc, url
            await asyncio.sleep(0.1)
    await stop(proc)
    raise RuntimeError(f"Engram did not become healthy at {url}:\n{_tail(log)}")


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        return
    proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), 5)
    except TimeoutError:
        proc.kill()
        await proc.wait()


# ---- load generation ---------------------------------------------------------------------


async def _check(resp: aiohttp.ClientResponse) -> None:
    if resp.status != 200:
        raise RuntimeError(f"{resp.url} answered {resp.status}: {(await resp.text())[:300]}")


async def full(session: aiohttp.ClientSession, base: str, body: bytes) -> float:
    """Seconds until the whole response has been read."""
    t0 = time.perf_counter()
    async with session.post(base + PATH, data=body, headers=HEADERS) as resp:
        await _check(resp)
        await resp.read()
    return time.perf_counter() - t0


async def first_chunk(session: aiohttp.ClientSession, base: str, body: bytes) -> float:
    """Seconds until the first body bytes arrive (the rest is then drained, untimed)."""
    t0 = time.perf_counter()
    async with session.post(base + PATH, data=body, headers=HEADERS) as resp:
        await _check(resp)
        if not await resp.content.readany():
            raise RuntimeError("empty stream")
        elapsed = time.perf_counter() - t0
        await resp.read()
    return elapsed


async def paired(
    session: aiohttp.ClientSession, urls: list[str], timer: Timer, body: bytes, n: int
) -> list[list[float]]:
    """``n`` timings per URL at concurrency 1, alternating URLs (order flipped every round)."""
    out: list[list[float]] = [[] for _ in urls]
    for i in range(n):
        order = list(enumerate(urls))
        for k, url in order if i % 2 == 0 else reversed(order):
            out[k].append(await timer(session, url, body))
    return out


async def throughput(
    session: aiohttp.ClientSession, base: str, concurrency: int, total: int
) -> float:
    """Requests per second for ``total`` non-streamed requests over ``concurrency`` workers."""
    left = total

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await full(session, base, BODY)

    await asyncio.gather(*(full(session, base, BODY) for _ in range(concurrency)))  # warm pool
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - t0)


# ---- report ------------------------------------------------------------------------------


def pct(xs: list[float], p: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1] * 1000.0


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def _row(
    name: str, unit: str, d: float, e: float | None, target: str, limit: float | None
) -> dict[str, Any]:
    row: dict[str, Any] = {"metric": name, "unit": unit, "direct": round(d, 3), "target": target}
    row["engram"] = None if e is None else round(e, 3)
    if e is None:
        row["added"], row["pass"] = None, None
    elif unit == "ms":
        row["added"] = round(e - d, 3)
        row["pass"] = None if limit is None else e - d <= limit
    else:
        row["ratio"] = round(e / d, 3)
        row["pass"] = None if limit is None else e / d >= limit
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| metric | direct | engram | added / ratio | target | pass/fail |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        unit = r["unit"]
        engram = "n/a" if r["engram"] is None else f"{r['engram']:.3f} {unit}"
        if r["engram"] is None:
            delta = "n/a"
        elif unit == "ms":
            delta = f"{r['added']:+.3f} ms"
        else:
            delta = f"{r['ratio'] * 100:.1f}%"
        verdict = {True: "PASS", False: "FAIL", None: "-"}[r["pass"]]
        direct = f"{r['direct']:.3f} {unit}" if unit == "ms" else f"{r['direct']:.0f} {unit}"
        if unit != "ms" and r["engram"] is not None:
            engram = f"{r['engram']:.0f} {unit}"
        lines.append(
            f"| {r['metric']} | {direct} | {engram} | {delta} | {r['target']} | {verdict} |"
        )
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    n, total = args.requests, args.throughput_requests
    procs: list[asyncio.subprocess.Process] = []
    with tempfile.TemporaryFile() as fake_log, tempfile.TemporaryFile() as engram_log:
        try:
            fake, upstream = await start_fake(fake_log)
            procs.append(fake)
            urls = [upstream]
            if not args.direct_only:
                proxy, engram_url = await start_engram(upstream, args.proxy_arg, engram_log)
                procs.append(proxy)
                urls.append(engram_url)
            connector = aiohttp.TCPConnector(limit=256, limit_per_host=0)
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                await check_same_reply(session, urls)
                warm = max(20, min(200, n // 10))
                await paired(session, urls, full, BODY, warm)
                await paired(session, urls, first_chunk, STREAM_BODY, warm)
                lat = await paired(session, urls, full, BODY, n)
                ttfc = await paired(session, urls, first_chunk, STREAM_BODY, n)
                rps = {c: [await throughput(session, u, c, total) for u in urls] for c in (16, 64)}
        finally:
            for proc in reversed(procs):
                await stop(proc)

    def second(xs: list[Any]) -> Any:
        return xs[1] if len(xs) > 1 else None

    def ms(xs: list[list[float]], p: int) -> tuple[float, float | None]:
        return pct(xs[0], p), (pct(xs[1], p) if len(xs) > 1 else None)

    rows = [
        _row("latency p50, non-stream, c=1", "ms", *ms(lat, 50), "added ≤ 1.5 ms", 1.5),
        _row("latency p95, non-stream, c=1", "ms", *ms(lat, 95), "added ≤ 4 ms", 4.0),
        _row("TTFC p50, stream, c=1", "ms", *ms(ttfc, 50), "added ≤ 1.5 ms", 1.5),
        _row("TTFC p95, stream, c=1", "ms", *ms(ttfc, 95), "-", None),
        _row("throughput, c=16", "req/s", rps[16][0], second(rps[16]), "-", None),
        _row("throughput, c=64", "req/s", rps[64][0], second(rps[64]), "≥ 50% of direct", 0.5),
    ]
    config = {"requests": n, "throughput_requests": total, "proxy_args": args.proxy_arg}
    return {"machine": machine(), "config": config, "metrics": rows}


async def check_same_reply(session: aiohttp.ClientSession, urls: list[str]) -> None:
    """Warn when Engram's memory-off reply differs from the upstream's."""
    replies = []
    for url in urls:
        async with session.post(url + PATH, data=BODY, headers=HEADERS) as resp:
            await _check(resp)
            replies.append(await resp.json())
    if any(r != replies[0] for r in replies[1:]):
        print("warning: Engram's reply differs from the upstream's", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="per c=1 measurement")
    parser.add_argument("--throughput-requests", type=int, default=3000, help="per c=16/c=64 run")
    parser.add_argument("--quick", action="store_true", help="smoke run: 200 / 500 requests")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--direct-only", action="store_true", help="skip Engram")
    parser.add_argument(
        "--proxy-arg", action="append", default=[], help="extra `proxy serve` argument (repeat)"
    )
    parser.add_argument("--fail-on-miss", action="store_true", help="exit 1 if a target fails")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.throughput_requests = 200, 500
    results = asyncio.run(run(args))
    m = results["machine"]
    print(f"CPU: {m['cpu']} ({m['cores']} cores), {m['platform']}")
    print(f"Python {m['python']}, aiohttp {m['aiohttp']}, {m['date']}")
    print(
        f"{args.requests} requests per c=1 metric, {args.throughput_requests} per throughput run;"
        " load generator, fake upstream and Engram share this machine.\n"
    )
    print(table(results["metrics"]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    failed = [r["metric"] for r in results["metrics"] if r["pass"] is False]
    return 1 if failed and args.fail_on_miss else 0


if __name__ == "__main__":
    raise SystemExit(main())
