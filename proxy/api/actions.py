"""What a person does when memory is wrong, one function per action, shared by every surface:
the inspector page (:mod:`proxy.inspector`), the admin API (:mod:`proxy.api.routes`), the MCP
tools and the ``engram`` command (:mod:`proxy.cli`). No aiohttp here.

Each action checks that what it names is the user's (another user's turn, fact or session is
"not found", exactly like a missing one), does its work in one write transaction, and answers a
:class:`Done` saying what changed and what is left to do afterwards on the caller's side (the
Redis copies of slots, the scrub that makes the bytes leave the file, in-memory views):
:func:`proxy.api.effects.after` on a server, the command's own steps in the CLI.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from proxy.errors import BadRequest, NotFound
from proxy.redact import redact
from proxy.search.embedder import Embedder
from proxy.store import corrections, queries
from proxy.store.forget import forget_session as forget_session_rows
from proxy.store.models import NewTurn, Turn, embed_text, text_hash
from proxy.store.naming import named_session
from proxy.store.store import Store

MAX_NOTE_CHARS = 8000
NOTE_API = "note"
"""``turns.api`` of a note: it came through no chat API, a person wrote it."""


@dataclass(frozen=True)
class Done:
    """What an action changed (``detail``, its JSON answer) and what the caller still does:
    delete ``slot_ids`` from Redis, drop the in-memory views of ``sessions`` (or of ``turn``,
    or all of the user's with ``everything``), scrub the file (``scrub``)."""

    user: str
    detail: dict[str, Any]
    sessions: tuple[str, ...] = ()
    slot_ids: tuple[str, ...] = ()
    turn: int | None = None
    everything: bool = False
    scrub: bool = False
    pins_changed: bool = False


# --- parameters ---------------------------------------------------------------------------------


def parse_turn_id(raw: object, name: str = "id") -> int:
    """A turn id from a path, a form or JSON: a positive integer, else a 400 naming it."""
    if isinstance(raw, bool):
        raw = None
    if isinstance(raw, int):
        value = raw
    elif isinstance(raw, str) and raw.strip().isdigit() and len(raw.strip()) <= 18:
        value = int(raw.strip())
    else:
        raise BadRequest(f"{name} must be a turn id (a positive integer); got {raw!r}.", param=name)
    if value <= 0:
        raise BadRequest(f"{name} must be a positive integer; got {value}.", param=name)
    return value


def clean_text(raw: object, name: str = "text", limit: int = MAX_NOTE_CHARS) -> str:
    """A note's or fact's text: a string, not blank, at most ``limit`` characters; NULs and lone
    surrogates replaced."""
    if not isinstance(raw, str):
        raise BadRequest(f"{name} is required: a string.", param=name, code=f"invalid_{name}")
    text = raw.replace("\x00", " ").encode("utf-8", "replace").decode("utf-8").strip()
    if not text:
        raise BadRequest(f"{name} must not be empty.", param=name, code=f"invalid_{name}")
    if len(text) > limit:
        raise BadRequest(
            f"{name} is {len(text)} characters; at most {limit} are accepted.",
            param=name,
            code=f"{name}_too_long",
        )
    return text


def parse_recall(raw: object) -> int:
    """``pinned``, ``muted`` or ``normal`` as ``turns.recall``'s value."""
    if not isinstance(raw, str) or raw not in corrections.RECALL_MODES:
        modes = ", ".join(corrections.RECALL_MODES)
        raise BadRequest(f"recall must be one of {modes}; got {raw!r}.", param="recall")
    return corrections.RECALL_MODES[raw]


# --- reading --------------------------------------------------------------------------------------


async def owned_turn(store: Store, user: str, turn_id: int) -> Turn:
    found = await store.read(lambda c: corrections.user_turn(c, user, turn_id))
    if found is None:
        raise NotFound(f"No turn {turn_id} for user {user!r}.", code="turn_not_found")
    return found


async def owned_fact(store: Store, user: str, fact_id: int) -> Turn:
    found = await owned_turn(store, user, fact_id)
    if found.role != "fact":
        raise NotFound(f"No fact {fact_id} for user {user!r}.", code="fact_not_found")
    return found


# --- forgetting -----------------------------------------------------------------------------------


async def forget_session(store: Store, user: str, name: str) -> Done:
    """Delete the user's session ``name`` and all it produced (:mod:`proxy.store.forget`)."""
    session = await store.read(lambda c: named_session(c, user, name))
    if session is None:
        raise NotFound(f"No session {name!r} for user {user!r}.", code="session_not_found")
    turns = await store.count_turns(session.id)
    gone = await store.write(lambda c: forget_session_rows(c, session.id, user))
    if gone is None:  # deleted meanwhile
        raise NotFound(f"No session {name!r} for user {user!r}.", code="session_not_found")
    return Done(
        user,
        {"id": session.name, "deleted": True, "turns": turns},
        sessions=gone.sessions,
        slot_ids=gone.slot_ids,
        scrub=True,
        pins_changed=True,
    )


async def forget_turn(store: Store, user: str, turn_id: int) -> Done:
    """Delete one of the user's turns and what was made from it
    (:func:`proxy.store.corrections.forget_turn`)."""
    gone = await store.write(lambda c: corrections.forget_turn(c, user, turn_id))
    if gone is None:
        raise NotFound(f"No turn {turn_id} for user {user!r}.", code="turn_not_found")
    return Done(
        user,
        {
            "id": turn_id,
            "deleted": True,
            "role": gone.role,
            "derived": {
                "facts": gone.facts,
                "summaries": gone.summaries,
                "handbacks": gone.handbacks,
                "requests": gone.requests,
            },
        },
        sessions=(gone.session_id,) if gone.summaries or gone.requests else (),
        turn=turn_id,
        scrub=True,
        pins_changed=True,
    )


async def forget_everything(store: Store, user: str) -> Done:
    """Delete all of the user's memory: sessions, turns, items, requests, feedback, slots,
    scaffolding. Their keys stay (forgetting memory is not closing an account)."""
    turns = (await store.session_turn_counts(user)).values()
    sessions = [s.id for s in await store.list_sessions(user)]
    await store.delete_user(user)
    return Done(
        user,
        {"user": user, "deleted": True, "sessions": len(sessions), "turns": sum(turns)},
        sessions=tuple(sessions),
        everything=True,
        scrub=True,
        pins_changed=True,
    )


# --- notes, facts, pins ---------------------------------------------------------------------------


async def _vector(embedder: Embedder | None, role: str, speaker: str | None, text: str) -> Any:
    if embedder is None:
        return None  # the indexer embeds it once a model is there
    return (await embedder.embed_passages([embed_text(role, speaker, text)]))[0]


async def add_note(
    store: Store,
    embedder: Embedder | None,
    user: str,
    text: str,
    *,
    redact_secrets: bool = True,
) -> Turn:
    """Store ``text`` as the user's own words in their notes session, indexed and embedded
    before this returns: recalled like any turn from the next chat on."""
    content = redact(text) if redact_secrets else text
    vector = await _vector(embedder, "user", None, content)
    now = time.time()
    em = text_hash(embed_text("user", None, content))

    def write(c: Any) -> Turn:
        sid = corrections.notes_session(c, user, now)
        turn = NewTurn(
            position=queries.next_position(c, sid),
            role="user",
            content=content,
            timestamp=now,
            api=NOTE_API,
            embed_hash=em if vector is not None else None,
        )
        (turn_id,) = queries.add_turns(
            c, sid, user, [turn], [vector] if vector is not None else None, now
        )
        found = corrections.user_turn(c, user, turn_id)
        assert found is not None
        return found

    return await store.write(write)


async def edit_fact(
    store: Store,
    embedder: Embedder | None,
    user: str,
    fact_id: int,
    text: str,
    *,
    redact_secrets: bool = True,
) -> tuple[Turn, Done]:
    """Replace the user's fact by one saying ``text`` (same subject, session and sources; a new
    id: the old row, its index entry and vector are deleted, so its words leave the file)."""
    old = await owned_fact(store, user, fact_id)
    content = redact(text) if redact_secrets else text
    vector = await _vector(embedder, "fact", old.speaker, content)
    new = NewTurn(
        position=-1,
        role="fact",
        content=content,
        speaker=old.speaker,
        timestamp=time.time(),
        content_hash=text_hash(f"fact\0{old.speaker}\0{content}"),
        embed_hash=text_hash(embed_text("fact", old.speaker, content)),
    )

    turn = await store.write(lambda c: corrections.replace_fact(c, user, fact_id, new, vector))
    if turn is None:  # forgotten meanwhile
        raise NotFound(f"No fact {fact_id} for user {user!r}.", code="fact_not_found")
    done = Done(
        user,
        {"id": turn.id, "replaces": fact_id, "content": turn.content},
        turn=fact_id,
        scrub=True,
        pins_changed=True,  # a pinned fact's old words may be in the pinned turns kept
    )
    return turn, done


async def delete_fact(store: Store, user: str, fact_id: int) -> Done:
    await owned_fact(store, user, fact_id)
    return await forget_turn(store, user, fact_id)


async def set_recall(store: Store, user: str, turn_id: int, value: int) -> Turn:
    """Pin (recalled into every chat), mute (never recalled) or release one of the user's turns."""
    found = await store.write(lambda c: corrections.set_recall(c, user, turn_id, value))
    if found is None:
        raise NotFound(f"No turn {turn_id} for user {user!r}.", code="turn_not_found")
    return found
