"""One front door: an engine bound off loopback serves its client API to the cluster only.

A network namespace of the test's own (`unshare -n`), with 10.231.0.1 on its loopback device
as a non-loopback address, holds everything: a pd engine bound to 10.231.0.1 with a cluster
token, a proxy on 127.0.0.1 that has the same token, and the checks. The engine refuses its
client API (/v1/..., /tokenize) to a caller without the token (401, OpenAI-style body) and
keeps its probes open; the token gets through directly, and the proxy, which sends it with
every request (health checks, routing, generation), serves the same greedy tokens. This module
runs itself inside the namespace (`python -m tests.integration.test_front_door`) and prints
what it saw as JSON; the test asserts on that. The namespace goes with its processes.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import PYTHON, REPO, ascendserve, control, wait_for

pytestmark = pytest.mark.integration
ADDRESS = "10.231.0.1"  # in the namespace only
SETUP = f"ip link set lo up && ip addr add {ADDRESS}/32 dev lo"
PROMPT = "The quick brown fox"


def _namespace_refusal() -> str | None:
    """Why `unshare -n` with an address of our own cannot run here, or None."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        return "unshare or ip is not installed"
    try:
        r = subprocess.run(["unshare", "-n", "sh", "-c", SETUP], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare -n failed: {exc!r}"
    return None if r.returncode == 0 else f"unshare -n is not permitted here: {r.stderr.strip()[:300]}"


def test_an_engine_off_loopback_serves_its_client_api_only_through_the_proxy(text_model, tmp_path):
    refusal = _namespace_refusal()
    if refusal:
        pytest.skip(refusal)
    logs = tmp_path / "logs"
    logs.mkdir()
    command = f"{SETUP} && exec {PYTHON} -m tests.integration.test_front_door {text_model} {logs}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["unshare", "-n", "sh", "-c", command], capture_output=True, text=True, timeout=900,
                       cwd=REPO, env=env)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and lines, f"driver failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    seen = json.loads(lines[-1])
    direct = seen["direct"]
    for check in ("completions", "chat", "models", "tokenize", "wrong token", "api key as token"):
        status, body = direct[check]
        assert status == 401, (check, status, body)
        error = json.loads(body)["error"]
        assert error["type"] == "authentication_error" and error["code"] == "401", (check, body)
        assert "proxy" in error["message"] and seen["token"] not in body, (check, body)
    for probe in ("health", "metrics", "version"):
        assert direct[probe][0] == 200, (probe, direct[probe])
    assert direct["admin"][0] == 401  # as before: vLLM's admin routes want the token
    assert direct["tokenize with the token"][0] == 200
    assert seen["proxy_health"] == 200
    assert seen["through the proxy"]["status"] == 200, seen["through the proxy"]
    assert seen["through the proxy"]["completion_tokens"] == 8
    # the token opens the engine directly too, and the proxy's answer is the engine's
    assert seen["with the token"]["status"] == 200 and seen["with the token"]["ids"] == seen["through the proxy"]["ids"]
    engine_log = (logs / "pd-front-door.log").read_text(errors="replace")
    assert "cluster token or API key (bound off loopback)" in engine_log  # the start-up line says so
    assert engine_log.count('"authentication failed"') >= 5 and seen["token"] not in engine_log


# ---- the driver, run inside the namespace ---------------------------------------------------------


def _drive(model: Path, logs: Path) -> dict:
    import httpx

    token = secrets.token_urlsafe(24)
    engine = ascendserve("pd", model, logs, "--host", ADDRESS, "--log-format", "json", name="pd-front-door",
                         env={"ASCENDSERVE_CLUSTER_TOKEN": token})
    engine.host, engine.ready_path = ADDRESS, "/health"  # /v1/models wants the token now
    proxy = control("proxy", logs, "--pd", f"{ADDRESS}:{engine.port}")
    proxy.env = {"ASCENDSERVE_CLUSTER_TOKEN": token}
    seen: dict = {"token": token, "direct": {}}
    try:
        engine.start().wait_ready()
        proxy.start().wait_ready()
        with httpx.Client(timeout=120) as http:
            def health() -> int:
                return http.get(proxy.url + "/health").status_code

            try:
                wait_for(lambda: health() == 200, 60, "the proxy never found the engine healthy")
            finally:
                seen["proxy_health"] = health()
            model_name = str(model)
            completion = {"model": model_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                          "return_token_ids": True}

            def direct(check: str, method: str, path: str, headers: dict | None = None, body: dict | None = None):
                r = http.request(method, engine.url + path, headers=headers or {}, json=body)
                seen["direct"][check] = [r.status_code, r.text[:1000]]

            direct("completions", "POST", "/v1/completions", body=completion)
            direct("chat", "POST", "/v1/chat/completions",
                   body={"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            direct("models", "GET", "/v1/models")
            direct("tokenize", "POST", "/tokenize", body={"model": model_name, "prompt": PROMPT})
            direct("wrong token", "POST", "/v1/completions", {"x-cluster-token": "not-" + token}, completion)
            direct("api key as token", "POST", "/v1/completions", {"authorization": "Bearer some-client-key"},
                   completion)
            direct("admin", "POST", "/reset_prefix_cache")
            for probe in ("health", "metrics", "version"):
                direct(probe, "GET", "/" + probe)
            direct("tokenize with the token", "POST", "/tokenize", {"x-cluster-token": token},
                   {"model": model_name, "prompt": PROMPT})
            r = http.post(engine.url + "/v1/completions", headers={"authorization": f"Bearer {token}"},
                          json=completion)
            seen["with the token"] = {"status": r.status_code,
                                      "ids": r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text}
            r = http.post(proxy.url + "/v1/completions", json=completion)
            seen["through the proxy"] = {"status": r.status_code, "ids": None, "completion_tokens": None}
            if r.status_code == 200:
                seen["through the proxy"].update(ids=r.json()["choices"][0]["token_ids"],
                                                 completion_tokens=r.json()["usage"]["completion_tokens"])
            else:
                seen["through the proxy"]["body"] = r.text[:1000]
    finally:
        proxy.stop(timeout=10)
        engine.stop()
    return seen


if __name__ == "__main__":
    print(json.dumps(_drive(Path(sys.argv[1]), Path(sys.argv[2]))), flush=True)
