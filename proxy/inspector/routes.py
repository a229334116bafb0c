"""The inspector's routes under ``/engram/`` (registered before the ``/engram/{tail}``
catch-all, after the admin API). Pages are GET; everything that changes memory or the sign-in
is a form POST carrying the sign-in's token (:mod:`proxy.inspector.web`)."""

from __future__ import annotations

import mimetypes

from aiohttp import web

from proxy.config import Settings
from proxy.errors import NotFound
from proxy.inspector import explain, forms, pages
from proxy.inspector.signin import WebSessions
from proxy.inspector.web import HEADERS, HERE, INSPECTOR, PREFIX, Inspector, templates

STATIC = {p.name: p for p in (HERE / "static").iterdir() if p.is_file()}


async def static(request: web.Request) -> web.StreamResponse:
    """The page's own script and style (the only ones its policy allows)."""
    found = STATIC.get(request.match_info["name"])
    if found is None:
        raise NotFound(f"No inspector file {request.match_info['name']!r}.")
    kind = mimetypes.guess_type(found.name)[0] or "application/octet-stream"
    return web.Response(
        body=found.read_bytes(),
        content_type=kind,
        charset="utf-8",
        headers={**HEADERS, "Cache-Control": "no-cache"},
    )


async def to_slash(request: web.Request) -> web.StreamResponse:
    raise web.HTTPPermanentRedirect(f"{PREFIX}/")


def add_routes(app: web.Application, settings: Settings) -> None:
    """Register the inspector (``inspector.enabled``)."""
    if not settings.inspector.enabled:
        return
    app[INSPECTOR] = Inspector(WebSessions(settings.inspector.session_hours), templates())
    r = app.router
    r.add_get(PREFIX, to_slash)
    r.add_get(f"{PREFIX}/", pages.overview)
    r.add_get(f"{PREFIX}/signin", pages.signin_page)
    r.add_post(f"{PREFIX}/signin", pages.signin_post)
    r.add_post(f"{PREFIX}/signout", forms.signout)
    r.add_get(f"{PREFIX}/static/{{name}}", static)
    r.add_get(f"{PREFIX}/sessions", pages.sessions)
    r.add_get(f"{PREFIX}/sessions/{{name:.+}}/export", pages.session_export)
    r.add_get(f"{PREFIX}/sessions/{{name:.+}}", pages.session)
    r.add_get(f"{PREFIX}/search", explain.search)
    r.add_get(f"{PREFIX}/requests", explain.requests)
    r.add_get(f"{PREFIX}/requests/{{id}}", explain.one_request)
    r.add_get(f"{PREFIX}/memory", pages.memory_page)
    r.add_get(f"{PREFIX}/slots", pages.slots_page)
    actions = {
        "forget-turn": forms.forget_turn,
        "forget-session": forms.forget_session,
        "forget-all": forms.forget_all,
        "recall": forms.set_recall,
        "note": forms.add_note,
        "fact-edit": forms.edit_fact,
        "fact-delete": forms.delete_fact,
        "feedback": forms.feedback,
    }
    for name, handler in actions.items():
        r.add_post(f"{PREFIX}/actions/{name}", handler)
