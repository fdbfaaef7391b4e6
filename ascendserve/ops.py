"""Block-page copies between one layer of vLLM's paged cache and a contiguous buffer.

`gather_pages` copies pages `block_ids` of a layer into `out`
(out[i] = layer[block_ids[i]]); `scatter_pages` is the inverse. Layers and
buffers are numpy byte views ([num_blocks, page_bytes]) of the torch
caches, so any dtype (bf16 included)
copies as bytes. numpy, not torch: the callers are transfer threads, and a
torch op there starts its own OpenMP team that fights vLLM's core-bound one
(seen here: 3.5 s for one 128-token block instead of milliseconds). The
native batched op of native/ (when built) replaces these behind the same
two functions.
"""

from __future__ import annotations

import numpy as np


def gather_pages(layer: np.ndarray, block_ids: np.ndarray, out: np.ndarray) -> None:
    # ids are range-checked by the caller; mode="raise" is 5x slower
    np.take(layer, block_ids, axis=0, out=out, mode="clip")


def scatter_pages(layer: np.ndarray, block_ids: np.ndarray, src: np.ndarray) -> None:
    layer[block_ids] = src
