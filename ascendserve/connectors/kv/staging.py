"""Host staging of KV pages that live in device memory (cuda, npu): bounded, reused buffers
and layer-by-layer pipelines that overlap the device copies with the socket.

A read of device pages moves in *units*: one layer's pages of some blocks (layer-major), or
whole cross-layer blocks (block-major, `PagedKV.whole_blocks`), in the same byte order as the
zero-copy host path, so either side may stage while the other reads in place. A unit is at
most half the pool's budget (a layer is split by blocks when it is larger), so two units, one
on the wire and one being copied, always fit.

    sender    copy_out(unit k+1) is queued on the side stream, then unit k is sent
              once its copy finished: the device -> host copy of the next unit runs
              while the current one is on the wire
    receiver  unit k is received into a free buffer, then copy_in (host -> device and
              the scatter) is queued; its buffer is reused once that copy finished, and
              the read ends only when every copy has (the engine may read the pages next)

`StagingPool`: the host buffers, pinned when the pages are on a device (so the copies are
asynchronous), reused across reads, and bounded: `budget` bytes in use at most (a unit
larger than the budget gets a buffer of its own only when nothing else is in use); a
caller that finds the pool full waits up to `wait_s`, then the read fails (TransferError),
which frees the request like any failed read. Every path returns the buffers, including a
peer that disconnects mid-read; a returned buffer is only reused after its copy finished.
With host pages staged (`PagedKV(staging=True)`, how CI runs this code) nothing is pinned
and the copies are synchronous, but the units, buffers and order are the same.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from ascendserve.connectors.transport.base import TransferError

DEFAULT_BUDGET = 256 << 20  # bytes of staging buffers per worker ([kv] staging_mib)
MIN_BUFFER = 1 << 12  # buffers are sized in powers of two from here, so reads reuse them
WAIT_S = 30.0  # longest a read waits for a staging buffer before it fails


@dataclass(eq=False)
class Buffer:
    tensor: torch.Tensor  # uint8 host memory, pinned when the pool pins
    array: np.ndarray  # the same bytes as numpy

    @property
    def nbytes(self) -> int:
        return self.array.nbytes


def _size_class(nbytes: int) -> int:
    return max(MIN_BUFFER, 1 << max(0, nbytes - 1).bit_length())


class StagingPool:
    """Host buffers for staged pages: bounded (`budget` bytes in use), reused, pinned on
    request (`pin`: the pages are on an accelerator)."""

    def __init__(self, budget: int = DEFAULT_BUDGET, pin: bool = False, wait_s: float = WAIT_S):
        if budget < 1:
            raise ValueError(f"a staging budget must be positive, got {budget}")
        self.budget, self.pin, self.wait_s = budget, pin, wait_s
        self._lock = threading.Condition()
        self._idle: dict[int, list[Buffer]] = {}  # size class -> buffers nobody uses
        self._idle_bytes = 0
        self._used = 0  # bytes handed out
        self.allocated = 0  # buffers made (reuse keeps this low)
        self.waits = 0  # acquires that had to wait for another read's buffers

    def _alloc(self, size: int) -> Buffer:
        t = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        with self._lock:
            self.allocated += 1
        return Buffer(t, t.numpy())

    def acquire(self, nbytes: int, count: int = 1, wait_s: float | None = None) -> list[Buffer]:
        """`count` buffers of at least `nbytes` each, taken together (two reads that each held
        one buffer while waiting for a second could wait for each other). Waits while the pool
        is full; TransferError after `wait_s` (default: the pool's)."""
        size = _size_class(nbytes)
        need = size * count
        wait_s = self.wait_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        with self._lock:
            waited = False
            while self._used and self._used + need > self.budget:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"no KV staging buffers ({count} x {size} bytes) within "
                                        f"{wait_s:g} s: {self._used} of {self.budget} bytes in use "
                                        "by other reads (raise [kv] staging_mib)")
                waited = True
                self._lock.wait(left)
            self.waits += waited
            self._used += need
            idle = self._idle.pop(size, [])
            out = [idle.pop() for _ in range(min(count, len(idle)))]
            if idle:
                self._idle[size] = idle
            self._idle_bytes -= size * len(out)
            self._evict()
        try:
            while len(out) < count:
                out.append(self._alloc(size))
        except BaseException:
            self.release(*out)
            with self._lock:
                self._used -= size * (count - len(out))
                self._lock.notify_all()
            raise
        return out

    def _evict(self) -> None:
        """Free idle buffers, largest first, while in-use plus idle bytes exceed the budget
        (called locked)."""
        while self._idle and self._used + self._idle_bytes > self.budget:
            size = max(self._idle)
            self._idle[size].pop()
            self._idle_bytes -= size
            if not self._idle[size]:
                del self._idle[size]

    def pair_bytes(self) -> int:
        """The largest unit for which two buffers fit in the budget together."""
        half = max(1, self.budget // 2)
        return 1 << (half.bit_length() - 1)  # a power of two: a size class of its own

    def release(self, *bufs: Buffer) -> None:
        """Return buffers whose copies have finished (kept for reuse while they fit the budget)."""
        with self._lock:
            for buf in bufs:
                size = buf.nbytes
                self._used -= size
                if self._used + self._idle_bytes + size <= self.budget:
                    self._idle.setdefault(size, []).append(buf)
                    self._idle_bytes += size
            self._lock.notify_all()

    def stats(self) -> dict:
        with self._lock:
            return {"budget": self.budget, "in_use": self._used, "idle": self._idle_bytes,
                    "allocated": self.allocated, "waits": self.waits, "pinned": self.pin}

    def close(self) -> None:
        """Free the idle buffers (the worker is shutting down; buffers in use go with their reads)."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0


def units(pages, block_ids: list[int], heads: tuple[int, int] | None, budget: int
          ) -> list[tuple[int | None, list[int]]]:
    """(layer, blocks) of a read in transfer order; layer None: whole cross-layer blocks.
    Each unit holds at most `budget` bytes, or one block where a block is larger."""
    per_block = pages.page_bytes if heads is None else heads[1] * pages.head_bytes
    block_major = heads is None and pages.whole_blocks()
    if block_major:
        per_block *= pages.num_layers
    step = max(1, budget // max(1, per_block))
    chunks = [block_ids[i:i + step] for i in range(0, len(block_ids), step)]
    if block_major:
        return [(None, c) for c in chunks]
    return [(layer, c) for layer in range(pages.num_layers) for c in chunks]


def _unit_bytes(pages, unit: tuple[int | None, list[int]], heads) -> int:
    layer, blocks = unit
    per_block = pages.page_bytes if heads is None else heads[1] * pages.head_bytes
    return len(blocks) * per_block * (pages.num_layers if layer is None else 1)


class _Pair:
    """Pool buffers used in turn (two, or one for a unit too large to pipeline), each with
    the copy last queued on it."""

    def __init__(self, pool: StagingPool, nbytes: int, units: int):
        two = units > 1 and _size_class(nbytes) <= pool.pair_bytes()
        self.pool, self.bufs = pool, pool.acquire(nbytes, 2 if two else 1)
        self.events: list = [None] * len(self.bufs)

    def slot(self, k: int) -> int:
        return k % len(self.bufs)

    def close(self, pages) -> None:
        """Wait for the copies still queued on the buffers, then return them."""
        try:
            for ev in self.events:
                pages.wait(ev)
        finally:
            self.pool.release(*self.bufs)
            self.bufs = []


def send_units(send, pages, block_ids: list[int], heads: tuple[int, int] | None) -> int:
    """Stage a read's pages unit by unit and `send(memoryview)` each; with two buffers the
    copy of unit k + 1 is queued before unit k is sent. Returns the bytes sent."""
    pool = pages.staging
    plan = units(pages, block_ids, heads, pool.pair_bytes())
    if not plan:
        return 0
    sizes = [_unit_bytes(pages, u, heads) for u in plan]
    pair = _Pair(pool, max(sizes), len(plan))
    ahead = len(pair.bufs) - 1  # units copied ahead of the one on the wire

    def start(k: int) -> None:
        layer, blocks = plan[k]
        i = pair.slot(k)
        pair.events[i] = pages.copy_out(layer, blocks, pair.bufs[i].tensor[:sizes[k]], heads)

    try:
        for k in range(ahead + 1):
            start(k)
        for k in range(len(plan)):
            i = pair.slot(k)
            pages.wait(pair.events[i])
            pair.events[i] = None
            send(memoryview(pair.bufs[i].array[:sizes[k]]))
            if k + 1 + ahead < len(plan):
                start(k + 1 + ahead)  # into the buffer just sent
        return sum(sizes)
    finally:
        pair.close(pages)


def recv_units(recv_into, pages, block_ids: list[int], heads: tuple[int, int] | None) -> int:
    """send_units' mirror: `recv_into(memoryview)` fills a buffer with unit k, whose copy
    into the pages is queued while unit k + 1 arrives. Returns when every copy finished."""
    pool = pages.staging
    plan = units(pages, block_ids, heads, pool.pair_bytes())
    if not plan:
        return 0
    sizes = [_unit_bytes(pages, u, heads) for u in plan]
    pair = _Pair(pool, max(sizes), len(plan))
    try:
        for k, (layer, blocks) in enumerate(plan):
            i = pair.slot(k)
            pages.wait(pair.events[i])  # the buffer's previous copy into the pages is done
            pair.events[i] = None
            recv_into(memoryview(pair.bufs[i].array[:sizes[k]]))
            pair.events[i] = pages.copy_in(layer, blocks, pair.bufs[i].tensor[:sizes[k]], heads)
        return sum(sizes)
    finally:
        pair.close(pages)
