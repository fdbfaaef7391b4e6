"""KV pages in every layout vLLM 0.32 lists (KVCacheLayout), built by vLLM's own
`create_kv_cache_views`: pages of random block lists move bit-exact from a producer process
to this one over tcp and shm, read in place and through the device path's host staging
(on these CPU tensors) on either side; P TP=2 -> D TP=1 head slicing lands each P rank's heads in
their range; a cross-layer layout moves whole blocks; a D whose layout differs is refused
with both layouts named; MLA latents, padded pages and kernel-block splitting too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from ascendserve.connectors.kv.page_geometry import layout_mismatch
from ascendserve.connectors.kv.pages import PagedKV
from ascendserve.connectors.transport import make_transport
from ascendserve.connectors.transport.base import TransferError
from ascendserve.connectors.transport.channel import ChannelClient
from tests.kv_layouts import (HELD, NUM_BLOCKS, STAGING_BUDGET, Case, build, pages_of, producer_args,
                              producer_seed)

vllm_layouts = pytest.importorskip("vllm.v1.kv_cache_layout")
LAYOUTS = [layout.name for layout in vllm_layouts.KVCacheLayout]  # whatever vLLM lists, not ours
TRANSPORTS = ["tcp", "shm"]
CASES = [Case(name, name) for name in LAYOUTS] + [
    Case("mla", "LBHNC", kind="mla", heads=1),
    Case("mla-cross-layer", "BLHNC", kind="mla", heads=1),
    Case("padded", "LBHNC", padded=True),
    Case("padded-cross-layer", "BLNHC", padded=True),
    Case("kernel-blocks", "LBNHC", kernel_block=8),
] + [Case(f"tp2-{name}", name, heads=2, p_tp=2) for name in LAYOUTS]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def producer():
    """One process serving every case (P ranks included); {case name: base port}."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.kv_layouts", *producer_args(CASES, TRANSPORTS)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen = []
    for line in proc.stdout:  # its log lines, then the ports
        if line.startswith("PORTS "):
            break
        seen.append(line)
    else:
        raise AssertionError("the producer process died before serving:\n" + "".join(seen[-40:]))
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
    yield json.loads(line[6:])
    proc.stdin.close()
    try:
        proc.wait(10)
    finally:
        proc.kill()


class Consumer:
    """D: a side-channel client over caches of `case` (its own bytes, `views`), reading its pages
    in place or through host staging (the device path) with `transport`."""

    def __init__(self, case: Case, transport: str, heads: int | None = None, staged: bool = False):
        self.views = build(case, seed=5, heads=heads)
        self.kv = PagedKV(self.views, NUM_BLOCKS, staging=staged, staging_budget=STAGING_BUDGET)
        self.transport = make_transport(transport, self.kv)
        self.client = ChannelClient("tok", self.kv, self.transport)

    def close(self) -> None:
        self.client.close()
        self.transport.close()


# (D staged, P staged): host memory both sides, D on the device path, P on the device path
PATHS = {"host": (False, False), "staged-d": (True, False), "staged-p": (False, True)}


def ratio(case: Case) -> int:
    return 16 // case.kernel_block if case.kernel_block else 1


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


LOCAL = [[1, 0, 2, 6], [9, 10, 3, 4], [8], [0, 1, 2, 3, 4, 5, 6, 7]]  # D's blocks for HELD[i]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", [c for c in CASES if c.p_tp == 1], ids=lambda c: c.name)
def test_pages_move_bit_exact_between_processes(producer, case, transport, path):
    d_staged, p_staged = PATHS[path]
    d = Consumer(case, transport, staged=d_staged)
    port = producer[f"{case.name}/{'staged' if p_staged else 'host'}"]
    try:
        assert d.kv.layout()["name"] == case.layout
        expected, untouched = build(case, producer_seed(case, 0)), build(case, seed=5)
        k = ratio(case)
        written = set()
        for i, (remote, local) in enumerate(zip(HELD, LOCAL)):
            moved = d.client.pull("127.0.0.1", port, f"{case.name}-{transport}-{i}", remote, local)
            assert moved == d.kv.nbytes(len(remote))
            written |= set(local)
            for r, lo in zip(remote, local):  # HELD[1] repeats block 7: it lands twice
                assert same(pages_of(d.views, lo, k), pages_of(expected, r, k)), (case, i, r, lo)
        for b in set(range(NUM_BLOCKS)) - written:  # nothing else of D's cache was touched
            assert same(pages_of(d.views, b, k), pages_of(untouched, b, k)), b
        assert d.kv.staging.stats()["in_use"] == 0  # a staged read returns its buffers
    finally:
        d.close()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", [c for c in CASES if c.p_tp == 2], ids=lambda c: c.name)
