"""shm: same-host transfers through a shared-memory segment, one copy in and one copy out.

    D -> READ                P: SHM {name, size} of its segment for this connection
    P -> LAYER {i} per layer P copied layer i in; D copies it out into its blocks
                             while P copies the next (the two copies overlap)
    D -> DONE                P may reuse the segment (and unpins the blocks)

P owns the segments (one per connection, grown on demand). Its name leaves
/dev/shm as soon as D has answered once (D keeps its mapping for the
connection's life), so a crash of either side leaves nothing behind; before
that, Python's resource tracker unlinks it if P dies. D maps segments
without registering them anywhere. A D on another host cannot open the name and fails the transfer
with a clear error instead of reading garbage.

Where libascendserve_xfer.so is built (transport/native.py) each side's layer loop is
one call with the GIL released: P's gathers, LAYER frames and D's DONE; D's LAYER frames,
scatters and DONE. The frames are the same; a peer on the Python loop still interoperates.
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket
import threading
import weakref
from multiprocessing import shared_memory

import numpy as np

from ascendserve.connectors.transport import native
from ascendserve.connectors.transport.base import Pages, TransferError, Transport
from ascendserve.protocol.frames import encode, parse_frame, read_frame, send_frame

SHM_DIR = "/dev/shm"
DONE = encode({"type": "DONE"})
_names = itertools.count()


class _Segments(threading.local):
    """P: the segment of the connection served by this thread."""

    shm: shared_memory.SharedMemory | None = None
    linked: bool = False  # its name is still in /dev/shm (until D has mapped it)


class ShmTransport(Transport):
    name = "shm"

    def __init__(self):
        self._mine = _Segments()
        self._lock = threading.Lock()
        self._live: set[str] = set()  # P: names still in /dev/shm
        self._maps: dict[int, tuple[str, mmap.mmap]] = {}  # D: the segment mapped per connection
        self._push: dict[tuple[str, int], tuple[shared_memory.SharedMemory, bool]] = {}  # P: per decode peer

    # ---- producer ---------------------------------------------------------
    def _segment(self, size: int) -> shared_memory.SharedMemory:
        seg = self._mine.shm
        if seg is not None and seg.size >= size:
            return seg
        self.release_thread_segment()
        seg = shared_memory.SharedMemory(name=f"asf-kv-{os.getpid()}-{next(_names)}", create=True,
                                         size=max(size, 1 << 20))
        self._mine.shm, self._mine.linked = seg, True
        with self._lock:
            self._live.add(seg.name)
        return seg

    def mapped_by_peer(self) -> None:
        """D answered on this connection, so it has the segment mapped: take the name out of
        /dev/shm now. Both mappings stay valid, and a crash of either side leaves nothing."""
        seg = self._mine.shm
        if seg is not None and self._mine.linked:
            self._mine.linked = False
            with self._lock:
                self._live.discard(seg.name)
            try:
                seg.unlink()
            except FileNotFoundError:
                pass

    def release_thread_segment(self) -> None:
        """Called by the channel when a connection ends."""
        self.mapped_by_peer()  # unlinks it if D never got that far
        seg, self._mine.shm = self._mine.shm, None
        if seg is not None:
            seg.close()

    def serve_read(self, conn: socket.socket, pages: Pages, block_ids: list[int],
                   heads: tuple[int, int] | None) -> None:
        size = pages.nbytes(len(block_ids), heads[1] if heads else None)
        seg = self._segment(size)
        out = np.ndarray((pages.num_layers, len(block_ids), size // max(1, pages.num_layers * len(block_ids))),
                         dtype=np.uint8, buffer=seg.buf)
        send_frame(conn, {"type": "SHM", "name": seg.name, "size": size})
        try:
            if pages.host_visible and native.enabled():  # the loop below in one call, off the GIL
                runs = pages.request_runs(block_ids, heads, layer_major=True)
                raw = native.shm_serve(conn, runs, out.ctypes.data, size, DONE)
                done = parse_frame(raw, 0) if raw is not None else {"type": "DONE"}
            else:
                # layer by layer, so D copies layer i out while P copies layer i + 1 in
                for layer in range(pages.num_layers):
                    pages.gather_layer_into(layer, block_ids, out[layer], heads)
                    send_frame(conn, {"type": "LAYER", "layer": layer})
                done = None
        finally:
            del out  # no export may outlive the segment
        done = done or read_frame(conn, 0)
        if done["type"] != "DONE":
            raise TransferError(f"expected DONE after SHM, got {done['type']}")
        self.mapped_by_peer()

    # ---- consumer ---------------------------------------------------------
    def _map(self, sock: socket.socket, name: str, size: int) -> mmap.mmap:
        """The producer's segment for this connection (P unlinks its name once we answered, so
        the mapping is kept for the connection's life, and dropped with it)."""
        key = id(sock)
        with self._lock:
            cur = self._maps.get(key)
        if cur is not None and cur[0] == name and len(cur[1]) >= size:
            return cur[1]
        if "/" in name or "\x00" in name or not name.startswith("asf-kv-"):
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
        except ValueError as exc:  # an empty file
            raise TransferError(f"shared-memory segment {name}: {exc}") from None
        finally:
            os.close(fd)
        with self._lock:
            old = self._maps.get(key)
            self._maps[key] = (name, m)
        if old is None:
            weakref.finalize(sock, self._forget, key)
        else:
            _close(old[1])  # P grew its segment
        return m

    def _forget(self, key: int) -> None:
        with self._lock:
            cur = self._maps.pop(key, None)
        if cur is not None:
            _close(cur[1])

    def view(self, conn: socket.socket, name: str, size: int) -> np.ndarray:
        """D in push mode: the first `size` bytes of the producer's segment on `conn`."""
        return np.frombuffer(self._map(conn, name, size), dtype=np.uint8, count=size)

    def push_segment(self, peer: tuple[str, int], size: int) -> shared_memory.SharedMemory:
        """P in push mode: the segment for one decode peer (its connection), at least `size` bytes."""
        with self._lock:
            cur = self._push.get(peer)
        if cur is not None and cur[0].size >= size:
            return cur[0]
        if cur is not None:
            self.push_peer_gone(peer)
        seg = shared_memory.SharedMemory(name=f"asf-kv-{os.getpid()}-{next(_names)}", create=True,
                                         size=max(size, 1 << 20))
        with self._lock:
            self._push[peer] = (seg, True)
            self._live.add(seg.name)
        return seg

    def push_mapped(self, peer: tuple[str, int]) -> None:
        """The peer acknowledged a layer, so it has the segment mapped: unlink the name."""
        with self._lock:
            cur = self._push.get(peer)
            if cur is None or not cur[1]:
                return
            self._push[peer] = (cur[0], False)
            self._live.discard(cur[0].name)
        try:
            cur[0].unlink()
        except FileNotFoundError:
            pass

    def push_peer_gone(self, peer: tuple[str, int]) -> None:
        self.push_mapped(peer)
        with self._lock:
            cur = self._push.pop(peer, None)
        if cur is not None:
            cur[0].close()

    def fetch(self, sock: socket.socket, offer: dict, pages: Pages, remote_blocks: list[int],
              local_blocks: list[int], heads: tuple[int, int, int] | None, read: bytes) -> int:
        sock.sendall(read)
        answer = read_frame(sock, 0)
        if answer["type"] != "SHM":
            raise TransferError(f"producer refused READ: {answer.get('reason')}")
        size = pages.nbytes(len(local_blocks), heads[2] if heads else None)
        if answer.get("size") != size or not isinstance(answer.get("name"), str):
            raise TransferError(f"producer offered {answer.get('size')} bytes, expected {size}")
        m = self._map(sock, answer["name"], size)
        src = np.frombuffer(m, dtype=np.uint8, count=size)
        mine = (heads[1], heads[2]) if heads else None
        start, ready = 0, None
        try:
            if pages.host_visible and native.enabled():  # the loop below in one call, off the GIL
                runs = pages.request_runs(local_blocks, mine, layer_major=True)
                rest = native.shm_fetch(sock, runs, src.ctypes.data, size, DONE)
                if rest is None:
                    return size  # every layer copied in, DONE sent
                start, raw = rest  # a LAYER frame encoded otherwise (another version): go on here
                ready = parse_frame(raw, 0)
            src = src.reshape(pages.num_layers, len(local_blocks), -1)
            for layer in range(start, pages.num_layers):
                ready = ready if layer == start and ready is not None else read_frame(sock, 0)
                if ready["type"] != "LAYER" or ready.get("layer") != layer:
                    raise TransferError(f"expected LAYER {layer}, got {ready['type']} {ready.get('layer')}")
                pages.scatter_layer(layer, local_blocks, src[layer], mine)
                ready = None
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
            maps, self._maps = list(self._maps.values()), {}
            pushes, self._push = list(self._push.values()), {}
        for _, m in maps:
            _close(m)
        for seg, _ in pushes:
            seg.close()


def _close(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:  # a view is still alive; the mapping goes with it
        pass
