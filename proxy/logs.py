"""Structured logging: one line per event, as `key=value` text or JSON. Never bodies or keys."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any


class _Formatter(logging.Formatter):
    def __init__(self, as_json: bool) -> None:
        super().__init__()
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "fields", {}) or {}
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        ts += f".{int(record.msecs):03d}"
        if self.as_json:
            out: dict[str, Any] = {
                "ts": ts,
                "level": record.levelname.lower(),
                "logger": record.name,
                "msg": record.getMessage(),
                **fields,
            }
            if record.exc_info:
                out["exc"] = self.formatException(record.exc_info)
            return json.dumps(out, default=str)
        parts = [ts, record.levelname.lower(), record.name, record.getMessage()]
        parts += [f"{k}={_text(v)}" for k, v in fields.items()]
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _text(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (not text or " " in text or '"' in text) else text


def setup(level: str = "info", fmt: str = "text") -> None:
    """Configure the root 'engram' logger (idempotent)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(fmt == "json"))
    root = logging.getLogger("engram")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def event(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Log ``msg`` with structured fields."""
    if logger.isEnabledFor(level):
        logger.log(level, msg, extra={"fields": fields})
