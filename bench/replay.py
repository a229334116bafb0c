"""What Engram forwards in a long chat: LoCoMo conversations replayed through a running Engram.

    .venv/bin/python -m bench.replay [--conversations N] [--quick] [--json out.json]
        [--budgets 2048,4096] [--modes zones,stable] [--set section.key=value ...]

Each LoCoMo conversation becomes one chat: the speaker of its first turn is the user, the other
the assistant; consecutive turns of one speaker are joined (a blank line between) into one
message so that user and assistant alternate; the first message of each LoCoMo session starts
with ``[<session date>]``; image captions are appended as `` [image: caption]``. The client
resends the whole history with every request (as real clients do), under a fixed per-conversation
system prompt, ``X-Engram-User: <sample_id>`` and ``X-Engram-Session: <sample_id>``. The fake
upstream answers each request with the recorded next turn, so the assistant turns in the history
are LoCoMo's; a conversation that ends on a user turn gets the reply "OK." to its last request.
Before every next request the script waits until Engram's background archiving is done.

Then every question of categories 1-4 is asked at the end of its conversation: the full history
plus the question as a new user message, with ``X-Engram-Memory: read-only`` in the same session
(the question is recalled against, never archived; the fake's reply to it is empty, since
read-only mode still archives a reply that has text). An evidence turn counts as in the prompt
when the chat message holding it (whitespace collapsed, as memory lines show it) appears in a
forwarded message; its zone is where: ``primacy-memory`` (memory block in the system message,
mode ``zones``), ``recency-memory`` (memory block leading the new user message, mode
``stable``), ``recency-summary``, ``recency-window`` (the recent turns), or ``absent``. A question
is served when all its evidence turns are in the prompt (in brackets: at least one of them).
``--diagnose`` ranks every absent evidence turn in a top-50 search of the same Retriever with
the window's turns left out: beyond the memory budget, or not found at all?

Settings: summary off, the default embedder (MiniLM int8), ``reply_reserve`` 256, and the fake
reports the ``n_ctx`` (``context_for``) at which Engram's prompt budget — context minus reply
reserve, safety share and margin, over its uncalibrated token factor — is the budget named, in
cl100k_base tokens. Tokens are counted with ``proxy.tokens``
(cl100k_base, the counter Engram budgets with); the fake's replies carry no ``usage``, so
Engram learns no correction factor from made-up prompt_tokens. Prefix stability: for
consecutive forwarded prompts of the replay, the byte length of their longest common prefix,
rendered as a chat template would (role header, then the message text), over the later one's
length. Rendered text rather than JSON, because a message whose content became a list of parts
(memory in mode ``stable``) is the same text to the model's KV cache; both are reported.

Target (4,096 tokens): evidence-in-prompt >= 0.85 with forwarded prompts at most a fifth of the
full history's tokens. The data is CC BY-NC: it is read in place, never copied.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    CATEGORIES,
    DEFAULT_LOCOMO,
    EvidenceLog,
    machine,
    machine_lines,
    repair_evidence,
)
from proxy.chat.fence import BLOCK_OPEN, clean_text, parse_block
from proxy.chat.prompt import SUMMARY_OPEN
from proxy.chat.rewrite import PROMPT_MARGIN, PROMPT_SAFETY
from proxy.messages import content_text
from proxy.tokens import UNCALIBRATED, TokenCounter, load_encoder

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPLY_RESERVE = 256


def context_for(budget: int) -> int:
    """The n_ctx the fake reports so that Engram's prompt budget, in cl100k_base tokens, is
    ``budget``: Engram keeps a safety share and, with no usage to learn from, scales counts by
    its cautious uncalibrated factor."""
    return math.ceil((budget * UNCALIBRATED + PROMPT_MARGIN) / (1 - PROMPT_SAFETY)) + REPLY_RESERVE


ZONES = ("primacy-memory", "recency-memory", "recency-summary", "recency-window", "absent")
TARGET_RATE, TARGET_SHARE, TARGET_BUDGET = 0.85, 0.2, 4096
FILLER = "OK."


# ---- the data --------------------------------------------------------------------------------


@dataclass
class ChatMessage:
    role: str  # user | assistant
    text: str
    turns: list[str]  # dia_ids of the LoCoMo turns joined into this message


@dataclass
class Question:
    text: str
    category: int
    evidence: list[str]  # dia_ids


@dataclass
class Conversation:
    sample_id: str
    user: str
    assistant: str
    messages: list[ChatMessage]
    questions: list[Question]
    holder: dict[str, str]  # dia_id -> the text of the chat message holding that turn

    @property
    def system(self) -> str:
        return (
            f"You are {self.assistant}, chatting with your friend {self.user}. Reply as "
            f"{self.assistant} would, briefly and in character."
        )


def load(
    path: Path, limit: int | None, names: bool = False
) -> tuple[list[Conversation], EvidenceLog]:
    """The conversations as chats; ``names`` starts every turn with "<speaker>: "."""
    data = json.loads(path.read_text())[:limit]
    log = EvidenceLog()
    out: list[Conversation] = []
    for sample in data:
        conv = sample["conversation"]
        numbers = sorted(int(k.split("_")[1]) for k in conv if re.fullmatch(r"session_\d+", k))
        turns = [(n, t) for n in numbers for t in conv[f"session_{n}"]]
        user = turns[0][1]["speaker"]
        other = conv["speaker_b"] if user == conv["speaker_a"] else conv["speaker_a"]
        messages: list[ChatMessage] = []
        seen_sessions: set[int] = set()
        for n, t in turns:
            caption = t.get("blip_caption")
            text = t["text"] + (f" [image: {caption}]" if caption else "")
            shown = f"{t['speaker']}: {text}" if names else text
            if n not in seen_sessions:
                seen_sessions.add(n)
                shown = f"[{conv.get(f'session_{n}_date_time', '').strip()}] {shown}"
            role = "user" if t["speaker"] == user else "assistant"
            if messages and messages[-1].role == role:
                messages[-1].text += "\n\n" + shown
                messages[-1].turns.append(t["dia_id"])
            else:
                messages.append(ChatMessage(role, shown, [t["dia_id"]]))
        holder = {d: m.text for m in messages for d in m.turns}
        questions = []
        for q in sample["qa"]:
            if q["category"] not in CATEGORIES:
                log.questions_skipped_category += 1
                continue
            evidence = repair_evidence(q.get("evidence", []), set(holder), log)
            if not evidence:
                log.questions_without_evidence += 1
                continue
            questions.append(Question(q["question"], q["category"], sorted(evidence)))
        out.append(Conversation(sample["sample_id"], user, other, messages, questions, holder))
    return out, log


# ---- reading a forwarded prompt --------------------------------------------------------------


def squash(text: str) -> str:
    return " ".join(text.split())


def memory_texts(block: str) -> str:
    """The memories' own texts in a memory block (each line holds its text as a JSON string)."""
    try:
        return "\n".join(m.text for m in parse_block(block.strip()))
    except ValueError:
        return block


