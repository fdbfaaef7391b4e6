"""The start-up fixes of engine/patches against the vLLM and torch installed here.

* core_fork: vLLM's engine-core manager gets a fork context where vLLM would spawn
  (on a CPU platform, when asked), and nothing else changes; the real module's
  manager is the one that asks for the context. That an engine role's engine core
  really is a fork and its workers spawned: tests/integration/test_pd_role.py.
* the forked child lets go of the parent's listening sockets.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import types
from pathlib import Path
from multiprocessing import resource_tracker

import psutil
import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from ascendserve.engine.host_defaults import process_env  # noqa: E402
from ascendserve.engine.patches import core_fork  # noqa: E402

FORK = {core_fork.ENV: "fork"}


def _module(method: str):
    calls = []

    def get_mp_context():
        calls.append(method)
        return multiprocessing.get_context(method)

    class CoreEngineProcManager:
        def __init__(self):
            self.context = module.get_mp_context()  # through the module, as vLLM's own does

    module = types.SimpleNamespace(__name__="fake.utils", get_mp_context=get_mp_context,
                                   CoreEngineProcManager=CoreEngineProcManager)
    return module, calls


def test_engine_cores_fork_where_vllm_would_spawn_on_a_cpu():
    module, calls = _module("spawn")
    assert core_fork.apply(module, FORK, is_cpu=True) == ["CoreEngineProcManager forks engine cores"]
    assert module.get_mp_context().get_start_method() == "fork"
    assert calls == ["spawn"]  # vLLM's own function still runs first (its checks, its warnings)
    # the resource tracker is this process's child, not the forked engine core's (vLLM kills that tree)
    tracker = resource_tracker._resource_tracker._pid
    assert tracker is not None and psutil.Process(tracker).ppid() == os.getpid()
    assert core_fork.apply(module, FORK, is_cpu=True) == []  # idempotent
    assert module.get_mp_context().get_start_method() == "fork"


def test_a_method_other_than_spawn_and_numa_binding_are_left_to_vllm(monkeypatch):
    module, _ = _module("forkserver")
    core_fork.apply(module, FORK, is_cpu=True)
    assert module.get_mp_context().get_start_method() == "forkserver"
    module, _ = _module("spawn")
    core_fork.apply(module, FORK, is_cpu=True)
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--numa-bind"])  # vLLM re-executes the process for it
    assert module.get_mp_context().get_start_method() == "spawn"


def test_unset_spawn_or_an_accelerator_leave_vllm_alone():
    for environ, is_cpu in (({}, True), ({core_fork.ENV: "spawn"}, True), (FORK, False)):
        module, _ = _module("spawn")
        original = module.get_mp_context
        assert core_fork.apply(module, environ, is_cpu=is_cpu) == []
        assert module.get_mp_context is original
    for bad in ("forks", "1", "thread"):
        with pytest.raises(ValueError, match=core_fork.ENV):
            core_fork.apply(_module("spawn")[0], {core_fork.ENV: bad}, is_cpu=True)


def test_a_manager_that_does_not_ask_get_mp_context_is_refused():
    module, _ = _module("spawn")

    class CoreEngineProcManager:
        def __init__(self):
            self.context = multiprocessing.get_context("spawn")

    module.CoreEngineProcManager = CoreEngineProcManager
    original = module.get_mp_context
    with pytest.raises(TypeError, match="get_mp_context"):
        core_fork.apply(module, FORK, is_cpu=True)
    assert module.get_mp_context is original


def test_the_installed_vllm_starts_engine_cores_through_the_patched_function(monkeypatch):
    from vllm.v1.engine import utils

    monkeypatch.setattr(utils, "get_mp_context", utils.get_mp_context)  # restored after the test
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # what vLLM's CPU platform sets
    assert core_fork.apply(utils, FORK, is_cpu=True) == ["CoreEngineProcManager forks engine cores"]
    assert utils.get_mp_context().get_start_method() == "fork"
    from vllm.v1.executor import multiproc_executor

    assert multiproc_executor.get_mp_context().get_start_method() == "spawn"  # workers: vLLM's method


def test_host_defaults_fork_engine_cores_on_cpu_hosts_only(monkeypatch):
    monkeypatch.delenv(core_fork.ENV, raising=False)
    assert process_env(cpu=True)[core_fork.ENV] == "fork"
    assert core_fork.ENV not in process_env(cpu=False)
    monkeypatch.setenv(core_fork.ENV, "spawn")  # the user's value stays
    assert core_fork.ENV not in process_env(cpu=True)


def _sockets_in_child(q, fd) -> None:
    import socket

    try:
        probe = socket.socket(fileno=os.dup(fd))
    except OSError:
        q.put(None)
        return
    try:
        q.put(probe.getsockname()[1] if probe.family == socket.AF_INET else None)
    finally:
        probe.close()


def test_a_forked_engine_core_lets_go_of_the_parents_sockets():
    """Else an engine core outliving a crashed API server would keep its HTTP port bound: vLLM binds
    it before it starts the engine core and listens once the engine is up."""
    import socket

    with socket.socket() as server, socket.socket() as control:
        server.bind(("127.0.0.1", 0))  # bound, not listening yet: as vLLM's when the engine core starts
        port = server.getsockname()[1]
        q = core_fork.FORK.Queue()
        child = core_fork.FORK.Process(target=_sockets_in_child, args=(q, server.fileno()))
        child.start()
        assert q.get(timeout=30) is None  # the fd number is /dev/null there
        child.join(30)
        assert child.exitcode == 0
        plain = multiprocessing.get_context("fork")  # what an unpatched fork keeps: the check can tell
        child = plain.Process(target=_sockets_in_child, args=(q, server.fileno()))
        child.start()
        assert q.get(timeout=30) == port
        child.join(30)
        server.listen()  # the parent's socket is whole
        control.connect(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()


# -- worker_fork: vLLM's workers forked from the engine core ---------------------------------

from ascendserve.engine.patches import worker_fork  # noqa: E402

WORKER_FORK = {worker_fork.ENV: "fork"}


def _executor_module(method: str):
    def get_mp_context():
        return multiprocessing.get_context(method)

    class WorkerProc:
        @staticmethod
        def make_worker_process():
            return module.get_mp_context()  # through the module, as vLLM's own does

    module = types.SimpleNamespace(__name__="fake.multiproc_executor", get_mp_context=get_mp_context,
                                   WorkerProc=WorkerProc)
    return module


def test_workers_fork_only_where_the_role_prepared_for_it(monkeypatch):
    module = _executor_module("spawn")
    assert worker_fork.apply(module, WORKER_FORK, is_cpu=True) == ["MultiprocExecutor forks workers"]
    assert worker_fork.apply(module, WORKER_FORK, is_cpu=True) == []  # idempotent
    # this pytest process held no OpenMP threads for it: vLLM's spawn stays, with the reason
    monkeypatch.delenv(worker_fork.THREADS_ENV, raising=False)
    assert worker_fork._why_not(os.environ) == ("the API server did not hold its OpenMP threads "
                                                "(not an ascendserve engine role)")
    assert module.WorkerProc.make_worker_process().get_start_method() == "spawn"
    for environ, is_cpu in (({}, True), ({worker_fork.ENV: "spawn"}, True), (WORKER_FORK, False)):
        module = _executor_module("spawn")
        original = module.get_mp_context
        assert worker_fork.apply(module, environ, is_cpu=is_cpu) == []
        assert module.get_mp_context is original
    with pytest.raises(ValueError, match=worker_fork.ENV):
        worker_fork.apply(_executor_module("spawn"), {worker_fork.ENV: "forks"}, is_cpu=True)


def test_an_executor_that_does_not_ask_get_mp_context_is_refused():
    module = _executor_module("spawn")
    module.WorkerProc = type("WorkerProc", (), {"make_worker_process": staticmethod(lambda: None)})
    with pytest.raises(TypeError, match="get_mp_context"):
        worker_fork.apply(module, WORKER_FORK, is_cpu=True)


def test_the_installed_vllm_starts_workers_through_the_patched_function(monkeypatch):
    from vllm.v1.executor import multiproc_executor

    monkeypatch.setattr(multiproc_executor, "get_mp_context", multiproc_executor.get_mp_context)
    assert worker_fork.apply(multiproc_executor, WORKER_FORK, is_cpu=True) == ["MultiprocExecutor forks workers"]
    assert getattr(multiproc_executor.get_mp_context, worker_fork.PATCHED)


def test_why_a_worker_is_spawned_after_all(monkeypatch):
    held = {worker_fork.THREADS_ENV: "2"}
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--numa-bind"])
    assert "numa-bind" in worker_fork._why_not(held)
    monkeypatch.setattr(sys, "argv", [a for a in sys.argv if a != "--numa-bind"])
    tp = worker_fork._why_not({**held, "LOCAL_WORLD_SIZE": "2"})  # TP ranks fork like a lone worker
    assert tp is None or "tensor" not in tp, tp
    assert "KMP_AFFINITY" in worker_fork._why_not({**held, "LD_PRELOAD": "/opt/intel/libiomp5.so"})
    assert worker_fork._why_not({**held, "LD_PRELOAD": "/nowhere/libtcmalloc.so.4"}) == (
        "LD_PRELOAD names libraries this process has not loaded: /nowhere/libtcmalloc.so.4")
    loaded = next(p for p in worker_fork._mapped_libraries() if "libc.so" in p or "libc-" in p)
    assert worker_fork.preload_missing({"LD_PRELOAD": loaded}) == []


def test_the_preload_the_role_re_executes_with():
    wanted = worker_fork.wanted_preload()
    assert any("libgomp" in p for p in wanted) and all(Path(p).exists() for p in wanted)
    extra = worker_fork.preload_env({**WORKER_FORK, "LD_PRELOAD": "/usr/lib/x.so"})
    assert extra == {"LD_PRELOAD": ":".join(["/usr/lib/x.so", *wanted]), worker_fork.PRELOADED_ENV: "1"}
    for environ in ({}, {worker_fork.ENV: "spawn"}, {**WORKER_FORK, worker_fork.PRELOADED_ENV: "1"},
                    {**WORKER_FORK, "LD_PRELOAD": "/opt/intel/libiomp5.so"}):
        assert worker_fork.preload_env(environ) is None, environ


def test_host_defaults_fork_workers_on_cpu_hosts_only(monkeypatch):
    monkeypatch.delenv(worker_fork.ENV, raising=False)
    assert process_env(cpu=True)[worker_fork.ENV] == "fork"
    assert worker_fork.ENV not in process_env(cpu=False)
    monkeypatch.setenv(worker_fork.ENV, "spawn")
    assert worker_fork.ENV not in process_env(cpu=True)


def test_the_cores_vllm_binds_a_worker_to():
    assert worker_fork._cpu_list({"GOMP_CPU_AFFINITY": "0 1 4"}) == [0, 1, 4]
    assert worker_fork._cpu_list({"OMP_PLACES": "{2,3}"}) == [2, 3]
    assert worker_fork._cpu_list({"GOMP_CPU_AFFINITY": "0-2 5"}) == [0, 1, 2, 5]
    assert worker_fork._cpu_list({}) == []


_FORKED_WORKER = r"""
import json, os, sys, threading, torch
from ascendserve.engine.patches import worker_fork
cores = sorted(os.sched_getaffinity(0))[:2]
os.environ.update({worker_fork.ENV: "fork", "ASCENDSERVE_ENGINE_CORE_START": "fork", "OMP_NUM_THREADS": str(len(cores)),
                   "GOMP_CPU_AFFINITY": " ".join(map(str, cores))})
