"""What the four engine roles share: vLLM in this process, registry heartbeat, no orphans after,
no shared memory left by a killed predecessor."""

from __future__ import annotations

from ascendserve.config import Config
from ascendserve.discovery.heartbeat import Heartbeat, registrar_for
from ascendserve.engine.startup_stop import exit_now
from ascendserve.engine.kv_args import kv_registration
from ascendserve.engine import kv_events
from ascendserve.engine.vllm_server import interrupted_during_startup, passthrough_args, serve
from ascendserve.launch.children import reap_children
from ascendserve.launch.shm_ledger import ShmLedger
from ascendserve.logging import get_logger
from ascendserve.netloader.checkpoint import seed_registration


def run_engine(config: Config) -> int:
    log = get_logger("ascendserve.role")
    ledger = ShmLedger(config.runtime_dir, config.instance_id)
    removed = ledger.sweep()
    if removed:
        log.warning("removed the shared memory a killed run of this instance left", names=removed)
    ledger.start()
    heartbeat = None
    user_args = passthrough_args(config)
    if kv_events.enabled(config, user_args) and not kv_events.is_loopback(config.kv_events.host):
        log.warning("KV events are published on a non-loopback address without authentication: whoever "
                    "reaches it reads the token ids of every prompt this instance caches",
                    address=f"{config.kv_events.host}:{config.kv_events.port}")
    if (registrar := registrar_for(config)) is not None:
        heartbeat = Heartbeat(registrar, config.instance_id, config.role, config.advertise_url, config.local_url,
                              config.model.served_name or config.model.path,
                              config.metaserver.heartbeat_interval_s,
                              {**seed_registration(config), **kv_registration(config),
                               **kv_events.registration(config, user_args)},
                              ready_headers={"x-cluster-token": config.cluster.token} if config.cluster.token
                              else None).start()
    try:
        code = serve(config)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        ledger.stop()
        killed = reap_children(timeout=10.0)
        if killed:
            log.warning("killed engine processes that outlived the server", pids=killed)
        log.info("stopped")
    if interrupted_during_startup():
        exit_now(code)  # nothing of vLLM's half-built state is worth an interpreter finalization
    return code
