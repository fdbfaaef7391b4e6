"""Host staging of device KV (kv/staging.py), run on CPU tensors through the same code a GPU
or NPU host runs (PagedKV(staging=True): nothing pinned, copies synchronous): the pool is
bounded, reuses its buffers, takes a read's buffers together and times out with a clear
error; a read moves in units no larger than the budget allows, in the zero-copy path's byte
order; the next unit's copy is queued before the current one is sent; every buffer comes
back, also when the peer goes away mid-read. Mooncake refuses device KV its build cannot
register, naming what works instead."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch

from ascendserve import ops, ops_cuda
from ascendserve.connectors.kv import staging
from ascendserve.connectors.kv.pages import PagedKV
from ascendserve.connectors.kv.staging import StagingPool, recv_units, send_units, units
from ascendserve.connectors.transport.base import TransferError
from ascendserve.connectors.transport.mooncake import build_device_memory, check_pages_memory
from ascendserve.connectors.transport.tcp import recv_views, send_views

LAYERS, BLOCKS, HEADS, TOKENS, CONTENT = 3, 10, 4, 16, 32  # float32: a page is 8 KiB
PAGE = HEADS * TOKENS * CONTENT * 4


def cache(seed: int, cross_layer: bool = False) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, C] views: LBHNC, or BLHNC (one allocation, blocks outermost)."""
    g = torch.Generator().manual_seed(seed)
    if cross_layer:
        raw = torch.randn(BLOCKS, LAYERS, HEADS, TOKENS, CONTENT, generator=g)
        return {f"layers.{i}.attn": raw[:, i] for i in range(LAYERS)}
    raw = torch.randn(LAYERS, BLOCKS, HEADS, TOKENS, CONTENT, generator=g)
    return {f"layers.{i}.attn": raw[i] for i in range(LAYERS)}


def staged(views, budget: int, kernels: str = "torch") -> PagedKV:
    return PagedKV(views, staging=True, staging_budget=budget, kernels=kernels)


# the two ways a device gathers and scatters its pages: torch's index ops (Ascend, and CUDA
# without ascendserve's kernels) and the CUDA kernels, whose launch runs here on the CPU
EMULATED = pytest.param("emulated", marks=pytest.mark.skipif(
    not ops_cuda.cuda_library_built(), reason="no libascendserve_cuda.so: native/build.sh found no nvcc"))
KERNELS = ["torch", EMULATED]


# ---- the pool ---------------------------------------------------------------------
def test_buffers_are_reused_not_reallocated():
    pool = StagingPool(1 << 20)
    for _ in range(20):
        bufs = pool.acquire(100_000, 2)
        assert len(bufs) == 2 and all(b.nbytes >= 100_000 for b in bufs)
        pool.release(*bufs)
    assert pool.allocated == 2 and pool.stats()["in_use"] == 0


def test_a_full_pool_waits_for_a_release_then_times_out_naming_the_setting():
    pool = StagingPool(256 << 10, wait_s=0.3)
    held = pool.acquire(200 << 10)  # a 256 KiB size class: the whole budget
    t = time.monotonic()
    with pytest.raises(TransferError, match=r"staging_mib"):
        pool.acquire(1000)
    assert 0.25 < time.monotonic() - t < 3
    threading.Timer(0.1, pool.release, held).start()
    got = pool.acquire(1000, wait_s=5)  # served once the other read returns its buffer
    assert pool.waits == 1
    pool.release(*got)


def test_a_reads_buffers_are_taken_together():
    """Two reads that each took one buffer and waited for a second would wait for each other:
    a read's buffers come all at once or not at all."""
    pool = StagingPool(4 * (64 << 10), wait_s=0.2)
    a = pool.acquire(64 << 10, 3)
    with pytest.raises(TransferError):
        pool.acquire(64 << 10, 2)  # one would fit, two do not: none taken
    assert pool.stats()["in_use"] == 3 * (64 << 10)
    pool.release(*a)
    pool.release(*pool.acquire(64 << 10, 2))


def test_a_buffer_larger_than_the_budget_is_lent_alone_and_not_kept():
    pool = StagingPool(64 << 10, wait_s=0.2)
    big, = pool.acquire(1 << 20)  # nothing else in use: one oversized buffer
    with pytest.raises(TransferError):
        pool.acquire(10)
    pool.release(big)
    assert pool.stats() == {**pool.stats(), "in_use": 0, "idle": 0}  # freed, not cached


def test_idle_buffers_are_freed_to_stay_within_the_budget():
    pool = StagingPool(1 << 20)
    pool.release(*pool.acquire(100_000, 4))  # 4 x 128 KiB kept idle
    pool.release(*pool.acquire(400_000, 2))  # 2 x 512 KiB: the idle small ones make room
    stats = pool.stats()
    assert stats["in_use"] == 0 and stats["idle"] <= pool.budget


