"""The MCP tools Engram serves and the instructions it gives a client, as data (pure).

Each description says *when* to call the tool (agents rarely use memory tools that only say what
they do). Input schemas are the ones :mod:`proxy.mcp.schema` enforces, limits included (the
same as the admin API's: :data:`proxy.api.views.MAX_K`, :data:`~proxy.api.views.MAX_QUERY_CHARS`,
:data:`proxy.api.actions.MAX_NOTE_CHARS`). A credential that may act for any user (the admin
token, an admin key) is shown every tool with one more argument, ``user``; to anyone else that
argument does not exist.
"""

from __future__ import annotations

import copy
from typing import Any

from proxy.api.actions import MAX_NOTE_CHARS
from proxy.api.views import DEFAULT_K, MAX_K, MAX_QUERY_CHARS
from proxy.search.retrieval import MODES

MAX_IDS = 100
"""Turn ids one ``engram_forget`` call takes."""
MAX_TAGS = 10
MAX_TAG_CHARS = 40
MAX_SESSION_CHARS = 200
DEFAULT_SESSIONS, MAX_SESSIONS = 20, 200
DEFAULT_PAGE, MAX_PAGE = 20, 100
MAX_SAFE_INT = 2**53 - 1  # the largest integer every JSON client reads exactly

INSTRUCTIONS = (
    "Engram is this user's long-term memory: every earlier conversation that went through the "
    "Engram proxy (any chat client or coding agent) and the notes saved with engram_remember. "
    "Call engram_search before answering whenever the answer may depend on something from an "
    "earlier session: the user's preferences, people, projects, decisions, names and numbers, "
    "or how a problem was solved before; and whenever the user refers to the past ('as I said', "
    "'last time', 'do you remember'). Call engram_remember when the user tells you something "
    "worth keeping across sessions or asks you to remember it: one self-contained fact per note. "
    "Call engram_forget only when the user asks to forget or delete something. engram_sessions "
    "and engram_session browse past conversations."
)

_SESSION_ID: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_SESSION_CHARS,
    "description": "A session id, as engram_sessions and engram_search show it.",
}
_USER: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_SESSION_CHARS,
    "description": (
        "The user whose memory to use (this credential may act for any user). Default: the "
        "X-Engram-User header, else the key's own user, else 'default'."
    ),
}
_NULLABLE_STR = {"type": ["string", "null"]}
_TURN: dict[str, Any] = {
    "type": "object",
    "required": ["id", "role", "content", "timestamp_iso"],
    "properties": {
        "id": {"type": "integer"},
        "session": {"type": "string"},
        "position": {"type": "integer"},
        "role": {"type": "string"},
        "speaker": _NULLABLE_STR,
        "content": {"type": "string"},
        "timestamp": {"type": "number"},
        "timestamp_iso": {"type": "string"},
        "api": _NULLABLE_STR,
    },
}
_HIT = copy.deepcopy(_TURN)
_HIT["required"] = [*_TURN["required"], "session", "score", "ranks"]
_HIT["properties"].update(
    score={"type": "number"},
    ranks={
        "type": "object",
        "properties": {"fts": {"type": ["integer", "null"]}, "vec": {"type": ["integer", "null"]}},
    },
)
_SESSION: dict[str, Any] = {
    "type": "object",
    "required": ["id", "turns", "last_seen_iso"],
    "properties": {
        "id": {"type": "string"},
        "turns": {"type": "integer"},
        "first_line": _NULLABLE_STR,
        "agent": _NULLABLE_STR,
        "parent": _NULLABLE_STR,
        "last_seen_iso": {"type": "string"},
        "created_at_iso": {"type": "string"},
    },
}


def _tool(
    name: str,
    title: str,
    description: str,
    properties: dict[str, Any],
    required: list[str],
    output: dict[str, Any],
    *,
    read_only: bool,
    destructive: bool = False,
    idempotent: bool = True,
) -> dict[str, Any]:
    return {
        "name": name,
        "title": title,
        "description": description,
        "inputSchema": {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        },
        "outputSchema": {"type": "object", **output},
        "annotations": {
            "title": title,
            "readOnlyHint": read_only,
            "destructiveHint": destructive,
            "idempotentHint": idempotent,
            "openWorldHint": False,
        },
    }


