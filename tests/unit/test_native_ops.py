"""The native block copy ops (native/) against the torch reference, and the connectors' use of them."""

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ascendserve import ops

REPO = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]


@pytest.fixture(scope="session")
def native(tmp_path_factory):
    """torch.ops.ascendserve, from ascendserve/_native/ if built, else built here into a temporary folder."""
    if not os.path.exists(ops.LIBRARY):
        if shutil.which("cmake") is None or not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
            pytest.skip("cmake or a C++ compiler is missing: native/ cannot be built")
        out = tmp_path_factory.mktemp("native")
        subprocess.run(["bash", str(REPO / "native" / "build.sh"), str(out)], check=True, timeout=600)
        path = str(out / "libascendserve_ops.so")
    else:
        path = ops.LIBRARY
    assert ops.load_native(path), ops._why_not
    assert ops.backend() == "native"
    return torch.ops.ascendserve


def layers_of(dtype, n_layers=3, blocks=12, page=(2, 16, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((blocks, *page), generator=g).mul(40).to(dtype) for _ in range(n_layers)]


def page_bytes(layer):
    return layer[0].numel() * layer.element_size()


def random_ids(n, blocks, seed):
    return torch.randint(0, blocks, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_gather_equals_reference(native, dtype, ids_dtype):
    layers = layers_of(dtype)
    for seed in range(5):
        ids = random_ids(7, 12, seed).to(ids_dtype)
        got = torch.full((3, 7, page_bytes(layers[0])), 7, dtype=torch.uint8)
        want = torch.zeros_like(got)
        native.gather_blocks(layers, ids, got)
        ops.gather_blocks_ref(layers, ids, want)
        assert torch.equal(got, want)
        for l, layer in enumerate(layers):  # and it means what it says
            assert torch.equal(got[l].view(dtype).view(7, *layer.shape[1:]), layer[ids.long()])


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_equals_reference(native, dtype):
    for seed in range(5):
        ids = torch.randperm(12, generator=torch.Generator().manual_seed(seed))[:5]
        src = layers_of(dtype, n_layers=1, blocks=3 * 5, seed=seed + 100)[0]  # [L*n pages] of `dtype`
        got, want = layers_of(dtype), layers_of(dtype)
        native.scatter_blocks(got, ids, src)
        ops.scatter_blocks_ref(want, ids, src)
        for g, w, l in zip(got, want, range(3)):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
            assert torch.equal(g[ids], src[l * 5:(l + 1) * 5])


def test_dtype_of_the_buffer_does_not_matter(native):
    layers = layers_of(torch.bfloat16)
    ids = torch.tensor([11, 0, 4])
    as_bytes = torch.empty(3 * 3 * page_bytes(layers[0]), dtype=torch.uint8)
    as_f32 = torch.empty(3 * 3 * page_bytes(layers[0]) // 4, dtype=torch.float32)
    native.gather_blocks(layers, ids, as_bytes)
    native.gather_blocks(layers, ids, as_f32)
    assert torch.equal(as_bytes, as_f32.view(torch.uint8))


def test_empty_ids_copy_nothing(native):
    layers = layers_of(torch.float32)
    before = [t.clone() for t in layers]
    empty = torch.empty(0, dtype=torch.uint8)
    native.gather_blocks(layers, torch.empty(0, dtype=torch.int64), empty)
    native.scatter_blocks(layers, torch.empty(0, dtype=torch.int64), empty)
    ops.gather_blocks_ref(layers, torch.empty(0, dtype=torch.int64), empty)
    ops.scatter_blocks_ref(layers, torch.empty(0, dtype=torch.int64), empty)
    assert all(torch.equal(a, b) for a, b in zip(layers, before))


def test_repeated_and_last_block(native):
    layers = layers_of(torch.float16)
    ids = torch.tensor([11, 3, 11, 11, 0])
    got = torch.empty((3, 5, page_bytes(layers[0])), dtype=torch.uint8)
    want = torch.empty_like(got)
    native.gather_blocks(layers, ids, got)
    ops.gather_blocks_ref(layers, ids, want)
    assert torch.equal(got, want) and torch.equal(got[:, 0], got[:, 2])


@pytest.mark.parametrize("threads", [1, 4])
def test_scatter_repeated_ids_last_write_wins(native, threads):
    ids = torch.tensor([5, 2, 5, 11, 5])
    n_layers, blocks = 2, 12
    page = (64, 1024)  # 256 KiB pages: 2.5 MiB in all, so 4 threads are really used
    src = torch.randn((n_layers * 5, *page))
    got = [torch.zeros((blocks, *page)) for _ in range(n_layers)]
    want = [torch.zeros((blocks, *page)) for _ in range(n_layers)]
    native.scatter_blocks(got, ids, src, threads)
    ops.scatter_blocks_ref(want, ids, src)
    for l in range(n_layers):
        assert torch.equal(got[l], want[l])
        assert torch.equal(got[l][5], src[l * 5 + 4]) and torch.equal(got[l][2], src[l * 5 + 1])


@pytest.mark.parametrize("threads", [1, 2, 4, 16])
def test_threaded_copies_match(native, threads):
    layers = [torch.randn(40, 8, 128, 64) for _ in range(3)]  # 256 KiB pages
    ids = torch.randperm(40)[:17]
    got = torch.empty((3, 17, page_bytes(layers[0])), dtype=torch.uint8)
    want = torch.empty_like(got)
    native.gather_blocks(layers, ids, got, threads)
    ops.gather_blocks_ref(layers, ids, want)
    assert torch.equal(got, want)
    back = [torch.zeros_like(t) for t in layers]
    native.scatter_blocks(back, ids, got, threads)
    for t, b in zip(layers, back):
        assert torch.equal(t[ids], b[ids])


def test_strided_layers_keep_contiguous_pages(native):
    """A layer may be a slice of a bigger cache (dim 0 strided); only pages must be contiguous."""
    big = torch.randn(24, 2, 8, 4)
    layers = [big[::2], big[1::2]]
    ids = torch.tensor([0, 11, 5])
    got = torch.empty((2, 3, page_bytes(big)), dtype=torch.uint8)
    want = torch.empty_like(got)
    native.gather_blocks(layers, ids, got)
    ops.gather_blocks_ref(layers, ids, want)
    assert torch.equal(got, want)


@pytest.mark.parametrize("bad_id", [12, -1, 1 << 40])
@pytest.mark.parametrize("which", ["gather", "scatter"])
def test_out_of_range_id_raises_before_copying(native, bad_id, which):
    layers = layers_of(torch.float32)
    before = [t.clone() for t in layers]
    ids = torch.tensor([0, 1, bad_id])
    buf = torch.zeros((3, 3, page_bytes(layers[0])), dtype=torch.uint8)
    for fn in (getattr(native, f"{which}_blocks"), getattr(ops, f"{which}_blocks_ref")):
        with pytest.raises(RuntimeError, match="out of range"):
            fn(layers, ids, buf)
    assert not buf.any() and all(torch.equal(a, b) for a, b in zip(layers, before))


@pytest.mark.parametrize("case", ["small", "big", "not_contiguous", "ids_float", "ids_2d", "pages_differ",
                                  "blocks_differ", "page_not_contiguous", "no_layers"])
def test_bad_arguments_raise(native, case):
    layers = layers_of(torch.float32)
    pb = page_bytes(layers[0])
    ids = torch.tensor([1, 2])
    buf = torch.zeros((3, 2, pb), dtype=torch.uint8)
    if case == "small":
        buf = buf.reshape(-1)[:-1]
    elif case == "big":
        buf = torch.zeros(3 * 2 * pb + 1, dtype=torch.uint8)
    elif case == "not_contiguous":
        buf = torch.zeros((3, 2, 2 * pb), dtype=torch.uint8)[:, :, ::2]
    elif case == "ids_float":
        ids = ids.float()
    elif case == "ids_2d":
        ids = ids.reshape(1, 2)
    elif case == "pages_differ":
        layers[1] = torch.zeros(12, 2, 16, 4)
    elif case == "blocks_differ":
        layers[1] = torch.zeros(13, 2, 16, 8)
    elif case == "page_not_contiguous":
        layers[2] = torch.zeros(12, 2, 8, 16).transpose(2, 3)
    elif case == "no_layers":
        layers = []
    for fn in (native.gather_blocks, native.scatter_blocks, ops.gather_blocks_ref, ops.scatter_blocks_ref):
        with pytest.raises(RuntimeError):
            fn(layers, ids, buf)


def test_python_entry_points_count_native_calls(native):
    layers = layers_of(torch.bfloat16)
    ids = [3, 3, 0]
    buf = torch.empty((3, 3, page_bytes(layers[0])), dtype=torch.uint8)
    before = ops.calls["native"]
    ops.gather_blocks(layers, ids, buf)
    ops.scatter_blocks(layers, np.array([1, 2, 4]), buf)
    layer = layers[0].view(torch.uint8).reshape(12, -1).numpy()
    out = np.empty((3, layer.shape[1]), np.uint8)
    ops.gather_pages(layer, np.array([5, 6, 7]), out)
    ops.scatter_pages(layer, np.array([0, 1, 2]), out)
    assert ops.calls["native"] - before == 4
    assert np.array_equal(layer[:3], layer[5:8])


def test_connectors_use_the_native_op(native):
    from ascendserve.connectors.kv.pages import PagedKV

    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(10, 2, 32, 64) for i in range(2)}
    src, dst = PagedKV(caches), PagedKV({k: torch.zeros_like(v) for k, v in caches.items()})
    staging = np.empty((2, 3, src.page_bytes), np.uint8)
    before = ops.calls["native"]
    for layer in range(2):
        src.gather_layer_into(layer, [9, 0, 4], staging[layer])
        dst.scatter_layer(layer, [1, 2, 3], staging[layer])
    assert ops.calls["native"] - before == 4
    for s, d in zip(src.layers, dst.layers):
        assert torch.equal(s[[9, 0, 4]], d[[1, 2, 3]])


def test_ec_region_reads_through_the_native_op(native):
    from ascendserve.connectors.ec.region import Region

    region = Region(f"asf-test-native-{os.getpid()}", size_bytes=1 << 20, block_size=4096)
    try:
        data = np.random.default_rng(0).integers(0, 255, 3 * 4096 + 100, dtype=np.uint8)
        assert region.write("k", data, "uint8", (data.size,))
        entry = region.pin("k", 10.0)
        before = ops.calls["native"]
        assert np.array_equal(region.read(entry), data)
        assert ops.calls["native"] - before == 1
    finally:
        region.close()


@pytest.mark.parametrize("threads", [-1, 65])
def test_num_threads_bounds(native, threads):
    layers = layers_of(torch.float32)
    with pytest.raises(RuntimeError, match="num_threads"):
        native.gather_blocks(layers, torch.tensor([1]), torch.empty((3, 1, page_bytes(layers[0])),
                                                                    dtype=torch.uint8), threads)


def test_fallbacks_equal_the_native_results(native, monkeypatch):
    """Without the library: numpy for CPU memory, both entry points, same bytes (last repeat wins)."""
    layers = layers_of(torch.bfloat16)
    ids = [4, 11, 4, 0]
    results = {}
    for name in ("native", "numpy"):
        if name == "numpy":
            monkeypatch.setattr(ops, "_native", None)
        before = ops.calls[name]
        got = torch.empty((3, 4, page_bytes(layers[0])), dtype=torch.uint8)
        ops.gather_blocks(layers, ids, got)
        dst = [torch.zeros_like(t) for t in layers]
        ops.scatter_blocks(dst, ids, got.flip(1).contiguous())
        view = layers[0].view(torch.uint8).reshape(12, -1).numpy()
        pages = np.empty((4, view.shape[1]), np.uint8)
        ops.gather_pages(view, np.array(ids), pages)
        assert ops.calls[name] - before == 3
        results[name] = (got, dst, pages)
    (g1, d1, p1), (g2, d2, p2) = results["native"], results["numpy"]
    assert torch.equal(g1, g2) and np.array_equal(p1, p2) and np.array_equal(p1, g1[0].numpy())
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(d1, d2))
    # src rows are pages 0, 4, 11, 4 written to ids 4, 11, 4, 0: id 4 last gets page 11
    assert torch.equal(d1[0][4], layers[0][11]) and torch.equal(d1[0][0], layers[0][4])
