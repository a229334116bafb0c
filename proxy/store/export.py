"""One user namespace as JSON-ready dicts, for ``engram export`` and ``GET /engram/api/export``:
``{"type": "session", ...}`` for each session (oldest first), then ``{"type": "turn", ...}`` for
each turn (by id), a page at a time. Each session carries ``parent_name`` and each turn
``session_name``: the names its owner knows them by (:mod:`proxy.store.naming`), which is what
an export writes, so it imports back under the same names. A turn's content is its text as sent:
the scaffolding stored once per user (:mod:`proxy.store.scaffolds`) is put back in place."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from proxy.store import queries, scaffolds
from proxy.store.sqlite.db import Connection

T = TypeVar("T")
Reader = Callable[[Callable[[Connection], T]], Awaitable[T]]


async def export_items(
    read: Reader[Any], user_id: str, page_size: int
) -> AsyncIterator[dict[str, Any]]:
    """The user's sessions, then turns; ``read`` runs a function on a reader connection."""
    sessions = await read(lambda c: queries.session_rows(c, user_id))
    names = {s.id: s.name for s in sessions}
    for session in sessions:
        parent = names.get(session.parent_id) if session.parent_id is not None else None
        yield {"type": "session", **dataclasses.asdict(session), "parent_name": parent}
    after = 0
    while True:
        page = await read(
            functools.partial(
                queries.user_turns_page, user_id=user_id, after_id=after, limit=page_size
            )
        )
        ids = [t.id for t in page]
        whole = await read(
            functools.partial(scaffolds.full_contents, user_id=user_id, turn_ids=ids)
        )
        for turn in page:
            name = names.get(turn.session_id, turn.session_id)
            item = {"type": "turn", **dataclasses.asdict(turn), "session_name": name}
            if turn.id in whole:  # the text as sent: its scaffolding put back
                item["content"] = whole[turn.id]
            yield item
        if len(page) < page_size:
            return
        after = page[-1].id
