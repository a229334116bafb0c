"""Memory's files are private (issue 12, row 10): the database and its -wal/-shm 0600 in a 0700
folder under any umask, old 0644 files tightened, Engram's own data directory made 0700, a folder
the user chose left as it is (with a warning when others can write into it), token files 0600."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.paths import db_path
from proxy.store.store import Store

pytestmark = pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def modes(folder: Path) -> dict[str, int]:
    return {p.name: mode(p) for p in folder.iterdir()}


def loosen(folder: Path) -> None:
    """What an older Engram left: every file 0644, a -wal too."""
    for p in folder.iterdir():
        p.chmod(0o644)
    (folder / "engram.db-wal").touch(mode=0o644)


@pytest.fixture(params=[0o022, 0o000, 0o002], ids=["umask022", "umask000", "umask002"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """Each test under a usual, an empty and a group-writable umask."""
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


@pytest.mark.asyncio
async def test_the_database_and_its_wal_and_shm_are_0600_in_a_0700_folder(
    tmp_path: Path, umask: int
) -> None:
    path = tmp_path / "new" / "deeper" / "engram.db"
    before = mode(tmp_path)
    async with Store(path) as store:
        await store.stats()
        files = modes(path.parent)
        assert set(files) >= {"engram.db", "engram.db-wal", "engram.db-shm"}
        assert set(files.values()) == {0o600}, files
    assert mode(path.parent) == 0o700 and mode(path.parent.parent) == 0o700
    assert mode(tmp_path) == before  # an existing folder: as it was


@pytest.mark.asyncio
async def test_files_an_older_engram_left_open_are_tightened(tmp_path: Path) -> None:
    path = tmp_path / "engram.db"
    async with Store(path) as store:
        await store.stats()
    loosen(tmp_path)
    async with Store(path) as store:
        await store.stats()
        assert modes(tmp_path) == {
            name: 0o600 for name in ("engram.db", "engram.db-wal", "engram.db-shm")
        }


def test_engrams_own_data_directory_is_made_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, umask: int
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr("sys.platform", "linux")
    path = db_path("")
    assert path == tmp_path / "xdg" / "engram" / "engram.db"
    assert mode(path.parent) == 0o700
    path.parent.chmod(0o755)  # made by an older Engram
    db_path("")
    assert mode(path.parent) == 0o700


def test_a_folder_the_user_chose_is_left_as_it_is_with_a_warning(tmp_path: Path) -> None:
    from proxy.paths import warn_if_writable_by_others

    chosen = tmp_path / "shared"
    chosen.mkdir()
    chosen.chmod(0o777)
    assert db_path(str(chosen / "engram.db")) == chosen / "engram.db"
    assert mode(chosen) == 0o777
    assert warn_if_writable_by_others(chosen)
    chosen.chmod(0o755)
    assert not warn_if_writable_by_others(chosen)  # readable by others: the files are 0600
    missing = tmp_path / "mine" / "engram.db"
    db_path(str(missing))
    assert mode(missing.parent) == 0o700


def test_private_file_and_token_file_modes(tmp_path: Path, umask: int) -> None:
    from proxy.store.files import private_file, write_private

    path = tmp_path / "f" / "x.db"
    private_file(path)
    assert path.exists() and mode(path) == 0o600 and mode(path.parent) == 0o700
    token = tmp_path / "tokens" / "admin_token"
    write_private(token, "abc\n")
    write_private(token, "def\n")  # replaced atomically, still private
    assert token.read_text() == "def\n" and mode(token) == 0o600
    assert mode(token.parent) == 0o700
    assert [p.name for p in token.parent.iterdir()] == ["admin_token"]
