"""On a CPU host, vLLM's workers are forked from the engine core instead of spawned.

A spawned worker imports torch and vLLM from scratch: ~13 CPU-seconds on this
2-core host, half of an engine's start (core_fork.py did the same for the
engine core). vLLM spawns them on its CPU platform for three reasons, and a
forked worker is only made where each of them is taken care of; otherwise the
worker is spawned as vLLM does, and the first time a line says why.

1. Thread binding. vLLM binds each worker's OpenMP threads through variables
   (GOMP_CPU_AFFINITY or OMP_PLACES, and OMP_NUM_THREADS) that the OpenMP
   runtime reads only when it is loaded. A forked worker reads the same
   variables (vLLM sets them around each worker's start) and binds itself:
   its thread count, then each of its OpenMP threads to one of the listed
   cores, the first (this thread) to the first, as libgomp does. Intel's
   OpenMP (libiomp in LD_PRELOAD) binds through KMP_AFFINITY: spawned.
2. Preloaded libraries. vLLM puts tcmalloc and torch's libgomp in LD_PRELOAD
   for the workers it spawns. A fork runs with the libraries its parent has,
   so it is made only where everything LD_PRELOAD names is loaded in this
   process: the engine role re-executes itself with them at its start
   (`preload_env`, called by the CLI before anything else is imported).
3. GNU OpenMP does not survive a fork once a parallel region has run: the
   child hangs in its first one (measured here). The engine role's API server
   therefore runs with one OpenMP thread until its engine cores are forked
   (`hold_threads` / `release_threads`), so the engine core, which computes
   nothing, never starts a thread pool, and its forked workers start theirs.

`ASCENDSERVE_WORKER_START=fork` asks for it (engine.host_defaults sets it for
engine roles on CPU hosts; `spawn` leaves vLLM as it is). Only on vLLM's CPU
platform, without --numa-bind, and in an engine core forked from an API server
that held its threads (core_fork.py). The forked worker lets go of the TCP
sockets it inherits and starts the watch that kills it when the engine core
is gone, as core_fork's engine core does. Feature-tested: installed only
where vLLM's multiproc executor starts workers through a `get_mp_context` of
its own; otherwise apply() raises and nothing changes.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
from importlib.util import find_spec
from pathlib import Path

PATCHED = "_ascendserve_fix"
ENV = "ASCENDSERVE_WORKER_START"
# The API server's OpenMP thread count before hold_threads(): a forked worker without a count of
# its own from vLLM (VLLM_CPU_OMP_THREADS_BIND=nobind) gets it back.
THREADS_ENV = "ASCENDSERVE_OMP_THREADS"
# Set in the environment the engine role re-executes itself with, so that it does it once.
PRELOADED_ENV = "ASCENDSERVE_PRELOADED"

_why_spawned: set[str] = set()


def start_method(environ=os.environ) -> str | None:
    """The start method asked for; None when unset. Anything else is an error naming the variable."""
    from ascendserve.engine.patches.core_fork import start_method as asked

    return asked(environ, ENV)


# -- 2. the libraries vLLM preloads into its workers ------------------------------------------

def wanted_preload() -> list[str]:
    """What vLLM's CPU platform adds to LD_PRELOAD for its workers (torch's libgomp, vLLM's
    tcmalloc), found the way it finds them but without importing torch or vLLM; [] where
    either package is missing."""
    torch_spec, vllm_spec = find_spec("torch"), find_spec("vllm")
    if torch_spec is None or vllm_spec is None or not torch_spec.submodule_search_locations:
        return []
    torch_dir = Path(list(torch_spec.submodule_search_locations)[0])
    out = []
    gomp = sorted(p for d in (torch_dir.parent / "torch.libs", torch_dir / "lib") for p in d.glob("libgomp*.so*"))
    if gomp:
        out.append(str(gomp[0]))
    vllm_dir = Path(list(vllm_spec.submodule_search_locations)[0])
    for pattern in ("libtcmalloc_minimal*.so*", "libtcmalloc.so*"):
        if found := sorted((vllm_dir / "libs").glob(pattern)):
            out.insert(0, str(found[0]))
            break
    return out


def preload_env(environ=os.environ) -> dict[str, str] | None:
    """What to add to the environment of an engine role re-executing itself so that its
    processes have vLLM's preloaded libraries; None where that is not wanted: workers not asked
    to fork, already re-executed, or an OpenMP or tcmalloc already preloaded by the user."""
    if start_method(environ) != "fork" or environ.get(PRELOADED_ENV):
        return None
    current = environ.get("LD_PRELOAD", "")
    if any(lib in current for lib in ("libiomp", "libomp", "libgomp", "libtcmalloc")):
        return None  # the user chose: vLLM keeps it, and _why_not() checks that it is loaded
    wanted = wanted_preload()
    if not wanted:
        return None
    return {"LD_PRELOAD": ":".join([p for p in current.split(":") if p] + wanted), PRELOADED_ENV: "1"}


def reexec_with_preload(environ=os.environ) -> None:
    """Re-execute this process (same interpreter, same arguments) with vLLM's preloaded
    libraries where preload_env(environ) says so. Call it before anything starts a thread or
    opens a file: exec keeps the pid and the standard streams, nothing else."""
    extra = preload_env(environ)
    if extra is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # the interpreter's own switches and -m/-c come back with orig_argv; a frozen program (the
    # release bundle) is its own interpreter, and its arguments are argv
    args = sys.argv[1:] if getattr(sys, "frozen", False) else sys.orig_argv[1:]
    os.execve(sys.executable, [sys.executable, *args], {**os.environ, **extra})


def _mapped_libraries() -> set[str]:
    try:
        with open("/proc/self/maps") as maps:
            return {os.path.realpath(line.split(None, 5)[5].strip()) for line in maps
                    if len(line.split(None, 5)) == 6 and ".so" in line}
    except OSError:
        return set()


def preload_missing(environ=os.environ) -> list[str]:
    """The libraries in LD_PRELOAD that this process has not loaded (a fork would lack them)."""
    named = [p for p in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    if not named:
        return []
    mapped = _mapped_libraries()
    return [p for p in named if os.path.realpath(p) not in mapped]


# -- 3. no OpenMP thread pool before the forks ------------------------------------------------

def hold_threads(environ=os.environ) -> bool:
    """In the API server, before vLLM starts: one OpenMP thread until release_threads(), the
    count it had kept in THREADS_ENV for the forked workers. Only where the engine core and
    its workers both fork (core_fork gives the count back once the engine cores are forked)."""
    from ascendserve.engine.patches import core_fork

    if start_method(environ) != "fork" or core_fork.start_method(environ) != "fork":
        return False
    import torch

    environ.setdefault(THREADS_ENV, str(torch.get_num_threads()))
    torch.set_num_threads(1)
    return True


def release_threads(environ=os.environ) -> None:
    """In the API server, once its engine cores are forked: its own thread count back. Sizing
    the pool starts no thread, so a later fork (another data-parallel engine core) is safe."""
    held = environ.get(THREADS_ENV)
    if held and multiprocessing.parent_process() is None:
        import torch

        if torch.get_num_threads() == 1:
            torch.set_num_threads(int(held))


def _why_not(environ=os.environ) -> str | None:
    """Why this engine core must spawn its workers after all; None when a fork is safe."""
    if "--numa-bind" in sys.argv:
        return "--numa-bind re-executes each worker"
    if any(lib in environ.get("LD_PRELOAD", "") for lib in ("libiomp", "libomp.")):
        return "Intel/LLVM OpenMP binds through KMP_AFFINITY at load"
    if missing := preload_missing(environ):
        return f"LD_PRELOAD names libraries this process has not loaded: {', '.join(missing)}"
    if THREADS_ENV not in environ:
        return "the API server did not hold its OpenMP threads (not an ascendserve engine role)"
    import torch

    if torch.get_num_threads() != 1:
        return "this process may have run OpenMP threads (a fork would hang)"
    return None


# -- the forked worker -----------------------------------------------------------------------

def _cpu_list(environ=os.environ) -> list[int]:
    """The cores vLLM bound this worker to (GOMP_CPU_AFFINITY "0 1 2", OMP_PLACES "{0,1,2}");
    [] when it binds nothing (VLLM_CPU_OMP_THREADS_BIND=nobind)."""
    raw = environ.get("GOMP_CPU_AFFINITY") or environ.get("OMP_PLACES", "").strip("{}")
    out = []
    for part in raw.replace(",", " ").split():
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def bind_threads(environ=os.environ) -> dict[int, int]:
    """In a forked worker: the OpenMP thread count and binding vLLM's variables ask for, which a
    spawned worker's OpenMP would have read at load. Returns {thread id: core}."""
    import torch

    cores = _cpu_list(environ)
    count = int(environ.get("OMP_NUM_THREADS") or 0) or len(cores) or int(environ.get(THREADS_ENV) or 1)
    binding: dict[int, int] = {}
    if cores:
        os.sched_setaffinity(0, {cores[0]})  # this thread: libgomp's master takes the first place
        binding[_tid()] = cores[0]
    before = set(os.listdir("/proc/self/task"))
    torch.set_num_threads(count)
    if count > 1:
        torch.ones(count * (1 << 16)).add_(1)  # a parallel region over `count` threads starts the pool
    if cores:
        pool = sorted(int(t) for t in set(os.listdir("/proc/self/task")) - before)
        for i, tid in enumerate(pool, start=1):
            core = cores[i % len(cores)]
            os.sched_setaffinity(tid, {core})
            binding[tid] = core
    return binding


