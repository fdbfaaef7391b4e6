"""Block-page copies between paged caches and contiguous buffers.

Two entry points, one meaning (out[l, i] = layers[l][block_ids[i]], bytes):

- `gather_pages(layer, ids, out)` / `scatter_pages`: numpy byte views
  ([num_blocks, page_bytes]) of one layer, what the connectors hold.
- `gather_blocks(layers, ids, out)` / `scatter_blocks`: torch tensors, many
  layers per call (vllm-ascend's `swap_blocks_batch`); `out`/`src` is any
  contiguous tensor of len(layers) * len(ids) * page_bytes bytes, read as
  [L, n, page_bytes]. Scatter writes in order: with repeated ids the last wins.

Backends, chosen per call: the `native` ops of native/ (torch.ops.ascendserve,
libascendserve_ops.so next to this module, built by native/build.sh) for CPU
memory; else numpy for CPU memory; the torch reference (`*_ref`) for device
tensors. Never a torch CPU op: the callers are transfer threads, and a torch
op there starts its own OpenMP team that fights vLLM's core-bound one (seen
here: 3.5 s for one 128-token block instead of milliseconds). The native ops
use no OpenMP and release the GIL while they copy.

Importing this module imports no torch; the numpy entry points use the native
ops only in processes that already imported torch (vLLM's), so the EC region
stays torch-free in the proxy.

CUDA caches have their own kernels: ops_cuda.py.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter

import numpy as np

LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_native", "libascendserve_ops.so")

calls: Counter = Counter()  # copies done per backend: "native", "numpy", "reference", "cuda", "emulated"
_lock = threading.Lock()
_native = None  # torch.ops.ascendserve once loaded
_tried = False
_why_not = "not loaded yet"


def load_native(path: str | None = None) -> bool:
    """Load the native ops (default: LIBRARY) and use them from now on; False if they cannot load.

    Imports torch; logs the outcome once. Tests pass an explicit path. One
    library per process (torch registers the `ascendserve` namespace once):
    once loaded, later calls keep it."""
    global _native, _tried, _why_not
    import torch

    with _lock:
        if _native is not None or (path is None and _tried):
            return _native is not None
        _tried = True
        path = path or LIBRARY
        try:
            if not _registered(torch):
                if not os.path.exists(path):
                    raise FileNotFoundError(f"{path} not found (build it: native/build.sh)")
                torch.ops.load_library(path)
            _native = torch.ops.ascendserve
            _why_not = ""
        except Exception as exc:  # a missing, stale or foreign-ABI library: fall back, say why
            _why_not = f"{type(exc).__name__}: {exc}"
        _log_backend(path)
        return _native is not None


def backend() -> str:
    """"native" or "reference" (numpy for CPU memory, torch for devices). Loads the library."""
    return "native" if _ops() is not None else "reference"


def _registered(torch) -> bool:
    try:
        torch.ops.ascendserve.gather_blocks  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


def _log_backend(path: str) -> None:
    from ascendserve.logging import log_library

    log_library("ascendserve.ops", _native is not None, path, "block copy ops: native",
                "block copy ops: reference (numpy on CPU, torch on devices)", _why_not)


def _ops():
    """The native ops, loading them on first use (imports torch)."""
    if not _tried:
        load_native()
    return _native


def _ops_if_torch():
    """The native ops, but only where torch is already imported (never pulls torch in)."""
    if _native is not None:
        return _native
    return _ops() if "torch" in sys.modules and not _tried else None


# ---- numpy callers (one layer) -----------------------------------------------
def _native_numpy(layer: np.ndarray, block_ids: np.ndarray, buf: np.ndarray):
    ops = _ops_if_torch()
    pages_contiguous = layer.flags.c_contiguous or (layer.ndim == 2 and layer.strides[1] == layer.itemsize)
    if ops is None or not (pages_contiguous and layer.flags.writeable and buf.flags.writeable
                           and buf.flags.c_contiguous):
        return None  # what the native op would refuse (or torch.from_numpy warn about): numpy copes
    torch = sys.modules["torch"]
    if block_ids.dtype not in (np.int64, np.int32):
        block_ids = block_ids.astype(np.int64)
    try:
        return ops, torch.from_numpy(layer), torch.from_numpy(block_ids), torch.from_numpy(buf)
    except TypeError:  # a dtype torch does not map
        return None


def gather_pages(layer: np.ndarray, block_ids: np.ndarray, out: np.ndarray) -> None:
    native = _native_numpy(layer, block_ids, out)
    if native is not None:
        ops, t_layer, t_ids, t_out = native
        ops.gather_blocks([t_layer], t_ids, t_out, 0)
        calls["native"] += 1
        return
    calls["numpy"] += 1
    # ids are range-checked by the caller; mode="raise" is 5x slower
    np.take(layer, block_ids, axis=0, out=out, mode="clip")


def scatter_pages(layer: np.ndarray, block_ids: np.ndarray, src: np.ndarray) -> None:
    native = _native_numpy(layer, block_ids, src)
    if native is not None:
        ops, t_layer, t_ids, t_src = native
        ops.scatter_blocks([t_layer], t_ids, t_src, 0)
        calls["native"] += 1
        return
    calls["numpy"] += 1
    layer[block_ids] = src


# ---- torch callers (many layers) ---------------------------------------------
def gather_blocks(layers, block_ids, out, *, num_threads: int = 0) -> None:
    """out[l, i] = layers[l][block_ids[i]] (bytes).

    `num_threads` (native only): 0 = auto, min(4, cores) but one per 8 MiB; n = n threads."""
    layers, ids = list(layers), _ids(block_ids)
    cpu = _on_cpu(layers, out)
    ops = _ops() if cpu else None
    if ops is not None:
        ops.gather_blocks(layers, ids, out, num_threads)
        calls["native"] += 1
    elif cpu:
        pages, ids_np, flat = _numpy_args(layers, ids, out)
        for l, page in enumerate(pages):
            np.take(page, ids_np, axis=0, out=flat[l])
        calls["numpy"] += 1
    else:
        gather_blocks_ref(layers, ids, out)


def scatter_blocks(layers, block_ids, src, *, num_threads: int = 0) -> None:
    """layers[l][block_ids[i]] = src[l, i] (bytes), in order: with repeated ids the last wins."""
    layers, ids = list(layers), _ids(block_ids)
    cpu = _on_cpu(layers, src)
    ops = _ops() if cpu else None
    if ops is not None:
        ops.scatter_blocks(layers, ids, src, num_threads)
        calls["native"] += 1
    elif cpu:
        pages, ids_np, flat = _numpy_args(layers, ids, src)
        for l, page in enumerate(pages):
            page[ids_np] = flat[l]  # numpy assigns in order: the last repeat wins
        calls["numpy"] += 1
    else:
        scatter_blocks_ref(layers, ids, src)


def gather_blocks_ref(layers, block_ids, out) -> None:
    """gather_blocks in plain torch (index_select): any device, the tests' oracle."""
    import torch

    pages, ids, flat = _checked(layers, _ids(block_ids), out)
    ids = ids.to(device=flat.device, dtype=torch.long)
    for l, page in enumerate(pages):
        torch.index_select(page, 0, ids, out=flat[l])
    calls["reference"] += 1


