"""The model server behind Engram: one pooled client, detection, health and context size.

Requests are sent with the client's own headers (minus hop-by-hop and Engram's own), no
automatic headers of aiohttp's, no decompression (bytes are relayed as sent), a connect timeout
and no total timeout, because generations can take many minutes.

A pooled connection can be dead when a request picks it up: llama-server closes its connection
about 0.1 ms after every streamed reply while advertising keep-alive, and the next request sent
on it dies before any byte of an answer ("Server disconnected", or a reset). A request whose
connection came from the pool and died so is sent once more, with the same method, URL, headers
and body, on a connection opened for it alone (a second session that pools nothing). Not
retried: the same death on a connection opened for the request (the upstream failed on it; a
second try could repeat a crash or a long generation), a failure to connect (nothing listens:
one fast 502) and anything after the answer's headers arrived (the relay's business).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from proxy.config import UpstreamSettings
from proxy.errors import BadRequest, UpstreamUnavailable
from proxy.logs import event
from proxy.masking import display_url

log = logging.getLogger("engram.upstream")

LLAMACPP_DEFAULT = "http://127.0.0.1:8080"
OLLAMA_DEFAULT = "http://127.0.0.1:11434"

# RFC 9110 §7.6.1 connection-specific fields; never forwarded in either direction.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
_LARGE_BODY = 1 << 20
_FAILURES = (TimeoutError, aiohttp.ClientConnectionError, OSError)  # no answer: a 502
# A connection that died under a request: closed or reset by the server, or a failed write.
_DIED = (
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    ConnectionResetError,
    BrokenPipeError,
)
CONTEXT_RETRY_S = 30.0  # how long an undiscoverable context size is taken as unknown
# Headers Engram reads and owns: stripped before forwarding.
ENGRAM_HEADER_PREFIX = "x-engram-"


def forward_headers(headers: Mapping[str, str], *, drop: Iterable[str] = ()) -> CIMultiDict[str]:
    """Headers to send on: hop-by-hop ones, those named in ``Connection``, Engram's own,
    ``Host`` and ``Content-Length`` (recomputed by the client) and ``drop`` removed."""
    remove = set(HOP_BY_HOP) | {"host", "content-length"} | {d.lower() for d in drop}
    conn = headers.get("Connection")
    if conn:
        remove.update(token.strip().lower() for token in conn.split(","))
    out: CIMultiDict[str] = CIMultiDict()
    items = headers.items()
    for name, value in items:
        low = name.lower()
        if low in remove or low.startswith(ENGRAM_HEADER_PREFIX):
            continue
        out.add(name, value)
    return out


def upstream_credentials(headers: Mapping[str, str], api_key: str) -> CIMultiDict[str]:
    """``headers`` without the client's credentials, with ``Authorization: Bearer <api_key>``
    when one is configured."""
    out = CIMultiDict(
        (k, v) for k, v in headers.items() if k.lower() not in ("authorization", "x-api-key")
    )
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    return out


def response_headers(headers: Mapping[str, str], *, keep_cors: bool) -> CIMultiDict[str]:
    """Upstream response headers to relay: hop-by-hop removed; CORS removed unless configured."""
    remove = set(HOP_BY_HOP)
    conn = headers.get("Connection")
    if conn:
        remove.update(token.strip().lower() for token in conn.split(","))
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        low = name.lower()
        if low in remove or (not keep_cors and low.startswith("access-control-")):
            continue
        out.add(name, value)
    return out


def check_target(raw_path: str) -> None:
    """A 400 unless the request target is a path (origin-form, ``/...``): an absolute-form
    target (``POST http://host/v1/... HTTP/1.1``, which aiohttp accepts and routes by its path)
    would otherwise be glued to the upstream's origin."""
    if not raw_path.startswith("/"):
        raise BadRequest(
            "The request target must be a path such as /v1/chat/completions; Engram is not a "
            f"forward proxy (got {raw_path[:100]!r}).",
            code="invalid_request_target",
        )


def join_url(base: URL, raw_path: str) -> URL:
    """The upstream URL for an incoming raw path+query (kept byte-exact, already encoded; a
    target that is not a path is a 400, see :func:`check_target`).

    A base that ends in ``/v1`` (as people write OPENAI_BASE_URL) does not double it.
    """
    check_target(raw_path)
    prefix = base.raw_path.rstrip("/")
    if prefix.endswith("/v1") and (raw_path == "/v1" or raw_path.startswith(("/v1/", "/v1?"))):
        prefix = prefix[:-3]
    origin = str(base.origin())
    return URL(origin + prefix + raw_path, encoded=True)


@dataclass
class UpstreamInfo:
    """What we know of the upstream: where, what kind, and its context window."""

    url: str
    kind: str  # llamacpp | ollama | openai | unknown
    found_by: str  # configured | detected | fallback
    context_size: int | None = None


CHAT_PATH = "/v1/chat/completions"


def path_unknown(body: bytes) -> bool:
    """Whether a 404's body says the path is unknown (llama-server's "File Not Found", a bare
    404) rather than that a model is (Ollama answers 404 for "model 'x' not found")."""
    return b"model" not in body.lower()


def upstream_message(body: bytes) -> str:
    """The message of an upstream error body (OpenAI's, Ollama's or any JSON), else its text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:500] or "(no body)"
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return str(err["message"])[:500]
    if isinstance(err, str):
        return err[:500]
    return json.dumps(data)[:500]


class Upstream:
    """The pooled HTTP client to the model server. Create inside a running event loop."""

    def __init__(
        self, settings: UpstreamSettings, info: UpstreamInfo, keep_client_key: bool = True
    ) -> None:
        """``keep_client_key`` off (``auth.mode = "keys"``: the client's key is Engram's): the
        client's credentials never go upstream. ``settings.api_key``, when set, replaces them."""
        self.settings = settings
        self.info = info
        self._replace_key = bool(settings.api_key) or not keep_client_key
        # Chat APIs (adapter names) this upstream answered 404 for: translated from then on.
        self.missing_apis: set[str] = set()
        self.base = URL(info.url)
        self._ctx_cache: dict[str, tuple[int | None, float]] = {}  # key -> (size, when)
        self._ctx_lock = asyncio.Lock()
        self._urls: dict[str, URL] = {}  # raw path -> upstream URL (building one costs)
        limit = settings.max_connections
        self.session = _client_session(
            settings,
            aiohttp.TCPConnector(limit=limit, limit_per_host=limit, ttl_dns_cache=300),
            trace=True,
        )
        # For a request sent again after its pooled connection died: a new connection each.
        self._fresh = _client_session(
            settings,
            aiohttp.TCPConnector(
                limit=limit, limit_per_host=limit, ttl_dns_cache=300, force_close=True
            ),
        )

    async def close(self) -> None:
        await self.session.close()
        await self._fresh.close()

    async def send(
        self, method: str, raw_path: str, headers: Mapping[str, str], body: bytes | None
    ) -> aiohttp.ClientResponse:
        """Send a request and return once the response headers arrived.

        The caller owns the response: read it, then release or close it.
        """
        url = self._urls.get(raw_path)
        if url is None:
            if len(self._urls) > 1024:
                self._urls.clear()
            url = self._urls[raw_path] = join_url(self.base, raw_path)
        if self._replace_key:
            headers = upstream_credentials(headers, self.settings.api_key)
        attempt = _Attempt()
        try:
            try:
                return await _request(self.session, method, url, headers, body, attempt)
            except _FAILURES as exc:
                if not (attempt.reused and died_unanswered(exc)):
                    raise
                event(
                    log,
                    logging.DEBUG,
                    "the upstream closed a pooled connection before answering; sending it again "
                    "on a new connection",
                    method=method,
                    path=url.path,
                    error=describe_connect_error(exc, self.settings.connect_timeout),
                )
            return await _request(self._fresh, method, url, headers, body, None)
        except _FAILURES as exc:
            raise UpstreamUnavailable(
                "Engram could not reach the upstream model server at "
                f"{display_url(self.info.url)}: "
                f"{describe_connect_error(exc, self.settings.connect_timeout)}. "
                "Is it running? Set it with --upstream URL or [upstream] url.",
            ) from exc

    async def probe(self) -> tuple[bool, str]:
        """Whether the upstream answers now, and how."""
        path = {"llamacpp": "/health", "ollama": "/api/version"}.get(self.info.kind, "/v1/models")
        try:
            async with self.session.get(
                join_url(self.base, path),
                timeout=aiohttp.ClientTimeout(total=self.settings.probe_timeout),
            ) as resp:
                await resp.read()
                return resp.status < 500, f"GET {path} -> {resp.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return False, describe_connect_error(exc, self.settings.probe_timeout)

    async def context_size(self, model: str | None = None) -> int | None:
        """The context window: configured, else discovered (cached per model)."""
        if self.settings.context_size:
            return self.settings.context_size
        # llama.cpp serves one context whatever the model name; Ollama's depends on the model.
        key = (model or "") if self.info.kind == "ollama" else ""
        cached = self._ctx_cache.get(key)
        if cached is not None and (
            cached[0] is not None or time.monotonic() - cached[1] < CONTEXT_RETRY_S
        ):
            return cached[0]
        async with self._ctx_lock:  # one discovery at a time, not one per waiting request
            cached = self._ctx_cache.get(key)
            if cached is not None and (
                cached[0] is not None or time.monotonic() - cached[1] < CONTEXT_RETRY_S
            ):
                return cached[0]
            size = await discover_context_size(
                self.session, self.base, self.info.kind, model, self.settings.probe_timeout
            )
            # An unknown size is remembered too (retried later), so requests don't each wait.
            self._ctx_cache[key] = (size, time.monotonic())
        if size and not key:
            self.info.context_size = size
        return size


@dataclass(slots=True)
class _Attempt:
    """One request's trace context: whether its connection came from the pool."""

    reused: bool = False


async def _on_reuse(
    session: aiohttp.ClientSession,
    ctx: SimpleNamespace,
    params: aiohttp.TraceConnectionReuseconnParams,
) -> None:
    if isinstance(ctx.trace_request_ctx, _Attempt):
        ctx.trace_request_ctx.reused = True


def _client_session(
    settings: UpstreamSettings, connector: aiohttp.TCPConnector, *, trace: bool = False
) -> aiohttp.ClientSession:
    traces = []
    if trace:
        config = aiohttp.TraceConfig()
        config.on_connection_reuseconn.append(_on_reuse)
        traces.append(config)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=settings.connect_timeout, sock_read=None
        ),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Content-Type", "Accept", "Accept-Encoding"),
        cookie_jar=aiohttp.DummyCookieJar(),
        trace_configs=traces,
    )