def test_p_tp2_to_d_tp1_lands_each_ranks_heads_in_their_range(producer, case, transport, path):
    """D (TP=1, 4 heads) reads heads 0-1 from P rank 0 and 2-3 from P rank 1 (2 heads each)."""
    d_staged, p_staged = PATHS[path]
    d = Consumer(case, transport, heads=case.heads * case.p_tp, staged=d_staged)
    port = producer[f"{case.name}/{'staged' if p_staged else 'host'}"]
    try:
        i, remote, local = 0, HELD[0], LOCAL[0]
        for rank in range(case.p_tp):
            heads = (0, rank * case.heads, case.heads)  # (first on P, first here, count)
            moved = d.client.pull("127.0.0.1", port + rank, f"{case.name}-{transport}-{i}", remote, local, heads)
            assert moved == d.kv.nbytes(len(remote), case.heads)
        ranks = [build(case, producer_seed(case, rank)) for rank in range(case.p_tp)]
        for r, lo in zip(remote, local):
            mine = pages_of(d.views, lo)
            for rank, theirs in enumerate(ranks):
                part = [page[:, rank * case.heads:(rank + 1) * case.heads] for page in mine]
                assert same(part, pages_of(theirs, r)), (rank, r, lo)
    finally:
        d.close()


def test_staged_pages_have_no_host_views():
    kv = PagedKV(build(Case("LBHNC", "LBHNC"), seed=1), NUM_BLOCKS, staging=True)
    assert kv.staged and not kv.host_visible
    with pytest.raises(RuntimeError, match="no host views"):
        kv.request_views([1])


def test_every_layout_is_named_and_cross_layer_blocks_move_whole():
    for name in LAYOUTS:
        kv = PagedKV(build(Case(name, name), seed=1), NUM_BLOCKS)
        assert kv.layout_name == name
        assert kv.cross_layer == (name.index("B") < name.index("L"))
        views = kv.request_views([2, 5])
        if kv.whole_blocks():  # one piece of every layer's page per block
            assert [len(v) for v in views] == [kv.num_layers * kv.page_bytes] * 2
        else:
            assert sum(len(v) for v in views) == kv.nbytes(2)
    assert PagedKV(build(Case("BLHNC", "BLHNC"), seed=1), NUM_BLOCKS).whole_blocks()
    padded = PagedKV(build(Case("p", "BLNHC", padded=True), seed=1), NUM_BLOCKS)
    assert padded.cross_layer and not padded.whole_blocks()  # padding between the layers' pages


def test_head_runs_follow_the_layout():
    """A head range is one run per page when heads are outermost in the page (LBHNC), one run per
    token when tokens are outside heads (LBNHC); MLA has one head and whole pages."""
    hnc = PagedKV(build(Case("LBHNC", "LBHNC"), seed=1), NUM_BLOCKS)
    assert hnc.run_bytes((1, 2)) == 2 * hnc.head_bytes
    nhc = PagedKV(build(Case("LBNHC", "LBNHC"), seed=1), NUM_BLOCKS)
    assert nhc.run_bytes((1, 2)) == 2 * nhc.content_bytes
    assert len(nhc.layer_views(0, [3], (1, 2))) == nhc.block_tokens
    mla = PagedKV(build(Case("mla", "LBHNC", kind="mla", heads=1), seed=1), NUM_BLOCKS)
    assert mla.num_heads == 1 and mla.content_bytes == 576 * 2 and mla.run_bytes() == mla.page_bytes


def test_a_consumer_with_another_layout_is_refused_naming_both(producer):
    d = Consumer(Case("LBHNC", "LBNHC"), "tcp")  # same model, heads inside tokens
    try:
        with pytest.raises(TransferError, match="KV layout mismatch: peer LBNHC vs here LBHNC"):
            d.client.pull("127.0.0.1", producer["LBHNC/host"], "LBHNC-tcp-0", HELD[0], LOCAL[0])
    finally:
        d.close()
    a = PagedKV(build(Case("a", "LBHNC"), seed=1), NUM_BLOCKS).layout()
    b = PagedKV(build(Case("b", "BLHNC"), seed=1), NUM_BLOCKS).layout()
    assert "peer BLHNC vs here LBHNC" in layout_mismatch(b, a)
    assert layout_mismatch(a, dict(a, heads=8)) is None  # TP shards heads: not a mismatch


def test_kernel_block_views_need_the_manager_block_count():
    views = build(Case("k", "LBNHC", kernel_block=8), seed=1)
    assert PagedKV(views, NUM_BLOCKS).kernel_blocks == 2
    with pytest.raises(ValueError, match="do not split"):
        PagedKV(views, 7)