def _tid() -> int:
    import threading

    return threading.get_native_id()


class _WorkerProcess(multiprocessing.context.ForkProcess):
    def run(self):
        from ascendserve.engine.patches.core_fork import release_sockets
        from ascendserve.launch import children

        release_sockets()
        bind_threads()  # first: the threads started after it take its core, as under spawn
        children._watching = False  # the engine core's watch thread did not fork with it
        children.die_with_parent()
        super().run()


class _ForkContext(multiprocessing.context.ForkContext):
    Process = _WorkerProcess


FORK = _ForkContext()


def forking(get_mp_context):
    """Wrap vLLM's get_mp_context() in its multiproc executor: fork where vLLM would spawn and
    a fork is safe here (_why_not)."""

    @functools.wraps(get_mp_context)
    def wrapper():
        context = get_mp_context()  # vLLM's own checks run first (and may log why it spawns)
        if context.get_start_method() != "spawn":
            return context
        why = _why_not()
        if why is None:
            return FORK
        if why not in _why_spawned:
            _why_spawned.add(why)
            from ascendserve.logging import get_logger

            get_logger("ascendserve.patches").info("vLLM workers spawned, not forked", reason=why)
        return context

    setattr(wrapper, PATCHED, True)
    return wrapper


def apply(module=None, environ=os.environ, is_cpu: bool | None = None) -> list[str]:
    """Fork vLLM's workers when ASCENDSERVE_WORKER_START=fork on a CPU platform. Idempotent."""
    from ascendserve.engine.patches.core_fork import fork_where_asked

    def load():
        from vllm.v1.executor import multiproc_executor

        return multiproc_executor

    return fork_where_asked(ENV, environ, is_cpu, module, load, "WorkerProc.make_worker_process", "workers",
                            forking, "MultiprocExecutor forks workers")
