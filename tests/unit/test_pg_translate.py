"""SQLite's SQL as the PostgreSQL connection sends it: placeholders, JSON-array lists, IS."""

from __future__ import annotations

from proxy.store.postgres.connection import translate


def test_placeholders_become_psycopgs_outside_quotes_and_percent_is_doubled() -> None:
    assert translate("SELECT ? WHERE a = :name AND b = '?:x%' AND c::text = ?") == (
        "SELECT %s WHERE a = %(name)s AND b = '?:x%%' AND c::text = %s"
    )


def test_begin_immediate_is_begin() -> None:
    assert translate("BEGIN IMMEDIATE") == "BEGIN"


def test_a_json_array_list_is_read_as_the_columns_type() -> None:
    sql = translate(
        "SELECT 1 FROM t WHERE t.id IN (SELECT value FROM json_each(?))"
        " AND session_id NOT IN (SELECT value FROM json_each(?))"
    )
    assert sql == (
        "SELECT 1 FROM t WHERE t.id IN"
        " (SELECT value::bigint FROM json_array_elements_text(%s::json))"
        " AND session_id NOT IN (SELECT value FROM json_array_elements_text(%s::json))"
    )


def test_is_a_parameter_compares_nulls_as_sqlite_does() -> None:
    assert translate("WHERE a IS ? AND b IS NOT ? AND c IS NOT NULL") == (
        "WHERE a IS NOT DISTINCT FROM %s AND b IS DISTINCT FROM %s AND c IS NOT NULL"
    )


def test_a_postgres_url_is_shown_without_its_user_password_or_query() -> None:
    from proxy.store.backend import display

    assert display("postgresql://engram:s3cret@db.local:5432/mem?password=x") == (
        "postgresql://db.local:5432/mem"
    )
