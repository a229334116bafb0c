"""SIGKILL loses no turn a client received in full (issue 10, item 3).

Engram runs as a real process (``python -m proxy serve``) in front of the fake upstream, which
runs in this process. Each round, several clients hold one conversation each and send back-to-back
turns (the whole history plus one new user message, as chat clients do): half name their session
with ``X-Engram-Session``, half leave Engram to recognise it by its hash chain; half stream. At a
random moment (seeded, printed) Engram is killed with SIGKILL, then restarted on the same database
and port. Then, reading the database:

- every user message and every reply a client received in full is stored, once, in order, in one
  session, marked complete; the only thing stored beyond them may be the turn that was in flight
  at the kill (committed before its last byte reached the client);
- SQLite's and FTS5's integrity checks pass on the database the crash left;
- the start-up replay gives a vector to every archived turn with text, and ``turn_vec`` matches;
- each conversation then goes on after the restart in the same session, nothing stored twice.

The subprocess runs the ``proxy`` package of the checkout this file lies in (its cwd and
PYTHONPATH are that checkout), so a copy of this file in a worktree of an older commit tests that
commit. ``ENGRAM_CRASH_SEED`` and ``ENGRAM_CRASH_ROUNDS`` change the seed and the number of rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import aiohttp
import pytest
import pytest_asyncio

from proxy.store.sqlite.db import Connection, connect
from testing.fake_upstream import FakeUpstream

REPO = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("ENGRAM_CRASH_SEED", "20261130"))
ROUNDS = int(os.environ.get("ENGRAM_CRASH_ROUNDS", "4"))
CLIENTS = 8
KILL_AFTER = (0.4, 1.6)  # seconds of traffic before the kill, drawn per round
MIN_ANSWERED = CLIENTS  # a round with fewer turns answered in full tested nothing
START_WAIT = 30.0  # seconds Engram may take to answer /engram/health
REPLAY_WAIT = 20.0  # seconds the start-up replay may take to embed what the crash left
TURN_TIMEOUT = aiohttp.ClientTimeout(total=15)
TOPICS = ("lighthouse", "saffron", "glacier", "violin", "orchard", "comet", "harbour", "basalt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- Engram as a real process -----------------------------------------------------------------


class EngramProcess:
    """``python -m proxy serve`` on a fixed port and database; restartable after a kill."""

    def __init__(self, port: int, upstream: str, db: Path, log_path: Path) -> None:
        self.port = port
        self.upstream = upstream
        self.db = db
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")}
        env.update(
            {
                "ENGRAM_EMBEDDER_MODEL": "hash",
                "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
                # This checkout's proxy package first (the venv's editable install may point at
                # another one).
                "PYTHONPATH": os.pathsep.join(
                    [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
                ),
            }
        )
        return env

    def _open_log(self) -> BinaryIO:
        log = open(self.log_path, "ab")  # noqa: SIM115 (the caller closes it)
        log.write(f"---- start {self.starts}\n".encode())
        log.flush()
        return log

    async def start(self) -> None:
        assert self.proc is None
        self.starts += 1
        with self._open_log() as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "proxy",
                "serve",
                "--port",
                str(self.port),
                "--upstream",
                self.upstream,
                "--db",
                str(self.db),
                cwd=REPO,
                env=self._env(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + START_WAIT
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.returncode is not None:
                    raise AssertionError(
                        f"engram exited with {self.proc.returncode}:\n{self.log()}"
                    )
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with http.get(
                        self.url + "/engram/health", timeout=aiohttp.ClientTimeout(total=2)
                    ) as r:
                        if r.status == 200:
                            return
                await asyncio.sleep(0.05)
        raise AssertionError(f"engram did not answer /engram/health:\n{self.log()}")

    async def kill(self) -> None:
        """SIGKILL: no shutdown hook, no background task, nothing after this instant runs."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()
        self.proc = None

    async def stop(self) -> None:
        """Graceful stop (SIGTERM), or a kill if it takes too long; safe to call when stopped."""
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            if proc is not None:
                await proc.wait()
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    def log(self, tail: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError as exc:
            return f"(no log: {exc})"

    def replayed(self) -> list[str]:
        """The start-up replay's log lines ("embedded turns archived before the last stop")."""
        return [
            line
            for line in self.log(1 << 30).splitlines()
            if "archived before the last stop" in line
        ]


@pytest_asyncio.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    # A large context: prompts are never rewritten, no rolling summary is made.
    fake = FakeUpstream(n_ctx=1 << 20, record=False)
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


# ---- clients ----------------------------------------------------------------------------------


@dataclass
class Received:
    user_text: str
    reply: str
    at: float  # time.monotonic() when the reply had arrived in full


@dataclass
class Client:
    index: int
    user: str
    session: str | None  # the X-Engram-Session it sends, None: left to the hash chain
    stream: bool
    received: list[Received] = field(default_factory=list)
    in_flight: str | None = None  # the user message of the turn under way when it stopped
    stopped_by: str = ""

    @property
    def kind(self) -> str:
        return f"{'stream' if self.stream else 'plain'}/{'header' if self.session else 'chain'}"

    def history(self) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        for r in self.received:
            out += [
                {"role": "user", "content": r.user_text},
                {"role": "assistant", "content": r.reply},
            ]
        return out

    def headers(self) -> dict[str, str]:
        h = {"X-Engram-User": self.user}
        if self.session:
            h["X-Engram-Session"] = self.session
        return h


class TurnFailed(Exception):
    """The reply did not arrive in full."""


async def read_stream(resp: aiohttp.ClientResponse) -> str:
    """The streamed reply's text; TurnFailed unless ``[DONE]`` came and the body ended cleanly
    (aiohttp raises ClientPayloadError when the chunked body stops short)."""
    parts: list[str] = []
    done = False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            continue
        for choice in json.loads(data).get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if isinstance(content, str):
                parts.append(content)
    if not done:
        raise TurnFailed("the stream ended without [DONE]")
    return "".join(parts)


async def one_turn(http: aiohttp.ClientSession, url: str, client: Client, text: str) -> str:
    body = {
        "model": "fake-model",
        "messages": [*client.history(), {"role": "user", "content": text}],
        "stream": client.stream,
    }
    async with http.post(
        url + "/v1/chat/completions", json=body, headers=client.headers(), timeout=TURN_TIMEOUT
    ) as resp:
        if resp.status != 200:
            raise TurnFailed(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        if client.session is not None:
            assert resp.headers.get("X-Engram-Session") == client.session
        if client.stream:
            return await read_stream(resp)
        payload = json.loads(await resp.read())
        return str(payload["choices"][0]["message"]["content"])


def user_text(round_no: int, client: Client, turn: int) -> str:
    topic = TOPICS[(client.index + turn) % len(TOPICS)]
    return f"round {round_no} client {client.index} turn {turn}: note the {topic} number {turn * 7}"


async def converse(http: aiohttp.ClientSession, url: str, round_no: int, client: Client) -> None:
    """Back-to-back turns until one fails (Engram was killed)."""
    for turn in range(100_000):
        text = user_text(round_no, client, turn)
        client.in_flight = text
        try:
            reply = await one_turn(http, url, client, text)
        except (aiohttp.ClientError, TimeoutError, TurnFailed, ValueError, KeyError) as exc:
            client.stopped_by = f"{type(exc).__name__}: {exc}"[:160]
            return
        client.received.append(Received(text, reply, time.monotonic()))
        client.in_flight = None


# ---- the database -----------------------------------------------------------------------------


@dataclass
class Row:
    id: int
    session_id: str
    position: int
    role: str
    content: str
    incomplete: int


def stored_rows(db: Path, user: str) -> list[Row]:
    with contextlib.closing(connect(db, readonly=True)) as conn:
        rows = conn.execute(
            "SELECT id, session_id, position, role, content, incomplete FROM turns"
            " WHERE user_id = ? AND position >= 0 ORDER BY id",
            (user,),
        ).fetchall()
    return [Row(*r) for r in rows]


def integrity_problems(db: Path) -> list[str]:
    """SQLite's integrity and foreign-key checks and FTS5's own check (a write statement, so
    run on a read-write connection while Engram is down)."""
    problems: list[str] = []
    with contextlib.closing(connect(db)) as conn:
        result = [r[0] for r in conn.execute("PRAGMA integrity_check").fetchall()]
        if result != ["ok"]:
            problems.append(f"PRAGMA integrity_check: {result[:5]}")
        fk = conn.execute("PRAGMA foreign_key_check").fetchall()
        if fk:
            problems.append(f"PRAGMA foreign_key_check: {fk[:5]}")
        try:
            conn.execute("INSERT INTO turns_fts(turns_fts) VALUES ('integrity-check')")
        except Exception as exc:
            problems.append(f"FTS5 integrity-check: {exc}")
    return problems


def unembedded(conn: Connection) -> int:
    """Turns still waiting for the indexer: a vector (those with text), or a full-text row."""
    (n,) = conn.execute(
        "SELECT count(*) FROM turns WHERE (embed_hash IS NULL AND trim(content) != '')"
        " OR fts_pending = 1"
    ).fetchone()
    return int(n)


def pending_vectors(db: Path) -> int:
    with contextlib.closing(connect(db, readonly=True)) as conn:
        return unembedded(conn)


def vector_problems(db: Path) -> list[str]:
    with contextlib.closing(connect(db, readonly=True)) as conn:
        with_text = {r[0] for r in conn.execute("SELECT id FROM turns WHERE trim(content) != ''")}
        embedded = {r[0] for r in conn.execute("SELECT id FROM turns WHERE embed_hash IS NOT NULL")}
        all_ids = {r[0] for r in conn.execute("SELECT id FROM turns")}
        vec_rows = [r[0] for r in conn.execute("SELECT turn_id FROM turn_vec")]
        fts = {r[0] for r in conn.execute("SELECT id FROM turns_fts_docsize")}
    vec = set(vec_rows)
    problems = []
    if len(vec_rows) != len(vec):
        problems.append(f"turn_vec holds {len(vec_rows) - len(vec)} duplicate rows")
    if with_text - embedded:
        problems.append(f"{len(with_text - embedded)} turns with text have no embed_hash")
    if embedded - vec:
        problems.append(f"turns {sorted(embedded - vec)[:10]} have an embed_hash but no vector")
    if vec - all_ids:
        problems.append(f"turn_vec rows {sorted(vec - all_ids)[:10]} belong to no turn")
    if fts - all_ids or all_ids - fts:
        problems.append(f"turns_fts rows differ from turns: {sorted(fts ^ all_ids)[:10]}")
    return problems


async def wait_for_replay(db: Path) -> tuple[int, float]:
    """Wait until no archived turn with text lacks a vector; (left, seconds waited)."""
    started = time.monotonic()
    left = pending_vectors(db)
    while left and time.monotonic() - started < REPLAY_WAIT:
        await asyncio.sleep(0.1)
        left = pending_vectors(db)
    return left, time.monotonic() - started


# ---- the verdict ------------------------------------------------------------------------------


@dataclass
class Verdict:
    answered: int = 0  # turns whose reply a client received in full
    found: int = 0  # of those, found stored (user message and reply) after the restart
    extra: int = 0  # in-flight turns committed whose reply the client never got in full
    lost: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def check_client(client: Client, rows: list[Row], killed_at: float, verdict: Verdict) -> bool:
    """Compare what the client received in full with what is stored. True when the stored
    conversation is exactly what it received (no in-flight extra), so it can go on."""
    who = f"client {client.index} ({client.kind}, user {client.user})"
    stored = [(r.role, r.content) for r in rows]
    counts = Counter(stored)
    expected: list[tuple[str, str]] = []
    for k, turn in enumerate(client.received):
        pair = [("user", turn.user_text), ("assistant", turn.reply)]
        expected += pair
        verdict.answered += 1
        missing = [role for role, text in pair if counts[(role, text)] == 0]
        if missing:
            last = " (its last turn)" if k == len(client.received) - 1 else ""
            verdict.lost.append(
                f"{who} turn {k}{last}: {' and '.join(missing)} message missing; reply received"
                f" in full {1000 * (killed_at - turn.at):.0f} ms before the kill"
            )
        else:
            verdict.found += 1
        for role, text in pair:
            if counts[(role, text)] > 1:
                verdict.problems.append(f"{who} turn {k}: {role} stored {counts[(role, text)]}x")
    # In order: what was received appears in the stored sequence in the same order.
    wanted = set(expected)
    seen = [item for item in stored if item in wanted]
    dedup = list(dict.fromkeys(seen))
    if dedup != [item for item in expected if item in set(seen)]:
        verdict.problems.append(f"{who}: stored out of order")
    # Beyond what was received: at most the turn in flight at the kill.
    beyond = [item for item in stored if item not in wanted]
    allowed = []
    if client.in_flight is not None:
        allowed = [("user", client.in_flight), ("assistant", f"echo: {client.in_flight}")]
    if beyond and beyond != allowed[: len(beyond)]:
        verdict.problems.append(f"{who}: unexpected stored turns {beyond[:4]}")
    if beyond == allowed and allowed:
        verdict.extra += 1
    sessions = {r.session_id for r in rows}
    if len(sessions) > 1:
        verdict.problems.append(f"{who}: stored in {len(sessions)} sessions {sorted(sessions)}")
    if client.session is not None and sessions - {client.session}:
        verdict.problems.append(f"{who}: stored in {sessions}, not in {client.session}")
    if [r.position for r in rows] != list(range(len(rows))):
        verdict.problems.append(f"{who}: positions {[r.position for r in rows][:12]}…")
    for r in rows:
        if (r.role, r.content) in wanted and r.incomplete:
            verdict.problems.append(f"{who}: a reply received in full is marked incomplete")
    return stored == expected and len(sessions) <= 1


async def resume(
    http: aiohttp.ClientSession, engram: EngramProcess, round_no: int, client: Client
) -> str | None:
    """One more turn after the restart: it is answered and stored right after the history, in
    the same session, nothing stored twice. None when fine, else what went wrong."""
    before = stored_rows(engram.db, client.user)
    text = user_text(round_no, client, len(client.received)) + " (after the restart)"
    try:
        reply = await one_turn(http, engram.url, client, text)
    except (aiohttp.ClientError, TimeoutError, TurnFailed, ValueError, KeyError) as exc:
        return f"client {client.index}: the turn after the restart failed: {exc!r}"
    after = stored_rows(engram.db, client.user)
    want = [(r.role, r.content) for r in before] + [("user", text), ("assistant", reply)]
    got = [(r.role, r.content) for r in after]
    sessions = {r.session_id for r in after}
    if got != want or len(sessions) != 1 or [r.position for r in after] != list(range(len(after))):
        return (
            f"client {client.index} ({client.kind}): after the restart stored {got[-4:]} in "
            f"{len(sessions)} sessions, positions {[r.position for r in after][-4:]}"
        )
    return None


# ---- the test ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_sigkill_loses_no_turn_the_client_received(upstream: FakeUpstream) -> None:
    rng = random.Random(SEED)
    print(f"\ncrash test: seed {SEED}, {ROUNDS} rounds of {CLIENTS} clients, engram from {REPO}")
    tmp = tempfile.TemporaryDirectory(prefix="engram-crash-")
    engram = EngramProcess(
        free_port(), upstream.url, Path(tmp.name) / "engram.db", Path(tmp.name) / "engram.log"
    )
    totals = Verdict()
    failures: list[str] = []
    try:
        await engram.start()
        for round_no in range(ROUNDS):
            clients = [
                Client(
                    index=i,
                    user=f"crash-r{round_no}-c{i}",
                    session=f"crash-r{round_no}-c{i}-chat" if i % 2 == 0 else None,
                    stream=(i // 2) % 2 == 0,
                )
                for i in range(CLIENTS)
            ]
            delay = rng.uniform(*KILL_AFTER)
            async with aiohttp.ClientSession() as http:
                tasks = [
                    asyncio.create_task(converse(http, engram.url, round_no, c)) for c in clients
                ]
                await asyncio.sleep(delay)
                killed_at = time.monotonic()
                await engram.kill()
                await asyncio.wait_for(asyncio.gather(*tasks), 30)

            # The database as the crash left it.
            crash_problems = integrity_problems(engram.db)
            unembedded_at_crash = pending_vectors(engram.db)

            replay_lines = len(engram.replayed())
            await engram.start()  # same database, same port
            verdict = Verdict(problems=[f"after the kill: {p}" for p in crash_problems])
            intact = [
                check_client(c, stored_rows(engram.db, c.user), killed_at, verdict) for c in clients
            ]

            left, waited = await wait_for_replay(engram.db)
            if left:
                verdict.problems.append(
                    f"{left} turns still without a vector {REPLAY_WAIT}s after start"
                )
            verdict.problems += vector_problems(engram.db)

            async with aiohttp.ClientSession() as http:
                resumed = await asyncio.gather(
                    *(
                        resume(http, engram, round_no, c)
                        for c, ok in zip(clients, intact, strict=True)
                        if ok
                    )
                )
            verdict.problems += [r for r in resumed if r]

            lost = len(verdict.lost)
            print(
                f"round {round_no}: kill after {delay:.3f} s of traffic; answered in full "
                f"{verdict.answered}, found after restart {verdict.found}, lost {lost} "
                f"({100 * lost / max(verdict.answered, 1):.1f} %); in-flight turns stored too "
                f"{verdict.extra}; unembedded at the crash {unembedded_at_crash}, replayed in "
                f"{waited:.1f} s; went on after restart {sum(intact)}/{CLIENTS}"
            )
            for line in engram.replayed()[replay_lines:]:
                print(f"    replay: {line}")
            for c in clients:
                print(
                    f"    client {c.index} {c.kind:13} received {len(c.received):3}  "
                    f"stopped by {c.stopped_by}"
                )
            for line in verdict.lost + verdict.problems:
                print(f"    ! {line}")
            if verdict.answered < MIN_ANSWERED:
                failures.append(f"round {round_no}: only {verdict.answered} turns answered")
            failures += [f"round {round_no}: lost {x}" for x in verdict.lost]
            failures += [f"round {round_no}: {x}" for x in verdict.problems]
            totals.answered += verdict.answered
            totals.found += verdict.found
            totals.lost += verdict.lost

        await engram.stop()
        failures += [f"after the last stop: {p}" for p in integrity_problems(engram.db)]
        lost = len(totals.lost)
        print(
            f"total: answered in full {totals.answered}, found {totals.found}, lost {lost} "
            f"({100 * lost / max(totals.answered, 1):.1f} %) over {ROUNDS} kills"
        )
    except BaseException:
        print(f"engram log (tail):\n{engram.log()}")
        raise
    finally:
        await engram.stop()
        tmp.cleanup()
    assert not failures, "\n".join(failures[:40])
