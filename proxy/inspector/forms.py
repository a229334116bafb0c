"""The inspector's forms: each correction is one call of :mod:`proxy.api.actions` (the same
functions the admin API, MCP and the CLI call), then :func:`proxy.api.effects.after`, then back
to the page it came from saying what was done. Destructive forms need their confirmation field
(a checkbox, or for everything the user's name typed), checked here whatever the page's script
did."""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

from proxy.api import actions
from proxy.api.effects import after
from proxy.errors import BadRequest
from proxy.inspector.signin import clear_cookie_header
from proxy.inspector.web import (
    HEADERS,
    INSPECTOR,
    PREFIX,
    Visit,
    current,
    done,
    field,
    form,
    parts_of,
)
from proxy.relay import body_read
from proxy.services import SERVICES

_BACK = re.compile(r"/engram/[A-Za-z0-9_./~%-]*")


def back_to(data: Any, default: str) -> str:
    """Where a form returns: a path of the inspector it names (never another site), else
    ``default``."""
    raw = field(data, "back")
    if raw and _BACK.fullmatch(raw) and "//" not in raw and ".." not in raw:
        return raw.removeprefix(PREFIX)
    return default


def _confirmed(data: Any) -> None:
    if field(data, "confirm") != "yes":
        raise BadRequest(
            "Tick the confirmation box: forgetting cannot be undone.", code="confirm_required"
        )


async def signout(request: web.Request) -> web.StreamResponse:
    """End the sign-in (a form with its csrf token; without one the sign-in stays)."""
    ws = current(request)
    data = await body_read(request, request.post())
    if ws is not None and ws.csrf_ok(field(data, "csrf")):
        request.app[INSPECTOR].sessions.end(ws.id)
    raise web.HTTPSeeOther(
        f"{PREFIX}/signin", headers={**HEADERS, "Set-Cookie": clear_cookie_header(request.secure)}
    )


@form
async def forget_turn(request: web.Request, v: Visit, data: Any) -> web.StreamResponse:
    _confirmed(data)
    turn_id = actions.parse_turn_id(field(data, "id"))
    result = await actions.forget_turn(parts_of(request).store, v.user, turn_id)
    after(request.app[SERVICES], result)
    derived = result.detail["derived"]
    extra = ", ".join(f"{n} {k}" for k, n in derived.items() if n)
    return done(
        v,
        back_to(data, "/sessions"),
        f"Forgot turn {turn_id}" + (f" ({extra})" if extra else "") + ".",
    )


@form
async def forget_session(request: web.Request, v: Visit, data: Any) -> web.StreamResponse:
    _confirmed(data)
    name = field(data, "name") or ""
    result = await actions.forget_session(parts_of(request).store, v.user, name)
    after(request.app[SERVICES], result)
    turns = result.detail["turns"]
    return done(v, "/sessions", f"Forgot session {name} and its {turns} turns.")


@form
async def forget_all(request: web.Request, v: Visit, data: Any) -> web.StreamResponse:
    if field(data, "confirm_user") != v.user:
        raise BadRequest(
            f"Type the user's name ({v.user}) to confirm: this forgets all of their memory.",
            code="confirm_required",
        )
    result = await actions.forget_everything(parts_of(request).store, v.user)
    after(request.app[SERVICES], result)
    d = result.detail
    return done(
        v, "/", f"Forgot everything of {v.user}: {d['sessions']} sessions, {d['turns']} turns."
    )


@form
async def set_recall(request: web.Request, v: Visit, data: Any) -> web.StreamResponse:
    turn_id = actions.parse_turn_id(field(data, "id"))
    value = actions.parse_recall(field(data, "recall"))
    parts = parts_of(request)
    turn = await actions.set_recall(parts.store, v.user, turn_id, value)
    parts.memory.recall.forget_pinned(v.user)
    what = {
        1: "pinned: recalled into every chat",
        -1: "muted: never recalled",
        0: "as search finds it",
    }
    return done(v, back_to(data, "/memory"), f"Turn {turn.id} is {what[turn.recall]}.")


@form
async def add_note(request: web.Request, v: Visit, data: Any) -> web.StreamResponse:
    text = actions.clean_text(field(data, "text"))
    parts = parts_of(request)
    turn = await actions.add_note(
        parts.store,
        parts.retriever.embedder,
        v.user,
        text,
        redact_secrets=request.app[SERVICES].settings.memory.redact_secrets,
    )
    return done(v, "/memory", f"Noted (turn {turn.id}): recalled in chats from now on.")


@form
async def edit_fact(request: web.Request, v: Visit, data: Any) -> web.StreamResponse:
    fact_id = actions.parse_turn_id(field(data, "id"))
    text = actions.clean_text(field(data, "text"))
    parts = parts_of(request)
    turn, result = await actions.edit_fact(
        parts.store,
        parts.retriever.embedder,
        v.user,
        fact_id,
        text,
        redact_secrets=request.app[SERVICES].settings.memory.redact_secrets,
    )
    after(request.app[SERVICES], result)
    return done(v, back_to(data, "/memory"), f"Fact {fact_id} corrected (now fact {turn.id}).")


@form
async def delete_fact(request: web.Request, v: Visit, data: Any) -> web.StreamResponse:
    _confirmed(data)
    fact_id = actions.parse_turn_id(field(data, "id"))
    result = await actions.delete_fact(parts_of(request).store, v.user, fact_id)
    after(request.app[SERVICES], result)
    return done(v, back_to(data, "/memory"), f"Fact {fact_id} deleted.")


@form
async def feedback(request: web.Request, v: Visit, data: Any) -> web.StreamResponse:
    request_id = field(data, "request_id") or ""
    helpful = field(data, "helpful")
    if helpful not in ("yes", "no"):
        raise BadRequest("helpful must be yes or no.", param="helpful")
    note = (field(data, "note") or "").strip()[:2000] or None
    fb = parts_of(request).memory.feedback
    if fb is None:
        raise BadRequest("Feedback is not recorded on this server.")
    result = await fb.submit(v.user, request_id, helpful == "yes", note)
    said = (
        "helpful"
        if result.helpful
        else "not helpful" + (" (queued for consolidation)" if result.queued else "")
    )
    return done(v, f"/requests/{request_id}", f"Feedback recorded: {said}.")
