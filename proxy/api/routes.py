"""Engram's admin API under ``/engram/api/``: search, sessions, forget, export.

    GET    /engram/api/search?q=&user=&session=&k=&mode=hybrid|fts|vec
    GET    /engram/api/sessions                 the user's sessions, most recently seen first
    GET    /engram/api/sessions/{id}            one session and its turns
    DELETE /engram/api/sessions/{id}            the session and all it produced (store.forget);
                                                the scrub follows in the background
    GET    /engram/api/export                   the user's memory as JSON Lines (importable)
    POST   /engram/api/sessions/{id}/complete   a sub-agent is done: hand its summary back
    POST   /engram/api/feedback                 {"request_id", "helpful", "note"}: flag a request
    POST   /engram/api/consolidate              run a consolidation pass over the user's queue
    GET    /engram/api/stats                    the user's counts, the token figures and the
                                                slot figures (per backend, server-wide)
    GET    /engram/api/slots/{id}               one of the user's tool-result slots
    DELETE /engram/api/turns/{id}               one turn and what was made from it
    POST   /engram/api/turns/{id}/recall        {"recall": "pinned" | "muted" | "normal"}
    DELETE /engram/api/memory?confirm=yes       all of the user's memory (keys stay)
    POST   /engram/api/notes                    {"text"}: a note, recalled like a turn
    POST   /engram/api/facts/{id}               {"text"}: a fact corrected (a new row)
    DELETE /engram/api/facts/{id}               a fact deleted

The corrections are :mod:`proxy.api.actions`, shared with the inspector, MCP and the CLI.

The user namespace comes from ``X-Engram-User``, else the ``user`` query parameter, else
``default``, cleaned as the chat pipeline cleans it; a user's own key (``auth.mode = "keys"``)
acts on that user only. Another user's session or slot is a 404, exactly like a missing (or
expired) one. Who may call it at all is :mod:`proxy.auth`'s decision, made in the middleware:
the admin token, an Engram key, or (``auth.loopback_admin``) a loopback client. The JSON
shaping and parameter checks (:mod:`proxy.api.views`) are shared with the ``engram`` command.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from proxy import json_input
from proxy.api import actions
from proxy.api.effects import after
from proxy.api.views import (
    clean_query,
    hit_json,
    iso,
    owned_session,
    parse_feedback,
    parse_k,
    parse_mode,
    search,
    session_json,
    sessions_json,
    slot_json,
    turn_json,
)
from proxy.auth import PRINCIPAL, Principal, acting_user
from proxy.background.stats import token_figures
from proxy.errors import BadRequest, Forbidden, NotFound, ServiceUnavailable
from proxy.jsonl import export_line
from proxy.relay import body_read
from proxy.services import SERVICES, MemoryParts
from proxy.slots.refs import SLOT_ID
from proxy.slots.store import SlotStore
from proxy.store.corrections import RECALL_NAMES
from proxy.store.counters import memory_counts
from proxy.store.store import Store

PREFIX = "/engram/api"
DEFAULT_K = 10
MAX_K = 100
MAX_QUERY_CHARS = 4096
_INT = re.compile(r"[+-]?\d{1,9}")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --- access -------------------------------------------------------------------------------------


def request_user(request: web.Request) -> str:
    """The user namespace a request may act on. The admin token and admin keys choose it
    (``X-Engram-User``, else ``?user=``, else the key's own user, else ``default``); a user's
    key acts on its own user only, and naming another is a 403."""
    principal: Principal | None = request.get(PRINCIPAL)
    if principal is None:  # the middleware authenticates every admin route
        raise Forbidden("The admin API needs a credential.", code="admin_forbidden")
    return acting_user(principal, request.headers.get("X-Engram-User") or request.query.get("user"))


# --- handlers -----------------------------------------------------------------------------------


def _parts(request: web.Request) -> MemoryParts:
    parts = request.app[SERVICES].parts
    if parts is None:
        raise ServiceUnavailable(
            "Memory is disabled (memory.enabled = false): the admin API has nothing to serve.",
            code="memory_disabled",
        )
    return parts


def _store(request: web.Request) -> Store:
    return _parts(request).store


def _slots(request: web.Request) -> SlotStore:
    slots = request.app[SERVICES].slots
    if slots is None:
        raise ServiceUnavailable(
            "Tool-result slots are disabled (slots.enabled = false, or memory.enabled = false).",
            code="slots_disabled",
        )
    return slots


async def search_handler(request: web.Request) -> web.Response:
    store = _store(request)
    q = request.query
    query = clean_query(q.get("q"))
    k, mode = parse_k(q.get("k")), parse_mode(q.get("mode"))
    session = q.get("session") or None
    user = request_user(request)
    retriever = _parts(request).retriever
    hits = await search(store, retriever, user, query, k=k, mode=mode, session=session)
    return web.json_response(
        {"user": user, "mode": mode, "k": k, "results": [hit_json(h) for h in hits]}
    )


async def sessions_handler(request: web.Request) -> web.Response:
    store = _store(request)
    user = request_user(request)
    return web.json_response({"user": user, "sessions": await sessions_json(store, user)})


async def session_handler(request: web.Request) -> web.Response:
    store = _store(request)
    user = request_user(request)
    session = await owned_session(store, user, request.match_info["id"])
    turns = await store.session_turns(session.id)
    return web.json_response(
        {"session": session_json(session, len(turns)), "turns": [turn_json(t) for t in turns]}
    )


async def last_request_handler(request: web.Request) -> web.Response:
    """The last prompt forwarded for a session, each message labelled by zone and source."""
    store = _store(request)
    user = request_user(request)
    session = await owned_session(store, user, request.match_info["id"])
    found = _parts(request).memory.last_requests.get(session.id)
    if found is None:
        raise NotFound(
            f"No request of session {session.name!r} was forwarded since Engram started.",
            code="no_request_recorded",
        )
    when, assembly = found
    parts = [
        {
            "zone": p.zone,
            "source": p.source,
            "index": p.index,
            "memory_ids": list(p.refs),
            "message": m,
        }
        for p, m in zip(assembly.parts, assembly.messages, strict=True)
    ]
    return web.json_response(
        {
            "session": session.name,
            "at": when,
            "at_iso": iso(when),
            "rewritten": assembly.rewritten,
            "aged": assembly.aged,
            "tokens": {"forwarded": assembly.tokens, "original": assembly.original_tokens},
            "parts": parts,
        },
        headers={
            "X-Engram-Memories": str(len(next((p.refs for p in assembly.parts if p.refs), ()))),
            "X-Engram-Prompt-Tokens": f"{assembly.tokens}/{assembly.original_tokens}",
        },
    )


async def complete_handler(request: web.Request) -> web.Response:
    """A sub-agent is done: its summary is handed back to its parent (in the background)."""
    store = _store(request)
    user = request_user(request)
    session = await owned_session(store, user, request.match_info["id"])
    if session.parent_id is None:
        raise BadRequest(
            f"Session {session.name!r} has no parent: only sub-agent sessions (started with "
            "X-Engram-Parent) are completed.",
            code="not_a_subagent",
        )
    handback = _parts(request).memory.handback
    assert handback is not None
    queued = handback.complete(session)
    return web.json_response(
        {
            "id": session.name,
            "parent": session.parent_id,
            "status": "queued" if queued else "already running",
        },
        status=202,
    )


async def delete_handler(request: web.Request) -> web.Response:
    """Delete the session and all it produced now; its Redis slots and the scrub that makes the
    bytes leave the files (:mod:`proxy.store.sqlite.scrub`) follow in the background (drained at
    shutdown)."""
    return await _act(
        request, lambda store, user: actions.forget_session(store, user, request.match_info["id"])
    )


async def _act(
    request: web.Request, action: Callable[[Store, str], Awaitable[actions.Done]]
) -> web.Response:
    """Run a correction as the request's user, then what it leaves to the server."""
    store, user = _store(request), request_user(request)
    done = await action(store, user)
    after(request.app[SERVICES], done)
    return web.json_response(done.detail)


async def forget_turn_handler(request: web.Request) -> web.Response:
    """Delete one turn and what was made from it."""
    turn_id = actions.parse_turn_id(request.match_info["id"])
    return await _act(request, lambda store, user: actions.forget_turn(store, user, turn_id))


async def forget_all_handler(request: web.Request) -> web.Response:
    """Delete all of the user's memory (``?confirm=yes`` required: there is no undo)."""
    if request.query.get("confirm") != "yes":
        raise BadRequest(
            "This deletes all of the user's memory; add ?confirm=yes to do it.",
            param="confirm",
            code="confirm_required",
        )
    return await _act(request, actions.forget_everything)


async def recall_handler(request: web.Request) -> web.Response:
    """``{"recall": "pinned" | "muted" | "normal"}``: always, never or as search finds it."""
    turn_id = actions.parse_turn_id(request.match_info["id"])
    value = actions.parse_recall((await json_object(request)).get("recall"))
    user = request_user(request)
    turn = await actions.set_recall(_store(request), user, turn_id, value)
    _parts(request).memory.recall.forget_pinned(user)
    return web.json_response({**turn_json(turn), "recall": RECALL_NAMES[turn.recall]})


async def note_handler(request: web.Request) -> web.Response:
    """``{"text"}``: a note of the user's, stored and recalled like a turn (201)."""
    text = actions.clean_text((await json_object(request)).get("text"))
    parts, user = _parts(request), request_user(request)
    turn = await actions.add_note(
        parts.store,
        parts.retriever.embedder,
        user,
        text,
        redact_secrets=request.app[SERVICES].settings.memory.redact_secrets,
    )
    return web.json_response(turn_json(turn), status=201)


async def fact_edit_handler(request: web.Request) -> web.Response:
    """``{"text"}``: the fact says this now (a new row; the old one and its words are gone)."""
    fact_id = actions.parse_turn_id(request.match_info["id"])
    text = actions.clean_text((await json_object(request)).get("text"))
    parts, user = _parts(request), request_user(request)
    turn, done = await actions.edit_fact(
        parts.store,
        parts.retriever.embedder,
        user,
        fact_id,
        text,
        redact_secrets=request.app[SERVICES].settings.memory.redact_secrets,
    )
    after(request.app[SERVICES], done)
    return web.json_response({**turn_json(turn), "replaces": fact_id})


async def fact_delete_handler(request: web.Request) -> web.Response:
    fact_id = actions.parse_turn_id(request.match_info["id"])
    return await _act(request, lambda store, user: actions.delete_fact(store, user, fact_id))


async def export_handler(request: web.Request) -> web.StreamResponse:
    store = _store(request)
    user = request_user(request)
    resp = web.StreamResponse(
        headers={
            "Content-Type": "application/x-ndjson; charset=utf-8",
            "Content-Disposition": f'attachment; filename="engram-{user}.jsonl"',
        }
    )
    await resp.prepare(request)
    chunk: list[str] = []
    async for item in store.export(user):
        chunk.append(json.dumps(export_line(item), ensure_ascii=False) + "\n")
        if len(chunk) >= 200:
            await resp.write("".join(chunk).encode())
            chunk.clear()
    if chunk:
        await resp.write("".join(chunk).encode())
    await resp.write_eof()
    return resp


async def json_object(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    raw = await body_read(request, request.read())
    if not raw.strip():
        raise BadRequest("Request body is empty; expected a JSON object.", code="invalid_json")
    try:
        body = json_input.loads(raw)
    except json_input.TooDeep as exc:
        raise BadRequest(f"Request body is not accepted: {exc}.", code="json_too_deep") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"Request body is not valid JSON: {exc}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object.", code="invalid_body")
    return body


async def feedback_handler(request: web.Request) -> web.Response:
    """Feedback on a chat request; ``helpful: false`` queues it for consolidation."""
    parts = _parts(request)
    user = request_user(request)
    request_id, helpful, note = parse_feedback(await json_object(request))
    feedback = parts.memory.feedback
    assert feedback is not None
    result = await feedback.submit(user, request_id, helpful, note)
    return web.json_response(
        {"request_id": result.request_id, "helpful": result.helpful, "queued": result.queued}
    )


async def consolidate_handler(request: web.Request) -> web.Response:
    """Run a consolidation pass over the user's queued requests now (tests, operations)."""
    consolidator = _parts(request).consolidator
    user = request_user(request)
    report = await consolidator.run_pass(user)
    return web.json_response(
        {
            "user": user,
            **dataclasses.asdict(report),
            "tokens_spent": consolidator.tokens_spent,
            "tokens_allowed": int(consolidator.allowance()),
        }
    )


async def stats_handler(request: web.Request) -> web.Response:
    """The user's hand-backs, facts, feedback and queue; the server's token figures."""
    parts = _parts(request)
    user = request_user(request)
    counts = await parts.store.read(lambda c: memory_counts(c, user))
    tokens = token_figures(parts.counters.current(), request.app[SERVICES].settings)
    slots = parts.slots
    slot_figures = {"backend": slots.backend, **await slots.stats()} if slots else None
    return web.json_response({"user": user, "tokens": tokens, **counts, "slots": slot_figures})


async def slot_handler(request: web.Request) -> web.Response:
    """The user's slot; another user's slot is a 404 exactly like a missing or expired one."""
    slots = _slots(request)
    user = request_user(request)
    slot_id = request.match_info["id"]
    if not SLOT_ID.fullmatch(slot_id):
        raise BadRequest(
            "A slot id is 1-80 letters, digits, '_', '.' or '-' (as in [TOOL_RESULT:<id>]).",
            code="invalid_slot_id",
            param="id",
        )
    found = await slots.lookup(user, slot_id)
    if found is None:
        raise NotFound(
            f"No tool-result slot {slot_id!r} for user {user!r} (unknown or expired).",
            code="slot_not_found",
        )
    return web.json_response(slot_json(*found))


def add_routes(app: web.Application) -> None:
    """Register the admin routes (before the ``/engram/{tail}`` catch-all)."""
    app.router.add_get(f"{PREFIX}/search", search_handler)
    app.router.add_get(f"{PREFIX}/sessions", sessions_handler)
    app.router.add_get(f"{PREFIX}/sessions/{{id:.+}}/requests/last", last_request_handler)
    app.router.add_post(f"{PREFIX}/sessions/{{id:.+}}/complete", complete_handler)
    app.router.add_get(f"{PREFIX}/sessions/{{id:.+}}", session_handler)
    app.router.add_delete(f"{PREFIX}/sessions/{{id:.+}}", delete_handler)
    app.router.add_get(f"{PREFIX}/export", export_handler)
    app.router.add_post(f"{PREFIX}/feedback", feedback_handler)
    app.router.add_post(f"{PREFIX}/consolidate", consolidate_handler)
    app.router.add_get(f"{PREFIX}/stats", stats_handler)
    app.router.add_get(f"{PREFIX}/slots/{{id}}", slot_handler)
    app.router.add_delete(f"{PREFIX}/turns/{{id}}", forget_turn_handler)
    app.router.add_post(f"{PREFIX}/turns/{{id}}/recall", recall_handler)
    app.router.add_delete(f"{PREFIX}/memory", forget_all_handler)
    app.router.add_post(f"{PREFIX}/notes", note_handler)
    app.router.add_post(f"{PREFIX}/facts/{{id}}", fact_edit_handler)
    app.router.add_delete(f"{PREFIX}/facts/{{id}}", fact_delete_handler)