TOOLS: tuple[dict[str, Any], ...] = (
    _tool(
        "engram_search",
        "Search memory",
        "Search the user's long-term memory: earlier conversations through Engram (any client "
        "or agent) and saved notes. Call it BEFORE answering whenever the answer may depend on "
        "an earlier session (the user's preferences, people, projects, decisions, names, "
        "numbers, how something was fixed before) or the user refers to the past. Returns the "
        "best matches with their text, who said it, when, in which session, and why they "
        "ranked. When nothing matches it says so (not an error): then try other words, mode "
        "'fts' for exact names and identifiers, 'vec' for meaning, or no session filter.",
        {
            "query": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_QUERY_CHARS,
                "description": "What to look for, in words (a question or key terms).",
            },
            "k": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_K,
                "default": DEFAULT_K,
                "description": f"How many results at most (default {DEFAULT_K}).",
            },
            "mode": {
                "type": "string",
                "enum": list(MODES),
                "default": "hybrid",
                "description": "hybrid (default): words and meaning; fts: exact words; "
                "vec: meaning only.",
            },
            "session": {**_SESSION_ID, "description": "Search this session only (its id)."},
        },
        ["query"],
        {
            "required": ["user", "query", "mode", "k", "results"],
            "properties": {"results": {"type": "array", "items": _HIT}},
        },
        read_only=True,
    ),
    _tool(
        "engram_remember",
        "Remember a note",
        "Save a note to the user's long-term memory. It is stored durably before this call "
        "returns, found by engram_search, and recalled like any past conversation in every "
        "later chat through Engram. Call it when the user tells you something worth keeping "
        "across sessions (a preference, a decision, a fact about them, their work or their "
        "setup), asks you to remember something, or you learn what a future session would need "
        "(how a problem was solved, where something lives). One self-contained fact per note, "
        "written to make sense without this conversation; never store secrets. Returns the "
        "note's id (engram_forget takes it).",
        {
            "text": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_NOTE_CHARS,
                "description": "The note, self-contained.",
            },
            "tags": {
                "type": "array",
                "maxItems": MAX_TAGS,
                "uniqueItems": True,
                "items": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": MAX_TAG_CHARS,
                    "pattern": r"^[^,()\r\n]+$",
                    "description": "a short tag without commas, parentheses or line breaks.",
                },
                "description": "Short labels (project, topic); kept in the note's text, so "
                "searching for a tag finds the note.",
            },
            "session": {
                **_SESSION_ID,
                "description": "The conversation or project this note is about; kept in the "
                "note's text (notes live in the user's notes session).",
            },
        },
        ["text"],
        {
            "required": ["id", "session", "content", "timestamp_iso"],
            "properties": _TURN["properties"],
        },
        read_only=False,
        idempotent=False,
    ),
    _tool(
        "engram_forget",
        "Forget memories",
        "Permanently delete memories: turns by id (as engram_search and engram_session show "
        "them) with what was made from them (facts, summaries), and/or a whole session with "
        "everything it produced; the words leave the database file. Call it ONLY when the user "
        "asks to forget or delete something, or a note you saved is wrong; there is no undo. "
        "Ids not found (already forgotten, or not this user's) are reported; the rest go.",
        {
            "ids": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_IDS,
                "uniqueItems": True,
                "items": {"type": "integer", "minimum": 1, "maximum": MAX_SAFE_INT},
                "description": "Turn ids to delete.",
            },
            "session": {**_SESSION_ID, "description": "A session id: the whole session goes."},
        },
        [],
        {
            "required": ["user", "forgotten", "not_found"],
            "properties": {
                "forgotten": {"type": "array", "items": {"type": "object"}},
                "not_found": {"type": "array", "items": {"type": "object"}},
            },
        },
        read_only=False,
        destructive=True,
    ),
    _tool(
        "engram_sessions",
        "List sessions",
        "List the user's conversations (sessions) in memory, most recently active first: id, "
        "first line, number of turns, when last active. Call it to find a past conversation to "
        "read with engram_session, or when the user asks what you worked on before.",
        {
            "limit": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_SESSIONS,
                "default": DEFAULT_SESSIONS,
                "description": f"How many sessions at most (default {DEFAULT_SESSIONS}).",
            }
        },
        [],
        {
            "required": ["user", "total", "sessions"],
            "properties": {
                "total": {"type": "integer"},
                "sessions": {"type": "array", "items": _SESSION},
            },
        },
        read_only=True,
    ),
    _tool(
        "engram_session",
        "Read a session",
        "Read one past conversation (session) in order, a page at a time: each turn's id, role, "
        "speaker, time and text. Call it after engram_search or engram_sessions when you need "
        "the context around a hit or the whole discussion; pass the answer's next_offset as "
        "offset to read on.",
        {
            "session": {**_SESSION_ID, "description": "The session id."},
            "offset": {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_SAFE_INT,
                "default": 0,
                "description": "The turn position to start at (next_offset of the last page).",
            },
            "limit": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_PAGE,
                "default": DEFAULT_PAGE,
                "description": f"Turns per page (default {DEFAULT_PAGE}).",
            },
        },
        ["session"],
        {
            "required": ["session", "total", "turns", "next_offset"],
            "properties": {
                "session": {"type": "object"},
                "total": {"type": "integer"},
                "turns": {"type": "array", "items": _TURN},
                "next_offset": {"type": ["integer", "null"]},
            },
        },
        read_only=True,
    ),
)
NAMES = tuple(t["name"] for t in TOOLS)
_BY_NAME = {t["name"]: t for t in TOOLS}


def tool_list(may_name_user: bool) -> list[dict[str, Any]]:
    """The tools as ``tools/list`` shows them to this credential (module docstring)."""
    return [definition(name, may_name_user) for name in NAMES]


def definition(name: str, may_name_user: bool) -> dict[str, Any]:
    """One tool's definition (``KeyError`` for a name Engram does not serve)."""
    tool = _BY_NAME[name]
    if not may_name_user:
        return tool
    tool = copy.deepcopy(tool)
    tool["inputSchema"]["properties"]["user"] = _USER
    return tool
