"""Elastic-server: serves one model's weights, held in memory, to joining instances (NetLoader)."""

from ascendserve.config import Config, ConfigError
from ascendserve.discovery.heartbeat import Heartbeat, registrar_for
from ascendserve.netloader.checkpoint import CheckpointError, seed_registration
from ascendserve.netloader.elastic import create_app, start_seed
from ascendserve.web import server


def run(config: Config) -> int:
    try:
        seed = start_seed(config)
    except (CheckpointError, OSError) as exc:
        raise ConfigError(f"elastic-server cannot serve {config.model.path}: {exc}") from None
    heartbeat = None
    if (registrar := registrar_for(config)) is not None:
        heartbeat = Heartbeat(registrar, config.instance_id, config.role, config.advertise_url, config.local_url,
                              config.model.served_name or config.model.path, config.metaserver.heartbeat_interval_s,
                              seed_registration(config), ready_path="/health").start()
    try:
        return server.run(create_app(seed, config.cluster.token), config.server)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        seed.stop()
