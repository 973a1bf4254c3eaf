"""logging.format=json: one JSON object per line with the request id set by a front end; text stays the default."""

from __future__ import annotations

import io
import json
import logging

from appliance.config.compose import load_runtime_config
from appliance.core.logs import REQUEST_ID, JsonFormatter, configure_logging


def test_json_lines_carry_time_level_logger_message_and_request_id():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("appliance.test_logs")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        log.warning("plain %d", 1)
        token = REQUEST_ID.set("req-42")
        log.info("inside a request")
        REQUEST_ID.reset(token)
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    first, second, third = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert set(first) == {"time", "level", "logger", "message"} and first["message"] == "plain 1"
    assert first["level"] == "WARNING" and first["logger"] == "appliance.test_logs" and first["time"].endswith("+00:00")
    assert second["request_id"] == "req-42"
    assert "request_id" not in third and "ValueError: boom" in third["exc_info"]


def test_configure_logging_sets_the_formatter_on_root_handlers():
    root = logging.getLogger()
    handler = logging.StreamHandler(io.StringIO())
    saved = root.handlers[:], root.level
    root.handlers[:] = [handler]
    try:
        configure_logging("text", "WARNING")
        assert not isinstance(handler.formatter, JsonFormatter) and root.level == logging.WARNING
        configure_logging("json", "INFO")
        assert isinstance(handler.formatter, JsonFormatter) and root.level == logging.INFO
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


def test_logging_defaults_and_bad_values():
    rc = load_runtime_config([])
    assert (rc.logging.format, rc.logging.level) == ("text", "INFO")
    try:
        load_runtime_config(["logging.format=xml"])
    except ValueError as exc:
        assert "logging.format = 'xml': must be one of ['text', 'json']" in str(exc)
    else:
        raise AssertionError("logging.format=xml was accepted")
