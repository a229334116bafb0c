"""What each real client sends, replayed through Engram: how Engram treats each kind of request,
and the errors of the structural rule that tells a client's side requests from its user's turns
(issue 38; :mod:`proxy.chat.machinery`).

The traffic is what the tests recorded from the real clients (``tests/data/clients/*.jsonl``,
:mod:`testing.traffic`): every request each client sent straight to the fake upstream, in order.
Each client's requests are sent again, in that order and with their headers, through a new
Engram in front of the fake upstream, which answers as the model did then (the recorded reply
where there is one, as for Open WebUI against the real llama-server; else its echo, which is
what the agents got), so each conversation resent matches what was stored. A request's kind is
what the recording says (Open WebUI's ``kind``: chat, title, tags, follow-ups) or, for the
agents, whether its system text or current turn is a known client prompt
(:func:`proxy.chat.identity.is_housekeeping`): then a side request, else a turn of the user's.

For each client: requests by kind; how many side requests the structural rule caught, how many
the known texts caught, how many neither (archived or given memory); the rule's false positives
(turns it took for side requests); sessions made; and the time Engram adds to each request (the
same request timed straight to the fake upstream, then through Engram).

    .venv/bin/python -m bench.clients                 # every recorded client
    .venv/bin/python -m bench.clients --client openwebui
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import DEFAULT_LOCOMO, load_locomo, machine, machine_lines
from proxy.chat.identity import is_housekeeping
from proxy.chat.machinery import fold, quotes_any
from proxy.said import said_key
from proxy.services import SERVICES
from testing.fake_upstream import FakeUpstream
from testing.harness import settle, start_engram
from testing.traffic import TRAFFIC_DIR

REAL_MODEL = "engram/all-MiniLM-L6-v2-q8"
CHAT_PATHS = ("/v1/chat/completions", "/chat/completions", "/v1/messages", "/v1/responses")
KEEP_HEADERS = ("x-openwebui-", "x-engram-", "x-session-id", "anthropic-", "session-id")


@dataclass
class Tally:
    client: str
    kinds: Counter[str] = field(default_factory=Counter)
    side_by_rule: int = 0
    side_by_text: int = 0
    side_missed: int = 0  # archived or given memory
    side_given_memory: int = 0
    turns_taken_by_rule: int = 0  # the rule's false positives
    turns_archived: int = 0
    sessions: int = 0
    memory_ms: list[float] = field(default_factory=list)  # each request through Engram
    direct_ms: list[float] = field(default_factory=list)  # the same, straight to the fake


def said(reply: str, _last: str) -> str:
    """What the fake answers: the reply the model gave then."""
    return reply


def kind_of(line: dict[str, Any]) -> str:
    """``turn`` or the side request's kind."""
    if line.get("kind"):
        return "turn" if line["kind"] == "chat" else str(line["kind"])
    body = line.get("body")
    messages = body.get("messages") or [] if isinstance(body, dict) else []
    if isinstance(body, dict) and body.get("system"):  # Anthropic's top-level system
        system = body["system"]
        text = system if isinstance(system, str) else " ".join(b.get("text", "") for b in system)
        messages = [{"role": "system", "content": text}, *messages]
    return "side" if is_housekeeping(messages) else "turn"


def recorded(path: Path) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    direct = [x for x in lines if str(x.get("via", "")).startswith("direct")]
    return sorted(direct, key=lambda x: (str(x.get("via")), x.get("seq", 0)))


