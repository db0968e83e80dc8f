"""The router's logs: one line per finished request, and the log format (plain text, or one
JSON object per line with `--json-output`, as TGI's `--json-output`)."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from datetime import UTC, datetime

REQUEST_LOGGER = "loom.requests"
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

request_log = logging.getLogger(REQUEST_LOGGER)


@dataclass(slots=True)
class RequestSummary:
    """What the log line of a finished request says. None: never happened (no token, never ran)."""

    request_id: int | None
    http_request_id: str | None  # the X-Request-Id of its HTTP request (the client's, or the router's)
    num_input_tokens: int
    num_generated_tokens: int
    queue_s: float | None
    ttft_s: float | None
    total_s: float
    finish_reason: str

    def fields(self) -> dict[str, object]:
        """The log line's fields, durations in milliseconds."""
        return {
            "request_id": self.request_id,
            "http_request_id": self.http_request_id,
            "num_input_tokens": self.num_input_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "finish_reason": self.finish_reason,
            "queue_ms": _ms(self.queue_s),
            "ttft_ms": _ms(self.ttft_s),
            "total_ms": _ms(self.total_s),
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def request_line(fields: dict[str, object]) -> str:
    return "request finished " + " ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items())


def log_request(summary: RequestSummary) -> None:
    if request_log.isEnabledFor(logging.INFO):
        fields = summary.fields()
        request_log.info(request_line(fields), extra={"fields": fields})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: timestamp, level, target, message, and a record's `fields`."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "timestamp": datetime.fromtimestamp(record.created, tz=UTC).isoformat(),
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line["fields"] = fields
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: str, json_output: bool, process: str | None = None) -> None:
    """A router process's root handler, once, at startup; `process` names a frontend in its lines."""
    handler = logging.StreamHandler(sys.stderr)
    plain = PLAIN_FORMAT if process is None else PLAIN_FORMAT.replace("%(name)s", f"[{process}] %(name)s")
    handler.setFormatter(JsonFormatter() if json_output else logging.Formatter(plain))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
