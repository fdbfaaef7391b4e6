"""Proxy: the OpenAI-compatible front door routing E -> P -> D."""

import structlog

from ascendserve.config import Config
from ascendserve.router import workers
from ascendserve.router.app import create_app
from ascendserve.router.hot_path import ClientRoutes
from ascendserve.web import server
from ascendserve.web.limits import raise_open_files_limit

# Each stream holds a client and a backend socket: 1,500 streams need ~3,000 descriptors.
FEW_OPEN_FILES = 8192


def run(config: Config) -> int:
    before, limit = raise_open_files_limit()
    log = structlog.get_logger("ascendserve.proxy")
    if limit < FEW_OPEN_FILES:
        log.warning("open files limit is low for a proxy; raise the hard limit (ulimit -Hn, LimitNOFILE=)",
                    limit=limit)
    elif limit != before:
        log.info("open files limit raised", before=before, limit=limit)
    count = workers.worker_count(config.proxy.workers)
    if count == 1:
        return server.run(ClientRoutes(create_app(config)), config.server)
    return workers.supervise(count, lambda worker: server.run(ClientRoutes(create_app(config, worker)),
                                                              config.server))
