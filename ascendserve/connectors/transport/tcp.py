"""tcp: the pages follow the DATA frame on the control socket, one frame per READ.

P gathers every layer's pages into one staging buffer and sends it with
sendall; D receives straight into a staging buffer and scatters it. No
per-block round trip; the kernel does the rest.
"""

from __future__ import annotations

import socket

from ascendserve.connectors.transport.base import Pages, TransferError, Transport
from ascendserve.protocol.frames import read_frame, recv_exact, send_frame


class TcpTransport(Transport):
    name = "tcp"

    def serve_read(self, conn: socket.socket, pages: Pages, block_ids: list[int],
                   heads: tuple[int, int] | None) -> None:
        staging = pages.staging(len(block_ids), heads[1] if heads else None)
        pages.gather_into(block_ids, staging, heads)
        send_frame(conn, {"type": "DATA"}, memoryview(staging.reshape(-1)))

    def fetch(self, sock: socket.socket, offer: dict, pages: Pages, remote_blocks: list[int],
              local_blocks: list[int], heads: tuple[int, int, int] | None) -> int:
        staging = pages.staging(len(local_blocks), heads[2] if heads else None)
        into = memoryview(staging.reshape(-1))
        answer = read_frame(sock, len(into))
        if answer["type"] != "DATA":
            raise TransferError(f"producer refused READ: {answer.get('reason')}")
        if answer.get("payload", 0) != len(into):
            raise TransferError(f"producer sent {answer.get('payload')} bytes, expected {len(into)}")
        recv_exact(sock, len(into), into)
        pages.scatter(local_blocks, staging, (heads[1], heads[2]) if heads else None)
        return len(into)
