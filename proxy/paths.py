"""Where Engram keeps its files by default: the platform's user data and cache directories."""

from __future__ import annotations

import os
import sys
from pathlib import Path


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
    """The database file: the configured path, else the default; its folder is created."""
    path = Path(configured).expanduser() if configured else default_db_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
