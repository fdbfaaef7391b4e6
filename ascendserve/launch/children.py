"""Make sure a role leaves no process behind.

vLLM spawns its engine core and workers as children of the role process.
They normally exit with it; `reap_children` is the deadline that guarantees
it on every path (clean stop, error, interrupted start-up).
"""

from __future__ import annotations

import os
import signal
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


def kill_group(pgid: int, grace_s: float = 0.0) -> None:
    """SIGKILL what is left of process group `pgid`, after up to `grace_s` seconds
    for it to go by itself: multiprocessing's resource tracker (a member of the
    group) unlinks the shared memory its parent leaked just after the parent
    exits, and killing it early leaves the segments in /dev/shm for good."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
