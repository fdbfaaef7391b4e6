"""launch/children: a multiprocessing child (vLLM's engine core, its workers) dies with its parent."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import psutil

from ascendserve.launch.children import die_with_parent


def _grandchild() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like a graceful shutdown that hangs: SIGKILL is not caught
    assert die_with_parent(poll_s=0.05)
    assert not die_with_parent(), "one watch per process"
    time.sleep(600)


def _child(queue) -> None:
    grandchild = mp.get_context("spawn").Process(target=_grandchild, daemon=False)
    grandchild.start()
    queue.put(grandchild.pid)
    time.sleep(600)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_child_stops_when_its_parent_is_sigkilled():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    grandchild = queue.get(timeout=60)
    try:
        time.sleep(1.0)
        assert not _gone(grandchild), "the watch must leave a child with a live parent alone"
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        deadline = time.monotonic() + 20
        while not _gone(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(grandchild), "an orphaned child kept running"
    finally:
        for pid in (child.pid, grandchild):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_no_watch_in_a_process_nobody_spawned():
    assert not die_with_parent()  # the test runner itself: its parent may well go away
