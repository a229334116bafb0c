"""The memory commands of `engram`: import, search, sessions, forget, export, stats, doctor."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy.cli.main import main
from testing.fake_upstream import FakeUpstream

LINES = [
    '{"user": "alice", "session": "a1", "role": "user", "speaker": "Alice", '
    '"content": "I adopted a cat named Miso", "timestamp": 1700000000}',
    '{"user": "alice", "session": "a1", "role": "assistant", "content": "What a lovely cat", '
    '"timestamp": "2023-11-14T22:14:00Z"}',
    "this is not json",
    '{"user": "alice", "session": "a1", "role": "robot", "content": "beep"}',
    "",
    '{"user": "bob", "session": "b1", "role": "user", "content": "My city is Lisbon"}',
    '{"user": "bob", "session": "b1", "role": "user", "content": "ok"}',
    '{"user": "bob", "session": "b1", "role": "user", "content": "ok"}',
    # A parent is a name of the same user: alice's a1 is not bob's.
    '{"type": "session", "user": "bob", "session": "b2", "parent": "a1"}',
]


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A database path; the hash embedder; no stray settings from the environment."""
    for name in list(os.environ):
        if name.startswith("ENGRAM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ENGRAM_EMBEDDER_MODEL", "hash")
    return tmp_path / "engram.db"


def engram(db: Path, *args: str) -> int:
    return main([args[0], "--db", str(db), *args[1:]])


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def stats(db: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert engram(db, "stats", "--json") == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


def test_import_reports_bad_lines_and_keeps_good_ones_once(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write(tmp_path / "in.jsonl", LINES)
    assert engram(env, "import", str(src), "--batch", "2") == 0
    out = capsys.readouterr()
    assert f"{src}:3: not valid JSON" in out.err
    assert f"{src}:4: role must be one of" in out.err
    assert f"{src}:9: parent session 'a1' does not exist" in out.err
    assert "imported 5 turns (5 with vectors) from 8 lines; 2 new sessions" in out.out
    assert "3 bad lines" in out.out
    data = stats(env, capsys)
    assert data["turns"] == 5 and data["vectors"] == 5
    assert data["per_user"] == {
        "alice": {"sessions": 1, "turns": 2},
        "bob": {"sessions": 1, "turns": 3},
    }
    # Importing the same file again stores nothing twice (the two "ok" turns included).
    assert engram(env, "import", str(src)) == 0
    assert "imported 0 turns" in capsys.readouterr().out
    assert stats(env, capsys)["turns"] == 5


def test_import_all_bad_exits_1(
    env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b'[1, 2]\n{"session": "s", "role": "user"}\n\xff\xfe\n')
    assert engram(env, "import", str(src)) == 1
    err = capsys.readouterr().err
    assert f"{src}:1: expected a JSON object, got list" in err
    assert f"{src}:2: content must be a string" in err
    assert f"{src}:3: not valid UTF-8" in err
    assert engram(env, "import", str(tmp_path / "missing.jsonl")) == 1


def test_import_in_a_subprocess_prints_progress_lines(env: Path, tmp_path: Path) -> None:
    src = write(tmp_path / "in.jsonl", ["\ufeff" + LINES[0], *LINES[1:2]])
    run = subprocess.run(
        [sys.executable, "-m", "proxy", "import", str(src), "--db", str(env)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "imported 2 turns" in run.stdout and "bad lines" in run.stdout


@pytest.fixture
def loaded(env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    assert engram(env, "import", str(write(tmp_path / "in.jsonl", LINES))) == 0
    capsys.readouterr()
    return env


def test_search(loaded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert engram(loaded, "search", "cat Miso", "--user", "alice") == 0
    out = capsys.readouterr().out
    assert "Alice: I adopted a cat named Miso" in out and "Lisbon" not in out
    assert engram(loaded, "search", "cat", "--user", "alice", "--json", "--mode", "fts") == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert results and all(r["ranks"]["vec"] is None for r in results)
    assert results[0]["timestamp"] == 1700000000.0
    assert engram(loaded, "search", "cat", "--user", "bob", "--session", "a1") == 1
    assert "No session 'a1'" in capsys.readouterr().err
    assert engram(loaded, "search", "cat", "-k", "0") == 2
    assert "k must be from 1 to 100" in capsys.readouterr().err
    assert engram(loaded, "search", 'NEAR("*', "--user", "alice") == 0


def test_sessions(loaded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert engram(loaded, "sessions") == 0
    out = capsys.readouterr().out
    assert "alice" in out and "bob" in out
    assert engram(loaded, "sessions", "--user", "bob", "--json") == 0
    rows = json.loads(capsys.readouterr().out)["sessions"]
    assert [(r["id"], r["user"], r["turns"]) for r in rows] == [("b1", "bob", 3)]


def test_forget(loaded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert engram(loaded, "forget", "a1", "--user", "bob") == 1  # not bob's
    assert engram(loaded, "forget", "a1") == 0
    assert "deleted session 'a1' of user 'alice' (2 turns)" in capsys.readouterr().out
    assert engram(loaded, "forget", "a1") == 1
    assert engram(loaded, "forget", "--user", "bob", "--all") == 2  # needs --yes
    assert "3 turns" in capsys.readouterr().err
    assert stats(loaded, capsys)["turns"] == 3
    assert engram(loaded, "forget", "--user", "bob", "--all", "--yes") == 0
    assert stats(loaded, capsys)["turns"] == 0
    assert engram(loaded, "forget") == 2


def test_export_round_trips_through_import(
    loaded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dump = tmp_path / "dump.jsonl"
    assert engram(loaded, "export", "-o", str(dump)) == 0
    assert "exported 2 sessions, 5 turns" in capsys.readouterr().err
    copy = tmp_path / "copy.db"
    assert engram(copy, "import", str(dump)) == 0
    capsys.readouterr()
    assert engram(copy, "export", "--user", "bob") == 0
    again = capsys.readouterr().out.splitlines()
    original = [x for x in dump.read_text().splitlines() if '"user": "bob"' in x]
    strip = {"created_at", "last_seen"}

    def clean(lines: list[str]) -> list[dict[str, Any]]:
        return [{k: v for k, v in json.loads(x).items() if k not in strip} for x in lines]

    assert clean(again) == clean(original) and len(again) == 4


def test_missing_database(env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert engram(env, "sessions") == 1
    assert "no memory database" in capsys.readouterr().err
    assert not env.exists()


@pytest.mark.asyncio
async def test_doctor(env: Path, fake: FakeUpstream, capsys: pytest.CaptureFixture[str]) -> None:
    code = await asyncio.to_thread(engram, env, "doctor", "--upstream", fake.url)
    out = capsys.readouterr().out
    assert code == 0, out
    for name in ("sqlite", "fts5", "sqlite-vec", "database", "model", "upstream"):
        assert any(line.startswith("ok") and f" {name} " in line for line in out.splitlines())
    assert "skip redis" in " ".join(out.split())
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    code = await asyncio.to_thread(engram, env, "doctor", "--upstream", dead)
    out = capsys.readouterr().out
    assert code == 1 and "FAIL upstream" in " ".join(out.split())
