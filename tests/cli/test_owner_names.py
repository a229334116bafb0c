"""The command line with sessions keyed by owner: two users' sessions of one name are imported,
exported and forgotten each as its owner's, never one for the other."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from proxy.cli.main import main

LINES = [
    '{"user": "bob", "session": "shared", "role": "user", "content": "bob owns the name first"}',
    '{"user": "alice", "session": "shared", "role": "user", "content": "alice uses it too"}',
    '{"type": "session", "user": "alice", "session": "child", "parent": "shared"}',
    '{"user": "alice", "session": "child", "role": "user", "content": "a sub-agent of hers"}',
]


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in list(os.environ):
        if name.startswith("ENGRAM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ENGRAM_EMBEDDER_MODEL", "hash")
    path = tmp_path / "engram.db"
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    assert main(["import", str(src), "--db", str(path)]) == 0
    return path


def test_import_gives_each_user_its_own_session_of_a_name(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sessions", "--db", str(db), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["sessions"]
    got = {(r["user"], r["id"], r["parent"], r["turns"]) for r in rows}
    assert got == {
        ("bob", "shared", None, 1),
        ("alice", "shared", None, 1),
        ("alice", "child", "shared", 1),
    }


def test_export_writes_names_and_imports_back(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", "--db", str(db), "--user", "alice"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert {(x["type"], x["session"]) for x in lines} == {
        ("session", "shared"),
        ("session", "child"),
        ("turn", "shared"),
        ("turn", "child"),
    }
    assert next(x["parent"] for x in lines if x["session"] == "child") == "shared"
    dump = tmp_path / "alice.jsonl"
    dump.write_text("\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    copy = tmp_path / "copy.db"
    assert main(["import", str(dump), "--db", str(copy)]) == 0
    capsys.readouterr()
    assert main(["export", "--db", str(copy), "--user", "alice"]) == 0
    again = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    strip = ("created_at", "last_seen")
    assert [{k: v for k, v in x.items() if k not in strip} for x in again] == [
        {k: v for k, v in x.items() if k not in strip} for x in lines
    ]


def test_forget_needs_the_user_when_two_have_the_name(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(["forget", "shared", "--db", str(db)]) == 1
    assert "users alice, bob each have a session 'shared'" in capsys.readouterr().err
    assert main(["forget", "shared", "--user", "alice", "--db", str(db)]) == 0
    assert "deleted session 'shared' of user 'alice' (1 turns)" in capsys.readouterr().out
    assert main(["sessions", "--db", str(db), "--json", "--user", "alice"]) == 0
    assert json.loads(capsys.readouterr().out)["sessions"] == []  # her sub-agent went with it
    assert main(["forget", "shared", "--db", str(db)]) == 0  # only bob's is left
    assert "deleted session 'shared' of user 'bob' (1 turns)" in capsys.readouterr().out
