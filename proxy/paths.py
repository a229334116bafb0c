"""Where Engram keeps its files by default: the platform's user data and cache directories.

Memory is private: the data directory is created ``0700`` and the database ``0600``
(:mod:`proxy.store.files`, whatever the umask). Engram's own data directory found open to others
(made by an older Engram, or under a loose umask) is tightened to ``0700``. A folder the user
chose (``--db PATH``) is theirs: it is created ``0700`` when missing, but an existing one is
never changed, only warned about when others can write into it (they could swap the database
for their own); the files Engram creates in it are ``0600`` all the same.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path

from proxy.store.files import DIR_MODE, private_dir

log = logging.getLogger("engram.paths")


def data_dir() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "engram"
    if os.name == "nt":
        return Path(os.environ.get("APPDATA", Path.home())) / "engram"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "engram"


def default_db_path() -> Path:
    return data_dir() / "engram.db"


def db_path(configured: str) -> Path:
    """The database file: the configured path, else the default; its folder is created
    ``0700`` (see the module's docstring for existing folders)."""
    if configured:
        path = Path(configured).expanduser()
        private_dir(path.parent)
        warn_if_writable_by_others(path.parent)
        return path
    path = default_db_path()
    own_data_dir(path.parent)
    return path


def own_data_dir(folder: Path) -> None:
    """Create Engram's own data directory ``0700``, or make an existing one so."""
    private_dir(folder)
    try:
        st = folder.stat()
    except OSError:
        return
    owner = getattr(os, "getuid", None)
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077 and (owner is None or st.st_uid == owner()):
        os.chmod(folder, DIR_MODE)
        log.info("made Engram's data directory %s private (mode %o -> 700)", folder, mode)


def warn_if_writable_by_others(folder: Path) -> bool:
    """Log a warning (and answer True) when users other than its owner can write into
    ``folder``."""
    try:
        mode = stat.S_IMODE(folder.stat().st_mode)
    except OSError:
        return False
    if os.name == "nt" or not mode & 0o022:
        return False
    log.warning(
        "the database folder %s is writable by other users (mode %o): they could replace "
        "Engram's files. Engram leaves a folder you chose as it is; consider chmod 700 %s",
        folder,
        mode,
        folder,
    )
    return True


def store_target(backend: str, postgres_url: str, configured_path: str) -> str | Path:
    """Where the memory store is: the PostgreSQL URL with ``backend = "postgres"``, else the
    SQLite file (:func:`db_path`)."""
    if backend == "postgres":
        return postgres_url
    return db_path(configured_path)
