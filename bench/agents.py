"""What Engram stores per session for each real coding agent (issue 22): Claude Code, Codex and
opencode, installed by ``make agents-deps``, each run as its users run it through an in-process
Engram in front of the fake upstream: ``--sessions`` new sessions that each tell one fact, then
one more that asks for it. Prints, per client, the turns and bytes each session adds (the turns'
text and the scaffolding stored once per user, where this Engram has it), and whether the last
session's request was given the fact.

    python -m bench.agents [--sessions 3] [--clients claude,codex,opencode]

Run from a checkout without scaffolding (an older Engram), it measures that one: the same
script, ``PYTHONPATH=<old checkout>`` (the ``testing`` harness must be there too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from proxy.services import SERVICES
from testing.agents import AgentRun, find_agents, make_home, run_claude, run_codex, run_opencode
from testing.fake_upstream import FakeUpstream
from testing.harness import Engram, settle, start_engram

MODEL = "smollm2"
RUNNERS: dict[str, Callable[..., Awaitable[AgentRun]]] = {
    "claude": run_claude,
    "codex": run_codex,
    "opencode": run_opencode,
}


async def stored(engram: Engram) -> tuple[int, int, int]:
    """(turns, bytes of turn text, bytes of stored scaffolding) in the database now."""
    store = engram.app[SERVICES].store
    assert store is not None

    def run(c: Any) -> tuple[int, int, int]:
        turns, text = c.execute(
            "SELECT count(*), coalesce(sum(length(content)), 0) FROM turns"
        ).fetchone()
        has = c.execute("SELECT 1 FROM sqlite_master WHERE name = 'scaffolds'").fetchone()
        sql = "SELECT coalesce(sum(length(content)), 0) FROM scaffolds"
        pieces = c.execute(sql).fetchone()[0] if has else 0
        return int(turns), int(text), int(pieces)

    return await store.read(run)


async def measure(client: str, sessions: int, tmp: Path) -> dict[str, Any]:
    agents = find_agents()
    async with FakeUpstream(n_ctx=65536, model=MODEL) as fake:
        fake.reply_text = lambda last: "Noted."  # a model's reply, not an echo of the prompt
        engram = await start_engram(fake.url)
        try:
            adds: list[tuple[int, int, int]] = []
            walls: list[float] = []
            before = await stored(engram)
            for i in range(sessions + 1):
                work = tmp / f"{client}-{i}"
                work.mkdir()
                home = make_home(engram.url, MODEL, parent=tmp)
                prompt = (
                    f"Remember: my locker number is {4100 + i}."
                    if i < sessions
                    else "What is my locker number?"
                )
                start = time.monotonic()
                run = await RUNNERS[client](
                    engram.url, prompt, home=home, cwd=work, model=MODEL, agents=agents
                )
                walls.append(time.monotonic() - start)
                if not run.ok:
                    raise SystemExit(run.report())
                await settle(engram, timeout=30)
                after = await stored(engram)
                adds.append((after[0] - before[0], after[1] - before[1], after[2] - before[2]))
                before = after
            last = json.dumps(engram.turns[-1].forwarded or engram.turns[-1].conv.messages)
            return {
                "client": client,
                "first": adds[0],
                "later": adds[1:sessions],
                "recalled": str(4100 + sessions - 1) in last,
                "wall": statistics.median(walls),
            }
        finally:
            await engram.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=3, help="sessions that tell a fact")
    parser.add_argument("--clients", default="claude,codex,opencode")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="engram-bench-agents-") as tmp:
        rows = [await measure(c, args.sessions, Path(tmp)) for c in args.clients.split(",")]
    print(
        f"{'client':<9} {'session':<8} {'turns':>5} {'text bytes':>10} {'scaffold bytes':>14} "
        f"{'total':>8}"
    )
    for r in rows:
        for label, add in [("first", r["first"]), *[("next", a) for a in r["later"]]]:
            turns, text, pieces = add
            print(
                f"{r['client']:<9} {label:<8} {turns:>5} {text:>10} {pieces:>14} {text + pieces:>8}"
            )
        print(f"{'':<9} fact recalled in a new session: {r['recalled']}; "
              f"median run {r['wall']:.1f} s")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
