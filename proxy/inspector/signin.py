"""Signing in to the inspector: a server-side session per sign-in, named by a random cookie.

The credential (the admin token, or with ``auth.mode = "keys"`` an Engram key) is entered once on
the sign-in page and checked as the admin API checks it, loopback or not: a page on a laptop's
loopback is exactly what a hostile web page reaches, so there is no token-free loopback sign-in.
The credential itself is never kept, never put in a URL and never set in a cookie: the cookie
holds a random 256-bit id of a session kept in this process's memory, with the
:class:`~proxy.auth.Principal` it proved and a per-session token every form carries (``csrf``).

The cookie is ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no other site's page sends
it), ``Path=/engram/`` and expires with the session (``inspector.session_hours``); signing out
deletes the session at once. A session made with a key ends when the key is revoked.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from proxy.auth import Principal

COOKIE = "engram_inspector"
MAX_SESSIONS = 10_000
"""Sign-ins held at once; the oldest go first beyond it."""


@dataclass(frozen=True)
class WebSession:
    """One sign-in."""

    id: str
    principal: Principal
    csrf: str
    expires: float  # Unix seconds

    def csrf_ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.csrf.encode())


class WebSessions:
    """The sign-ins of this process."""

    def __init__(self, hours: float, clock: Callable[[], float] = time.time) -> None:
        self.seconds = hours * 3600
        self._clock = clock
        self._by_id: dict[str, WebSession] = {}

    def start(self, principal: Principal) -> WebSession:
        now = self._clock()
        self._expire(now)
        while len(self._by_id) >= MAX_SESSIONS:
            self._by_id.pop(next(iter(self._by_id)))
        ws = WebSession(
            secrets.token_urlsafe(32), principal, secrets.token_urlsafe(24), now + self.seconds
        )
        self._by_id[ws.id] = ws
        return ws

    def get(self, session_id: str | None) -> WebSession | None:
        if not session_id:
            return None
        ws = self._by_id.get(session_id)
        if ws is None:
            return None
        if ws.expires <= self._clock():
            self._by_id.pop(session_id, None)
            return None
        return ws

    def end(self, session_id: str | None) -> None:
        if session_id:
            self._by_id.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._by_id)

    def _expire(self, now: float) -> None:
        for sid in [k for k, v in self._by_id.items() if v.expires <= now]:
            del self._by_id[sid]


def cookie_header(ws: WebSession, secure: bool) -> str:
    """The ``Set-Cookie`` value that names ``ws``."""
    max_age = max(0, int(ws.expires - time.time()))
    flags = "; Secure" if secure else ""
    return f"{COOKIE}={ws.id}; Path=/engram/; Max-Age={max_age}; HttpOnly; SameSite=Strict{flags}"


def clear_cookie_header(secure: bool) -> str:
    flags = "; Secure" if secure else ""
    return f"{COOKIE}=; Path=/engram/; Max-Age=0; HttpOnly; SameSite=Strict{flags}"