async def _request(
    session: aiohttp.ClientSession,
    method: str,
    url: URL,
    headers: Mapping[str, str],
    body: bytes | None,
    attempt: _Attempt | None,
) -> aiohttp.ClientResponse:
    # Large bodies go as a stream (a new one each attempt), so aiohttp does not copy them in
    # one blocking write.
    data = io.BytesIO(body) if body and len(body) > _LARGE_BODY else body or None
    return await session.request(
        method,
        url,
        headers=headers,
        data=data,
        allow_redirects=False,
        compress=None,
        trace_request_ctx=attempt,
    )


def died_unanswered(exc: BaseException) -> bool:
    """Whether ``exc`` says an open connection died under a request before any answer: the
    server closed or reset it, or writing the request to it failed. Not a failure to connect
    (nothing listens, a refused or timed-out connect), which a second attempt would only repeat."""
    return isinstance(exc, _DIED) and not isinstance(exc, aiohttp.ClientConnectorError)


def describe_connect_error(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return f"no connection within {timeout:g} s"
    text = str(exc) or type(exc).__name__
    return text


async def get_json(
    session: aiohttp.ClientSession, method: str, url: URL, timeout: float, payload: Any = None
) -> tuple[int, Any] | None:
    try:
        async with session.request(
            method,
            url,
            json=payload,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            raw = await resp.read()
            try:
                return resp.status, json.loads(raw) if raw else None
            except ValueError:
                return resp.status, None
    except (TimeoutError, aiohttp.ClientError, OSError):
        return None


async def identify(session: aiohttp.ClientSession, base: URL, timeout: float) -> str | None:
    """What answers at ``base``: 'llamacpp', 'ollama', 'openai', or None if nothing does."""
    got = await get_json(session, "GET", join_url(base, "/health"), timeout)
    if got is None:
        return None  # nothing listens there
    status, body = got
    if status in (200, 503) and isinstance(body, dict) and "status" in body:
        return "llamacpp"
    got = await get_json(session, "GET", join_url(base, "/api/version"), timeout)
    if got and got[0] == 200 and isinstance(got[1], dict) and "version" in got[1]:
        return "ollama"
    return "openai"


async def detect(settings: UpstreamSettings) -> UpstreamInfo:
    """Resolve the upstream: the configured URL (its kind probed), or auto-detect."""
    async with aiohttp.ClientSession() as session:
        if settings.url:
            kind = settings.kind
            if kind == "auto":
                kind = (
                    await identify(session, URL(settings.url), settings.probe_timeout) or "unknown"
                )
            return UpstreamInfo(settings.url, kind, "configured")
        for url, expect in ((LLAMACPP_DEFAULT, "llamacpp"), (OLLAMA_DEFAULT, "ollama")):
            if await identify(session, URL(url), settings.probe_timeout) == expect:
                return UpstreamInfo(url, expect, "detected")
    return UpstreamInfo(LLAMACPP_DEFAULT, "unknown", "fallback")


async def discover_context_size(
    session: aiohttp.ClientSession, base: URL, kind: str, model: str | None, timeout: float
) -> int | None:
    """llama.cpp: GET /props → default_generation_settings.n_ctx;
    Ollama: POST /api/show → model_info["<arch>.context_length"] (num_ctx if set)."""
    if kind in ("llamacpp", "unknown", "openai"):
        got = await get_json(session, "GET", join_url(base, "/props"), timeout)
        if got and got[0] == 200 and isinstance(got[1], dict):
            settings = got[1].get("default_generation_settings")
            n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
            if isinstance(n_ctx, int) and n_ctx > 0:
                return n_ctx
    if kind == "ollama" and model:
        got = await get_json(
            session, "POST", join_url(base, "/api/show"), timeout, {"model": model}
        )
        if got and got[0] == 200 and isinstance(got[1], dict):
            return _ollama_ctx(got[1])
    return None


def _ollama_ctx(show: dict[str, Any]) -> int | None:
    params = show.get("parameters")
    if isinstance(params, str):
        for line in params.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "num_ctx" and parts[1].isdigit():
                return int(parts[1])
    info = show.get("model_info")
    if isinstance(info, dict):
        arch = info.get("general.architecture")
        value = info.get(f"{arch}.context_length")
        if isinstance(value, int) and value > 0:
            return value
    return None
