"""`ascendserve --role all`: a whole cluster from one command, supervised."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.procs import ENGINE_ENV, ShmWatch, all_role_port

pytestmark = pytest.mark.integration


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(what)


def _up_events(log) -> str:
    return "\n".join(line for line in log.read_text().splitlines() if '"child is up"' in line)


def tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.memory_gib(2.0)  # tests/memory.py: `all` starts its engine without tests.procs
def test_all_mono_serves_restarts_a_crashed_engine_and_stops_clean(tmp_path):
    port = all_role_port()
    out = open(tmp_path / "all.out", "w")
    err = open(tmp_path / "all.err", "w")
    env = {**os.environ, **ENGINE_ENV}
    env.pop("VLLM_CPU_KVCACHE_SPACE")  # the demo sizes its own memory
    proc = subprocess.Popen([sys.executable, "-m", "ascendserve", "--role", "all", "--topology", "mono",
                             "--port", str(port), "--runtime-dir", str(tmp_path / "run"), "--log-format", "json"],
                            stdout=out, stderr=err, env=env, start_new_session=True)
    watch = ShmWatch(proc.pid, ("psm_",))  # what its processes map, the crashed engine's included
    url = f"http://127.0.0.1:{port}"
    try:
        def announced_or_exited() -> bool:
            assert proc.poll() is None, f"all exited with {proc.returncode}:\n{(tmp_path / 'all.err').read_text()[-3000:]}"
            return "ready at" in (tmp_path / "all.out").read_text()

        wait_for(announced_or_exited, 300, "cluster never announced itself")
        announced = (tmp_path / "all.out").read_text()
        assert url in announced and "curl -s" in announced
        model = str(tmp_path / "run" / "demo-model-text")
        body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
                "temperature": 0, "return_token_ids": True}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        first_ids = r.json()["choices"][0]["token_ids"]

        # the crash must come after the supervisor saw the engine up (its probe runs once a second;
        # the proxy can see the engine first): else it is a failed start, not a crash (seen in CI)
        wait_for(lambda: '"child": "pd"' in _up_events(tmp_path / "all.err"), 30, "the supervisor never saw pd up")
        engine = next(p for p in tree(proc.pid) if "--role" in p.cmdline() and "pd" in p.cmdline())
        engine_tree = [engine, *engine.children(recursive=True)]
        engine.kill()  # SIGKILL of the main process, as the OOM killer would; the supervisor cleans up the rest
        wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 503, 60, "crash not noticed")
        wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 300, "engine not restarted")
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engine_tree)
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == first_ids
        assert "child exited; restarting" in (tmp_path / "all.err").read_text()

        everything = tree(proc.pid)
        assert len(everything) >= 4  # metaserver, engine (+ vLLM core), proxy
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in everything), 30,
                 "children outlived --role all")
        # vLLM's shared-memory queues, the crashed engine's included, are unlinked.
        assert watch.stop(), "none of vLLM's shared-memory queues was seen: the check would prove nothing"
        wait_for(lambda: not watch.left(), 15, f"leaked: {watch.left()}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in tree(proc.pid):
            p.kill()
        out.close()
        err.close()


@pytest.mark.memory_gib(2.0)  # tests/memory.py: `all` starts its engine without tests.procs
def test_all_on_etcd_with_two_proxies_serves_the_same_tokens_through_both(tmp_path):
    """`all` with the registry on etcd and no endpoints: it starts the etcd it finds installed, the
    engine registers there, and both proxies route to it (no tuning flags: the demo's defaults)."""
    from tests.etcd_cluster import need_etcd

    need_etcd()
    port = all_role_port(proxies=2, etcd=True)
    err = open(tmp_path / "all.err", "w")
    env = {**os.environ, **ENGINE_ENV}
    env.pop("VLLM_CPU_KVCACHE_SPACE")  # the demo sizes its own memory
    proc = subprocess.Popen([sys.executable, "-m", "ascendserve", "--role", "all", "--topology", "mono",
                             "--registry-backend", "etcd", "--proxies", "2", "--port", str(port),
                             "--runtime-dir", str(tmp_path / "run"), "--log-format", "json"],
                            stdout=open(tmp_path / "all.out", "w"), stderr=err, env=env, start_new_session=True)
    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 2}"]
    try:
        def announced_or_exited() -> bool:
            assert proc.poll() is None, f"all exited with {proc.returncode}:\n{(tmp_path / 'all.err').read_text()[-3000:]}"
            return "ready at" in (tmp_path / "all.out").read_text()

        wait_for(announced_or_exited, 300, "cluster never announced itself")
        assert urls[1] in (tmp_path / "all.out").read_text()
        keys = httpx.post(f"http://127.0.0.1:{port + 20}/v3/kv/range", timeout=5, json={
            "key": "L2FzY2VuZHNlcnZlLw==", "range_end": "L2FzY2VuZHNlcnZlMA=="}).json()  # /ascendserve/ .. 0
        assert int(keys.get("count", 0)) >= 2, f"the engine and the metaserver are keys in etcd: {keys}"
        model = str(tmp_path / "run" / "demo-model-text")
        ids = []
        for url in urls:
            wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 60, f"{url} ready")
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": "Hello there", "max_tokens": 8, "temperature": 0,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            ids.append(r.json()["choices"][0]["token_ids"])
        assert ids[0] == ids[1] and len(ids[0]) == 8
        everything = tree(proc.pid)
        assert any(p.name() == "etcd" for p in everything), "the etcd `all` started is its child"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in everything), 30,
                 "children outlived --role all")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in tree(proc.pid):
            p.kill()
        err.close()
