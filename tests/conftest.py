"""Shared fixtures: a fake upstream and Engram itself, both real servers on real ports."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest_asyncio
from aiohttp import web

from proxy.app import PIPELINE, create_app
from proxy.config import Settings, load_settings
from proxy.pipeline import ChatTurn
from tests.fake_upstream import FakeUpstream

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class Engram:
    """A running Engram app on a real port, with a probe that collects finished chat turns."""

    url: str
    app: web.Application
    runner: web.AppRunner
    turns: list[ChatTurn] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


async def start_engram(upstream_url: str, **sections: dict[str, Any]) -> Engram:
    overrides: dict[str, dict[str, Any]] = {"upstream": {"url": upstream_url}}
    for name, values in sections.items():
        overrides.setdefault(name, {}).update(values)
    settings: Settings = load_settings(None, None, overrides)
    app = create_app(settings)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    engram = Engram(f"http://127.0.0.1:{port}", app, runner)

    async def probe(turn: ChatTurn) -> None:
        engram.turns.append(turn)

    app[PIPELINE].reply_hooks.append(probe)
    return engram


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as upstream:
        yield upstream


@pytest_asyncio.fixture
async def engram(fake: FakeUpstream) -> AsyncIterator[Engram]:
    e = await start_engram(fake.url)
    try:
        yield e
    finally:
        await e.runner.cleanup()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
