"""What a P or D role asks of vLLM for each KV connector: the engines' own documentation's
--kv-transfer-config for the same deployment (each test cites it), filled from ascendserve's
settings; ascendserve adds engine_id and kv_load_failure_policy on the top level (both
fields of vLLM's KVTransferConfig). And the combinations that cannot work, refused by name.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from ascendserve.config import ConfigError, load
from ascendserve.engine import kv_args
from ascendserve.engine.vllm_server import build_argv

OURS_ON_TOP = ("engine_id", "kv_load_failure_policy")


@pytest.fixture()
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def config(role, model_dir, tmp_path, toml="", **flags):
    path = tmp_path / f"{role}.toml"
    path.write_text(toml)
    return load(role, str(path), {"model__path": model_dir, "server__port": "8100", **flags}, env={})


def kv_config(role, model_dir, tmp_path, toml="", **flags) -> dict:
    argv = build_argv(config(role, model_dir, tmp_path, toml, **flags))
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def without_ours(cfg: dict) -> dict:
    """The documented part: what ascendserve adds on the top level checked and taken off."""
    assert cfg["engine_id"].startswith(("prefill-", "decode-")) and cfg["kv_load_failure_policy"] == "recompute"
    return {k: v for k, v in cfg.items() if k not in OURS_ON_TOP}


@pytest.mark.parametrize("role,kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_nixl_as_vllm_documents_it(model_dir, tmp_path, role, kv_role, monkeypatch):
    """vLLM docs/features/nixl_connector_usage.md: {"kv_connector": "NixlConnector", "kv_role":
    ...}; v0.32 deprecates kv_both for kv_producer on P and kv_consumer on D (its log says so);
    kv_buffer_device "cpu" on a CPU host; the side channel from VLLM_NIXL_SIDE_CHANNEL_HOST/PORT."""
    monkeypatch.setattr(kv_args, "is_cpu_host", lambda: True)
    cfg = kv_config(role, model_dir, tmp_path, kv__connector="nixl", kv__port="19100", kv__ttl_s="60")
    assert without_ours(cfg) == {
        "kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": 60}}
    env = kv_args.kv_env(config(role, model_dir, tmp_path, kv__connector="nixl", kv__port="19100"))
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "19100" and env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["UCX_TLS"] == "tcp,self"
    info = msgspec.json.decode(env["ASCENDSERVE_KV_INFO"])
    assert info["connector"] == "nixl" and info["flow"] == "pull" and info["free"] == "lease" and info["port"] == 19100


def test_nixl_buffer_device_follows_the_host(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(kv_args, "is_cpu_host", lambda: False)
    monkeypatch.setattr(kv_args.glob, "glob", lambda pattern: [])
    assert kv_config("prefill", model_dir, tmp_path, kv__connector="nixl")["kv_buffer_device"] == "cuda"
    assert kv_config("prefill", model_dir, tmp_path, kv__connector="nixl",
                     kv__buffer_device="cpu")["kv_buffer_device"] == "cpu"


@pytest.mark.parametrize("role,kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_vllm_mooncake_as_vllm_documents_it(model_dir, tmp_path, role, kv_role, monkeypatch):
    """vLLM docs/features/mooncake_connector_usage.md: {"kv_connector": "MooncakeConnector",
    "kv_role": "kv_producer"|"kv_consumer"}; VLLM_MOONCAKE_BOOTSTRAP_PORT on P (we set it
    from [kv] port); mooncake_protocol (default rdma) is tcp on a CPU host."""
    monkeypatch.setattr(kv_args, "is_cpu_host", lambda: True)
    cfg = kv_config(role, model_dir, tmp_path, kv__connector="mooncake", kv__port="19100")
    assert without_ours(cfg) == {
        "kv_connector": "MooncakeConnector", "kv_role": kv_role,
        "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    monkeypatch.setattr(kv_args.importlib.util, "find_spec", lambda name: object())
    env = kv_args.kv_env(config(role, model_dir, tmp_path, kv__connector="mooncake", kv__port="19100",
                                kv__ttl_s="90"))
    assert env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "19100" and env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] == "90"
    assert msgspec.json.decode(env["ASCENDSERVE_KV_INFO"])["flow"] == "named"


@pytest.mark.parametrize("name,cls", [("ascend-mooncake", "MooncakeConnectorV1"),
                                      ("ascend-layerwise", "MooncakeLayerwiseConnector")])
@pytest.mark.parametrize("role,kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_ascend_mooncake_as_vllm_ascend_documents_it(model_dir, tmp_path, name, cls, role, kv_role):
    """vllm-ascend docs/source/tutorials/features/pd_disaggregation_mooncake_multi_node.md
    (commit 182b75ea): {"kv_connector": "MooncakeLayerwiseConnector" | "MooncakeConnectorV1",
    "kv_role": ..., "kv_port": "36000", "kv_connector_extra_config": {"prefill": {"dp_size": 2,
    "tp_size": 8}, "decode": {"dp_size": 32, "tp_size": 1}}}; the sizes of a P TP8xDP2 / D DP32
    deployment come from [kv.extra] (this instance's own sizes when not given)."""
    toml = '[kv.extra]\nprefill = {dp_size = 2, tp_size = 8}\ndecode = {dp_size = 32, tp_size = 1}\n'
    cfg = kv_config(role, model_dir, tmp_path, toml, kv__connector=name, kv__port="36000")
    assert without_ours(cfg) == {
        "kv_connector": cls, "kv_role": kv_role, "kv_port": "36000",
        "kv_connector_extra_config": {"prefill": {"dp_size": 2, "tp_size": 8}, "decode": {"dp_size": 32, "tp_size": 1}}}
    own = kv_config(role, model_dir, tmp_path, kv__connector=name, kv__port="36000")
    assert own["kv_connector_extra_config"] == {"prefill": {"dp_size": 1, "tp_size": 1},
                                                "decode": {"dp_size": 1, "tp_size": 1}}


@pytest.mark.parametrize("role,kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_ascend_store_as_vllm_ascend_documents_it(model_dir, tmp_path, role, kv_role, monkeypatch):
    """vllm-ascend docs/source/user_guide/feature_guide/kv_pool.md (commit 182b75ea):
    {"kv_connector": "AscendStoreConnector", "kv_role": ..., "kv_connector_extra_config":
    {"backend": "mooncake", "lookup_rpc_port": "<one per instance on a host>"}} and
    PYTHONHASHSEED=0 on every node."""
    cfg = kv_config(role, model_dir, tmp_path, kv__connector="ascend-store", kv__port="20001")
    assert without_ours(cfg) == {
        "kv_connector": "AscendStoreConnector", "kv_role": kv_role,
        "kv_connector_extra_config": {"backend": "mooncake", "lookup_rpc_port": "20001"}}
    monkeypatch.setattr(kv_args.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(kv_args, "environ", lambda: {})
    env = kv_args.kv_env(config(role, model_dir, tmp_path, kv__connector="ascend-store"))
    assert env["PYTHONHASHSEED"] == "0"


@pytest.mark.parametrize("role,kv_role,rpc", [("prefill", "kv_producer", "producer"),
                                              ("decode", "kv_consumer", "consumer")])
def test_lmcache_as_lmcache_documents_it(model_dir, tmp_path, role, kv_role, rpc):
    """LMCache's disaggregated prefill example (vLLM examples/others/lmcache/
    disagg_prefill_lmcache_v1/disagg_vllm_launcher.sh): {"kv_connector": "LMCacheConnectorV1",
    "kv_role": "kv_producer", "kv_connector_extra_config": {"discard_partial_chunks": false,
    "lmcache_rpc_port": "producer1"}} ("consumer1" on D): a name per instance."""
    cfg = kv_config(role, model_dir, tmp_path, kv__connector="lmcache", kv__port="19100")
    assert without_ours(cfg) == {
        "kv_connector": "LMCacheConnectorV1", "kv_role": kv_role,
        "kv_connector_extra_config": {"discard_partial_chunks": False, "lmcache_rpc_port": f"{rpc}19100"}}


def test_multi_as_vllm_ascend_documents_it(model_dir, tmp_path):
    """vllm-ascend kv_pool.md, "MooncakeConnectorV1 + AscendStoreConnector": {"kv_connector":
    "MultiConnector", "kv_role": ..., "kv_connector_extra_config": {"connectors": [{...
    MooncakeConnectorV1, kv_port, prefill/decode sizes}, {... AscendStoreConnector, backend,
    lookup_rpc_port}]}}; kv_load_failure_policy on the top level only (the same page)."""
    toml = '[kv]\nconnector = "multi"\nconnectors = ["ascend-mooncake", "ascend-store"]\nport = 20001\n'
    cfg = kv_config("prefill", model_dir, tmp_path, toml)
    assert cfg["kv_connector"] == "MultiConnector" and cfg["kv_role"] == "kv_producer"
    assert cfg["kv_load_failure_policy"] == "recompute"
    assert cfg["kv_connector_extra_config"] == {"connectors": [
        {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": "20001",
         "kv_connector_extra_config": {"prefill": {"dp_size": 1, "tp_size": 1}, "decode": {"dp_size": 1, "tp_size": 1}}},
        {"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer",
         "kv_connector_extra_config": {"backend": "mooncake", "lookup_rpc_port": "20001"}}]}


def test_a_connector_of_ones_own_gets_its_extra_table(model_dir, tmp_path):
    toml = '[kv]\nconnector = "my_pkg.kv:FastConnector"\nflow = "store"\n[kv.extra]\nendpoint = "rdma://x"\n'
    cfg = kv_config("decode", model_dir, tmp_path, toml)
    assert cfg["kv_connector"] == "FastConnector" and cfg["kv_connector_module_path"] == "my_pkg.kv"
    assert cfg["kv_role"] == "kv_consumer" and cfg["kv_connector_extra_config"] == {"endpoint": "rdma://x"}
    assert kv_args.kv_info(config("decode", model_dir, tmp_path, toml)).flow == "store"


def test_ours_keep_their_own_settings(model_dir, tmp_path):
    cfg = kv_config("prefill", model_dir, tmp_path, kv__connector="pull", kv__port="19100", kv__transport="shm")
    assert cfg["kv_connector"] == "AscendPullConnector"
    assert cfg["kv_connector_module_path"] == "ascendserve.connectors.kv.pull"
    assert cfg["kv_connector_extra_config"]["port"] == 19100 and cfg["kv_connector_extra_config"]["transport"] == "shm"


@pytest.mark.parametrize("toml,flags,needle", [
    ("", {"kv__connector": "teleport"}, "want one of"),
    ('[kv]\nconnector = "multi"\nconnectors = ["nixl"]\n', {}, "two or more"),
    ('[kv]\nconnector = "multi"\nconnectors = ["nixl", "push"]\n', {}, "'push' cannot be a connector of 'multi'"),
    ('[kv]\nconnector = "multi"\nconnectors = ["nixl", "ascend-mooncake"]\n', {}, "each move KV from P to D"),
    ('[kv]\nconnector = "multi"\nconnectors = ["lmcache", "lmcache"]\n', {}, "twice"),
    ('[kv]\nconnector = "nixl"\nconnectors = ["lmcache", "ascend-store"]\n', {}, "is for kv.connector = 'multi'"),
    ('[kv]\nconnector = "pull"\n[kv.extra]\nx = 1\n', {}, "[kv.extra] is for the engines' connectors"),
    ("", {"kv__connector": "mooncake", "engine__data_parallel_size": "2"}, "one engine per instance"),
])
def test_combinations_that_cannot_work_are_refused_by_name(model_dir, tmp_path, toml, flags, needle):
    with pytest.raises(ConfigError) as err:
        config("prefill", model_dir, tmp_path, toml, **flags)
    assert needle in str(err.value)


def test_a_connector_whose_package_is_missing_is_refused_with_how_to_install_it(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(kv_args.importlib.util, "find_spec", lambda name: None if name == "lmcache" else object())
    with pytest.raises(ConfigError) as err:
        kv_args.kv_env(config("decode", model_dir, tmp_path, kv__connector="lmcache"))
    assert "'lmcache'" in str(err.value) and "pip install lmcache" in str(err.value)


def test_registration_carries_the_connector(model_dir, tmp_path):
    reg = kv_args.kv_registration(config("decode", model_dir, tmp_path, kv__connector="nixl", kv__port="19200"))
    assert reg["kv"]["connector"] == "nixl" and reg["kv"]["port"] == 19200 and reg["kv"]["free"] == "lease"
    assert kv_args.kv_registration(config("pd", model_dir, tmp_path)) == {}
