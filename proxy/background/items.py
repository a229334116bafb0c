"""Memory items: what Engram itself adds to a session (a sub-agent's hand-back summary, a
consolidated fact), stored and indexed like turns so the normal hybrid search finds them.

Items take negative positions (-1, -2, …) in their session, so they never collide with the
conversation's messages (0, 1, 2, …) nor change how a conversation is recognised; they carry the
session they came from in ``source_session``.
"""

from __future__ import annotations

import time

from proxy.redact import redact
from proxy.search.embedder import Embedder
from proxy.store.items import insert_item
from proxy.store.models import NewTurn, embed_text, text_hash
from proxy.store.store import Store

ITEM_ROLES = ("summary", "fact")


async def add_item(
    store: Store,
    embedder: Embedder | None,
    session_id: str,
    user_id: str,
    role: str,
    speaker: str,
    content: str,
    source_session: str | None = None,
    redact_secrets: bool = True,
    source_turn: int | None = None,
) -> int:
    """Store ``content`` as a memory item of ``session_id``; returns its turn id. The model
    wrote it from archived turns, yet it is redacted too (``memory.redact_secrets``): turns
    archived before a rule existed still hold what the rule now finds."""
    if role not in ITEM_ROLES:
        raise ValueError(f"a memory item's role is one of {ITEM_ROLES}, not {role!r}")
    if redact_secrets:
        speaker, content = redact(speaker), redact(content)
    text = embed_text(role, speaker, content)
    vector = (await embedder.embed_passages([text]))[0] if embedder is not None else None
    turn = NewTurn(
        position=-1,
        role=role,
        content=content,
        speaker=speaker,
        timestamp=time.time(),
        content_hash=text_hash(f"{role}\0{speaker}\0{content}"),
        embed_hash=text_hash(text),
    )
    return await store.write(
        lambda c: insert_item(c, session_id, user_id, turn, vector, source_session, source_turn)
    )
