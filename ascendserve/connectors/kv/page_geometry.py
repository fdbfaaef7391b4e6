"""Where a page's bytes are, as plain numbers (no numpy, no torch: the channel and the proxy
import this).

A page is one block of one layer, logically [K, H, N, C] (kernel blocks, heads, tokens,
content bytes); `order` is the physical order of its k, h, n axes (outermost first), `extent`
and `stride` their sizes and byte strides. A range of heads of a page is `outer` axes of
contiguous runs of `run` bytes (`split`). Both sides of a transfer describe their pages this
way (pages.PagedKV.layout()); `layout_mismatch` says why two cannot exchange bytes.
"""

from __future__ import annotations

AXES = "khn"


def split(order: str, extent: dict[str, int], stride: dict[str, int], content: int,
          heads: int) -> tuple[list[tuple[int, int]], int]:
    """(outer axes as (extent, byte stride), outermost first; bytes per run) of a page region
    holding `heads` consecutive heads."""
    ext = dict(extent, h=heads)
    run, outer, merging = content, [], True
    for axis in reversed(order):
        if merging and (ext[axis] == 1 or stride[axis] == run):
            run *= ext[axis]
            merging = ext[axis] == extent[axis]  # a partial axis ends the run
        else:
            merging = False
            outer.append((ext[axis], stride[axis]))
    return outer[::-1], run


def offsets(outer: list[tuple[int, int]]) -> list[int]:
    """Byte offset of each run in a page region, in memory (transfer) order."""
    out = [0]
    for extent, stride in outer:
        out = [o + i * stride for o in out for i in range(extent)]
    return out


def addresses(geometry: dict, layer: int, blocks: list[int], heads: tuple[int, int] | None) -> tuple[list[int], int]:
    """(address of every run, run bytes) of `blocks` of `layer`, in transfer order, from a
    geometry dict (PagedKV.geometry(): this process's pages, or a peer's from its offer)."""
    first, count = (0, geometry["extent"]["h"]) if heads is None else heads
    outer, run = split(geometry["order"], geometry["extent"], geometry["stride"], geometry["content"], count)
    base = geometry["bases"][layer] + first * geometry["stride"]["h"]
    offs = offsets(outer)
    step = geometry["block_stride"]
    return [base + b * step + o for b in blocks for o in offs], run


# what must agree for pages to mean the same bytes (heads may differ: TP shards them)
_MUST_MATCH = ("layers", "kernel_blocks", "block_tokens", "content_bytes", "dtype", "names", "cross_layer")


def _order(order, extents: dict[str, int]) -> str:
    """The page's axes of extent > 1, in physical order: an axis of extent 1 moves no byte
    wherever its stride puts it."""
    return "".join(a for a in order if extents.get(a, 1) > 1) if isinstance(order, str) else repr(order)


def layout_mismatch(peer: dict, mine: dict) -> str | None:
    """None when pages described by `peer` and `mine` (PagedKV.layout()) can be exchanged
    byte for byte, else a message naming both layouts."""
    if not isinstance(peer, dict):
        return f"KV layout mismatch: peer sent {peer!r}, here {mine.get('name')} {mine}"
    differs = [k for k in _MUST_MATCH if peer.get(k) != mine.get(k)]
    if not differs:  # the shared extents are ints here; heads count when both sides have several
        heads = isinstance(peer.get("heads"), int) and peer["heads"] > 1 and mine["heads"] > 1
        extents = {"k": mine["kernel_blocks"], "h": 2 if heads else 1, "n": mine["block_tokens"]}
        if _order(peer.get("page_order"), extents) != _order(mine["page_order"], extents):
            differs.append("page_order")
    if not differs:
        return None
    detail = ", ".join(f"{k} {peer.get(k)!r} vs {mine.get(k)!r}" for k in differs)
    return (f"KV layout mismatch: peer {peer.get('name')} vs here {mine.get('name')} ({detail}); "
            "P and D must run the same model with the same KV cache layout and dtype")
