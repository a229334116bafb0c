"""Each MCP tool, run for the request's user through the same functions as the admin API, the
CLI and the inspector: :mod:`proxy.api.views` to search and read, :mod:`proxy.api.actions` to
add notes and forget (with :func:`proxy.api.effects.after`, as every server-side correction).

A call goes: the arguments checked against the tool's input schema and the tool's own rules
(:class:`~proxy.mcp.schema.ArgumentError`, before anything is read or stored), then the work.
Arguments refused, and what goes wrong in the work — an unknown session or id (another user's is
unknown too), nothing forgotten, memory disabled — are a :class:`ToolResult` with ``is_error``
(a tool execution error, as the 2025-11-25 revision's SEP-1303 puts input validation errors), told
so the model can correct its call; JSON-RPC errors are left to what the model cannot fix (an
unknown tool, a malformed request: :mod:`proxy.mcp.dispatch`). A search that finds nothing is
an answer, not an error: ``is_error`` false, saying so and what to try instead.

Notes (``engram_remember``): tags and the session argument are kept in the note's own text, as
``(tags: a, b; session: s)`` on its last line, so that searches find them and the note reads
the same wherever it is recalled; notes live in the user's ``notes~<user>`` session.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from proxy.api import actions, views
from proxy.api.effects import after
from proxy.errors import BadRequest, EngramError, NotFound, ServiceUnavailable
from proxy.mcp import render, tools
from proxy.mcp.access import Access
from proxy.mcp.schema import ArgumentError, validate
from proxy.services import MemoryParts, Services
from proxy.store import queries
from proxy.store.models import Turn
from proxy.store.naming import NOTES_PREFIX

FIRST_TURNS = 8
"""Turns read from the start of a session for its first line."""
_HINTS = {
    "session_not_found": " engram_sessions lists this user's session ids.",
    "vector_search_unavailable": " Use mode 'fts' or 'hybrid'.",
}


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer: readable ``text``, the same as JSON in ``structured``."""

    text: str
    structured: dict[str, Any] | None = None
    is_error: bool = False

    def wire(self) -> dict[str, Any]:
        """The ``CallToolResult`` object."""
        out: dict[str, Any] = {
            "content": [{"type": "text", "text": self.text}],
            "isError": self.is_error,
        }
        if self.structured is not None:
            out["structuredContent"] = self.structured
        return out


@dataclass(frozen=True)
class Call:
    """One call's world: the running services and the user it acts for."""

    services: Services
    user: str

    @property
    def parts(self) -> MemoryParts:
        parts = self.services.parts
        if parts is None:
            raise ServiceUnavailable(
                "Memory is disabled on this Engram (memory.enabled = false): nothing is "
                "stored, searched or forgotten.",
                code="memory_disabled",
            )
        return parts


Runner = Callable[[Call, dict[str, Any]], Awaitable[ToolResult]]


async def call_tool(services: Services, access: Access, name: str, arguments: Any) -> ToolResult:
    """Run tool ``name`` (``KeyError`` when Engram has none of that name); arguments it refuses
    are a tool error (:func:`invalid_arguments`), not an exception."""
    schema = tools.definition(name, access.may_name_user)["inputSchema"]
    try:
        args = validate(schema, {} if arguments is None else arguments)
        call = Call(services, access.acting_for(args.pop("user", None)))
        return await _RUNNERS[name](call, args)
    except ArgumentError as exc:
        return invalid_arguments(name, exc)
    except BadRequest as exc:  # a parameter the shared functions refuse
        return invalid_arguments(name, ArgumentError(exc.message, exc.param))
    except EngramError as exc:
        hint = _HINTS.get(exc.code or "", "")
        return ToolResult(exc.message + hint, is_error=True)


def invalid_arguments(name: str, error: ArgumentError) -> ToolResult:
    """Arguments ``name`` refuses, as the tool error the model reads to correct its call."""
    return ToolResult(
        f"Invalid arguments for {name}: {error.message} Nothing was done; correct the "
        "arguments and call it again.",
        is_error=True,
    )


# --- the tools --------------------------------------------------------------------------------


async def _search(call: Call, args: dict[str, Any]) -> ToolResult:
    query = args["query"].strip()
    if not query:
        raise ArgumentError("query must not be blank: say what to look for.", "query")
    k: int = args.get("k", views.DEFAULT_K)
    mode: str = args.get("mode", "hybrid")
    session: str | None = args.get("session")
    store, retriever = call.parts.store, call.parts.retriever
    text = views.clean_query(query)
    hits = await views.search(store, retriever, call.user, text, k=k, mode=mode, session=session)
    results = [views.hit_json(h) for h in hits]
    structured = {"user": call.user, "query": query, "mode": mode, "k": k, "results": results}
    if not results:  # an answer, not a failure
        return ToolResult(render.nothing_found(query, mode, session), structured)
    return ToolResult(render.hits_text(query, mode, results), structured)


