"""The memory database's circuit breaker (proxy.store.gate), on a clock the test moves."""

from __future__ import annotations

import logging

import pytest

from proxy.store.gate import Gate, StoreUnavailable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gate() -> tuple[Gate, Clock]:
    clock = Clock()
    return Gate("PostgreSQL at db", first_delay=0.5, max_delay=4.0, clock=clock), clock


def refused(g: Gate) -> bool:
    try:
        g.check()
    except StoreUnavailable:
        return True
    return False


def test_up_lets_everything_through() -> None:
    g, _ = gate()
    for _ in range(3):
        g.check()
    assert g.state().up and g.state().outages == 0


def test_down_refuses_until_the_delay_then_lets_one_probe() -> None:
    g, clock = gate()
    g.failed(ConnectionError("the connection is closed"))
    assert refused(g)
    clock.now += 0.49
    assert refused(g)
    clock.now += 0.02
    assert not refused(g)  # the probe
    assert refused(g)  # only one per window
    state = g.state()
    assert not state.up and state.refused == 3 and state.last_error == "the connection is closed"


def test_many_failures_at_once_do_not_push_the_backoff_to_the_cap() -> None:
    g, clock = gate()
    for _ in range(20):  # every in-flight job fails at the same moment
        g.failed("the connection is closed")
    clock.now += 0.5
    assert not refused(g)


def test_failed_probes_double_the_delay_up_to_the_cap() -> None:
    g, clock = gate()
    g.failed("refused")
    waits = []
    for _ in range(6):
        waited = 0.0
        while refused(g):
            clock.now += 0.25
            waited += 0.25
        waits.append(waited)
        g.failed("refused")  # the probe failed
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_probe_that_succeeds_brings_it_up_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    g, clock = gate()
    with caplog.at_level(logging.INFO, logger="engram.store"):
        g.failed("refused")
        g.failed("refused")
        clock.now += 0.5
        g.check()
        g.succeeded()
        g.succeeded()
    assert g.state().up and g.state().outages == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "is unavailable (refused)" in lines[0]
    assert "answers again after 0.5 s" in lines[1]
    g.check()  # up: no wait


def test_going_down_again_starts_from_the_first_delay_and_a_new_epoch() -> None:
    g, clock = gate()
    g.failed("refused")
    first = g.epoch
    clock.now += 0.5
    g.check()
    g.failed("refused")  # probe failed: 1 s
    clock.now += 1.0
    g.check()
    g.succeeded()
    g.failed("reset")
    assert g.epoch == first + 1 and g.state().outages == 2
    clock.now += 0.5
    assert not refused(g)


def test_a_job_on_a_connection_from_before_the_outage_does_not_bring_it_up() -> None:
    g, clock = gate()
    before = g.epoch
    g.failed("server closed the connection unexpectedly")
    g.succeeded(before)  # a job that was under way when it went down, ended well
    assert not g.state().up
    clock.now += 0.5
    g.check()
    g.succeeded(g.epoch)  # the probe, on a connection opened since
    assert g.state().up and g.state().outages == 1