def test_pinning_follows_the_device():
    assert not staged(cache(1), 1 << 20).staging.pin  # host memory: nothing to pin
    # device memory would pin (a CUDA or NPU host; checked by bench/device_kv.py there)


# ---- units ------------------------------------------------------------------------
def test_a_layer_larger_than_half_the_budget_is_split_by_blocks_in_transfer_order():
    kv = staged(cache(1), 8 * PAGE)
    blocks = [7, 2, 9, 0, 4, 5, 1]
    plan = units(kv, blocks, None, kv.staging.pair_bytes())  # 4 pages to a unit
    assert plan == [(layer, chunk) for layer in range(LAYERS) for chunk in ([7, 2, 9, 0], [4, 5, 1])]
    heads = units(kv, blocks, (1, 2), kv.staging.pair_bytes())  # half pages: 8 to a unit
    assert heads == [(layer, blocks) for layer in range(LAYERS)]


def test_cross_layer_blocks_move_whole_and_block_major():
    kv = staged(cache(1, cross_layer=True), 64 * PAGE)
    assert kv.whole_blocks()
    plan = units(kv, [3, 1, 8], None, kv.staging.pair_bytes())
    assert plan == [(None, [3, 1, 8])]
    out = torch.empty(3 * LAYERS * PAGE, dtype=torch.uint8)
    kv.wait(kv.copy_out(None, [3, 1, 8], out))
    host = PagedKV(cache(1, cross_layer=True))  # the same bytes, read in place
    assert out.numpy().tobytes() == b"".join(bytes(v) for v in host.request_views([3, 1, 8]))


# ---- reads over a socket ------------------------------------------------------------
def _move(src: PagedKV, dst: PagedKV, remote, local, heads=None, dst_heads=None):
    a, b = socket.socketpair()
    try:
        err: list = []

        def sender():
            try:
                send_units(lambda v: send_views(a, [v]), src, remote, heads)
            except Exception as exc:  # noqa: BLE001 - checked below
                err.append(exc)

        t = threading.Thread(target=sender)
        t.start()
        got = recv_units(lambda v: recv_views(b, [v]), dst, local, dst_heads or heads)
        t.join(10)
        assert not err, err
        return got
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("cross_layer", [False, True], ids=["LBHNC", "BLHNC"])
@pytest.mark.parametrize("budget_pages", [2, 8, 1000], ids=["one-buffer", "pipelined", "one-unit"])
def test_staged_reads_are_bit_exact_whatever_the_budget(cross_layer, budget_pages, kernels):
    src = staged(cache(1, cross_layer), budget_pages * PAGE, kernels)
    dst = staged(cache(2, cross_layer), 3 * PAGE, kernels)  # the sides split the stream differently
    remote, local = [9, 0, 4, 4, 7, 1, 2], [0, 1, 2, 3, 5, 6, 8]
    before = ops.calls["emulated"]
    assert _move(src, dst, remote, local) == src.nbytes(len(remote))
    # the CUDA kernels' code did every copy (gathers on P, scatters on D), or none of them
    assert (ops.calls["emulated"] > before) == (kernels == "emulated")
    for layer in range(LAYERS):
        for r, lo in zip(remote, local):
            assert torch.equal(dst.layers[layer][lo], src.layers[layer][r])
    untouched = cache(2, cross_layer)
    for layer in range(LAYERS):
        assert torch.equal(dst.layers[layer][[4, 7, 9]], untouched[f"layers.{layer}.attn"][[4, 7, 9]])
    assert src.staging.stats()["in_use"] == 0 and dst.staging.stats()["in_use"] == 0


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_head_range_lands_in_the_other_sides_range(kernels):
    src, dst = staged(cache(1), 4 * PAGE, kernels), staged(cache(2), 4 * PAGE, kernels)
    _move(src, dst, [3, 5], [6, 1], heads=(2, 2), dst_heads=(0, 2))
    for layer in range(LAYERS):
        assert torch.equal(dst.layers[layer][[6, 1], :2], src.layers[layer][[3, 5], 2:])
        assert torch.equal(dst.layers[layer][[6, 1], 2:], cache(2)[f"layers.{layer}.attn"][[6, 1], 2:])


def test_reads_of_many_requests_reuse_the_same_buffers():
    src, dst = staged(cache(1), 8 * PAGE), staged(cache(2), 8 * PAGE)
    for i in range(10):
        _move(src, dst, [i % BLOCKS, (i + 3) % BLOCKS], [i % BLOCKS, (i + 5) % BLOCKS])
    assert src.staging.allocated <= 2 and dst.staging.allocated <= 2


