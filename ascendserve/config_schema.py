"""The config's schema: one msgspec Struct per section of the TOML file, and Config, their tree.

Types only (and the checks their annotations carry); config.py merges the sources into them and
config_checks.py checks what spans keys. Callers import these names from config.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from ascendserve.flags import ENGINE_ROLES


Port = Annotated[int, Meta(ge=1, le=65535)]
PositiveInt = Annotated[int, Meta(ge=1)]
Fraction = Annotated[float, Meta(gt=0.0, le=1.0)]
PassthroughValue = str | int | float | bool | list[str | int | float] | dict[str, Any]


class ConfigError(Exception):
    """Bad configuration; the message is meant for the operator, as is."""


class _Section(Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=False):
    pass


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: Port = 8000
    # HTTPS for the proxy and the metaserver: PEM certificate chain and unencrypted key.
    tls_cert: str = ""
    tls_key: str = ""
    # Limits of our HTTP servers (proxy, metaserver, elastic-server). Connections
    # beyond max_connections wait in the listen backlog; a request head larger than
    # max_header_kb gets 431; a connection that sends no complete head within
    # header_timeout_s (also: idle keep-alive) is closed. Bodies: proxy.max_body_mb.
    max_connections: Annotated[int, Meta(ge=1, le=1_000_000)] = 8192
    max_header_kb: Annotated[int, Meta(ge=8, le=4096)] = 64
    header_timeout_s: Annotated[float, Meta(gt=0.0, le=3600.0)] = 30.0


class ModelConfig(_Section):
    path: str = ""
    served_name: str = ""


class EngineConfig(_Section):
    tensor_parallel_size: PositiveInt = 1
    dtype: str = "auto"
    max_model_len: PositiveInt | None = None
    max_num_seqs: PositiveInt | None = None
    gpu_memory_utilization: Fraction | None = None
    # KV cache size in bytes (vLLM's --kv-cache-memory-bytes). Unset on a CPU host:
    # sized from the memory free at start-up, shared by `host_engines` engines.
    kv_cache_memory_bytes: PositiveInt | None = None
    host_engines: PositiveInt = 1  # engines starting on this host that share its free memory (`all` sets it)
    enforce_eager: bool = False
    # Data and expert parallelism (MoE models; `ascendserve launch` starts the
    # ranks). data_parallel_size > 1 with no data_parallel_rank: vLLM's internal
    # DP, every rank behind this one server. With data_parallel_rank (set per
    # rank by the launcher): one external rank of the deployment, serving and
    # registering on its own. Dense models get independent instances instead.
    data_parallel_size: PositiveInt = 1
    data_parallel_rank: Annotated[int, Meta(ge=0)] | None = None
    data_parallel_size_local: PositiveInt | None = None  # launch: ranks on this node (default: all)
    data_parallel_rank_start: Annotated[int, Meta(ge=0)] = 0  # launch: global rank of this node's first
    data_parallel_address: str = "127.0.0.1"  # DP master: the node of rank 0
    data_parallel_rpc_port: Port = 13345
    enable_expert_parallel: bool = False  # experts sharded over TP x DP ranks instead of TP-split
    vllm: dict[str, PassthroughValue] = {}
    vllm_args: list[str] = []


class KVConfig(_Section):
    # example | pull | push (ascendserve's) | nixl | mooncake | ascend-mooncake | ascend-layerwise |
    # ascend-store | lmcache | multi | module.path:ClassName (protocol/kv_connectors.py)
    connector: str = "example"
    connectors: list[str] = []  # multi: its connectors, in vLLM MultiConnector's order
    flow: Literal["pull", "named", "push", "store"] = "pull"  # how the proxy drives a module.path:ClassName connector
    extra: dict[str, PassthroughValue] = {}  # [kv.extra]: merged into the connector's kv_connector_extra_config
    engine_id: str = ""  # vLLM's engine_id for the engine connectors (default: the instance id)
    buffer_device: Literal["auto", "cpu", "cuda", "npu"] = "auto"  # nixl's kv_buffer_device (auto: the host's)
    path: str = ""  # example connector: shared storage directory
    transport: Literal["tcp", "shm", "mooncake"] = "tcp"
    port: Annotated[int, Meta(ge=0, le=65535)] = 0  # side channel; 0 = server.port + 1000 (TP rank r: + r)
    ttl_s: Annotated[float, Meta(gt=0.0)] = 120.0  # P frees blocks D never pulled after this
    # host buffers (pinned) of KV in device memory, per worker: two units of a read move
    # at once, a layer split by blocks when it is larger than half of this
    staging_mib: Annotated[int, Meta(ge=1, le=65536)] = 256
    load_failure_policy: Literal["recompute", "fail"] = "recompute"


class ECConfig(_Section):
    # example: vLLM's ECExampleConnector (shared directory `path`); shm: host-wide
    # shared-memory region; store: cluster-wide pool (`store_backend`)
    connector: Literal["example", "shm", "store"] = "example"
    enabled: bool = False
    path: str = ""
    store_backend: Literal["memcached", "mooncake"] = "memcached"
    store_url: str = ""  # memcached host:port (the proxy checks it too, to skip the encoder)
    mooncake_master: str = ""  # host:port of mooncake_master (store_backend = mooncake)
    mooncake_segment_mb: Annotated[int, Meta(ge=1)] = 256  # memory an encoder contributes to the Mooncake pool
    shm_name: str = "asf-ec"  # region name in /dev/shm; one per host and cluster
    shm_size_mb: Annotated[int, Meta(ge=1)] = 512
    block_kb: Annotated[int, Meta(ge=4, multiple_of=4)] = 64
    chunk_kb: Annotated[int, Meta(ge=1)] = 512  # memcached value chunk; keep under its item limit (-I)
    ttl_s: Annotated[int, Meta(ge=1, le=2592000)] = 3600  # store entries expire after this
    wait_s: Annotated[float, Meta(ge=0.0)] = 5.0  # consumer waits this long for an item the encoder promised
    pin_ttl_s: Annotated[float, Meta(gt=0.0)] = 60.0  # a consumer's pin on an entry lapses after this
    # consumer receive buffer (store): [2048, max_num_batched_tokens]; default max_num_batched_tokens
    recv_buffer_tokens: Annotated[int, Meta(ge=2048)] | None = None


class NetLoaderConfig(_Section):
    # Engine roles: serve this instance's weights to joiners (a seed inside the process).
    serve: bool = False
    port: Annotated[int, Meta(ge=0, le=65535)] = 0  # seed port; 0 = server.port + 2000
    # Load weights from seeds instead of storage: "host:port" entries (TP rank r tries
    # entry r mod n first), or ["auto"]: the seeds of this model the metaserver knows.
    sources: list[str] = []
    fallback: Literal["disk", "fail"] = "disk"  # when no seed delivers: load from disk, or stop
    timeout_s: Annotated[float, Meta(gt=0.0)] = 30.0  # connect / silence deadline per seed
    # TCP connections a joining instance splits one transfer over (its TP/PP ranks share them): one
    # socket copies at one core's pace (README "NetLoader performance")
    streams: Annotated[int, Meta(ge=1, le=16)] = 4
    max_clients: Annotated[int, Meta(ge=1, le=1024)] = 16  # transfers a seed runs at once


class KVEventsConfig(_Section):
    # vLLM's KV cache events (blocks stored / removed), which the proxy's KV-aware routing reads.
    # Unset: on for pd and prefill (the roles that compute prompts), off for decode. The events
    # carry prompt token ids and ZMQ has no authentication: bound to `host` (loopback unless set).
    enabled: bool | None = None
    host: str = "127.0.0.1"
    # publisher; 0 = server.port + 1500 (internal DP: rank r on + r; an external rank has a port of its own)
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    replay_port: Annotated[int, Meta(ge=0, le=65535)] = 0  # missed batches on request; 0 = port + 1000 (+ r)
    buffer_steps: Annotated[int, Meta(ge=1, le=1_000_000)] = 10_000  # batches kept for replay


class LogConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"


class ClusterConfig(_Section):
    # Shared secret of every internal route and port (admin, registry, metaserver,
    # KV side channel, NetLoader). Without it those accept anyone, so a role that
    # serves them on a non-loopback address refuses to start unless allow_unauthenticated.
    token: str = ""
    allow_unauthenticated: bool = False
    tls_ca: str = ""  # PEM bundle trusted (besides the system's CAs) for https URLs inside the cluster
    metaserver_url: str = ""
    # Address peers use to reach this instance; default: server.host, or this
    # host's name when bound to a wildcard address.
    advertise_host: str = ""


Seconds = Annotated[float, Meta(gt=0.0)]
NonNegative = Annotated[float, Meta(ge=0.0)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
PortList = list[Port]
CountList = list[Annotated[int, Meta(ge=1)]]


class ProxyConfig(_Section):
    mode: Literal["pull", "push"] = "pull"
    encoder_dispatch: Literal["single", "fanout"] = "single"
    encoder_fallback: Literal["local", "fail"] = "local"
    mm_hash_algorithm: Literal["blake3", "sha256", "sha512"] = "blake3"  # the engines' --mm-hasher-algorithm
    max_image_pixels: PositiveInt = 178_956_970  # larger images get 400 at the proxy (vLLM's own default limit)
    # how a pd or prefill instance is chosen: kv (the engines' KV events: cached blocks against load,
    # router/kv_route.py; by load where an instance's cache is unknown), load
    routing: Literal["kv", "load"] = "kv"
    kv_overlap_weight: NonNegative = 1.0  # cost = weight x uncached prompt blocks + blocks in flight
    kv_temperature: NonNegative = 0.0  # 0: the cheapest; > 0: softmax over -cost / (temperature x blocks)
    kv_tokenizer: Literal["auto", "engine", "local"] = "auto"  # the prompt's token ids: local files or /tokenize
    kv_index_max_blocks: PositiveInt = 2_000_000  # per instance; above it the index is rebuilt from scratch
    # processes serving clients on the one port (router/workers.py); 0: the cores given to the proxy,
    # at most 8. Health, discovery and ejection run once, in worker 0; every worker routes by its own
    # in-flight plus the others'
    workers: Annotated[int, Meta(ge=0, le=64)] = 0
    max_retries: Annotated[int, Meta(ge=0, le=20)] = 3
    retry_backoff_s: NonNegative = 0.05
    # a decode/pd instance that fails mid-generation: the request continues on another one with the
    # tokens generated so far (router/ledger.py), at most this many times; 0: end the stream with an error
    migration_limit: Annotated[int, Meta(ge=0, le=20)] = 3
    stall_timeout_s: Seconds = 30.0  # no event from a generating instance for this long: it failed
    # a P->D request continued after a failure goes through a prefill instance again (it still has
    # the prompt cached; D pulls) from this many tokens of prompt + generated on, else D recomputes
    # it alone (bench/migration_route.py: D alone 1.3x faster at 100 tokens, P 3.6x faster at 3.3k)
    migrate_via_prefill_tokens: NonNegativeInt = 1024
    request_timeout_s: Seconds = 600.0
    connect_timeout_s: Seconds = 5.0
    health_interval_s: Seconds = 5.0
    health_timeout_s: Seconds = 3.0
    eject_after: PositiveInt = 3
    registry_poll_s: Seconds = 1.0
    max_body_mb: Annotated[float, Meta(gt=0.0, le=1024.0)] = 32.0
    api_keys: list[str] = []
    backend_api_key: str = ""
    # Static instances: "host:port" or "http://host:port".
    encoder: list[str] = []
    prefill: list[str] = []
    decode: list[str] = []
    pd: list[str] = []
    # vllm-ascend example-proxy flags: hosts x count, ports x consecutive count.
    prefiller_hosts: list[str] = []
    prefiller_ports: PortList = []
    prefiller_hosts_num: CountList = []
    prefiller_ports_inc: CountList = []
    decoder_hosts: list[str] = []
    decoder_ports: PortList = []
    decoder_hosts_num: CountList = []
    decoder_ports_inc: CountList = []


class MetaserverConfig(_Section):
    heartbeat_interval_s: Seconds = 2.0
    heartbeat_timeout_s: Seconds = 6.0
    push_expect_ttl_s: Seconds = 120.0


class RegistryConfig(_Section):
    # Where instances, NetLoader seeds and metaservers are found: the metaserver (one process's memory,
    # cluster.metaserver_url) or etcd (the v3 API through its JSON gateway; discovery/etcd.py)
    backend: Literal["metaserver", "etcd"] = "metaserver"
    endpoints: list[str] = []  # etcd client URLs (http(s)://host:2379); role all: empty starts a local etcd
    cluster: str = "default"  # keys live under /ascendserve/<cluster>/
    lease_ttl_s: Annotated[int, Meta(ge=2, le=3600)] = 10  # an instance's key outlives its last keep-alive by this
    username: str = ""  # etcd auth (the password: prefer ASCENDSERVE_REGISTRY_PASSWORD)
    password: str = ""
    tls_cert: str = ""  # etcd client certificate and key (mTLS); the CA is cluster.tls_ca
    tls_key: str = ""


class AllConfig(_Section):
    topology: Literal["1E1P1D", "1P1D", "1E1PD", "mono"] = "1E1P1D"
    restart_backoff_max_s: Seconds = 30.0
    # a child that exits before its readiness probe ever answered, this many times in a row,
    # is given up and `all` exits non-zero (systemd's start limit); 0: restart for ever
    start_limit: Annotated[int, Meta(ge=0, le=1000)] = 3
    proxies: Annotated[int, Meta(ge=1, le=8)] = 1  # proxies on server.port, then + 2, + 3, ... (+ 1: metaserver)


class Config(_Section):
    role: Literal["encoder", "prefill", "decode", "pd", "proxy", "metaserver", "elastic-server", "all"] | None = None
    config_file: str = ""  # set from --config; `all` hands it to its children
    instance_id: str = ""
    runtime_dir: str = ""
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    kv: KVConfig = msgspec.field(default_factory=KVConfig)
    kv_events: KVEventsConfig = msgspec.field(default_factory=KVEventsConfig)
    ec: ECConfig = msgspec.field(default_factory=ECConfig)
    netloader: NetLoaderConfig = msgspec.field(default_factory=NetLoaderConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    proxy: ProxyConfig = msgspec.field(default_factory=ProxyConfig)
    metaserver: MetaserverConfig = msgspec.field(default_factory=MetaserverConfig)
    registry: RegistryConfig = msgspec.field(default_factory=RegistryConfig)
    all: AllConfig = msgspec.field(default_factory=AllConfig)

    @property
    def is_engine(self) -> bool:
        return self.role in ENGINE_ROLES

    @property
    def scheme(self) -> str:
        return "https" if self.server.tls_cert else "http"

    @property
    def advertise_url(self) -> str:
        return self._url(self.cluster.advertise_host)

    @property
    def local_url(self) -> str:
        """How this process reaches its own server."""
        host = self.server.host
        return self._url("127.0.0.1" if host in ("0.0.0.0", "::", "") else host)

    def _url(self, host: str) -> str:
        return f"{self.scheme}://[{host}]:{self.server.port}" if ":" in host else \
            f"{self.scheme}://{host}:{self.server.port}"
