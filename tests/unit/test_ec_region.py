"""The host-wide EC region: allocator, LRU, pins with deadlines, multi-process life cycle."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
import uuid

import numpy as np
import pytest

from ascendserve.connectors.ec.region import Region, RegionError, _sizes, ready_keys, snapshot

BLOCK = 4096


@pytest.fixture
def name():
    n = f"asf-ec-test-{uuid.uuid4().hex[:8]}"
    yield n
    assert not os.path.exists(f"/dev/shm/{n}"), "the last close left the region in /dev/shm"


def item(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def test_roundtrip_multi_block_and_partial_tail(name):
    r = Region(name, size_bytes=16 * BLOCK, block_size=BLOCK)
    try:
        for i, n in enumerate((1, BLOCK, 3 * BLOCK + 17)):
            data = item(i, n)
            assert r.write(f"h{i}", data, "float32" if n % 4 == 0 else "uint8", (n,))
            e = r.pin(f"h{i}", ttl_s=5)
            assert e.nbytes == n and e.shape == (n,)
            assert np.array_equal(r.read(e), data)
            r.unpin(f"h{i}")
        assert not r.write("h1", item(9, 10), "uint8", (10,)), "a second write of one key must be refused"
        assert r.pin("absent", 5) is None
    finally:
        r.close()


def test_lru_evicts_oldest_unpinned_first(name):
    r = Region(name, size_bytes=4 * BLOCK, block_size=BLOCK)
    try:
        for k in "abcd":
            assert r.write(k, item(ord(k), BLOCK), "uint8", (BLOCK,))
        assert r.pin("a", ttl_s=60) is not None  # a: most recently used, and pinned
        assert r.write("e", item(5, 2 * BLOCK), "uint8", (2 * BLOCK,))
        assert r.contains("a") and not r.contains("b") and not r.contains("c")
        assert r.contains("d") and r.contains("e")
        # only pinned "a" and the rest are too small for a 4-block item
        assert not r.write("big", item(6, 4 * BLOCK), "uint8", (4 * BLOCK,))
        assert r.contains("a"), "a pinned entry was evicted"
        assert r.stats()["evictions"] >= 4
    finally:
        r.close()


def test_expired_pin_and_dead_writer_are_reclaimed(name):
    r = Region(name, size_bytes=2 * BLOCK, block_size=BLOCK)
    try:
        assert r.write("a", item(1, BLOCK), "uint8", (BLOCK,))
        assert r.pin("a", ttl_s=0.05) is not None
        assert r.write("b", item(2, BLOCK), "uint8", (BLOCK,))
        assert r.write("c", item(3, BLOCK), "uint8", (BLOCK,))  # evicts b, not pinned a
        assert r.contains("a") and not r.contains("b")
        time.sleep(0.1)  # a's pin deadline passed: its holder is presumed dead
        assert r.write("d", item(4, 2 * BLOCK), "uint8", (2 * BLOCK,))
        assert not r.contains("a") and not r.contains("c")
    finally:
        r.close()


def test_layout_mismatch_is_refused(name):
    r = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
    try:
        with pytest.raises(RegionError, match="same \\[ec\\] shm"):
            Region(name, size_bytes=16 * BLOCK, block_size=BLOCK)
    finally:
        r.close()


@pytest.mark.parametrize("opened_as", ["empty", "sized, never set up"])
def test_two_instances_starting_at_once_both_attach(name, opened_as):
    """Another instance opened the region (and holds it) but has not set it up yet: the first to
    take the region's lock sets it up, the other checks it (CI: an encoder started beside
    another was refused with "exists with a different layout (0, ...)")."""
    import fcntl

    other = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT, 0o600)  # the other instance, mid-attach
    fcntl.flock(other, fcntl.LOCK_SH)
    if opened_as != "empty":  # it died between its truncate and its header: the magic is still 0
        os.ftruncate(other, _sizes(BLOCK, 8, 4096)[3])
    try:
        first = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
        assert first.write("a", item(1, 3 * BLOCK), "uint8", (3 * BLOCK,))
        second = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)  # the other one gets there
        assert np.array_equal(second.read(second.pin("a", ttl_s=5)), item(1, 3 * BLOCK))
        second.unpin("a")
        with pytest.raises(RegionError, match="same \\[ec\\] shm"):  # a real mismatch still is one
            Region(name, size_bytes=16 * BLOCK, block_size=BLOCK)
        second.close()
        first.close()
    finally:
        os.close(other)
    with contextlib.suppress(FileNotFoundError):  # the other instance's hold kept the last close from unlinking
        os.unlink(f"/dev/shm/{name}")


def _writer(name: str, ready, hold: bool) -> None:
    r = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
    r.write("x", item(7, 2 * BLOCK + 5), "uint8", (2 * BLOCK + 5,))
    ready.set()
    if hold:
        time.sleep(60)
    r.close()


def test_other_process_reads_and_last_close_unlinks(name):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_writer, args=(name, ready, True))
    p.start()
    try:
        assert ready.wait(60)
        r = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
        e = r.pin("x", 5)
        assert e is not None and np.array_equal(r.read(e), item(7, 2 * BLOCK + 5))
    finally:
        os.kill(p.pid, signal.SIGKILL)  # the writer dies holding the region
        p.join()
    r.close()  # the survivor is the last holder: the name goes


def test_a_forked_child_does_not_keep_its_parents_hold(name):
    """An instance's engine core and workers are forks of the process that holds the region:
    a child that outlives its parent's close must not keep the parent's shared flock, or the
    real last holder does not unlink (the chaos test's leak)."""
    first = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)  # another instance's hold
    second = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)  # this instance's, then a fork
    second.write("x", item(3, BLOCK + 1), "uint8", (BLOCK + 1,))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the lingering child: holds whatever it inherited until killed
        os.close(r)
        os.write(w, b"1" if second.closed else b"0")
        time.sleep(60)
        os._exit(0)
    try:
        os.close(w)
        assert os.read(r, 1) == b"1", "the child kept the parent's region open"
        assert second.pin("x", 5) is not None  # the parent's region is untouched
        second.close()
        first.close()  # the last holder, while the child still lives: the name goes
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)


