"""tcp: the pages follow the DATA frame on the control socket, one frame per READ.

No staging copy on either side: P writes the pages straight from its KV
cache with scatter-gather sends (sendmsg over the pages' runs, layer-major, or
block-major whole blocks of a cross-layer layout: PagedKV.request_views), D
receives them straight into its own pages with recvmsg_into. The kernel's
copies are the only ones; no per-block round trip. Pages with no host views
(device memory) are staged through a bounded pool of host buffers, the next
unit's device copy overlapping the current unit's send (`send_staged`,
`recv_staged`, kv/staging.py), in the same byte order.

The socket I/O runs in native code with the GIL released (transport/native.py,
libascendserve_xfer.so) when that library is built: P's DATA header and every page
in one call, D's READ, the DATA header and every page in one call. Without it (or
with ASCENDSERVE_KV_NATIVE=0) the same bytes go through Python's socket calls.
"""

from __future__ import annotations

import socket

from ascendserve.connectors.transport import native
from ascendserve.connectors.transport.base import Pages, TransferError, Transport
from ascendserve.protocol.frames import encode, parse_frame, read_frame, send_frame

IOV_BATCH = 512  # buffers per sendmsg/recvmsg_into call (under any IOV_MAX)


def _vectored(io, views: list[memoryview]) -> None:
    """Run `io` (sendmsg / recvmsg_into over a batch of buffers, returning the bytes done)
    until every view is done, resuming a partly done buffer where it stopped."""
    i, head = 0, None
    while i < len(views):
        batch = ([head] if head is not None else []) + views[i + (head is not None):i + IOV_BATCH]
        n = io(batch)
        if n == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        head = None
        for buf in batch:
            if n >= len(buf):
                n -= len(buf)
                i += 1
            else:
                head = buf[n:]
                break


def send_views(sock: socket.socket, views: list[memoryview], prefix: bytes = b"") -> None:
    """`prefix` (a frame header), then every view, natively when the library is loaded."""
    runs = native.Runs.buffers(views, writable=False) if native.enabled() else None
    if runs is not None:
        native.move(sock, runs, send=True, prefix=prefix)
        return
    if prefix:
        sock.sendall(prefix)
    _vectored(sock.sendmsg, views)


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    runs = native.Runs.buffers(views, writable=True) if native.enabled() else None
    if runs is not None:
        native.move(sock, runs, send=False)
        return
    _vectored(lambda batch: sock.recvmsg_into(batch)[0], views)


def recv_layer(sock: socket.socket, pages: Pages, layer: int, block_ids: list[int]) -> None:
    """A pushed layer's pages, received straight into them (host pages)."""
    if native.enabled():
        native.move(sock, pages.layer_runs(layer, block_ids), send=False)
    else:
        recv_views(sock, pages.layer_views(layer, block_ids))


def send_staged(sock: socket.socket, pages: Pages, block_ids: list[int], heads: tuple[int, int] | None) -> None:
    """Pages with no host views (device memory): staged unit by unit through the pages' pool
    (kv/staging.py: the next unit is copied off the device while this one is sent), in
    request_views' byte order."""
    from ascendserve.connectors.kv.staging import send_units  # torch: only where pages are

    send_units(lambda view: send_views(sock, [view]), pages, block_ids, heads)


def recv_staged(sock: socket.socket, pages: Pages, block_ids: list[int], heads: tuple[int, int] | None) -> None:
    """send_staged's mirror: each unit received into a staging buffer, then copied in."""
    from ascendserve.connectors.kv.staging import recv_units

    recv_units(lambda view: recv_views(sock, [view]), pages, block_ids, heads)


class TcpTransport(Transport):
    name = "tcp"

    def serve_read(self, conn: socket.socket, pages: Pages, block_ids: list[int],
                   heads: tuple[int, int] | None) -> None:
        if not pages.host_visible:
            send_frame(conn, {"type": "DATA", "payload": pages.nbytes(len(block_ids), heads[1] if heads else None)})
            send_staged(conn, pages, block_ids, heads)
            return
        if native.enabled():
            runs = pages.request_runs(block_ids, heads)
            native.move(conn, runs, send=True, prefix=encode({"type": "DATA", "payload": runs.nbytes}))
            return
        views = pages.request_views(block_ids, heads)
        send_frame(conn, {"type": "DATA", "payload": sum(len(v) for v in views)})
        send_views(conn, views)

    def fetch(self, sock: socket.socket, offer: dict, pages: Pages, remote_blocks: list[int],
              local_blocks: list[int], heads: tuple[int, int, int] | None, read: bytes) -> int:
        """Natively, `read` goes out in the same call that receives the answer and its pages."""
        mine = (heads[1], heads[2]) if heads else None
        runs = pages.request_runs(local_blocks, mine) if pages.host_visible and native.enabled() else None
        if runs is not None:
            size = runs.nbytes
            raw = native.fetch(sock, read, encode({"type": "DATA", "payload": size}), runs)
            if raw is None:
                return size
            answer = parse_frame(raw, size)  # ERR, another size, or another encoding of DATA
        else:
            views = pages.request_views(local_blocks, mine) if pages.host_visible else None
            size = sum(len(v) for v in views) if views is not None else pages.nbytes(len(local_blocks), mine and mine[1])
            sock.sendall(read)  # after the views: blocks out of range fail before P is asked
            answer = read_frame(sock, size)
        if answer["type"] != "DATA":
            raise TransferError(f"producer refused READ: {answer.get('reason')}")
        if answer.get("payload", 0) != size:
            raise TransferError(f"producer sent {answer.get('payload')} bytes, expected {size}")
        if runs is not None:
            native.move(sock, runs, send=False)
        elif views is None:
            recv_staged(sock, pages, local_blocks, mine)
        else:
            recv_views(sock, views)
        return size
