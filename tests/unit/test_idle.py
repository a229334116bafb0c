"""The idle gate Engram's own upstream calls wait on (proxy/idle.py): its decision on a clock of
the test's own, and its waiting on the real one."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.idle import UpstreamActivity


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_no_request_yet_is_idle() -> None:
    gate = UpstreamActivity(idle=5, max_wait=60, clock=Clock())
    assert gate.quiet_in(100.0) == 0.0
    assert gate.decide(100.0, since=100.0) == ("idle", 0.0)


def test_a_request_in_flight_holds_own_calls_until_the_ceiling() -> None:
    clock = Clock(100.0)
    gate = UpstreamActivity(idle=5, max_wait=60, clock=clock)
    with gate.request():
        assert gate.in_flight == 1
        assert gate.quiet_in(100.0) is None  # its end is not known
        assert gate.decide(100.0, since=100.0) == ("wait", 60.0)
        assert gate.decide(130.0, since=100.0) == ("wait", 30.0)
        assert gate.decide(160.0, since=100.0) == ("forced", 0.0)
        clock.now = 161.0
    assert gate.in_flight == 0
    assert gate.last_end == 161.0


def test_quiet_time_counts_from_the_last_end() -> None:
    clock = Clock(10.0)
    gate = UpstreamActivity(idle=5, max_wait=60, clock=clock)
    with gate.request():
        pass  # ended at 10
    assert gate.decide(12.0, since=11.0) == ("wait", 3.0)
    assert gate.decide(14.9, since=11.0)[0] == "wait"
    assert gate.decide(15.0, since=11.0) == ("idle", 0.0)
    # The ceiling caps the pause, and ends the wait.
    assert gate.decide(12.0, since=-47.0) == ("wait", 1.0)
    assert gate.decide(13.0, since=-47.0) == ("forced", 0.0)


def test_two_requests_in_flight_the_last_end_counts() -> None:
    clock = Clock(0.0)
    gate = UpstreamActivity(idle=2, max_wait=60, clock=clock)
    with gate.request():
        with gate.request():
            clock.now = 1.0
        assert gate.decide(1.0, since=0.0) == ("wait", 59.0)  # one still in flight
        clock.now = 4.0
    assert gate.decide(5.0, since=0.0) == ("wait", 1.0)
    assert gate.decide(6.0, since=0.0) == ("idle", 0.0)


def test_a_failed_request_ends_too() -> None:
    clock = Clock(7.0)
    gate = UpstreamActivity(idle=1, max_wait=60, clock=clock)
    with pytest.raises(RuntimeError), gate.request():
        raise RuntimeError("upstream died")
    assert gate.in_flight == 0 and gate.last_end == 7.0


def test_zero_settings() -> None:
    clock = Clock(0.0)
    no_quiet = UpstreamActivity(idle=0, max_wait=60, clock=clock)
    with no_quiet.request():
        pass
    assert no_quiet.decide(0.0, since=0.0) == ("idle", 0.0)  # nothing in flight is enough
    never_wait = UpstreamActivity(idle=5, max_wait=0, clock=clock)
    with never_wait.request():
        assert never_wait.decide(0.0, since=0.0) == ("forced", 0.0)


# -- waiting, on the real clock (asyncio only: the loop is never blocked) ---------------------


@pytest.mark.asyncio
async def test_wait_idle_returns_the_quiet_time_after_the_last_request_ends() -> None:
    gate = UpstreamActivity(idle=0.2, max_wait=30)
    ended = asyncio.Event()

    async def chat() -> float:
        with gate.request():
            await asyncio.sleep(0.3)
        ended.set()
        return time.monotonic()

    request = asyncio.create_task(chat())
    await asyncio.sleep(0.05)
    began = time.monotonic()
    waiter = asyncio.create_task(gate.wait_idle("test"))
    await asyncio.sleep(0.1)
    assert not waiter.done() and gate.waiting == 1
    end = await request
    assert await waiter is True
    done = time.monotonic()
    assert done - end >= 0.19  # the quiet time, counted from the end
    assert done - began < 2.0
    assert (gate.waiting, gate.delayed, gate.forced) == (0, 1, 0)


@pytest.mark.asyncio
async def test_wait_idle_goes_at_the_ceiling_when_never_idle() -> None:
    gate = UpstreamActivity(idle=0.1, max_wait=0.3)
    with gate.request():
        began = time.monotonic()
        assert await gate.wait_idle("test") is False
        assert 0.29 <= time.monotonic() - began < 2.0
    assert (gate.delayed, gate.forced) == (1, 1)


@pytest.mark.asyncio
async def test_an_idle_upstream_does_not_delay() -> None:
    gate = UpstreamActivity(idle=5, max_wait=30)
    assert await asyncio.wait_for(gate.wait_idle(), 0.5) is True
    assert (gate.delayed, gate.forced) == (0, 0)


@pytest.mark.asyncio
async def test_own_calls_go_one_at_a_time_and_look_again() -> None:
    """The second call waits for the first, then for a request that came meanwhile."""
    gate = UpstreamActivity(idle=0.0, max_wait=30)
    order: list[str] = []
    first_in = asyncio.Event()
    release_first = asyncio.Event()

    async def own(name: str, hold: asyncio.Event | None) -> None:
        async with gate.own_call(name) as idle:
            assert idle
            order.append(f"{name} in")
            if hold is not None:
                first_in.set()
                await hold.wait()
            order.append(f"{name} out")

    first = asyncio.create_task(own("a", release_first))
    await first_in.wait()
    second = asyncio.create_task(own("b", None))
    await asyncio.sleep(0.05)
    assert order == ["a in"]  # b waits for a
    with gate.request():  # a user's request arrives while a runs
        release_first.set()
        await first
        await asyncio.sleep(0.05)
        assert order == ["a in", "a out"]  # b now waits for the request
    await asyncio.wait_for(second, 2)
    assert order == ["a in", "a out", "b in", "b out"]
