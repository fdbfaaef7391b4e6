"""CPU-host engine defaults: what an engine role gets when the user passes no tuning flag."""

from __future__ import annotations

import json

import pytest

from ascendserve.config import ConfigError, load
from ascendserve.engine import host_defaults
from ascendserve.engine.host_defaults import GiB, MiB, cpu_has_bf16, engine_dtype, memory_args, model_facts
from ascendserve.engine.vllm_server import build_argv


@pytest.fixture
def model(tmp_path):
    """A Qwen2-shaped config: 2 layers, 2 KV heads of 64 -> 512 KV elements per token; 100 MiB of weights."""
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
        "max_position_embeddings": 8192}))
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(100 * MiB)
    return tmp_path


@pytest.fixture(autouse=True)
def no_env_kv_space(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def config(model, role="pd", **flags):
    return load(role, None, {"model__path": str(model), **flags}, env={})


def kv_arg(args):
    return int(args[args.index("--kv-cache-memory-bytes") + 1]) if "--kv-cache-memory-bytes" in args else None


def test_model_facts_read_heads_layers_and_weights(model):
    facts = model_facts(str(model))
    assert (facts.kv_elements_per_token, facts.max_positions, facts.weight_bytes) == (512, 8192, 100 * MiB)


def test_model_facts_of_an_mla_model_count_one_latent(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 3, "num_attention_heads": 8, "kv_lora_rank": 448, "qk_rope_head_dim": 64,
        "hidden_size": 512, "max_position_embeddings": 4096}))
    assert model_facts(str(tmp_path)).kv_elements_per_token == 3 * 512


def test_model_facts_of_a_vl_model_use_its_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 128,
        "max_position_embeddings": 2048}}))
    facts = model_facts(str(tmp_path))
    assert (facts.kv_elements_per_token, facts.max_positions) == (4 * 2 * 64, 2048)


def test_cpu_bf16_detection():
    assert cpu_has_bf16("flags\t: fpu sse avx512f avx512_bf16\n")
    assert cpu_has_bf16("Features\t: fp asimd bf16\n")
    assert not cpu_has_bf16("flags\t: fpu sse avx2 avx512f\n")


def test_dtype_auto_is_float32_on_a_cpu_without_bf16(model, monkeypatch):
    monkeypatch.setattr(host_defaults, "is_cpu_host", lambda: True)
    assert engine_dtype(config(model), cpuinfo="flags : avx2") == "float32"
    assert engine_dtype(config(model), cpuinfo="flags : avx512_bf16") == "auto"
    assert engine_dtype(config(model, engine__dtype="bfloat16"), cpuinfo="flags : avx2") == "bfloat16"
    assert engine_dtype(config(model, engine__vllm_args=["--dtype=half"]), cpuinfo="flags : avx2") == "auto"
    monkeypatch.setattr(host_defaults, "is_cpu_host", lambda: False)
    assert engine_dtype(config(model), cpuinfo="flags : avx2") == "auto"


def test_kv_cache_is_sized_for_16_sequences_when_memory_allows(model, monkeypatch):
    monkeypatch.setattr(host_defaults, "engine_dtype", lambda c: "float32")
    args = memory_args(config(model), cpu=True, available=20 * GiB, total=24 * GiB)
    assert kv_arg(args) == 512 * 4 * 8192 * 16  # 256 MiB
    args = memory_args(config(model, engine__max_model_len=1024), cpu=True, available=20 * GiB, total=24 * GiB)
    assert kv_arg(args) == 512 * 4 * 1024 * 16


def test_kv_cache_shrinks_to_half_of_the_free_share_of_each_engine(tmp_path, monkeypatch):
    monkeypatch.setattr(host_defaults, "engine_dtype", lambda c: "float32")
    (tmp_path / "config.json").write_text(json.dumps({  # 128 KiB per token: 16 x 8k tokens = 16 GiB wanted
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "max_position_embeddings": 8192}))
    one = kv_arg(memory_args(config(tmp_path), cpu=True, available=20 * GiB, total=24 * GiB))
    assert one == (20 - 3) * GiB // 2
    three = kv_arg(memory_args(config(tmp_path, engine__host_engines=3), cpu=True, available=20 * GiB,
                               total=24 * GiB))
    assert three == int((20 - 9) * GiB * 0.5 / 3) // MiB * MiB


def test_an_engine_that_cannot_fit_fails_in_one_line_naming_the_settings(tmp_path, monkeypatch):
    monkeypatch.setattr(host_defaults, "engine_dtype", lambda c: "float32")
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 131072}))
    with pytest.raises(ConfigError) as err:
        memory_args(config(tmp_path), cpu=True, available=8 * GiB, total=24 * GiB)
    assert "\n" not in str(err.value)
    assert "--max-model-len" in str(err.value) and "--kv-cache-memory-bytes" in str(err.value)


def test_explicit_settings_win(model, monkeypatch):
    assert memory_args(config(model, engine__kv_cache_memory_bytes=123 * MiB), cpu=True,
                       available=20 * GiB, total=24 * GiB) == ["--kv-cache-memory-bytes", str(123 * MiB)]
    assert memory_args(config(model, engine__gpu_memory_utilization=0.3), cpu=True, available=20 * GiB,
                       total=24 * GiB) == ["--gpu-memory-utilization", "0.3"]
    assert memory_args(config(model, engine__vllm_args=["--kv-cache-memory-bytes=1000000"]), cpu=True,
                       available=20 * GiB, total=24 * GiB) == []
    toml = model / "pd.toml"
    toml.write_text(f'[model]\npath = "{model}"\n[engine.vllm]\ngpu_memory_utilization = 0.2\n')
    assert memory_args(load("pd", str(toml), {}, env={}), cpu=True, available=20 * GiB, total=24 * GiB) == []
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert memory_args(config(model), cpu=True, available=20 * GiB, total=24 * GiB) == []


def test_a_memory_fraction_the_host_cannot_give_fails_before_vllm_starts(model):
    with pytest.raises(ConfigError, match=r"engine.gpu_memory_utilization = 0.92 .*--gpu-memory-utilization"):
        memory_args(config(model, engine__gpu_memory_utilization=0.92), cpu=True, available=15 * GiB,
                    total=19 * GiB)


def test_accelerator_hosts_keep_vllms_own_sizing(model):
    assert memory_args(config(model), cpu=False) == []
    assert memory_args(config(model, engine__gpu_memory_utilization=0.9), cpu=False) == \
        ["--gpu-memory-utilization", "0.9"]


def test_every_engine_role_gets_the_defaults(model, monkeypatch):
    monkeypatch.setattr(host_defaults, "is_cpu_host", lambda: True)
    for role in ("prefill", "decode", "pd", "encoder"):
        flags = {"kv__connector": "pull"} if role in ("prefill", "decode") else {}
        assert kv_arg(build_argv(config(model, role, **flags))) is not None, role
