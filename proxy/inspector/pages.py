"""The inspector's pages that show memory: sign-in, the overview, sessions and one session, the
user's notes, facts and pins, and the slots. Each reads a page of rows (:mod:`proxy.store.browse`)
and renders a template; nothing here changes memory (:mod:`proxy.inspector.forms` does)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from proxy.api.views import owned_session
from proxy.background.stats import token_figures
from proxy.errors import BadRequest, EngramError
from proxy.inspector import charts
from proxy.inspector.signin import cookie_header
from proxy.inspector.web import (
    HEADERS,
    INSPECTOR,
    PREFIX,
    Visit,
    current,
    page,
    parts_of,
    render,
)
from proxy.jsonl import export_line
from proxy.masking import display_url
from proxy.relay import body_read
from proxy.search.fts_query import match_of, query_words
from proxy.services import SERVICES
from proxy.store import browse, corrections
from proxy.store.counters import memory_counts
from proxy.store.items import session_items
from proxy.store.naming import FACTS_PREFIX, NOTES_PREFIX, named_session
from proxy.store.summaries import get_summary

PAGE = 50
TURNS_PAGE = 200
MAX_PAGE = 100_000
PROBE_SECONDS = 1.5
TEXT_MATCHES = 500  # full-text matches the sessions filter looks at


def page_number(raw: str | None) -> int:
    if raw is None or raw == "":
        return 1
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE:
        raise BadRequest(f"page must be a number from 1 to {MAX_PAGE}; got {raw!r}.", param="page")
    return int(raw)


def day(raw: str | None, name: str) -> float | None:
    """A date field (YYYY-MM-DD, UTC) as Unix seconds at its start."""
    if not raw:
        return None
    try:
        return datetime.strptime(raw, "%Y-%m-%d").replace(tzinfo=UTC).timestamp()
    except ValueError:
        raise BadRequest(f"{name} must be a date, YYYY-MM-DD; got {raw!r}.", param=name) from None


# --- sign-in ------------------------------------------------------------------------------------


async def signin_page(request: web.Request) -> web.StreamResponse:
    if current(request) is not None:
        raise web.HTTPSeeOther(f"{PREFIX}/", headers=HEADERS)
    return render(request, "signin.html", None, keys=request.app[SERVICES].auth.keys)


async def signin_post(request: web.Request) -> web.StreamResponse:
    """Check the credential as the admin API does, but never let loopback in without one."""
    data = await body_read(request, request.post())
    token = data.get("token")
    auth = request.app[SERVICES].auth
    if not isinstance(token, str) or not token.strip() or len(token) > 512:
        return render(request, "signin.html", None, 400, keys=auth.keys, failed=True)
    try:
        principal = await auth.admin({"Authorization": f"Bearer {token.strip()}"}, None)
    except EngramError:
        return render(request, "signin.html", None, 401, keys=auth.keys, failed=True)
    ws = request.app[INSPECTOR].sessions.start(principal)
    secure = request.secure
    raise web.HTTPSeeOther(
        f"{PREFIX}/", headers={**HEADERS, "Set-Cookie": cookie_header(ws, secure)}
    )


# --- overview -----------------------------------------------------------------------------------


@page
async def overview(request: web.Request, v: Visit) -> web.StreamResponse:
    services = request.app[SERVICES]
    parts = parts_of(request)
    store, memory = parts.store, parts.memory
    upstream = services.upstream
    try:
        reachable, _ = await asyncio.wait_for(upstream.probe(), PROBE_SECONDS)
    except TimeoutError:
        reachable = False
    stats = await store.stats()
    counts = await store.read(lambda c: memory_counts(c, v.user))
    user_turns, user_sessions = await store.read(lambda c: browse.user_totals(c, v.user))
    tokens = token_figures(parts.counters.current(), services.settings)
    pipeline_counts: Counter[str] = Counter()
    for each in services.pipelines.values():
        pipeline_counts.update(each.counts)
    recent = memory.recent
    p50, p95 = recent.percentiles()
    latencies = [ms for _, ms in list(recent.latencies)[-120:]]
    saved = list(recent.saved)[-120:]
    reports, computed, reused = recent.reuse()
    slots = parts.slots
    indexer = memory.indexer
    info = upstream.info
    return render(
        request,
        "overview.html",
        v,
        upstream={
            "kind": info.kind,
            "url": display_url(info.url),
            "context": info.context_size,
            "reachable": reachable,
        },
        stats=stats,
        user_turns=user_turns,
        user_sessions=user_sessions,
        counts=counts,
        tokens=tokens,
        sent=sum(s for _, s, _ in saved),
        forwarded=sum(f for _, _, f in saved),
        recent_requests=len(saved),
        cache={
            "requests": reports,
            "computed": computed,
            "reused": reused,
            "share": reused / (computed + reused) if computed + reused else None,
        },
        p50=p50,
        p95=p95,
        spark=charts.sparkline(latencies),
        saved_chart=charts.saved_chart(saved),
        slot_counts=slots.counters() if slots else None,
        slot_backend=slots.backend if slots else None,
        queue={
            "index": indexer.queued if indexer else 0,
            "deferred": indexer.deferred if indexer else 0,
            "background": len(services.tasks),
        },
        failures={
            "memory stages": pipeline_counts["memory_failures"],
            "archive": pipeline_counts["archive_failures"],
            "upstream": pipeline_counts["upstream_failures"],
            "embedding": indexer.failures if indexer else 0,
            "background tasks": services.tasks.failed,
        },
        db=services.settings.memory.db_path,
    )


# --- sessions -----------------------------------------------------------------------------------


@page
async def sessions(request: web.Request, v: Visit) -> web.StreamResponse:
    parts = parts_of(request)
    q = request.query
    text = (q.get("q") or "").strip()[:200] or None
    api = (q.get("api") or "").strip()[:40] or None
    since, until = day(q.get("from"), "from"), day(q.get("to"), "to")
    if until is not None:
        until += 86400  # the whole day
    n = page_number(q.get("page"))
    among: list[str] | None = None
    if text:
        match = match_of(query_words(text))
        ids = await parts.store.fts_search(v.user, match, TEXT_MATCHES) if match is not None else []
        turns = await parts.store.get_turns([i for i, _ in ids], user_id=v.user)
        among = sorted({t.session_id for t in turns})
    rows, total = await parts.store.read(
        lambda c: browse.session_page(
            c,
            v.user,
            limit=PAGE,
            offset=(n - 1) * PAGE,
            name=text,
            among=among,
            api=api,
            since=since,
            until=until,
        )
    )
    apis = await parts.store.read(lambda c: browse.session_apis(c, v.user))
    return render(
        request,
        "sessions.html",
        v,
        rows=rows,
        total=total,
        page=n,
        pages=max(1, -(-total // PAGE)),
        q=text or "",
        api=api or "",
        apis=apis,
        date_from=q.get("from", ""),
        date_to=q.get("to", ""),
    )


@page
async def session(request: web.Request, v: Visit) -> web.StreamResponse:
    parts = parts_of(request)
    store = parts.store
    s = await owned_session(store, v.user, request.match_info["name"])
    n = page_number(request.query.get("page"))

    def read(c: Any) -> dict[str, Any]:
        return {
            "turns": browse.turn_page(c, s.id, limit=TURNS_PAGE, offset=(n - 1) * TURNS_PAGE),
            "summary": get_summary(c, s.id),
            "tree": browse.sub_sessions(c, s.id),
            "handbacks": session_items(c, s.id, "summary", 50),
            "facts": browse.facts_of(c, v.user, s.id, 100),
            "own_facts": session_items(c, s.id, "fact", 100),
        }

    data = await store.read(read)
    count = await store.count_turns(s.id)
    facts = data["facts"]
    sources = await store.read(lambda c: corrections.fact_sources(c, [f.id for f in facts]))
    source_turns = {
        t.id: t
        for t in await store.get_turns(
            [st for _, st in sources.values() if st is not None], user_id=v.user
        )
    }
    parent = None
    if s.parent_id is not None:
        parent = await store.get_session(s.parent_id)
    return render(
        request,
        "session.html",
        v,
        s=s,
        parent=parent,
        turns=data["turns"],
        count=count,
        own_facts=data["own_facts"],
        page=n,
        pages=max(1, -(-count // TURNS_PAGE)),
        summary=data["summary"],
        tree=data["tree"],
        handbacks=data["handbacks"],
        facts=facts,
        sources=sources,
        source_turns=source_turns,
        recall_names=corrections.RECALL_NAMES,
        own=not s.name.startswith((FACTS_PREFIX, NOTES_PREFIX)),
    )


@page
async def session_export(request: web.Request, v: Visit) -> web.StreamResponse:
    """The session (and its sub-sessions) as JSON Lines, as ``engram export`` writes them."""
    parts = parts_of(request)
    s = await owned_session(parts.store, v.user, request.match_info["name"])
    tree = {
        s.id,
        *(t.id for t, _ in await parts.store.read(lambda c: browse.sub_sessions(c, s.id))),
    }
    resp = web.StreamResponse(
        headers={
            **HEADERS,
            "Content-Type": "application/x-ndjson; charset=utf-8",
            "Content-Disposition": 'attachment; filename="engram-session.jsonl"',
        }
    )
    await resp.prepare(request)
    async for item in parts.store.export(v.user):
        key = "id" if item.get("type") == "session" else "session_id"
        if item.get(key) in tree:
            await resp.write((json.dumps(export_line(item), ensure_ascii=False) + "\n").encode())
    await resp.write_eof()
    return resp


# --- the user's own corrections: notes, facts, pins ---------------------------------------------


@page
async def memory_page(request: web.Request, v: Visit) -> web.StreamResponse:
    parts = parts_of(request)
    store = parts.store
    n = page_number(request.query.get("page"))

    def read(c: Any) -> dict[str, Any]:
        notes = named_session(c, v.user, f"{NOTES_PREFIX}{v.user}")
        note_rows, note_total = (
            browse.session_turns_newest(c, notes.id, limit=PAGE) if notes else ([], 0)
        )
        facts, fact_total = browse.user_items(c, v.user, "fact", limit=PAGE, offset=(n - 1) * PAGE)
        return {
            "notes": note_rows,
            "note_total": note_total,
            "facts": facts,
            "fact_total": fact_total,
            "marked": browse.marked(c, v.user, 200),
        }

    data = await store.read(read)
    return render(
        request,
        "memory.html",
        v,
        page=n,
        pages=max(1, -(-data["fact_total"] // PAGE)),
        recall_names=corrections.RECALL_NAMES,
        **data,
    )


@page
async def slots_page(request: web.Request, v: Visit) -> web.StreamResponse:
    parts = parts_of(request)
    slots = parts.slots
    n = page_number(request.query.get("page"))
    if slots is None:
        return render(request, "slots.html", v, slots=None, rows=[], total=0, page=1, pages=1)
    listed = await slots.list_user(v.user, limit=PAGE, offset=(n - 1) * PAGE)
    total = listed.total
    return render(
        request,
        "slots.html",
        v,
        slots=slots,
        rows=listed.slots,
        total=total,
        page=n,
        pages=max(1, -(-total // PAGE)),
        redis_down=listed.redis_unreachable,
    )