def scatter_blocks_ref(layers, block_ids, src) -> None:
    """scatter_blocks in plain torch (index_copy_); only each id's last occurrence is written."""
    import torch

    pages, ids, flat = _checked(layers, _ids(block_ids), src)
    ids = ids.to(device=flat.device, dtype=torch.long)
    if ids.numel():
        pos = torch.arange(ids.numel(), device=ids.device)
        last = torch.full((pages[0].shape[0],), -1, dtype=torch.long, device=ids.device)
        last.scatter_reduce_(0, ids, pos, "amax")
        keep = torch.nonzero(last[ids] == pos).squeeze(1)
        for l, page in enumerate(pages):
            page.index_copy_(0, ids[keep], flat[l].index_select(0, keep))
    calls["reference"] += 1


def _ids(block_ids):
    import torch

    if isinstance(block_ids, torch.Tensor):
        return block_ids
    return torch.as_tensor(np.asarray(block_ids, dtype=np.int64))


def _on_cpu(layers, buf) -> bool:
    return buf.is_cpu and all(t.is_cpu for t in layers)


def _bytes(t, size: tuple[int, ...], stride: tuple[int, ...]):
    """A uint8 view (never a copy) of t's memory, from t's first byte."""
    import torch

    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return raw.as_strided(size, stride, t.storage_offset() * t.element_size())


def _byte_pages(t, what: str):
    """[num_blocks, page_bytes] bytes of a layer: dim 0 is the block, each page contiguous."""
    if t.dim() < 1:
        raise RuntimeError(f"{what} has no block dimension (0-d tensor)")
    expected = 1
    for d in range(t.dim() - 1, 0, -1):
        if t.shape[d] != 1 and t.stride(d) != expected:
            raise RuntimeError(f"{what} pages are not contiguous (sizes {tuple(t.shape)}, strides {t.stride()})")
        expected *= t.shape[d]
    item = t.element_size()
    return _bytes(t, (t.shape[0], expected * item), (t.stride(0) * item, 1))


def _checked(layers, ids, buf):
    """The native op's checks, for the other backends: byte pages, ids, [L, n, page_bytes] buffer."""
    import torch

    if not layers:
        raise RuntimeError("no layers given")
    pages = [_byte_pages(t, f"layer {l}") for l, t in enumerate(layers)]
    num_blocks, page_bytes = pages[0].shape
    for l, p in enumerate(pages):
        if tuple(p.shape) != (num_blocks, page_bytes):
            raise RuntimeError(f"layer {l} has {p.shape[0]} blocks of {p.shape[1]} bytes, "
                               f"layer 0 has {num_blocks} of {page_bytes}")
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise RuntimeError(f"block_ids must be a 1-D int64 or int32 tensor, got {ids.dim()}-D {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise RuntimeError(f"block id out of range 0..{num_blocks - 1}: {ids.tolist()}")
    want = len(layers) * ids.numel() * page_bytes
    if not buf.is_contiguous() or buf.numel() * buf.element_size() != want:
        raise RuntimeError(f"buffer must be contiguous with {want} bytes (layers x ids x page bytes), got "
                           f"{buf.numel() * buf.element_size()}{'' if buf.is_contiguous() else ', not contiguous'}")
    n = ids.numel()
    return pages, ids, _bytes(buf, (len(layers), n, page_bytes), (n * page_bytes, page_bytes, 1))


def _numpy_args(layers, ids, buf):
    pages, ids, flat = _checked(layers, ids, buf)
    return [p.numpy() for p in pages], ids.numpy(), flat.numpy()


# ---- CUDA kernels (libascendserve_cuda.so, through ctypes) -------------------
