"""The DP launcher's plan: ports, devices and vLLM data-parallel settings per rank."""

from __future__ import annotations

import json

import pytest

from ascendserve.config import load
from ascendserve.engine.vllm_server import build_argv
from ascendserve.launch.dp import _check, device_env, is_moe, parser, rank_children, resolve


def _plan(tmp_path, *argv, moe=False, device="cpu", env=None, config=None):
    args, rest = parser().parse_known_args(["--role", "decode", "--model", str(tmp_path), *argv])
    resolve(args, config)
    assert _check(args) is None
    return rank_children(args, rest, ["ascendserve"], env or {}, device, moe)


def _value(argv, flag):
    return argv[argv.index(flag) + 1]


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
        assert _value(argv, "--data-parallel-size") == "1"  # dense: independent instances
        assert "--data-parallel-rank" not in argv
        assert _value(argv, "--host-engines") == "2"  # this node's ranks share its memory


def test_moe_ranks_carry_vllm_data_parallel_settings(tmp_path):
    ranks = _plan(tmp_path, "--dp-size", "4", "--dp-size-local", "2", "--dp-rank-start", "2",
                  "--dp-address", "10.0.0.1", "--dp-rpc-port", "5555", moe=True)
    assert [_value(r.argv, "--data-parallel-rank") for r in ranks] == ["2", "3"]
    for rank in ranks:
        assert (_value(rank.argv, "--data-parallel-size"), _value(rank.argv, "--data-parallel-address"),
                _value(rank.argv, "--data-parallel-rpc-port")) == ("4", "10.0.0.1", "5555")


def _tiny_dir(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    return model


def test_launch_takes_the_layout_from_the_role_config(tmp_path):
    model = _tiny_dir(tmp_path)
    toml = tmp_path / "decode.toml"
    toml.write_text(f"""
[model]
path = "{model}"
[engine]
tensor_parallel_size = 2
data_parallel_size = 8
data_parallel_size_local = 2
data_parallel_rank_start = 4
data_parallel_address = "10.0.0.9"
data_parallel_rpc_port = 14000
enable_expert_parallel = true
""")
    config = load("decode", str(toml), {}, {})
    args, rest = parser().parse_known_args(["--role", "decode", "--config", str(toml), "--dp-rpc-port", "14001"])
    resolve(args, config)
    assert (args.dp_size, args.dp_size_local, args.dp_rank_start, args.dp_address, args.dp_rpc_port,
            args.tp_size) == (8, 2, 4, "10.0.0.9", 14001, 2)  # a flag beats the file
    ranks = rank_children(args, rest, ["ascendserve"], {}, "cpu", True)
    assert [_value(r.argv, "--data-parallel-rank") for r in ranks] == ["4", "5"]
    # what one rank then hands vLLM: its file plus the launcher's per-rank flags
    rank_config = load("decode", str(toml), {"engine__data_parallel_rank": 5}, {})
    argv = build_argv(rank_config)
    assert (_value(argv, "--data-parallel-size"), _value(argv, "--data-parallel-rank"),
            _value(argv, "--tensor-parallel-size")) == ("8", "5", "2")
    assert "--enable-expert-parallel" in argv


def test_launch_needs_a_dp_size(tmp_path):
    args, _ = parser().parse_known_args(["--role", "decode", "--model", str(tmp_path)])
    resolve(args, None)
    assert "--dp-size" in _check(args)
    args, _ = parser().parse_known_args(["--role", "decode", "--dp-size", "2", "--dp-rank-start", "1",
                                         "--dp-size-local", "2"])
    resolve(args, None)
    assert "do not fit" in _check(args)


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


def test_parallel_settings_are_checked_and_reach_vllm(tmp_path):
    from ascendserve.config import ConfigError

    model = _tiny_dir(tmp_path)
    internal = build_argv(load("pd", None, {"model__path": str(model), "engine__data_parallel_size": 2,
                                            "engine__enable_expert_parallel": True}, {}))
    assert _value(internal, "--data-parallel-size") == "2" and "--data-parallel-rank" not in internal
    assert "--enable-expert-parallel" in internal
    plain = build_argv(load("pd", None, {"model__path": str(model)}, {}))
    assert not any("parallel-size" in a and a != "--tensor-parallel-size" for a in plain)
    assert "--enable-expert-parallel" not in plain
    with pytest.raises(ConfigError, match="outside"):
        load("pd", None, {"model__path": str(model), "engine__data_parallel_size": 2,
                          "engine__data_parallel_rank": 2}, {})
    with pytest.raises(ConfigError, match="ascendserve launch"):  # one side channel per rank
        build_argv(load("decode", None, {"model__path": str(model), "engine__data_parallel_size": 2,
                                         "kv__connector": "pull"}, {}))
    with pytest.raises(ConfigError, match="data-parallel-size"):
        build_argv(load("pd", None, {"model__path": str(model), "engine__vllm_args": ["--data-parallel-size=2"]}, {}))


def test_node_rank_gives_the_rank_start():
    """Kubernetes: a StatefulSet's pod ordinal as ASCENDSERVE_NODE_RANK, no shell arithmetic."""
    args, _ = parser().parse_known_args(["--role", "decode", "--dp-size", "8", "--dp-size-local", "2"])
    resolve(args, None, {"ASCENDSERVE_NODE_RANK": "3"})
    assert args.dp_rank_start == 6 and _check(args) is None
    args, _ = parser().parse_known_args(["--role", "decode", "--dp-size", "8", "--dp-size-local", "2",
                                         "--node-rank", "4"])
    resolve(args, None, {})
    assert "do not fit" in _check(args)  # ranks 8, 9 of 8
    args, _ = parser().parse_known_args(["--role", "decode", "--dp-size", "8", "--dp-size-local", "2",
                                         "--node-rank", "1", "--dp-rank-start", "4"])
    resolve(args, None, {})
    assert "--node-rank" in _check(args)
    args, _ = parser().parse_known_args(["--role", "decode", "--dp-size", "8", "--dp-size-local", "2"])
    resolve(args, None, {"ASCENDSERVE_NODE_RANK": "x"})
    assert "integer" in _check(args)
