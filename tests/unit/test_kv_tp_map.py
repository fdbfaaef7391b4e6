"""Heterogeneous TP: the head mapping, and real pulls between differently sharded KV tensors."""

import importlib.util
import socket
import time

import pytest
import torch

from ascendserve.connectors.kv.pull_plan import PullMetadata, PullSettings, RecvPlan
from ascendserve.connectors.kv.pull_worker import PullWorker
from ascendserve.connectors.kv.tp_map import Segment, check_tp, local_heads, plan, source_ranks
from tests.kvtools import results_until

LAYERS, BLOCKS, BS, HD = 3, 12, 8, 32


def test_split_without_replication():
    # 4 heads, P TP 2 -> D TP 1: D takes heads 0-1 from P rank 0 and 2-3 from P rank 1
    assert plan(4, 2, 1, 0, "r") == [Segment(0, 0, 0, 2), Segment(1, 0, 2, 2)]
    # P TP 4 -> D TP 2: each D rank reads only its two P ranks
    assert plan(4, 4, 2, 1, "r") == [Segment(2, 0, 0, 1), Segment(3, 0, 1, 1)]
    assert list(source_ranks(4, 2, 1)) == [2, 3]


def test_replicated_heads_pick_one_replica_deterministically():
    # 2 heads over P TP 4: head 0 on ranks 0 and 1, head 1 on ranks 2 and 3
    assert local_heads(2, 4, 1) == (0, 1) and local_heads(2, 4, 2) == (1, 1)
    picks = {tuple(s.p_rank for s in plan(2, 4, 1, 0, f"req-{i}")) for i in range(64)}
    assert picks <= {(0, 2), (0, 3), (1, 2), (1, 3)} and len(picks) > 1  # spread over replicas
    assert plan(2, 4, 1, 0, "same") == plan(2, 4, 1, 0, "same")  # every side computes the same choice


def test_mla_latent_is_one_head_replicated_on_every_rank():
    """An MLA cache has no head axis: vLLM reports the model's attention heads (4 here), the
    connector counts one, so each D rank reads the whole latent page from one P replica."""
    from types import SimpleNamespace

    from ascendserve.connectors.kv.connector import total_kv_heads

    mla = SimpleNamespace(use_mla=True, get_total_num_kv_heads=lambda: 4)
    gqa = SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 4)
    assert total_kv_heads(mla) == 1 and total_kv_heads(gqa) == 4
    picks = {tuple(plan(1, 2, 1, 0, f"req-{i}")) for i in range(32)}
    assert picks == {(Segment(0, 0, 0, 1),), (Segment(1, 0, 0, 1),)}  # one whole page, either replica
    assert plan(1, 4, 2, 1, "r")[0].p_rank in (2, 3)


@pytest.mark.parametrize("p_tp,d_tp", [(3, 2), (1, 2), (2, 4), (0, 1)])
def test_incompatible_tp_refused_with_a_clear_message(p_tp, d_tp):
    with pytest.raises(ValueError, match="prefill TP >= decode TP and prefill TP a multiple of decode TP"):
        check_tp(p_tp, d_tp)


def full_kv(heads: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((BLOCKS, heads, BS, 2 * HD), generator=g) for _ in range(LAYERS)]


def shard(full: list[torch.Tensor], heads: int, tp: int, rank: int) -> dict:
    first, n = local_heads(heads, tp, rank)
    return {f"model.layers.{i}.attn": t[:, first:first + n].clone().contiguous() for i, t in enumerate(full)}


def free_port_run(n: int) -> int:
    for base in range(20000, 60000, 97):
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port run")


@pytest.mark.parametrize("transport", ["tcp", "shm", pytest.param("mooncake", marks=pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="mooncake-transfer-engine not installed"))])
@pytest.mark.parametrize("heads,p_tp,d_tp", [(4, 2, 1), (4, 4, 2), (2, 4, 1), (2, 4, 2), (1, 2, 1), (2, 2, 2)])
def test_each_decode_rank_gets_exactly_its_heads(transport, heads, p_tp, d_tp):
    full_p, full_d = full_kv(heads, 1), full_kv(heads, 2)
    base = free_port_run(p_tp)
    settings = PullSettings("127.0.0.1", "127.0.0.1", base, 30.0, transport)
    producers, consumers = [], []
    try:
        for r in range(p_tp):
            p = PullWorker(settings, "tok", r, producer=True, tp_size=p_tp, total_kv_heads=heads)
            p.register_kv_caches(shard(full_p, heads, p_tp, r))
            p.start_load_kv(PullMetadata(send={"req-p": ([2, 5, 7], 30.0)}))
            producers.append(p)
        for d in range(d_tp):
            w = PullWorker(settings, "tok", d, producer=False, tp_size=d_tp, total_kv_heads=heads)
            w.register_kv_caches(shard(full_d, heads, d_tp, d))
            w.start_load_kv(PullMetadata(recv=[RecvPlan("req-d", [1, 9, 4], [2, 5, 7], "127.0.0.1", base, "req-p",
                                                        remote_tp=p_tp)]))
            consumers.append(w)
        for d, w in enumerate(consumers):
            _, _, failed = results_until(w, lambda g: "req-d" in g[1], 15)
            assert not failed
            first, n = local_heads(heads, d_tp, d)
            for layer, (src, dst) in enumerate(zip(full_p, w.kv.layers)):
                assert torch.equal(dst[[1, 9, 4]], src[[2, 5, 7], first:first + n]), f"layer {layer} rank {d}"
                untouched = [b for b in range(BLOCKS) if b not in (1, 9, 4)]
                assert torch.equal(dst[untouched], full_d[layer][untouched, first:first + n])
        for p in producers:  # every P rank's hold was released, read or not
            got = set()
            deadline = time.monotonic() + 10
            while "req-p" not in got and time.monotonic() < deadline:
                got |= p.get_transfer_results()[0]
                time.sleep(0.01)
            assert "req-p" in got
    finally:
        for w in producers + consumers:
            w.shutdown()


def test_decode_refuses_a_prefill_tp_it_cannot_map():
    settings = PullSettings("127.0.0.1", "127.0.0.1", 1, 30.0)
    w = PullWorker(settings, "tok", 0, producer=False, tp_size=2, total_kv_heads=4)
    w.register_kv_caches(shard(full_kv(4, 1), 4, 2, 0))
    try:
        w.start_load_kv(PullMetadata(recv=[RecvPlan("r", [1], [1], "127.0.0.1", 1, "x", remote_tp=3)]))
        _, _, failed = results_until(w, lambda g: "r" in g[1])
        assert "r" in failed
    finally:
        w.shutdown()