def segments(forwarded: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(zone, text) pieces of a forwarded prompt; memory and summary blocks split out (of a
    memory block, the memories' texts)."""
    out: list[tuple[str, str]] = []
    for i, msg in enumerate(forwarded):
        role = msg.get("role")
        content = msg.get("content")
        pieces: list[str]
        if isinstance(content, list):
            pieces = [p.get("text", "") for p in content if isinstance(p, dict)]
        else:
            pieces = [content_text(content)]
        for piece in pieces:
            if i == 0 and role in ("system", "developer"):
                head, sep, block = piece.partition(BLOCK_OPEN)
                out.append(("primacy-system", head))
                if sep:
                    out.append(("primacy-memory", memory_texts(sep + block)))
            elif piece.startswith(BLOCK_OPEN):
                out.append(("recency-memory", memory_texts(piece)))
            elif piece.startswith(SUMMARY_OPEN):
                out.append(("recency-summary", piece))
            else:
                out.append(("recency-window", piece))
    return [(zone, squash(text)) for zone, text in out]


def zone_of(message: str, segs: Sequence[tuple[str, str]]) -> str:
    """Where the chat message ``message`` (holding an evidence turn) sits in the prompt."""
    needles = {squash(message), clean_text(message)}  # (a memory shows its text cleaned)
    for zone in ("recency-window", "primacy-memory", "recency-memory", "recency-summary"):
        if any(z == zone and n in text for z, text in segs for n in needles):
            return zone
    return "absent"


DIAGNOSE_K = 50
RANK_BUCKETS = ("1-6", "7-10", "11-20", "21-50", ">50")


def rank_bucket(message: str, found: Sequence[str]) -> str:
    """Where a wider search (window turns left out) ranks the chat message ``message``."""
    needle = squash(message)
    rank = next((i + 1 for i, text in enumerate(found) if needle in text), None)
    if rank is None:
        return ">50"
    return next(b for b, top in zip(RANK_BUCKETS, (6, 10, 20, 50), strict=False) if rank <= top)


def rendered(messages: Sequence[Mapping[str, Any]]) -> bytes:
    """The prompt as a chat template lays it out (role header, text), for prefix comparison."""
    return "".join(
        f"<|{m.get('role')}|>\n{content_text(m.get('content'))}\n" for m in messages
    ).encode()


def common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# ---- one run: a budget and a mode ------------------------------------------------------------


@dataclass
class Figures:
    """What one (budget, mode) run measured for one conversation."""

    questions: int = 0
    served: int = 0  # questions with all their evidence turns in the prompt
    served_any: int = 0  # … with at least one
    evidence_turns: int = 0
    zones: Counter[str] = field(default_factory=Counter)
    by_category: dict[int, list[int]] = field(default_factory=dict)  # cat -> [served, n]
    q_forwarded: list[int] = field(default_factory=list)
    q_full: list[int] = field(default_factory=list)
    r_forwarded: list[int] = field(default_factory=list)
    r_full: list[int] = field(default_factory=list)
    prefix: list[float] = field(default_factory=list)  # rendered text
    prefix_json: list[float] = field(default_factory=list)  # JSON of the message list
    rewritten: int = 0  # replay requests whose history was cut
    memories: list[int] = field(default_factory=list)  # memories injected per question
    q_memory: list[int] = field(default_factory=list)  # memory tokens newly injected, per question
    r_memories: list[int] = field(default_factory=list)  # … memories, per replay request
    r_memory: list[int] = field(default_factory=list)  # … memory tokens, per replay request
    missed_rank: Counter[str] = field(default_factory=Counter)  # --diagnose: absent turns
    seconds: float = 0.0

    def merge(self, other: Figures) -> None:
        self.questions += other.questions
        self.served += other.served
        self.served_any += other.served_any
        self.evidence_turns += other.evidence_turns
        self.zones.update(other.zones)
        for cat, (s, n) in other.by_category.items():
            acc = self.by_category.setdefault(cat, [0, 0])
            acc[0] += s
            acc[1] += n
        for name in (
            "q_forwarded",
            "q_full",
            "r_forwarded",
            "r_full",
            "prefix",
            "prefix_json",
            "memories",
            "q_memory",
            "r_memories",
            "r_memory",
        ):
            getattr(self, name).extend(getattr(other, name))
        self.rewritten += other.rewritten
        self.missed_rank.update(other.missed_rank)
        self.seconds += other.seconds


class TokenTally:
    """Token counts of messages, cached by their JSON (the history is resent every time)."""

    def __init__(self) -> None:
        self.tokens = TokenCounter(load_encoder())
        self._cache: dict[str, int] = {}

    def __call__(self, messages: Sequence[Mapping[str, Any]]) -> int:
        total = 0
        for m in messages:
            key = json.dumps(m, sort_keys=True)
            n = self._cache.get(key)
            if n is None:
                n = self._cache[key] = self.tokens.messages([m])
            total += n
        return total


async def run_config(
    budget: int,
    mode: str,
    convs: Sequence[Conversation],
    overrides: Mapping[str, Mapping[str, Any]],
    count: TokenTally,
    progress: bool,
    diagnose: bool = False,
) -> dict[str, Figures]:
    """Replay every conversation through a fresh Engram; figures per sample_id."""
    import aiohttp

    from proxy.services import SERVICES
    from proxy.store.models import Turn
    from testing.fake_upstream import FakeUpstream, JsonReply, chat_completion
    from testing.harness import start_engram

    sections: dict[str, dict[str, Any]] = {
        "summary": {"enabled": False},
        "embedder": {"model": "engram/all-MiniLM-L6-v2-q8"},
        "prompt": {"mode": mode, "reply_reserve": REPLY_RESERVE},
    }
    for name, values in overrides.items():
        sections.setdefault(name, {}).update(values)
    out: dict[str, Figures] = {}
    async with FakeUpstream(n_ctx=context_for(budget)) as fake:
        engram = await start_engram(fake.url, **sections)
        app = engram.app
        try:
            async with aiohttp.ClientSession() as http:
                replied = asyncio.Event()

                async def on_reply(turn: Any) -> None:
                    replied.set()

                app[SERVICES].pipeline.reply_hooks.append(on_reply)

                async def settle() -> None:
                    """Until the reply hooks (archiving) of the last request are done."""
                    await replied.wait()
                    replied.clear()
                    await app[SERVICES].tasks.drain(timeout=120)

                async def send(
                    conv: Conversation, messages: list[dict[str, Any]], reply: str, memory: str
                ) -> tuple[list[dict[str, Any]], Any]:
                    # No usage in the reply: Engram would learn a token ratio from the
                    # fake's made-up prompt_tokens; without it, budgets are in cl100k tokens.
                    completion = chat_completion(reply)
                    del completion["usage"]
                    fake.enqueue(JsonReply(completion))
                    headers = {
                        "X-Engram-User": conv.sample_id,
                        "X-Engram-Session": conv.sample_id,
                        "X-Engram-Memory": memory,
                    }
                    body = {"model": "fake-model", "messages": messages}
                    async with http.post(
                        engram.base_url + "/chat/completions", json=body, headers=headers
                    ) as resp:
                        resp.raise_for_status()
                        await resp.read()
                        session = resp.headers.get("X-Engram-Session", conv.sample_id)
                    await settle()
                    engram.turns.clear()
                    forwarded = fake.chat_requests()[-1].json()["messages"]
                    fake.requests.clear()
                    last = app[SERVICES].require_memory().memory.last_requests.get(session)
                    return forwarded, last[1] if last else None

                for conv in convs:
                    t0 = time.perf_counter()
                    fig = out[conv.sample_id] = Figures()
                    history: list[dict[str, Any]] = [{"role": "system", "content": conv.system}]
                    previous: tuple[bytes, bytes] | None = None
                    msgs = conv.messages
                    for i, msg in enumerate(msgs):
                        history.append({"role": msg.role, "content": msg.text})
                        if msg.role != "user":
                            continue
                        # the fake answers with the recorded next message (the assistant's)
                        nxt = msgs[i + 1].text if i + 1 < len(msgs) else FILLER
                        forwarded, assembly = await send(conv, history, nxt, "on")
                        if assembly is not None and assembly.rewritten:
                            fig.rewritten += 1
                        fig.r_memories.append(new_memories(assembly))
                        fig.r_memory.append(assembly.memory_tokens if assembly else 0)
                        fig.r_forwarded.append(count(forwarded))
                        fig.r_full.append(count(history))
                        now = (rendered(forwarded), json.dumps(forwarded).encode())
                        if previous is not None:
                            fig.prefix.append(common_prefix(previous[0], now[0]) / len(now[0]))
                            fig.prefix_json.append(common_prefix(previous[1], now[1]) / len(now[1]))
                        previous = now
                    if msgs[-1].role == "user":
                        history.append({"role": "assistant", "content": FILLER})
                    for q in conv.questions:
                        asked = [*history, {"role": "user", "content": q.text}]
                        # An empty reply: read-only still archives a reply with text (see the
                        # report), and the questions must leave the memory as the replay left it.
                        forwarded, assembly = await send(conv, asked, "", "read-only")
                        segs = segments(forwarded)
                        zones = [zone_of(conv.holder[d], segs) for d in q.evidence]
                        served = all(z != "absent" for z in zones)
                        fig.questions += 1
                        fig.served += served
                        fig.served_any += any(z != "absent" for z in zones)
                        fig.evidence_turns += len(zones)
                        fig.zones.update(zones)
                        acc = fig.by_category.setdefault(q.category, [0, 0])
                        acc[0] += served
                        acc[1] += 1
                        fig.q_forwarded.append(count(forwarded))
                        fig.q_full.append(count(asked))
                        fig.memories.append(new_memories(assembly))
                        fig.q_memory.append(assembly.memory_tokens if assembly else 0)
                        if diagnose and "absent" in zones:
                            window = [t for z, t in segs if z == "recency-window"]

                            def keep(turn: Turn, window: list[str] = window) -> bool:
                                return squash(turn.content) not in window

                            hits = (
                                await app[SERVICES]
                                .require_memory()
                                .retriever.search(conv.sample_id, q.text, DIAGNOSE_K, keep=keep)
                            )
                            found = [squash(h.turn.content) for h in hits]
                            for d, z in zip(q.evidence, zones, strict=True):
                                if z == "absent":
                                    fig.missed_rank[rank_bucket(conv.holder[d], found)] += 1
                    fig.seconds = time.perf_counter() - t0
                    if progress:
                        print(
                            f"  [{budget} {mode}] {conv.sample_id}: {fig.served}/"
                            f"{fig.questions} served, {len(fig.r_full)} requests, "
                            f"{fig.seconds:.0f} s",
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            await engram.close()
    return out


# ---- the report ------------------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def new_memories(assembly: Any) -> int:
    """Memories newly injected by the request (its own block's, not blocks laid again)."""
    return len([r for p in assembly.parts for r in p.refs]) if assembly is not None else 0


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def summary(fig: Figures) -> dict[str, Any]:
    ratios = [f / w for f, w in zip(fig.q_forwarded, fig.q_full, strict=True) if w]
    turns = fig.evidence_turns or 1
    return {
        "questions": fig.questions,
        "evidence_in_prompt": fig.served / fig.questions if fig.questions else float("nan"),
        "any_evidence_in_prompt": (
            fig.served_any / fig.questions if fig.questions else float("nan")
        ),
        "evidence_turns_present": 1 - fig.zones["absent"] / turns,
        "zones": {z: fig.zones[z] / turns for z in ZONES},
        "by_category": {c: s / n for c, (s, n) in sorted(fig.by_category.items())},
        "question_tokens": {
            "forwarded_median": statistics.median(fig.q_forwarded) if fig.q_forwarded else 0,
            "forwarded_p95": quantile(fig.q_forwarded, 0.95),
            "full_median": statistics.median(fig.q_full) if fig.q_full else 0,
            "full_p95": quantile(fig.q_full, 0.95),
            "ratio_median": statistics.median(ratios) if ratios else float("nan"),
            "ratio_p95": quantile(ratios, 0.95),
            "ratio_total": sum(fig.q_forwarded) / max(1, sum(fig.q_full)),
        },
        "memories_median": statistics.median(fig.memories) if fig.memories else 0,
        "memories_mean": mean(fig.memories),
        "memory_tokens_mean": mean(fig.q_memory),
        "absent_rank": {b: fig.missed_rank[b] for b in RANK_BUCKETS} if fig.missed_rank else {},
        "replay": {
            "requests": len(fig.r_full),
            "rewritten": fig.rewritten,
            "forwarded_median": statistics.median(fig.r_forwarded) if fig.r_forwarded else 0,
            "forwarded_p95": quantile(fig.r_forwarded, 0.95),
            "full_median": statistics.median(fig.r_full) if fig.r_full else 0,
            "full_p95": quantile(fig.r_full, 0.95),
            "prefix_median": statistics.median(fig.prefix) if fig.prefix else float("nan"),
            "prefix_mean": statistics.fmean(fig.prefix) if fig.prefix else float("nan"),
            "prefix_json_median": (
                statistics.median(fig.prefix_json) if fig.prefix_json else float("nan")
            ),
            "memories_mean": mean(fig.r_memories),
            "memory_tokens_mean": mean(fig.r_memory),
            "requests_with_memory": sum(1 for n in fig.r_memories if n)
            / max(1, len(fig.r_memories)),
        },
        "memory_tokens_mean_all": mean([*fig.r_memory, *fig.q_memory]),
        "seconds": round(fig.seconds, 1),
    }


QUESTION_HEAD = (
    "| budget | mode | conversation | questions | evidence in prompt (any) "
    "| evidence turns present "
    "| primacy-memory | recency-memory | recency-window | absent | forwarded tokens median / p95 "
    "| full history median / p95 | forwarded / full median (p95) |"
)


def question_row(budget: int, mode: str, name: str, s: dict[str, Any]) -> str:
    z, t = s["zones"], s["question_tokens"]
    return (
        f"| {budget} | {mode} | {name} | {s['questions']} | {s['evidence_in_prompt']:.3f} "
        f"({s['any_evidence_in_prompt']:.3f}) "
        f"| {s['evidence_turns_present']:.3f} | {z['primacy-memory']:.3f} "
        f"| {z['recency-memory']:.3f} | {z['recency-window']:.3f} | {z['absent']:.3f} "
        f"| {t['forwarded_median']:.0f} / {t['forwarded_p95']:.0f} "
        f"| {t['full_median']:.0f} / {t['full_p95']:.0f} "
        f"| {t['ratio_median']:.3f} ({t['ratio_p95']:.3f}) |"
    )


def tables(runs: list[dict[str, Any]], per_conversation: bool) -> str:
    rule = "|" + "---|" * QUESTION_HEAD.count(" | ")
    rule += "---|"
    lines = ["Questions (evidence shares are of evidence turns, by zone)", "", QUESTION_HEAD, rule]
    for r in runs:
        lines.append(question_row(r["budget"], r["mode"], "all", r["overall"]))
    if per_conversation:
        lines += ["", "Per conversation", "", QUESTION_HEAD, rule]
        for r in runs:
            for name, s in r["conversations"].items():
                lines.append(question_row(r["budget"], r["mode"], name, s))
    cats = sorted(CATEGORIES)
    lines += [
        "",
        "Evidence in prompt by question category",
        "",
        "| budget | mode | " + " | ".join(f"{c} {CATEGORIES[c]}" for c in cats) + " |",
        "|---|---|" + "---|" * len(cats),
    ]
    for r in runs:
        by = r["overall"]["by_category"]
        cells = " | ".join(f"{by[c]:.3f}" if c in by else "-" for c in cats)
        lines.append(f"| {r['budget']} | {r['mode']} | {cells} |")
    lines += [
        "",
        "Replay prompts (every request of the conversations, before the questions)",
        "",
        "| budget | mode | requests | history cut | forwarded tokens median / p95 "
        "| full history median / p95 | prefix stability median (mean) | same, JSON messages "
        "| requests given memory | memories / request | memory tokens / request |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        p = r["overall"]["replay"]
        lines.append(
            f"| {r['budget']} | {r['mode']} | {p['requests']} | {p['rewritten']} "
            f"| {p['forwarded_median']:.0f} / {p['forwarded_p95']:.0f} "
            f"| {p['full_median']:.0f} / {p['full_p95']:.0f} "
            f"| {p['prefix_median']:.3f} ({p['prefix_mean']:.3f}) "
            f"| {p['prefix_json_median']:.3f} | {p['requests_with_memory']:.3f} "
            f"| {p['memories_mean']:.2f} | {p['memory_tokens_mean']:.1f} |"
        )
    lines += [
        "",
        "Memory newly injected (each request's own block)",
        "",
        "| budget | mode | memories / question | memory tokens / question "
        "| memory tokens / replay request | memory tokens / request, all |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        o = r["overall"]
        lines.append(
            f"| {r['budget']} | {r['mode']} | {o['memories_mean']:.2f} "
            f"| {o['memory_tokens_mean']:.1f} | {o['replay']['memory_tokens_mean']:.1f} "
            f"| {o['memory_tokens_mean_all']:.1f} |"
        )
    return "\n".join(lines)


def checks(runs: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    out = []
    for r in runs:
        if r["budget"] != TARGET_BUDGET:
            continue
        s = r["overall"]
        rate, share = s["evidence_in_prompt"], s["question_tokens"]["ratio_median"]
        name = f"{r['budget']} {r['mode']}"
        out.append((f"{name}: evidence in prompt {rate:.3f} >= {TARGET_RATE}", rate >= TARGET_RATE))
        out.append(
            (
                f"{name}: forwarded / full-history tokens {share:.3f} <= {TARGET_SHARE} "
                "(median per question)",
                share <= TARGET_SHARE,
            )
        )
    return out


# ---- main ------------------------------------------------------------------------------------


def parse_sets(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot:
            raise SystemExit(f"--set wants section.key=value, got {item!r}")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        out.setdefault(section, {})[name] = value
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    convs, evlog = load(args.data, args.conversations, args.speaker_names)
    overrides = parse_sets(args.set)
    count = TokenTally()
    configs = [(b, m) for b in args.budgets for m in args.modes]
    gate = asyncio.Semaphore(args.jobs)

    async def one(budget: int, mode: str) -> dict[str, Any]:
        async with gate:
            t0 = time.perf_counter()
            figs = await run_config(
                budget, mode, convs, overrides, count, not args.quiet, args.diagnose
            )
            total = Figures()
            for f in figs.values():
                total.merge(f)
            return {
                "budget": budget,
                "mode": mode,
                "n_ctx": context_for(budget),
                "seconds": round(time.perf_counter() - t0, 1),
                "overall": summary(total),
                "conversations": {k: summary(f) for k, f in figs.items()},
            }

    t0 = time.perf_counter()
    runs = await asyncio.gather(*(one(b, m) for b, m in configs))
    return {
        "machine": machine(),
        "data": str(args.data),
        "conversations": [c.sample_id for c in convs],
        "messages": sum(len(c.messages) for c in convs),
        "turns": sum(len(c.holder) for c in convs),
        "questions": sum(len(c.questions) for c in convs),
        "settings": {
            "summary": {"enabled": False},
            "prompt": {"reply_reserve": REPLY_RESERVE},
            "overrides": overrides,
            "speaker_names": args.speaker_names,
        },
        "evidence": {
            "repaired": dict(evlog.repaired),
            "dropped": dict(evlog.dropped),
            "questions_without_evidence": evlog.questions_without_evidence,
            "questions_skipped_category": evlog.questions_skipped_category,
        },
        "seconds": round(time.perf_counter() - t0, 1),
        "runs": runs,
        "checks": checks(runs),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_LOCOMO, help="locomo10.json")
    parser.add_argument("--conversations", type=int, default=10, help="the first N (default 10)")
    parser.add_argument(
        "--quick", action="store_true", help="2 conversations, the 4,096-token budget only"
    )
    parser.add_argument(
        "--budgets",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[2048, 4096],
        help="prompt budgets in tokens, comma-separated (default 2048,4096)",
    )
    parser.add_argument(
        "--modes",
        type=lambda s: s.split(","),
        default=["zones", "stable"],
        help="prompt modes, comma-separated (default zones,stable)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="an Engram setting for every run, e.g. retrieval.top_k=10 (repeatable)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=max(1, min(4, os.cpu_count() or 1)),
        help="runs (budget x mode) at once, each its own Engram (default: cores, at most 4)",
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help=f"rank each absent evidence turn in a top-{DIAGNOSE_K} search (window excluded)",
    )
    parser.add_argument(
        "--speaker-names",
        action="store_true",
        help='start every turn\'s text with "<speaker>: " (a diagnostic: chat clients do not)',
    )
    parser.add_argument("--per-conversation", action="store_true", help="print that table too")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.budgets = min(args.conversations, 2), [TARGET_BUDGET]
    if not args.data.is_file():
        parser.error(f"no LoCoMo data at {args.data} (see --data)")
    out = asyncio.run(run(args))
    print("\n".join(machine_lines(out["machine"])))
    ev = out["evidence"]
    print(
        f"LoCoMo: {len(out['conversations'])} conversations, {out['turns']} turns in "
        f"{out['messages']} chat messages, {out['questions']} questions (categories 1-4); "
        f"evidence ids: {sum(ev['repaired'].values())} repaired, "
        f"{sum(ev['dropped'].values())} dropped, {ev['questions_without_evidence']} questions "
        f"without evidence skipped. Settings: summary off, reply_reserve {REPLY_RESERVE}, "
        f"overrides {out['settings']['overrides'] or 'none'}"
        f"{', speaker names in the text' if args.speaker_names else ''}; "
        f"{out['seconds']} s in all."
    )
    print()
    print(tables(out["runs"], args.per_conversation))
    if args.diagnose:
        print()
        print(f"Absent evidence turns: their rank in a top-{DIAGNOSE_K} search, window left out")
        print()
        print("| budget | mode | " + " | ".join(RANK_BUCKETS) + " |")
        print("|---|---|" + "---|" * len(RANK_BUCKETS))
        for r in out["runs"]:
            ranks = r["overall"]["absent_rank"]
            cells = " | ".join(str(ranks.get(b, 0)) for b in RANK_BUCKETS)
            print(f"| {r['budget']} | {r['mode']} | {cells} |")
    print()
    for text, ok in out["checks"]:
        print(f"- {'PASS' if ok else 'FAIL'}: {text}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
