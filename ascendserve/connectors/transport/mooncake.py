"""mooncake: D reads P's KV pages straight into its own with the Mooncake Transfer Engine.

Both sides register every layer's cache with a TransferEngine in
P2PHANDSHAKE mode (no metadata server). P's handshake answer carries its
engine session and the base address of each layer; a READ is answered with
GRANT once the blocks are pinned, D issues one batched read of every
(layer, run of consecutive blocks) segment, then sends DONE. No staging
copy on either side. Over TCP here (`mooncake-transfer-engine-non-cuda`);
the RDMA and Ascend builds expose the same API.
"""

from __future__ import annotations

import os
import socket

from ascendserve.connectors.transport.base import Pages, TransferError, Transport
from ascendserve.protocol.frames import read_frame, send_frame


def _runs(remote: list[int], local: list[int]) -> list[tuple[int, int, int]]:
    """Coalesce block pairs into (remote_start, local_start, count) runs."""
    runs: list[tuple[int, int, int]] = []
    for r, lo in zip(remote, local):
        if runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == lo:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((r, lo, 1))
    return runs


def segments(remote_bases: list[int], local_bases: list[int], remote_page: int, local_page: int,
             remote: list[int], local: list[int], head_bytes: int = 0,
             heads: tuple[int, int, int] | None = None) -> tuple[list[int], list[int], list[int]]:
    """(local addresses, remote addresses, lengths) of every copy a transfer needs: runs of
    whole pages, or with `heads` = (first on P, first here, count) one head run per page."""
    dst, src, lengths = [], [], []
    for rb, lb in zip(remote_bases, local_bases):
        if heads is None:
            for r, lo, n in _runs(remote, local):
                src.append(rb + r * remote_page)
                dst.append(lb + lo * local_page)
                lengths.append(n * remote_page)
        else:
            p_first, d_first, n = heads
            for r, lo in zip(remote, local):
                src.append(rb + r * remote_page + p_first * head_bytes)
                dst.append(lb + lo * local_page + d_first * head_bytes)
                lengths.append(n * head_bytes)
    return dst, src, lengths


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self, pages: Pages, hostname: str, protocol: str = "tcp", device: str = ""):
        os.environ.setdefault("GLOG_minloglevel", "1")  # its INFO lines would flood the engine's log
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransferError("the mooncake transport needs mooncake-transfer-engine "
                                f"(pip install mooncake-transfer-engine-non-cuda): {exc}") from None
        self.engine = TransferEngine()
        if self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device) != 0:
            raise TransferError(f"Mooncake TransferEngine failed to initialize on {hostname} ({protocol})")
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        self.regions = pages.regions()
        self.page_bytes = pages.page_bytes
        for addr, size in self.regions:
            if self.engine.register_memory(addr, size) != 0:
                raise TransferError(f"Mooncake could not register {size} bytes of KV cache")

    def offer(self) -> dict:
        return {"mooncake": {"session": self.session, "bases": [a for a, _ in self.regions],
                             "page_bytes": self.page_bytes}}

    def serve_read(self, conn: socket.socket, pages: Pages, block_ids: list[int],
                   heads: tuple[int, int] | None) -> None:
        send_frame(conn, {"type": "GRANT"})
        done = read_frame(conn, 0)  # the blocks stay pinned until D has read them
        if done["type"] != "DONE":
            raise TransferError(f"expected DONE after GRANT, got {done['type']}")

    def fetch(self, sock: socket.socket, offer: dict, pages: Pages, remote_blocks: list[int],
              local_blocks: list[int], heads: tuple[int, int, int] | None) -> int:
        peer = offer.get("mooncake")
        if not isinstance(peer, dict) or len(peer.get("bases", ())) != len(self.regions):
            raise TransferError("producer does not offer the mooncake transport (start it with transport=mooncake)")
        answer = read_frame(sock, 0)
        if answer["type"] != "GRANT":
            raise TransferError(f"producer refused READ: {answer.get('reason')}")
        try:
            dst, src, lengths = segments(peer["bases"], [a for a, _ in self.regions], int(peer["page_bytes"]),
                                         pages.page_bytes, remote_blocks, local_blocks, pages.head_bytes, heads)
            rc = self.engine.batch_transfer_sync_read(peer["session"], dst, src, lengths)
        finally:
            send_frame(sock, {"type": "DONE"})
        if rc != 0:
            raise TransferError(f"Mooncake read from {peer['session']} failed (rc={rc})")
        return sum(lengths)

    def close(self) -> None:
        for addr, _ in self.regions:
            self.engine.unregister_memory(addr)


def page_addresses(bases: list[int], page_bytes: int, layer: int, blocks: list[int]) -> list[int]:
    return [bases[layer] + b * page_bytes for b in blocks]
