"""Process logging for ``inflight serve``: one JSON object (or one text line) per record on stderr.

Owns the log line format (``ts``, ``level``, ``logger``, ``message``). The per-request line
of ``generation`` carries its fields as a JSON message, which is merged into the line so a
log pipeline gets flat fields. Knows nothing about the server itself.
"""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    """Format a record as one JSON object; a message that is a JSON object is merged in."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        line: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
        }
        fields = _as_object(message)
        if fields is None:
            line["message"] = message
        else:
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def _as_object(message: str) -> dict[str, object] | None:
    if not message.startswith("{"):
        return None
    try:
        value = json.loads(message)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str, fmt: str = "json") -> None:
    """Send every log record to stderr at ``level`` (e.g. "info"), as ``json`` or ``text`` lines."""
    if fmt not in ("json", "text"):
        raise ValueError(f"log format must be json or text (got {fmt!r}).")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
