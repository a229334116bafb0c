"""The inspector's edges: templates (Jinja2, escaped by default), the security headers of every
page, who is looking (:class:`Visit`) and the checks on every form.

- Every page is ``no-store`` (it shows memory), framed by nobody, and runs under a Content
  Security Policy that allows the page's own script and style files only: no inline script, no
  inline style, no other origin, forms posting to the page's own origin only.
- A visit needs a sign-in (:mod:`proxy.inspector.signin`): without one a page redirects to the
  sign-in page and a form answers 401. An admin picks the user (``?user=`` on pages, a ``user``
  field in forms); a user's key sees and changes its own user only, and naming another is a 403
  (so is an id of another user's turn: the actions answer "not found" for it).
- A form must carry the sign-in's ``csrf`` token, beside the cross-site checks
  (:mod:`proxy.guard`: a page on another origin cannot post to ``/engram/`` at all) and the
  ``SameSite=Strict`` cookie.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from aiohttp import web

from proxy.auth import acting_user
from proxy.errors import EngramError, Forbidden, ServiceUnavailable, Unauthorized
from proxy.inspector.signin import COOKIE, WebSession, WebSessions
from proxy.relay import body_read
from proxy.services import SERVICES, MemoryParts

HERE = Path(__file__).parent
PREFIX = "/engram"
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Inspector:
    """What the inspector keeps: the sign-ins and the templates."""

    sessions: WebSessions
    templates: jinja2.Environment


INSPECTOR = web.AppKey("inspector", Inspector)
STARTED = web.RequestKey("inspector_started", float)  # when the page's handler began


def templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = when
    env.filters["short"] = short
    env.filters["size"] = size
    return env


def when(ts: float | None) -> str:
    if ts is None:
        return ""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


def short(text: str | None, n: int = 200) -> str:
    text = (text or "").strip()
    return text if len(text) <= n else text[: n - 1] + "…"


def size(n: int | None) -> str:
    if n is None:
        return ""
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


@dataclass
class Visit:
    """Who is looking and for which user."""

    ws: WebSession
    user: str
    admin: bool

    def link(self, path: str, **params: Any) -> str:
        """A link within the inspector that keeps the chosen user (for an admin)."""
        if self.admin:
            params = {"user": self.user, **params}
        query = urlencode({k: v for k, v in params.items() if v not in (None, "")})
        return f"{PREFIX}{path}" + (f"?{query}" if query else "")


def current(request: web.Request) -> WebSession | None:
    return request.app[INSPECTOR].sessions.get(request.cookies.get(COOKIE))


async def visit(request: web.Request, named: str | None) -> Visit:
    """The visit of a signed-in request, for the user it names (an admin's choice); 401 when
    not signed in (or the key it used was revoked), 403 for another user's key."""
    ws = current(request)
    if ws is None:
        raise Unauthorized("Sign in first: /engram/signin.", code="not_signed_in")
    p = ws.principal
    if p.key_id is not None and not await request.app[SERVICES].auth.key_active(p.key_id):
        request.app[INSPECTOR].sessions.end(ws.id)
        raise Unauthorized("The key this sign-in used was revoked.", code="key_revoked")
    return Visit(ws, acting_user(p, named), p.admin)


def parts_of(request: web.Request) -> MemoryParts:
    parts = request.app[SERVICES].parts
    if parts is None:
        raise ServiceUnavailable(
            "Memory is disabled (memory.enabled = false): nothing to inspect.",
            code="memory_disabled",
        )
    return parts


def render(
    request: web.Request,
    name: str,
    v: Visit | None,
    status: int = 200,
    **context: Any,
) -> web.Response:
    env = request.app[INSPECTOR].templates
    started = request.get(STARTED, time.perf_counter())
    html = env.get_template(name).render(
        v=v,
        msg=request.query.get("msg", ""),
        path=request.path,
        ms=lambda: f"{(time.perf_counter() - started) * 1000:.1f}",
        **context,
    )
    return web.Response(
        text=html, status=status, content_type="text/html", charset="utf-8", headers=HEADERS
    )


def page(fn: Callable[[web.Request, Visit], Awaitable[web.StreamResponse]]) -> Handler:
    """A GET page: signed in (else to the sign-in page), errors drawn as a page."""

    @functools.wraps(fn)
    async def handler(request: web.Request) -> web.StreamResponse:
        request[STARTED] = time.perf_counter()
        try:
            v = await visit(request, request.query.get("user"))
        except Unauthorized:
            raise web.HTTPSeeOther(f"{PREFIX}/signin", headers=HEADERS) from None
        except EngramError as exc:
            return render(request, "error.html", None, exc.status, error=exc)
        try:
            return await fn(request, v)
        except EngramError as exc:
            return render(request, "error.html", v, exc.status, error=exc)

    return handler


def form(fn: Callable[[web.Request, Visit, Any], Awaitable[web.StreamResponse]]) -> Handler:
    """A form post: signed in, the sign-in's ``csrf`` token, then the action; errors as a page."""

    @functools.wraps(fn)
    async def handler(request: web.Request) -> web.StreamResponse:
        request[STARTED] = time.perf_counter()
        data = await body_read(request, request.post())
        try:
            v = await visit(request, field(data, "user"))
            if not v.ws.csrf_ok(field(data, "csrf")):
                raise Forbidden(
                    "This form is not from your signed-in page (its token is missing or "
                    "stale): open the page again and retry.",
                    code="csrf_failed",
                )
        except EngramError as exc:
            return render(request, "error.html", None, exc.status, error=exc)
        try:
            return await fn(request, v, data)
        except EngramError as exc:
            return render(request, "error.html", v, exc.status, error=exc)

    return handler


def field(data: Any, name: str) -> str | None:
    """A text field of a posted form (None: absent, or a file)."""
    value = data.get(name)
    return value if isinstance(value, str) else None


def done(v: Visit, path: str, msg: str, **params: Any) -> web.Response:
    """After a form: back to a page of the inspector, saying what was done."""
    raise web.HTTPSeeOther(v.link(path, msg=msg, **params), headers=HEADERS)