def test_an_observer_reads_ready_keys_without_becoming_a_holder(name):
    """The proxy's presence check: it sees what is READY and never keeps the region alive."""
    assert ready_keys(name, ["x"]) == set()  # no region: nothing, and none is created
    assert not os.path.exists(f"/dev/shm/{name}")
    r = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
    r.write("x", item(5, BLOCK), "uint8", (BLOCK,))
    r.write("y", item(6, 10), "uint8", (10,))
    assert ready_keys(name, ["x", "y", "z"]) == {"x", "y"}
    r.close()  # the only holder: the name goes although an observer read it
    assert not os.path.exists(f"/dev/shm/{name}")


def test_stale_region_of_a_dead_holder_starts_empty(name):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_writer, args=(name, ready, True))
    p.start()
    assert ready.wait(60)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    assert os.path.exists(f"/dev/shm/{name}")  # nobody was left to unlink it
    r = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
    try:
        assert not r.contains("x") and r.stats()["free_blocks"] == 8
    finally:
        r.close()


def test_snapshot_counts_what_peers_hold_without_holding_the_region(name):
    assert snapshot(name) is None
    r = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
    try:
        assert r.write("a", item(1, BLOCK), "uint8", (BLOCK,)) and r.write("b", item(2, 10), "uint8", (10,))
        assert snapshot(name) == {"entries": 2, "pinned": 0, "writing": 0, "held": 0}
        r.pin("a", ttl_s=60)
        r.pin("b", ttl_s=0.2)
        assert snapshot(name)["held"] == 2
        time.sleep(0.3)  # b's pin lapsed: a dead reader's pin holds nothing past its deadline
        assert snapshot(name) == {"entries": 2, "pinned": 1, "writing": 0, "held": 1}
        r.unpin("a")
        assert snapshot(name)["held"] == 0
    finally:
        r.close()  # still the last holder: the fixture checks the name is gone


