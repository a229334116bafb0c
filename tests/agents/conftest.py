"""The real coding agents (Claude Code, Codex, opencode; ``testing.agents``) for the tests here,
all marked ``agents`` (``pytest -m agents`` selects them, ``-m "not agents"`` leaves them out).

Not installed (``make agents-deps``, which ``make test`` runs; it needs npm): the tests that need
them are skipped with that reason; under CI (``CI=true``) that is a failure.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from testing.agents import Agents, AgentsMissing, find_agents

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.agents)


@pytest.fixture(scope="session")
def agents() -> Agents:
    try:
        return find_agents()
    except AgentsMissing as exc:
        reason = str(exc)
        if shutil.which("npm") is None:
            reason += " (it needs npm, from Node.js, which is not on PATH)"
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)
