"""Prototype platform fixes for vLLM-CPU MoE expert/data parallelism.

apply_all() is idempotent and patches only what the running vLLM lacks:
  * CpuCommunicator.all_gatherv / reduce_scatterv  (missing -> base raises NotImplementedError)
  * CPU fused-MoE experts ignoring expert_map      (detected with a tiny in-bounds kernel probe)
"""
from __future__ import annotations

import functools
import inspect
import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger("moe_proto.patches")
_PATCHED_MARK = "_moe_proto_patched"
_DEBUG = os.environ.get("MOE_PROTO_DEBUG") == "1"
_SEEN: set = set()


def _seen(key) -> bool:  # debug helper: True the first few times a key shows up
    if key in _SEEN or len(_SEEN) > 20:
        return False
    _SEEN.add(key)
    return True


# ---------------------------------------------------------------------------
# 1. all_gatherv / reduce_scatterv for the CPU communicator
# ---------------------------------------------------------------------------

def _cpu_all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    """Concatenate each rank's tensor along dim 0; rank r contributes sizes[r] rows.

    Same contract as CudaCommunicator.all_gatherv: dim must be 0; input_ may be a
    tensor or a list of tensors (each gathered with the same sizes); sizes=None
    means every rank holds the same number of rows. Output rows are ordered by
    rank within the group.
    """
    if dim != 0:
        raise NotImplementedError("only dim 0 all-gatherv is supported")
    world_size = self.world_size
    rank = self.rank_in_group
    group = self.device_group
    if sizes is not None:
        assert len(sizes) == world_size, f"{len(sizes)} != {world_size}"

    def _one(t: torch.Tensor) -> torch.Tensor:
        if world_size == 1:
            return t
        rows = sizes if sizes is not None else [t.shape[0]] * world_size
        assert t.shape[0] == rows[rank], f"{t.shape[0]} != {rows[rank]}"
        max_rows = max(rows)
        tail = tuple(t.shape[1:])
        if max_rows == 0:  # every rank agrees (same sizes list): nothing to move
            return t.new_empty((0,) + tail)
        # gloo all_gather wants equal shapes: pad every rank to max_rows.
        if t.shape[0] == max_rows:
            send = t.contiguous()
        else:
            send = t.new_zeros((max_rows,) + tail)
            send[: t.shape[0]].copy_(t)
        bufs = [torch.empty_like(send) for _ in range(world_size)]
        dist.all_gather(bufs, send, group=group)
        return torch.cat([b[:n] for b, n in zip(bufs, rows)], dim=0)

    if _DEBUG and sizes is not None and len(set(sizes)) > 1 and _seen(("agv", tuple(sizes))):
        print(f"[moe_proto] pid={os.getpid()} all_gatherv unequal sizes={sizes}", flush=True)
    if isinstance(input_, torch.Tensor):
        return _one(input_)
    return [_one(t) for t in input_]