if sys.argv[1] == "pool-used":
    torch.set_num_threads(2)
    torch.ones(1 << 18).add_(1)  # a parallel region: a fork of this process would hang in its first
    print(json.dumps({"why": worker_fork._why_not()}))
    sys.exit(0)
assert worker_fork.hold_threads()  # as the API server does before vLLM starts
torch.ones(1 << 18).add_(1)  # work on one thread is harmless
print(json.dumps({"why": worker_fork._why_not(), "held": torch.get_num_threads()}), flush=True)

def child(q):  # runs after the forked process bound itself (worker_fork._WorkerProcess.run)
    x = torch.randn(512, 512)
    (x @ x).sum()
    tasks = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
    q.put({"threads": torch.get_num_threads(), "main": threading.get_native_id(), "tasks": tasks})

q = worker_fork.FORK.Queue()
p = worker_fork.FORK.Process(target=child, args=(q,))
p.start()
print(json.dumps({"child": q.get(timeout=60), "cores": cores}), flush=True)
p.join(30)
"""


def test_a_forked_worker_binds_its_threads_as_vllm_binds_a_spawned_one(tmp_path):
    """A real fork: the API server's one-thread hold, then the child's thread count and binding
    from vLLM's variables, and a parallel region that completes (no libgomp hang)."""
    import json
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", _FORKED_WORKER, "held"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines[0] == {"why": None, "held": 1}
    child, cores = lines[1]["child"], lines[1]["cores"]
    assert child["threads"] == len(cores)
    tasks = child["tasks"]
    assert tasks[str(child["main"])] == cores[:1]  # the forking thread on the first core, as libgomp's master
    assert all(len(allowed) == 1 for allowed in tasks.values()), tasks  # every thread on one core
    assert sorted({allowed[0] for allowed in tasks.values()}) == cores  # and the pool on the others
    # a process that has run a parallel region on two threads is not forked from
    out = subprocess.run([sys.executable, "-c", _FORKED_WORKER, "pool-used"], capture_output=True, text=True,
                         timeout=120, env={**env, worker_fork.THREADS_ENV: "2"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1])["why"] == "this process may have run OpenMP threads (a fork would hang)"
