"""Users' vectors held in memory for the exact KNN: the same search as vec0's, in numpy.

vec0's exact KNN reads every vector of the user's partition from SQLite's pages for each query
(5-6 ms for 10,000 MiniLM vectors on a 2-core machine); a float32 matrix product over the same
vectors takes about 0.3 ms. :class:`VectorCache` keeps, per user, the rows of ``turn_vec``
(turn id, vector, session, ``indexed``) with the turn's role, and answers searches with
:func:`proxy.store.caches.knn.knn`: the rows vec0's exact plan returns (cosine distance, nearest
first,
ties by turn id; filtered before the cut, as :func:`proxy.store.sqlite.search_sql.vec_search`
does). It
serves the exact plan, and in ``auto`` mode every user it holds, however many vectors (the
quantised plan is then only for a user not held yet, or too large to hold).

Coherence, in the writer thread (:class:`~proxy.store.store.Store` wraps every write in
:meth:`VectorCache.begin` / :meth:`VectorCache.commit`):

- every vector inserted goes through :func:`proxy.store.indexing.insert_vector`, which calls
  :func:`inserted`: after the commit the rows are appended to the users held (an id held
  already, i.e. a replaced vector, drops the user instead);
- a deleted turn (its vector goes with it, by trigger) and a changed ``sessions.indexed`` are
  seen by temporary triggers on the writer connection (:func:`install_triggers`), and an
  ``UPDATE turn_vec`` elsewhere calls :func:`changed`: the user (or everyone) is dropped and
  loaded again, in the background, by the next search, which meanwhile uses vec0.

Code that changes ``turn_vec`` some other way must call :func:`changed` (and log the change
for other processes: :mod:`proxy.store.changes`, whose rows are applied the same way through
:meth:`VectorCache.append_stored`). Appending a vector the user's rows hold already for that
turn is a no-op; a different one drops the user (a replaced vector).

A user is loaded (one read, about 0.1-0.2 s per 10,000 vectors) on a reader thread in the
background; inserts that commit meanwhile are applied once it is in. Users beyond ``max_bytes``
in all are dropped, least recently searched first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from proxy.store.caches.knn import knn
from proxy.store.caches.scope import Codes, claim_load
from proxy.store.sqlite.db import Connection
from proxy.vectors import Vector, as_vector

MAX_BYTES = 256 * 1024 * 1024
"""Memory the cache may hold (a user of 10,000 MiniLM vectors takes about 17 MB, of 100,000
about 175 MB)."""

T = TypeVar("T")
ALL = "\0all"  # a change whose user is unknown: everyone is dropped

_journal = threading.local()


def inserted(turn_id: int, user_id: str, session_id: str, indexed: bool, vec: Vector) -> None:
    """A vector row was inserted (writer thread; applied once the transaction commits)."""
    changes: _Changes | None = getattr(_journal, "changes", None)
    if changes is not None:
        changes.rows.append((turn_id, user_id, session_id, indexed, vec))


def changed(user_id: str | None = None) -> None:
    """Some of ``user_id``'s vector rows (None: anyone's) changed or went (writer thread)."""
    changes: _Changes | None = getattr(_journal, "changes", None)
    if changes is not None:
        changes.users.add(ALL if user_id is None else user_id)


def install_triggers(conn: Connection) -> None:
    """Temporary triggers (this connection only) that report deletes and ``indexed`` flips."""
    conn.create_function("engram_vectors_changed", 1, lambda user: changed(str(user)))
    conn.executescript(
        """
        CREATE TEMP TRIGGER IF NOT EXISTS engram_vec_cache_delete AFTER DELETE ON main.turns
        BEGIN SELECT engram_vectors_changed(old.user_id); END;
        CREATE TEMP TRIGGER IF NOT EXISTS engram_vec_cache_indexed
        AFTER UPDATE OF indexed ON main.sessions WHEN old.indexed IS NOT new.indexed
        BEGIN SELECT engram_vectors_changed(new.user_id); END;
        """
    )


@dataclass
class _Changes:
    rows: list[tuple[int, str, str, bool, Vector]] = field(default_factory=list)
    users: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class _Rows:
    """One user's rows: arrays of capacity >= n, of which the first n are live. Appends fill
    rows past n and publish a new ``_Rows``; a reader holding an old one reads its n rows."""

    n: int
    ids: npt.NDArray[np.int64]
    matrix: npt.NDArray[np.float32]
    norms: npt.NDArray[np.float32]
    session: npt.NDArray[np.int32]
    indexed: npt.NDArray[np.bool_]
    role: npt.NDArray[np.int32]
    sessions: Codes
    roles: Codes
    held: dict[int, int]  # turn id -> row

    @property
    def nbytes(self) -> int:
        return int(self.matrix.nbytes + self.ids.nbytes + 12 * len(self.ids))


def _capacity(rows: int) -> int:
    """Rows allocated for ``rows``: room to append an eighth more before the arrays are copied
    again (half more held a 100k user in 233 MB instead of 175)."""
    return max(1024, rows + rows // 8)


def _rows_of(
    items: Sequence[tuple[int, str, str, bool, Vector]],
    base: _Rows | None,
    dim: int,
) -> _Rows:
    """``base`` with ``items`` (turn id, role, session, indexed, vector) appended."""
    n0 = base.n if base is not None else 0
    need = n0 + len(items)
    if base is not None and need <= len(base.ids):
        r = base
    else:
        cap = _capacity(need)
        r = _Rows(
            n0,
            np.zeros(cap, np.int64),
            np.zeros((cap, dim), np.float32),
            np.zeros(cap, np.float32),
            np.zeros(cap, np.int32),
            np.zeros(cap, np.bool_),
            np.zeros(cap, np.int32),
            base.sessions if base is not None else Codes(),
            base.roles if base is not None else Codes(),
            base.held if base is not None else {},
        )
        if base is not None:
            for name in ("ids", "matrix", "norms", "session", "indexed", "role"):
                getattr(r, name)[:n0] = getattr(base, name)[:n0]
    for i, (turn_id, role, session_id, indexed, vec) in enumerate(items, n0):
        v = as_vector(vec)
        r.ids[i] = turn_id
        r.matrix[i] = v
        r.norms[i] = np.sqrt(np.dot(v, v))
        r.session[i] = r.sessions.code(session_id)
        r.indexed[i] = indexed
        r.role[i] = r.roles.code(role)
        r.held[turn_id] = i
    return _Rows(
        need, r.ids, r.matrix, r.norms, r.session, r.indexed, r.role, r.sessions, r.roles, r.held
    )


class VectorCache:
    """Per-user vector rows in memory (see the module docstring). Thread-safe."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._users: OrderedDict[str, _Rows] = OrderedDict()
        self._loading: dict[str, list[tuple[int, str, str, bool, Vector]]] = {}
        self._scheduled: set[str] = set()
        self._lock = threading.Lock()
        self.loads = 0

    # -- writer thread --------------------------------------------------------------------
    def run_write(self, conn: Connection, fn: Callable[[Connection], T], transaction: bool) -> T:
        """``fn(conn)`` inside one ``BEGIN IMMEDIATE`` transaction (``transaction=False``:
        outside any); then what it did to vectors is applied here."""
        self.begin()
        ok = False
        try:
            if transaction:
                conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(conn)
            except BaseException:
                if transaction:
                    conn.execute("ROLLBACK")
                raise
            if transaction:
                conn.execute("COMMIT")
            ok = True
            return result
        finally:
            self.commit(conn, ok)

    def begin(self) -> None:
        _journal.changes = _Changes()

    def commit(self, conn: Connection, ok: bool) -> None:
        """Apply what the transaction just ended did (``ok``: it committed)."""
        changes: _Changes | None = getattr(_journal, "changes", None)
        _journal.changes = None
        if changes is None or not (changes.rows or changes.users):
            return
        if not ok:  # rolled back: nothing changed, but be safe
            changes.users.update(r[1] for r in changes.rows)
            changes.rows = []
        with self._lock:
            users = set(self._users) | set(self._loading)
        if ALL in changes.users:
            self.clear()
            return
        for user in changes.users:
            self.drop(user)
        self._append(conn, [r for r in changes.rows if r[1] in users and r[1] not in changes.users])

    def append_stored(self, conn: Connection, turns: Sequence[tuple[int, str]]) -> None:
        """Add the vectors stored for (turn id, user) to the users held or loading, read from
        ``turn_vec`` (a reader, for another process's writes: :mod:`proxy.store.changes`)."""
        with self._lock:
            users = set(self._users) | set(self._loading)
        rows: list[tuple[int, str, str, bool, Vector]] = []
        for turn_id, user in turns:
            if user not in users:
                continue
            row = conn.execute(
                "SELECT user_id, session_id, indexed, embedding FROM turn_vec WHERE turn_id = ?",
                (turn_id,),
            ).fetchone()
            if row is not None and row[0] == user:  # gone meanwhile: its deletion drops
                rows.append((turn_id, user, str(row[1]), bool(row[2]), _vector(row[3])))
        self._append(conn, rows)

    def _append(self, conn: Connection, rows: Sequence[tuple[int, str, str, bool, Vector]]) -> None:
        if not rows:
            return
        roles = _roles(conn, [r[0] for r in rows])
        by_user: dict[str, list[tuple[int, str, str, bool, Vector]]] = {}
        for turn_id, user, session_id, indexed, vec in rows:
            by_user.setdefault(user, []).append(
                (turn_id, roles.get(turn_id, ""), session_id, indexed, vec)
            )
        for user, items in by_user.items():
            with self._lock:
                if user in self._loading:
                    self._loading[user].extend(items)
                    continue
                base = self._users.get(user)
                if base is None:
                    continue
                fresh = _not_held(items, base)
                if fresh is None:  # a replaced vector
                    del self._users[user]
                    continue
                if fresh:
                    self._users[user] = _rows_of(fresh, base, base.matrix.shape[1])

    # -- readers --------------------------------------------------------------------------
    def get(self, user_id: str) -> _Rows | None:
        with self._lock:
            rows = self._users.get(user_id)
            if rows is not None:
                self._users.move_to_end(user_id)
            return rows

    def wants_load(self, user_id: str) -> bool:
        """True (and the user marked as scheduled) when ``user_id`` should be loaded."""
        return claim_load(self._lock, self._users, self._scheduled, user_id)

    def load(self, conn: Connection, user_id: str) -> None:
        """Read the user's rows (a reader thread, after :meth:`wants_load` said so). Inserts
        that commit while it reads are applied after; if one of them replaced a vector the
        read may already hold, the load is thrown away (the next search tries again)."""
        with self._lock:
            self._loading[user_id] = []
        built: _Rows | None = None
        try:
            rows = conn.execute(
                "SELECT v.turn_id, t.role, v.session_id, v.indexed, v.embedding"
                " FROM turn_vec v JOIN turns t ON t.id = v.turn_id WHERE v.user_id = ?",
                (user_id,),
            ).fetchall()
            items = [(int(r[0]), str(r[1]), str(r[2]), bool(r[3]), _vector(r[4])) for r in rows]
            if items:
                built = _rows_of(items, None, len(items[0][4]))
        finally:
            with self._lock:
                self._scheduled.discard(user_id)
                pending = self._loading.pop(user_id, None)
                fresh = (
                    _not_held(pending, built) if built is not None and pending is not None else None
                )
                if built is not None and fresh is not None:
                    if fresh:
                        built = _rows_of(fresh, built, built.matrix.shape[1])
                    self._users[user_id] = built
                    self.loads += 1
                    self._evict()

    def search(
        self,
        user_id: str,
        vec: Vector,
        limit: int,
        in_background: Callable[[Callable[[Connection], object]], None],
        expected_rows: int = 0,
        **filters: Any,
    ) -> list[tuple[int, float]] | None:
        """:func:`knn` over the user's rows; None when they are not held (a load is then
        started with ``in_background``, unless ``expected_rows`` rows of ``vec``'s size would
        not fit in ``max_bytes``; the caller asks vec0)."""
        rows = self.get(user_id)
        if rows is not None:
            return knn(rows, vec, limit, **filters)
        if self.fits(expected_rows, len(as_vector(vec))) and self.wants_load(user_id):
            in_background(lambda conn: self.load(conn, user_id))
        return None

    def preload(
        self,
        user_id: str,
        rows: int,
        dim: int,
        in_background: Callable[[Callable[[Connection], object]], None],
    ) -> None:
        """Load a user of ``rows`` vectors of ``dim`` floats with ``in_background`` if they fit
        and are not held."""
        if self.fits(rows, dim) and self.wants_load(user_id):
            in_background(lambda conn: self.load(conn, user_id))

    def fits(self, rows: int, dim: int) -> bool:
        """Whether a user of ``rows`` vectors of ``dim`` floats, loaded, stays within
        ``max_bytes`` (counted as :attr:`_Rows.nbytes` counts a fresh load)."""
        cap = _capacity(rows)
        return cap * (4 * dim + 8 + 12) <= self.max_bytes

    def vectors(self, user_id: str, ids: Sequence[int]) -> dict[int, Vector] | None:
        """The stored vectors of those of ``ids`` that have one (as
        :func:`proxy.store.indexing.turn_vectors` reads them); None when the user's rows are
        not held."""
        rows = self.get(user_id)
        if rows is None:
            return None
        out: dict[int, Vector] = {}
        for turn_id in ids:
            i = rows.held.get(turn_id)
            if i is not None and i < rows.n:
                out[turn_id] = rows.matrix[i]
        return out

    # -- both -----------------------------------------------------------------------------
    def drop(self, user_id: str) -> None:
        with self._lock:
            self._users.pop(user_id, None)
            self._loading.pop(user_id, None)  # the load in flight is thrown away

    def clear(self) -> None:
        with self._lock:
            self._users.clear()
            self._loading.clear()

    def _evict(self) -> None:
        total = sum(r.nbytes for r in self._users.values())
        while total > self.max_bytes and self._users:
            _, gone = self._users.popitem(last=False)
            total -= gone.nbytes


def _vector(blob: bytes) -> Vector:
    return np.frombuffer(blob, "<f4")


def _not_held(
    items: Sequence[tuple[int, str, str, bool, Vector]], rows: _Rows
) -> list[tuple[int, str, str, bool, Vector]] | None:
    """Those of ``items`` whose turn ``rows`` does not hold; None when one it holds has another
    vector (replaced: the rows are stale). One it holds with the same vector is skipped: a
    load that read it already, or another process's log naming what this one applied."""
    fresh = []
    for item in items:
        i = rows.held.get(item[0])
        if i is None:
            fresh.append(item)
        elif not np.array_equal(rows.matrix[i], as_vector(item[4])):
            return None
    return fresh


def _roles(conn: Connection, ids: Sequence[int]) -> dict[int, str]:
    out: dict[int, str] = {}
    for turn_id in ids:
        row = conn.execute("SELECT role FROM turns WHERE id = ?", (turn_id,)).fetchone()
        if row is not None:
            out[turn_id] = str(row[0])
    return out
