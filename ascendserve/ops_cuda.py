"""The CUDA block copy kernels, `gather_runs_cuda` / `scatter_runs_cuda`, for CUDA caches (ops.py
copies pages of CPU memory):
libascendserve_cuda.so (native/csrc/block_copy_cuda.cu), a plain C library
called through ctypes, not a torch op, so it serves any CUDA build of torch.
They copy "strided runs" (pages that are A x B runs of bytes, e.g. one head's
slice of each K and V plane) between byte views of the cache and a contiguous
device buffer, asynchronously on a stream. `load_cuda()` says whether they can
run here (`cuda_why_not()` why not), `cuda_self_test(device)` whether they copy
what the torch reference copies; callers use them only where both passed.

Importing this module imports no torch.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass

import numpy as np

from ascendserve.ops import calls

_lock = threading.Lock()


CUDA_LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_native", "libascendserve_cuda.so")
CUDA_ABI_VERSION = 1  # asv_cuda_abi_version() of the library this module speaks to

_cuda = None  # the ctypes library, once loaded with a device to run on
_cuda_tried = False
_cuda_why_not = "not loaded yet"

# asv_cuda_{gather,scatter}_runs(bases_dev, num_layers, ids_dev, n, num_blocks, buf, block_stride,
#                               a_extent, stride_a, b_extent, stride_b, run_bytes, device, stream)
_RUNS_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]


def load_cuda(path: str | None = None) -> bool:
    """Load the CUDA kernels (default: CUDA_LIBRARY) and use them from now on; False if they cannot run here.

    Never raises and imports no torch; `cuda_why_not()` says why not (library
    missing, another ABI, no CUDA device). Logs the outcome once. Tests pass an
    explicit path, which is tried even after a failure; once loaded, the
    library stays."""
    global _cuda, _cuda_tried, _cuda_why_not
    with _lock:
        if _cuda is not None or (path is None and _cuda_tried):
            return _cuda is not None
        _cuda_tried = True
        path = path or CUDA_LIBRARY
        try:
            _cuda = _open_cuda(path)
            _cuda_why_not = ""
        except (OSError, AttributeError, RuntimeError) as exc:  # missing, foreign or no device: say why
            _cuda_why_not = str(exc)
        _log_cuda(path)
        return _cuda is not None


def cuda_why_not() -> str:
    """Why the CUDA kernels are not in use ("" once load_cuda() succeeded)."""
    return _cuda_why_not


def _open_cuda(path: str):
    if not os.path.exists(path):
        raise RuntimeError(f"{os.path.basename(path)} not found at {path} (build it: native/build.sh)")
    lib = _open_library(path)
    count = lib.asv_cuda_device_count()
    if count <= 0:
        raise RuntimeError(f"no CUDA device ({_no_device_detail(lib, count)})")
    return lib


def _open_library(path: str):
    """The library at `path`, its ABI checked first (another ABI may lack a symbol), then bound."""
    try:
        lib = ctypes.CDLL(path)
        lib.asv_cuda_abi_version.argtypes = []
        lib.asv_cuda_abi_version.restype = ctypes.c_int
        version = lib.asv_cuda_abi_version()
        if version != CUDA_ABI_VERSION:
            raise RuntimeError(f"{path} has ABI version {version}, this ascendserve needs {CUDA_ABI_VERSION} "
                               "(rebuild it: native/build.sh)")
        _bind(lib)
    except (OSError, AttributeError) as exc:
        raise RuntimeError(f"{path} does not load ({exc}; rebuild it: native/build.sh)") from exc
    return lib


def _bind(lib) -> None:
    lib.asv_cuda_abi_version.argtypes = []
    lib.asv_cuda_abi_version.restype = ctypes.c_int
    lib.asv_cuda_device_count.argtypes = []
    lib.asv_cuda_device_count.restype = ctypes.c_int
    lib.asv_cuda_error_string.argtypes = [ctypes.c_int]
    lib.asv_cuda_error_string.restype = ctypes.c_char_p
    for name in ("asv_cuda_gather_runs", "asv_cuda_scatter_runs"):
        fn = getattr(lib, name)
        fn.argtypes = _RUNS_ARGTYPES
        fn.restype = ctypes.c_int
    lib.asv_cuda_emulate_runs.argtypes = [ctypes.c_int, *_RUNS_ARGTYPES[:-2]]
    lib.asv_cuda_emulate_runs.restype = ctypes.c_int


def _cuda_error(lib, code: int) -> str:
    return f"{lib.asv_cuda_error_string(code).decode(errors='replace')} (cudaError {code})"


def _no_device_detail(lib, count: int) -> str:
    if count == 0:
        return "cudaGetDeviceCount: 0 devices"
    detail = f"cudaGetDeviceCount: {_cuda_error(lib, -count)}"
    try:  # without a driver the runtime says "insufficient driver": name the real cause
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        detail += "; no CUDA driver here (libcuda.so.1 not found)"
    return detail


def _log_cuda(path: str) -> None:
    from ascendserve.logging import log_library

    log_library("ascendserve.ops_cuda", _cuda is not None, path, "CUDA block copy kernels: loaded",
                "CUDA block copy kernels: not available", _cuda_why_not)


def _cuda_lib():
    """The loaded library; RuntimeError saying why when it cannot run here."""
    if not load_cuda():
        raise RuntimeError(f"CUDA block copy kernels unavailable: {_cuda_why_not}")
    return _cuda


def gather_runs_cuda(layer_views, block_ids, buf, stream=None) -> None:
    """buf[l, i, a, b] = layer_views[l][block_ids[i], a, b] (bytes), with the CUDA kernels.

    layer_views: one torch.uint8 CUDA tensor per layer, a view of that layer's
      cache bytes shaped [num_blocks, A, B, run] (or [num_blocks, A, run], or
      [num_blocks, run]), all with the same shape and strides, last stride 1
      (a run is contiguous; runs may have gaps between them).
    block_ids: ints (list, numpy array or tensor; a CUDA tensor is read back),
      each in 0..num_blocks-1, checked here (the kernels trust them).
    buf: a contiguous torch.uint8 tensor of L * n * A * B * run bytes on the
      same device, read as [L, n, A, B, run].
    stream: a torch.cuda.Stream or torch.Stream, or None (the current stream).
      The copy is queued there and not waited for: the caller orders it after
      the writes it reads (stream.wait_stream / events), waits for it before
      using the result, and keeps the tensors alive until then. The ids and
      layer addresses travel to the device on that stream, so no other sync.

    Raises ValueError for bad arguments (before any CUDA call), RuntimeError
    when the kernels cannot run here (cuda_why_not()) or CUDA refuses the
    launch. Example, a GPU host's bench:

        from ascendserve import ops_cuda
        assert ops_cuda.load_cuda(), ops_cuda.cuda_why_not()
        assert not ops_cuda.cuda_self_test("cuda:0")
        kv = cache.view(torch.uint8)               # a layer's [2, blocks, 16, heads, 128] bf16 cache
        view = kv.as_strided((blocks, 2, 16 * heads * 256), (16 * heads * 256, blocks * 16 * heads * 256, 1))
        ops_cuda.gather_runs_cuda([view], ids, staging)  # staging: uint8 [1 * len(ids) * 2 * 16 * heads * 256]
        torch.cuda.current_stream().synchronize()
    """
    _runs_cuda(False, layer_views, block_ids, buf, stream)


def scatter_runs_cuda(layer_views, block_ids, buf, stream=None) -> None:
    """layer_views[l][block_ids[i], a, b] = buf[l, i, a, b] (bytes): gather_runs_cuda's reverse, same arguments.

    With repeated ids the last occurrence wins: the earlier ones are not
    written at all (the kernel's threads write in no order, so this module
    sends -1, "skip", for every position a later repeat overrides)."""
    _runs_cuda(True, layer_views, block_ids, buf, stream)


def emulate_runs_cuda(scatter: bool, layer_views, block_ids, buf) -> None:
    """gather_runs_cuda (scatter False) or scatter_runs_cuda on host tensors: the kernels'
    own launch plan and per-thread code (asv_cuda_emulate_runs), run thread by thread on
    the CPU. How CI, which has no GPU, runs PagedKV's CUDA-kernel branch
    (PagedKV(staging=True, kernels="emulated")); slow, for tests. The same argument
    checks as on the device; RuntimeError when the library is not built or not loadable."""
    import torch

    views = list(layer_views)
    runs = _run_geometry(torch, views)
    ids = _host_ids(torch, block_ids, runs.num_blocks)
    _check_buf(torch, buf, len(views) * ids.size * runs.page_bytes)
    for l, v in enumerate([*views, buf]):
        if v.device.type != "cpu":
            raise ValueError(f"{'buf' if l == len(views) else f'layer view {l}'} is on {v.device}: "
                             "the emulation runs on host memory")
    lib = _host_cuda_lib()
    if scatter:
        ids = _last_wins(ids)
    bases = np.array([v.data_ptr() for v in views], dtype=np.uint64)
    rc = lib.asv_cuda_emulate_runs(int(scatter), bases.ctypes.data, len(views), ids.ctypes.data, ids.size,
                                   runs.num_blocks, buf.data_ptr(), runs.block_stride, runs.a, runs.stride_a,
                                   runs.b, runs.stride_b, runs.run)
    if rc != 0:
        raise RuntimeError(f"asv_cuda_emulate_runs: {_cuda_error(lib, rc)}")
    calls["emulated"] += 1


_host_cuda = None  # the library opened without a device, for emulate_runs_cuda


def _host_cuda_lib():
    global _host_cuda
    with _lock:
        if _host_cuda is None:
            if not os.path.exists(CUDA_LIBRARY):
                raise RuntimeError(f"the CUDA kernels' emulation needs {CUDA_LIBRARY} (build it: native/build.sh "
                                   "with an nvcc)")
            _host_cuda = _open_library(CUDA_LIBRARY)
        return _host_cuda


def cuda_library_built() -> bool:
    """Whether libascendserve_cuda.so is here (it may still have no device to run on)."""
    return os.path.exists(CUDA_LIBRARY)


@dataclass(frozen=True)
class _Runs:
    """A layer view's geometry in bytes: [num_blocks, a, b, run] with strides (block_stride, stride_a, stride_b, 1)."""

    num_blocks: int
    a: int
    b: int
    run: int
    block_stride: int
    stride_a: int
    stride_b: int

    @property
    def page_bytes(self) -> int:
        return self.a * self.b * self.run


