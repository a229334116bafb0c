"""The memory database: SQLite with FTS5 and sqlite-vec, behind an async :class:`Store`.

- :mod:`proxy.store.sqlite.db` — open a connection through a driver that can load sqlite-vec.
- :mod:`proxy.store.sqlite.migrations` — the schema as numbered migrations.
- :mod:`proxy.store.models` — row dataclasses, message/text hashes, store errors.
- :mod:`proxy.store.rows` — the columns of sessions and turns, and reading them from a row.
- :mod:`proxy.store.queries` — the SQL of users, sessions and turns, as synchronous functions of
  a connection (so is every module below that owns tables).
- :mod:`proxy.store.indexing` — the turns' vectors and their deferred full-text rows.
- :mod:`proxy.store.sqlite.search_sql` — FTS5 and vector search (exact or bit-quantised) in one
namespace.
- :mod:`proxy.store.vectable` — which model made the vectors, ``turn_vec``'s dimension, and the
  build table ``engram reindex`` fills and swaps in; :mod:`proxy.store.sqlite.lock` — the lock file
  that
  keeps ``engram reindex`` apart from the processes that write vectors.
- :mod:`proxy.store.store` — :class:`Store`: writer thread, reader pool, async methods.

The tables of the stages above, each module the SQL of what it owns (run through
:meth:`Store.read` / :meth:`Store.write`):

- :mod:`proxy.store.items` — memory items (hand-backs, facts) in ``turns``.
- :mod:`proxy.store.subagents` — when sub-agent sessions were completed.
- :mod:`proxy.store.summaries` — ``summaries``: one rolling summary per session.
- :mod:`proxy.store.feedback` — ``requests``, ``feedback``, ``consolidation_queue``.
- :mod:`proxy.store.counters` — ``counters``, and the memory loop's counts.
- :mod:`proxy.store.slots` — ``slots``: the embedded tool-result slot backend.

All SQL lives in this package. The store knows nothing of where vectors come from; it stores
and searches them.
"""

from proxy.store.models import (
    NewTurn,
    Session,
    SessionConflict,
    SessionNotFound,
    StoreError,
    StoreStats,
    Turn,
    message_hash,
    text_hash,
)
from proxy.store.sqlite.db import DbInfo, connect, database_info
from proxy.store.store import Store

__all__ = [
    "DbInfo",
    "NewTurn",
    "Session",
    "SessionConflict",
    "SessionNotFound",
    "Store",
    "StoreError",
    "StoreStats",
    "Turn",
    "connect",
    "database_info",
    "message_hash",
    "text_hash",
]
