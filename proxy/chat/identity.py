"""Who is asking and which conversation this is: headers, body fields, key hash; housekeeping.

Pure functions. With ``auth.mode = "keys"`` the user is the key's (:mod:`proxy.auth`); otherwise
the user namespace comes from explicit headers or body fields, else a hash of the client's API key
(never the key), else ``default``. The session comes from an explicit id, else from the
hash chain over the messages (:func:`proxy.messages.chain_hashes`), matched against stored turns
by :func:`proxy.chat.sessions.place`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy import clients
from proxy.messages import content_text, current_turn_start

USER_HEADERS = ("X-Engram-User", "X-OpenWebUI-User-Id")
SESSION_HEADERS = ("X-Engram-Session", "X-OpenWebUI-Chat-Id", "X-Session-Id")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:@/+=~-]{1,200}$")


@dataclass(frozen=True)
class Identity:
    user: str
    explicit_session: str | None
    user_source: str  # key (Engram's, auth.mode = keys) | header | body | api-key | default
    parent: str | None = None  # X-Engram-Parent: this is a sub-agent of that session
    agent: str | None = None  # X-Engram-Agent: the sub-agent's label


def is_safe_id(text: str) -> bool:
    """Whether ``text`` is a user or session id as Engram keeps it (no cleaning needed)."""
    return bool(_SAFE_ID.match(text))


def _clean_id(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    text: str = value.strip()
    if not text:
        return None
    if _SAFE_ID.match(text):
        return text
    # Anything else (spaces, unicode, very long) is kept stable but made safe.
    return "h-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def identify(
    headers: Mapping[str, str], body: Mapping[str, Any], user: str | None = None
) -> Identity:
    """User namespace and explicit session id (if the client sent one). ``user``: the user of
    the request's credential (``auth.mode = "keys"``), which nothing in the request overrides."""
    source = "key" if user else "default"
    for name in USER_HEADERS if not user else ():
        user = _clean_id(headers.get(name))
        if user:
            source = "header"
            break
    if not user:
        for key in ("user", "safety_identifier"):
            user = _clean_id(body.get(key))
            if user:
                source = "body"
                break
    if not user:
        secret = api_key(headers)
        if secret:
            user = "key-" + hashlib.sha256(secret.encode()).hexdigest()[:16]
            source = "api-key"
    session = None
    for name in SESSION_HEADERS:
        session = _clean_id(headers.get(name))
        if session:
            break
    if not session:
        meta = body.get("metadata")
        if isinstance(meta, Mapping):
            session = _clean_id(meta.get("session_id")) or _clean_id(meta.get("sessionId"))
    agent = headers.get("X-Engram-Agent", "").strip()[:100] or None
    return Identity(
        user or "default", session, source, _clean_id(headers.get("X-Engram-Parent")), agent
    )


def api_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    else:
        key = headers.get("X-Api-Key", "").strip()
    # Placeholder keys that local clients send carry no identity.
    if not key or key.lower() in {
        "sk-no-key-required",
        "no-key",
        "none",
        "null",
        "ollama",
        "sk-xxx",
        "dummy",
        "empty",
        "-",
    }:
        return None
    return key


# Requests clients make for themselves (titles, tags, topics, summaries, quota probes), by what
# they ask (proxy.clients): answered as usual but neither archived nor given memories.
_HOUSEKEEPING = clients.compile_all(clients.HOUSEKEEPING)
_HOUSEKEEPING_ANY_CASE = clients.compile_all(clients.HOUSEKEEPING_ANY_CASE)
HOUSEKEEPING_CHARS = 4000  # how much of each text is searched


def is_housekeeping(
    messages: Sequence[Mapping[str, Any]], extra: re.Pattern[str] | None = None
) -> bool:
    """Whether the request is a client's housekeeping: its first system message or a user
    message of its current turn (everything after the last reply) asks for it. ``extra``:
    ``memory.housekeeping_patterns``, case-insensitive."""
    cur = current_turn_start(messages)
    for i, msg in enumerate(messages):
        if not (
            (i == 0 and msg.get("role") in ("system", "developer"))
            or (msg.get("role") == "user" and i >= cur)
        ):
            continue
        text = content_text(msg.get("content"))[:HOUSEKEEPING_CHARS]
        if any(p.search(text) for p in _HOUSEKEEPING):
            return True
        low = text.lower()
        if any(p.search(low) for p in _HOUSEKEEPING_ANY_CASE):
            return True
        if extra is not None and extra.search(text):
            return True
    return False
