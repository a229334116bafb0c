"""An in-process Engram for tests, benchmarks and scripts: a real aiohttp app on a real port.

    engram = await start_engram(fake.url, slots={"min_tokens": 100})
    ...  # drive it at engram.base_url
    await settle(engram)  # its background work (archiving, embedding, summaries) is done
    await engram.close()

Every finished chat turn is also collected in ``engram.turns``.
"""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.app import create_app
from proxy.chat.fence import BLOCK_CLOSE, BLOCK_OPEN
from proxy.chat.turn import ChatTurn
from proxy.config import Settings, load_settings
from proxy.messages import content_text
from proxy.services import SERVICES
from proxy.store import queries
from proxy.store.models import Turn

# The embedding model comes from PyPI packages; never ask a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class Engram:
    """A running Engram app on a real port, with a probe that collects finished chat turns."""

    url: str
    app: web.Application
    runner: web.AppRunner
    tmp: tempfile.TemporaryDirectory[str]
    turns: list[ChatTurn] = field(default_factory=list)

    async def close(self) -> None:
        await self.runner.cleanup()
        self.tmp.cleanup()

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


async def start_engram(upstream_url: str, **sections: dict[str, Any]) -> Engram:
    """Engram on a free port with its own database in a temporary folder. Unless a test says
    otherwise it uses the deterministic hash embedder (tests about memory use the real model;
    with the hash embedder the relevance gate is off unless the test sets it), a
    recall deadline of 5 s (``limits.recall_deadline``), loopback clients may use the admin API
    without the token (``auth.loopback_admin``), and Engram's own upstream calls wait only while
    a request is in flight (``upstream.own_calls_idle = 0``)."""
    tmp = tempfile.TemporaryDirectory(prefix="engram-test-")
    overrides: dict[str, dict[str, Any]] = {
        # Engram's own calls (summaries…) wait for no chat in flight, not for seconds of quiet
        # (tests of that wait set their own upstream.own_calls_idle).
        "upstream": {"url": upstream_url, "own_calls_idle": 0.0},
        "memory": {"db_path": f"{tmp.name}/engram.db"},
        "embedder": {"model": "hash"},
        # Tests of other things reach the admin API from loopback without the token; the
        # tests of access control set this back to False (the default).
        "auth": {"loopback_admin": True},
        # Tests assert what recall finds, on machines shared with other work: a deadline that
        # only a stalled search reaches (tests of the deadline set their own).
        "limits": {"recall_deadline": 5.0},
    }
    for name, values in sections.items():
        overrides.setdefault(name, {}).update(values)
    if str(overrides["embedder"].get("model", "")).startswith("hash"):
        # The relevance gate's cosine bars are calibrated on a real model's vectors; the hash
        # embedder's (shared words only) mean nothing to it: off unless the test says.
        overrides.setdefault("retrieval", {}).setdefault("gate", False)
    # Tests of tool-result slots hold small conversations, far from any context budget: their
    # outputs become references at once (the default waits until the prompt fills,
    # slots.replace; tests/proxy/test_stable_prefix.py tests that) unless the test says.
    overrides.setdefault("slots", {}).setdefault("replace", "always")
    settings: Settings = load_settings(None, None, overrides)
    app = create_app(settings)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    engram = Engram(f"http://127.0.0.1:{port}", app, runner, tmp)

    async def probe(turn: ChatTurn) -> None:
        engram.turns.append(turn)

    for pipeline in app[SERVICES].pipelines.values():
        pipeline.reply_hooks.append(probe)
    return engram


async def settle(engram: Engram, timeout: float = 10.0) -> None:
    """Wait until Engram's background work (archiving, embedding, summaries) is done."""
    tasks = engram.app[SERVICES].tasks
    for _ in range(int(timeout / 0.01)):
        if not len(tasks):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("background work did not finish")


async def turns_as_sent(engram: Engram, session_id: str) -> list[Turn]:
    """A session's turns with their text as the client sent it (the scaffolding that is stored
    once per user put back, :mod:`proxy.store.scaffolds`): what archiving must not lose."""
    store = engram.app[SERVICES].store
    assert store is not None, "memory is off"
    return await store.read(lambda c: queries.session_turns(c, session_id, as_sent=True))


_BLOCK = re.compile(re.escape(BLOCK_OPEN) + r"[^>]*>.*?" + re.escape(BLOCK_CLOSE) + r"[^>]*>", re.S)


def memory_blocks(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every memory block in forwarded ``messages``, in order, wherever it sits: the system
    message (``prompt.mode = "zones"``) or leading a user message (``"stable"``, the default)."""
    out: list[str] = []
    for m in messages:
        out += _BLOCK.findall(content_text(m.get("content")))
    return out


def forwarded_memory(messages: Sequence[Mapping[str, Any]]) -> str:
    """The text of every memory block in forwarded ``messages`` ("" when none)."""
    return "\n".join(memory_blocks(messages))
