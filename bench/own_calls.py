"""Engram's own calls against the user's cached prompt on a one-slot llama-server: measured.

    .venv/bin/python -m bench.own_calls [--ctx 8192] [--threads 2] [--json out.json]
    .venv/bin/python -m bench.own_calls --engram [--json out.json]

The real bundled llama-server (``proxy.bundled``, SmolLM2-135M-Instruct), ``--parallel 1``, a
fresh server for each case. A case sends (1) a conversation of about 1,500 tokens, (2) another
prompt of about 800 tokens, standing for Engram's summary request (another system message,
other text), sent in the case's way, (3) the conversation again with the reply of (1) and one
new user turn. It prints what the server reports for (3): ``timings.prompt_n`` (tokens
computed) and ``timings.cache_n`` (tokens reused from the cache), and the milliseconds the
prompt took. The baseline leaves (2) out. Every request is greedy (``temperature: 0``) and
generates at most 8 tokens.

Cases: the summary sent as is; with ``cache_prompt: false``; with ``id_slot: 0``; each on the
server's defaults (its host-memory prompt cache, ``--cache-ram``, on at 8,192 MiB) and with
``--cache-ram 0`` (as a llama-server from before that cache, or one started without it); the
slot saved before (2) and restored after it (``--slot-save-path``, ``POST /slots/0?action=save``
and ``restore``); for comparison, two slots (``--parallel 2``); and, on the defaults, (2)
generating 128 tokens while (3) is sent, 0.3 s after it (an agent loop's next turn): (3)'s wall
time then holds the wait for the slot.

``--engram``: the same question end to end, through an in-process Engram (``testing.harness``:
hash embedder, ``summary.budget_share = 1``, ``summary.max_tokens = 128``, the default
``prompt.mode``) in front of the real llama-server with a 2,048-token context, ``--parallel 1``,
on its defaults and with ``--cache-ram 0``. A client sends a conversation turn after turn (a user
message of about 120 tokens, replies of at most 16), each the instant the last reply ended, as an
agent loop does, until Engram's window cut has scheduled a rolling summary; then ``--turns`` (8)
more back to back, then, once Engram's background work is done, one after that ("after the
pause"). Each with Engram's own calls waiting for an idle upstream (``upstream.own_calls_idle =
5``) and without (``own_calls_max_wait = 0``). Printed per phase: the turns, those whose
forwarded prompt extended the previous one message by message (the server could reuse all of
it), how many of those the server recomputed from scratch (reused under 64 tokens), the tokens
it computed and reused for them, and the client's mean wall time per turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from proxy.bundled.cache import binary_path, command_for
from proxy.bundled.smoke import _free_port, _healthy
from proxy.services import SERVICES
from testing.harness import settle, start_engram

WORDS = [
    "heron",
    "river",
    "stone",
    "lantern",
    "copper",
    "orchard",
    "violet",
    "harbour",
    "meadow",
    "signal",
    "thunder",
    "marble",
    "compass",
    "garden",
    "winter",
    "falcon",
    "saddle",
    "cobalt",
    "willow",
    "ember",
    "canyon",
    "velvet",
    "quarry",
    "cedar",
]


def conversation(turns: int = 12) -> list[dict[str, str]]:
    """A deterministic chat of ``turns`` exchanges, about 1,500 tokens of SmolLM2's."""
    messages = [{"role": "system", "content": "You are a helpful assistant for a travel diary."}]
    for i in range(turns):
        words = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(40))
        messages.append(
            {"role": "user", "content": f"Day {i + 1}: I saw {words}. What should I note?"}
        )
        messages.append(
            {"role": "assistant", "content": f"Note for day {i + 1}: {words[::-1][:200]}."}
        )
    return messages


def summary_request() -> list[dict[str, str]]:
    """Another prompt of about 800 tokens: what Engram's summariser sends."""
    lines = [
        f"user: item {i} is the {WORDS[i % len(WORDS)]} near the {WORDS[(i * 5) % len(WORDS)]}"
        for i in range(70)
    ]
    return [
        {"role": "system", "content": "You maintain the running summary of a conversation."},
        {"role": "user", "content": "Conversation:\n" + "\n".join(lines) + "\n\nSummarise it."},
    ]


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def chat(url: str, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return post(
        url,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 8, "temperature": 0, **extra},
    )


def start(
    binary: Path, ctx: int, threads: int, parallel: int, extra: list[str]
) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = command_for(binary, port, ctx=ctx, threads=threads, parallel=parallel, extra=extra)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}: {cmd}")
        if _healthy(url):
            return proc, url
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("llama-server did not become ready")