def _runs_cuda(scatter: bool, layer_views, block_ids, buf, stream) -> None:
    import torch

    views = list(layer_views)
    runs = _run_geometry(torch, views)
    ids = _host_ids(torch, block_ids, runs.num_blocks)
    _check_buf(torch, buf, len(views) * ids.size * runs.page_bytes)
    device = _cuda_device(views, buf)
    lib = _cuda_lib()
    if buf.numel() == 0:
        calls["cuda"] += 1
        return
    if scatter:
        ids = _last_wins(ids)
    cuda_stream = _torch_stream(torch, stream, device)
    meta = _upload(torch, views, ids, device, cuda_stream)  # alive until the launch is queued: enough (below)
    fn = lib.asv_cuda_scatter_runs if scatter else lib.asv_cuda_gather_runs
    rc = fn(meta.data_ptr(), len(views), meta.data_ptr() + 8 * len(views), ids.size, runs.num_blocks,
            buf.data_ptr(), runs.block_stride, runs.a, runs.stride_a, runs.b, runs.stride_b, runs.run,
            device, cuda_stream.cuda_stream)
    if rc != 0:
        raise RuntimeError(f"asv_cuda_{'scatter' if scatter else 'gather'}_runs on cuda:{device}: "
                           f"{_cuda_error(lib, rc)}")
    calls["cuda"] += 1


