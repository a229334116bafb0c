"""Chat apps as their users run them (Open WebUI, ``testing.openwebui``), in a real headless
Chromium, all marked ``openwebui`` (``pytest -m openwebui`` selects them, ``-m "not openwebui"``
leaves them out).

Open WebUI comes from ``make openwebui-deps`` (which ``make test`` runs): the version pinned in
``testing/openwebui.pins``, in its own virtualenv in the cache. Not installed, or no Chromium: the
tests skip with that reason; under ``CI=true`` they fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testing.browser import chromium_or_skip
from testing.openwebui import OpenWebUI, OpenWebUIMissing, find_openwebui

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.openwebui)


@pytest.fixture(scope="session")
def openwebui() -> OpenWebUI:
    """The installed Open WebUI (``testing.openwebui_install``), a Chromium to drive it: either
    missing, skipped with the reason; under ``CI=true``, failed."""
    chromium_or_skip()
    try:
        return find_openwebui()
    except OpenWebUIMissing as exc:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true but {exc}", pytrace=False)
        pytest.skip(str(exc))
