"""`ascendserve --role pd` as a subprocess, driven by the official openai client."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.procs import ascendserve

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pd(text_model, tmp_path_factory):
    # vLLM's own binding (the suite's engines run unbound, tests/procs.ENGINE_ENV): the forked
    # worker must bind as a spawned one does
    proc = ascendserve("pd", text_model, tmp_path_factory.mktemp("pd-logs"), "--log-format", "json",
                       env={"VLLM_CPU_OMP_THREADS_BIND": "auto"})
    proc.start().wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(pd):
    return openai.OpenAI(base_url=pd.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_model(client, text_model):
    assert [m.id for m in client.models.list().data] == [str(text_model)]


def test_streamed_chat_completion(client, text_model):
    stream = client.chat.completions.create(
        model=str(text_model),
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and next(iter(ids))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens > 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert content


def test_non_streamed_completion(client, text_model):
    r = client.completions.create(model=str(text_model), prompt="Once upon a time", max_tokens=10, temperature=0)
    assert r.id and r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens == len("Once upon a time")


def test_request_id_is_echoed_and_logged(pd, text_model):
    r = httpx.post(pd.url + "/v1/completions", headers={"x-request-id": "itest-req-1"}, timeout=60,
                   json={"model": str(text_model), "prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200 and r.headers["x-request-id"] == "itest-req-1"
    time.sleep(0.5)
    events = [json.loads(line) for line in pd.log_text().splitlines() if line.startswith("{")]
    canonical = [e for e in events if e.get("event") == "request" and e.get("request_id") == "itest-req-1"]
    assert len(canonical) == 1
    assert canonical[0]["status"] == 200 and canonical[0]["path"] == "/v1/completions"
    assert canonical[0]["role"] == "pd" and canonical[0]["instance_id"].startswith("pd-")
    # vLLM's own records come through the same renderer, engine core included.
    assert any(e.get("logger", "").startswith("vllm.") and e.get("process") == "EngineCore" for e in events)
    assert any(e.get("event") == "effective config" for e in events)


def _heap_start(p: psutil.Process) -> str:
    """Where p's heap begins: chosen at random at exec (ASLR), inherited unchanged by a fork."""
    with open(f"/proc/{p.pid}/maps") as f:
        return next(line.split("-", 1)[0] for line in f if line.rstrip().endswith("[heap]"))


def test_engine_core_and_worker_are_forked_and_bound(pd):
    """engine/patches/core_fork.py and worker_fork.py on this CPU host: neither the engine core
    nor its worker imports torch and vLLM again (each is a fork of its parent: same heap start),
    the role re-executed itself once with vLLM's preloaded libraries, which the worker has, and
    the worker's threads are bound to the core vLLM gave it, as a spawned worker's are."""
    with open("/proc/sys/kernel/randomize_va_space") as f:
        if f.read().strip() == "0":
            pytest.skip("address space randomization is off: a fork and an exec look alike")
    children = pd.descendants()
    cores = [p for p in children if "EngineCore" in p.name() + " ".join(p.cmdline())]
    workers = [p for p in children if "Worker" in p.name() + " ".join(p.cmdline())]
    assert len(cores) == 1 and len(workers) == 1, [(p.pid, p.name(), p.cmdline()) for p in children]
    assert cores[0].ppid() == pd.pid and workers[0].ppid() == cores[0].pid
    role = psutil.Process(pd.pid)
    assert _heap_start(cores[0]) == _heap_start(role), "the engine core was spawned, not forked"
    assert _heap_start(workers[0]) == _heap_start(cores[0]), "the worker was spawned, not forked"
    assert role.environ().get("ASCENDSERVE_PRELOADED") == "1"
    with open(f"/proc/{workers[0].pid}/maps") as f:
        mapped = f.read()
    for lib in role.environ()["LD_PRELOAD"].split(":"):
        assert os.path.realpath(lib) in mapped, lib
    bound = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir(f"/proc/{workers[0].pid}/task")}
    assert len(bound) == 1 and len(next(iter(bound))) == 1, bound  # one core (OMP_NUM_THREADS=1), all threads
    assert "workers spawned, not forked" not in pd.log_text()


def test_the_worker_runs_one_gloo_loop_not_one_per_group(pd):
    """engine/patches/gloo_device.py: vLLM makes 13 gloo groups in a worker; they share one
    gloo device, so one `gloo_tcp_loop` thread wakes 100 times a second instead of 13."""
    workers = [p for p in pd.descendants() if "Worker" in p.name() + " ".join(p.cmdline())]
    assert len(workers) == 1
    names = []
    for tid in os.listdir(f"/proc/{workers[0].pid}/task"):
        with open(f"/proc/{workers[0].pid}/task/{tid}/comm") as f:
            names.append(f.read().strip())
    assert names.count("gloo_tcp_loop") == 1, sorted(names)
    assert "one gloo device per process" in pd.log_text()  # among the fixes the role logged


def test_bad_request_is_a_4xx_with_openai_error(client, text_model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=str(text_model), prompt="x", max_tokens=-3)
    assert info.value.status_code == 400


def test_zz_sigterm_stops_engine_processes(pd):
    """Runs last in this module: it stops the shared instance, with a connection still open."""
    children = pd.descendants()
    assert any("EngineCore" in p.name() + " ".join(p.cmdline()) for p in children), children
    # vLLM's ZMQ sockets live in the instance's own directory, which the stop removes (vLLM left
    # a dozen socket files per engine in /tmp: those of the workers it force-kills)
    config = next(json.loads(line)["config"] for line in pd.log_text().splitlines()
                  if '"effective config"' in line)
    ipc = Path(config["runtime_dir"]).absolute() / f"ipc-{config['instance_id']}"
    assert any(e.is_socket() for e in ipc.iterdir()), list(ipc.iterdir())
    # a client that keeps a request half sent: uvicorn's graceful shutdown waited for it for ever
    held = socket.create_connection(("127.0.0.1", pd.port))
    held.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: 100\r\n\r\n{")
    try:
        pd.popen.send_signal(signal.SIGTERM)
        assert pd.popen.wait(timeout=60) == 0
    finally:
        held.close()
    deadline = time.monotonic() + 15
    alive = children
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    assert not ipc.exists(), sorted(e.name for e in ipc.iterdir())
