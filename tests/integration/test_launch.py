"""`ascendserve launch`: data-parallel ranks of one role behind the proxy.

Two local ranks of `pd` register with a metaserver; the proxy balances over
both and each gives the oracle's tokens. One rank is SIGKILLed: the launcher
reports it, restarts it, and it serves again; SIGTERM stops every rank.
"""

from __future__ import annotations

import re
import signal
import time

import httpx
import psutil
import pytest

from tests.procs import ENGINE_ARGS, PYTHON, Proc, completion_ids, control, free_port_run, wait_for

pytestmark = pytest.mark.integration
TOKEN = "launch-test-token"
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Hello, my name is"]
_SUCCESS = re.compile(r"^vllm:request_success_total\{[^}]*\}\s+([0-9.eE+-]+)", re.MULTILINE)


def _served(url: str) -> float:
    return sum(float(v) for v in _SUCCESS.findall(httpx.get(url + "/metrics", timeout=10).text))


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _active_pd(proxy: Proc) -> set[str]:
    listed = httpx.get(proxy.url + "/instances", timeout=5, headers={"authorization": f"Bearer {TOKEN}"}).json()
    return {i["url"] for i in listed["instances"] if i["role"] == "pd" and i["state"] == "active"}


def _rank_process(launcher: psutil.Process, port: int) -> psutil.Process:
    for p in launcher.children():
        if str(port) in p.cmdline():
            return p
    raise AssertionError(f"no rank process serves port {port}")


def test_launch_two_ranks_behind_the_proxy_restarts_a_killed_rank(text_model, text_oracle, tmp_path):
    meta = control("metaserver", tmp_path, "--cluster-token", TOKEN)
    proxy = control("proxy", tmp_path, "--metaserver-url", meta.url, "--cluster-token", TOKEN)
    port = free_port_run(2, (1000, 1001))
    ranks = [f"http://127.0.0.1:{port + i}" for i in range(2)]
    launcher = Proc("launch", [PYTHON, "-m", "ascendserve", "launch", "--role", "pd", "--model", str(text_model),
                               "--dp-size", "2", "--dp-size-local", "2", "--engine-port", str(port),
                               "--restart-backoff-max", "2", "--log-format", "json",
                               "--metaserver-url", meta.url, "--cluster-token", TOKEN, *ENGINE_ARGS],
                    port, tmp_path / "launch.log", ready_path="/health")
    meta.start().wait_ready()
    proxy.start().wait_ready()
    try:
        launcher.start()
        wait_for(lambda: all(_ready(u) for u in ranks), 300, "ranks not ready")
        wait_for(lambda: _active_pd(proxy) == set(ranks), 30, "the proxy did not learn both ranks")
        log = launcher.log_text()
        assert "independent instances (dense model)" in log  # vLLM refuses --data-parallel-* for dense models
        binds = sorted(re.findall(r"VLLM_CPU_OMP_THREADS_BIND=(\S+)", " ".join(
            " ".join(f"{k}={v}" for k, v in p.environ().items() if k == "VLLM_CPU_OMP_THREADS_BIND")
            for p in psutil.Process(launcher.popen.pid).children())))
        assert len(binds) == 2 and binds[0] != binds[1], binds  # each rank has its own cores

        expected = {p: completion_ids(text_oracle.url, str(text_model), p) for p in PROMPTS}
        for _ in range(2):
            for prompt, ids in expected.items():
                assert completion_ids(proxy.url, str(text_model), prompt) == ids
        assert all(_served(u) >= 1 for u in ranks), [_served(u) for u in ranks]  # both ranks served

        victim = _rank_process(psutil.Process(launcher.popen.pid), port + 1)
        victim_tree = [victim, *victim.children(recursive=True)]
        victim.kill()
        wait_for(lambda: "child exited; restarting" in launcher.log_text(), 30, "the dead rank was not reported")
        assert re.search(r'"child": "pd-dp1".*"exit_code": -9|"exit_code": -9.*"child": "pd-dp1"',
                         launcher.log_text())
        wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in victim_tree), 30,
                 "the killed rank's engine processes outlived it")
        wait_for(lambda: _ready(ranks[1]), 300, "the killed rank was not restarted")
        before = _served(ranks[1])
        deadline = time.monotonic() + 60
        while _served(ranks[1]) == before and time.monotonic() < deadline:  # the proxy routes to it again
            assert completion_ids(proxy.url, str(text_model), PROMPTS[0]) == expected[PROMPTS[0]]
        assert _served(ranks[1]) > before

        everything = psutil.Process(launcher.popen.pid).children(recursive=True)
        launcher.popen.send_signal(signal.SIGTERM)
        assert launcher.popen.wait(90) == 0
        wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in everything), 30,
                 "ranks outlived the launcher")
    finally:
        launcher.stop(timeout=10)
        proxy.stop()
        meta.stop()


def test_launch_refuses_ranks_that_do_not_fit(tmp_path):
    import subprocess

    r = subprocess.run([PYTHON, "-m", "ascendserve", "launch", "--role", "pd", "--model", str(tmp_path),
                        "--dp-size", "2", "--dp-size-local", "2", "--dp-rank-start", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "do not fit in --dp-size 2" in r.stderr
