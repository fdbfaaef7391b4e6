"""engine/patches/idle_poll.py against vLLM's own shared-memory MessageQueue.

A writer process and a reader process (spawned, as vLLM's workers are) share
one vLLM MessageQueue. The writer enqueues a message, stays quiet for
0.6 s (inside vLLM's 1 s busy window) and enqueues another. The reader
reports the CPU time it spent waiting for the second message and how late
that message arrived. Unpatched, the reader spins through the quiet time
(CPU ~ the quiet time); with the nap it sleeps (CPU a small fraction) and
still gets the message within a few milliseconds.
"""

from __future__ import annotations

import multiprocessing
import time

import pytest

pytest.importorskip("vllm")

from ascendserve.engine.host_defaults import process_env  # noqa: E402
from ascendserve.engine.patches import idle_poll  # noqa: E402

QUIET_S = 0.6


def _reader(handle, nap: str | None, out) -> None:
    import os

    if nap is not None:
        os.environ[idle_poll.ENV] = nap
        idle_poll.apply()
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready()
    assert mq.dequeue() == "first"
    cpu0 = time.process_time()
    second = mq.dequeue()
    out.put({"cpu_s": time.process_time() - cpu0, "got": time.time(), "msg": second})


def _wait_for_second(nap: str | None) -> dict:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    writer = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2)
    reader = ctx.Process(target=_reader, args=(writer.export_handle(), nap, out), daemon=True)
    reader.start()
    try:
        writer.wait_until_ready()
        writer.enqueue("first")
        time.sleep(QUIET_S)
        sent = time.time()
        writer.enqueue("second")
        result = out.get(timeout=60)
        result["late_s"] = result["got"] - sent
        return result
    finally:
        reader.join(timeout=30)
        if reader.is_alive():
            reader.kill()
        writer.shutdown()


def test_vllm_reader_spins_through_its_busy_window_unpatched():
    """The cost the patch removes exists in this vLLM (else the patch is moot: the check below
    would pass for any reader)."""
    result = _wait_for_second(None)
    assert result["msg"] == "second"
    assert result["cpu_s"] > 0.5 * QUIET_S, result


def test_napping_reader_sleeps_and_still_reads_at_once():
    result = _wait_for_second("0.5")
    assert result["msg"] == "second"
    assert result["cpu_s"] < 0.25 * QUIET_S, result  # measured 0.045 s of 0.6 s (most of it the first 20 ms, still spun)
    assert result["late_s"] < 0.05, result  # measured 0.7 ms: one nap and a wake-up


def test_nap_setting_is_checked_and_zero_or_unset_leaves_vllm_alone():
    class Fake:
        def __init__(self, is_reader, busy_loop_s=1):
            self.is_reader, self.busy_loop_s, self.last_read = is_reader, busy_loop_s, 0.0

        def wait(self, timeout_ms=None):
            return "vllm"

    assert idle_poll.apply(Fake, {}) == []
    assert idle_poll.apply(Fake, {idle_poll.ENV: "0"}) == []
    for bad in ("fast", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match=idle_poll.ENV):
            idle_poll.apply(Fake, {idle_poll.ENV: bad})
    assert Fake.wait(Fake(True)) == "vllm"

    assert idle_poll.apply(Fake, {idle_poll.ENV: "0.5"}) == ["Fake.wait naps 0.5 ms"]
    assert idle_poll.apply(Fake, {idle_poll.ENV: "0.5"}) == []  # idempotent
    reader = Fake(True)
    reader.last_read = time.monotonic() - 0.1  # past the spin, inside the busy window: a nap
    assert reader.wait() is None
    reader.last_read = time.monotonic()  # just read: vLLM's own spin
    assert reader.wait() == "vllm"
    reader.last_read = time.monotonic() - 2  # past the window: vLLM's own idle wait
    assert reader.wait() == "vllm"
    assert Fake(False).wait() == "vllm"  # writers are not readers


def test_a_spin_condition_without_the_reader_state_is_refused():
    class Other:
        def __init__(self, something):
            self.something = something

        def wait(self, timeout_ms=None):
            pass

    with pytest.raises(TypeError, match="busy_loop_s"):
        idle_poll.apply(Other, {idle_poll.ENV: "0.1"})
    assert not hasattr(Other.wait, idle_poll.PATCHED)


def test_host_defaults_nap_on_every_cpu_host_and_leave_a_users_value(monkeypatch):
    monkeypatch.delenv(idle_poll.ENV, raising=False)
    assert process_env(cpu=True)[idle_poll.ENV] == "0.5"  # one engine alone too: its neighbours are unknown
    assert idle_poll.ENV not in process_env(cpu=False)  # GPU/NPU: vLLM's spin
    monkeypatch.setenv(idle_poll.ENV, "0")  # the user's value, even 0, stays
    assert idle_poll.ENV not in process_env(cpu=True)
