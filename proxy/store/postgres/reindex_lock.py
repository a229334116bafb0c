"""``engram reindex`` alone on a PostgreSQL database: SQLite's lock file
(:mod:`proxy.store.sqlite.lock`) as a session advisory lock, and a look at who else is connected.

``engram reindex`` takes :data:`REINDEX_KEY` exclusively and ``engram import`` shared (each on
a connection of its own, held for the run: the lock goes with the session, even when the process
is killed). An exclusive holder also refuses while any other Engram process is connected to the
database (``pg_stat_activity``: the store's connections are named ``engram``), since servers do
not take the advisory lock: their vectors would land beside the new model's. A server started
after ``engram reindex`` began is not stopped by this; the reindex's own swap still checks, in
its transaction, that no turn lacks a vector of the new model.
"""

from __future__ import annotations

from typing import Any

from proxy.store.postgres.connection import PostgresUnavailable, normalise_url, redact_error
from proxy.store.sqlite.lock import DatabaseBusy

REINDEX_KEY = 0x72656E646578  # "rendex": not the migrations' (pg.migrate.LOCK_KEY)
STORE_APPLICATION = "engram"  # application_name of the store's connections (pg.connection)


class PgReindexLock:
    """The advisory lock of ``url``'s database: ``acquire(exclusive=)``, ``release()``;
    :class:`~proxy.store.sqlite.lock.DatabaseBusy` when it cannot be had now."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._raw: Any = None

    def acquire(self, *, exclusive: bool) -> None:
        import psycopg

        name = "engram reindex" if exclusive else "engram import"
        try:
            raw = psycopg.connect(
                normalise_url(self.url), autocommit=True, application_name=name, connect_timeout=10
            )
        except psycopg.Error as exc:
            raise PostgresUnavailable(
                f"cannot connect to PostgreSQL: {redact_error(exc)}"
            ) from None
        try:
            take = "pg_try_advisory_lock" if exclusive else "pg_try_advisory_lock_shared"
            got = raw.execute(f"SELECT {take}(%s)", (REINDEX_KEY,)).fetchone()
            if not (got and got[0]):
                raise DatabaseBusy("engram reindex" if not exclusive else "another engram command")
            others = _other_engram_sessions(raw) if exclusive else 0
            if others:
                raise DatabaseBusy(f"{others} connections of an Engram server or command")
        except BaseException:
            raw.close()
            raise
        self._raw = raw

    def release(self) -> None:
        """Close the lock's session (which ends the lock)."""
        if self._raw is not None:
            self._raw.close()
            self._raw = None


def _other_engram_sessions(raw: Any) -> int:
    """Connections of Engram's store (servers, other commands) to this database, ours aside."""
    row = raw.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = %s AND pid <> pg_backend_pid()",
        (STORE_APPLICATION,),
    ).fetchone()
    return int(row[0])
