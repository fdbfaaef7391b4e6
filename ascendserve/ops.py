"""Block-page copies between vLLM's paged caches and one contiguous staging buffer.

`gather_pages` copies pages `block_ids` of every layer into `out`
(layer-major: out[layer, i] = layers[layer][block_ids[i]]); `scatter_pages`
is the inverse. Layers and buffers are numpy byte views ([num_blocks,
page_bytes] per layer) of the torch caches, so any dtype (bf16 included)
copies as bytes. numpy, not torch: the callers are transfer threads, and a
torch op there starts its own OpenMP team that fights vLLM's core-bound one
(seen here: 3.5 s for one 128-token block instead of milliseconds). The
native batched op of native/ (when built) replaces these behind the same
two functions.
"""

from __future__ import annotations

import numpy as np


def gather_pages(layers: list[np.ndarray], block_ids: np.ndarray, out: np.ndarray) -> None:
    for i, layer in enumerate(layers):
        np.take(layer, block_ids, axis=0, out=out[i], mode="clip")  # ids checked by the caller; "raise" is 5x slower


def scatter_pages(layers: list[np.ndarray], block_ids: np.ndarray, src: np.ndarray) -> None:
    for i, layer in enumerate(layers):
        layer[block_ids] = src[i]