def note_text(text: str, tags: list[str], session: str | None) -> str:
    """The note as stored: its text, then its tags and session on a line of their own."""
    context = []
    if tags:
        context.append(f"tags: {', '.join(tags)}")
    if session:
        context.append(f"session: {session}")
    return f"{text}\n({'; '.join(context)})" if context else text


async def _remember(call: Call, args: dict[str, Any]) -> ToolResult:
    text = actions.clean_text(args["text"])
    tags = [t.strip() for t in args.get("tags", [])]
    if any(not t for t in tags):
        raise ArgumentError("tags must not be blank.", "tags")
    session = args.get("session", "").strip() or None
    note = note_text(text, tags, session)
    if len(note) > actions.MAX_NOTE_CHARS:
        raise ArgumentError(
            f"text with its tags and session is {len(note)} characters; at most "
            f"{actions.MAX_NOTE_CHARS} are accepted.",
            "text",
        )
    parts = call.parts
    turn = await actions.add_note(
        parts.store,
        parts.retriever.embedder,
        call.user,
        note,
        redact_secrets=call.services.settings.memory.redact_secrets,
    )
    stored = {**views.turn_json(turn), "session": f"{NOTES_PREFIX}{call.user}", "tags": tags}
    return ToolResult(render.note_text(stored), stored)


async def _forget(call: Call, args: dict[str, Any]) -> ToolResult:
    ids: list[int] = args.get("ids", [])
    session: str | None = args.get("session")
    if not ids and session is None:
        raise ArgumentError(
            "Give ids (turn ids, from engram_search or engram_session), a session (from "
            "engram_sessions), or both.",
            "ids",
        )
    store = call.parts.store
    forgotten: list[dict[str, Any]] = []
    missing: list[dict[str, Any]] = []

    async def forget(key: dict[str, Any], action: Awaitable[actions.Done]) -> None:
        try:
            done = await action
        except NotFound as exc:
            reason = f"{exc.message} Already forgotten, or never this user's."
            missing.append({**key, "reason": reason})
            return
        after(call.services, done)
        forgotten.append(done.detail)

    for turn_id in ids:
        await forget({"id": turn_id}, actions.forget_turn(store, call.user, turn_id))
    if session is not None:
        await forget({"session": session}, actions.forget_session(store, call.user, session))
    structured = {"user": call.user, "forgotten": forgotten, "not_found": missing}
    text = render.forget_text(call.user, forgotten, missing)
    return ToolResult(text, structured, is_error=not forgotten)


def _first_line(turns: list[Turn]) -> str | None:
    """The first line of a session: its first user message's, else its first text's."""
    for role in ("user", None):
        for t in turns:
            if (role is None or t.role == role) and t.content.strip():
                return render.first_line(t.content)
    return None


async def _sessions(call: Call, args: dict[str, Any]) -> ToolResult:
    limit = args.get("limit", tools.DEFAULT_SESSIONS)
    store = call.parts.store
    sessions = await store.list_sessions(call.user)
    counts = await store.session_turn_counts(call.user)
    names = {s.id: s.name for s in sessions}
    page = sessions[:limit]
    firsts = await store.read(
        lambda c: {s.id: _first_line(queries.session_turns(c, s.id, 0, FIRST_TURNS)) for s in page}
    )
    rows = [
        {**views.session_json(s, counts.get(s.id, 0), names), "first_line": firsts[s.id]}
        for s in page
    ]
    structured = {"user": call.user, "total": len(sessions), "sessions": rows}
    return ToolResult(render.sessions_text(call.user, len(sessions), rows), structured)


async def _session(call: Call, args: dict[str, Any]) -> ToolResult:
    offset = args.get("offset", 0)
    limit = args.get("limit", tools.DEFAULT_PAGE)
    store = call.parts.store
    session = await views.owned_session(store, call.user, args["session"])
    total = await store.count_turns(session.id)
    turns = await store.session_turns(session.id, offset, limit + 1)
    more = turns[limit].position if len(turns) > limit else None
    names: dict[str, str] = {}
    if session.parent_id is not None:
        parent = await store.get_session(session.parent_id)
        names = {parent.id: parent.name} if parent is not None else {}
    shown = views.session_json(session, total, names)
    rows = [{**views.turn_json(t), "session": session.name} for t in turns[:limit]]
    structured = {"session": shown, "total": total, "turns": rows, "next_offset": more}
    return ToolResult(render.session_text(shown, rows, more), structured)


_RUNNERS: dict[str, Runner] = {
    "engram_search": _search,
    "engram_remember": _remember,
    "engram_forget": _forget,
    "engram_sessions": _sessions,
    "engram_session": _session,
}
assert set(_RUNNERS) == set(tools.NAMES)
