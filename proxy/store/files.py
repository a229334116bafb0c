"""Private files: memory is written only where its owner alone can read it (POSIX modes).

A file is created ``0600`` by ``os.open`` with that mode, and set to it again right after (a
umask can only take permissions away, never add; the second step makes the result the same under
any umask). A folder Engram creates is ``0700`` the same way. SQLite gives the ``-wal`` and
``-shm`` files of a database the database file's own mode, so creating the database file first
covers them; ones left by an older Engram (created ``0644``) are tightened when the database is
opened. Folders that already exist are left alone here: :mod:`proxy.paths` decides about them.
Windows has no such modes; there the calls change nothing.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


def private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) if it is missing; the folders created here are
    ``0700`` whatever the umask. An existing folder is not changed."""
    missing = []
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing.append(folder)
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=DIR_MODE)
            os.chmod(folder, DIR_MODE)


def private_file(path: Path) -> None:
    """Make sure ``path`` exists as a file only its owner can read and write: create it empty
    ``0600`` (in a ``0700`` folder if the folder is missing), or take group and other
    permissions off an existing one we own (and off its SQLite side files)."""
    private_dir(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        for existing in (path, *(Path(f"{path}{suffix}") for suffix in SQLITE_SIDE_FILES)):
            tighten(existing)
        return
    try:
        _set_mode(fd, path)
    finally:
        os.close(fd)


def tighten(path: Path) -> None:
    """Take group and other permissions off ``path`` if it is a regular file we own (a file
    of another user, a device, a missing file: left as it is)."""
    try:
        st = os.stat(path)
    except OSError:
        return
    owner = getattr(os, "getuid", None)
    if not stat.S_ISREG(st.st_mode) or (owner is not None and st.st_uid != owner()):
        return
    if st.st_mode & 0o077:
        with contextlib.suppress(OSError):
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (a token file), ``0600`` from its first byte, replacing it
    atomically."""
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            _set_mode(fh.fileno(), tmp)
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _set_mode(fd: int, path: Path) -> None:
    if hasattr(os, "fchmod"):
        os.fchmod(fd, FILE_MODE)
    else:  # pragma: no cover - Windows
        os.chmod(path, FILE_MODE)
