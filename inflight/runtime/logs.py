"""Process logging for ``inflight serve`` and the processes it starts (engine core, tensor-parallel
workers): one JSON object (or one text line) per record on stderr.

Owns the log line format (``ts``, ``level``, ``logger``, ``message``). The per-request line
of ``generation`` carries its fields as a JSON message, which is merged into the line so a
log pipeline gets flat fields; a record may also bring them as ``extra={"fields": {...}}``
beside a readable message (the access log does). Owns the access log's settings and its line
(:func:`access_record`): method, path without the query, status, latency, the request id when
there is one; never a body or a header's value besides that id. Start-up errors printed before
logging is set up take the same format (:func:`startup_error_line`). Every server process writes
each thread's Python stack to stderr on ``SIGUSR1`` (:func:`dump_stacks_on_signal`): ``kill -USR1
PID`` shows where a stuck process waits, and it goes on. Knows nothing about the
server itself: it sits beside the engine, not in ``server/``, because the engine core and the
tensor-parallel workers set up their logging with it too (and must not import the server).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, field

ACCESS_LOGGER = "inflight.access"
# ``kill -USR1 PID``: every thread's Python stack to stderr (None where there is no SIGUSR1: Windows)
STACKS_SIGNAL: signal.Signals | None = getattr(signal, "SIGUSR1", None)
MAX_LOGGED_PATH = 200
MAX_LOGGED_ID = 128


@dataclass(frozen=True, slots=True)
class AccessLog:
    """``enabled``: one line per HTTP request; ``exclude``: paths left out (e.g. probes)."""

    enabled: bool = True
    exclude: frozenset[str] = field(default_factory=frozenset)


def access_record(method: str, path: str, status: int, latency_ms: float,
                  request_id: str | None) -> tuple[str, dict[str, object]]:
    """(the readable message, the flat fields) of one access-log line."""
    fields: dict[str, object] = {"event": "http_request", "method": method, "path": path[:MAX_LOGGED_PATH],
                                 "status": status, "latency_ms": round(latency_ms, 1)}
    text = f"{method} {fields['path']} {status} {latency_ms:.1f} ms"
    if request_id:
        fields["request_id"] = request_id[:MAX_LOGGED_ID]
        text += f" request_id={fields['request_id']}"
    return text, fields


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
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            line.update(extra)
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


def startup_error_line(message: str, fmt: str, prog: str = "inflight serve") -> str:
    """A start-up error as the process prints it, before logging is set up (or instead of it):
    ``PROG: error: MESSAGE`` as text, or with ``fmt`` json the line the log would carry (level
    ERROR, logger ``inflight.cli``), so a log pipeline reading JSON sees it too."""
    if fmt != "json":
        return f"{prog}: error: {message}"
    record = logging.LogRecord("inflight.cli", logging.ERROR, __file__, 0, "%s", (message,), None)
    return JsonFormatter().format(record)


def configure_logging(level: str, fmt: str = "json") -> None:
    """Send every log record to stderr at ``level`` (e.g. "info"), as ``json`` or ``text`` lines."""
    if fmt not in ("json", "text"):
        raise ValueError(f"log format must be json or text (got {fmt!r}).")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def dump_stacks_on_signal() -> None:
    """Write every thread's Python stack to stderr when :data:`STACKS_SIGNAL` arrives, as plain
    text (not log lines); the process goes on. :mod:`faulthandler` does it in C, so it answers
    while Python is stuck (a thread blocked in a collective or a lock)."""
    if STACKS_SIGNAL is not None:
        faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)