def _cpu_reduce_scatterv(self, input_: torch.Tensor, dim: int = -1,
                         sizes: list[int] | None = None) -> torch.Tensor:
    """Sum input_ over all ranks, then rank r keeps rows
    [sum(sizes[:r]), sum(sizes[:r+1])) along `dim` (equal chunks if sizes is None).

    Same contract as CudaCommunicator.reduce_scatterv. Implemented as a gloo
    all_reduce on a private copy followed by a slice: twice the bytes of a real
    reduce-scatter, but gloo has no reduce_scatter_v and every rank ends with a
    bit-identical sum, so the result does not depend on rank.
    """
    world_size = self.world_size
    if world_size == 1:
        return input_
    if dim < 0:
        dim += input_.dim()
    x = input_.movedim(dim, 0).contiguous().clone()  # never reduce into the caller's tensor
    if sizes is None:
        assert x.shape[0] % world_size == 0
        sizes = [x.shape[0] // world_size] * world_size
    assert len(sizes) == world_size, f"{len(sizes)} != {world_size}"
    assert x.shape[0] == sum(sizes), f"{x.shape[0]} != sum({sizes})"
    if x.numel() > 0:
        dist.all_reduce(x, group=self.device_group)
    rank = self.rank_in_group
    if _DEBUG and len(set(sizes)) > 1 and _seen(("rsv", tuple(sizes))):
        print(f"[moe_proto] pid={os.getpid()} reduce_scatterv unequal sizes={sizes}", flush=True)
    start = sum(sizes[:rank])
    out = x[start : start + sizes[rank]]
    return out.movedim(0, dim).contiguous()


def cpu_communicator_lacks(method: str) -> bool:
    """Feature test: does CpuCommunicator (or a class between it and the base)
    override `method`, or does it inherit the NotImplementedError stub?"""
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    impl = getattr(CpuCommunicator, method, None)
    return impl is None or impl is getattr(DeviceCommunicatorBase, method, None)


def patch_cpu_communicator() -> list[str]:
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    done = []
    for name, fn in (("all_gatherv", _cpu_all_gatherv),
                     ("reduce_scatterv", _cpu_reduce_scatterv)):
        if getattr(getattr(CpuCommunicator, name, None), _PATCHED_MARK, False):
            continue
        if cpu_communicator_lacks(name):
            setattr(fn, _PATCHED_MARK, True)
            setattr(CpuCommunicator, name, fn)
            done.append(name)
    # reduce_scatterv_into_output: the base version copies reduce_scatterv's
    # result into `output`, which is what we want once reduce_scatterv exists.
    return done


# ---------------------------------------------------------------------------
# 2. expert-map-aware CPU fused MoE
# ---------------------------------------------------------------------------

def localize_topk(topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_map: torch.Tensor):
    """Global expert ids -> local slots. expert_map[g] is the local slot of
    global expert g, or -1 if this rank does not hold it. Non-local picks get
    weight 0 and are pointed at local slot 0 (always in bounds), so they add
    exactly 0 * finite = 0 to the token's output."""
    local = expert_map.to(topk_ids.device)[topk_ids.long()]
    is_local = local >= 0
    new_ids = torch.where(is_local, local, torch.zeros_like(local)).to(topk_ids.dtype)
    new_w = torch.where(is_local, topk_weights, torch.zeros_like(topk_weights))
    return new_w, new_ids, is_local


def _wrap_apply(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def apply(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        a = bound.arguments
        expert_map = a.get("expert_map")
        if expert_map is None:
            return orig(*bound.args, **bound.kwargs)
        w, ids, is_local = localize_topk(a["topk_weights"], a["topk_ids"], expert_map)
        if _DEBUG and _seen(("ep", int(is_local.sum()), is_local.numel())):
            print(f"[moe_proto] pid={os.getpid()} EP apply: {int(is_local.sum())}/"
                  f"{is_local.numel()} (token, k) picks local, map={expert_map.tolist()}", flush=True)
        a["topk_weights"], a["topk_ids"], a["expert_map"] = w, ids, None
        orig(*bound.args, **bound.kwargs)
        if a.get("apply_router_weight_on_input"):
            # topk == 1 and the router weight was folded into hidden_states by
            # prepare(); the kernel runs with skip_weighted, so a zeroed topk
            # weight would not silence a non-local expert: zero its rows here.
            a["output"][~is_local.all(dim=1)] = 0
        return None

    setattr(apply, _PATCHED_MARK, True)
    return apply


def _probe_experts_honour_expert_map(cls) -> bool:
    """Run cls.apply once on a 2-expert toy where the unfixed and fixed
    behaviours differ but every id stays in bounds (no segfault either way):
    expert_map = [-1, 0] (global expert 0 not local, global 1 -> local slot 0).
    Token A picks global 1 -> must equal local slot 0's output.
    Token B picks global 0 -> must be 0 (non-local).
    An implementation that ignores expert_map gives slot 1 for A and slot 0 for B."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    H, I, E = 32, 32, 2
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.2
    w2 = torch.randn(E, H, I, generator=g) * 0.2
    x = torch.randn(2, H, generator=g)

    def ref(e, xi):
        gate, up = (w13[e] @ xi).chunk(2)
        return w2[e] @ (torch.nn.functional.silu(gate) * up)

    expected = torch.stack([ref(0, x[0]), torch.zeros(H)])
    # No __init__ (needs a full FusedMoEConfig): a throw-away subclass supplies
    # only what apply() reads; w1_bias/w2_bias are quant-config properties.
    probe_cls = type("_ExpertMapProbe", (cls,),
                     {"w1_bias": None, "w2_bias": None, "isa": "vec"})
    self = object.__new__(probe_cls)
    self._use_zentorch = False
    out = torch.zeros(2, H)
    cls.apply(
        self,
        output=out,
        hidden_states=x,
        w1=cpu_prepack_moe_weight(w13.contiguous(), "vec"),
        w2=cpu_prepack_moe_weight(w2.contiguous(), "vec"),
        topk_weights=torch.ones(2, 1),
        topk_ids=torch.tensor([[1], [0]], dtype=torch.int32),
        activation=MoEActivation.SILU,
        global_num_experts=2,
        expert_map=torch.tensor([-1, 0], dtype=torch.int32),
        a1q_scale=None, a2_scale=None,
        workspace13=torch.empty(0), workspace2=torch.empty(0),
        expert_tokens_meta=None,
        apply_router_weight_on_input=False,
    )
    return torch.allclose(out, expected, atol=1e-4, rtol=1e-4)


def cpu_moe_ignores_expert_map() -> bool | None:
    """True: needs the patch; False: already honours expert_map; None: probe failed."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    try:
        return not _probe_experts_honour_expert_map(CPUUnquantizedExperts)
    except Exception as e:  # API drifted: do not guess
        log.warning("CPU MoE expert_map probe failed (%r); leaving it unpatched", e)
        return None


def patch_cpu_moe_expert_map() -> list[str]:
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    cls = cpu_moe.CPUUnquantizedExperts
    if getattr(cls.apply, _PATCHED_MARK, False):
        return []
    if not cpu_moe_ignores_expert_map():
        return []
    done = []
    # Subclasses (X86 AMX / Arm / Power) inherit apply; patch every class in the
    # module that defines its own apply taking expert_map and is an unquantized
    # descendant, so all CPU unquantized ISAs are covered.
    for name, obj in vars(cpu_moe).items():
        if (isinstance(obj, type) and issubclass(obj, cls) and "apply" in vars(obj)
                and "expert_map" in inspect.signature(obj.apply).parameters):
            obj.apply = _wrap_apply(vars(obj)["apply"])
            done.append(f"{name}.apply")
    return done


def apply_all() -> dict:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    res = {"communicator": patch_cpu_communicator(), "moe": patch_cpu_moe_expert_map()}
    if os.environ.get("MOE_PROTO_VERBOSE", "1") == "1":
        print(f"[moe_proto] pid={os.getpid()} patched: {res}", flush=True)
    return res
