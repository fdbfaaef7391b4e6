"""`[kv]` → vLLM's `--kv-transfer-config`, the environment its connector reads, and what
the instance tells the proxy and the registry of it (protocol/kv_connectors.py's table).

Each engine connector gets what its own documentation writes for a P/D deployment, filled
from ascendserve's settings (ports, engine id, TTL, parallel sizes); `[kv.extra]` is merged
last into its `kv_connector_extra_config`, so anything the docs offer can still be set:
    nixl              vLLM docs/features/nixl_connector_usage.md (kv_producer / kv_consumer
                      since v0.32, which deprecates kv_both); side channel from
                      VLLM_NIXL_SIDE_CHANNEL_HOST/PORT; kv_lease_duration
    mooncake          vLLM docs/features/mooncake_connector_usage.md; the bootstrap server on
                      P at VLLM_MOONCAKE_BOOTSTRAP_PORT
    ascend-mooncake,  vllm-ascend docs/source/tutorials/features/
    ascend-layerwise  pd_disaggregation_mooncake_multi_node.md: kv_port, and the prefill and
                      decode {dp_size, tp_size} in kv_connector_extra_config
    ascend-store      vllm-ascend docs/source/user_guide/feature_guide/kv_pool.md: backend,
                      lookup_rpc_port (one per instance on a host), PYTHONHASHSEED=0 everywhere
    lmcache           LMCache's disaggregated-prefill example (vLLM examples/others/lmcache):
                      discard_partial_chunks false, lmcache_rpc_port a name per instance
    multi             MultiConnector: the children's configs under `connectors`,
                      kv_load_failure_policy on the top level only (vllm-ascend kv_pool.md)
"""

from __future__ import annotations

import glob
import importlib.util
from typing import Any

import msgspec

from ascendserve.config import Config, ConfigError, environ
from ascendserve.engine.host_defaults import is_cpu_host
from ascendserve.engine.patches import nixl_progress
from ascendserve.protocol import kv_connectors as kc

INSTALL_HINTS = {
    "nixl": "pip install nixl==1.5.1 nixl-cu12==1.5.1",
    "mooncake": "pip install mooncake-transfer-engine (CUDA) or mooncake-transfer-engine-non-cuda",
    "vllm_ascend": "ASCENDSERVE_DEVICE=npu bash scripts/install.sh, on a host with CANN",
    "lmcache": "pip install lmcache",
}


def kv_transfer_config(config: Config, kv_role: str) -> dict:
    """vLLM's --kv-transfer-config for this role (kv_role: kv_producer on P, kv_consumer on D)."""
    kv = config.kv
    if kv.connector == kc.MULTI:
        children = [_connector_config(config, name, kv_role, {}, child=True) for name in kv.connectors]
        return {"kv_connector": "MultiConnector", "kv_role": kv_role, "engine_id": kv.engine_id,
                "kv_load_failure_policy": kv.load_failure_policy,
                "kv_connector_extra_config": {"connectors": children, **kv.extra}}
    return _connector_config(config, kv.connector, kv_role, kv.extra)


