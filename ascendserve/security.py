"""Start-up security checks of a loaded config: what this role serves that only the
cluster may use, the refusal to serve it off loopback without a token, TLS files,
and the warnings an operator should hear (called by config.load and the CLI)."""

from __future__ import annotations

import ipaddress

from ascendserve.config_schema import Config, ConfigError

TLS_ROLES = ("proxy", "metaserver")


def internal_listeners(config: Config) -> list[str]:
    """What this role serves that only the cluster may use (guarded by cluster.token)."""
    role = config.role
    found = []
    if role == "proxy":
        found.append("the proxy's admin routes")
    if role == "metaserver":
        found.append("the metaserver's registry and push routes")
    if role in ("prefill", "decode") and config.kv.connector in ("pull", "push"):
        found.append("the KV side channel")
    return found


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def open_without_token(config: Config) -> list[str]:
    """Internal listeners this process runs without a cluster token (for a start-up warning)."""
    return [] if config.cluster.token else internal_listeners(config)


def security_warnings(config: Config) -> list[str]:
    """What an operator should hear at start-up (the hard refusals are in check)."""
    out = []
    exposed = open_without_token(config)
    if exposed and is_loopback(config.server.host):
        out.append(f"cluster.token is not set: {' and '.join(exposed)} accept any process on this host")
    elif exposed:
        out.append(f"UNAUTHENTICATED: {' and '.join(exposed)} served on {config.server.host} without "
                   "cluster.token (allow_unauthenticated = true): anyone who can reach this host may use them")
    if config.is_engine and not config.cluster.token and not is_loopback(config.server.host):
        out.append(f"UNAUTHENTICATED: this engine serves its client API and vLLM's admin routes on "
                   f"{config.server.host} without cluster.token: anyone who can reach this host may use them, "
                   "around the proxy's API keys and limits; set cluster.token (--cluster-token / "
                   "ASCENDSERVE_CLUSTER_TOKEN, the proxy's), and only the cluster gets in")
    if config.cluster.token and len(config.cluster.token) < 16 and (internal_listeners(config) or config.is_engine):
        out.append(f"cluster.token is short ({len(config.cluster.token)} characters); use 32 or more random "
                   "characters, e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return out


def check(config: Config) -> None:
    """The hard refusals, at config load (ConfigError, exit 2)."""
    from ascendserve import tls

    server, cluster = config.server, config.cluster
    if server.tls_cert or server.tls_key:
        if config.role not in TLS_ROLES:
            raise ConfigError(f"server.tls_cert / server.tls_key (--tls-cert / --tls-key) are for the "
                              f"{' and '.join(TLS_ROLES)} roles, not {config.role!r}")
        if (problem := tls.server_files_problem(server.tls_cert, server.tls_key)) is not None:
            raise ConfigError(problem)
    if cluster.tls_ca and (problem := tls.ca_file_problem(cluster.tls_ca)) is not None:
        raise ConfigError(problem)
    exposed = open_without_token(config)
    if exposed and not is_loopback(server.host) and not cluster.allow_unauthenticated:
        raise ConfigError(
            f"server.host = {server.host!r} serves {' and '.join(exposed)} to other hosts, and without "
            "cluster.token anyone who can reach it may use them: set cluster.token (--cluster-token / "
            "ASCENDSERVE_CLUSTER_TOKEN), bind 127.0.0.1, or set cluster.allow_unauthenticated = true "
            "(--allow-unauthenticated) to run open on purpose")
