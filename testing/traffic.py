"""What real clients send, recorded to measure Engram's rules against (issue 38): every request a
client made in a test, run by run, as JSON lines in ``tests/data/clients/<client>-<version>.jsonl``.

    rec = Recording("qwen", agents.versions["qwen"], "direct", fake)  # fake.requests, recorded
    rec.run("new")                                   # before each run of the client
    await run_qwen(fake.url, ...)
    rec.save()                                       # only with ENGRAM_RECORD_TRAFFIC=1

Through Engram, a :class:`RecordingRelay` in front of it records what the client sent (Engram's
answer headers, ``X-Engram-*``, with each) while Engram sees the client's requests unchanged:

    relay = RecordingRelay(engram.url); await relay.start()   # the client talks to relay.url

One line a request: ``client``, ``version``, ``via`` (``direct``: straight to the fake
upstream; ``engram``: to Engram), ``run`` (the label given, numbered), ``seq``, ``method``,
``path``, ``query``, ``headers`` (without the transport's: Host, Content-Length…), ``body``
(the parsed JSON, else the text), and through Engram ``status`` and ``engram`` (its
``X-Engram-*`` answer headers). Saving replaces that file's lines of the same ``via`` and keeps
the others, so a direct test and a through-Engram test write one file.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from testing.fake_upstream import RecordedRequest

__all__ = ["TRAFFIC_DIR", "Recording", "RecordingRelay", "Source", "recording_on"]

TRAFFIC_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "clients"
ENV = "ENGRAM_RECORD_TRAFFIC"
TRANSPORT = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "upgrade",
        "accept-encoding",
    }
)


def recording_on() -> bool:
    return os.environ.get(ENV, "").lower() in ("1", "true", "yes")


class RecordingRelay:
    """A relay on a real port that forwards every request to ``upstream`` unchanged (the
    transport's headers aside) and streams the answer back chunk by chunk, recording the
    request (``requests``) and the answer's status and ``X-Engram-*`` headers (``answers``)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.url = ""
        self.requests: list[RecordedRequest] = []
        self.answers: list[dict[str, Any]] = []
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        self.requests.append(
            RecordedRequest(
                request.method,
                request.path,
                request.query_string,
                CIMultiDict(request.headers),
                body,
                time.monotonic(),
            )
        )
        answer: dict[str, Any] = {}
        self.answers.append(answer)
        hop = TRANSPORT - {"accept-encoding"}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in hop}
        async with self._session.request(
            request.method, self.upstream + request.raw_path, headers=headers, data=body or None
        ) as up:
            answer["status"] = up.status
            answer["engram"] = {
                k: v for k, v in up.headers.items() if k.lower().startswith("x-engram-")
            }
            out = {k: v for k, v in up.headers.items() if k.lower() not in hop}
            resp = web.StreamResponse(status=up.status, headers=out)
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp


class Source(Protocol):
    """What records requests: a fake upstream, a relay."""

    @property
    def requests(self) -> list[RecordedRequest]: ...


class Recording:
    """A client's requests to ``source`` (a :class:`~testing.fake_upstream.FakeUpstream` or a
    :class:`RecordingRelay`), labelled by the run that sent them."""

    def __init__(self, client: str, version: str, via: str, source: Source) -> None:
        self.client, self.version, self.via, self.source = client, version, via, source
        self.runs: list[tuple[int, str]] = []  # (index of the run's first request, label)

    def run(self, label: str) -> None:
        """The requests from now on are the next run's, ``label`` (``new``, ``continue``…)."""
        self.runs.append((len(self.source.requests), f"{len(self.runs) + 1} {label}"))

    def lines(self) -> list[dict[str, Any]]:
        answers: Sequence[Mapping[str, Any]] = getattr(self.source, "answers", [])
        out = []
        for seq, req in enumerate(self.source.requests):
            labels = [label for start, label in self.runs if start <= seq]
            try:
                body: Any = json.loads(req.body) if req.body else None
            except ValueError:
                body = req.body.decode("utf-8", "replace")
            line: dict[str, Any] = {
                "client": self.client,
                "version": self.version,
                "via": self.via,
                "run": labels[-1] if labels else "",
                "seq": seq,
                "method": req.method,
                "path": req.path,
                "query": req.query_string,
                "headers": {k: v for k, v in req.headers.items() if k.lower() not in TRANSPORT},
                "body": body,
            }
            if seq < len(answers):
                line |= dict(answers[seq])
            out.append(line)
        return out

    def path(self) -> Path:
        return TRAFFIC_DIR / f"{self.client}-{self.version}.jsonl"

    def save(self) -> Path | None:
        """Write this recording into the client's file (its earlier lines of this ``via``
        replaced), when ``ENGRAM_RECORD_TRAFFIC`` is set; else nothing."""
        if not recording_on():
            return None
        path = self.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if path.exists():
            kept = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            kept = [x for x in kept if x.get("via") != self.via]
        lines = sorted(kept + self.lines(), key=lambda x: (x["via"], x["seq"]))
        path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
        return path