def _run_geometry(torch, views) -> _Runs:
    """The layers' common view geometry, normalized to [num_blocks, A, B, run]; ValueError if they have none."""
    if not views:
        raise ValueError("no layer views given")
    first = views[0]
    for l, v in enumerate(views):
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"layer view {l} is a {type(v).__name__}, not a torch.Tensor")
        if v.dtype != torch.uint8:
            raise ValueError(f"layer view {l} is {v.dtype}: views must be torch.uint8 (view the cache as bytes)")
        if not 2 <= v.dim() <= 4:
            raise ValueError(f"layer view {l} has {v.dim()} dims: want [num_blocks, A, B, run], "
                             "[num_blocks, A, run] or [num_blocks, run]")
        if v.shape != first.shape or v.stride() != first.stride():
            raise ValueError(f"layer view {l} is {tuple(v.shape)} with strides {v.stride()}, layer view 0 "
                             f"{tuple(first.shape)} with strides {first.stride()}: layers must share both")
    if first.shape[-1] > 1 and first.stride(-1) != 1:
        raise ValueError(f"layer views' last stride is {first.stride(-1)}: it must be 1 (a run is contiguous)")
    shape, strides = list(first.shape), list(first.stride())
    while len(shape) < 4:  # [N, run] -> [N, 1, 1, run]; [N, A, run] -> [N, A, 1, run]
        shape.insert(len(shape) - 1, 1)
        strides.insert(len(strides) - 1, 0)
    return _Runs(num_blocks=shape[0], a=shape[1], b=shape[2], run=shape[3],
                 block_stride=strides[0], stride_a=strides[1], stride_b=strides[2])


