"""The CUDA block copy kernels (native/csrc/block_copy_cuda.cu -> libascendserve_cuda.so) and ops.py's wrappers.

On any host with nvcc: the build, loading without a driver, the exports, load_cuda's reasons, the wrappers'
argument checks, and the kernels' own per-thread code run on the CPU (asv_cuda_emulate_runs: the same launch
plan, every thread of every CTA in turn) against a numpy oracle. On a GPU host also the kernels themselves,
bit-exact against the same oracle, and cuda_self_test.
"""

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ascendserve import ops, ops_cuda

REPO = Path(__file__).resolve().parents[2]
LIB = "libascendserve_cuda.so"
EXPORTS = ("asv_cuda_abi_version", "asv_cuda_device_count", "asv_cuda_error_string", "asv_cuda_gather_runs",
           "asv_cuda_scatter_runs", "asv_cuda_emulate_runs")
CUDA_ERROR_INVALID_VALUE = 1
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch")


def find_nvcc():
    """The nvcc native/build.sh would use (NVCC, PATH, /usr/local/cuda/bin), or None."""
    if os.environ.get("NVCC"):
        return os.environ["NVCC"]
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None


def run_build(out, **env):
    return subprocess.run(["bash", str(REPO / "native" / "build.sh"), str(out)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """(out dir, build.sh's last line): native/build.sh run into a temporary folder (incremental: the shared build
    tree makes this a no-op when it is up to date)."""
    if find_nvcc() is None:
        pytest.skip("no nvcc: native/build.sh builds no CUDA library here")
    if shutil.which("cmake") is None or not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("cmake or a C++ compiler is missing: native/ cannot be built")
    out = tmp_path_factory.mktemp("native_cuda")
    done = run_build(out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def library(request):
    """The library to test: built here when nvcc exists, else ascendserve/_native's (a GPU host without nvcc)."""
    if find_nvcc() is None and os.path.exists(ops_cuda.CUDA_LIBRARY):
        return ops_cuda.CUDA_LIBRARY
    return str(request.getfixturevalue("built")[0] / LIB)


@pytest.fixture(scope="session")
def lib(library):
    """The library through plain ctypes (works without a driver), the emulation entry point bound."""
    cdll = ctypes.CDLL(library)
    ops_cuda._bind(cdll)
    return cdll


@pytest.fixture
def fresh_cuda_state(monkeypatch):
    """load_cuda as in a new process (restored afterwards)."""
    monkeypatch.setattr(ops_cuda, "_cuda", None)
    monkeypatch.setattr(ops_cuda, "_cuda_tried", False)
    monkeypatch.setattr(ops_cuda, "_cuda_why_not", "not loaded yet")


# ---- build and load ------------------------------------------------------------
def test_build_makes_the_cuda_library_and_says_so(built):
    out, last = built
    assert (out / LIB).is_file() and (out / "libascendserve_ops.so").is_file()
    assert "CPU kernels; CUDA kernels libascendserve_cuda.so for sm_80,sm_90 + compute_90 PTX" in last, last


def test_second_build_is_a_no_op(built):
    out, _ = built
    before = os.stat(out / LIB)
    done = run_build(out)
    assert done.returncode == 0, done.stderr[-3000:]
    after = os.stat(out / LIB)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rebuilt, not recopied


def test_failed_nvcc_still_ships_the_cpu_library(built, tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "fake nvcc 0.0"; exit 0; }\n'
                    'echo "fake nvcc: compile error" >&2; exit 1\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    done = run_build(out, NVCC=str(fake))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CUDA kernels NOT built: nvcc failed" in done.stdout.strip().splitlines()[-1]
    assert "fake nvcc: compile error" in done.stderr
    assert (out / "libascendserve_ops.so").is_file() and not (out / LIB).exists()
    required = run_build(out, NVCC=str(fake), ASCENDSERVE_REQUIRE_CUDA="1")
    assert required.returncode != 0 and "ASCENDSERVE_REQUIRE_CUDA=1" in required.stderr


def test_library_loads_without_a_driver_and_exports_its_abi(lib, library):
    assert lib.asv_cuda_abi_version() == ops_cuda.CUDA_ABI_VERSION == 1
    for name in EXPORTS:
        assert hasattr(lib, name), name
    assert lib.asv_cuda_error_string(0) == b"no error"
    if shutil.which("nm"):  # the static CUDA runtime stays hidden: no binding to (or from) torch's cudart
        symbols = subprocess.run(["nm", "-D", "--defined-only", library], capture_output=True,
                                 text=True, check=True).stdout.split()
        exported = {s for s in symbols if s.startswith(("asv_", "cuda", "cu"))}
        assert exported == set(EXPORTS)


def test_load_cuda_without_a_device_says_so(lib, library, fresh_cuda_state):
    if lib.asv_cuda_device_count() > 0:
        pytest.skip("this host has a CUDA device")
    assert ops_cuda.load_cuda(library) is False
    assert ops_cuda.cuda_why_not().startswith("no CUDA device (cudaGetDeviceCount: "), ops_cuda.cuda_why_not()
    assert ops_cuda.load_cuda() is False  # remembered, still no raise


def test_load_cuda_without_the_library_says_how_to_build_it(tmp_path, fresh_cuda_state):
    assert ops_cuda.load_cuda(str(tmp_path / LIB)) is False
    assert "libascendserve_cuda.so not found" in ops_cuda.cuda_why_not()
    assert "native/build.sh" in ops_cuda.cuda_why_not()
    with pytest.raises(RuntimeError, match="not found"):
        ops_cuda._cuda_lib()


def test_load_cuda_refuses_another_abi(tmp_path, fresh_cuda_state):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "fake.c"
    src.write_text("int asv_cuda_abi_version(void) { return 2; }\nint asv_cuda_device_count(void) { return 1; }\n"
                   "const char* asv_cuda_error_string(int c) { return \"fake\"; }\n"
                   "int asv_cuda_gather_runs(void) { return 0; }\nint asv_cuda_scatter_runs(void) { return 0; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / LIB), str(src)], check=True)
    assert ops_cuda.load_cuda(str(tmp_path / LIB)) is False
    assert "ABI version 2, this ascendserve needs 1" in ops_cuda.cuda_why_not()


# ---- the wrappers' checks (CPU tensors: no CUDA call may happen) ---------------------
def cpu_case(**change):
    cache = torch.zeros(2 * 6 * 4 * 32, dtype=torch.uint8)
    views = [cache.as_strided((6, 2, 4, 16), (128, 768, 32, 1)) for _ in range(2)]  # K/V planes, half of each head
    args = {"views": views, "ids": [0, 5, 2], "buf": torch.zeros(2 * 3 * 2 * 4 * 16, dtype=torch.uint8)}
    args.update(change)
    return args


BAD = {
    "no views": (dict(views=[]), "no layer views"),
    "not a tensor": (dict(views=[np.zeros((6, 16), np.uint8)]), "not a torch.Tensor"),
    "float32 views": (dict(views=[torch.zeros(6, 2, 4, 4)] * 2), "must be torch.uint8"),
    "1-D view": (dict(views=[torch.zeros(96, dtype=torch.uint8)] * 2), "has 1 dims"),
    "layers differ": (dict(views=[torch.zeros(6, 2, 4, 16, dtype=torch.uint8),
                                  torch.zeros(6, 2, 4, 32, dtype=torch.uint8)[..., :16]]), "layers must share"),
    "run not contiguous": (dict(views=[torch.zeros(6, 2, 4, 32, dtype=torch.uint8)[..., ::2]] * 2),
                           "last stride is 2"),
    "id -1": (dict(ids=[0, -1, 2]), r"block id -1 \(at index 1\) out of range 0..5"),
    "id = blocks": (dict(ids=[0, 6, 2]), "block id 6 .* out of range"),
    "huge id": (dict(ids=np.array([0, 1 << 40, 2])), "out of range"),
    "float ids": (dict(ids=[0.0, 1.0, 2.0]), "must be integers"),
    "2-D ids": (dict(ids=[[0, 1, 2]]), "must be 1-D"),
    "buf one byte short": (dict(buf=torch.zeros(2 * 3 * 2 * 4 * 16 - 1, dtype=torch.uint8)), "bytes, layers x ids"),
    "buf one byte long": (dict(buf=torch.zeros(2 * 3 * 2 * 4 * 16 + 1, dtype=torch.uint8)), "bytes, layers x ids"),
    "buf float32": (dict(buf=torch.zeros(2 * 3 * 2 * 4 * 4)), "contiguous torch.uint8"),
    "buf not contiguous": (dict(buf=torch.zeros(2 * 2 * 3 * 2 * 4 * 16, dtype=torch.uint8)[::2]), "not contiguous"),
    "all on the CPU": ({}, "need CUDA tensors"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("fn", [ops_cuda.gather_runs_cuda, ops_cuda.scatter_runs_cuda])
def test_bad_arguments_raise_value_error_before_cuda(fn, case, monkeypatch):
    def touched():
        raise AssertionError("the CUDA library was reached before the arguments were checked")

    monkeypatch.setattr(ops_cuda, "_cuda_lib", touched)
    change, message = BAD[case]
    args = cpu_case(**change)
    with pytest.raises(ValueError, match=message):
        fn(args["views"], args["ids"], args["buf"])


def test_view_shapes_normalize_to_four_dims():
    cache = torch.zeros(1000, dtype=torch.uint8)
    assert ops_cuda._run_geometry(torch, [cache.as_strided((5, 40), (100, 1))]) == \
        ops_cuda._Runs(5, 1, 1, 40, 100, 0, 0)
    assert ops_cuda._run_geometry(torch, [cache.as_strided((5, 2, 40), (100, 50, 1))]) == \
        ops_cuda._Runs(5, 2, 1, 40, 100, 50, 0)
    assert ops_cuda._run_geometry(torch, [cache.as_strided((5, 2, 3, 8), (100, 50, 10, 1))]) == \
        ops_cuda._Runs(5, 2, 3, 8, 100, 50, 10)


def test_last_wins_marks_overridden_repeats():
    assert ops_cuda._last_wins(np.array([5, 2, 5, 11, 5])).tolist() == [-1, 2, -1, 11, 5]
    assert ops_cuda._last_wins(np.array([3, 1, 3])).tolist() == [-1, 1, 3]
    distinct = np.array([4, 0, 9])
    assert ops_cuda._last_wins(distinct) is distinct
    assert ops_cuda._last_wins(np.array([], np.int64)).size == 0


# ---- the kernels' code, emulated on the CPU, against numpy ------------------------------
# (A, B, run bytes, gap after each run, cache offset, view dims, buffer offset)
GEOMETRIES = {
    "whole pages": (1, 1, 8192, 0, 0, 2, 0),
    "K/V planes": (2, 1, 1024, 0, 0, 3, 0),
    "heads with gaps": (2, 3, 256, 16, 0, 4, 0),
    "odd heads, unaligned": (2, 2, 130, 3, 1, 4, 0),
    "tiny runs": (1, 3, 3, 1, 0, 4, 0),
    "one byte": (1, 1, 1, 0, 0, 2, 0),
    "misaligned apart": (3, 2, 17, 5, 3, 4, 1),
    "chunk + 1": (1, 2, 4097, 2, 6, 4, 2),
    "long unaligned": (1, 1, 65536 + 7, 0, 5, 2, 3),
    "aligned cache, odd buffer": (2, 1, 4096, 0, 0, 3, 8),
}
BLOCKS, LAYERS = 8, 3
GATHER_IDS = [5, 0, 7, 5, 2]
SCATTER_IDS = [3, 7, 3, 0, 3]


class Caches:
    """LAYERS random byte caches, [A, BLOCKS, B + 2, run + gap] each, and views of B runs from the second one."""

    def __init__(self, geometry, seed=0):
        self.a, self.b, self.run, self.gap, self.offset, self.dims, self.buf_offset = geometry
        self.pitch = self.run + self.gap
        self.block = (self.b + 2) * self.pitch
        self.size = self.offset + self.a * BLOCKS * self.block
        rng = np.random.default_rng(seed)
        self.storages = [rng.integers(0, 256, self.size, dtype=np.uint8) for _ in range(LAYERS)]
        self.rng = rng

    @property
    def page(self):
        return self.a * self.b * self.run

    def shape(self):
        size = (BLOCKS, self.a, self.b, self.run)
        stride = (self.block, BLOCKS * self.block, self.pitch, 1)
        if self.dims == 3:
            return (size[0], self.a, self.run), (stride[0], stride[1], 1)
        if self.dims == 2:
            return (size[0], self.run), (stride[0], 1)
        return size, stride

    def numpy_views(self, storages=None):
        size, stride = self.shape()
        start = self.offset + self.pitch
        return [np.lib.stride_tricks.as_strided(s[start:], size, stride) for s in (storages or self.storages)]

    def torch_views(self, storages):
        size, stride = self.shape()
        return [s.as_strided(size, stride, self.offset + self.pitch) for s in storages]

    def geometry(self):
        return ops_cuda._run_geometry(torch, self.torch_views([torch.from_numpy(s) for s in self.storages]))

    def buffer(self, n):
        """A random buffer for n ids, starting buf_offset bytes into its allocation."""
        whole = self.rng.integers(0, 256, self.buf_offset + LAYERS * n * self.page, dtype=np.uint8)
        return whole[self.buf_offset:]

    def gathered(self, ids):
        return np.stack([v[ids] for v in self.numpy_views()]).reshape(-1)

    def scattered(self, ids, buf):
        """The caches after writing buf's rows to ids in order (the last repeat wins)."""
        expect = [s.copy() for s in self.storages]
        rows = buf.reshape(LAYERS, len(ids), *self.shape()[0][1:])
        for l, view in enumerate(self.numpy_views(expect)):
            for i, block in enumerate(ids):
                view[block] = rows[l, i]
        return expect


def emulate(lib, scatter, caches, ids, buf, num_blocks=BLOCKS):
    runs = caches.geometry()
    bases = np.array([s.ctypes.data + caches.offset + caches.pitch for s in caches.storages], dtype=np.uint64)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    return lib.asv_cuda_emulate_runs(int(scatter), bases.ctypes.data, LAYERS, ids.ctypes.data, ids.size, num_blocks,
                                     buf.ctypes.data, runs.block_stride, runs.a, runs.stride_a, runs.b,
                                     runs.stride_b, runs.run)


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_emulated_gather_equals_numpy(lib, name):
    caches = Caches(GEOMETRIES[name])
    before = [s.copy() for s in caches.storages]
    buf = caches.buffer(len(GATHER_IDS))
    assert emulate(lib, False, caches, GATHER_IDS, buf) == 0
    assert np.array_equal(buf, caches.gathered(GATHER_IDS))
    assert all(np.array_equal(a, b) for a, b in zip(caches.storages, before))


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_emulated_scatter_equals_numpy_last_repeat_wins(lib, name):
    caches = Caches(GEOMETRIES[name], seed=1)
    buf = caches.buffer(len(SCATTER_IDS))
    expect = caches.scattered(SCATTER_IDS, buf)
    assert emulate(lib, True, caches, ops_cuda._last_wins(np.array(SCATTER_IDS)), buf) == 0
    for got, want in zip(caches.storages, expect):  # every byte: gaps and other blocks untouched
        assert np.array_equal(got, want)


def test_emulated_kernel_skips_ids_out_of_range(lib):
    caches = Caches(GEOMETRIES["heads with gaps"])
    before = [s.copy() for s in caches.storages]
    buf = caches.buffer(3)
    original = buf.copy()
    assert emulate(lib, False, caches, [-1, BLOCKS, 1 << 40], buf) == 0
    assert emulate(lib, True, caches, [-1, BLOCKS, 1 << 40], buf) == 0
    assert np.array_equal(buf, original)
    assert all(np.array_equal(a, b) for a, b in zip(caches.storages, before))


def test_plan_refuses_bad_scalars_and_accepts_empty_copies(lib):
    args = dict(bases=1, layers=1, ids=1, n=1, blocks=1, buf=1, block_stride=16, a=1, sa=0, b=1, sb=0, run=16)

    def plan(**change):
        a = {**args, **change}
        return lib.asv_cuda_emulate_runs(0, a["bases"], a["layers"], a["ids"], a["n"], a["blocks"], a["buf"],
                                         a["block_stride"], a["a"], a["sa"], a["b"], a["sb"], a["run"])

    assert plan(run=-1) == plan(n=-1) == plan(a=-2) == CUDA_ERROR_INVALID_VALUE
    assert plan(ids=None) == CUDA_ERROR_INVALID_VALUE
    assert plan(layers=1 << 16, n=1 << 16, run=1) == CUDA_ERROR_INVALID_VALUE  # 2^32 items: over 32-bit indexing
    assert plan(n=0, ids=None, bases=None, buf=None) == 0  # nothing to copy, nothing read
    assert plan(run=0) == 0


# ---- on a GPU ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def cuda_kernels(library):
    assert ops_cuda.load_cuda(library), ops_cuda.cuda_why_not()
    return torch.device("cuda", torch.cuda.current_device())


def on_device(caches, dev):
    storages = [torch.from_numpy(s).to(dev) for s in caches.storages]
    return storages, caches.torch_views(storages)


@GPU
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_gpu_gather_equals_numpy(cuda_kernels, name):
    caches = Caches(GEOMETRIES[name])
    storages, views = on_device(caches, cuda_kernels)
    buf = torch.from_numpy(caches.buffer(len(GATHER_IDS)).copy()).to(cuda_kernels)
    before = ops.calls["cuda"]
    ops_cuda.gather_runs_cuda(views, GATHER_IDS, buf)
    assert ops.calls["cuda"] - before == 1
    assert np.array_equal(buf.cpu().numpy(), caches.gathered(GATHER_IDS))
    assert all(np.array_equal(s.cpu().numpy(), c) for s, c in zip(storages, caches.storages))


@GPU
@pytest.mark.parametrize("name", list(GEOMETRIES))
@pytest.mark.parametrize("stream_kind", ["current", "cuda stream", "torch.Stream"])
def test_gpu_scatter_equals_numpy_last_repeat_wins(cuda_kernels, name, stream_kind):
    caches = Caches(GEOMETRIES[name], seed=1)
    host_buf = caches.buffer(len(SCATTER_IDS)).copy()
    expect = caches.scattered(SCATTER_IDS, host_buf)
    storages, views = on_device(caches, cuda_kernels)
    buf = torch.from_numpy(host_buf).to(cuda_kernels)
    current = torch.cuda.current_stream(cuda_kernels)
    stream = {"current": None, "cuda stream": torch.cuda.Stream(cuda_kernels),
              "torch.Stream": torch.Stream(device=cuda_kernels)}[stream_kind]
    if stream is not None:
        stream.wait_stream(current)
    ops_cuda.scatter_runs_cuda(views, torch.tensor(SCATTER_IDS, device=cuda_kernels), buf, stream=stream)
    if stream is not None:
        current.wait_stream(stream)
    for got, want in zip(storages, expect):
        assert np.array_equal(got.cpu().numpy(), want)


@GPU
def test_gpu_round_trip_of_a_large_cache(cuda_kernels):
    """A realistic size: 4 layers of [2, 512 blocks, 16 tokens, 8 heads, 128] bf16, heads 2..5 of K and V."""
    caches = [torch.randn(2, 512, 16, 8, 128, device=cuda_kernels).to(torch.bfloat16) for _ in range(4)]
    views = [c.view(torch.uint8).as_strided((512, 2, 16, 4 * 256), (16 * 8 * 256, 512 * 16 * 8 * 256, 8 * 256, 1),
                                            2 * 256) for c in caches]
    ids = torch.randperm(512)[:300].tolist()
    buf = torch.empty(4 * 300 * 2 * 16 * 4 * 256, dtype=torch.uint8, device=cuda_kernels)
    ops_cuda.gather_runs_cuda(views, ids, buf)
    want = torch.stack([v[torch.tensor(ids, device=cuda_kernels)] for v in views]).reshape(-1)
    assert torch.equal(buf, want)
    back = [torch.zeros_like(c) for c in caches]
    back_views = [b.view(torch.uint8).as_strided(v.shape, v.stride(), 2 * 256) for b, v in zip(back, views)]
    ops_cuda.scatter_runs_cuda(back_views, ids, buf)
    for c, b in zip(caches, back):
        assert torch.equal(c[:, ids, :, 2:6], b[:, ids, :, 2:6])
        assert not b[:, :, :, :2].any() and not b[:, :, :, 6:].any()


@GPU
def test_gpu_self_test_passes(cuda_kernels):
    assert ops_cuda.cuda_self_test(cuda_kernels) == ""


@GPU
@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC", "BLHNC", "BHLNC"])
def test_gpu_paged_kv_staging_goes_through_the_kernels_bit_exact(cuda_kernels, layout):
    """PagedKV's staged copies on a CUDA cache use the kernels (after their self-test) and move what the
    same cache on the host moves: whole layers, a head range, whole cross-layer blocks, and back."""
    from ascendserve.connectors.kv.pages import PagedKV

    def build(layout, num_blocks, device, seed):  # one buffer in the layout's physical order, per layer [B, H, N, C]
        logical = {"L": 6, "B": num_blocks, "H": 4, "N": 16, "C": 64}
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(-30000, 30000, [logical[a] for a in layout], dtype=torch.int16, generator=g)
        five = raw.view(torch.float16).to(device).permute(*[layout.index(a) for a in "LBHNC"])
        return {f"model.layers.{i}.self_attn.attn": five[i] for i in range(logical["L"])}

    blocks, ids = 12, [7, 0, 11, 3]
    host = PagedKV(build(layout, blocks, "cpu", seed=3), blocks)
    gpu = PagedKV(build(layout, blocks, str(cuda_kernels), seed=3), blocks, staging=True)
    back = PagedKV(build(layout, blocks, str(cuda_kernels), seed=4), blocks, staging=True)
    before = ops.calls["cuda"]
    for layer in (0, 5):
        for heads in (None, (1, 2)):
            want = host.gather_layer(layer, ids) if heads is None else None
            if want is None:
                want = np.empty((len(ids), 2 * host.head_bytes), dtype=np.uint8)
                host.gather_layer_into(layer, ids, want, heads)
            out = torch.empty(want.nbytes, dtype=torch.uint8, pin_memory=True)
            gpu.wait(gpu.copy_out(layer, ids, out, heads))
            assert np.array_equal(out.numpy(), want.reshape(-1)), (layer, heads)
            back.wait(back.copy_in(layer, ids, out, heads))
            got = np.empty_like(want)
            back.gather_layer_into(layer, ids, got, heads)
            assert np.array_equal(got, want), (layer, heads)
    if gpu.whole_blocks():
        span = gpu.num_layers * gpu.page_bytes
        out = torch.empty(len(ids) * span, dtype=torch.uint8, pin_memory=True)
        gpu.wait(gpu.copy_out(None, ids, out))
        want = np.concatenate([np.asarray(v) for v in host.request_views(ids)])
        assert np.array_equal(out.numpy(), want)
    assert ops.calls["cuda"] > before  # the kernels did the copies, not torch's index ops
