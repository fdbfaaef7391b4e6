"""Our EC connectors for vLLM: `shm` (same host) and `store` (cluster-wide pool).

Producer (the encoder role):
    save_caches        rank `save_rank` writes each new encoder output to the store in
                       the step that encoded it, before the encoder's answer
    start_save_caches  republishes items the encoder served from its own encoder
                       cache (e.g. after the store was restarted empty)
    has_cache_item     the store already holds it: the encoder skips the work
    request_finished   ec_transfer_params: {mm_hash: {...}} for the proxy to pass on

Consumer (prefill / pd), scheduler side:
    ensure_cache_available  locates each item the request still needs. shm: pins
        it in the host region. store: fetches it on a thread into a persistent
        receive region of `recv_buffer_tokens` (items larger than that region get
        a one-off region), then pins it there. The request waits while a fetch
        runs; an item the encoder promised (listed in the request's
        ec_transfer_params) is waited for up to `wait_s` (a save the encoder's answer
        overtook, e.g. another rank's). Anything not found is encoded locally by vLLM.
    has_cache_item / update_state_after_alloc  load what was located
    worker meta        which items the workers copied: their pins are released

Consumer, worker side: every TP rank copies each item out of the region with
one batched gather onto its own device.

Every pin has a deadline (`pin_ttl_s`) in the region itself, so a consumer that
dies holding pins does not keep entries forever.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver, collect_ec_item_metadata
from vllm.logger import init_logger

from ascendserve.connectors.ec.backends import ItemInfo, MemcachedStore, MooncakeStore, Store
from ascendserve.connectors.ec.memcached import StoreError
from ascendserve.connectors.ec.region import Entry, Region, RegionError
from ascendserve.connectors.ec.stats import ECStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

MIN_RECV_TOKENS = 2048
# the producer's saves: a store error that took longer than SLOW_FAILURE_S skips saving for
# STORE_RETRY_S (consumers encode those items themselves, as with any item not in the store)
SLOW_FAILURE_S = 0.5
STORE_RETRY_S = 10.0
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8,
                "int32": torch.int32, "int64": torch.int64}


@dataclass
class Settings:
    backend: str = "shm"  # shm | memcached | mooncake
    shm_name: str = "asf-ec"
    shm_bytes: int = 512 << 20
    block_bytes: int = 64 << 10
    store_url: str = ""
    chunk_bytes: int = 512 << 10
    ttl_s: int = 3600
    wait_s: float = 5.0
    pin_ttl_s: float = 60.0
    recv_buffer_tokens: int | None = None
    save_rank: int = 0
    mooncake_master: str = ""
    mooncake_metadata: str = "P2PHANDSHAKE"
    mooncake_segment_bytes: int = 256 << 20
    local_host: str = "127.0.0.1"
    recv_prefix: str = ""

    @classmethod
    def from_config(cls, vllm_config: "VllmConfig") -> "Settings":
        extra = dict(vllm_config.ec_transfer_config.ec_connector_extra_config or {})
        known = {k: v for k, v in extra.items() if k in cls.__dataclass_fields__}
        return cls(**known)


# ---- metadata ------------------------------------------------------------------------
@dataclass
class LoadItem:
    mm_hash: str
    region: str  # name of the region holding it
    region_bytes: int
    block_bytes: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    blocks: list[int]
    max_entries: int
    one_off: bool = False


@dataclass
class ECMeta(ECConnectorMetadata):
    loads: list[LoadItem] = field(default_factory=list)
    republish: list[str] = field(default_factory=list)


@dataclass
class ECLoaded(ECConnectorWorkerMetadata):
    hashes: set[str] = field(default_factory=set)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        if isinstance(other, ECLoaded):
            self.hashes |= other.hashes
        return self


@dataclass
class _Located:
    item: LoadItem
    region: Region
    owners: set[str] = field(default_factory=set)
    loading: bool = False
    since: float = field(default_factory=time.monotonic)


@dataclass
class _ReqState:
    promised: set[str]
    started: float = field(default_factory=time.monotonic)
    local: set[str] = field(default_factory=set)  # given up: vLLM encodes these itself
    next_try: dict[str, float] = field(default_factory=dict)


def make_store(s: Settings, producer: bool = True) -> Store:
    if s.backend == "memcached":
        if not s.store_url:
            raise ValueError("[ec] store_url (memcached host:port) is required for the store connector")
        return MemcachedStore(s.store_url, s.chunk_bytes, s.ttl_s)
    if s.backend == "mooncake":
        return MooncakeStore(s.mooncake_master, s.local_host, s.mooncake_segment_bytes if producer else 0,
                             64 << 20, s.mooncake_metadata)
    raise ValueError(f"unknown EC store backend {s.backend!r}")


class AscendECConnector(ECConnectorBase):
    """Shared machinery; `AscendECShmConnector` / `AscendECStoreConnector` pick the backend."""

    backend_kind = ""

    def __init__(self, vllm_config: "VllmConfig", role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        self.s = Settings.from_config(vllm_config)
        if self.backend_kind == "shm":
            self.s.backend = "shm"
        self.role_ = role
        self.stats = ECStats()
        self._store: Store | None = None
        self._region: Region | None = None
        self._store_lock = threading.Lock()
        self._dtype_bytes = torch.tensor([], dtype=vllm_config.model_config.dtype).element_size()
        self._hidden = vllm_config.model_config.get_hidden_size()
        if role == ECConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config)
        else:
            self._init_worker(vllm_config)

    # ---- shared ----------------------------------------------------------------------
    def _host_region(self) -> Region:
        if self._region is None:
            self._region = Region(self.s.shm_name, size_bytes=self.s.shm_bytes, block_size=self.s.block_bytes)
        return self._region

    def _store_(self) -> Store:
        with self._store_lock:
            if self._store is None:
                # only the producer's saving rank contributes memory to a Mooncake pool
                self._store = make_store(self.s, producer=self.is_producer and self.role_ == ECConnectorRole.WORKER)
            return self._store

    def _contains(self, mm_hash: str) -> bool:
        if self.s.backend == "shm":
            return self._host_region().contains(mm_hash)
        try:
            return self._store_().info(mm_hash) is not None
        except StoreError as exc:
            self._store_down(exc)
            return False

    def _store_down(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - getattr(self, "_last_down_log", 0.0) > 10.0:
            self._last_down_log = now
            logger.warning("EC store unavailable (%s); items are encoded locally until it is back", exc)

    # ======================================================================================
    # scheduler side
    # ======================================================================================
    def _init_scheduler(self, vllm_config: "VllmConfig") -> None:
        self._located: dict[str, _Located] = {}
        self._reqs: dict[str, _ReqState] = {}
        self._fetches: dict[str, Future] = {}
        self._step_loads: list[LoadItem] = []
        self._resolver = PlaceholderMetadataResolver(vllm_config.model_config)
        self._recv: Region | None = None
        self._one_offs: dict[str, Region] = {}
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="ec-fetch") if self.is_consumer else None
        if self.is_consumer and self.s.backend != "shm":
            mnbt = vllm_config.scheduler_config.max_num_batched_tokens
            tokens = self.s.recv_buffer_tokens
            if tokens is None:
                tokens = mnbt
            elif not MIN_RECV_TOKENS <= tokens <= mnbt:
                raise ValueError(
                    f"[ec] recv_buffer_tokens={tokens} is outside [{MIN_RECV_TOKENS}, max_num_batched_tokens="
                    f"{mnbt}]; pick a value in that range (or raise --max-num-batched-tokens)")
            self._recv_bytes = -(-tokens * self._hidden * self._dtype_bytes // self.s.block_bytes) * self.s.block_bytes
            prefix = self.s.recv_prefix or f"asf-ec-recv-{os.getpid()}"
            self._recv_name = f"{prefix}-{uuid.uuid4().hex[:6]}"

    def _recv_region(self) -> Region:
        if self._recv is None:
            self._recv = Region(self._recv_name, size_bytes=self._recv_bytes, block_size=self.s.block_bytes,
                                max_entries=1024)
        return self._recv

    # ---- producer ---------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        if self.is_consumer:
            return identifier in self._located
        return self._contains(identifier)

    def update_state_after_alloc(self, request: "Request", index: int) -> None:
        if not self.is_consumer:
            return
        mm_hash = request.mm_features[index].identifier
        loc = self._located.get(mm_hash)
        if loc is None or loc.loading:
            return
        loc.loading = True
        self._step_loads.append(loc.item)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> ECConnectorMetadata:
        meta = ECMeta(loads=self._step_loads)
        self._step_loads = []
        if self.is_producer:
            meta.republish = [f.identifier for r in scheduler_output.scheduled_new_reqs for f in r.mm_features]
        if self.is_consumer:
            self._expire_located()
        return meta

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        if self.is_consumer:
            self._reqs.pop(request.request_id, None)
            for mm_hash, loc in list(self._located.items()):
                loc.owners.discard(request.request_id)
                if not loc.owners and not loc.loading:
                    self._release(mm_hash)
        if not self.is_producer:
            return False, None
        items = collect_ec_item_metadata(request.mm_features, self._resolver)
        return False, (items or None)

    # ---- consumer -----------------------------------------------------------------------
    def ensure_cache_available(self, request: "Request", num_computed_tokens: int) -> bool:
        if not self.is_consumer:
            return True
        st = self._reqs.get(request.request_id)
        if st is None:
            promised = set((request.ec_transfer_params or {}).keys()) if isinstance(
                request.ec_transfer_params, dict) else set()
            st = self._reqs[request.request_id] = _ReqState(promised=promised)
        now = time.monotonic()
        waiting = False
        for f in request.mm_features:
            pos = f.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue
            h = f.identifier
            if h in st.local:
                continue
            loc = self._located.get(h)
            if loc is not None:
                loc.owners.add(request.request_id)
                continue
            if h in self._fetches:
                fut = self._fetches[h]
                if not fut.done():
                    waiting = True
                    continue
                del self._fetches[h]
                outcome = fut.result()
                if outcome is not None:
                    self._located[h] = outcome
                    outcome.owners.add(request.request_id)
                    self.stats.hit()
                    continue
            elif st.next_try.get(h, 0.0) <= now:
                found = self._locate(h)
                if found is True:
                    waiting = True  # a fetch started
                    continue
                if isinstance(found, _Located):
                    self._located[h] = found
                    found.owners.add(request.request_id)
                    self.stats.hit()
                    continue
            else:
                waiting = True
                continue
            # not there (yet)
            if h in st.promised and now - st.started < self.s.wait_s and not self._store_unreachable:
                st.next_try[h] = now + 0.005
                waiting = True
            else:
                st.local.add(h)
                self.stats.miss()
                if h in st.promised:
                    why = "the EC store is unreachable" if self._store_unreachable else \
                        f"it did not arrive within {self.s.wait_s:.1f}s"
                    logger.warning("encoder output %s was promised by the encoder but %s; encoding it here", h, why)
        return not waiting

    _store_unreachable = False

    def _locate(self, mm_hash: str) -> "_Located | bool | None":
        """shm: pin now. store: start a fetch (True), or None when absent."""
        if self.s.backend == "shm":
            region = self._host_region()
            entry = region.pin(mm_hash, self.s.pin_ttl_s)
            return None if entry is None else _Located(self._item(region, entry), region)
        self._fetches[mm_hash] = self._pool.submit(self._fetch, mm_hash)
        return True

    def _fetch(self, mm_hash: str) -> _Located | None:
        """On a fetch thread: store -> the receive region (or a one-off region), pinned."""
        try:
            store = self._store_()
            info = store.info(mm_hash)
            self._store_unreachable = False
            logger.debug("EC fetch %s: %s", mm_hash, info)
            if info is None:
                return None
            data = np.empty(info.nbytes, np.uint8)
            if not store.read_into(mm_hash, info, data):
                return None
        except StoreError as exc:
            self._store_unreachable = True
            self._store_down(exc)
            return None
        except Exception:
            logger.exception("EC fetch of %s failed", mm_hash)
            return None
        return self._stage(mm_hash, info, data)

    def _stage(self, mm_hash: str, info: ItemInfo, data: np.ndarray) -> _Located | None:
        region = self._recv_region()
        if info.nbytes > self._recv_bytes:
            # larger than the whole receive buffer: its own region, gone once loaded
            size = -(-max(info.nbytes, 1) // self.s.block_bytes) * self.s.block_bytes
            region = Region(f"{self._recv_name}-{uuid.uuid4().hex[:6]}", size_bytes=size,
                            block_size=self.s.block_bytes, max_entries=1)
        try:
            if not region.write(mm_hash, data, info.dtype, info.shape) and not region.contains(mm_hash):
                logger.warning("EC receive buffer full (%d bytes); %s is encoded locally", self._recv_bytes, mm_hash)
                if region is not self._recv:
                    region.close()
                return None
            entry = region.pin(mm_hash, self.s.pin_ttl_s)
        except RegionError:
            logger.exception("EC staging of %s failed", mm_hash)
            return None
        if entry is None:
            return None
        item = self._item(region, entry)
        item.one_off = region is not self._recv
        return _Located(item, region)

    @staticmethod
    def _item(region: Region, entry: Entry) -> LoadItem:
        return LoadItem(mm_hash=entry.key, region=region.name, region_bytes=region.num_blocks * region.block_size,
                        block_bytes=region.block_size, dtype=entry.dtype, shape=entry.shape, nbytes=entry.nbytes,
                        blocks=entry.blocks.tolist(), max_entries=region.max_entries)

    def _release(self, mm_hash: str) -> None:
        loc = self._located.pop(mm_hash, None)
        if loc is None:
            return
        loc.region.unpin(mm_hash)
        if loc.item.one_off:
            loc.region.close()

    def _expire_located(self) -> None:
        """Items located but never loaded nor released, past their pin deadline (a lost step)."""
        now = time.monotonic()
        for mm_hash, loc in list(self._located.items()):
            if now - loc.since > self.s.pin_ttl_s:
                self._release(mm_hash)

    def update_connector_output(self, connector_output: "ECConnectorOutput") -> None:
        meta = connector_output.ec_connector_worker_meta
        if isinstance(meta, ECLoaded):
            for mm_hash in meta.hashes:
                loc = self._located.get(mm_hash)
                if loc is not None and loc.loading:
                    self._release(mm_hash)

    def get_ec_connector_stats(self):
        return self.stats.take() if self.role_ == ECConnectorRole.SCHEDULER else None

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None):
        return ECStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from ascendserve.connectors.ec.stats import ECProm

        return ECProm(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ======================================================================================
    # worker side
    # ======================================================================================
    def _init_worker(self, vllm_config: "VllmConfig") -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        try:
            self._rank = get_tensor_model_parallel_rank()
        except Exception:
            self._rank = 0
        self._regions: dict[str, Region] = {}
        self._loaded: set[str] = set()
        self._saving = self.is_producer and self._rank == self.s.save_rank
        self._store_retry_at = 0.0  # after a store error, saves are skipped until then

    # Saving runs on the worker's own thread, inside the step that encoded the item: the
    # encoder's answer (and so the promise the consumer waits for) follows the save. It ran on
    # a background thread before, and in CI that thread was now and then not run at all for
    # 5 to 30 s, until the worker's main thread woke for the next request (cause not found);
    # P/PD then waited `wait_s` and encoded the item itself.
    # A save costs the step what the copy to the store costs (a few KiB to MiB over a socket).
    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs) -> None:
        if self._saving:
            self._save(mm_hash, encoder_cache[mm_hash], check=False)

    def start_save_caches(self, encoder_cache: dict[str, torch.Tensor] | None = None, **kwargs) -> None:
        if not self._saving or encoder_cache is None or self._connector_metadata is None:
            return
        meta = self._get_connector_metadata()
        for mm_hash in getattr(meta, "republish", ()):
            logger.debug("EC republish check %s: in encoder cache %s", mm_hash, mm_hash in encoder_cache)
            if mm_hash in encoder_cache:
                self._save(mm_hash, encoder_cache[mm_hash], check=True)

    def _save(self, mm_hash: str, tensor: torch.Tensor, check: bool) -> None:
        """Publish one item now; never raises. A store that failed slowly (a timeout: an
        unanswering host) is not tried again for STORE_RETRY_S, so it costs one step its socket
        timeout rather than every step; a refused connection fails at once and is retried."""
        if time.monotonic() < self._store_retry_at:
            logger.debug("EC save of %s skipped: the store failed less than %.0f s ago", mm_hash, STORE_RETRY_S)
            return
        host = tensor.detach()
        if host.device.type != "cpu":
            host = host.to("cpu")
        started = time.monotonic()
        try:
            self._save_one(mm_hash, host, check)
        except StoreError as exc:
            if time.monotonic() - started > SLOW_FAILURE_S:
                self._store_retry_at = time.monotonic() + STORE_RETRY_S
            logger.debug("EC save of %s failed: %s", mm_hash, exc)
            self._store_down(exc)
        except Exception:
            logger.exception("EC save of %s failed", mm_hash)

    def _save_one(self, mm_hash: str, tensor: torch.Tensor, check: bool) -> None:
        dtype = str(tensor.dtype).removeprefix("torch.")
        shape = tuple(tensor.shape)
        data = tensor.contiguous().view(torch.uint8).reshape(-1).numpy()
        if self.s.backend == "shm":
            self._host_region().write(mm_hash, data, dtype, shape)
            return
        store = self._store_()
        if check and store.info(mm_hash) is not None:
            return
        logger.debug("EC save %s (%d bytes, republish=%s)", mm_hash, data.nbytes, check)
        started = time.monotonic()
        if not store.put(mm_hash, data, dtype, shape):
            logger.warning("EC store refused %s (%d bytes)", mm_hash, data.nbytes)
            return
        took = time.monotonic() - started
        if took > self.s.wait_s / 2:
            logger.warning("EC save of %s took %.1f s: this step and the encoder's answer waited for it",
                           mm_hash, took)
        else:
            logger.debug("EC saved %s in %.1f ms", mm_hash, took * 1000)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ECMeta):
            return
        device = self._device()
        for item in meta.loads:
            self._loaded.add(item.mm_hash)
            if item.mm_hash in encoder_cache:
                continue
            region = self._regions.get(item.region)
            if region is None:
                region = Region(item.region, size_bytes=item.region_bytes, block_size=item.block_bytes,
                                max_entries=item.max_entries)
                if not item.one_off:
                    self._regions[item.region] = region
            entry = Entry(item.mm_hash, item.dtype, tuple(item.shape), item.nbytes, np.asarray(item.blocks, np.int64))
            raw = region.read(entry)
            if item.one_off:
                region.close()
            t = torch.from_numpy(raw).view(TORCH_DTYPES[item.dtype]).reshape(item.shape)
            encoder_cache[item.mm_hash] = t.to(device) if device.type != "cpu" else t

    def _device(self) -> torch.device:
        from vllm.platforms import current_platform

        if current_platform.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(current_platform.device_type, current_platform.current_device())

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        if not getattr(self, "_loaded", None):
            return None
        meta, self._loaded = ECLoaded(self._loaded), set()
        return meta

    def shutdown(self) -> None:
        if self.role_ == ECConnectorRole.WORKER:
            for region in self._regions.values():
                region.close()
            self._regions.clear()
        else:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            for mm_hash in list(self._located):
                self._release(mm_hash)
            if self._recv is not None:
                self._recv.close()
        if self._region is not None:
            self._region.close()
            self._region = None
        if self._store is not None:
            self._store.close()


class AscendECShmConnector(AscendECConnector):
    backend_kind = "shm"


class AscendECStoreConnector(AscendECConnector):
    backend_kind = "store"