def _host_ids(torch, block_ids, num_blocks: int) -> np.ndarray:
    """block_ids as a 1-D int64 numpy array, each in 0..num_blocks-1; ValueError otherwise."""
    if isinstance(block_ids, torch.Tensor):
        ids = block_ids.detach().cpu().numpy()
    else:
        ids = np.asarray(block_ids)
    if ids.size == 0:
        ids = ids.reshape(0).astype(np.int64)  # [] is float64 to numpy
    if ids.ndim != 1:
        raise ValueError(f"block ids must be 1-D, got shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"block ids must be integers, got {ids.dtype}")
    bad = np.flatnonzero((ids < 0) | (ids >= num_blocks))
    if bad.size:
        raise ValueError(f"block id {ids[bad[0]]} (at index {bad[0]}) out of range 0..{num_blocks - 1}")
    return ids.astype(np.int64, copy=False)


def _check_buf(torch, buf, want: int) -> None:
    if not isinstance(buf, torch.Tensor):
        raise ValueError(f"buf is a {type(buf).__name__}, not a torch.Tensor")
    if buf.dtype != torch.uint8 or not buf.is_contiguous():
        raise ValueError(f"buf must be a contiguous torch.uint8 tensor, got {buf.dtype}"
                         f"{'' if buf.is_contiguous() else ', not contiguous'}")
    if buf.numel() != want:
        raise ValueError(f"buf holds {buf.numel()} bytes, layers x ids x A x B x run = {want}")


def _cuda_device(views, buf) -> int:
    """The CUDA device index all the tensors are on; ValueError if they are elsewhere or apart."""
    if buf.device.type != "cuda":
        raise ValueError(f"buf is on {buf.device}: the CUDA kernels need CUDA tensors")
    for l, v in enumerate(views):
        if v.device != buf.device:
            raise ValueError(f"layer view {l} is on {v.device}, buf on {buf.device}")
    return buf.device.index


def _last_wins(ids: np.ndarray) -> np.ndarray:
    """ids with -1 (the kernel's "skip") at each position that a later repeat of its id overrides."""
    if ids.size < 2:
        return ids
    distinct, first_from_end = np.unique(ids[::-1], return_index=True)
    if distinct.size == ids.size:
        return ids
    keep = ids.size - 1 - first_from_end  # each id's last position
    out = np.full_like(ids, -1)
    out[keep] = ids[keep]
    return out


def _torch_stream(torch, stream, device: int):
    """stream (None: the current one) as a torch.cuda.Stream of `device`."""
    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, torch.cuda.Stream):
        cuda_stream = stream
    elif isinstance(stream, torch.Stream) and stream.device.type == "cuda":
        cuda_stream = torch.cuda.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                                        device_type=stream.device_type)  # the same stream, CUDA-typed
    else:
        raise ValueError(f"stream must be a CUDA torch.cuda.Stream or torch.Stream, or None; got {stream!r}")
    if cuda_stream.device_index != device:
        raise ValueError(f"stream is on cuda:{cuda_stream.device_index}, the tensors on cuda:{device}")
    return cuda_stream


def _upload(torch, views, ids: np.ndarray, device: int, stream):
    """[layer addresses..., ids...] as one int64 tensor on the device, copied on `stream`.

    Pinned memory and a non-blocking copy: the host does not wait. Both
    buffers belong to `stream` (the caching allocators reuse them only after
    the work queued there so far), so dropping them after the launch is safe."""
    host = torch.empty(len(views) + ids.size, dtype=torch.int64, pin_memory=True)
    flat = host.numpy()
    flat[:len(views)] = np.array([v.data_ptr() for v in views], dtype=np.uint64).view(np.int64)
    flat[len(views):] = ids
    with torch.cuda.stream(stream):
        return host.to(device=torch.device("cuda", device), non_blocking=True)


