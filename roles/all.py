"""All: metaserver, engine roles and proxy on one host, as supervised children.

Ports: proxy = --port, metaserver = --port + 1, engines = --port + 10, + 11, ...
Engines register with the metaserver; the proxy finds them there. Without
--model, a tiny random-weight demo model is built in the runtime directory.
"""

from __future__ import annotations

import secrets
import signal
import threading
import urllib.request
from pathlib import Path

from ascendserve.config import Config, environ
from ascendserve.launch.supervisor import Child, Supervisor, self_command
from ascendserve.logging import get_logger

TOPOLOGIES = {  # engine roles, in start order, and the extra flags each needs
    "1E1P1D": [("encoder", []), ("prefill", ["--ec-enabled"]), ("decode", [])],
    "1P1D": [("prefill", []), ("decode", [])],
    "1E1PD": [("encoder", []), ("pd", ["--ec-enabled"])],
    "mono": [("pd", [])],
}
# What the demo model needs on a CPU (vLLM's CPU attention, no bf16 everywhere).
DEMO_ENGINE_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
                     "--gpu-memory-utilization", "0.08"]


def _demo_model(config: Config, topology: str) -> str:
    kind = "vl" if "E" in topology else "text"
    path = Path(config.runtime_dir) / f"demo-model-{kind}"
    if not (path / "config.json").is_file():
        from ascendserve.models.tiny import build, default_spec

        get_logger().info("building the tiny demo model", kind=kind, path=str(path))
        build(path, default_spec(kind))
    return str(path)


def _children(config: Config, model: str, extra: list[str], token_env: dict) -> list[Child]:
    base, cli, run_dir = config.server.port, self_command(), Path(config.runtime_dir)
    common = ["--log-level", config.log.level, "--log-format", config.log.format, "--runtime-dir", config.runtime_dir]
    if config.config_file:
        common += ["--config", config.config_file]
    meta_url = f"http://127.0.0.1:{base + 1}"
    # our connector for the proxy's mode, unless the config picked one (the children share the token)
    connector = config.kv.connector if config.kv.connector != "example" else \
        ("push" if config.proxy.mode == "push" else "pull")
    kv = ["--kv-connector", connector] + (["--kv-path", str(run_dir / "kv")] if connector == "example" else [])
    ec = ["--ec-path", str(run_dir / "ec")]
    paths = {"encoder": ec, "prefill": kv + ec, "decode": kv, "pd": ec}
    children = [Child("metaserver", [*cli, "--role", "metaserver", "--port", str(base + 1), *common], token_env)]
    for i, (role, flags) in enumerate(TOPOLOGIES[config.all.topology]):
        children.append(Child(role, [*cli, "--role", role, "--model", model, "--port", str(base + 10 + i),
                                     "--metaserver-url", meta_url, *paths[role], *flags, *extra, *common],
                              token_env))
    children.append(Child("proxy", [*cli, "--role", "proxy", "--port", str(base), "--host", config.server.host,
                                    "--metaserver-url", meta_url, "--mode", config.proxy.mode, *common], token_env))
    return children


def _announce(config: Config, model: str, stopping: threading.Event) -> None:
    """Print the URL and a sample request once the proxy can serve."""
    url = f"http://127.0.0.1:{config.server.port}"
    while not stopping.is_set():
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        stopping.wait(1.0)
    if stopping.is_set():
        return
    print(f"\nascendserve cluster ({config.all.topology}) ready at {url}\n"
          f"  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\\n"
          f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
          f"\"max_tokens\": 16}}'\n", flush=True)


def run(config: Config) -> int:
    log = get_logger("ascendserve.all")
    model, extra = config.model.path, []
    if not model:
        model, extra = _demo_model(config, config.all.topology), DEMO_ENGINE_FLAGS
    token = config.cluster.token or secrets.token_urlsafe(24)
    # Through the environment, not argv: `ps` shows every process's arguments.
    token_env = {"ASCENDSERVE_CLUSTER_TOKEN": token}
    supervisor = Supervisor(_children(config, model, extra, token_env), environ(), config.all.restart_backoff_max_s)
    stop = supervisor.stopping
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    supervisor.start_all()
    threading.Thread(target=_announce, args=(config, model, stop), daemon=True).start()
    log.info("cluster starting", topology=config.all.topology, proxy_port=config.server.port, model=model)
    try:
        supervisor.run()
    finally:
        supervisor.stop_all()
    return 0