def _exited_leader(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        state = next(line for line in f if line.startswith("State:"))
    return "Z" in state and not os.listdir(f"/proc/{pid}/fd") and len(os.listdir(f"/proc/{pid}/task")) > 1


def _orphan_holder(name: str, hold_s: float, killed_instance: bool = False, leader_exits: bool = False) -> int:
    """A process of this process's group that is not its descendant (its parent exited: as vLLM's
    workers are once vLLM SIGKILLed their engine core first), holding the region for hold_s and
    exiting without closing it. Returns its pid once it holds the region. killed_instance: it is
    in a process group of its own whose leader is gone instead (what is left of an instance
    whose main process was SIGKILLed). leader_exits: its main thread exits once it holds the
    region and another thread holds it on (a multithreaded process being killed, whose main
    thread is gone while the last thread tears down its memory); returned once it has."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        if killed_instance:
            os.setsid()
        if os.fork() == 0:
            held = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            if leader_exits:
                import ctypes
                import threading

                def hold():
                    time.sleep(hold_s)
                    os._exit(0)

                threading.Thread(target=hold).start()
                ctypes.CDLL(None).pthread_exit(None)
            time.sleep(hold_s)
            os._exit(0)  # no close: the kernel lets go of its descriptor, as for a killed process
            del held
        os._exit(0)
    os.close(w)
    os.waitpid(child, 0)
    pid = int(os.read(r, 32) or b"0")
    os.close(r)
    assert pid, "the holder never opened the region"
    if leader_exits:
        deadline = time.monotonic() + 10
        while not _exited_leader(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _exited_leader(pid), "the holder's main thread did not exit"
    return pid


def _live_instance_holder(name: str) -> int:
    """Another instance holding the region for 30 s: not this process's descendant, in a session
    and process group of its own whose leader (itself) runs. Returns its pid once it holds it."""
    import subprocess
    import sys

    holder = ("import sys, time\n"
              "from ascendserve.connectors.ec.region import Region\n"
              f"r = Region({name!r}, size_bytes={8 * BLOCK}, block_size={BLOCK})\n"
              "print('held', flush=True); sys.stdout.close(); time.sleep(30)")
    launcher = ("import subprocess, sys\n"
                f"p = subprocess.Popen([sys.executable, '-c', {holder!r}], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, "
                "start_new_session=True)\n"
                "assert p.stdout.readline().strip() == b'held'\n"
                "print(p.pid, flush=True)")
    out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, timeout=60, check=True)
    return int(out.stdout)


def _wait_until_released(r: Region) -> None:
    """Until no other process holds r (a killed holder lets go once the kernel closed its files)."""
    deadline = time.monotonic() + 10
    while r.holders() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.holders() == []


def test_holders_are_found_by_group_and_counted_until_their_descriptors_go(name):
    r = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
    group = os.getpgid(0)
    orphan = _orphan_holder(name, 30)
    other = _live_instance_holder(name)
    try:
        assert r.holders(group) == [orphan]
        assert sorted(r.holders()) == sorted([orphan, other])
        os.kill(orphan, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while orphan in r.holders(group) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.holders(group) == [] and r.holders() == [other]
    finally:
        for pid in (orphan, other):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _wait_until_released(r)
    r.close()


def test_an_instance_waits_for_its_orphaned_workers_before_the_last_close(name):
    """An engine instance's close of the host's region waits for the processes of its group that
    still hold it although they are no longer its descendants: vLLM kills its engine core before
    the workers, which hold the region while they die. Without the wait the instance closed
    first, was not the last holder, nobody unlinked, and the region stayed in /dev/shm (the EPD
    shm and chaos tests' leftover)."""
    pytest.importorskip("psutil")
    from ascendserve.engine.vllm_server import _release_ec_regions

    r = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
    orphan = _orphan_holder(name, 1.5)
    assert r.holders(os.getpgid(0)) == [orphan]
    started = time.monotonic()
    _release_ec_regions(r, wait_s=20)
    assert r.closed and not os.path.exists(f"/dev/shm/{name}"), "the instance closed before its orphan let go"
    assert time.monotonic() - started < 15


def test_an_instance_does_not_wait_for_children_that_do_not_hold_the_region(name):
    """Only holders delay the last close: a process that has other children (a test runner's
    worker with a cluster of its own, a supervisor) closed at its deadline instead (the CI run
    where this file's previous test took 20 s)."""
    pytest.importorskip("psutil")
    import subprocess
    import sys

    from ascendserve.engine.vllm_server import _release_ec_regions

    r = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = time.monotonic()
        _release_ec_regions(r, wait_s=20)
        assert r.closed and not os.path.exists(f"/dev/shm/{name}")
        assert time.monotonic() - started < 10, "the close waited for a child that does not hold the region"
    finally:
        bystander.kill()
        bystander.wait()


def test_an_instance_waits_for_what_is_left_of_a_killed_instance(name):
    """A killed instance's processes still hold the region while they die and never close it: the
    last live instance's close waits for them (a group whose leader is gone) and removes the name.
    Without the wait the region stayed in /dev/shm after the EPD test SIGKILLed its encoder and
    the cluster stopped (CI, both instances logged removed=false, holders_left=[])."""
    pytest.importorskip("psutil")
    from ascendserve.engine.vllm_server import _release_ec_regions

    r = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
    orphan = _orphan_holder(name, 1.5, killed_instance=True)
    assert r.holders() == [orphan] and r.holders(os.getpgid(0)) == []
    _release_ec_regions(r, wait_s=20)
    assert r.closed and not os.path.exists(f"/dev/shm/{name}"), "closed before the killed instance's holder went"


def test_an_instance_does_not_wait_for_a_live_instance(name):
    """Another live instance's holder (its group's leader runs) is not waited for: the close
    returns at once without removing the name, which that instance removes when it stops."""
    from ascendserve.engine.vllm_server import _release_ec_regions

    r = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
    other = _live_instance_holder(name)
    try:
        started = time.monotonic()
        _release_ec_regions(r, wait_s=20)
        assert r.closed and os.path.exists(f"/dev/shm/{name}")
        assert time.monotonic() - started < 10, "the close waited for a live instance"
    finally:
        os.kill(other, signal.SIGKILL)
        last = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
        _wait_until_released(last)
        assert last.close()  # the last holder: removes the name


def test_a_holder_whose_main_thread_exited_is_still_a_holder(name):
    """A multithreaded process being killed can lose its main thread first: /proc/<pid>/fd is then
    empty while its other threads still hold the file and its flock. It counts as a holder."""
    r = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
    holder = _orphan_holder(name, 30, leader_exits=True)
    try:
        assert r.holders() == [holder] and r.holders(os.getpgid(0)) == [holder]
        assert holder in r.lock_pids()
    finally:
        os.kill(holder, signal.SIGKILL)
        _wait_until_released(r)
    assert r.close()


def test_an_instance_waits_for_a_holder_whose_main_thread_exited(name):
    """The CI leak of the EPD shm cluster (prefill's last close: removed=false, holders_left=[],
    other_holders=[]): its worker, SIGKILLed by vLLM, had lost its main thread and showed no
    descriptors while its last thread still held the region. The close now waits for it."""
    pytest.importorskip("psutil")
    from ascendserve.engine.vllm_server import _release_ec_regions

    r = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
    _orphan_holder(name, 1.5, leader_exits=True)  # returns once its main thread has exited
    _release_ec_regions(r, wait_s=20)
    assert r.closed and not os.path.exists(f"/dev/shm/{name}"), "closed while the holder's thread held the region"


def test_the_last_close_retries_while_a_lock_outlives_every_descriptor(name):
    """A killed holder's flock is released a moment after its descriptors leave /proc: a close
    that finds the lock held but nobody holding the region tries again for settle_s (here the
    lock is held through a mapping alone, which /proc/<pid>/fd does not show)."""
    import ctypes
    import fcntl
    import mmap

    r = Region(name, size_bytes=8 * BLOCK, block_size=BLOCK)
    rd, wr = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(rd)
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_SH)
        # libc's mmap (Python's keeps a descriptor of its own): the mapping keeps the open file,
        # and its lock, after the descriptor goes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        addr = libc.mmap(None, BLOCK, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        os.close(fd)
        os.write(wr, b"1" if addr not in (None, ctypes.c_void_p(-1).value) else b"0")
        time.sleep(1.0)
        os._exit(0)
    os.close(wr)
    assert os.read(rd, 1) == b"1"
    os.close(rd)
    try:
        assert r.holders() == []
        started = time.monotonic()
        assert r.close(settle_s=10), "the close gave up while the lock was held"
        assert time.monotonic() - started < 8
    finally:
        os.waitpid(child, 0)
