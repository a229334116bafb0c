"""Structured logging: one line per event, as `key=value` text or JSON. Never bodies or keys."""

from __future__ import annotations

import json
import logging
import logging.handlers
import queue
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
        exc = record.exc_text or (self.formatException(record.exc_info) if record.exc_info else "")
        if self.as_json:
            out: dict[str, Any] = {
                "ts": ts,
                "level": record.levelname.lower(),
                "logger": record.name,
                "msg": record.getMessage(),
                **fields,
            }
            if exc:
                out["exc"] = exc
            return json.dumps(out, default=str)
        parts = [ts, record.levelname.lower(), record.name, record.getMessage()]
        parts += [f"{k}={_text(v)}" for k, v in fields.items()]
        line = " ".join(parts)
        if exc:
            line += "\n" + exc
        return line


def _text(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (not text or " " in text or '"' in text) else text


class _DeferredQueueHandler(logging.handlers.QueueHandler):
    """Hands records to the writer thread unformatted: no formatting or write on the loop."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        return record


def setup(level: str = "info", fmt: str = "text") -> logging.handlers.QueueListener:
    """Configure the 'engram' logger: records go through a queue to a writer thread, so the
    event loop never blocks on stderr. Returns the listener; stop it at exit to flush."""
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(_Formatter(fmt == "json"))
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = logging.handlers.QueueListener(records, stream)
    listener.start()
    root = logging.getLogger("engram")
    root.handlers[:] = [_DeferredQueueHandler(records)]
    root.setLevel(level.upper())
    root.propagate = False
    return listener


def event(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Log ``msg`` with structured fields."""
    if logger.isEnabledFor(level):
        logger.log(level, msg, extra={"fields": fields})
