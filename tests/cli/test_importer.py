"""The import core and the JSON Lines format: parsing, batching, idempotence, fidelity."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from proxy.background.items import add_item
from proxy.cli.importer import import_records
from proxy.cli.progress import Progress
from proxy.jsonl import LineError, SessionRecord, TurnRecord, export_line, parse_line
from proxy.search.embedder import HashEmbedder
from proxy.store.store import Store
from proxy.vectors import Vector


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{", "not valid JSON"),
        ('"a string"', "expected a JSON object"),
        ('{"role": "user", "content": "x"}', "session is missing"),
        ('{"session": "s", "role": "user", "content": "  "}', "content is empty"),
        ('{"session": "s", "role": "user", "content": 5}', "content must be a string"),
        ('{"session": "has space", "role": "user", "content": "x"}', "session must be"),
        ('{"session": "s", "user": "", "role": "user", "content": "x"}', "user must be"),
        ('{"session": "s", "role": "user", "content": "x", "timestamp": "May 8"}', "ISO 8601"),
        ('{"session": "s", "role": "user", "content": "x", "timestamp": true}', "timestamp"),
        ('{"session": "s", "role": "user", "content": "x", "timestamp": -1}', "not a valid"),
        ('{"session": "s", "role": "user", "content": "\\ud800"}', "lone surrogate"),
        ('{"session": "s", "role": "user", "content": "x", "speaker": 3}', "speaker must"),
        ('{"type": "note", "session": "s"}', 'type must be "turn" or "session"'),
        ('{"type": "session", "session": "s", "indexed": "yes"}', "indexed must be"),
    ],
)
def test_parse_line_errors(text: str, reason: str) -> None:
    got = parse_line(7, text)
    assert isinstance(got, LineError) and got.line == 7 and reason in got.reason, got


def test_parse_line_records() -> None:
    got = parse_line(
        1, '{"session": "s", "role": "user", "content": "hi", "timestamp": "2023-05-08T13:56:00"}'
    )
    assert isinstance(got, TurnRecord) and got.user == "default"
    assert got.timestamp == 1683554160.0  # naive ISO times are UTC
    offset = parse_line(
        2,
        '{"session": "s", "role": "user", "content": "hi", '
        '"timestamp": "2023-05-08T15:56:00+02:00"}',
    )
    assert isinstance(offset, TurnRecord) and offset.timestamp == got.timestamp
    session = parse_line(3, '{"type": "session", "user": "u", "session": "c", "parent": "p"}')
    assert session == SessionRecord(3, "u", "c", "p", None, None)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_and_lines() -> None:
    tty = _Tty()
    bar = Progress(4, tty)
    bar.update(2, "2 turns")
    bar.close()
    assert "\r[" in tty.getvalue() and "2/4 (50%)  2 turns" in tty.getvalue()
    plain = io.StringIO()
    lines = Progress(4, plain, every_s=0.0)
    lines.update(4)
    lines.close()
    assert plain.getvalue() == "4/4 (100%)\n"


class _BrokenEmbedder(HashEmbedder):
    async def embed_passages(self, texts: Sequence[str]) -> list[Vector]:
        raise RuntimeError("model crashed")


def _turn(session: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"user": "u", "session": session, "role": "user", "content": content, **extra}


@pytest.mark.asyncio
async def test_embedding_failure_keeps_the_text(tmp_path: Path) -> None:
    async with Store(tmp_path / "e.db") as store:
        records = list(enumerate([_turn("s", "one"), _turn("s", "two")], 1))
        report = await import_records(store, _BrokenEmbedder(), records, 1)
        assert (report.imported, report.vectors, report.unembedded) == (2, 0, 2)
        assert (await store.stats()).vectors == 0


@pytest.mark.asyncio
async def test_sub_sessions_and_tool_calls_survive_export_and_import(tmp_path: Path) -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    records: list[dict[str, Any]] = [
        {"type": "session", "user": "u", "session": "parent"},
        {"type": "session", "user": "u", "session": "child", "parent": "parent", "indexed": False},
        _turn("parent", "plan the trip"),
        _turn("child", "", role="assistant", tool_calls=calls),
        _turn("child", "42 results", role="tool", tool_call_id="call_1", incomplete=True),
    ]
    async with Store(tmp_path / "a.db") as a, Store(tmp_path / "b.db") as b:
        first = await import_records(a, HashEmbedder(), list(enumerate(records, 1)), 2)
        assert (first.imported, first.sessions, first.errors) == (3, 2, [])
        lines = [export_line(item) async for item in a.export("u")]
        second = await import_records(b, HashEmbedder(), list(enumerate(lines, 1)), 2)
        assert (second.imported, second.errors) == (3, [])
        child = await b.get_session("child")
        assert child is not None and child.parent_id == "parent" and not child.indexed
        assert child.level == 1
        assert [export_line(item) async for item in b.export("u") if item["type"] == "turn"] == [
            x for x in lines if x["type"] == "turn"
        ]
        # Positions continue after what a session holds; known turns are skipped.
        more = [_turn("parent", "plan the trip"), _turn("parent", "and the hotel")]
        third = await import_records(b, None, list(enumerate(more, 1)), 10)
        assert (third.imported, third.duplicates) == (1, 1)
        assert [t.position for t in await b.session_turns("parent")] == [0, 1]


@pytest.mark.asyncio
async def test_memory_items_come_back_at_negative_positions(tmp_path: Path) -> None:
    async with Store(tmp_path / "a.db") as a, Store(tmp_path / "b.db") as b:
        await import_records(a, None, list(enumerate([_turn("s", "hello")], 1)), 10)
        await add_item(a, None, "s", "u", "fact", "fact", "Alice lives in Lyon.")
        await add_item(a, None, "s", "u", "summary", "summary", "They talked about Lyon.")
        lines = [export_line(item) async for item in a.export("u")]
        report = await import_records(b, None, list(enumerate(lines, 1)), 10)
        assert report.errors == [] and report.imported == 3
        got = {t.content: t.position for t in await b.session_turns("s", -100)}
        assert got["hello"] == 0
        assert sorted([got["Alice lives in Lyon."], got["They talked about Lyon."]]) == [-2, -1]
        # A later item in the imported session goes below them; a later message after "hello".
        await add_item(b, None, "s", "u", "fact", "fact", "Bob likes chess.")
        more = [_turn("s", "next message")]
        await import_records(b, None, list(enumerate(more, 1)), 10)
        got = {t.content: t.position for t in await b.session_turns("s", -100)}
        assert got["Bob likes chess."] == -3 and got["next message"] == 1
