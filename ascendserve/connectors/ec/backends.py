"""Where encoder outputs live between an encoder and its consumers.

    shm        the host-wide Region (connectors/ec/region.py): same-host only
    memcached  a cluster-wide pool (connectors/ec/memcached.py), chunked entries
    mooncake   Mooncake Store (its master must run; `mooncake.store` installed)

All keyed by vLLM's mm_hash. Producers `put`, schedulers ask `header`
(presence plus what to allocate), consumers `read_into` a buffer. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ascendserve.connectors.ec import memcached
from ascendserve.connectors.ec.memcached import StoreError


@dataclass(frozen=True)
class ItemInfo:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class Store:
    """A cluster-wide EC pool."""

    name = ""

    def put(self, mm_hash: str, data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> bool:
        raise NotImplementedError

    def info(self, mm_hash: str) -> ItemInfo | None:
        raise NotImplementedError

    def read_into(self, mm_hash: str, info: ItemInfo, out: np.ndarray) -> bool:
        raise NotImplementedError

    def delete(self, mm_hash: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class MemcachedStore(Store):
    name = "memcached"

    def __init__(self, url: str, chunk_bytes: int, ttl_s: int, timeout_s: float = 2.0):
        self.client = memcached.Client(url, timeout_s)
        self.chunk_bytes, self.ttl_s = chunk_bytes, ttl_s
        self._headers: dict[str, memcached.Header] = {}

    def put(self, mm_hash, data, dtype, shape) -> bool:
        return memcached.put_entry(self.client, mm_hash, memoryview(data), dtype, shape, self.chunk_bytes, self.ttl_s)

    def info(self, mm_hash) -> ItemInfo | None:
        h = memcached.get_header(self.client, mm_hash)
        if h is None:
            return None
        self._headers[mm_hash] = h
        if len(self._headers) > 4096:
            self._headers.pop(next(iter(self._headers)))
        return ItemInfo(h.dtype, tuple(h.shape), h.nbytes)

    def read_into(self, mm_hash, info, out) -> bool:
        h = self._headers.pop(mm_hash, None) or memcached.get_header(self.client, mm_hash)
        if h is None or h.nbytes != info.nbytes:
            return False
        return memcached.read_entry_into(self.client, mm_hash, h, memoryview(out))

    def delete(self, mm_hash) -> None:
        memcached.delete_entry(self.client, mm_hash)

    def close(self) -> None:
        self.client.close()


class MooncakeStore(Store):
    """Mooncake Store (P2PHANDSHAKE: only its master runs besides us).

    The value is one object (`asf-ec:<hash>:data`, written and read without
    a staging copy: put_from / get_into on our buffers) plus the header
    object. Data lives in the segments the clients contribute: producers
    give `segment_bytes`, consumers none, so an entry goes when the encoder
    that holds it stops (Mooncake's master also evicts when segments fill).
    """

    name = "mooncake"

    def __init__(self, master: str, local_host: str, segment_bytes: int, buffer_bytes: int, metadata: str):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise StoreError(f"[ec] store_backend=mooncake needs the mooncake package: {exc}") from None
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(local_host, metadata, segment_bytes, buffer_bytes, "tcp", "", master)
        if rc != 0:
            raise StoreError(f"Mooncake Store setup against master {master} failed (code {rc})")

    @staticmethod
    def _data_key(mm_hash: str) -> str:
        return memcached.PREFIX + mm_hash + ":data"

    def put(self, mm_hash, data, dtype, shape) -> bool:
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        head = memcached.new_header(dtype, shape, data.nbytes, max(1, data.nbytes))
        rc = self.store.put_from(self._data_key(mm_hash), data.ctypes.data, data.nbytes)
        if rc != 0:
            if rc <= -900:
                raise StoreError(f"Mooncake Store unreachable (code {rc})")
            return False
        import msgspec

        return self.store.put(memcached.header_key(mm_hash), msgspec.msgpack.encode(head)) == 0

    def info(self, mm_hash) -> ItemInfo | None:
        raw = self.store.get(memcached.header_key(mm_hash))  # b"" on a miss (or a failure)
        h = memcached.decode_header(raw) if raw else None
        return ItemInfo(h.dtype, tuple(h.shape), h.nbytes) if h else None

    def read_into(self, mm_hash, info, out) -> bool:
        out = np.asarray(out).reshape(-1).view(np.uint8)
        if out.nbytes < info.nbytes or not out.flags.c_contiguous:
            return False
        return self.store.get_into(self._data_key(mm_hash), out.ctypes.data, info.nbytes) == info.nbytes

    def delete(self, mm_hash) -> None:
        # force: a recent get holds a lease on the object for a few seconds
        self.store.remove(memcached.header_key(mm_hash), True)
        self.store.remove(self._data_key(mm_hash), True)

    def close(self) -> None:
        try:
            self.store.close()
        except Exception:
            pass
