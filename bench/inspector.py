"""The inspector's pages at scale (issue 23): every page's server time at 100,000 turns, and what
the inspector costs a chat request when nobody looks.

    .venv/bin/python -m bench.inspector [--turns 100000] [--runs 50] [--chats 200]
                                        [--chat-pairs 300] [--db PATH] [--json out.json]

(1) A database is built once and kept (``--cache-dir``, or ``--db``): ``--turns`` turns of user
    ``bench`` over ``--sessions`` sessions of varied length (one big one of ``--big`` turns),
    some with sub-agent sessions (and their hand-backs in the parent), a rolling summary in some,
    facts with ``source_session`` and ``source_turn`` in the user's ``facts~`` session, notes,
    pinned and muted turns; ``--other-turns`` turns of a second user. Written through the store's
    own SQL (:func:`proxy.store.queries.add_turns`, :func:`proxy.store.items.insert_item`, …),
    full-text rows and vectors included, the vectors from the deterministic ``hash`` embedder
    (not the real model: building 100,000 turns takes 2-4 minutes on 2 cores instead of an
    hour, and no page's cost depends on which model made the vectors). Texts are LoCoMo's
    turns, cycled and joined to words of another so none repeats (a built-in word list when
    LoCoMo is absent).
(2) ``python -m proxy serve`` on a copy, with the hash embedder, in front of
    ``python -m testing.fake_upstream`` (both their own processes); ``--chats`` chat requests
    as new conversations (a few with a large tool result, so there are slots) fill the
    Requests pages; once the server's warm start has loaded the user's terms and vectors into
    memory (its log says so), this process signs in (``POST /engram/signin``, the admin token)
    and times every page ``--runs`` times, the pages in a new random order each round, after
    one untimed round. The searches, the sessions' text filter, the date filter and the request
    shown change every run. Server time is the client's wall time of the HTTP request over
    loopback (sent to last byte read); the page's own footer figure (``server time X ms``:
    handler start to rendered) is the second column.
(3) The chat path: two servers on fresh copies, ``inspector.enabled`` true and false, the same
    new-conversation requests sent to each in turn (``--chat-pairs`` pairs, which goes first
    alternating, after both loaded their caches and 20 pairs of warm-up), with memory on and
    with memory off. Exits 1 when a page misses 150 ms p95.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import DEFAULT_CACHE, DEFAULT_LOCOMO, load_locomo, machine, machine_lines, pct
from bench.retrieval import serving
from proxy.api.actions import NOTE_API
from proxy.background.consolidation import facts_session
from proxy.search.embedder import HashEmbedder
from proxy.store import Store, queries
from proxy.store.corrections import notes_session, set_recall
from proxy.store.items import insert_item
from proxy.store.models import NewTurn, embed_text, text_hash
from proxy.store.sqlite.db import Connection
from proxy.store.summaries import Summary, put_summary
from proxy.vectors import Vector
from testing.conversations import WORDS

USER = "bench"
OTHER = "bench-other"
TOKEN = "bench-inspector-admin-token-0123456789"
TARGET_MS = 150.0
BUILD = 2  # bump when the layout changes: cached databases of another layout are rebuilt
START = 1_735_689_600.0  # 2025-01-01 UTC: the first session
SPAN_DAYS = 365
APIS = ["openai-chat"] * 6 + ["anthropic-messages"] * 2 + ["openai-responses", None]
FILTER_WORDS = [
    "painting", "camping", "dog", "book", "music", "kids", "adoption", "school", "pottery",
    "beach", "concert", "garden", "hiking", "cooking", "friends", "family", "job", "support",
    "photo", "career", "running", "violin", "trip", "weekend", "project", "movie", "art",
]  # fmt: skip
FALLBACK_WORDS = WORDS


# ---- the machine -------------------------------------------------------------------------


def cpu_flags() -> dict[str, Any]:
    """AVX2 / AVX-512 as /proc/cpuinfo says (the vector search's kernels use them)."""
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {"avx2": "avx2" in flags, "avx512": sorted(f for f in flags if f.startswith("avx512"))}


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


# ---- the database ------------------------------------------------------------------------


@dataclass
class Planned:
    """One session to write."""

    name: str
    user: str
    length: int
    start: float
    api: str | None
    parent: int | None = None  # index of the parent in the plan
    agent: str | None = None
    system: bool = False
    ids: list[int] = field(default_factory=list)  # turn ids, once written


def plan(
    rnd: random.Random, user: str, turns: int, sessions: int, big: int, subagents: bool
) -> list[Planned]:
    """Sessions holding ``turns`` turns in all: one of ``big`` turns (spanning a third of the
    year), the rest log-normally long; with ``subagents``, a tenth of them get one to three
    sub-agent sessions (an eighth of those a sub-sub-agent). Parents come before children."""
    starts = sorted(START + rnd.random() * SPAN_DAYS * 86400.0 for _ in range(sessions))
    top = [
        Planned(
            f"{user}-project-{i:04d}" if i % 7 == 0 else f"s-{rnd.getrandbits(64):016x}",
            user,
            0,
            start,
            rnd.choice(APIS),
            system=rnd.random() < 0.5,
        )
        for i, start in enumerate(starts)
    ]
    big_one = top[len(top) // 3]
    big_one.name, big_one.length = f"{user}-big", big
    out = top[:]
    for k, parent in enumerate(top):
        if not subagents or parent is big_one or rnd.random() >= 0.1:
            continue
        for j in range(rnd.randint(1, 3)):
            child = Planned(
                f"{parent.name}/agent-{j}",
                user,
                rnd.randint(8, 60),
                parent.start + 60 * (j + 1),
                parent.api,
                parent=k,
                agent="task",
            )
            out.append(child)
            if rnd.random() < 0.125:
                out.append(
                    Planned(
                        f"{child.name}/agent-0",
                        user,
                        rnd.randint(6, 30),
                        child.start + 30,
                        child.api,
                        parent=len(out) - 1,
                        agent="task",
                    )
                )
    rest = turns - sum(p.length for p in out)
    others = [p for p in top if p is not big_one]
    weights = [rnd.lognormvariate(0.0, 0.9) for _ in others]
    scale = max(0, rest - 2 * len(others)) / (sum(weights) or 1.0)
    for p, w in zip(others, weights, strict=True):
        p.length = 2 + int(w * scale)
    left, i = rest - sum(p.length for p in others), 0
    while left > 0 and others:  # what the rounding down left over
        others[i % len(others)].length += 1
        left, i = left - 1, i + 1
    return out


class Texts:
    """Distinct texts: LoCoMo's turns cycled, each later cycle joined to words of another."""

    def __init__(self, base: list[str]) -> None:
        self.base = base
        self.i = 0

    def next(self) -> str:
        self.i += 1
        cycle, j = divmod(self.i, len(self.base))
        text = self.base[j]
        if cycle:
            other = self.base[(j * 31 + cycle * 977) % len(self.base)]
            text += " " + " ".join(other.split()[:12])
        return text


def base_texts(path: Path) -> tuple[list[str], list[str], str]:
    """(turn texts, questions, where they came from)."""
    if path.is_file():
        convs, qs, _ = load_locomo(path)
        return [t.content for c in convs for t in c.turns], [q.question for q in qs], "LoCoMo"
    rnd = random.Random(7)
    words = [
        " ".join(rnd.choice(FALLBACK_WORDS) for _ in range(rnd.randint(8, 40))) for _ in range(6000)
    ]
    questions = [
        f"What about the {rnd.choice(FALLBACK_WORDS)} and the {rnd.choice(FALLBACK_WORDS)}?"
        for _ in range(2000)
    ]
    return words, questions, "a built-in word list (no LoCoMo data)"


async def write_sessions(
    store: Store, embedder: HashEmbedder, texts: Texts, planned: list[Planned]
) -> None:
    for p in planned:
        roles: list[str] = []
        contents: list[str] = []
        for pos in range(p.length):
            if pos == 0 and p.system:
                roles.append("system")
                contents.append("You are a helpful assistant. Answer briefly and kindly.")
            else:
                roles.append("user" if (pos - p.system) % 2 == 0 else "assistant")
                contents.append(texts.next())
        embedded = [embed_text(r, None, c) for r, c in zip(roles, contents, strict=True)]
        # every turn gets its vector, as the indexer gives one to each archived turn
        vectors: list[Vector | None] = list(await embedder.embed_passages(embedded))
        step = 20.0 if p.length < 2000 else SPAN_DAYS * 86400.0 / 3 / p.length
        new = [
            NewTurn(
                pos,
                roles[pos],
                contents[pos],
                timestamp=p.start + pos * step,
                api=p.api,
                embed_hash=text_hash(embedded[pos]) if vectors[pos] is not None else None,
            )
            for pos in range(p.length)
        ]
        parent = planned[p.parent].name if p.parent is not None else None
        last = p.start + max(0, p.length - 1) * step

        def job(
            c: Connection,
            p: Planned = p,
            new: list[NewTurn] = new,
            parent: str | None = parent,
            vectors: list[Vector | None] = vectors,
            last: float = last,
        ) -> list[int]:
            queries.get_or_create_session(
                c,
                p.user,
                p.name,
                parent_id=parent,
                agent=p.agent,
                fingerprint=None,
                indexed=None,
                now=p.start,
            )
            ids: list[int] = []
            for k in range(0, len(new), 512):
                ids += queries.add_turns(
                    c, p.name, p.user, new[k : k + 512], vectors[k : k + 512], last
                )
            return ids

        p.ids = await store.write(job)


async def write_items(
    store: Store, embedder: HashEmbedder, texts: Texts, rnd: random.Random, planned: list[Planned]
) -> dict[str, int]:
    """Hand-backs, rolling summaries, facts, notes, pins and mutes of :data:`USER`."""
    counts = dict.fromkeys(("handbacks", "summaries", "facts", "notes", "pinned", "muted"), 0)

    async def vector(role: str, speaker: str | None, text: str) -> Vector:
        return (await embedder.embed_passages([embed_text(role, speaker, text)]))[0]

    def item(role: str, speaker: str, text: str, when: float) -> NewTurn:
        return NewTurn(
            -1,
            role,
            text,
            speaker=speaker,
            timestamp=when,
            content_hash=text_hash(f"{role}\0{speaker}\0{text}"),
            embed_hash=text_hash(embed_text(role, speaker, text)),
        )

    facts_sid = await store.write(lambda c: facts_session(c, USER, START))
    for p in planned:
        if p.user != USER:
            continue
        if p.parent is not None:  # the sub-agent's hand-back, in its parent
            parent = planned[p.parent].name
            text = "Sub-agent result: " + texts.next()
            turn = item("summary", p.agent or "task", text, p.start + 600)
            vec = await vector("summary", p.agent, text)
            await store.write(
                functools.partial(
                    insert_item,
                    session_id=parent,
                    user_id=USER,
                    turn=turn,
                    vector=vec,
                    source=p.name,
                )
            )
            counts["handbacks"] += 1
            continue
        if p.length >= 20 and rnd.random() < 0.2:
            s = Summary(
                p.name, "Summary so far: " + texts.next(), p.length - 10, 120, p.start + 3600
            )
            await store.write(functools.partial(put_summary, s=s, model="bench"))
            counts["summaries"] += 1
        if p.length >= 4 and rnd.random() < 0.3:
            for _ in range(rnd.randint(1, 3)):
                source = rnd.choice(p.ids)
                text = texts.next()
                turn = item("fact", "the user", text, p.start + 7200)
                vec = await vector("fact", "the user", text)
                await store.write(
                    functools.partial(
                        insert_item,
                        session_id=facts_sid,
                        user_id=USER,
                        turn=turn,
                        vector=vec,
                        source=p.name,
                        source_turn=source,
                    )
                )
                counts["facts"] += 1
    for k in range(25):
        text = "Note: " + texts.next()
        vec = await vector("user", None, text)
        when = START + (k + 1) * 86400.0 * 14

        def note(c: Connection, text: str = text, vec: Vector = vec, when: float = when) -> None:
            sid = notes_session(c, USER, when)
            turn = NewTurn(
                queries.next_position(c, sid),
                "user",
                text,
                timestamp=when,
                api=NOTE_API,
                embed_hash=text_hash(embed_text("user", None, text)),
            )
            queries.add_turns(c, sid, USER, [turn], [vec], when)

        await store.write(note)
        counts["notes"] += 1
    ids = [i for p in planned if p.user == USER for i in p.ids]
    for value, n in ((1, 10), (-1, 40)):
        for turn_id in rnd.sample(ids, min(n, len(ids))):
            await store.write(
                functools.partial(set_recall, user_id=USER, turn_id=turn_id, value=value)
            )
            counts["pinned" if value == 1 else "muted"] += 1
    return counts


async def build(path: Path, args: argparse.Namespace, base: list[str]) -> dict[str, Any]:
    rnd = random.Random(args.build_seed)
    texts = Texts(base)
    embedder = HashEmbedder()
    tmp = path.with_name(path.name + ".building")
    for p in tmp.parent.glob(tmp.name + "*"):
        p.unlink()
    t0 = time.perf_counter()
    mine = plan(rnd, USER, args.turns, args.sessions, args.big, subagents=True)
    theirs = plan(
        rnd,
        OTHER,
        args.other_turns,
        max(1, args.other_turns // 100),
        min(500, args.other_turns // 4),
        subagents=False,
    )
    async with Store(tmp) as store:
        await store.ensure_embedding_model(embedder.name, embedder.dim)
        await write_sessions(store, embedder, texts, mine)
        await write_sessions(store, embedder, texts, theirs)
        items = await write_items(store, embedder, texts, rnd, mine)
        await store.write(lambda c: c.execute("PRAGMA wal_checkpoint(TRUNCATE)"), transaction=False)
    tmp.replace(path)
    figures = {
        "turns": args.turns,
        "other_turns": args.other_turns,
        "sessions": sum(1 for p in mine if p.parent is None),
        "subagent_sessions": sum(1 for p in mine if p.parent is not None),
        "big": f"{USER}-big",
        "big_turns": args.big,
        "rich": rich_session(mine),
        "seconds": round(time.perf_counter() - t0, 1),
        **items,
    }
    path.with_name(path.name + ".json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"built {path} in {figures['seconds']:.0f} s", file=sys.stderr)
    return figures


def rich_session(planned: Sequence[Planned]) -> str:
    """The longest top-level session with sub-agents (so its page shows a tree)."""
    parents = {p.parent for p in planned if p.parent is not None}
    with_subs = [p for i, p in enumerate(planned) if i in parents and p.parent is None]
    return max(with_subs, key=lambda p: p.length).name if with_subs else planned[0].name


async def cached_db(args: argparse.Namespace, base: list[str]) -> tuple[Path, dict[str, Any]]:
    path = args.db or args.cache_dir / (
        f"inspector-b{BUILD}-{args.turns}-{args.other_turns}-{args.sessions}-{args.big}-hash.db"
    )
    meta = path.with_name(path.name + ".json")
    if path.is_file() and meta.is_file() and not args.rebuild:
        return path, json.loads(meta.read_text())
    path.parent.mkdir(parents=True, exist_ok=True)
    return path, await build(path, args, base)


# ---- the pages ---------------------------------------------------------------------------


FOOTER = re.compile(r"<footer>server time ([0-9.]+) ms</footer>")
CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@dataclass
class Page:
    name: str
    method: str
    times: list[float] = field(default_factory=list)
    footer: list[float] = field(default_factory=list)


def q(**params: Any) -> str:
    return urllib.parse.urlencode({"user": USER, **params})


async def fetch(
    http: aiohttp.ClientSession, method: str, url: str, data: dict[str, str] | None = None
) -> tuple[float, str, int]:
    t0 = time.perf_counter()
    async with http.request(method, url, data=data, allow_redirects=False) as r:
        body = await r.text()
        status = r.status
    return time.perf_counter() - t0, body, status


async def sign_in(http: aiohttp.ClientSession, url: str) -> str:
    """Sign in with the admin token; the form token of the session."""
    _, _, status = await fetch(http, "POST", f"{url}/engram/signin", {"token": TOKEN})
    if status != 303:
        raise RuntimeError(f"sign-in answered {status}")
    _, html, status = await fetch(http, "GET", f"{url}/engram/memory?{q()}")
    found = CSRF.search(html)
    if status != 200 or found is None:
        raise RuntimeError(f"no form token on the memory page ({status})")
    return found.group(1)


class Workload:
    """What each page is asked, different every run."""

    def __init__(
        self,
        rnd: random.Random,
        questions: list[str],
        figures: dict[str, Any],
        request_ids: list[str],
        csrf: str,
    ) -> None:
        self.rnd = rnd
        self.questions = questions[:]
        rnd.shuffle(self.questions)
        self.qi = 0
        self.big = urllib.parse.quote(figures["big"], safe="")
        self.rich = urllib.parse.quote(figures["rich"], safe="")
        self.last_page = max(1, -(-int(figures["big_turns"]) // 200))
        self.request_ids = request_ids
        self.csrf = csrf
        self.notes = 0

    def question(self) -> str:
        self.qi += 1
        return self.questions[self.qi % len(self.questions)]

    def month(self) -> tuple[str, str]:
        m = self.rnd.randint(1, 11)
        return f"2025-{m:02d}-01", f"2025-{m + 1:02d}-01"

    def request(self, name: str) -> tuple[str, str, dict[str, str] | None]:
        """(method, path and query, form) of one visit of page ``name``."""
        if name.startswith("search "):
            mode = name.split()[1]
            return "GET", f"/engram/search?{q(q=self.question(), mode=mode)}", None
        if name == "note (form POST)":
            self.notes += 1
            text = f"Remember: {self.question()} (note {self.notes})"
            return "POST", "/engram/actions/note", {"csrf": self.csrf, "user": USER, "text": text}
        if name == "sessions, text filter":
            return "GET", f"/engram/sessions?{q(q=self.rnd.choice(FILTER_WORDS))}", None
        if name == "sessions, API filter":
            api = self.rnd.choice(["anthropic-messages", "openai-responses", "openai-chat"])
            return "GET", f"/engram/sessions?{q(api=api)}", None
        if name == "sessions, date filter":
            since, until = self.month()
            return "GET", "/engram/sessions?" + q(**{"from": since, "to": until}), None
        if name == "request detail":
            return "GET", f"/engram/requests/{self.rnd.choice(self.request_ids)}?{q()}", None
        fixed = {
            "overview": f"/engram/?{q()}",
            "sessions, page 1": f"/engram/sessions?{q()}",
            "sessions, page 15": f"/engram/sessions?{q(page=15)}",
            "big session, page 1": f"/engram/sessions/{self.big}?{q()}",
            "big session, last page": f"/engram/sessions/{self.big}?{q(page=self.last_page)}",
            "session with sub-agents": f"/engram/sessions/{self.rich}?{q()}",
            "requests": f"/engram/requests?{q()}",
            "memory (notes, facts, pins)": f"/engram/memory?{q()}",
            "slots": f"/engram/slots?{q()}",
        }
        return "GET", fixed[name], None


PAGES = [
    "overview",
    "sessions, page 1",
    "sessions, page 15",
    "sessions, text filter",
    "sessions, API filter",
    "sessions, date filter",
    "big session, page 1",
    "big session, last page",
    "session with sub-agents",
    "search hybrid",
    "search fts",
    "search vec",
    "requests",
    "request detail",
    "memory (notes, facts, pins)",
    "slots",
    "note (form POST)",
]


async def time_pages(
    http: aiohttp.ClientSession, url: str, work: Workload, runs: int, rnd: random.Random
) -> list[Page]:
    pages = {name: Page(name, "POST" if "POST" in name else "GET") for name in PAGES}
    for round_ in range(runs + 1):  # round 0 warms up (templates, caches), untimed
        order = PAGES[:]
        rnd.shuffle(order)
        for name in order:
            method, path, form = work.request(name)
            seconds, body, status = await fetch(http, method, url + path, form)
            if status != (303 if method == "POST" else 200):
                raise RuntimeError(f"{name}: {path} answered {status}: {body[:300]}")
            if round_:
                pages[name].times.append(seconds)
                if (m := FOOTER.search(body)) is not None:
                    pages[name].footer.append(float(m.group(1)) / 1000)
    return [pages[n] for n in PAGES]


# ---- chat requests -----------------------------------------------------------------------


def chat_body(question: str, tool: bool = False) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": question},
    ]
    if tool:
        listing = "\n".join(
            f"line {i}: {' '.join(FALLBACK_WORDS[i % 30 : i % 30 + 8])}" for i in range(300)
        )
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "notes.txt"}'},
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": f"{question}\n{listing}"},
            {"role": "assistant", "content": "I read the file."},
            {"role": "user", "content": "Thanks. And what does it say about the last line?"},
        ]
    return {"model": "fake-model", "messages": messages, "max_tokens": 32}


async def chat(
    http: aiohttp.ClientSession, url: str, question: str, mode: str = "on", tool: bool = False
) -> tuple[float, str]:
    headers = {"X-Engram-User": USER, "X-Engram-Memory": mode}
    t0 = time.perf_counter()
    async with http.post(
        f"{url}/v1/chat/completions", json=chat_body(question, tool), headers=headers
    ) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"chat answered {r.status}")
        rid = r.headers.get("X-Engram-Request-Id", "")
    return time.perf_counter() - t0, rid


class Questions:
    """Questions, each numbered so no text is sent twice."""

    def __init__(self, texts: list[str], tag: str) -> None:
        self.texts, self.tag, self.i = texts, tag, 0

    def next(self) -> str:
        self.i += 1
        return f"{self.texts[self.i % len(self.texts)]} ({self.tag} {self.i})"


async def chat_path(
    http: aiohttp.ClientSession, urls: dict[str, str], qs: Questions, mode: str, pairs: int
) -> dict[str, Any]:
    """The same question to the inspector-on and the inspector-off server, alternating which
    goes first; 20 pairs of warm-up."""
    times: dict[str, list[float]] = {k: [] for k in urls}
    start = load()
    for i in range(pairs + 20):
        question = qs.next()
        order = list(urls) if i % 2 == 0 else list(reversed(urls))
        for k in order:
            seconds, _ = await chat(http, urls[k], question, mode)
            if i >= 20:
                times[k].append(seconds)
    return {
        "memory": mode,
        "pairs": pairs,
        **{f"{k}_p50": pct(v, 50) for k, v in times.items()},
        **{f"{k}_p95": pct(v, 95) for k, v in times.items()},
        "load": f"{start} -> {load()}",
    }


# ---- the run -----------------------------------------------------------------------------


def env(inspector: bool) -> dict[str, str]:
    return {
        "ENGRAM_EMBEDDER_MODEL": "hash",
        "ENGRAM_MEMORY_ADMIN_TOKEN": TOKEN,
        "ENGRAM_INSPECTOR_ENABLED": "true" if inspector else "false",
        "ENGRAM_SERVER_LOG_LEVEL": "info",  # the cache loads are logged (see loaded)
    }


TERMS_LOADED = re.compile(r"terms in memory: (\d+) turns in ([0-9.]+) s")
VECTORS_AFTER = 10.0
"""Seconds allowed after the terms load for the vectors' (the loader's next job; 2 s at
100,000 turns on a quiet machine)."""


async def loaded(logs: Sequence[Path], turns: int, timeout: float = 600.0) -> list[float]:
    """Wait until each server logged the main user's terms held in memory (its warm start
    loads them, then their vectors, on a thread of their own), and then :data:`VECTORS_AFTER`
    seconds more; the seconds each load took. Until then searches answer from FTS5 and vec0,
    not from the caches a running server searches."""
    deadline = time.monotonic() + timeout
    took: dict[Path, float] = {}
    while len(took) < len(logs):
        for log in logs:
            for m in TERMS_LOADED.finditer(log.read_text(errors="replace")):
                if int(m.group(1)) >= turns:
                    took[log] = float(m.group(2))
        if time.monotonic() > deadline:
            raise RuntimeError(f"the caches did not load in {timeout:g} s (see {logs})")
        await asyncio.sleep(0.5)
    await asyncio.sleep(VECTORS_AFTER)
    return [took[log] for log in logs]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    base, questions, source = base_texts(args.data)
    rnd = random.Random(args.seed)
    source_db, figures = await cached_db(args, base)
    out: dict[str, Any] = {
        "machine": {**machine(), **cpu_flags()},
        "db": str(source_db),
        "texts": source,
        "figures": figures,
        "seed": args.seed,
        "runs": args.runs,
    }
    timeout = aiohttp.ClientTimeout(total=120)
    with tempfile.TemporaryDirectory(prefix="engram-inspector-") as tmp:
        db = Path(tmp) / "pages.db"
        shutil.copyfile(source_db, db)
        log_path = Path(tmp) / "serve.log"
        try:
            async with (
                serving(db, log_path, env(True)) as url,
                aiohttp.ClientSession(
                    timeout=timeout, cookie_jar=aiohttp.CookieJar(unsafe=True)
                ) as http,
            ):
                qs = Questions(questions, f"run {args.seed}")
                ids: list[str] = []
                t0 = time.perf_counter()
                for i in range(args.chats):
                    _, rid = await chat(http, url, qs.next(), tool=i % 10 == 0)
                    ids.append(rid)
                out["chats_seconds"] = round(time.perf_counter() - t0, 1)
                out["terms_load_seconds"] = await loaded([log_path], args.turns)
                csrf = await sign_in(http, url)
                work = Workload(rnd, questions, figures, [i for i in ids if i], csrf)
                out["load_pages"] = [load()]
                pages = await time_pages(http, url, work, args.runs, rnd)
                out["load_pages"].append(load())
                out["pages"] = [
                    {
                        "page": p.name,
                        "runs": len(p.times),
                        "p50": pct(p.times, 50),
                        "p95": pct(p.times, 95),
                        "max": max(p.times) * 1000,
                        "footer_p50": pct(p.footer, 50) if p.footer else None,
                        "footer_p95": pct(p.footer, 95) if p.footer else None,
                    }
                    for p in pages
                ]
        except Exception:
            sys.stderr.write(log_path.read_text(errors="replace")[-4000:])
            raise
        out["chat_path"] = []
        if args.chat_pairs:
            shutil.copyfile(source_db, Path(tmp) / "on.db")
            shutil.copyfile(source_db, Path(tmp) / "off.db")
            async with (
                serving(Path(tmp) / "on.db", Path(tmp) / "on.log", env(True)) as on,
                serving(Path(tmp) / "off.db", Path(tmp) / "off.log", env(False)) as off,
                aiohttp.ClientSession(timeout=timeout) as http,
            ):
                async with http.get(f"{off}/engram/") as r:
                    if r.status != 404:
                        raise RuntimeError(f"inspector.enabled = false, yet /engram/ is {r.status}")
                out["terms_load_seconds_chat_path"] = await loaded(
                    [Path(tmp) / "on.log", Path(tmp) / "off.log"], args.turns
                )
                qs = Questions(questions, f"path {args.seed}")
                for mode in args.chat_modes:
                    row = await chat_path(
                        http, {"inspector": on, "no_inspector": off}, qs, mode, args.chat_pairs
                    )
                    out["chat_path"].append(row)
    return out


def report(out: dict[str, Any]) -> str:
    f = out["figures"]
    m = out["machine"]
    avx512 = "yes (" + " ".join(m["avx512"]) + ")" if m["avx512"] else "no"
    lines = [
        f"AVX2: {'yes' if m['avx2'] else 'no'}; AVX-512: {avx512}",
        f"Database: {out['db']}",
        f"  {f['turns']:,} turns of user {USER!r} in {f['sessions']:,} sessions (+ "
        f"{f['subagent_sessions']} sub-agent sessions; the biggest {f['big_turns']:,} turns), "
        f"{f['other_turns']:,} turns of {OTHER!r}; {f['handbacks']} hand-backs, {f['summaries']} "
        f"rolling summaries, {f['facts']} facts, {f['notes']} notes, {f['pinned']} pinned, "
        f"{f['muted']} muted; texts from {out['texts']}; vectors from the hash embedder "
        "(not the real model)",
        f"  + {out.get('chats_seconds', 0):g} s of chat requests through Engram before the pages; "
        f"the server's caches loaded (terms in {out['terms_load_seconds'][0]:g} s, then the "
        f"vectors) before the first page",
        f"Pages: {out['runs']} runs each after one untimed round, seed {out['seed']}; load "
        f"{' -> '.join(out['load_pages'])}. Server time: the client's wall time of the request "
        "on loopback; 'render' is the page's footer figure (handler start to rendered).",
        "",
        "| page | runs | median | p95 | max | render median / p95 | target | pass/fail |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in out["pages"]:
        foot = f"{r['footer_p50']:.1f} / {r['footer_p95']:.1f} ms" if r["footer_p50"] else "-"
        ok = "PASS" if r["p95"] <= TARGET_MS else "FAIL"
        lines.append(
            f"| {r['page']} | {r['runs']} | {r['p50']:.1f} ms | {r['p95']:.1f} ms | "
            f"{r['max']:.1f} ms | {foot} | p95 ≤ {TARGET_MS:g} ms | {ok} |"
        )
    if out["chat_path"]:
        lines += [
            "",
            "Chat requests (new conversations), inspector enabled against inspector.enabled = "
            "false, paired, alternating:",
            "",
            "| memory | pairs | enabled p50 / p95 | disabled p50 / p95 | difference p50 / p95 | "
            "load 1/5/15 (start -> end) |",
            "|---|---|---|---|---|---|",
        ]
        for r in out["chat_path"]:
            lines.append(
                f"| {r['memory']} | {r['pairs']} | {r['inspector_p50']:.2f} / "
                f"{r['inspector_p95']:.2f} ms | {r['no_inspector_p50']:.2f} / "
                f"{r['no_inspector_p95']:.2f} ms | "
                f"{r['inspector_p50'] - r['no_inspector_p50']:+.2f} / "
                f"{r['inspector_p95'] - r['no_inspector_p95']:+.2f} ms | {r['load']} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=100_000, help="turns of the main user")
    parser.add_argument("--other-turns", type=int, default=3000, help="turns of a second user")
    parser.add_argument("--sessions", type=int, default=1000, help="top-level sessions")
    parser.add_argument("--big", type=int, default=4000, help="turns of the biggest session")
    parser.add_argument("--runs", type=int, default=50, help="timed visits per page")
    parser.add_argument("--chats", type=int, default=200, help="chat requests before the pages")
    parser.add_argument("--chat-pairs", type=int, default=300, help="0: skip the chat path")
    parser.add_argument("--chat-modes", default="on,off", help="memory modes of the chat path")
    parser.add_argument("--seed", type=int, help="the runs' queries (default: from the clock)")
    parser.add_argument("--build-seed", type=int, default=1, help="the database's layout")
    parser.add_argument("--db", type=Path, help="the database (built there if missing)")
    parser.add_argument("--rebuild", action="store_true", help="build the database again")
    parser.add_argument("--data", type=Path, default=DEFAULT_LOCOMO, help="locomo10.json")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="cached databases")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = int(time.time()) % 100_000
    args.chat_modes = [m for m in args.chat_modes.split(",") if m]
    if not 0 < args.big < args.turns:
        parser.error("--big must be between 0 and --turns")
    out = asyncio.run(run(args))
    print("\n".join(machine_lines(out["machine"])))
    print(report(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    failed = [r["page"] for r in out["pages"] if r["p95"] > TARGET_MS]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
