"""Structured logs: one JSON object per line on stderr, with the current trace id when there is one."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def _trace_id() -> str:
    try:
        from opentelemetry import trace
    except ImportError:
        return ""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {"ts": round(time.time(), 3), "level": record.levelname.lower(), "service": self.service,
                                "logger": record.name, "msg": record.getMessage()}
        trace_id = _trace_id()
        if trace_id:
            line["trace_id"] = trace_id
        line.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class RateLimit(logging.Filter):
    """Passes at most `burst` records of one cause (logger, level, message template) per `window_s`; the first
    record of a cause after a window in which some were dropped says how many. A flood of one error (accept()
    failing 20,000 times a second) then costs a few lines, not hundreds of megabytes of log."""

    def __init__(self, burst: int = 50, window_s: float = 10.0) -> None:
        super().__init__()
        self.burst, self.window_s = burst, window_s
        self._causes: dict[tuple[str, int, str], list[float]] = {}  # cause -> [window start, passed, dropped]
        self._lock = threading.Lock()  # handlers filter before they take their own lock

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            return self._filter(record)

    def _filter(self, record: logging.LogRecord) -> bool:
        cause = (record.name, record.levelno, str(record.msg))
        entry = self._causes.get(cause)
        if entry is None or record.created - entry[0] >= self.window_s:
            dropped = int(entry[2]) if entry is not None else 0
            if len(self._causes) > 1024:  # causes are templates, few; a bound anyway
                self._causes.clear()
            self._causes[cause] = [record.created, 1, 0]
            if dropped:
                record.suppressed = dropped  # the JSON formatter writes extras
            return True
        if entry[1] < self.burst:
            entry[1] += 1
            return True
        entry[2] += 1
        return False


def configure(service: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    handler.addFilter(RateLimit())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
