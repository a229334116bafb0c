"""The JSON Lines format of ``engram import`` and ``engram export``: one turn or session a line.

A turn line: ``{"user", "session", "role", "speaker", "content", "timestamp"}`` (``user``
defaults to ``default``; ``speaker`` and ``timestamp`` are optional; ``timestamp`` is Unix
seconds or an ISO 8601 string, naive times being UTC; ``tool_calls``, ``tool_call_id`` and
``incomplete`` are kept when present; other keys, such as the ``position`` export writes, are
ignored). A line ``{"type": "session", "user", "session", "parent", "agent", "indexed"}`` creates
a session before its turns; ``engram export`` writes them, so an export imports back. ``session``
and ``parent`` are names within ``user`` (the ids the user's clients know them by): two users may
each have a session of the same name.

Pure functions: :func:`parse_line` gives a record or a :class:`LineError` naming the line and
the reason; :func:`export_line` turns a :meth:`Store.export` item into a line.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from proxy import json_input

ROLES = frozenset(
    {"system", "developer", "user", "assistant", "tool", "function", "summary", "fact"}
)
ID_PATTERN = re.compile(r"^[A-Za-z0-9._:@/+=~-]{1,200}$")
_ID_RULE = "1-200 characters of letters, digits and ._:@/+=~-"


@dataclass(frozen=True)
class LineError:
    """A record that could not be imported, and why."""

    line: int
    reason: str


@dataclass(frozen=True)
class TurnRecord:
    """One valid turn line."""

    line: int
    user: str
    session: str
    role: str
    content: str
    speaker: str | None = None
    timestamp: float | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    incomplete: bool = False


@dataclass(frozen=True)
class SessionRecord:
    """One valid session line."""

    line: int
    user: str
    session: str
    parent: str | None = None
    agent: str | None = None
    indexed: bool | None = None


Record = TurnRecord | SessionRecord
Source = Mapping[str, Any] | TurnRecord | SessionRecord | LineError
"""What an importer takes per line: a decoded JSON object, or what :func:`parse_line` gave."""


class _Invalid(ValueError):
    """A value that breaks the format; its message is the reason reported."""


def parse_line(line_no: int, text: str) -> TurnRecord | SessionRecord | LineError:
    """Decode and validate one JSON line."""
    try:
        obj = json_input.loads(text)
    except json_input.TooDeep:
        return LineError(
            line_no, f"JSON nested deeper than {json_input.MAX_DEPTH} levels (not a record)"
        )
    except ValueError as exc:
        return LineError(line_no, f"not valid JSON: {exc}")
    return parse_record(line_no, obj)


def parse_record(line_no: int, obj: object) -> TurnRecord | SessionRecord | LineError:
    """Validate one decoded JSON value as a turn or session record."""
    try:
        if not isinstance(obj, Mapping):
            raise _Invalid(f"expected a JSON object, got {type(obj).__name__}")
        kind = obj.get("type", "turn")
        user = _id(obj, "user", default="default")
        session = _id(obj, "session")
        if kind == "session":
            parent = _id(obj, "parent") if obj.get("parent") is not None else None
            indexed = obj.get("indexed")
            if indexed is not None and not isinstance(indexed, bool):
                raise _Invalid("indexed must be true, false or null")
            return SessionRecord(line_no, user, session, parent, _opt_str(obj, "agent"), indexed)
        if kind != "turn":
            raise _Invalid(f'type must be "turn" or "session", got {kind!r}')
        role = obj.get("role")
        if role not in ROLES:
            raise _Invalid(f"role must be one of {', '.join(sorted(ROLES))}; got {role!r}")
        content = obj.get("content")
        if not isinstance(content, str):
            raise _Invalid("content must be a string")
        _check_text("content", content)
        calls = obj.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
        ):
            raise _Invalid("tool_calls must be a list of objects or null")
        if calls:
            _check_text("tool_calls", json.dumps(calls, ensure_ascii=False))
        if not content.strip() and not calls:
            raise _Invalid("content is empty")
        incomplete = obj.get("incomplete", False)
        if not isinstance(incomplete, bool):
            raise _Invalid("incomplete must be true or false")
        return TurnRecord(
            line_no,
            user,
            session,
            str(role),
            content,
            speaker=_opt_str(obj, "speaker"),
            timestamp=parse_timestamp(obj.get("timestamp")),
            tool_calls=calls,
            tool_call_id=_opt_str(obj, "tool_call_id"),
            incomplete=incomplete,
        )
    except _Invalid as exc:
        return LineError(line_no, str(exc))


def parse_timestamp(value: object) -> float | None:
    """Unix seconds (a number) or an ISO 8601 string (naive means UTC); None when absent.

    Raises ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 0:
            raise _Invalid(f"timestamp {value!r} is not a valid time")
        return float(value)
    if isinstance(value, str):
        try:
            when = datetime.fromisoformat(value.strip())
        except ValueError:
            raise _Invalid(f"timestamp {value!r} is neither Unix seconds nor ISO 8601") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return when.timestamp()
    raise _Invalid("timestamp must be Unix seconds or an ISO 8601 string")


def _id(obj: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = obj.get(key, default)
    if value is None:
        raise _Invalid(f"{key} is missing")
    if not isinstance(value, str) or not ID_PATTERN.match(value):
        raise _Invalid(f"{key} must be {_ID_RULE}; got {value!r}")
    return value


def _opt_str(obj: Mapping[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _Invalid(f"{key} must be a string or null")
    _check_text(key, value)
    return value


def _check_text(key: str, value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _Invalid(f"{key} is not valid Unicode (a lone surrogate)") from None


def export_line(item: Mapping[str, Any]) -> dict[str, Any]:
    """A :meth:`Store.export` item in this module's line format (what import reads back)."""
    if item.get("type") == "session":
        return {
            "type": "session",
            "user": item["user_id"],
            "session": item.get("name") or item["id"],
            "parent": item.get("parent_name", item["parent_id"]),
            "agent": item["agent"],
            "indexed": item["indexed"],
            "created_at": item["created_at"],
            "last_seen": item["last_seen"],
        }
    line: dict[str, Any] = {
        "type": "turn",
        "user": item["user_id"],
        "session": item.get("session_name") or item["session_id"],
        "position": item["position"],
        "role": item["role"],
        "speaker": item["speaker"],
        "content": item["content"],
        "timestamp": item["timestamp"],
    }
    for key in ("tool_calls", "tool_call_id"):
        if item.get(key) is not None:
            line[key] = item[key]
    if item.get("incomplete"):
        line["incomplete"] = True
    return line
