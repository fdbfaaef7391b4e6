"""`ascendserve doctor`: devices, ports, peers and clock skew, on 127.0.0.1."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import version

import pytest

from tests.procs import PYTHON, free_port

pytestmark = pytest.mark.integration


def _peer(offset_s: float) -> ThreadingHTTPServer:
    """An HTTP peer whose clock runs `offset_s` ahead of ours."""

    class Handler(BaseHTTPRequestHandler):
        def date_time_string(self, timestamp=None):
            return formatdate(time.time() + offset_s, usegmt=True)

        def do_GET(self):
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def doctor(*args: str) -> tuple[int, dict[str, dict]]:
    r = subprocess.run([PYTHON, "-m", "ascendserve", "doctor", "--json", *args], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, {c["name"]: c for c in json.loads(r.stdout)}


def test_doctor_passes_on_a_ready_host_and_measures_a_peer_clock():
    peer = _peer(0.0)
    free = free_port()
    try:
        code, checks = doctor("--device", "cpu", "--ports", str(free), "--peers", f"127.0.0.1:{peer.server_port}")
    finally:
        peer.shutdown()
    assert code == 0, checks
    assert checks["engine"]["status"] == "ok"
    for dist in ("torch", "transformers"):  # the stack actually installed, as this interpreter sees it
        assert f"{dist} {version(dist)}" in checks["engine"]["detail"], checks["engine"]
    assert not any(name.startswith(("npu ", "cuda ", "nccl")) for name in checks)  # --device cpu: no link checks
    assert checks["cpu"]["status"] == "ok"
    assert checks[f"port {free}"]["status"] == "ok"
    assert checks[f"peer 127.0.0.1:{peer.server_port}"]["status"] == "ok"
    clock = checks[f"clock 127.0.0.1:{peer.server_port}"]
    assert clock["status"] == "ok" and "±" in clock["detail"]


def test_doctor_fails_on_a_busy_port_an_unreachable_peer_a_skewed_clock_and_a_missing_device():
    skewed = _peer(30.0)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        busy_port = busy.getsockname()[1]
        dead = free_port()
        try:
            code, checks = doctor("--device", "npu", "--ports", str(busy_port),
                                  "--peers", f"127.0.0.1:{dead},127.0.0.1:{skewed.server_port}")
        finally:
            skewed.shutdown()
    assert code == 1
    assert checks[f"port {busy_port}"]["status"] == "FAIL" and "in use" in checks[f"port {busy_port}"]["detail"]
    assert checks[f"peer 127.0.0.1:{dead}"]["status"] == "FAIL"
    clock = checks[f"clock 127.0.0.1:{skewed.server_port}"]
    assert clock["status"] == "FAIL", clock
    assert abs(float(re.search(r"= ([+-][0-9.]+) s", clock["detail"]).group(1)) - 30.0) < 1.0, clock
    assert checks["npu"]["status"] == "FAIL"  # no NPU here; nor may the probe have crashed on torch_npu
    assert checks["cann"]["status"] == "FAIL" and "no CANN toolkit" in checks["cann"]["detail"]
    # link checks that cannot run say why, and do not fail
    assert checks["npu links"]["status"] == "skip" and "no /dev/davinci" in checks["npu links"]["detail"]


def test_doctor_derives_the_ports_of_a_role_config(tmp_path, text_model):
    port = free_port()
    conf = tmp_path / "prefill.toml"
    conf.write_text(f'role = "prefill"\n[server]\nport = {port}\n[model]\npath = "{text_model}"\n'
                    '[engine]\ntensor_parallel_size = 2\n[kv]\nconnector = "pull"\n')
    code, checks = doctor("--config", str(conf))
    assert {f"port {port}", f"port {port + 1000}", f"port {port + 1001}"} <= set(checks), checks
    table = subprocess.run([PYTHON, "-m", "ascendserve", "doctor", "--config", str(conf)], capture_output=True,
                           text=True, timeout=180).stdout
    assert table.splitlines()[0].split() == ["CHECK", "STATUS", "DETAIL"]
