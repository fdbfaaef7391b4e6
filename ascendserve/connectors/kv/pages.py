"""vLLM's registered KV caches seen as uniform pages, with bulk gather/scatter.

On vLLM's CPU backend each attention layer is one tensor
[num_blocks, kv_heads, block_size, 2 * head_size] (K and V packed), so a
block is one contiguous page per layer; CUDA/NPU backends that keep K and V
apart register them as separate tensors and are pages the same way. Pages
are opaque bytes: producer and consumer must agree on `layout()`, which the
side channel checks at the handshake.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from ascendserve.ops import gather_pages, scatter_pages


class PagedKV:
    def __init__(self, kv_caches: dict[str, torch.Tensor]):
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
        shapes = {tuple(t.shape[1:]) for t in self.layers}
        dtypes = {t.dtype for t in self.layers}
        blocks = {t.shape[0] for t in self.layers}
        if len(shapes) != 1 or len(dtypes) != 1 or len(blocks) != 1:
            raise ValueError(f"KV layers differ in page shape/dtype/blocks: {shapes} {dtypes} {blocks}")
        self.page_shape = shapes.pop()
        self.dtype = dtypes.pop()
        self.num_blocks = blocks.pop()
        self.page_bytes = math.prod(self.page_shape) * self.layers[0].element_size()
        self.num_layers = len(self.layers)
        # vLLM's CPU layout puts the KV heads outermost in a page, so a run of heads is
        # one contiguous byte range of every page: what heterogeneous TP moves.
        self.num_heads = self.page_shape[0]
        self.head_bytes = self.page_bytes // self.num_heads
        self._views: list[np.ndarray] | None = None

    def layout(self) -> dict:
        """What both sides must share for pages to mean the same thing (the number of
        heads per page may differ: P and D can shard heads over different TP sizes)."""
        return {"layers": len(self.layers), "head_page": list(self.page_shape[1:]), "dtype": str(self.dtype),
                "names": hashlib.sha256("\n".join(self.names).encode()).hexdigest()[:16]}

    def nbytes(self, n_blocks: int, heads: int | None = None) -> int:
        return len(self.layers) * n_blocks * (self.page_bytes if heads is None else heads * self.head_bytes)

    def _bytes_views(self) -> list[np.ndarray]:
        if self._views is None:
            self._views = [t.view(torch.uint8).numpy().reshape(self.num_blocks, self.page_bytes)
                           for t in self.layers]
        return self._views

    def _index(self, block_ids: list[int]) -> np.ndarray:
        idx = np.asarray(block_ids, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_blocks):
            raise ValueError(f"block id out of range 0..{self.num_blocks - 1}")
        return idx

    def _head_range(self, heads: tuple[int, int]) -> slice:
        first, n = heads
        if first < 0 or n < 1 or first + n > self.num_heads:
            raise ValueError(f"heads {first}..{first + n - 1} out of range 0..{self.num_heads - 1}")
        return slice(first * self.head_bytes, (first + n) * self.head_bytes)

    def layer_index(self) -> dict[str, int]:
        """vLLM layer name -> page layer (layers sharing a cache map to the first one only)."""
        return {n.rsplit("#", 1)[0]: i for i, n in enumerate(self.names) if n.endswith("#0")}

    def gather_layer(self, layer: int, block_ids: list[int]) -> np.ndarray:
        """A copy of one layer's pages: [len(block_ids), page_bytes]."""
        return self._bytes_views()[layer][self._index(block_ids)]

    def gather_layer_into(self, layer: int, block_ids: list[int], out: np.ndarray,
                          heads: tuple[int, int] | None = None) -> None:
        """`out`: [len(block_ids), bytes per page (or per head run)]; `heads` = (first, count)
        takes only those heads of each page."""
        view, idx = self._bytes_views()[layer], self._index(block_ids)
        if heads is None:
            gather_pages(view, idx, out)
        else:
            out[:] = view[idx, self._head_range(heads)]

    def scatter_layer(self, layer: int, block_ids: list[int], src: np.ndarray,
                      heads: tuple[int, int] | None = None) -> None:
        view, idx = self._bytes_views()[layer], self._index(block_ids)
        if heads is None:
            scatter_pages(view, idx, src)
        else:
            view[idx, self._head_range(heads)] = src

    def layer_views(self, layer: int, block_ids: list[int], heads: tuple[int, int] | None = None) -> list[memoryview]:
        """The byte ranges of these pages (or of one head run of each) in the cache itself:
        sockets read and write them with no staging copy."""
        view, cols = self._bytes_views()[layer], self._head_range(heads) if heads is not None else slice(None)
        return [memoryview(view[b, cols]) for b in self._index(block_ids)]

    def page_views(self, block_ids: list[int], heads: tuple[int, int] | None = None) -> list[list[memoryview]]:
        """`layer_views` of every layer."""
        return [self.layer_views(i, block_ids, heads) for i in range(self.num_layers)]

    def regions(self) -> list[tuple[int, int]]:
        return [(t.data_ptr(), t.numel() * t.element_size()) for t in self.layers]
