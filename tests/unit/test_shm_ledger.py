"""launch/shm_ledger: what a killed instance's processes mapped in /dev/shm is removed at its next start."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import signal
import uuid

from ascendserve.launch.shm_ledger import ShmLedger


def _map_and_wait(names: list[str], ready) -> None:
    maps = []
    for name in names:
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        maps.append(mmap.mmap(fd, 4096))
        os.close(fd)
    ready.set()
    signal.pause()


def _segment() -> str:
    name = f"asf-test-ledger-{uuid.uuid4().hex[:8]}"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"\0" * 4096)
    return name


def test_a_killed_runs_segments_are_removed_at_the_next_start_unless_in_use(tmp_path):
    ctx = mp.get_context("spawn")
    left, shared = _segment(), _segment()
    ready = ctx.Event()
    victim = ctx.Process(target=_map_and_wait, args=([left, shared], ready))
    other = ctx.Event()
    survivor = ctx.Process(target=_map_and_wait, args=([shared], other))  # another instance on the host
    victim.start(), survivor.start()
    try:
        assert ready.wait(60) and other.wait(60)
        ledger = ShmLedger(str(tmp_path), "prefill-host-8100")
        ledger.record()  # the role process records what its children map
        os.kill(victim.pid, signal.SIGKILL)  # nothing unlinks: the segments stay
        victim.join(10)
        assert os.path.exists(f"/dev/shm/{left}")
        removed = ShmLedger(str(tmp_path), "prefill-host-8100").sweep()
        assert removed == [left]
        assert not os.path.exists(f"/dev/shm/{left}")
        assert os.path.exists(f"/dev/shm/{shared}"), "a segment another live process maps must stay"
        assert not (tmp_path / "shm-prefill-host-8100.json").exists()
        assert ShmLedger(str(tmp_path), "prefill-host-8100").sweep() == []
    finally:
        for p in (victim, survivor):
            if p.is_alive():
                p.kill()
            p.join(10)
        for name in (left, shared):
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass


def test_another_instances_ledger_is_left_alone(tmp_path):
    name = _segment()
    try:
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        child = ctx.Process(target=_map_and_wait, args=([name], ready))
        child.start()
        assert ready.wait(60)
        ShmLedger(str(tmp_path), "decode-host-8200").record()
        child.kill()
        child.join(10)
        assert ShmLedger(str(tmp_path), "decode-host-8201").sweep() == []
        assert os.path.exists(f"/dev/shm/{name}")
    finally:
        os.unlink(f"/dev/shm/{name}")
