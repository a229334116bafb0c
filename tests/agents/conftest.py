"""The real coding agents (Claude Code, Codex, opencode; ``testing.agents``) for the tests here,
all marked ``agents`` (``pytest -m agents`` selects them, ``-m "not agents"`` leaves them out).

Their fixture ``agents`` is in ``tests/conftest.py`` (the end-to-end tests use it too).
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.agents)
