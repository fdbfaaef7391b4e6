"""The proxy's view of the EC store: which of a request's items are already encoded.

The proxy hashes each image part exactly as vLLM does (protocol/mm_hash.py)
with the model path its instances report (`root` in /v1/models), asks the
store, and skips the encoder hop when every item is there; the P/PD
instance then loads them itself. Only stores the proxy can see are asked:
`store` (memcached) and `example` (a shared directory). An unreachable
store counts as "not there": the encoder is asked, and the log says so.
`shm` is asked too when the proxy shares the host with its instances (the
region is per host; on another host it is simply empty).
"""

from __future__ import annotations

import asyncio
import os

from ascendserve.config import ECConfig
from ascendserve.connectors.ec.memcached import AsyncClient, StoreError
from ascendserve.protocol.mm_hash import part_hash


class ECLookup:
    def __init__(self, kind: str, client: AsyncClient | None = None, path: str = "", algorithm: str = "blake3",
                 shm: tuple[str, int, int] | None = None):
        self.kind, self.client, self.path, self.algorithm = kind, client, path, algorithm
        self.shm = shm

    @classmethod
    def from_config(cls, ec: ECConfig, algorithm: str) -> "ECLookup | None":
        if ec.connector == "store" and ec.store_backend == "memcached" and ec.store_url:
            return cls("store", AsyncClient(ec.store_url), algorithm=algorithm)
        if ec.connector == "example" and ec.path:
            return cls("example", path=ec.path, algorithm=algorithm)
        if ec.connector == "shm":
            return cls("shm", algorithm=algorithm, shm=(ec.shm_name, ec.shm_size_mb << 20, ec.block_kb << 10))
        return None

    def close(self) -> None:
        """Nothing is held: the shm lookup reads the region as an observer (region.ready_keys)."""

    def hashes(self, parts: list[dict], model_id: str) -> list[str] | None:
        """Every part's mm_hash, or None if any cannot be known here."""
        out = []
        for part in parts:
            h = part_hash(part, model_id, self.algorithm)
            if h is None:
                return None
            out.append(h)
        return out

    async def present(self, hashes: list[str]) -> set[str]:
        """The hashes the store holds; StoreError when it cannot be asked."""
        if self.kind == "store":
            return await self.client.present(hashes)
        # the region's entry table (up to ~1 MB) and the directory are read off the event loop
        read = self._in_region if self.kind == "shm" else self._on_disk
        return await asyncio.get_running_loop().run_in_executor(None, read, hashes)

    def _in_region(self, hashes: list[str]) -> set[str]:
        from ascendserve.connectors.ec.region import ready_keys

        name = self.shm[0]
        try:
            return ready_keys(name, hashes)
        except (OSError, ValueError) as exc:
            raise StoreError(f"EC region {name}: {exc}") from None

    def _on_disk(self, hashes: list[str]) -> set[str]:
        if not os.path.isdir(self.path):
            raise StoreError(f"EC directory {self.path} is missing")
        return {h for h in hashes if os.path.isfile(os.path.join(self.path, h, "encoder_cache.safetensors"))}
