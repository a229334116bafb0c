"""Background jobs once per item across processes sharing a database (proxy/store/leases.py,
proxy/background/leases.py): one claim wins however many race, a held lease is renewed while its
job runs, and a holder killed mid-job (a real process, SIGKILL) leaves the item to another once
its lease expires."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from proxy.background.leases import Leases
from proxy.store import Store, leases

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parents[2]


@pytest_asyncio.fixture
async def two(store_target: str | Path) -> AsyncIterator[tuple[Store, Store]]:
    async with Store(store_target) as a, Store(store_target) as b:
        yield a, b


async def test_one_claim_wins_however_many_race(two: tuple[Store, Store]) -> None:
    a, b = two
    now = time.time()

    async def claim(store: Store, holder: str) -> bool:
        return await store.write(lambda c: leases.claim(c, "summary:s1", holder, now, 30))

    won = await asyncio.gather(*(claim((a, b)[i % 2], f"p{i}") for i in range(20)))
    assert sum(won) == 1
    winner = f"p{won.index(True)}"
    assert await a.read(lambda c: leases.holder_of(c, "summary:s1", time.time())) == winner
    assert await claim(a, winner)  # the holder renews
    await b.write(lambda c: leases.release(c, "summary:s1", "p-other"))  # not theirs: no-op
    assert not await claim(b, "p-other")
    await b.write(lambda c: leases.release(c, "summary:s1", winner))
    assert await claim(b, "p-other")  # released: free


async def test_an_expired_lease_goes_to_the_next_claimer(two: tuple[Store, Store]) -> None:
    a, b = two
    t0 = time.time()
    assert await a.write(lambda c: leases.claim(c, "handback:s2", "dead", t0, 0.2))
    assert not await b.write(lambda c: leases.claim(c, "handback:s2", "alive", t0 + 0.1, 30))
    assert await b.write(lambda c: leases.claim(c, "handback:s2", "alive", t0 + 0.25, 30))
    await a.write(lambda c: leases.release(c, "handback:s2", "dead"))  # too late: not its own
    assert await a.read(lambda c: leases.holder_of(c, "handback:s2", time.time())) == "alive"


async def test_a_lease_is_renewed_while_its_job_runs(two: tuple[Store, Store]) -> None:
    a, b = two
    mine, theirs = Leases(a, ttl=0.3), Leases(b, ttl=0.3)
    seen: list[bool] = []
    async with mine.hold("consolidate:r1") as got:
        assert got
        for _ in range(5):  # 1 s: three times the lease's life
            await asyncio.sleep(0.2)
            async with theirs.hold("consolidate:r1") as other:
                seen.append(other)
    assert seen == [False] * 5 and theirs.refused == 5
    async with theirs.hold("consolidate:r1") as other:
        assert other  # released at the end of the job


HOLDER = """
import asyncio, sys
from proxy.background.leases import Leases
from proxy.store import Store

async def main() -> None:
    async with Store(sys.argv[1]) as store:
        async with Leases(store, ttl=1.0).hold("summary:s9") as mine:
            print("held" if mine else "refused", flush=True)
            await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_a_holder_killed_mid_job_leaves_the_item_to_another(
    store_target: str | Path,
) -> None:
    db = store_target
    async with Store(db):
        pass  # migrated before the holder starts
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, str(db), cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"held\n"
    async with Store(db) as store:
        other = Leases(store, ttl=1.0)
        await asyncio.sleep(1.5)  # past the lease's first life: renewed by the living holder
        async with other.hold("summary:s9") as got:
            assert not got
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        t0 = time.monotonic()
        while True:
            async with other.hold("summary:s9") as got:
                if got:
                    break
            assert time.monotonic() - t0 < 5, "the dead holder's lease never expired"
            await asyncio.sleep(0.1)
        assert time.monotonic() - t0 <= 1.5  # within the lease's life of the kill
