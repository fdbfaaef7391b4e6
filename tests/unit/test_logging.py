"""Every line is one structured event with role, instance_id and request_id."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r'''
import logging, structlog, warnings
from ascendserve.logging import configure, get_logger
configure("decode", "decode-7", "info", "json")
with structlog.contextvars.bound_contextvars(request_id="req-42"):
    get_logger().info("ours", n=1)
    logging.getLogger("vllm.v1.engine").info("vllm says %s", "hi")
    logging.getLogger("uvicorn.error").info("uvicorn line")
get_logger().info("outside")
logging.getLogger("vllm.x").debug("hidden at info")
warnings.warn("a python warning")
'''


def test_json_lines_carry_role_instance_and_request_id():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    lines = [json.loads(line) for line in r.stderr.splitlines() if line.strip()]
    events = {e["event"]: e for e in lines}
    assert set(events) >= {"ours", "vllm says hi", "uvicorn line", "outside"}
    assert "hidden at info" not in events
    for name in ("ours", "vllm says hi", "uvicorn line", "outside"):
        assert events[name]["role"] == "decode" and events[name]["instance_id"] == "decode-7"
        assert events[name]["level"] == "info" and "timestamp" in events[name]
    for name in ("ours", "vllm says hi", "uvicorn line"):
        assert events[name]["request_id"] == "req-42"
    assert "request_id" not in events["outside"]
    assert events["vllm says hi"]["logger"] == "vllm.v1.engine"
    assert any("a python warning" in e["event"] for e in lines)


def test_console_format_is_not_json():
    script = SCRIPT.replace('"json")', '"console")')
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "ours" in r.stderr and "role=decode" in r.stderr
    assert not r.stderr.lstrip().startswith("{")
