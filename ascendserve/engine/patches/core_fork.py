"""On a CPU host, vLLM's engine core starts by fork instead of spawn.

An engine is three processes: the API server, the engine core it starts, and
a worker per rank that the engine core starts. vLLM's CPU platform sets
VLLM_WORKER_MULTIPROC_METHOD=spawn for all of them, so each imports torch and
vLLM from scratch, one after the other: ~9 s each on this 2-core host, about
two thirds of a 25-30 s start. The workers must be spawned: they bind their
OpenMP threads through OMP_* variables that the OpenMP runtime reads only
when it is loaded. The engine core computes nothing (its workers do), so
nothing stops it from being forked from the API server, which has imported
everything it needs by then: vLLM's own default, and what vLLM does on a GPU
host when CUDA is not yet initialized. Measured here: ready in 18-22 s instead
of 30 s (tiny model, enforce-eager).

`ASCENDSERVE_ENGINE_CORE_START=fork` asks for it (engine.host_defaults sets it
for engine roles on CPU hosts; `spawn`, or unset, leaves vLLM as it is). It
takes effect only on vLLM's CPU platform and without --numa-bind (which
re-executes the process). Only the engine cores' start is changed
(`vllm.v1.engine.utils`, where CoreEngineProcManager gets its context); the
workers, and vLLM's data-parallel coordinator, keep vLLM's start method.
multiprocessing's resource tracker is started by the API server before the
fork, as it is before a spawn, so that it outlives the engine core's process
tree, which vLLM kills when it stops: a tracker started by the engine core
died with it and left vLLM's /dev/shm queues behind. The forked engine core
lets go of the TCP sockets it inherits (the HTTP port, bound before vLLM
starts the engine core): else, outliving a crashed API server, it would keep
the port, and a restart could not bind it.
It also starts the watch that kills it when the API server is gone
(launch.children.die_with_parent), which the vLLM plugin starts in every
process vLLM spawns and which, a thread, does not survive a fork.
Feature-tested: installed only where that module starts its processes through
a `get_mp_context` of its own; otherwise apply() raises and nothing changes.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import socket
import sys
from multiprocessing import resource_tracker

PATCHED = "_ascendserve_fix"
ENV = "ASCENDSERVE_ENGINE_CORE_START"
METHODS = ("fork", "spawn")


def start_method(environ=os.environ, variable: str = ENV) -> str | None:
    """The start method `variable` asks for; None when unset. Anything else is an error naming it."""
    raw = environ.get(variable, "").strip().lower()
    if not raw:
        return None
    if raw not in METHODS:
        raise ValueError(f"{variable}={raw!r}: expected one of {', '.join(METHODS)}")
    return raw


def forking(get_mp_context):
    """Wrap vLLM's get_mp_context(): fork where vLLM would spawn on a CPU host."""

    @functools.wraps(get_mp_context)
    def wrapper():
        context = get_mp_context()  # vLLM's own checks run first (and may log why it spawns)
        if context.get_start_method() == "spawn" and "--numa-bind" not in sys.argv:
            # multiprocessing's resource tracker (it unlinks the shared memory and semaphores its
            # users leave behind) must be this process's child, as under spawn: one the engine
            # core started would be in the process tree that vLLM SIGKILLs when it stops, and
            # its queues' /dev/shm segments would stay
            resource_tracker.ensure_running()
            return FORK
        return context

    setattr(wrapper, PATCHED, True)
    return wrapper


def release_sockets() -> list[int]:
    """In a forked child: let go of the TCP sockets inherited from the parent. The API server's
    HTTP socket is bound but not yet listening when vLLM starts its engine core (it listens once
    the engine is up), and it is the same socket in both processes: kept here, a child outliving
    a crashed API server would hold the port, and a restart could not bind it. Its connections
    (to the metaserver, a NetLoader seed's) are the parent's too. Each fd is pointed at
    /dev/null rather than closed: the parent's socket objects, copied into this process, may
    close their fd number later, and it must not be one this process reused. Never shutdown():
    the socket is the parent's too. vLLM's engine core makes its own sockets (ZMQ, gloo)."""
    fds = [fd for fd in _socket_fds() if _is_tcp(fd)]
    if fds:
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for fd in fds:
                os.dup2(null, fd)
        finally:
            os.close(null)
    return fds


def _socket_fds() -> list[int]:
    """This process's file descriptors that are sockets (bound-only ones included, which
    /proc/net/tcp, and so psutil, does not list)."""
    out = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                out.append(int(name))
        except (OSError, ValueError):
            continue
    return sorted(out)


def _is_tcp(fd: int) -> bool:
    try:
        probe = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        return probe.family in (socket.AF_INET, socket.AF_INET6) and probe.type == socket.SOCK_STREAM
    finally:
        probe.close()  # the dup only


class _EngineCoreProcess(multiprocessing.context.ForkProcess):
    def run(self):
        # what the vLLM plugin does in a process vLLM starts and a fork does not inherit: the
        # watch that SIGKILLs the process once its parent is gone (a thread: threads do not fork)
        from ascendserve.launch.children import die_with_parent

        release_sockets()
        die_with_parent()
        super().run()

    def start(self):
        super().start()
        # the API server held its OpenMP threads at one so that this fork (and the workers it
        # forks) inherited no thread pool (worker_fork.py); with the engine core forked it takes
        # its own count back
        from ascendserve.engine.patches.worker_fork import release_threads

        release_threads()


class _ForkContext(multiprocessing.context.ForkContext):
    """The fork context, with children that first let go of the parent's TCP sockets."""

    Process = _EngineCoreProcess


FORK = _ForkContext()


def fork_where_asked(variable: str, environ, is_cpu: bool | None, module, load, caller: str, starts: str,
                     forking_of, installed: str) -> list[str]:
    """core_fork's and worker_fork's install: when `variable` asks for fork on a CPU platform,
    replace module.get_mp_context (`load()` imports the module when none is given) by
    forking_of(it), after checking that `caller` ("Class.method") of the module starts its
    `starts` through it. Idempotent; returns [installed] when it installed the wrapper."""
    if start_method(environ, variable) != "fork":
        return []
    if is_cpu is None:
        from vllm.platforms import current_platform

        is_cpu = current_platform.is_cpu()
    if not is_cpu:
        return []  # an accelerator's runtime must not be forked: vLLM decides there
    module = module if module is not None else load()
    current = getattr(module, "get_mp_context", None)
    owner, method = caller.split(".")
    code = getattr(getattr(getattr(module, owner, None), method, None), "__code__", None)
    if current is None or code is None or "get_mp_context" not in code.co_names:
        raise TypeError(f"{module.__name__} does not start its {starts} through get_mp_context")
    if getattr(current, PATCHED, False):
        return []
    module.get_mp_context = forking_of(current)
    return [installed]


def apply(module=None, environ=os.environ, is_cpu: bool | None = None) -> list[str]:
    """Start engine cores by fork when ASCENDSERVE_ENGINE_CORE_START=fork on a CPU platform. Idempotent."""

    def load():
        from vllm.v1.engine import utils

        return utils

    return fork_where_asked(ENV, environ, is_cpu, module, load, "CoreEngineProcManager.__init__", "engine cores",
                            forking, "CoreEngineProcManager forks engine cores")
