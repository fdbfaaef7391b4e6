"""Elastic-server: serves one model's weights, held in memory, to joining instances (NetLoader)."""

from ascendserve.config import Config, ConfigError
from ascendserve.discovery.heartbeat import Heartbeat
from ascendserve.netloader.checkpoint import CheckpointError, seed_registration
from ascendserve.netloader.elastic import create_app, start_seed
from ascendserve.web import server


def run(config: Config) -> int:
    try:
        seed = start_seed(config)
    except (CheckpointError, OSError) as exc:
        raise ConfigError(f"elastic-server cannot serve {config.model.path}: {exc}") from None
    heartbeat = None
    if config.cluster.metaserver_url:
        heartbeat = Heartbeat(config.cluster.metaserver_url, config.cluster.token, config.instance_id,
                              config.role, config.advertise_url, config.local_url,
                              config.model.served_name or config.model.path, config.metaserver.heartbeat_interval_s,
                              seed_registration(config), ready_path="/health",
                              tls_ca=config.cluster.tls_ca).start()
    try:
        return server.run(create_app(seed, config.cluster.token), config.server)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        seed.stop()
