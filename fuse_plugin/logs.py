"""One line per event, as text for people or JSON for log pipelines.

Call sites name an event and attach fields (``event(log, "registered", endpoint=...)``);
the formatter decides the shape, so the same call reads well in a terminal and parses
cleanly in Loki or Elasticsearch.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

LOGGER_NAME = "fuse_plugin"
FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")


def _timestamp(record: logging.LogRecord) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{stamp}.{int(record.msecs):03d}Z"


class _Formatter(logging.Formatter):
    def __init__(self, context: dict[str, Any]) -> None:
        super().__init__()
        self.context = context

    def fields(self, record: logging.LogRecord) -> dict[str, Any]:
        return {**getattr(record, "fields", {}), **self.context}


class TextFormatter(_Formatter):
    """``<time> <LEVEL> <event> key=value ...``: greppable and short."""

    def format(self, record: logging.LogRecord) -> str:
        fields = self.fields(record)
        parts = [_timestamp(record), record.levelname, record.getMessage()]
        parts += [f"{key}={_text_value(value)}" for key, value in fields.items()]
        return " ".join(parts)


class JsonFormatter(_Formatter):
    """One JSON object per line with ``ts``, ``level``, ``event`` and the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        fields = self.fields(record)
        line = {"ts": _timestamp(record), "level": record.levelname.lower(),
                "event": record.getMessage(), **fields}
        return json.dumps(line, default=str, separators=(",", ":"))


def _text_value(value: object) -> str:
    if isinstance(value, (list, tuple)):
        text = ",".join(str(item) for item in value)
    else:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
    # Quoted (JSON escapes) when it holds a space, a quote, an '=' or anything unprintable:
    # a newline in a device ID or a path must not start a forged log line.
    plain = text and text.isprintable() and not any(c in text for c in ' "=')
    return text if plain else json.dumps(text)


def setup(log_format: str = "text", level: str = "info", stream: TextIO | None = None,
          **context: Any) -> logging.Logger:
    """Configure logging (idempotent: a second call replaces the handler).

    The handler sits on the root logger so that the warnings of the libraries we use
    (watchdog, grpc's Python layer) come out in the same format as our events instead of
    as bare lines that would break a JSON log pipeline. ``context`` fields (e.g. the
    resource name) end every line, so a node running two plugins still has lines that
    say which one spoke.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "fuse_plugin", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.fuse_plugin = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter(context) if log_format == "json"
                         else TextFormatter(context))
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level < logging.WARNING:
        root.setLevel(logging.WARNING)
    logger = logging.getLogger(LOGGER_NAME)
    for old in list(logger.handlers):
        logger.removeHandler(old)
    logger.setLevel(level.upper())
    logger.propagate = True
    return logger


def get() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def event(logger: logging.Logger, name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one event; fields become ``key=value`` (text) or JSON members."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={"fields": fields})
