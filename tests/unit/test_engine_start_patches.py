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
