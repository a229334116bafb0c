"""The inspector's pages that explain: a search with every hit's ranks, fusion features and
fused score; the recent requests as Engram forwarded them, drawn as zones, with why each memory
was injected and what each tool-result reference stands for."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from proxy.api.views import clean_query, parse_k, parse_mode
from proxy.chat.beside import places_near
from proxy.chat.prompt import summary_text
from proxy.chat.recent import ZONES, RequestView, zones
from proxy.costs import describe
from proxy.errors import NotFound, ServiceUnavailable
from proxy.inspector import charts
from proxy.inspector.pages import PAGE, page_number
from proxy.inspector.web import Visit, page, parts_of, render
from proxy.messages import content_text
from proxy.search.retrieval import Scoring
from proxy.search.scoring import FEATURES, features
from proxy.services import SERVICES
from proxy.store import queries
from proxy.store.feedback import get_request
from proxy.store.naming import session_names

MAX_SLOTS_SHOWN = 50
MESSAGE_CHARS = 20_000


@page
async def search(request: web.Request, v: Visit) -> web.StreamResponse:
    parts = parts_of(request)
    q = request.query
    raw = q.get("q")
    if raw is None or not raw.strip():
        return render(request, "search.html", v, q="", mode="hybrid", k=10, hits=None)
    query, k, mode = clean_query(raw), parse_k(q.get("k")), parse_mode(q.get("mode"))
    retriever = parts.retriever
    if mode == "vec" and retriever.embedder is None:
        raise ServiceUnavailable("Vector search is off: the embedding model did not load.")
    scoring: list[Scoring] = []
    started = time.time()
    hits = await retriever.search(v.user, query, k, mode=mode, scoring=scoring, use_mmr=False)
    feats: dict[int, dict[str, float]] = {}
    weights = retriever.settings.score_weights()
    if scoring:
        cands = scoring[0].candidates
        rows = features(cands, query, scoring[0].rankings.get("vec", ()), started)
        feats = {
            c.id: dict(zip(FEATURES, row, strict=True)) for c, row in zip(cands, rows, strict=True)
        }
    places = places_near([h.turn for h in hits], (-1, 1))
    near = await parts.store.read(lambda c: queries.turns_at(c, v.user, places))
    names = await parts.store.read(lambda c: session_names(c, {h.turn.session_id for h in hits}))
    shown = [
        {
            "hit": h,
            "session": names.get(h.turn.session_id, h.turn.session_id),
            "features": feats.get(h.turn.id),
            "before": near.get((h.turn.session_id, h.turn.position - 1)),
            "after": near.get((h.turn.session_id, h.turn.position + 1)),
        }
        for h in hits
    ]
    return render(
        request,
        "search.html",
        v,
        q=query,
        mode=mode,
        k=k,
        hits=shown,
        feature_names=FEATURES,
        weights=weights,
        fusion="scored" if scoring else ("rrf" if mode == "hybrid" else mode),
    )


@page
async def requests(request: web.Request, v: Visit) -> web.StreamResponse:
    parts = parts_of(request)
    n = page_number(request.query.get("page"))
    views, total = parts.memory.recent.of_user(v.user, PAGE, (n - 1) * PAGE)
    rows: list[dict[str, Any]] = []
    for view in views:
        a = view.assembly
        z = zones(a, _summary_tokens(request, view)) if a is not None else {}
        rows.append({"view": view, "zones": z, "bar": charts.zone_bar(z, view.budget, 300)})
    sids = {view.session for view in views if view.session}
    names = await parts.store.read(lambda c: session_names(c, sids))
    return render(
        request,
        "requests.html",
        v,
        rows=rows,
        names=names,
        total=total,
        page=n,
        pages=max(1, -(-total // PAGE)),
    )


def _summary_tokens(request: web.Request, view: RequestView) -> int:
    if not view.summary:
        return 0
    memory = parts_of(request).memory
    return memory.tokens.count(summary_text(view.summary), view.model)


@page
async def one_request(request: web.Request, v: Visit) -> web.StreamResponse:
    parts = parts_of(request)
    request_id = request.match_info["id"]
    view = parts.memory.recent.get(request_id)
    if view is None or view.user != v.user:
        found = await parts.store.read(lambda c: get_request(c, request_id))
        if found is None or found.user_id != v.user:
            raise NotFound(f"No request {request_id!r} for user {v.user!r}.")
        turns = await parts.store.get_turns(found.memory_ids, user_id=v.user)
        return render(request, "request_old.html", v, rec=found, turns=turns)
    a = view.assembly
    z = zones(a, _summary_tokens(request, view)) if a is not None else dict.fromkeys(ZONES, 0)
    ids = [i for p in (a.parts if a else []) for i in p.refs]
    memories = {t.id: t for t in await parts.store.get_turns(ids, user_id=v.user)}
    names = await parts.store.read(
        lambda c: session_names(c, {t.session_id for t in memories.values()} | {view.session or ""})
    )
    slots = []
    if parts.slots is not None:
        for sid in view.slot_refs[:MAX_SLOTS_SHOWN]:
            found_slot = await parts.slots.lookup(v.user, sid)
            slots.append({"id": sid, "slot": found_slot[0] if found_slot else None})
    messages = []
    if a is not None:
        for part, msg, cost in zip(
            a.parts, a.messages, a.costs or [0] * len(a.parts), strict=False
        ):
            text = content_text(msg.get("content"))
            messages.append(
                {
                    "part": part,
                    "role": msg.get("role"),
                    "text": text[:MESSAGE_CHARS],
                    "cut": len(text) > MESSAGE_CHARS,
                    "tools": msg.get("tool_calls"),
                    "tokens": cost,
                }
            )
    settings = request.app[SERVICES].settings
    return render(
        request,
        "request.html",
        v,
        view=view,
        a=a,
        zones=z,
        bar=charts.zone_bar(z, view.budget),
        ids=ids,
        memories=memories,
        names=names,
        slots=slots,
        ttl=settings.slots.ttl_seconds,
        messages=messages,
        feedback=parts.memory.feedback is not None,
        cost=describe(view.cost) if view.status is not None else "the reply is not over yet",
    )
