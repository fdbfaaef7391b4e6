"""All: metaserver, engine roles and proxy on one host, as supervised children.

Ports: proxy = --port, metaserver = --port + 1, more proxies (`[all] proxies`) = --port + 2, + 3, ...,
engines = --port + 10, + 11, ...; a local etcd (below) = --port + 20 (clients) and + 21 (peers).
Engines register with the metaserver, or in etcd with `[registry] backend = "etcd"`: the configured
endpoints, or, without any, an etcd this role starts from the `etcd` it finds installed (one
member, its data in the runtime directory). The proxies find them there. Without
--model, a tiny random-weight demo model is built in the runtime directory
(and started exactly as a user's model would be). A child that fails to start
`[all] start_limit` times in a row (exits before its /health answered) is
given up: its last output lines are printed, the others are stopped and `all`
exits with status 1.
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from ascendserve.config import Config, ConfigError, environ
from ascendserve.launch.supervisor import Child, Supervisor, child_log_format, probe_host, self_command
from ascendserve.logging import get_logger

TOPOLOGIES = {  # engine roles, in start order, and the extra flags each needs
    "1E1P1D": [("encoder", []), ("prefill", ["--ec-enabled"]), ("decode", [])],
    "1P1D": [("prefill", []), ("decode", [])],
    "1E1PD": [("encoder", []), ("pd", ["--ec-enabled"])],
    "mono": [("pd", [])],
}
STOP_TIMEOUT_S = 8.0  # SIGTERM to SIGKILL for a child (an engine stops within ~6 s, start-up included)


def _demo_model(config: Config, topology: str) -> str:
    kind = "vl" if "E" in topology else "text"
    path = Path(config.runtime_dir) / f"demo-model-{kind}"
    if not (path / "config.json").is_file():
        from ascendserve.models.tiny import build, default_spec

        get_logger().info("building the tiny demo model", kind=kind, path=str(path))
        build(path, default_spec(kind))
    return str(path)


def _etcd(config: Config) -> tuple[list[Child], list[str]]:
    """A local one-member etcd when the registry is etcd and no endpoint is configured."""
    if config.registry.backend != "etcd":
        return [], []
    if config.registry.endpoints:
        return [], list(config.registry.endpoints)
    binary = shutil.which("etcd")
    if binary is None:
        raise ConfigError("registry.backend = 'etcd' without registry.endpoints: `all` starts an etcd, but none is "
                          "installed (Debian: apt-get install etcd-server); or set registry.endpoints")
    client, peer = config.server.port + 20, config.server.port + 21
    data = Path(config.runtime_dir) / f"etcd-{client}"
    argv = [binary, "--name", "all", "--data-dir", str(data),
            "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls",
            f"http://127.0.0.1:{client}", "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"all=http://127.0.0.1:{peer}", "--log-level", "warn"]
    return [Child("etcd", argv, {}, ready_url=f"http://127.0.0.1:{client}/health")], [f"http://127.0.0.1:{client}"]


def proxy_ports(config: Config) -> list[int]:
    base = config.server.port
    return [base] + [base + 1 + i for i in range(1, config.all.proxies)]


def _children(config: Config, model: str, token_env: dict) -> list[Child]:
    base, cli, run_dir = config.server.port, self_command(), Path(config.runtime_dir)
    common = ["--log-level", config.log.level, "--log-format", child_log_format(config.log.format),
              "--runtime-dir", config.runtime_dir]
    if config.config_file:
        common += ["--config", config.config_file]
    meta_url = f"http://127.0.0.1:{base + 1}"
    etcd, endpoints = _etcd(config)
    # where the children register and look: etcd (the metaserver then only dispatches push mode), or it
    registry = ["--registry-backend", "etcd", "--registry-endpoints", *endpoints,
                "--registry-cluster", config.registry.cluster] if endpoints else ["--metaserver-url", meta_url]
    # our connector for the proxy's mode, unless the config picked one (the children share the token)
    connector = config.kv.connector if config.kv.connector != "example" else \
        ("push" if config.proxy.mode == "push" else "pull")
    kv = ["--kv-connector", connector] + (["--kv-path", str(run_dir / "kv")] if connector == "example" else [])
    ec = ["--ec-path", str(run_dir / "ec")]
    paths = {"encoder": ec, "prefill": kv + ec, "decode": kv, "pd": ec}
    engines = TOPOLOGIES[config.all.topology]
    # readiness probes: the engines' (vLLM's) /health, the metaserver's /health, the proxy's /healthcheck
    # (its /health says whether the cluster can serve, which is not the proxy's own start)
    scheme = "https" if config.server.tls_cert else "http"
    children = [*etcd, Child("metaserver", [*cli, "--role", "metaserver", "--port", str(base + 1),
                                            *(registry if endpoints else []), *common], token_env,
                             ready_url=f"{scheme}://127.0.0.1:{base + 1}/health")]
    for i, (role, flags) in enumerate(engines):
        port = base + 10 + i
        children.append(Child(role, [*cli, "--role", role, "--model", model, "--port", str(port),
                                     *registry, "--host-engines", str(len(engines)),
                                     *paths[role], *flags, *common],
                              token_env, ready_url=f"http://127.0.0.1:{port}/health"))
    for i, port in enumerate(proxy_ports(config)):
        children.append(Child("proxy" if i == 0 else f"proxy-{i + 1}",
                              [*cli, "--role", "proxy", "--port", str(port), "--host", config.server.host,
                               *registry, "--mode", config.proxy.mode, *common], token_env,
                              ready_url=f"{scheme}://{probe_host(config.server.host)}:{port}/healthcheck"))
    return children


WAITING_REPORT_S = 30.0


def _announce(config: Config, model: str, stopping: threading.Event) -> None:
    """Print the URL and a sample request once the proxy can serve; until then, every
    WAITING_REPORT_S, what the proxy's /health says is missing."""
    url = f"http://127.0.0.1:{config.server.port}"
    log = get_logger("ascendserve.all")
    started = last_report = time.monotonic()
    why = "the proxy does not answer yet"
    while not stopping.is_set():
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except urllib.error.HTTPError as exc:  # 503 with the proxy's explanation
            try:
                why = json.loads(exc.read()).get("error", {}).get("message", why)
            except (ValueError, AttributeError, OSError):
                pass
        except OSError:
            pass
        if time.monotonic() - last_report >= WAITING_REPORT_S:
            last_report = time.monotonic()
            log.info("cluster not ready yet", waited_s=round(last_report - started), why=why)
        stopping.wait(1.0)
    if stopping.is_set():
        return
    more = [f"http://127.0.0.1:{port}" for port in proxy_ports(config)[1:]]
    print(f"\nascendserve cluster ({config.all.topology}) ready at {url}"
          + (f" (and {', '.join(more)})" if more else "") + "\n"
          f"  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\\n"
          f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
          f"\"max_tokens\": 16}}'\n", flush=True)


def run(config: Config) -> int:
    log = get_logger("ascendserve.all")
    model = config.model.path or _demo_model(config, config.all.topology)
    token = config.cluster.token or secrets.token_urlsafe(24)
    # Through the environment, not argv: `ps` shows every process's arguments.
    token_env = {"ASCENDSERVE_CLUSTER_TOKEN": token}
    supervisor = Supervisor(_children(config, model, token_env), environ(), config.all.restart_backoff_max_s,
                            start_limit=config.all.start_limit, stop_timeout_s=STOP_TIMEOUT_S)
    stop = supervisor.stopping
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    supervisor.start_all()
    threading.Thread(target=_announce, args=(config, model, stop), daemon=True).start()
    log.info("cluster starting", topology=config.all.topology, proxy_ports=proxy_ports(config), model=model,
             registry=config.registry.backend)
    try:
        supervisor.run()
    finally:
        supervisor.stop_all()
    if supervisor.gave_up is not None:
        log.error("cluster stopped: a child could not start", child=supervisor.gave_up.name,
                  start_limit=config.all.start_limit)
    return supervisor.exit_code()
