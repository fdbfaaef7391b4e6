"""The elastic-server: a NetLoader seed without an engine.

Holds one model's weights in its own memory (read once at start, checksummed)
and streams them to many joining instances at once; a small HTTP side
(`GET /health`, and `GET /v1/seed` with the cluster token) tells the registry and
operators it is there.
No torch, no vLLM: it starts in seconds and needs only RAM for the weights.
"""

from __future__ import annotations

from litestar import Litestar, get

from ascendserve.netloader.checkpoint import CheckpointIndex, MemorySource
from ascendserve.netloader.seed import Seed
from ascendserve.web.auth import bearer_guard
from ascendserve.web.errors import EXCEPTION_HANDLERS


def create_app(seed: Seed, token: str) -> Litestar:
    """`/health` is open (probes); `/v1/seed` describes the model, so it takes the cluster token."""
    @get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @get("/v1/seed", guards=[bearer_guard([token], "cluster token")])
    async def describe() -> dict:
        index = seed.index
        return {"model": index.model_dir, "identity": index.identity, "tensors": len(index.entries),
                "total_bytes": index.total_bytes, "port": seed.port, "transfers_served": seed.served,
                "connections_refused": seed.refused}

    return Litestar(route_handlers=[health, describe], exception_handlers=EXCEPTION_HANDLERS, openapi_config=None)


def start_seed(config) -> Seed:
    index = CheckpointIndex.scan(config.model.path)
    return Seed(MemorySource(index), config.cluster.token, config.server.host, config.netloader.port,
                config.netloader.max_clients, idle_s=config.netloader.timeout_s).start()