class Recorder:
    """Real staged pages whose copies are logged next to the sends (the pipeline's order)."""

    def __init__(self, pages: PagedKV, log: list):
        self.pages, self.log = pages, log

    def __getattr__(self, name):
        return getattr(self.pages, name)

    def copy_out(self, layer, blocks, host, heads=None):
        self.log.append(("copy", layer, tuple(blocks)))
        return self.pages.copy_out(layer, blocks, host, heads)


def test_the_next_units_copy_is_queued_before_the_current_one_is_sent():
    log: list = []
    src = Recorder(staged(cache(1), 4 * PAGE), log)  # 2 pages to a unit, two buffers
    sent = bytearray()

    def send(view):
        log.append(("send",))
        sent.extend(view)

    send_units(send, src, [1, 2, 3, 4], None)
    kinds = [e[0] for e in log]
    assert kinds[:2] == ["copy", "copy"]  # unit 1 is copying while unit 0 is on the wire
    assert kinds == ["copy", "copy"] + ["send", "copy"] * (2 * LAYERS - 2) + ["send", "send"]
    host = PagedKV(cache(1))
    assert bytes(sent) == b"".join(bytes(v) for v in host.request_views([1, 2, 3, 4]))


def test_every_buffer_comes_back_when_the_producer_goes_away_mid_read():
    src, dst = staged(cache(1), 4 * PAGE), staged(cache(2), 4 * PAGE)
    a, b = socket.socketpair()
    sent = [0]

    def send(view):
        if sent[0] == 3:  # three units in, the producer is gone
            raise OSError("producer gone")
        send_views(a, [view])
        sent[0] += 1

    t = threading.Thread(target=lambda: pytest.raises(OSError, send_units, send, src, [4, 5, 6, 7], None))
    t.start()
    t.join(10)
    a.close()
    with pytest.raises(ConnectionError, match="closed"):
        recv_units(lambda v: recv_views(b, [v]), dst, [0, 1, 2, 3], None)
    b.close()
    assert src.staging.stats()["in_use"] == 0 and dst.staging.stats()["in_use"] == 0


def test_every_buffer_comes_back_when_the_consumer_goes_away():
    src = staged(cache(1), 4 * PAGE)
    a, b = socket.socketpair()
    b.close()
    with pytest.raises(OSError):
        send_units(lambda v: send_views(a, [v]), src, [4, 5, 6, 7], None)
    a.close()
    assert src.staging.stats()["in_use"] == 0


def test_scatter_through_the_pool_takes_read_only_sources():
    """shm hands D a read-only mapping: the staged scatter copies it into a pool buffer."""
    dst = staged(cache(2), 4 * PAGE)
    src = np.frombuffer(bytes(PagedKV(cache(1)).gather_layer(1, [2, 3])), dtype=np.uint8).reshape(2, PAGE)
    assert not src.flags.writeable
    dst.scatter_layer(1, [5, 6], src)
    assert torch.equal(dst.layers[1][[5, 6]], cache(1)["layers.1.attn"][[2, 3]])
    assert dst.staging.stats()["in_use"] == 0


# ---- mooncake and device memory ---------------------------------------------------------
def test_mooncake_builds_say_which_device_memory_they_move():
    assert build_device_memory(["mooncake-transfer-engine-non-cuda"], override="") == frozenset()
    assert build_device_memory(["mooncake-transfer-engine"], override="") == {"cuda"}
    assert build_device_memory(["mooncake-transfer-engine-non-cuda"], override="npu") == {"npu"}
    assert build_device_memory(["mooncake-transfer-engine"], override="none") == frozenset()


def test_mooncake_refuses_device_kv_its_build_cannot_register():
    check_pages_memory("cpu", True, frozenset(), "mooncake-transfer-engine-non-cuda")
    check_pages_memory("cuda", False, frozenset({"cuda"}), "mooncake-transfer-engine")
    with pytest.raises(TransferError) as err:
        check_pages_memory("cuda", False, frozenset(), "mooncake-transfer-engine-non-cuda")
    msg = str(err.value)
    assert "cuda memory" in msg and "non-cuda" in msg and "tcp or shm" in msg


def test_the_default_budget_is_the_configs():
    from ascendserve.config import KVConfig

    assert KVConfig().staging_mib << 20 == staging.DEFAULT_BUDGET


def test_the_copy_code_is_chosen_by_the_device_and_refuses_what_cannot_work():
    assert PagedKV(cache(1), staging=True).kernels == "torch"  # host memory: no CUDA kernels to use
    with pytest.raises(ValueError, match="staged host memory"):
        PagedKV(cache(1), kernels="emulated")  # in place: nothing is staged
    with pytest.raises(ValueError, match="want auto, torch or emulated"):
        PagedKV(cache(1), staging=True, kernels="cuda")
