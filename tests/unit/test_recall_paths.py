"""The recall deadline's two paths: when both fail (a store outage fails both), one failure is
raised and neither is left to asyncio's "Task exception was never retrieved" log."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from proxy.search.retrieval import _by_deadline

pytestmark = pytest.mark.asyncio


async def failing(what: str, after: float) -> list[tuple[int, float]]:
    await asyncio.sleep(after)
    raise ConnectionError(f"{what} path: the store is down")


async def ranked(after: float) -> list[tuple[int, float]]:
    await asyncio.sleep(after)
    return [(1, 0.5)]


@pytest.mark.parametrize("fts_after, vec_after", [(0.0, 0.0), (0.0, 0.05), (0.05, 0.0)])
async def test_both_paths_failing_raise_one_failure_and_log_none(
    fts_after: float, vec_after: float
) -> None:
    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    try:
        with pytest.raises(ConnectionError):
            await _by_deadline(
                failing("fts", fts_after), failing("vec", vec_after), loop.time() + 5, None
            )
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert not unretrieved, [c.get("message") for c in unretrieved]


async def test_a_failed_vector_path_is_raised_when_full_text_answered() -> None:
    loop = asyncio.get_running_loop()
    with pytest.raises(ConnectionError, match="vec path"):
        await _by_deadline(ranked(0.0), failing("vec", 0.0), loop.time() + 5, None)


async def test_a_late_vector_path_degrades_to_full_text() -> None:
    loop = asyncio.get_running_loop()
    degraded: list[str] = []
    fts, vec = await _by_deadline(ranked(0.0), ranked(5.0), loop.time() + 0.1, degraded)
    assert fts == [(1, 0.5)] and vec == [] and degraded
