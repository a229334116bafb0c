"""The SQL that keeps ``turns_fts`` in step with ``turns``: each turn's indexed body, date words
and ``ctx`` (its neighbours' bodies), the triggers (insert, update, delete) and the statements the
indexer runs for turns archived with ``fts_pending`` (:func:`fts_reindex_sql`). SQL text only."""

from __future__ import annotations

CTX_TURNS = 2
"""``turns_fts.ctx`` holds this many turns before and this many after a turn (same session)."""
CTX_CHARS = 1000
"""Each neighbour contributes at most this many characters of its body to ``ctx``."""

# Names for the date column, each padded to 9 characters so SQL can cut one out with substr().
_WEEKDAYS = "Sunday   Monday   Tuesday  WednesdayThursday Friday   Saturday "
_MONTHS = (
    "January  February March    April    May      June     "
    "July     August   SeptemberOctober  November December "
)


def body_sql(t: str) -> str:
    """SQL for the text a turn is indexed (and embedded) as, from the row alias ``t``."""
    return f"coalesce(nullif({t}.speaker, ''), {t}.role) || ': ' || {t}.content"


def date_sql(t: str) -> str:
    """SQL for ``t.timestamp`` (Unix seconds) as UTC words: ``Monday 8 May 2023``.

    SQLite's strftime has no month or day names: pick them out of fixed-width strings.
    """
    ts = f"{t}.timestamp, 'unixepoch'"
    return (
        f"rtrim(substr('{_WEEKDAYS}', 9 * CAST(strftime('%w', {ts}) AS INTEGER) + 1, 9))"
        f" || ' ' || CAST(strftime('%d', {ts}) AS INTEGER)"
        f" || ' ' || rtrim(substr('{_MONTHS}', 9 * CAST(strftime('%m', {ts}) AS INTEGER) - 8, 9))"
        f" || ' ' || strftime('%Y', {ts})"
    )


def _neighbours_sql(session: str, position: str) -> str:
    """SQL selecting the ids of the ``CTX_TURNS`` non-system turns on each side of a position."""
    side = (
        "SELECT * FROM (SELECT n.id FROM turns n WHERE n.session_id = {s} AND n.position {op} {p}"
        " AND n.role != 'system' AND n.position >= 0 ORDER BY n.position {order} LIMIT {k})"
    )
    return (
        side.format(s=session, p=position, op="<", order="DESC", k=CTX_TURNS)
        + " UNION ALL "
        + side.format(s=session, p=position, op=">", order="ASC", k=CTX_TURNS)
    )


def _ctx_sql(t: str) -> str:
    """SQL for the ``ctx`` column of the turn ``t``: its neighbours' bodies, newline-joined."""
    return (
        f"CASE WHEN {t}.role = 'system' OR {t}.position < 0 THEN '' ELSE coalesce(("
        f"SELECT group_concat("
        f"substr({body_sql('c')}, 1, {CTX_CHARS}), char(10)) FROM turns c WHERE c.id IN ("
        f"{_neighbours_sql(f'{t}.session_id', f'{t}.position')})), '') END"
    )


def _fts_insert_sql(ids: str) -> str:
    """SQL (re)indexing the turns whose ids ``ids`` (a subquery) selects."""
    return (
        "INSERT INTO turns_fts(rowid, body, ctx, date)"
        f" SELECT x.id, {body_sql('x')}, {_ctx_sql('x')}, {date_sql('x')}"
        f" FROM turns x WHERE x.id IN ({ids});"
    )


def fts_insert_trigger_sql(when: str | None = None) -> str:
    """The trigger indexing an inserted turn (and re-indexing its neighbours), if ``when``."""
    new_nb = _neighbours_sql("new.session_id", "new.position")
    condition = f" WHEN {when}" if when else ""
    return f"""
        CREATE TRIGGER turns_ai AFTER INSERT ON turns{condition} BEGIN
            DELETE FROM turns_fts WHERE rowid IN ({new_nb});
            {_fts_insert_sql(f"SELECT new.id UNION ALL {new_nb}")}
        END;
        """


def fts_reindex_sql() -> tuple[str, str]:
    """Two statements (parameter: a turn id) that index a turn archived with ``fts_pending``
    as the insert trigger would have: delete it and its neighbours from ``turns_fts``, insert
    back those of them not pending (the turn itself is no longer, by then)."""
    session = "(SELECT session_id FROM turns WHERE id = :id)"
    position = "(SELECT position FROM turns WHERE id = :id)"
    changed = f"SELECT :id UNION ALL {_neighbours_sql(session, position)}"
    pending = f"SELECT id FROM turns WHERE id IN ({changed}) AND fts_pending = 0"
    return f"DELETE FROM turns_fts WHERE rowid IN ({changed})", _fts_insert_sql(pending)


def fts_triggers_sql() -> str:
    """The triggers that keep ``turns_fts`` (and ``turn_vec`` on delete) in step with ``turns``.

    A turn entering or leaving a session changes the ``ctx`` of its neighbours: they are deleted
    from the index and inserted again (a contentless-delete table cannot update one column).
    Deletes by cascade from a deleted session skip that: every turn of it goes.
    """
    new_nb = _neighbours_sql("new.session_id", "new.position")
    old_nb = _neighbours_sql("old.session_id", "old.position")
    changed = f"SELECT new.id UNION {old_nb} UNION {new_nb}"
    old_live = (
        f"SELECT * FROM ({old_nb}) WHERE EXISTS (SELECT 1 FROM sessions WHERE id = old.session_id)"
    )
    return f"""
        {fts_insert_trigger_sql()}

        CREATE TRIGGER turns_au
        AFTER UPDATE OF session_id, position, role, speaker, content, timestamp ON turns BEGIN
            DELETE FROM turns_fts WHERE rowid = old.id OR rowid IN ({changed});
            {_fts_insert_sql(changed)}
        END;

        CREATE TRIGGER turns_ad AFTER DELETE ON turns BEGIN
            DELETE FROM turns_fts WHERE rowid = old.id;
            DELETE FROM turns_fts WHERE rowid IN ({old_live});
            {_fts_insert_sql(old_live)}
            DELETE FROM turn_vec WHERE turn_id = old.id;
        END;
        """