def case(
    binary: Path,
    args: argparse.Namespace,
    *,
    server: list[str],
    parallel: int = 1,
    summary: dict[str, Any] | None,
    save_restore: bool = False,
    overlap: bool = False,
) -> dict[str, Any]:
    """One case on a fresh server: the timings of the user's next turn, and of each step.
    ``overlap``: the summary generates ``OVERLAP_TOKENS`` tokens and the user's turn is sent
    while it does (``OVERLAP_AFTER`` s after it), as an agent loop's next turn would be."""
    with tempfile.TemporaryDirectory(prefix="engram-slots-") as slots_dir:
        extra = [*server, "--slot-save-path", slots_dir] if save_restore else server
        proc, url = start(binary, args.ctx, args.threads, parallel, extra)
        try:
            msgs = conversation()
            first = chat(url, msgs)
            out: dict[str, Any] = {"conversation": first.get("timings")}
            if save_restore:
                saved = post(url, "/slots/0?action=save", {"filename": "user.bin"})
                out["save_ms"] = (saved.get("timings") or {}).get("save_ms")
            background = None
            if summary is not None and overlap:
                long = {**summary, "max_tokens": OVERLAP_TOKENS, "ignore_eos": True}

                def run() -> None:
                    out["summary"] = chat(url, summary_request(), **long).get("timings")

                background = threading.Thread(target=run)
                background.start()
                time.sleep(OVERLAP_AFTER)
            elif summary is not None:
                out["summary"] = chat(url, summary_request(), **summary).get("timings")
            if save_restore:
                restored = post(url, "/slots/0?action=restore", {"filename": "user.bin"})
                out["restore_ms"] = (restored.get("timings") or {}).get("restore_ms")
            reply = first["choices"][0]["message"]["content"]
            later = [
                *msgs,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "And what about day 13?"},
            ]
            began = time.monotonic()
            out["next_turn"] = chat(url, later).get("timings")
            out["next_turn_wall_ms"] = round((time.monotonic() - began) * 1000)
            if background is not None:
                background.join()
            return out
        finally:
            proc.terminate()
            proc.wait(10)


OVERLAP_TOKENS = 128
OVERLAP_AFTER = 0.3

CASES: list[tuple[str, dict[str, Any]]] = [
    ("baseline: no summary request", {"server": [], "summary": None}),
    ("summary as is", {"server": [], "summary": {}}),
    ("summary, cache_prompt: false", {"server": [], "summary": {"cache_prompt": False}}),
    ("summary, id_slot: 0", {"server": [], "summary": {"id_slot": 0}}),
    ("--cache-ram 0, baseline", {"server": ["--cache-ram", "0"], "summary": None}),
    ("--cache-ram 0, summary as is", {"server": ["--cache-ram", "0"], "summary": {}}),
    (
        "--cache-ram 0, summary, cache_prompt: false",
        {"server": ["--cache-ram", "0"], "summary": {"cache_prompt": False}},
    ),
    (
        "--cache-ram 0, summary, id_slot: 0",
        {"server": ["--cache-ram", "0"], "summary": {"id_slot": 0}},
    ),
    (
        "--cache-ram 0, slot saved before and restored after",
        {"server": ["--cache-ram", "0"], "summary": {}, "save_restore": True},
    ),
    (
        "--cache-ram 0 --parallel 2, summary as is",
        {"server": ["--cache-ram", "0"], "summary": {}, "parallel": 2},
    ),
    (
        f"summary of {OVERLAP_TOKENS} tokens in flight as the turn comes",
        {"server": [], "summary": {}, "overlap": True},
    ),
]


def user_message(i: int) -> str:
    words = " ".join(WORDS[(i * 11 + j) % len(WORDS)] for j in range(90))
    return f"Log entry {i}: {words}. Reply with one short sentence."


