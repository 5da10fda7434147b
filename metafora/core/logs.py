"""Logging set-up for the CLI and daemons: plain or JSON lines with stable extra fields.

Library code only logs (``logging.getLogger(__name__)``); programs call :func:`configure`.
Records carry stable ``extra`` keys where they apply: ``node``, ``task``, ``token``, ``action``.

Masking happens here, at the edge where a record becomes text: :class:`MaskingFilter` (which
:func:`configure` puts on its handler; add it to a handler of your own) masks the message,
and both formatters mask what they write, tracebacks included -- so a handler's error that
names ``postgresql://app:SECRET@db`` is logged as ``postgresql://app:***@db`` whichever
module logged it.

Escaping happens there too: every record is one line. The plain format writes the message
and the traceback with control, format and bidi characters -- the newline included -- as
escapes (:func:`~metafora.core.masking.escape_line`), as the JSON format does by being JSON; a
handler's error cannot clear the terminal, write a link or forge a line of its own.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import TextIO

from metafora.core.masking import cut_text, escape_line, scrub

__all__ = ["EXTRA_FIELDS", "MAX_LOG_TEXT", "JsonFormatter", "MaskingFilter", "PlainFormatter",
           "configure"]

MAX_LOG_TEXT = 4096
"""The most of a record's message, and of its traceback, one log line carries (UTF-8 bytes,
then ``… cut, N bytes``): a handler's 1 MiB error made an 82 KB line. The store keeps the
error (cut at :data:`~metafora.contracts.coordinator.MAX_ERROR_BYTES`); the log says what happened."""


def _cut(text: str) -> str:
    # Before escaping (bounds the work) and after it (an escape is up to ten characters).
    return cut_text(text, MAX_LOG_TEXT)

EXTRA_FIELDS = ("node", "task", "token", "action")
LEVELS = ("debug", "info", "warning", "error", "critical")


class MaskingFilter(logging.Filter):
    """Masks every URL's credentials in a record's message (the record is kept, never dropped)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Replace the record's message by its masked text (its args merged in first)."""
        message = record.getMessage()
        masked = scrub(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the extra fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": scrub(_cut(record.getMessage())),
        }
        for key in EXTRA_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = scrub(_cut(self.formatException(record.exc_info)))
        return json.dumps(out, default=str)


class PlainFormatter(logging.Formatter):
    """``time level logger [node task] message`` for people, one line per record: the
    message and the traceback (after `` | ``) masked and escaped."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s%(ctx)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        """The record as one escaped, masked line."""
        parts = [f"{k}={getattr(record, k)}" for k in ("node", "task") if getattr(record, k, None)]
        record.ctx = escape_line(f" [{' '.join(parts)}]") if parts else ""
        # Escaped first, then masked (as metafora.core.masking.for_terminal): an escape joins what a
        # control character split, so a secret cut by one is masked whole.
        record.message = scrub(_cut(escape_line(_cut(record.getMessage()))))
        record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        if record.exc_info:
            line += " | " + scrub(_cut(escape_line(_cut(self.formatException(record.exc_info)))))
        elif record.exc_text:
            line += " | " + scrub(_cut(escape_line(_cut(record.exc_text))))
        if record.stack_info:
            line += " | " + scrub(_cut(escape_line(_cut(self.formatStack(record.stack_info)))))
        return line


def configure(level: str = "info", *, json_lines: bool = False, stream: TextIO | None = None) -> None:
    """Send metafora's logs (and the root logger's) to ``stream`` (stderr) at ``level``."""
    name = level.lower()
    if name not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else PlainFormatter())
    handler.addFilter(MaskingFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(name.upper())
