"""Proxy: the OpenAI-compatible front door routing E -> P -> D."""

from ascendserve.config import Config
from ascendserve.router.app import create_app
from ascendserve.web import server


def run(config: Config) -> int:
    return server.run(create_app(config), config.server.host, config.server.port)
