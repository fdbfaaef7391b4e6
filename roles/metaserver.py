"""Metaserver: the cluster registry and the push-mode prefill dispatcher."""

from ascendserve.config import Config
from ascendserve.metaserver.app import create_app
from ascendserve.web import server


def run(config: Config) -> int:
    return server.run(create_app(config), config.server)
