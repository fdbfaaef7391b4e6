"""The config's second half: what follows from the merged values (runtime dir, instance id, the
proxy's and NetLoader's addresses expanded and checked, KV events' defaults) and the checks that
span keys (the KV connector, parallelism, the registry, callback URLs, the model directory).
`config.load()` ends here.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from ascendserve.config_schema import ClusterConfig, Config, ConfigError, ProxyConfig, RegistryConfig
from ascendserve.flags import ROLES
from ascendserve.security import check


def finish(config: Config, env: dict[str, str]) -> Config:
    """What follows from the merged values (defaults that depend on others, addresses expanded) and
    the checks across keys; ConfigError with an operator message."""
    if config.role is None:
        raise ConfigError("no role given: pass --role (or set ASCENDSERVE_ROLE / role = ... in the file); "
                          f"allowed: {', '.join(ROLES)}")
    if not config.runtime_dir:
        config.runtime_dir = str(Path(env.get("TMPDIR", "/tmp")) / f"ascendserve-{os.getuid()}")
    if not config.instance_id:
        config.instance_id = f"{config.role}-{socket.gethostname()}-{config.server.port}"
    if config.is_engine:
        _check_model(config.model.path)
        if not config.kv.path:
            config.kv.path = str(Path(config.runtime_dir) / "kv")
        if not config.kv.port:
            config.kv.port = config.server.port + 1000
            if config.kv.port > 65535:
                raise ConfigError(f"kv.port defaults to server.port + 1000 = {config.kv.port}, above 65535; "
                                  "set kv.port (--kv-port)")
        _finish_kv_events(config)
        if not config.ec.path:
            config.ec.path = str(Path(config.runtime_dir) / "ec")
        if not config.kv.engine_id:
            config.kv.engine_id = config.instance_id
        _check_parallel(config)
        if config.netloader.sources and config.role == "encoder":
            raise ConfigError("netloader.sources: the encoder role loads its weights from disk "
                              "(it loads only the vision part of a checkpoint)")
    _check_kv_connector(config)
    if config.is_engine or config.role == "elastic-server":
        if (config.netloader.serve or config.role == "elastic-server") and not config.cluster.token:
            raise ConfigError("a NetLoader seed (netloader.serve, or the elastic-server role) streams the model's "
                              "weights to whoever asks: set cluster.token (--cluster-token / "
                              "ASCENDSERVE_CLUSTER_TOKEN) so only the cluster can")
        if config.netloader.sources not in ([], ["auto"]):
            for source in config.netloader.sources:
                instance_url("netloader.sources", source)  # host:port, checked now rather than at load time
        if config.netloader.sources == ["auto"] and not config.cluster.metaserver_url \
                and config.registry.backend != "etcd":
            raise ConfigError("netloader.sources = ['auto'] finds seeds through the registry: "
                              "set cluster.metaserver_url (--metaserver-url) or registry.backend = 'etcd'")
        if not config.netloader.port:
            config.netloader.port = config.server.port + 2000
            if config.netloader.port > 65535:
                raise ConfigError(f"netloader.port defaults to server.port + 2000 = {config.netloader.port}, "
                                  "above 65535; set netloader.port (--netloader-port)")
    if config.role == "elastic-server":
        _check_model(config.model.path)
    if config.role == "all" and config.model.path:
        _check_model(config.model.path)
    if not config.cluster.advertise_host:
        host = config.server.host
        config.cluster.advertise_host = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    if config.cluster.metaserver_url:
        _check_callback_url("cluster.metaserver_url", config.cluster.metaserver_url)
    _check_registry(config)
    if config.role == "proxy":
        _finish_proxy(config.proxy, config.cluster, config.registry)
    check(config)
    return config


def _check_kv_connector(config: Config) -> None:
    from ascendserve.protocol import kv_connectors as kc

    kv = config.kv
    why = kc.setting_why_not(kv.connector, kv.connectors, bool(kv.extra), config.engine.data_parallel_size)
    if why:
        raise ConfigError(why)


def _check_parallel(config: Config) -> None:
    e = config.engine
    if e.data_parallel_rank is not None and e.data_parallel_rank >= e.data_parallel_size:
        raise ConfigError(f"engine.data_parallel_rank = {e.data_parallel_rank} is outside "
                          f"data_parallel_size = {e.data_parallel_size} (ranks 0..{e.data_parallel_size - 1})")
    local = e.data_parallel_size_local or e.data_parallel_size - e.data_parallel_rank_start
    if e.data_parallel_rank_start + local > e.data_parallel_size:
        raise ConfigError(f"engine.data_parallel_rank_start = {e.data_parallel_rank_start} with "
                          f"data_parallel_size_local = {local} does not fit in data_parallel_size = "
                          f"{e.data_parallel_size}")


def _check_callback_url(key: str, url: str) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{key} = {url!r} is invalid; allowed: http(s)://host:port")
    if parts.hostname in ("0.0.0.0", "::"):
        raise ConfigError(f"{key} = {url!r} is a wildcard address; peers call it back, "
                          "so give a reachable host name or address")


def instance_url(key: str, address: str) -> str:
    """'host:port' or 'http(s)://host:port' -> base URL; ConfigError otherwise."""
    url = address if "://" in address else f"http://{address}"
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        port = None
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ConfigError(f"{key}: {address!r} is invalid; allowed: host:port or http(s)://host:port "
                          "with a port in 1..65535")
    return f"{parts.scheme}://{parts.netloc}"


def _expand(kind: str, hosts: list[str], ports: list[int], hosts_num: list[int], ports_inc: list[int]) -> list[str]:
    """vllm-ascend's expansion: each host repeated hosts_num times, each port
    widened to ports_inc consecutive ports, then zipped pairwise."""
    if hosts_num:
        if len(hosts_num) != len(hosts):
            raise ConfigError(f"--{kind}-hosts-num has {len(hosts_num)} values for {len(hosts)} --{kind}-hosts")
        hosts = [h for h, n in zip(hosts, hosts_num) for _ in range(n)]
    if ports_inc:
        if len(ports_inc) != len(ports):
            raise ConfigError(f"--{kind}-ports-inc has {len(ports_inc)} values for {len(ports)} --{kind}-ports")
        ports = [p + i for p, n in zip(ports, ports_inc) for i in range(n)]
    for port in ports:
        if not 1 <= port <= 65535:
            raise ConfigError(f"--{kind}-ports expands to {port}; allowed: 1..65535")
    if len(hosts) != len(ports):
        raise ConfigError(f"{len(hosts)} {kind} hosts but {len(ports)} {kind} ports (after expansion); "
                          "they pair up one to one")
    return [f"{h}:{p}" for h, p in zip(hosts, ports)]


def _finish_kv_events(config: Config) -> None:
    ev, e = config.kv_events, config.engine
    if ev.enabled is None:
        ev.enabled = config.role in ("pd", "prefill")
    ranks = e.data_parallel_size if e.data_parallel_rank is None else 1  # internal DP: a publisher per rank
    if not ev.port:
        ev.port = config.server.port + 1500
    if not ev.replay_port:
        # far from the publishers: ranks of `launch` serve on consecutive ports
        ev.replay_port = ev.port + 1000
    if ev.enabled and max(ev.port, ev.replay_port) + ranks - 1 > 65535:
        raise ConfigError(f"kv_events ports {ev.port} and {ev.replay_port} (+ DP ranks) go above 65535; set "
                          "kv_events.port and kv_events.replay_port (--kv-events-port)")


def _check_registry(config: Config) -> None:
    reg = config.registry
    if reg.backend != "etcd":
        return
    if not reg.endpoints and config.role != "all":
        raise ConfigError("registry.backend = 'etcd' needs registry.endpoints (--registry-endpoints "
                          "http://host:2379 ...)")
    for url in reg.endpoints:
        if not re.match(r"^https?://[^/\s]+/?$", url):
            raise ConfigError(f"registry.endpoints: {url!r} is not an etcd client URL http(s)://host:port")
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", reg.cluster):
        raise ConfigError(f"registry.cluster = {reg.cluster!r}: 1..64 of letters, digits, '.', '_', '-'")
    if bool(reg.tls_cert) != bool(reg.tls_key):
        raise ConfigError("registry.tls_cert and registry.tls_key go together: set both (PEM files) or neither")
    if reg.password and not reg.username:
        raise ConfigError("registry.password without registry.username: set the etcd user too")


def _finish_proxy(proxy: ProxyConfig, cluster: ClusterConfig, registry: RegistryConfig) -> None:
    if proxy.prefiller_hosts or proxy.prefiller_ports:
        proxy.prefill += _expand("prefiller", proxy.prefiller_hosts, proxy.prefiller_ports,
                                 proxy.prefiller_hosts_num, proxy.prefiller_ports_inc)
    if proxy.decoder_hosts or proxy.decoder_ports:
        proxy.decode += _expand("decoder", proxy.decoder_hosts, proxy.decoder_ports,
                                proxy.decoder_hosts_num, proxy.decoder_ports_inc)
    for role in ("encoder", "prefill", "decode", "pd"):
        setattr(proxy, role, [instance_url(f"proxy.{role}", a) for a in getattr(proxy, role)])
    if proxy.mode == "push" and not cluster.metaserver_url and registry.backend != "etcd":
        raise ConfigError("proxy.mode = 'push' needs cluster.metaserver_url (--metaserver-url), or "
                          "registry.backend = 'etcd' (metaservers found there): decode instances ask a "
                          "metaserver to dispatch their prefill")


def _check_model(path: str) -> None:
    if not path:
        raise ConfigError("model.path is required for engine roles: pass --model DIR "
                          "(or ASCENDSERVE_MODEL / [model] path = ...)")
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"model.path = {path!r} does not exist or is not a directory; "
                          "allowed: a local model directory holding config.json")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model.path = {path!r} has no config.json; "
                          "allowed: a local model directory holding config.json")
