"""Command-line flags: each is bound to one config key and has an environment twin.

`--port` <-> ASCENDSERVE_PORT sets `server.port`. Kept apart from config.py so
the table reads as one list; config.py applies it.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("encoder", "prefill", "decode", "pd", "proxy", "metaserver", "elastic-server", "all")
ENGINE_ROLES = ("encoder", "prefill", "decode", "pd")
ENV_PREFIX = "ASCENDSERVE_"


@dataclass(frozen=True)
class Flag:
    """A command-line flag bound to one config key; its env twin is derived."""

    name: str
    key: str
    help: str
    roles: tuple[str, ...] = ROLES
    repeatable: bool = False
    switch: bool = False
    many: bool = False  # nargs="+"; the env twin is comma- or space-separated

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.lstrip("-").replace("-", "_").upper()

    @property
    def dest(self) -> str:
        return self.key.replace(".", "__")


FLAGS: tuple[Flag, ...] = (
    Flag("--host", "server.host", "address to bind (default 127.0.0.1)"),
    Flag("--port", "server.port", "port to listen on (default 8000)"),
    Flag("--instance-id", "instance_id", "name of this instance in logs and the registry"),
    Flag("--runtime-dir", "runtime_dir", "scratch directory (default /tmp/ascendserve-<uid>)"),
    Flag("--log-level", "log.level", "debug | info | warning | error"),
    Flag("--log-format", "log.format", "auto (JSON unless stderr is a terminal) | json | console"),
    Flag("--cluster-token", "cluster.token", "shared secret for internal routes (prefer the env twin or the file: argv is visible in ps)"),
    Flag("--allow-unauthenticated", "cluster.allow_unauthenticated", "serve internal routes on a non-loopback address without a cluster token", switch=True),
    Flag("--tls-ca", "cluster.tls_ca", "PEM CA bundle trusted (besides the system's) for https URLs inside the cluster"),
    Flag("--tls-cert", "server.tls_cert", "PEM certificate chain: serve HTTPS (with --tls-key)", ("proxy", "metaserver")),
    Flag("--tls-key", "server.tls_key", "PEM private key (unencrypted) of --tls-cert", ("proxy", "metaserver")),
    Flag("--max-connections", "server.max_connections", "HTTP connections served at once; more wait (default 8192)", ("proxy", "metaserver", "elastic-server")),
    Flag("--max-body-mb", "proxy.max_body_mb", "largest request body in MiB; larger gets 413 (default 32)", ("proxy", "metaserver")),
    Flag("--metaserver-url", "cluster.metaserver_url", "metaserver to register with"),
    Flag("--advertise-host", "cluster.advertise_host", "address peers use to reach this instance (default: --host, or this host's name when bound to a wildcard address)"),
    Flag("--registry-backend", "registry.backend", "where instances are found: metaserver (default) | etcd"),
    Flag("--registry-endpoints", "registry.endpoints", "etcd client URLs http(s)://host:2379 (backend etcd)", many=True),
    Flag("--registry-cluster", "registry.cluster", "cluster name: keys under /ascendserve/<cluster>/ (default default)"),
    Flag("--registry-lease-ttl", "registry.lease_ttl_s", "seconds an instance's etcd key outlives its last keep-alive (default 10)"),
    Flag("--registry-username", "registry.username", "etcd user (backend etcd)"),
    Flag("--registry-password", "registry.password", "etcd password (prefer the env twin: argv is visible in ps)"),
    Flag("--registry-tls-cert", "registry.tls_cert", "etcd client certificate (mTLS; CA: --tls-ca)"),
    Flag("--registry-tls-key", "registry.tls_key", "etcd client key (mTLS)"),
    Flag("--model", "model.path", "local model directory (role all: default a tiny demo model)", (*ENGINE_ROLES, "all", "elastic-server")),
    Flag("--served-model-name", "model.served_name", "model name clients use (default: the path)", ENGINE_ROLES),
    Flag("--tensor-parallel-size", "engine.tensor_parallel_size", "tensor parallel ranks", ENGINE_ROLES),
    Flag("--data-parallel-size", "engine.data_parallel_size", "data-parallel ranks in the deployment (MoE: vLLM DP)", ENGINE_ROLES),
    Flag("--data-parallel-rank", "engine.data_parallel_rank", "this process's global DP rank (external DP; set by `launch`)", ENGINE_ROLES),
    Flag("--data-parallel-size-local", "engine.data_parallel_size_local", "DP ranks on this node (`launch`)", ENGINE_ROLES),
    Flag("--data-parallel-rank-start", "engine.data_parallel_rank_start", "global rank of this node's first DP rank (`launch`)", ENGINE_ROLES),
    Flag("--data-parallel-address", "engine.data_parallel_address", "DP master address (rank 0's node)", ENGINE_ROLES),
    Flag("--data-parallel-rpc-port", "engine.data_parallel_rpc_port", "DP master RPC port", ENGINE_ROLES),
    Flag("--enable-expert-parallel", "engine.enable_expert_parallel", "shard MoE experts over the TP x DP ranks", ENGINE_ROLES, switch=True),
    Flag("--dtype", "engine.dtype", "weights/activations dtype passed to vLLM", ENGINE_ROLES),
    Flag("--max-model-len", "engine.max_model_len", "context length limit", ENGINE_ROLES),
    Flag("--max-num-seqs", "engine.max_num_seqs", "concurrent sequences per step", ENGINE_ROLES),
    Flag("--gpu-memory-utilization", "engine.gpu_memory_utilization", "device memory fraction (0, 1]", ENGINE_ROLES),
    Flag("--kv-cache-memory-bytes", "engine.kv_cache_memory_bytes", "KV cache size in bytes (default on a CPU host: sized from free memory)", ENGINE_ROLES),
    Flag("--host-engines", "engine.host_engines", "engines on this host sharing its free memory for default KV sizing (`all` sets it)", ENGINE_ROLES),
    Flag("--enforce-eager", "engine.enforce_eager", "disable graph capture / compilation", ENGINE_ROLES, switch=True),
    Flag("--vllm-arg", "engine.vllm_args", "extra vLLM argument, repeatable (e.g. --vllm-arg=--seed=1)", ENGINE_ROLES, repeatable=True),
    Flag("--kv-connector", "kv.connector", "KV connector between prefill and decode: example | pull | push (ascendserve's) | nixl | mooncake | ascend-mooncake | ascend-layerwise | ascend-store | lmcache | multi | module.path:ClassName", ("prefill", "decode")),
    Flag("--kv-connectors", "kv.connectors", "connector multi: its connectors, in order (e.g. nixl lmcache)", ("prefill", "decode"), many=True),
    Flag("--kv-flow", "kv.flow", "proxy flow of a module.path:ClassName connector: pull | named | push | store", ("prefill", "decode")),
    Flag("--kv-engine-id", "kv.engine_id", "vLLM engine_id of the engine connectors (default: the instance id)", ("prefill", "decode")),
    Flag("--kv-buffer-device", "kv.buffer_device", "nixl's kv_buffer_device: auto | cpu | cuda | npu", ("prefill", "decode")),
    Flag("--kv-path", "kv.path", "storage path of the example KV connector", ("prefill", "decode")),
    Flag("--kv-transport", "kv.transport", "how KV pages move: tcp | shm (same host) | mooncake", ("prefill", "decode")),
    Flag("--kv-events", "kv_events.enabled", "true | false: publish vLLM's KV cache events for the proxy's routing (default: true for pd and prefill)", ENGINE_ROLES),
    Flag("--kv-events-host", "kv_events.host", "address the KV events bind (they carry prompt token ids; default 127.0.0.1)", ENGINE_ROLES),
    Flag("--kv-events-port", "kv_events.port", "KV events port (default server port + 1500; replay on server port + 2500)", ENGINE_ROLES),
    Flag("--kv-port", "kv.port", "KV side-channel port (default server port + 1000)", ("prefill", "decode")),
    Flag("--kv-ttl", "kv.ttl_s", "seconds P holds KV blocks that D never pulls", ("prefill", "decode")),
    Flag("--kv-staging-mib", "kv.staging_mib", "MiB of pinned host buffers per worker for KV in device memory", ("prefill", "decode")),
    Flag("--kv-load-failure-policy", "kv.load_failure_policy", "recompute | fail", ("prefill", "decode")),
    Flag("--ec-connector", "ec.connector", "encoder-cache connector: example | shm (same host) | store (cluster pool)", ("encoder", "prefill", "pd", "proxy")),
    Flag("--ec-store-backend", "ec.store_backend", "store connector backend: memcached | mooncake", ("encoder", "prefill", "pd")),
    Flag("--ec-store-url", "ec.store_url", "memcached host:port of the EC store (proxy: checked to skip the encoder)", ("encoder", "prefill", "pd", "proxy")),
    Flag("--ec-mooncake-master", "ec.mooncake_master", "mooncake_master host:port (store backend mooncake)", ("encoder", "prefill", "pd")),
    Flag("--ec-shm-name", "ec.shm_name", "name of the host's EC shared-memory region", ("encoder", "prefill", "pd", "proxy")),
    Flag("--ec-shm-size-mb", "ec.shm_size_mb", "size of the host's EC shared-memory region", ("encoder", "prefill", "pd", "proxy")),
    Flag("--ec-chunk-kb", "ec.chunk_kb", "memcached value chunk (under the server's item limit)", ("encoder", "prefill", "pd")),
    Flag("--ec-ttl", "ec.ttl_s", "seconds a store entry lives", ("encoder", "prefill", "pd")),
    Flag("--ec-wait", "ec.wait_s", "seconds a consumer waits for an item its encoder promised", ("prefill", "pd")),
    Flag("--ec-recv-buffer-tokens", "ec.recv_buffer_tokens", "consumer receive buffer in tokens: [2048, max_num_batched_tokens]", ("prefill", "pd")),
    Flag("--ec-path", "ec.path", "storage path of the example EC connector (proxy: checked to skip the encoder)", ("encoder", "prefill", "pd", "proxy")),
    Flag("--ec-enabled", "ec.enabled", "load encoder outputs from the EC store (topology has an encoder)", ("prefill", "pd"), switch=True),
    Flag("--netloader-serve", "netloader.serve", "serve this instance's weights to joining instances (NetLoader seed)", ENGINE_ROLES, switch=True),
    Flag("--netloader-port", "netloader.port", "NetLoader seed port (default server port + 2000)", (*ENGINE_ROLES, "elastic-server")),
    Flag("--netloader-source", "netloader.sources", "load weights from these seeds host:port, or auto (the metaserver's)", ENGINE_ROLES, many=True),
    Flag("--netloader-fallback", "netloader.fallback", "no seed delivered: disk (load from storage) | fail", ENGINE_ROLES),
    Flag("--netloader-timeout", "netloader.timeout_s", "seconds of silence before a seed is given up", ENGINE_ROLES),
    Flag("--mode", "proxy.mode", "P/D hand-off: pull | push (push needs --metaserver-url)", ("proxy", "all")),
    Flag("--encoder-dispatch", "proxy.encoder_dispatch", "single | fanout (one encoder call per item)", ("proxy",)),
    Flag("--encoder-fallback", "proxy.encoder_fallback", "all encoders (or the EC store) down: local (PD encodes) | fail", ("proxy",)),
    Flag("--mm-hash-algorithm", "proxy.mm_hash_algorithm", "the engines' --mm-hasher-algorithm: blake3 | sha256 | sha512", ("proxy",)),
    Flag("--workers", "proxy.workers", "proxy processes serving the one port (default 0: the cores given to it, at most 8)", ("proxy",)),
    Flag("--routing", "proxy.routing", "choice of pd/prefill instance: kv (the engines' cached blocks against load) | load", ("proxy",)),
    Flag("--kv-overlap-weight", "proxy.kv_overlap_weight", "kv routing: weight of uncached prompt blocks against blocks in flight", ("proxy",)),
    Flag("--max-retries", "proxy.max_retries", "retries of a failed hop before the first byte", ("proxy",)),
    Flag("--migration-limit", "proxy.migration_limit", "continuations of one request on another instance after a failure mid-generation (0: off)", ("proxy",)),
    Flag("--stall-timeout", "proxy.stall_timeout_s", "seconds without an event from a generating instance before the request moves on", ("proxy",)),
    Flag("--api-key", "proxy.api_keys", "accepted client API key(s)", ("proxy", "all"), many=True),
    Flag("--encoder", "proxy.encoder", "static encoder instances host:port", ("proxy",), many=True),
    Flag("--prefill", "proxy.prefill", "static prefill instances host:port", ("proxy",), many=True),
    Flag("--decode", "proxy.decode", "static decode instances host:port", ("proxy",), many=True),
    Flag("--pd", "proxy.pd", "static pd instances host:port", ("proxy",), many=True),
    Flag("--prefiller-hosts", "proxy.prefiller_hosts", "vllm-ascend compatible", ("proxy",), many=True),
    Flag("--prefiller-ports", "proxy.prefiller_ports", "vllm-ascend compatible", ("proxy",), many=True),
    Flag("--prefiller-hosts-num", "proxy.prefiller_hosts_num", "repeat each prefiller host N times", ("proxy",), many=True),
    Flag("--prefiller-ports-inc", "proxy.prefiller_ports_inc", "N consecutive ports from each prefiller port", ("proxy",), many=True),
    Flag("--decoder-hosts", "proxy.decoder_hosts", "vllm-ascend compatible", ("proxy",), many=True),
    Flag("--decoder-ports", "proxy.decoder_ports", "vllm-ascend compatible", ("proxy",), many=True),
    Flag("--decoder-hosts-num", "proxy.decoder_hosts_num", "repeat each decoder host N times", ("proxy",), many=True),
    Flag("--decoder-ports-inc", "proxy.decoder_ports_inc", "N consecutive ports from each decoder port", ("proxy",), many=True),
    Flag("--topology", "all.topology", "1E1P1D | 1P1D | 1E1PD | mono", ("all",)),
    Flag("--proxies", "all.proxies", "proxies `all` starts: on --port, then --port + 2, + 3, ... (default 1; at most 8)", ("all",)),
    Flag("--start-limit", "all.start_limit", "give up (exit 1) on a child that fails to start this many times in a row; 0: never", ("all",)),
)


def flags_for(role: str | None) -> list[Flag]:
    return [f for f in FLAGS if role is None or role in f.roles]


def argv_value(argv: list[str], flag: str) -> str:
    """The last value given to `flag` (`--flag V` or `--flag=V`) in an argument list, or ""."""
    value = ""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value
