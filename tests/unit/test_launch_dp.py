"""The DP launcher's plan: ports, devices and vLLM data-parallel settings per rank."""

from __future__ import annotations

import json

import pytest

from ascendserve.launch.dp import device_env, is_moe, parser, rank_children


def _plan(tmp_path, *argv, moe=False, device="cpu", env=None):
    args, rest = parser().parse_known_args(["--role", "decode", "--model", str(tmp_path), *argv])
    return rank_children(args, rest, ["ascendserve"], env or {}, device, moe)


def test_ranks_get_consecutive_ports_their_own_kv_ports_and_the_unknown_flags(tmp_path):
    ranks = _plan(tmp_path, "--dp-size", "4", "--dp-size-local", "2", "--dp-rank-start", "2", "--engine-port", "9000",
                  "--tp-size", "2", "--metaserver-url", "http://m:1")
    assert [r.name for r in ranks] == ["decode-dp2", "decode-dp3"]
    for i, rank in enumerate(ranks):
        argv = rank.argv
        assert argv[argv.index("--port") + 1] == str(9000 + i)
        assert argv[argv.index("--kv-port") + 1] == str(10000 + 2 * i)  # TP rank r of it: + r
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
        assert argv[-2:] == ["--metaserver-url", "http://m:1"]
        assert not any("data-parallel" in a for a in argv)  # dense: independent instances


def test_moe_ranks_carry_vllm_data_parallel_settings(tmp_path):
    ranks = _plan(tmp_path, "--dp-size", "4", "--dp-size-local", "2", "--dp-rank-start", "2",
                  "--dp-address", "10.0.0.1", "--dp-rpc-port", "5555", moe=True)
    assert "--vllm-arg=--data-parallel-rank=3" in ranks[1].argv
    assert {"--vllm-arg=--data-parallel-size=4", "--vllm-arg=--data-parallel-address=10.0.0.1",
            "--vllm-arg=--data-parallel-rpc-port=5555"} <= set(ranks[0].argv)


def test_device_blocks():
    assert device_env("cuda", 1, 2, {}, [], 2) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert device_env("cuda", 1, 2, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, [], 2) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert device_env("npu", 0, 4, {}, [], 2) == {"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"}
    with pytest.raises(ValueError):
        device_env("cuda", 1, 2, {"CUDA_VISIBLE_DEVICES": "0,1"}, [], 2)
    assert device_env("cpu", 1, 2, {}, list(range(16)), 2) == {"VLLM_CPU_OMP_THREADS_BIND": "8-11|12-15"}
    assert device_env("cpu", 1, 1, {}, [0, 1], 2) == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert device_env("cpu", 0, 1, {}, [4, 5, 9, 10], 1) == {"VLLM_CPU_OMP_THREADS_BIND": "4-5,9-10"}


def test_moe_detection(tmp_path):
    assert not is_moe(str(tmp_path))  # no config: dense
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    assert not is_moe(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    assert is_moe(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"n_routed_experts": 64}}))
    assert is_moe(str(tmp_path))
