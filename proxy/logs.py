"""Structured logging: one line per event, as `key=value` text or JSON. Never bodies or keys.

Every record passes :class:`RedactSecrets` on the writer thread before it is written: its message
(arguments filled in), its fields and its traceback are redacted (:func:`proxy.redact.redact`),
whatever ``memory.redact_secrets`` says, so a logged upstream error or URL never prints a key."""

from __future__ import annotations

import json
import logging
import logging.handlers
import queue
import sys
import time
from typing import Any

from proxy.redact import redact


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


class RedactSecrets(logging.Filter):
    """Redacts a record's message, fields and traceback in place (always passes it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "engram_redacted", False):
            return True
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: let the handler report it as logging does
            return True
        record.msg, record.args = redact(message), None
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            record.fields = {k: _redacted(v) for k, v in fields.items()}
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        record.engram_redacted = True
        return True


def _redacted(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    return redact(str(value))


class QuietOutages(logging.Filter):
    """Leaves out a failure's record when its exception says ``quiet`` (or was raised from one
    that does): the memory database being down (:class:`proxy.store.gate.StoreUnavailable`),
    which its gate logs once, not once per request and background tick."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        seen = 0
        while exc is not None and seen < 8:
            if getattr(exc, "quiet", False):
                return False
            exc, seen = exc.__cause__ or exc.__context__, seen + 1
        return True


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
    stream.addFilter(RedactSecrets())  # on the writer thread: off the event loop
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = logging.handlers.QueueListener(records, stream)
    listener.start()
    root = logging.getLogger("engram")
    handler = _DeferredQueueHandler(records)
    handler.addFilter(QuietOutages())
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    return listener


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record comes (tests swap it)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def setup_cli() -> None:
    """For the commands other than ``serve``: warnings and errors of the 'engram' loggers go to
    stderr as bare messages (as Python's last-resort handler would print them), redacted."""
    root = logging.getLogger("engram")
    if any(isinstance(f, RedactSecrets) for h in root.handlers for f in h.filters):
        return
    stream = _Stderr()
    stream.setLevel(logging.WARNING)
    stream.setFormatter(logging.Formatter("%(message)s"))
    stream.addFilter(RedactSecrets())
    root.addHandler(stream)


def event(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Log ``msg`` with structured fields."""
    if logger.isEnabledFor(level):
        logger.log(level, msg, extra={"fields": fields})
