"""The real coding agents (Claude Code, Codex, opencode, Qwen Code, aider; ``testing.agents``) for
the tests here, all marked ``agents`` (``pytest -m agents`` selects them, ``-m "not agents"``
leaves them out).

Their fixture ``agents`` is in ``tests/conftest.py`` (the end-to-end tests use it too). ``record``
makes a :class:`~testing.traffic.Recording` of a client's requests, saved when the test ends (a
failed one too) if ``ENGRAM_RECORD_TRAFFIC=1``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from testing.traffic import Recording, Source

HERE = Path(__file__).parent

Record = Callable[[str, str, str, Source], Recording]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.agents)


@pytest.fixture
def record() -> Iterator[Record]:
    made: list[Recording] = []

    def make(client: str, version: str, via: str, source: Source) -> Recording:
        made.append(Recording(client, version, via, source))
        return made[-1]

    yield make
    for rec in made:
        rec.save()