def _connector_config(config: Config, name: str, kv_role: str, extra: dict, child: bool = False) -> dict:
    kv = config.kv
    producer = kv_role == "kv_producer"
    if name == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": kv_role,
                "kv_connector_extra_config": {"shared_storage_path": kv.path}}
    if name in kc.OURS:
        spec = kc.CONNECTORS[name]
        return {"kv_connector": spec.vllm_class, "kv_connector_module_path": spec.module_path, "kv_role": kv_role,
                **({} if child else {"kv_load_failure_policy": kv.load_failure_policy}),
                "kv_connector_extra_config": {"host": config.cluster.advertise_host, "bind_host": config.server.host,
                                              "port": kv.port, "ttl_s": kv.ttl_s, "transport": kv.transport,
                                              "staging_mib": kv.staging_mib, "tls_ca": config.cluster.tls_ca}}
    if ":" in name:  # module.path:ClassName, the user's own
        module, cls = name.rsplit(":", 1)
        return {"kv_connector": cls, "kv_connector_module_path": module, "kv_role": kv_role,
                "engine_id": kv.engine_id, "kv_load_failure_policy": kv.load_failure_policy,
                "kv_connector_extra_config": dict(extra)}
    spec = kc.CONNECTORS[name]
    out: dict[str, Any] = {"kv_connector": spec.vllm_class, "kv_role": spec.roles[0 if producer else 1]}
    if spec.module_path:
        out["kv_connector_module_path"] = spec.module_path
    if not child:
        out["engine_id"] = kv.engine_id
        out["kv_load_failure_policy"] = kv.load_failure_policy
    own: dict[str, Any] = {}
    if name == "nixl":
        out["kv_buffer_device"] = buffer_device(kv.buffer_device)
        own = {"kv_lease_duration": max(1, int(kv.ttl_s))}
    elif name == "mooncake":
        own = {"mooncake_protocol": "tcp" if is_cpu_host() else "rdma"}
    elif name in ("ascend-mooncake", "ascend-layerwise"):
        out["kv_port"] = str(kv.port)
        sizes = {"dp_size": config.engine.data_parallel_size, "tp_size": config.engine.tensor_parallel_size}
        own = {"prefill": dict(sizes), "decode": dict(sizes)}
    elif name == "ascend-store":
        own = {"backend": "mooncake", "lookup_rpc_port": str(kv.port)}
    elif name == "lmcache":
        own = {"discard_partial_chunks": False, "lmcache_rpc_port": f"{'producer' if producer else 'consumer'}{kv.port}"}
    out["kv_connector_extra_config"] = {**own, **extra}
    return out


def buffer_device(setting: str) -> str:
    """nixl's kv_buffer_device: the setting, or the host's device (cpu without accelerators)."""
    if setting != "auto":
        return setting
    if is_cpu_host():
        return "cpu"
    return "npu" if glob.glob("/dev/davinci[0-9]*") else "cuda"


def check(config: Config) -> None:
    """Refuse a connector whose package is not installed on this host (ConfigError naming it
    and how to install it); config.py has refused the combinations that cannot work anywhere."""
    for name in kc.members(config.kv.connector, config.kv.connectors):
        spec = kc.CONNECTORS.get(name)
        if spec is not None and importlib.util.find_spec(spec.package) is None:
            raise ConfigError(f"kv.connector {name!r} needs the Python package {spec.package!r}, which is not "
                              f"installed here ({INSTALL_HINTS.get(spec.package, 'install it')})")


def kv_env(config: Config) -> dict[str, str]:
    """Environment of vLLM's processes for the KV connector, and ASCENDSERVE_KV_INFO, which
    the engine's `/kv_info` route serves (engine/middleware.py)."""
    if config.role not in ("prefill", "decode"):
        return {}
    check(config)
    kv = config.kv
    own = kc.members(kv.connector, kv.connectors)
    env: dict[str, str] = {}
    if "nixl" in own:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = config.cluster.advertise_host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(kv.port)
        if is_cpu_host() and "UCX_TLS" not in environ():
            env["UCX_TLS"] = "tcp,self"  # UCX's shared-memory transports fail between engines here
        if is_cpu_host() and nixl_progress.ENV not in environ():
            env[nixl_progress.ENV] = "1000"  # NIXL's progress thread would spin a core (engine/patches)
    if "mooncake" in own:
        env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(kv.port)
        env["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = str(max(1, int(kv.ttl_s)))
    if {"ascend-store", "lmcache"} & set(own) and "PYTHONHASHSEED" not in environ():
        env["PYTHONHASHSEED"] = "0"  # every instance must hash prompt blocks alike to share a pool
    env["ASCENDSERVE_KV_INFO"] = msgspec.json.encode(kv_info(config)).decode()
    return env


def kv_info(config: Config) -> kc.KVInfo:
    """What this instance tells the proxy and the registry about its KV connector."""
    kv = config.kv
    return kc.KVInfo(connector=kv.connector, connectors=list(kv.connectors),
                     flow=kc.flow_of(kv.connector, kv.connectors, kv.flow), free=kc.free_of(kv.connector, kv.connectors),
                     engine_id=kv.engine_id, host=config.cluster.advertise_host, port=kv.port)


def kv_registration(config: Config) -> dict:
    """The registration fields of this instance's KV connector (P and D only)."""
    if config.role not in ("prefill", "decode"):
        return {}
    return {"kv": msgspec.to_builtins(kv_info(config))}
