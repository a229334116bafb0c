"""The token counter's per-model corrections shared through the database (proxy/background/
stats.py ``Calibration``): a process that has not learned a model takes what another learned,
keeps what it learned itself, and a broken stored value is ignored, not fatal."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.background.stats import Calibration
from proxy.store import Store
from proxy.store.counters import CALIBRATION_KEY
from proxy.tokens import UNCALIBRATED, TokenCounter

pytestmark = pytest.mark.asyncio


async def test_a_process_takes_the_corrections_another_learned(store_target: str | Path) -> None:
    async with Store(store_target) as a, Store(store_target) as b:
        ta, tb = TokenCounter(), TokenCounter()
        ta.learn("smollm2", 1000, 1300)  # its factor: 1.3
        ta.learn("smollm2", 1000, 1300 + 10, rendered=8000)  # renders almost none of the tools
        tb.learn("other", 1000, 900)
        assert tb.factor("smollm2") == UNCALIBRATED and tb.rendered_share("smollm2") == 1.0
        await Calibration(a, ta).sync()
        await Calibration(b, tb).sync()
        assert tb.factor("smollm2") == pytest.approx(1.3)
        assert tb.rendered_share("smollm2") == pytest.approx(ta.rendered_share("smollm2"), abs=1e-3)
        assert tb.rendered_share("smollm2") < 0.01
        tb.learn("smollm2", 1000, 1000)  # b's own learning moves on from there
        await Calibration(a, ta).sync()
        assert ta.factor("smollm2") == pytest.approx(1.3)  # a keeps what it learned itself
        assert ta.factor("other") == pytest.approx(0.9)  # and takes what it had not


async def test_a_broken_stored_value_is_ignored(store_target: str | Path) -> None:
    async with Store(store_target) as st:
        for junk in ("not json", '["a list"]', '{"ratio": {"m": 1e9, "n": "x", "o": 2.0}}'):
            await st.write(
                lambda c, j=junk: c.execute(
                    "INSERT INTO meta(key, value) VALUES (?, ?)"
                    " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (CALIBRATION_KEY, j),
                )
            )
            tokens = TokenCounter()
            await Calibration(st, tokens).sync()
            assert tokens.ratio("m") is None and tokens.ratio("n") is None
        assert tokens.ratio("o") == 2.0  # in range: taken


async def test_a_request_of_an_unlearned_model_reads_what_others_learned(
    store_target: str | Path,
) -> None:
    """``take`` (before budgeting a model not learned here) reads at once, then at most once a
    second: what another process stored a moment ago counts for this request."""
    async with Store(store_target) as a, Store(store_target) as b:
        ta, tb = TokenCounter(), TokenCounter()
        mine = Calibration(b, tb)
        await mine.take()  # nothing stored yet
        ta.learn("smollm2", 1000, 1010, rendered=8000)
        await Calibration(a, ta).sync()
        await mine.take()  # within the second: not read again
        assert not tb.knows_rendered("smollm2")
        mine._taken -= 2  # a second later
        await mine.take()
        assert tb.knows_rendered("smollm2") and tb.rendered_share("smollm2") < 0.01
