"""What the four engine roles share: vLLM in this process, no orphans after."""

from __future__ import annotations

from ascendserve.config import Config
from ascendserve.engine.vllm_server import serve
from ascendserve.launch.children import reap_children
from ascendserve.logging import get_logger


def run_engine(config: Config) -> int:
    log = get_logger("ascendserve.role")
    try:
        return serve(config)
    finally:
        killed = reap_children(timeout=10.0)
        if killed:
            log.warning("killed engine processes that outlived the server", pids=killed)
        log.info("stopped")