def _messages(line: dict[str, Any]) -> list[dict[str, Any]]:
    body = line.get("body")
    messages = body.get("messages") if isinstance(body, dict) else None
    return [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []


def reply_then(lines: list[dict[str, Any]], i: int) -> str | None:
    """What the model answered request ``i``, where the recording does not say: the reply
    after its last user message in a later request of the same run (aider and Qwen Code send
    their history again, reworded: matched by what was said, :mod:`proxy.said`)."""
    if isinstance(lines[i].get("reply"), str):
        return str(lines[i]["reply"])
    mine = _messages(lines[i])
    if not mine or mine[-1].get("role") != "user":
        return None
    asked = said_key(mine[-1], False)[0]
    for later in lines[i + 1 :]:
        if later.get("via") != lines[i].get("via"):
            continue
        msgs = _messages(later)
        for a, b in itertools.pairwise(msgs):
            answered = a.get("role") == "user" and b.get("role") == "assistant"
            if answered and isinstance(b.get("content"), str) and said_key(a, False)[0] == asked:
                return str(b["content"])
    return None


async def replay(path: Path) -> Tally:
    lines = recorded(path)
    tally = Tally(path.stem)
    async with FakeUpstream() as fake, aiohttp.ClientSession() as http:
        # The default embedding model and relevance gate, as a user runs Engram.
        engram = await start_engram(
            fake.url, embedder={"model": REAL_MODEL}, retrieval={"gate": True}
        )
        try:
            memory = engram.app[SERVICES].pipelines["openai-chat"].memory
            echo = fake.reply_text
            assert memory is not None
            for i, line in enumerate(lines):
                if line.get("path") not in CHAT_PATHS or line.get("method") != "POST":
                    continue
                kind = kind_of(line)
                tally.kinds[kind] += 1
                headers = {
                    k: v
                    for k, v in (line.get("headers") or {}).items()
                    if k.lower().startswith(KEEP_HEADERS) or k.lower() == "content-type"
                }
                headers.setdefault("X-Engram-User", f"bench-{path.stem}")
                reply = reply_then(lines, i)  # what the model said then (a real one, maybe)
                said_then = functools.partial(said, reply) if isinstance(reply, str) else None
                fake.reply_text = said_then or echo
                started = time.perf_counter()
                async with http.post(fake.url + line["path"], json=line["body"]) as r:
                    await r.read()  # straight to the model server, for the time it takes
                tally.direct_ms.append((time.perf_counter() - started) * 1000)
                before = memory.client_tasks
                started = time.perf_counter()
                async with http.post(
                    engram.url + line["path"], json=line["body"], headers=headers
                ) as r:
                    await r.read()
                    archived = "X-Engram-Session" in r.headers
                    given = int((r.headers.get("X-Engram-Memories") or "0").split(";")[0])
                tally.memory_ms.append((time.perf_counter() - started) * 1000)
                by_rule = memory.client_tasks > before
                if kind == "turn":
                    tally.turns_taken_by_rule += by_rule
                    tally.turns_archived += archived
                elif by_rule:
                    tally.side_by_rule += 1
                elif not archived and not given:
                    tally.side_by_text += 1
                else:
                    tally.side_missed += 1
                    tally.side_given_memory += given > 0
                await settle(engram)
            store = engram.app[SERVICES].store
            assert store is not None
            users = {f"bench-{path.stem}"} | {
                h
                for line in lines
                for k, h in (line.get("headers") or {}).items()
                if k.lower() == "x-openwebui-user-id"
            }
            for user in users:
                tally.sessions += len(await store.list_sessions(user))
        finally:
            await engram.close()
    return tally


def table(tallies: list[Tally]) -> str:
    rows = [
        "| client | requests by kind | side: caught by the rule / by known texts / missed "
        "(given memory) | turns taken by the rule (false positives) | turns archived | "
        "sessions | added by Engram per request, p50 / p95 |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in tallies:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(t.kinds.items()))
        added = sorted(a - d for a, d in zip(t.memory_ms, t.direct_ms, strict=True))
        p95 = added[min(len(added) - 1, int(len(added) * 0.95))] if added else 0.0
        p50 = statistics.median(added) if added else 0.0
        rows.append(
            f"| {t.client} | {kinds} | {t.side_by_rule} / {t.side_by_text} / "
            f"{t.side_missed} ({t.side_given_memory}) | {t.turns_taken_by_rule} | "
            f"{t.turns_archived} | {t.sessions} | {p50:.1f} / {p95:.1f} ms |"
        )
    return "\n".join(rows)


def locomo_false_positives() -> tuple[int, int, int, int]:
    """The rule on LoCoMo's people (:func:`proxy.chat.machinery.quotes_any`), each turn while its
    conversation so far is live (its latest turns): sent alone as a new chat's first message;
    sent again, the same words twice (the turn itself among the live ones); and after the last
    exchange quoted whole (a person quoting it to go on from it: this the rule takes, by
    design). Returns (turns, taken alone, taken sent twice, taken after a quoted exchange)."""
    convs, _, _ = load_locomo(DEFAULT_LOCOMO)
    alone = twice = quoted = total = 0
    for conv in convs:
        turns = conv.turns
        for i in range(2, len(turns)):
            before = [(t.role, t.content) for t in reversed(turns[max(0, i - 4) : i])]
            with_it = [(t.role, t.content) for t in reversed(turns[max(0, i - 3) : i + 1])]
            words = fold(turns[i].content)
            total += 1
            alone += quotes_any(words, [before])
            twice += quotes_any(words, [with_it])
            exchange = fold(f"{turns[i - 2].content}\n{turns[i - 1].content}\n{turns[i].content}")
            quoted += quotes_any(exchange, [before])
    return total, alone, twice, quoted


async def main_async(args: argparse.Namespace) -> None:
    print("\n".join(machine_lines(machine())))
    files = sorted(TRAFFIC_DIR.glob("*.jsonl"))
    if args.client:
        files = [f for f in files if f.stem.startswith(args.client)]
    tallies = [await replay(f) for f in files]
    print(table(tallies))
    if not args.client:
        total, alone, twice, quoted = locomo_false_positives()
        print(
            f"\nLoCoMo, {total} turns, each while its conversation is live, taken by the rule: "
            f"sent alone as a new chat {alone}; the same words sent twice {twice}; after the "
            f"last exchange quoted whole {quoted} (by design)."
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--client", help="only the recordings whose name starts so")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