# ---- cuda_self_test: the kernels against torch on the device -----------------
# (name, A, B, run bytes, gap after each run, byte offset of the storage, view dims)
_SELF_TEST_CASES = (
    ("whole pages", 1, 1, 8192, 0, 0, 2),        # aligned, two chunks per run
    ("K/V planes", 2, 1, 1024, 0, 0, 3),
    ("heads", 2, 3, 256, 16, 0, 4),              # runs with gaps between them
    ("odd heads", 2, 2, 130, 3, 1, 4),           # unaligned runs and addresses
    ("tiny runs", 1, 3, 3, 1, 0, 4),
    ("long unaligned", 1, 1, 65536 + 7, 0, 5, 2),
)
_SELF_TEST_BLOCKS = 8
_SELF_TEST_LAYERS = 3
_SELF_TEST_GATHER_IDS = (5, 0, 7, 5, 2)   # a repeat and the last block
_SELF_TEST_SCATTER_IDS = (3, 7, 3, 0, 3)  # block 3 three times: its last source wins


def cuda_self_test(device) -> str:
    """"" when gather_runs_cuda / scatter_runs_cuda copy exactly the bytes torch copies on `device`, else what failed.

    Loads the library; small random data over the _SELF_TEST_CASES geometries
    (runs with gaps, unaligned run sizes and addresses, repeated ids, a side
    stream for scatter), checking every byte of the caches, gaps included.
    Synchronizes `device`; a few milliseconds."""
    import torch

    try:
        if not load_cuda():
            return cuda_why_not()
        dev = torch.device(device)
        gen = torch.Generator().manual_seed(0)
        for case in _SELF_TEST_CASES:
            problem = _self_test_case(torch, dev, gen, *case)
            if problem:
                return problem
        return ""
    except Exception as exc:  # a failed launch, a bad device: the kernels are not for this device
        return f"{type(exc).__name__}: {exc}"


def _self_test_views(torch, storages, a, b, run, gap, offset, dims):
    """Views of [A, blocks, B + 2, run + gap] byte caches, B runs from the second on (gaps on both sides)."""
    pitch = run + gap
    block = (b + 2) * pitch
    size, stride = (_SELF_TEST_BLOCKS, a, b, run), (block, _SELF_TEST_BLOCKS * block, pitch, 1)
    if dims == 3:
        size, stride = (size[0], a, run), (stride[0], stride[1], 1)
    elif dims == 2:
        size, stride = (size[0], run), (stride[0], 1)
    return [s.as_strided(size, stride, offset + pitch) for s in storages]


def _self_test_case(torch, dev, gen, name, a, b, run, gap, offset, dims) -> str:
    cache_bytes = offset + a * _SELF_TEST_BLOCKS * (b + 2) * (run + gap)

    def random_bytes(n):
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).to(dev)

    storages = [random_bytes(cache_bytes) for _ in range(_SELF_TEST_LAYERS)]
    views = _self_test_views(torch, storages, a, b, run, gap, offset, dims)
    page = a * b * run

    ids = list(_SELF_TEST_GATHER_IDS)
    buf = random_bytes(_SELF_TEST_LAYERS * len(ids) * page)
    gather_runs_cuda(views, ids, buf)
    index = torch.tensor(ids, device=dev)
    want = torch.stack([v.index_select(0, index) for v in views]).reshape(-1)
    if not torch.equal(buf, want):
        return f"gather_runs_cuda, {name}: bytes differ from torch's"

    ids = list(_SELF_TEST_SCATTER_IDS)
    src = random_bytes(_SELF_TEST_LAYERS * len(ids) * page)
    expect = [s.clone() for s in storages]
    rows = src.view(_SELF_TEST_LAYERS, len(ids), *views[0].shape[1:])
    for l, view in enumerate(_self_test_views(torch, expect, a, b, run, gap, offset, dims)):
        for i, block in enumerate(ids):  # in order: the last repeat wins
            view[block].copy_(rows[l, i])
    side, current = torch.cuda.Stream(dev), torch.cuda.current_stream(dev)
    side.wait_stream(current)
    scatter_runs_cuda(views, ids, src, stream=side)
    current.wait_stream(side)
    if not all(torch.equal(got, want) for got, want in zip(storages, expect)):
        return f"scatter_runs_cuda, {name}: cache bytes differ from torch's (repeated ids or gaps)"
    return ""
