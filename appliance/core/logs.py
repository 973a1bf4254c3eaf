"""Log format: human-readable by default, or `logging.format=json` for log collectors.

JSON mode writes one object per line: time (ISO 8601, UTC), level, logger, message, request_id where the
record was logged while serving a request, and exc_info when there is a traceback. Why a context variable
for the request id: a front end sets it once per request (each request runs in its own asyncio task, which
copies the context), so every record logged on that request's behalf carries the id without threading it
through each call. Standard library only, so every layer may import it.
"""

from __future__ import annotations

import contextvars
import json
import logging
from datetime import datetime, timezone

FORMATS = ("text", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        if request_id:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(fmt: str, level: str, console_level: str | None = None) -> None:
    """Set the root level and, for fmt "json", the JSON formatter on every root handler (Hydra's console and
    job-file handlers, or a stderr handler when nothing configured logging). console_level raises the console's
    threshold alone (a sweep's job: its log file keeps every record, the terminal only the sweep's lines)."""
    root = logging.getLogger()
    root.setLevel(level)
    if console_level is not None:
        for handler in root.handlers:
            if type(handler) is logging.StreamHandler:          # not the job's FileHandler (a subclass)
                handler.setLevel(console_level)
    if fmt != "json":
        return
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    for handler in root.handlers:
        handler.setFormatter(JsonFormatter())
