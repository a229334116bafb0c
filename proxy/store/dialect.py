"""What differs between the two backends' SQL, for the statements that cannot be the same.

The store's functions take a connection: a SQLite one (:mod:`proxy.store.sqlite.db`) or a
:class:`~proxy.store.postgres.connection.PgConnection`. Most SQL is written once, portable (``?``
placeholders, ``ON CONFLICT``, ``RETURNING``, ``IS [NOT] DISTINCT FROM``); where it cannot be,
the function asks :func:`is_pg` or takes a fragment from here.

A list travels as one JSON-array parameter (:func:`proxy.store.rows.json_list`): unpacked by
``json_each`` on SQLite and ``json_array_elements_text`` on PostgreSQL, cast to ``bigint`` for
ids (PostgreSQL compares no text with a number).
"""

from __future__ import annotations

from typing import Any


def is_pg(conn: Any) -> bool:
    """Whether ``conn`` is a PostgreSQL connection."""
    return getattr(conn, "dialect", "sqlite") == "postgres"


def ids_in(conn: Any) -> str:
    """A subquery of the integers in one JSON-array parameter: ``id IN {ids_in(conn)}``."""
    if is_pg(conn):
        return "(SELECT value::bigint FROM json_array_elements_text(?::json))"
    return "(SELECT value FROM json_each(?))"


def texts_in(conn: Any) -> str:
    """A subquery of the strings in one JSON-array parameter."""
    if is_pg(conn):
        return "(SELECT value FROM json_array_elements_text(?::json))"
    return "(SELECT value FROM json_each(?))"


def greatest(conn: Any) -> str:
    """The name of the two-argument maximum: SQLite's scalar ``max``, PostgreSQL's ``greatest``."""
    return "greatest" if is_pg(conn) else "max"


def least(conn: Any) -> str:
    """The two-argument minimum's name (see :func:`greatest`)."""
    return "least" if is_pg(conn) else "min"


def no_limit(conn: Any) -> int | None:
    """The ``LIMIT ?`` parameter that means no limit: -1 on SQLite, NULL on PostgreSQL."""
    return None if is_pg(conn) else -1


def instr(conn: Any) -> str:
    """The name of ``instr(haystack, needle)`` (1-based position, 0 if absent): SQLite's
    ``instr``, PostgreSQL's ``strpos``."""
    return "strpos" if is_pg(conn) else "instr"


def binary_order(conn: Any) -> str:
    """What follows a text column in an ``ORDER BY`` to sort it by code point, as SQLite's
    default ``BINARY`` collation does: ``COLLATE "C"`` on PostgreSQL (whose database may have
    a language's collation), nothing on SQLite."""
    return ' COLLATE "C"' if is_pg(conn) else ""


def char(conn: Any, code: int) -> str:
    """The one-character string of ``code``: SQLite's ``char(n)``, PostgreSQL's ``chr(n)``."""
    return f"chr({int(code)})" if is_pg(conn) else f"char({int(code)})"


def cross_join(conn: Any) -> str:
    """``CROSS JOIN`` on SQLite (an inner join whose order the planner keeps, ``ON`` allowed),
    ``JOIN`` on PostgreSQL (whose ``CROSS JOIN`` takes no ``ON``)."""
    return "JOIN" if is_pg(conn) else "CROSS JOIN"
