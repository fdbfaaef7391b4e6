"""What the four engine roles share: vLLM in this process, registry heartbeat, no orphans after."""

from __future__ import annotations

from ascendserve.config import Config
from ascendserve.discovery.heartbeat import Heartbeat
from ascendserve.engine.vllm_server import serve
from ascendserve.launch.children import reap_children
from ascendserve.logging import get_logger
from ascendserve.netloader.checkpoint import seed_registration


def run_engine(config: Config) -> int:
    log = get_logger("ascendserve.role")
    heartbeat = None
    if config.cluster.metaserver_url:
        heartbeat = Heartbeat(config.cluster.metaserver_url, config.cluster.token, config.instance_id,
                              config.role, config.advertise_url, config.local_url,
                              config.model.served_name or config.model.path,
                              config.metaserver.heartbeat_interval_s, seed_registration(config)).start()
    try:
        return serve(config)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        killed = reap_children(timeout=10.0)
        if killed:
            log.warning("killed engine processes that outlived the server", pids=killed)
        log.info("stopped")