async def through_engram(url: str, wait: bool, turns: int) -> dict[str, Any]:
    """One conversation through Engram: turns sent back to back until a summary is due, then
    ``turns`` more, then a pause until Engram's own calls are done and one turn more. Each
    turn's record says whether its forwarded prompt extended the previous one (message by
    message: then the server can reuse all of that) and what the server computed and reused."""
    upstream: dict[str, Any] = {"own_calls_idle": 5.0}
    if not wait:
        upstream["own_calls_max_wait"] = 0.0
    engram = await start_engram(
        url, upstream=upstream, summary={"budget_share": 1.0, "max_tokens": 128}
    )
    services = engram.app[SERVICES]
    summarizer = services.require_memory().memory.summarizer
    assert summarizer is not None
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You keep a log."}]
    records: list[dict[str, Any]] = []
    previous: list[Any] = []

    async def turn(http: aiohttp.ClientSession, i: int, phase: str) -> None:
        nonlocal previous
        messages.append({"role": "user", "content": user_message(i)})
        calls_before = summarizer.made + summarizer.failed
        seen = len(engram.turns)
        began = time.monotonic()
        async with http.post(
            engram.url + "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 16, "temperature": 0},
            headers={"X-Engram-User": "bench", "X-Engram-Session": "log"},
        ) as r:
            body = await r.json()
        wall = round((time.monotonic() - began) * 1000)
        messages.append(body["choices"][0]["message"])
        for _ in range(1000):  # the harness's reply hook runs in the background
            if len(engram.turns) > seen:
                break
            await asyncio.sleep(0.01)
        sent = engram.turns[-1]
        forwarded = list(sent.forwarded if sent.forwarded is not None else sent.conv.messages)
        t = body.get("timings") or {}
        records.append(
            {
                "phase": phase,
                "extends": bool(previous) and forwarded[: len(previous)] == previous,
                "prompt_n": t.get("prompt_n"),
                "cache_n": t.get("cache_n"),
                "wall_ms": wall,
                "own_calls_done_meanwhile": summarizer.made + summarizer.failed - calls_before,
            }
        )
        previous = [*forwarded, body["choices"][0]["message"]]

    try:
        # no total timeout: a turn may wait long behind Engram's own calls on a slow CPU
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            i = 0
            while not summarizer.running and i < 40:
                await turn(http, i, "before")
                await asyncio.sleep(0.05)  # a scheduled summary job starts
                i += 1
            if not summarizer.running:
                raise RuntimeError("no summary was scheduled in 40 turns")
            for j in range(turns):
                await turn(http, 100 + j, "back to back")
            await settle(engram, timeout=900)  # the pause: Engram's own calls run
            await turn(http, 200, "after the pause")
    finally:
        await engram.close()
    return {
        "records": records,
        "summaries_made": summarizer.made,
        "own_calls_delayed": services.activity.delayed,
        "own_calls_forced": services.activity.forced,
    }


def engram_cases(binary: Path, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    head = f"{'server':14} {'own calls':14} {'turns':20} {'n':>2} {'extend':>6} "
    print(head + f"{'evicted':>7} {'prompt_n':>8} {'cache_n':>8} {'wall ms':>8}")
    for server_name, extra in (("defaults", []), ("--cache-ram 0", ["--cache-ram", "0"])):
        for wait in (False, True):
            proc, url = start(binary, 2048, args.threads, 1, extra)
            try:
                got = asyncio.run(through_engram(url, wait, args.turns))
            finally:
                proc.terminate()
                proc.wait(10)
            gate = "wait for idle" if wait else "at once"
            results[f"{server_name}, {gate}"] = got
            for phase in ("back to back", "after the pause"):
                rows = [r for r in got["records"] if r["phase"] == phase]
                ext = [r for r in rows if r["extends"]]
                # extended the last prompt, yet the server reused almost nothing of it
                evicted = sum(1 for r in ext if (r["cache_n"] or 0) < 64)
                print(
                    f"{server_name:14} {gate:14} {phase:20} {len(rows):>2} {len(ext):>6} "
                    f"{evicted:>7} {sum(r['prompt_n'] or 0 for r in ext):>8} "
                    f"{sum(r['cache_n'] or 0 for r in ext):>8} "
                    f"{round(sum(r['wall_ms'] for r in rows) / max(1, len(rows))):>8}",
                    flush=True,
                )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write every timing here")
    parser.add_argument("--only", default="", help="the cases whose name holds this text")
    parser.add_argument("--engram", action="store_true", help="end to end through Engram")
    parser.add_argument("--turns", type=int, default=8, help="--engram: turns after the cut")
    args = parser.parse_args()
    binary = binary_path()
    if binary is None:
        print("llama-server is not built: make e2e-deps", file=sys.stderr)
        return 2
    if args.engram:
        found = engram_cases(binary, args)
        if args.json:
            args.json.write_text(json.dumps(found, indent=1))
        return 0
    results = {}
    print(f"{'case':55} {'prompt_n':>8} {'cache_n':>8} {'prompt ms':>9} {'wall ms':>8}")
    for name, spec in CASES:
        if args.only not in name:
            continue
        got = case(binary, args, **spec)
        results[name] = got
        t = got["next_turn"] or {}
        print(
            f"{name:55} {t.get('prompt_n')!s:>8} {t.get('cache_n')!s:>8} "
            f"{t.get('prompt_ms', 0):9.0f} {got['next_turn_wall_ms']:8}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
