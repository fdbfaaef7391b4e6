"""Page gather/scatter over tensors shaped like vLLM's CPU KV caches."""

import numpy as np
import pytest
import torch

from ascendserve.connectors.kv.pages import PagedKV


def caches(dtype, blocks=10, layers=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        t = torch.randn((blocks, 2, 32, 128), generator=g).to(dtype)
        out[f"model.layers.{i}.self_attn.attn"] = t
    out["model.layers.2.shared"] = out["model.layers.2.self_attn.attn"]  # a shared cache counts once
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_then_scatter_moves_exact_pages(dtype):
    src, dst = PagedKV(caches(dtype, seed=1)), PagedKV(caches(dtype, seed=2))
    assert len(src.layers) == 3 and src.layout() == dst.layout()
    remote, local = [7, 2, 2, 9], [0, 5, 6, 3]  # repeated ids and the last block included
    staging = np.empty((src.num_layers, 4, src.page_bytes), dtype=np.uint8)
    assert staging.nbytes == src.nbytes(4)
    for layer in range(src.num_layers):
        src.gather_layer_into(layer, remote, staging[layer])
        dst.scatter_layer(layer, local, staging[layer])
    for s, d in zip(src.layers, dst.layers):
        for r, l in zip(remote, local):
            assert torch.equal(s[r], d[l])
    untouched = [b for b in range(10) if b not in local]
    fresh = PagedKV(caches(dtype, seed=2))
    for d, f in zip(dst.layers, fresh.layers):
        assert torch.equal(d[untouched], f[untouched])


def test_empty_and_out_of_range():
    kv = PagedKV(caches(torch.float32))
    one = np.empty((1, kv.page_bytes), dtype=np.uint8)
    empty = np.empty((0, kv.page_bytes), dtype=np.uint8)
    kv.gather_layer_into(0, [], empty)
    assert empty.size == 0
    with pytest.raises(ValueError, match="out of range"):
        kv.gather_layer_into(0, [10], one)
    with pytest.raises(ValueError, match="out of range"):
        kv.scatter_layer(0, [-1], one)


def test_layout_differs_when_shapes_differ():
    a = PagedKV(caches(torch.float32))
    b = PagedKV({k: v.to(torch.bfloat16) for k, v in caches(torch.float32).items()})
    assert a.layout() != b.layout()


def test_regions_cover_each_layer_once():
    kv = PagedKV(caches(torch.float32))
    assert [size for _, size in kv.regions()] == [10 * 2 * 32 * 128 * 4] * 3
    assert len({addr for addr, _ in kv.regions()}) == 3
