"""The admin API's parameters and JSON shapes, and the operations the ``engram`` command
shares with it. No aiohttp here: the command line imports this without the web app."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from proxy.auth import clean_user as clean_user  # the CLI and MCP take it from here
from proxy.background.feedback import MAX_NOTE_CHARS
from proxy.errors import BadRequest, NotFound, ServiceUnavailable
from proxy.search.retrieval import MODES, Hit, Retriever
from proxy.slots.model import Slot
from proxy.store.models import Session, Turn
from proxy.store.naming import named_session, session_names
from proxy.store.store import Store

DEFAULT_K = 10
MAX_K = 100
MAX_QUERY_CHARS = 4096
_INT = re.compile(r"[+-]?\d{1,9}")


# --- parameters ---------------------------------------------------------------------------------


def parse_k(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_K
    if not _INT.fullmatch(raw.strip()):
        raise BadRequest(f"k must be an integer from 1 to {MAX_K}; got {raw!r}.", param="k")
    k = int(raw)
    if not 1 <= k <= MAX_K:
        raise BadRequest(f"k must be from 1 to {MAX_K}; got {k}.", param="k")
    return k


def parse_mode(raw: str | None) -> str:
    if raw is None:
        return "hybrid"
    if raw not in MODES:
        raise BadRequest(f"mode must be one of {', '.join(MODES)}; got {raw!r}.", param="mode")
    return raw


def clean_query(raw: str | None) -> str:
    """The search text: required, not blank; NULs and lone surrogates replaced, length capped."""
    if raw is None:
        raise BadRequest("q is required: the text to search for.", param="q")
    if not raw.strip():
        raise BadRequest("q must not be empty.", param="q")
    text = raw.replace("\x00", " ").encode("utf-8", "replace").decode("utf-8")
    return text[:MAX_QUERY_CHARS]


def parse_feedback(body: dict[str, Any]) -> tuple[str, bool, str | None]:
    """(request id, helpful, note) from a feedback body; a 400 naming the field otherwise."""
    request_id = body.get("request_id")
    if not isinstance(request_id, str) or not request_id.strip() or len(request_id) > 200:
        raise BadRequest(
            "request_id is required: the X-Engram-Request-Id of a chat request (a string).",
            param="request_id",
            code="invalid_request_id",
        )
    helpful = body.get("helpful")
    if not isinstance(helpful, bool):
        raise BadRequest(
            "helpful is required: false flags the request as badly served by memory, true "
            "records that it was served well.",
            param="helpful",
            code="invalid_helpful",
        )
    note = body.get("note")
    if note is not None and (not isinstance(note, str) or len(note) > MAX_NOTE_CHARS):
        raise BadRequest(
            f"note must be a string of at most {MAX_NOTE_CHARS} characters.",
            param="note",
            code="invalid_note",
        )
    return request_id.strip(), helpful, (note.strip() or None) if note is not None else None


# --- JSON shapes --------------------------------------------------------------------------------


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def hit_json(hit: Hit) -> dict[str, Any]:
    t = hit.turn
    return {
        "id": t.id,
        "session": t.session_id,
        "role": t.role,
        "speaker": t.speaker,
        "content": t.content,
        "timestamp": t.timestamp,
        "timestamp_iso": iso(t.timestamp),
        "score": hit.score,
        "ranks": {"fts": hit.ranks.get("fts"), "vec": hit.ranks.get("vec")},
        "api": t.api,  # the chat API it came through; None when imported or stored before
    }


def session_json(s: Session, turns: int, names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A session as its owner knows it: ``id`` is its name, ``parent`` the parent's name (from
    ``names``, session id -> name, when given)."""
    parent = s.parent_id
    return {
        "id": s.name,
        "user": s.user_id,
        "parent": (names or {}).get(parent, parent) if parent is not None else None,
        "level": s.level,
        "agent": s.agent,
        "indexed": s.indexed,
        "turns": turns,
        "created_at": s.created_at,
        "created_at_iso": iso(s.created_at),
        "last_seen": s.last_seen,
        "last_seen_iso": iso(s.last_seen),
    }


def turn_json(t: Turn) -> dict[str, Any]:
    return {
        "id": t.id,
        "position": t.position,
        "role": t.role,
        "speaker": t.speaker,
        "content": t.content,
        "tool_calls": t.tool_calls,
        "tool_call_id": t.tool_call_id,
        "timestamp": t.timestamp,
        "timestamp_iso": iso(t.timestamp),
        "incomplete": t.incomplete,
        "api": t.api,
    }


def slot_json(slot: Slot, backend: str) -> dict[str, Any]:
    return {
        "id": slot.id,
        "tool": slot.tool,
        "description": slot.description,
        "tokens": slot.tokens,
        "content": slot.content,
        "backend": backend,
    }


# --- operations shared with the CLI -------------------------------------------------------------


async def owned_session(store: Store, user: str, session_id: str) -> Session:
    """The user's session of this id (the name the user's client knows it by), or a 404 that
    does not tell whether another user has one."""
    found = await store.read(lambda c: named_session(c, user, session_id))
    if found is None:
        raise NotFound(f"No session {session_id!r} for user {user!r}.", code="session_not_found")
    return found


async def search(
    store: Store,
    retriever: Retriever,
    user: str,
    query: str,
    *,
    k: int = DEFAULT_K,
    mode: str = "hybrid",
    session: str | None = None,
) -> list[Hit]:
    """The user's best hits; each turn's ``session_id`` is given as the session's name (the id
    its owner knows it by)."""
    scope = [(await owned_session(store, user, session)).id] if session is not None else None
    if mode == "vec" and retriever.embedder is None:
        raise ServiceUnavailable(
            "Vector search is off: the embedding model did not load (see the log).",
            code="vector_search_unavailable",
        )
    hits = await retriever.search(user, query, k, mode=mode, session_ids=scope)
    ids = [h.turn.session_id for h in hits]
    names = await store.read(lambda c: session_names(c, ids)) if ids else {}
    return [_named(h, names.get(h.turn.session_id)) for h in hits]


def _named(hit: Hit, name: str | None) -> Hit:
    if name is None or name == hit.turn.session_id:
        return hit
    return dataclasses.replace(hit, turn=dataclasses.replace(hit.turn, session_id=name))


async def sessions_json(store: Store, user: str) -> list[dict[str, Any]]:
    counts = await store.session_turn_counts(user)
    sessions = await store.list_sessions(user)
    names = {s.id: s.name for s in sessions}
    return [session_json(s, counts.get(s.id, 0), names) for s in sessions]
