"""What the model reads of each tool's answer: plain text made from the same JSON the answer's
``structuredContent`` carries (the admin API's shapes, :mod:`proxy.api.views`), pure.

Long texts are cut in the readable part (:data:`TEXT_CHARS` a turn, saying how much was left
out); ``structuredContent`` keeps them whole.
"""

from __future__ import annotations

from typing import Any

TEXT_CHARS = 2000
FIRST_LINE_CHARS = 120
_PATHS = {"fts": "full-text", "vec": "vector"}


def cut(text: str, limit: int = TEXT_CHARS) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters in structuredContent)"


def first_line(text: str) -> str:
    """The first non-blank line of a text, cut to :data:`FIRST_LINE_CHARS`."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= FIRST_LINE_CHARS else line[: FIRST_LINE_CHARS - 1] + "…"


def _who(turn: dict[str, Any]) -> str:
    speaker = turn.get("speaker")
    return f"{turn['role']} ({speaker})" if speaker else str(turn["role"])


def _why(hit: dict[str, Any]) -> str:
    ranks = [f"{_PATHS[p]} #{r}" for p, r in hit["ranks"].items() if r is not None]
    return f"score {hit['score']:.4f} ({', '.join(ranks) or 'pinned'})"


def hits_text(query: str, mode: str, hits: list[dict[str, Any]]) -> str:
    head = f"{len(hits)} memor{'y' if len(hits) == 1 else 'ies'} for {query!r} ({mode} search):"
    lines = [head]
    for i, h in enumerate(hits, 1):
        via = f" · via {h['api']}" if h.get("api") else ""
        lines.append(
            f"{i}. [turn {h['id']} · session {h['session']} · {_who(h)} · "
            f"{h['timestamp_iso']}{via} · {_why(h)}]"
        )
        lines.append("   " + cut(h["content"]).replace("\n", "\n   "))
    return "\n".join(lines)


def nothing_found(query: str, mode: str, session: str | None) -> str:
    where = f" in session {session!r}" if session else ""
    others = ", ".join(m for m in ("hybrid", "fts", "vec") if m != mode)
    return (
        f"Nothing in memory matches {query!r}{where} ({mode} search). Try other or fewer words, "
        f"another mode ({others})" + (", or no session filter." if session else ".")
    )


def note_text(note: dict[str, Any]) -> str:
    return (
        f"Remembered as turn {note['id']} in session {note['session']} "
        f"({note['timestamp_iso']}); it is recalled in later chats and found by engram_search."
    )


def forget_text(user: str, forgotten: list[dict[str, Any]], missing: list[dict[str, Any]]) -> str:
    lines = []
    for done in forgotten:
        if "derived" in done:
            derived = {k: v for k, v in done["derived"].items() if v}
            made = ", ".join(f"{v} {k}" for k, v in derived.items())
            lines.append(
                f"Forgot turn {done['id']} ({done['role']})"
                + (f" and what was made from it: {made}." if made else ".")
            )
        else:
            lines.append(f"Forgot session {done['id']} and its {done['turns']} turn(s).")
    for item in missing:
        lines.append(item["reason"])
    if not forgotten:
        lines.append(
            f"Nothing was forgotten for user {user!r}: find ids with engram_search or "
            "engram_session, session ids with engram_sessions."
        )
    return "\n".join(lines)


def sessions_text(user: str, total: int, sessions: list[dict[str, Any]]) -> str:
    if not sessions:
        return f"User {user!r} has no sessions in memory yet."
    lines = [f"{len(sessions)} of {total} session(s) of user {user!r}, most recent first:"]
    for s in sessions:
        extra = "".join(
            f" · {label} {s[key]}"
            for key, label in (("agent", "agent"), ("parent", "sub-agent of"))
            if s.get(key)
        )
        first = f": {s['first_line']}" if s.get("first_line") else ""
        lines.append(
            f"- {s['id']} · {s['turns']} turn(s) · last {s['last_seen_iso']}{extra}{first}"
        )
    return "\n".join(lines)


def _call_names(calls: list[Any]) -> list[str]:
    names = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        names.append(str(fn.get("name", "?")) if isinstance(fn, dict) else "?")
    return names


def session_text(session: dict[str, Any], turns: list[dict[str, Any]], more: int | None) -> str:
    lines = [
        f"Session {session['id']} ({session['turns']} turn(s), last active "
        f"{session['last_seen_iso']}):"
    ]
    for t in turns:
        lines.append(
            f"[turn {t['id']} · position {t['position']} · {_who(t)} · {t['timestamp_iso']}]"
        )
        if t["content"]:
            lines.append(cut(t["content"]))
        if t.get("tool_calls"):
            lines.append(f"(tool calls: {', '.join(_call_names(t['tool_calls']))})")
    if not turns:
        lines.append("No turns at this offset.")
    if more is not None:
        lines.append(f"More turns follow: call engram_session again with offset {more}.")
    return "\n".join(lines)
