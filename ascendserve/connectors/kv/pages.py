"""vLLM's registered KV caches seen as pages, whatever their physical layout.

vLLM 0.32 hands every attention backend's cache to a connector as one view per
layer, logically [B, H, N, C] (blocks, KV heads, tokens per block, content:
K and V packed, or one MLA latent with H = 1) over a backing allocation whose
physical order is any permutation of [L, B, H, N, C] (`KVCacheLayout`:
LBHNC on CPU, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC), possibly with padded pages
and with manager blocks split into kernel blocks (then B is K times the
number of blocks). This module reads that description from the views' own
strides, never from a backend's shape:

- a page is one block of one layer, logically [K, H, N, C] (K kernel blocks);
  a head range of a page is a set of runs: one contiguous run when the heads
  are outermost in the page (the CPU layout), else a regular strided set;
- bytes travel in the page's physical order (the runs in memory order), so
  both sides must lay pages out alike: the handshake exchanges `layout()` and
  `layout_mismatch` (transport/base.py) refuses pages that would be misread,
  naming both layouts;
- in a cross-layer layout (B outside L) a block of every layer is one piece of
  memory, and whole-page reads move it as one (`request_views`).

Host memory is read in place (numpy views, the native copy ops, zero-copy socket
buffers). Device memory (cuda, npu) is staged (kv/staging.py): on a side stream of
the calling thread, a unit's pages are gathered on the device and copied to a
pinned host buffer of a bounded pool (`copy_out`), or copied in and scattered
(`copy_in`); the event each returns says when the copy is done, so a transport
overlaps the next unit's copy with the current one's send. `staging=True` runs
that path on host memory (synchronous, nothing pinned), which is how CI covers it.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading

import numpy as np
import structlog
import torch

from ascendserve import ops_cuda
from ascendserve.connectors.kv import page_geometry
from ascendserve.connectors.kv.staging import DEFAULT_BUDGET, StagingPool
from ascendserve.connectors.transport.native import Runs
from ascendserve.ops import gather_pages, scatter_pages

log = structlog.get_logger("ascendserve.kv")

# vLLM's KVCacheLayout names, by the physical order of the logical axes
LAYOUT_NAMES = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole allocation behind `t` as a uint8 tensor on its device."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 4:
        return t
    if t.dim() == 3:  # [B, N, C]: one latent per token (MLA) without a head axis
        return t.unsqueeze(1)
    raise ValueError(f"a KV cache view must be [blocks, heads, tokens, content] (4D), got {tuple(t.shape)}")


class PagedKV:
    """Pages of every registered layer. `num_blocks`: the manager's block count, when the views
    hold kernel blocks (B = K * num_blocks); default: the views' first dimension."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None = None,
                 staging: bool | None = None, staging_budget: int = DEFAULT_BUDGET, kernels: str = "auto"):
        seen: set[int] = set()
        self.names: list[str] = []
        self.layers: list[torch.Tensor] = []
        for name in sorted(kv_caches):
            tensors = kv_caches[name] if isinstance(kv_caches[name], (list, tuple)) else [kv_caches[name]]
            for j, t in enumerate(tensors):
                if t.data_ptr() in seen:  # layers that share one cache
                    continue
                seen.add(t.data_ptr())
                self.names.append(f"{name}#{j}")
                self.layers.append(t)
        if not self.layers:
            raise ValueError("no KV cache tensors registered")
        devices = {t.device for t in self.layers}
        if len(devices) != 1:
            raise ValueError(f"KV layers on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop()
        # device memory is copied through host staging buffers (gather on the device, then one
        # copy to the host; the reverse on receive); `staging=True` takes that path for host
        # memory too, which is how CI runs the device code on CPU tensors
        self.staged = bool(staging) or self.device.type != "cpu"
        self.host_visible = not self.staged  # zero-copy views of the cache itself exist
        # host buffers of staged reads: pinned for device memory, so its copies are asynchronous
        self.staging = StagingPool(staging_budget, pin=self.device.type != "cpu")
        self._streams = threading.local()  # a side stream per transfer thread (devices only)
        # what gathers and scatters staged pages on the device: "cuda", ascendserve's kernels
        # (a CUDA device where their self-test passed, asked here so no request pays for it);
        # "torch", its index ops (every other device); "emulated", the CUDA kernels' code run
        # on the CPU (host memory only: how CI runs the kernel branch); "auto" picks cuda or torch
        if kernels not in ("auto", "torch", "emulated"):
            raise ValueError(f"kernels={kernels!r}: want auto, torch or emulated")
        if kernels == "emulated" and (self.device.type != "cpu" or not self.staged):
            raise ValueError("kernels='emulated' is for staged host memory (PagedKV(staging=True) on CPU tensors)")
        if kernels == "auto":
            kernels = "cuda" if self.device.type == "cuda" and _kernels_on(self.device) else "torch"
        self.kernels = kernels
        views = [_as_4d(t) for t in self.layers]
        shapes = {tuple(v.shape) for v in views}
        dtypes = {v.dtype for v in views}
        strides = {tuple(v.stride()) for v in views}
        if len(shapes) != 1 or len(dtypes) != 1 or len(strides) != 1:
            raise ValueError(f"KV layers differ in shape, dtype or strides: {shapes} {dtypes} {strides}")
        b0, h, n, c = shapes.pop()
        self.dtype = dtypes.pop()
        e = self.layers[0].element_size()
        sb, sh, sn, sc = (s * e for s in strides.pop())
        if sc != e and c > 1:
            raise ValueError(f"the content axis of a KV view must be contiguous (stride {sc // e})")
        k = 1
        if num_blocks is not None and num_blocks != b0:
            if num_blocks < 1 or b0 % num_blocks:
                raise ValueError(f"{b0} kernel blocks per layer do not split into {num_blocks} blocks")
            k = b0 // num_blocks
        self.num_blocks = b0 // k
        self.kernel_blocks, self.num_heads, self.block_tokens, self.content_bytes = k, h, n, c * e
        self.num_layers = len(self.layers)
        # page axes k, h, n, c: extents and byte strides
        self._extent = {"k": k, "h": h, "n": n, "c": c * e}
        self._stride = {"k": sb, "h": sh, "n": sn, "c": 1}
        self.block_stride = sb * k
        self.head_bytes = k * n * c * e
        self.page_bytes = h * self.head_bytes
        self._storage = [] if self.staged else [_flat_bytes(t).numpy() for t in self.layers]
        self._flat = [_flat_bytes(t) for t in self.layers] if self.staged else []
        self._offset = [(t.data_ptr() - t.untyped_storage().data_ptr()) for t in self.layers]
        self.layer_stride = self._layer_stride()
        # layers in memory order: how a cross-layer block's pages follow each other
        self.memory_order = sorted(range(self.num_layers), key=lambda i: self._offset[i])
        # physical order of the page's axes (outermost first; an axis of extent 1 goes where
        # its stride puts it: it moves no byte either way)
        self.page_order = "".join(sorted("khn", key=lambda a: (-self._stride[a], "khn".index(a))))
        self.cross_layer = self.layer_stride is not None and 0 < self.layer_stride < self.block_stride
        self.layout_name = self._name()
        self._whole_blocks = (self.cross_layer and self.layer_stride == self.page_bytes
                              and self._split(self.num_heads)[0] == [])

    # ---- description ---------------------------------------------------------
    def _layer_stride(self) -> int | None:
        """Bytes between consecutive layers' block 0 when they share one allocation at a
        constant distance (vLLM 0.32's packing), else None."""
        if self.num_layers < 2:
            return None
        ptrs = [t.untyped_storage().data_ptr() for t in self.layers]
        if len(set(ptrs)) != 1:
            return None
        offsets = sorted(self._offset)  # memory order (names sort layers.10 before layers.2)
        steps = {b - a for a, b in zip(offsets, offsets[1:])}
        return steps.pop() if len(steps) == 1 else None

    def _name(self) -> str:
        """vLLM's KVCacheLayout name of this physical order ("LBHNC" on CPU)."""
        stride = {"L": float("inf") if self.layer_stride is None else self.layer_stride,
                  "B": self.block_stride, "H": self._stride["h"], "N": self._stride["n"]}
        name = "".join(sorted("LBHN", key=lambda a: (-stride[a], "LBHN".index(a)))) + "C"
        if name in LAYOUT_NAMES:
            return name
        extents = {"L": self.num_layers, "H": self.num_heads, "N": self.block_tokens}
        for alias in LAYOUT_NAMES:  # an axis of extent 1 may sit anywhere: name the listed one it matches
            if _same_order(name, alias, extents):
                return alias
        return name

    def layout(self) -> dict:
        """What both sides must share for pages to mean the same bytes (the number of heads per
        page may differ: P and D can shard heads over different TP sizes)."""
        return {"name": self.layout_name, "page_order": self.page_order, "cross_layer": self.cross_layer,
                "layers": self.num_layers, "kernel_blocks": self.kernel_blocks,
                "block_tokens": self.block_tokens, "content_bytes": self.content_bytes,
                "heads": self.num_heads, "dtype": str(self.dtype),
                "names": hashlib.sha256("\n".join(self.names).encode()).hexdigest()[:16]}

    def nbytes(self, n_blocks: int, heads: int | None = None) -> int:
        return self.num_layers * n_blocks * (self.page_bytes if heads is None else heads * self.head_bytes)

    def layer_index(self) -> dict[str, int]:
        """vLLM layer name -> page layer (layers sharing a cache map to the first one only)."""
        return {n.rsplit("#", 1)[0]: i for i, n in enumerate(self.names) if n.endswith("#0")}

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of every allocation that holds a layer, once each."""
        out: dict[int, int] = {}
        for t in self.layers:
            storage = t.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
        return list(out.items())

    # ---- runs ------------------------------------------------------------------
    def _index(self, block_ids) -> np.ndarray:
        idx = np.asarray(block_ids, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_blocks):
            raise ValueError(f"block id out of range 0..{self.num_blocks - 1}")
        return idx

    def _heads(self, heads: tuple[int, int] | None) -> tuple[int, int]:
        if heads is None:
            return 0, self.num_heads
        first, n = heads
        if first < 0 or n < 1 or first + n > self.num_heads:
            raise ValueError(f"heads {first}..{first + n - 1} out of range 0..{self.num_heads - 1}")
        return first, n

    def _split(self, count: int) -> tuple[list[tuple[int, int]], int]:
        """The page region with `count` heads: (outer axes, run bytes) (page_geometry.split)."""
        return page_geometry.split(self.page_order, self._extent, self._stride, self._extent["c"], count)

    def run_bytes(self, heads: tuple[int, int] | None = None) -> int:
        """Bytes of each contiguous run of a page (or of a head range of it)."""
        return self._split(self._heads(heads)[1])[1]

    def _view_spec(self, layer: int, heads: tuple[int, int] | None) -> tuple[int, tuple, tuple]:
        """(byte offset, shape, byte strides) of layer `layer` as [num_blocks, *outer axes, run
        bytes], heads restricted, in memory order."""
        first, count = self._heads(heads)
        outer, run = self._split(count)
        shape = (self.num_blocks, *(e for e, _ in outer), run)
        strides = (self.block_stride, *(st for _, st in outer), 1)
        return self._offset[layer] + first * self._stride["h"], shape, strides

    def _strided(self, layer: int, heads: tuple[int, int] | None) -> np.ndarray:
        """`_view_spec` over host memory (numpy)."""
        offset, shape, strides = self._view_spec(layer, heads)
        return np.lib.stride_tricks.as_strided(self._storage[layer][offset:], shape=shape, strides=strides)

    def _strided_t(self, layer: int, heads: tuple[int, int] | None) -> torch.Tensor:
        """`_view_spec` as a tensor on the cache's device (the staged path)."""
        offset, shape, strides = self._view_spec(layer, heads)
        return torch.as_strided(self._flat[layer], shape, strides, offset)

    # ---- copies ----------------------------------------------------------------
    def gather_layer(self, layer: int, block_ids: list[int]) -> np.ndarray:
        """A copy of one layer's pages: [len(block_ids), page_bytes]."""
        out = np.empty((len(block_ids), self.page_bytes), dtype=np.uint8)
        self.gather_layer_into(layer, block_ids, out)
        return out

    def gather_layer_into(self, layer: int, block_ids: list[int], out: np.ndarray,
                          heads: tuple[int, int] | None = None) -> None:
        """`out`: [len(block_ids), bytes per page (or per head range)], each page's runs in
        memory order; `heads` = (first, count) takes only those heads of each page."""
        if self.staged:
            self.wait(self.copy_out(layer, block_ids, torch.from_numpy(out).view(-1), heads))
            return
        view, idx = self._strided(layer, heads), self._index(block_ids)
        if view.ndim == 2:  # one run per page: the native op
            gather_pages(view, idx, out)
        else:
            out.reshape((len(idx), *view.shape[1:]))[...] = view[idx]

    def scatter_layer(self, layer: int, block_ids: list[int], src: np.ndarray,
                      heads: tuple[int, int] | None = None) -> None:
        if self.staged:  # through a staging buffer: `src` may be read-only (shm) or pageable
            n = src.nbytes
            buf, = self.staging.acquire(n)
            try:
                np.copyto(buf.array[:n], src.reshape(-1))
                self.wait(self.copy_in(layer, block_ids, buf.tensor[:n], heads))
            finally:
                self.staging.release(buf)
            return
        view, idx = self._strided(layer, heads), self._index(block_ids)
        if view.ndim == 2:
            scatter_pages(view, idx, src)
        else:
            view[idx] = src.reshape((len(idx), *view.shape[1:]))

    # ---- staged copies (device memory; kv/staging.py pipelines them) ------------------
    def _side(self) -> "_SideStream":
        """This thread's side stream on the cache's device (host memory: copies in order)."""
        side = getattr(self._streams, "side", None)
        if side is None:
            side = self._streams.side = _SideStream(self.device)
        return side

    def _unit_view(self, layer: int | None, heads: tuple[int, int] | None) -> torch.Tensor:
        """Layer `layer`'s pages as [num_blocks, *runs] on the device, or with layer None
        whole cross-layer blocks as [num_blocks, every layer's page bytes]."""
        if layer is not None:
            return self._strided_t(layer, heads)
        if heads is not None or not self.whole_blocks():
            raise ValueError("whole-block copies need whole pages of a cross-layer layout")
        span = self.num_layers * self.page_bytes
        return torch.as_strided(self._flat[0], (self.num_blocks, span), (self.block_stride, 1), min(self._offset))

    def copy_out(self, layer: int | None, block_ids: list[int], host: torch.Tensor,
                 heads: tuple[int, int] | None = None):
        """Queue the copy of these pages (`_unit_view`) into `host` (uint8, exactly their
        bytes, in transfer order): gathered on the device, then one copy to the host, after
        what the engine queued before. Returns the event to `wait` for (None: done)."""
        view, idx = self._unit_view(layer, heads), self._index(block_ids)
        side = self._side()
        with side.after_engine():
            if self._runs(view):  # gathered by ascendserve's kernel into a device buffer
                staged = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
                self._copy_runs(False, view, idx, staged, side)
            else:  # torch's index op (every other device, and CUDA without the kernels)
                ids = torch.from_numpy(idx).to(self.device, non_blocking=True)
                staged = view.index_select(0, ids).view(-1)
            host.copy_(staged, non_blocking=True)
            return side.event()

    def copy_in(self, layer: int | None, block_ids: list[int], host: torch.Tensor,
                heads: tuple[int, int] | None = None):
        """Queue `copy_out`'s reverse: `host`'s bytes copied to the device, then scattered
        into these pages. `host` must stay untouched until the returned event is done."""
        view, idx = self._unit_view(layer, heads), self._index(block_ids)
        side = self._side()
        with side.queued():
            staged = host.to(self.device, non_blocking=True)
            if self._runs(view):
                self._copy_runs(True, view, idx, staged, side)
            else:
                ids = torch.from_numpy(idx).to(self.device, non_blocking=True)
                view[ids] = staged.view((len(idx), *view.shape[1:]))
            return side.event()

    def _runs(self, view: torch.Tensor) -> bool:
        """Whether the kernels copy `view` (they take at most two axes between blocks and runs)."""
        return self.kernels != "torch" and view.dim() <= 4

    def _copy_runs(self, scatter: bool, view: torch.Tensor, idx: np.ndarray, staged: torch.Tensor,
                   side: "_SideStream") -> None:
        if self.kernels == "emulated":
            ops_cuda.emulate_runs_cuda(scatter, [view], idx, staged)
        elif scatter:
            ops_cuda.scatter_runs_cuda([view], idx, staged, stream=side.stream)
        else:
            ops_cuda.gather_runs_cuda([view], idx, staged, stream=side.stream)

    @staticmethod
    def wait(event) -> None:
        """Block until a staged copy is done (`copy_out` / `copy_in`'s event)."""
        if event is not None:
            event.synchronize()

    # ---- zero-copy views -----------------------------------------------------------
    def layer_views(self, layer: int, block_ids: list[int], heads: tuple[int, int] | None = None) -> list[memoryview]:
        """The runs of these pages (or of one head range of each) in the cache itself, in
        transfer order: sockets read and write them with no staging copy."""
        self._host_only()
        view, idx = self._strided(layer, heads), self._index(block_ids)
        inner = list(np.ndindex(view.shape[1:-1]))
        return [memoryview(view[(int(b), *ix)]) for b in idx for ix in inner]

    def _host_only(self) -> None:
        if self.staged:
            raise RuntimeError(f"pages on {self.device} have no host views: stage them (gather_layer_into)")

    def page_views(self, block_ids: list[int], heads: tuple[int, int] | None = None) -> list[list[memoryview]]:
        """`layer_views` of every layer."""
        return [self.layer_views(i, block_ids, heads) for i in range(self.num_layers)]

    def whole_blocks(self) -> bool:
        """Whether a block of every layer is one contiguous piece (a cross-layer layout with
        no padding between the layers' pages)."""
        return self._whole_blocks

    def request_views(self, block_ids: list[int], heads: tuple[int, int] | None = None) -> list[memoryview]:
        """Every run a read of these blocks moves, in transfer order: a cross-layer block as
        one piece for whole pages (`whole_blocks`), else layer by layer. Both sides of a
        transfer share `layout()`, so they choose alike."""
        self._host_only()
        if heads is None and self.whole_blocks():
            span = self.num_layers * self.page_bytes
            base = self._storage[0][min(self._offset):]  # the first layer in memory
            blocks = np.lib.stride_tricks.as_strided(base, shape=(self.num_blocks, span),
                                                     strides=(self.block_stride, 1))
            return [memoryview(blocks[b]) for b in self._index(block_ids)]
        return [v for layer in self.page_views(block_ids, heads) for v in layer]

    # ---- runs by address (the native data path: transport/native.py) ------------------
    def request_runs(self, block_ids: list[int], heads: tuple[int, int] | None = None,
                     layer_major: bool = False) -> Runs:
        """`request_views` as addresses, without a Python object per run: the same bytes in
        the same order, for the native transfer path. `layer_major`: one base per layer even
        where whole cross-layer blocks would move as one piece (the shm segment's order)."""
        self._host_only()
        idx = self._index(block_ids)
        if heads is None and self.whole_blocks() and not layer_major:
            first = min(range(self.num_layers), key=lambda i: self._offset[i])
            return self._checked([self._address(first)], idx, [0], self.num_layers * self.page_bytes, [first])
        return self._layer_runs(range(self.num_layers), idx, heads)

    def layer_runs(self, layer: int, block_ids: list[int], heads: tuple[int, int] | None = None) -> Runs:
        """`layer_views` as addresses."""
        self._host_only()
        return self._layer_runs([layer], self._index(block_ids), heads)

    def _layer_runs(self, layers, idx: np.ndarray, heads: tuple[int, int] | None) -> Runs:
        first, count = self._heads(heads)
        outer, run = self._split(count)
        layers = list(layers)
        bases = [self._address(i) + first * self._stride["h"] for i in layers]
        return self._checked(bases, idx, page_geometry.offsets(outer), run, layers)

    def _address(self, layer: int) -> int:
        """Address of block 0 of `layer` (host memory)."""
        return self._storage[layer].ctypes.data + self._offset[layer]

    def _checked(self, bases: list[int], idx: np.ndarray, offsets: list[int], run: int, layers) -> Runs:
        """Runs, once every byte they name is inside its layer's allocation (a wrong address
        would be written by the native code, not refused)."""
        if len(idx) and run:
            last = int(idx.max()) * self.block_stride + max(offsets) + run
            for base, layer in zip(bases, layers):
                start = self._storage[layer].ctypes.data
                if base < start or base + last > start + self._storage[layer].nbytes:
                    raise ValueError(f"runs of layer {layer} would leave its allocation")
        return Runs.structured(bases, idx, self.block_stride, offsets, run, keep=self)

    def geometry(self) -> dict:
        """Where this process's pages are, as numbers (page_geometry.addresses reads it; a
        transfer engine's peer gets it in the handshake)."""
        base = [t.untyped_storage().data_ptr() + off for t, off in zip(self.layers, self._offset)]
        return {"bases": base, "order": self.page_order, "extent": {a: self._extent[a] for a in "khn"},
                "stride": {a: self._stride[a] for a in "khn"}, "content": self._extent["c"],
                "block_stride": self.block_stride}


_kernel_lock = threading.Lock()
_kernel_ok: dict[int, bool] = {}  # CUDA device index -> whether its copies use ascendserve's kernels


def _kernels_on(device: torch.device) -> bool:
    """Whether ascendserve's CUDA kernels stage pages on this CUDA device: they loaded
    and passed `ops_cuda.cuda_self_test` there (run once per device, a few milliseconds,
    logged). Elsewhere torch's index ops copy the same bytes."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _kernel_lock:
        if index not in _kernel_ok:
            problem = ops_cuda.cuda_self_test(torch.device("cuda", index))
            _kernel_ok[index] = not problem
            if problem:
                log.warning("KV staging uses torch's index ops, not ascendserve's CUDA kernels",
                            device=f"cuda:{index}", reason=problem)
            else:
                log.info("KV staging uses ascendserve's CUDA kernels", device=f"cuda:{index}")
        return _kernel_ok[index]


class _SideStream:
    """Where one transfer thread queues its staged copies: a side stream of the device, so
    they overlap the engine's work and the thread's own socket I/O. For host memory (CI's
    staged runs) there is no stream and every copy is done when queued; the copy code
    itself is the same."""

    def __init__(self, device: torch.device):
        self.stream = None if device.type == "cpu" else torch.Stream(device=device)
        self.device = device

    @contextlib.contextmanager
    def queued(self):
        if self.stream is None:
            yield
            return
        with self.stream:
            yield

    @contextlib.contextmanager
    def after_engine(self):
        """`queued`, ordered after what the engine queued on its stream (P's pages are
        written there; the transfer thread's current stream is the device's default)."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.accelerator.current_stream(self.device))
        with self.stream:
            yield

    def event(self):
        return None if self.stream is None else self.stream.record_event()


def _same_order(a: str, b: str, extents: dict[str, int]) -> bool:
    """Two layout names order the axes of extent > 1 alike."""
    keep = [x for x in a if extents.get(x, 2) > 1]
    return keep == [x for x in b if extents.get(x, 2) > 1]

