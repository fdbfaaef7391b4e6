"""Make sure a role leaves no process behind.

vLLM spawns its engine core and workers as children of the role process.
They normally exit with it; `reap_children` is the deadline that guarantees
it on every path (clean stop, error, interrupted start-up).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil


def _is_resource_tracker(proc: psutil.Process) -> bool:
    # multiprocessing's resource tracker ignores SIGTERM on purpose and exits
    # when we do, after unlinking any shared memory a child leaked: let it.
    try:
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def reap_children(timeout: float = 10.0) -> list[int]:
    """Terminate, then kill after `timeout` seconds, every descendant of this
    process. Returns the pids that had to be killed."""
    try:
        children = [c for c in psutil.Process().children(recursive=True) if not _is_resource_tracker(c)]
    except psutil.Error:
        return []
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
    return [c.pid for c in alive]


_watching = False


def die_with_parent(poll_s: float = 0.5) -> bool:
    """In a multiprocessing child (vLLM's engine core, its workers): SIGKILL
    this process as soon as the process that started it is gone.

    vLLM's engine core does not watch the API server, so a role process
    killed by SIGKILL left its engine and workers running as orphans that
    held the KV side-channel port (a restart on the same port could not bind
    it), their KV blocks and gigabytes of memory. Not SIGTERM: vLLM's
    graceful shutdown waits on its workers and was seen stuck for more than
    30 s under load, and without the API server nothing it does matters.
    multiprocessing's resource tracker unlinks the shared memory the dead
    registered once they are all gone. Returns whether a watch was started
    (not in a process nobody spawned: a role's own parent may well exit)."""
    global _watching
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None or _watching:
        return False
    _watching = True

    def watch() -> None:
        while os.getppid() == parent.pid:
            time.sleep(poll_s)
        from ascendserve.logging import get_logger

        get_logger("ascendserve.launch").warning("parent process gone; exiting", parent=parent.pid)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="ascendserve-parent-watch", daemon=True).start()
    return True


def _members(pgid: int) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                out.append(proc)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def _wait_gone(pgid: int, until: float) -> bool:
    while time.monotonic() < until:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return True
        time.sleep(0.05)
    return False


def kill_group(pgid: int, grace_s: float = 0.0, tracker_grace_s: float | None = None) -> None:
    """Make sure nothing of process group `pgid` survives, without leaking
    shared memory. Members get `grace_s` seconds to exit by themselves; then
    everything but multiprocessing's resource tracker is SIGKILLed, and the
    tracker gets `tracker_grace_s` (default `grace_s`) more to unlink the
    segments the others leaked (it does so once no process holds its pipe)
    before it is killed too. A stopped group is continued for that."""
    if _wait_gone(pgid, time.monotonic() + grace_s):
        return
    for proc in _members(pgid):
        if not _is_resource_tracker(proc):
            try:
                proc.kill()
            except psutil.Error:
                pass
    try:
        os.killpg(pgid, signal.SIGCONT)  # a SIGSTOPped tracker cannot clean up
    except (ProcessLookupError, PermissionError):
        pass
    if _wait_gone(pgid, time.monotonic() + (grace_s if tracker_grace_s is None else tracker_grace_s)):
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
