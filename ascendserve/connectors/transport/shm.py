"""shm: same-host transfers through a shared-memory segment, one copy in and one copy out.

    D -> READ                P: SHM {name, size} of its segment for this connection
    P -> LAYER {i} per layer P copied layer i in; D copies it out into its blocks
                             while P copies the next (the two copies overlap)
    D -> DONE                P may reuse the segment (and unpins the blocks)

P owns the segments (one per connection, grown on demand, unlinked when the
connection closes; Python's resource tracker unlinks them if P is killed).
D maps them without registering them anywhere, so a D that dies leaks
nothing. A D on another host cannot open the name and fails the transfer
with a clear error instead of reading garbage.
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket
import threading
from multiprocessing import shared_memory

import numpy as np

from ascendserve.connectors.transport.base import Pages, TransferError, Transport
from ascendserve.protocol.frames import read_frame, send_frame

SHM_DIR = "/dev/shm"
_names = itertools.count()


class _Segments(threading.local):
    """P: the segment of the connection served by this thread."""

    shm: shared_memory.SharedMemory | None = None


class ShmTransport(Transport):
    name = "shm"

    def __init__(self):
        self._mine = _Segments()
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._maps: dict[str, mmap.mmap] = {}  # D: segments mapped, by name

    # ---- producer ---------------------------------------------------------
    def _segment(self, size: int) -> shared_memory.SharedMemory:
        seg = self._mine.shm
        if seg is not None and seg.size >= size:
            return seg
        self.release_thread_segment()
        seg = shared_memory.SharedMemory(name=f"asf-kv-{os.getpid()}-{next(_names)}", create=True,
                                         size=max(size, 1 << 20))
        self._mine.shm = seg
        with self._lock:
            self._live.add(seg.name)
        return seg

    def release_thread_segment(self) -> None:
        """Called by the channel when a connection ends."""
        seg, self._mine.shm = self._mine.shm, None
        if seg is not None:
            with self._lock:
                self._live.discard(seg.name)
            seg.close()
            try:
                seg.unlink()
            except FileNotFoundError:  # close() at shutdown got there first
                pass

    def serve_read(self, conn: socket.socket, pages: Pages, block_ids: list[int],
                   heads: tuple[int, int] | None) -> None:
        size = pages.nbytes(len(block_ids), heads[1] if heads else None)
        seg = self._segment(size)
        out = np.ndarray((pages.num_layers, len(block_ids), size // max(1, pages.num_layers * len(block_ids))),
                         dtype=np.uint8, buffer=seg.buf)
        send_frame(conn, {"type": "SHM", "name": seg.name, "size": size})
        # layer by layer, so D copies layer i out while P copies layer i + 1 in
        for layer in range(pages.num_layers):
            pages.gather_layer_into(layer, block_ids, out[layer], heads)
            send_frame(conn, {"type": "LAYER", "layer": layer})
        del out  # no export may outlive the segment
        done = read_frame(conn, 0)
        if done["type"] != "DONE":
            raise TransferError(f"expected DONE after SHM, got {done['type']}")

    # ---- consumer ---------------------------------------------------------
    def _map(self, name: str, size: int) -> mmap.mmap:
        with self._lock:
            m = self._maps.get(name)
            if m is not None and len(m) >= size:
                return m
        if "/" in name or not name.startswith("asf-kv-"):
            raise TransferError(f"refusing shared-memory name {name!r}")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        except FileNotFoundError:
            raise TransferError(f"shared-memory segment {name} not found: the shm transport needs "
                                "prefill and decode on the same host") from None
        try:
            if os.fstat(fd).st_size < size:
                raise TransferError(f"shared-memory segment {name} is smaller than {size} bytes")
            m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with self._lock:
            old = self._maps.pop(name, None)
            self._maps[name] = m
            # P replaces a segment only by a bigger one; forget mappings of dead ones
            for stale in [n for n in self._maps if n != name and not os.path.exists(os.path.join(SHM_DIR, n))]:
                self._maps.pop(stale).close()
        if old is not None:
            old.close()
        return m

    def view(self, name: str, size: int) -> np.ndarray:
        """D in push mode: the first `size` bytes of a producer's segment."""
        return np.frombuffer(self._map(name, size), dtype=np.uint8, count=size)

    def segment_for(self, size: int) -> shared_memory.SharedMemory:
        """P in push mode: this thread's segment, at least `size` bytes."""
        return self._segment(size)

    def fetch(self, sock: socket.socket, offer: dict, pages: Pages, remote_blocks: list[int],
              local_blocks: list[int], heads: tuple[int, int, int] | None) -> int:
        answer = read_frame(sock, 0)
        if answer["type"] != "SHM":
            raise TransferError(f"producer refused READ: {answer.get('reason')}")
        size = pages.nbytes(len(local_blocks), heads[2] if heads else None)
        if answer.get("size") != size or not isinstance(answer.get("name"), str):
            raise TransferError(f"producer offered {answer.get('size')} bytes, expected {size}")
        m = self._map(answer["name"], size)
        src = np.frombuffer(m, dtype=np.uint8, count=size).reshape(pages.num_layers, len(local_blocks), -1)
        mine = (heads[1], heads[2]) if heads else None
        try:
            for layer in range(pages.num_layers):
                ready = read_frame(sock, 0)
                if ready["type"] != "LAYER" or ready.get("layer") != layer:
                    raise TransferError(f"expected LAYER {layer}, got {ready['type']} {ready.get('layer')}")
                pages.scatter_layer(layer, local_blocks, src[layer], mine)
        finally:
            del src
        send_frame(sock, {"type": "DONE"})
        return size

    def close(self) -> None:
        with self._lock:
            for name in self._live:  # producer: segments of connections still open
                try:
                    os.unlink(os.path.join(SHM_DIR, name))
                except FileNotFoundError:
                    pass
            self._live.clear()
            for m in self._maps.values():
                try:
                    m.close()
                except BufferError:
                    pass
            self._maps.clear()
