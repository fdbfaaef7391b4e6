"""mooncake: D reads P's KV pages straight into its own with the Mooncake Transfer Engine.

Both sides register every layer's cache with a TransferEngine in
P2PHANDSHAKE mode (no metadata server). P's handshake answer carries its
engine session and its page geometry (where each layer's pages and their runs
are); a READ is answered with GRANT once the blocks are pinned, D issues one
batched read of every run (adjacent runs merged), then sends DONE. No staging
copy on either side. Over TCP here (`mooncake-transfer-engine-non-cuda`);
the RDMA and Ascend builds expose the same API.
"""

from __future__ import annotations

import os
import socket

from ascendserve.connectors.kv.page_geometry import addresses
from ascendserve.connectors.transport.base import Pages, TransferError, Transport
from ascendserve.protocol.frames import read_frame, send_frame


def coalesce(dst: list[int], src: list[int], length: int) -> tuple[list[int], list[int], list[int]]:
    """(dst, src, lengths) of copies of `length` bytes each, adjacent ones on both sides merged."""
    out_dst: list[int] = []
    out_src: list[int] = []
    lengths: list[int] = []
    for d, s in zip(dst, src):
        if lengths and out_dst[-1] + lengths[-1] == d and out_src[-1] + lengths[-1] == s:
            lengths[-1] += length
        else:
            out_dst.append(d), out_src.append(s), lengths.append(length)
    return out_dst, out_src, lengths


def segments(remote: dict, local: dict, remote_blocks: list[int], local_blocks: list[int],
             heads: tuple[int, int, int] | None = None) -> tuple[list[int], list[int], list[int]]:
    """(local addresses, remote addresses, lengths) of every copy a transfer needs, from both
    sides' page geometry (PagedKV.geometry(); equal layouts, checked at the handshake): the
    runs of whole pages, or with `heads` = (first on P, first here, count) of those heads,
    runs adjacent on both sides merged."""
    dst, src, lengths = [], [], []
    p_heads, d_heads = (None, None) if heads is None else ((heads[0], heads[2]), (heads[1], heads[2]))
    for layer in range(len(local["bases"])):
        r, run = addresses(remote, layer, remote_blocks, p_heads)
        lo, local_run = addresses(local, layer, local_blocks, d_heads)
        if run != local_run or len(r) != len(lo):
            raise TransferError(f"page runs differ: {len(r)} x {run} bytes on P, {len(lo)} x {local_run} here")
        d, s, n = coalesce(lo, r, run)
        dst += d
        src += s
        lengths += n
    return dst, src, lengths


# Which memory each Mooncake build registers besides host memory, by its distribution name:
# the CUDA build (mooncake-transfer-engine) registers CUDA memory; the non-CUDA one host only.
# Ascend builds (from source, USE_ASCEND*) are told with ASCENDSERVE_MOONCAKE_DEVICE_MEMORY.
BUILD_DEVICE_MEMORY = {"mooncake-transfer-engine": frozenset({"cuda"}),
                       "mooncake-transfer-engine-non-cuda": frozenset()}


def build_device_memory(dists: list[str] | None = None, override: str | None = None) -> frozenset[str]:
    """Device types the installed Mooncake build moves itself. `override`, default
    $ASCENDSERVE_MOONCAKE_DEVICE_MEMORY: a comma-separated list ("cuda", "npu", "none")."""
    override = os.environ.get("ASCENDSERVE_MOONCAKE_DEVICE_MEMORY") if override is None else override
    if override is not None and override.strip():
        return frozenset(x.strip() for x in override.split(",") if x.strip() not in ("", "none"))
    if dists is None:
        from importlib.metadata import packages_distributions

        dists = packages_distributions().get("mooncake", [])
    out: frozenset[str] = frozenset()
    for dist in dists:
        out |= BUILD_DEVICE_MEMORY.get(dist.lower().replace("_", "-"), frozenset())
    return out


def check_pages_memory(device_type: str, host_visible: bool, supported: frozenset[str], build: str) -> None:
    """Refuse pages this Mooncake build cannot read or write where they are (device memory
    of a type it does not register), naming what would work instead."""
    if host_visible or device_type == "cpu" or device_type in supported:
        return
    raise TransferError(f"the mooncake transport cannot move KV in {device_type} memory with {build} "
                        f"(it registers {', '.join(sorted(supported)) or 'host memory only'}): use transport "
                        "tcp or shm, which stage device KV through pinned host buffers, or a Mooncake build "
                        f"for {device_type} (set ASCENDSERVE_MOONCAKE_DEVICE_MEMORY={device_type} if yours is one)")


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self, pages: Pages, hostname: str, protocol: str = "tcp", device: str = ""):
        os.environ.setdefault("GLOG_minloglevel", "1")  # its INFO lines would flood the engine's log
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransferError("the mooncake transport needs mooncake-transfer-engine "
                                f"(pip install mooncake-transfer-engine-non-cuda): {exc}") from None
        from importlib.metadata import packages_distributions

        dists = packages_distributions().get("mooncake", [])
        self.device_memory = build_device_memory(dists)
        device_type = getattr(getattr(pages, "device", None), "type", "cpu")
        check_pages_memory(device_type, pages.host_visible, self.device_memory,
                           ", ".join(dists) or "this Mooncake build")
        self.engine = TransferEngine()
        if self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device) != 0:
            raise TransferError(f"Mooncake TransferEngine failed to initialize on {hostname} ({protocol})")
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        self.regions = pages.regions()
        self.geometry = pages.geometry()
        for addr, size in self.regions:
            if self.engine.register_memory(addr, size) != 0:
                raise TransferError(f"Mooncake could not register {size} bytes of KV cache")

    def offer(self) -> dict:
        return {"mooncake": {"session": self.session, "geometry": self.geometry}}

    def serve_read(self, conn: socket.socket, pages: Pages, block_ids: list[int],
                   heads: tuple[int, int] | None) -> None:
        send_frame(conn, {"type": "GRANT"})
        done = read_frame(conn, 0)  # the blocks stay pinned until D has read them
        if done["type"] != "DONE":
            raise TransferError(f"expected DONE after GRANT, got {done['type']}")

    def fetch(self, sock: socket.socket, offer: dict, pages: Pages, remote_blocks: list[int],
              local_blocks: list[int], heads: tuple[int, int, int] | None, read: bytes) -> int:
        peer = offer.get("mooncake")
        if not isinstance(peer, dict) or not isinstance(peer.get("geometry"), dict):
            raise TransferError("producer does not offer the mooncake transport (start it with transport=mooncake)")
        sock.sendall(read)
        answer = read_frame(sock, 0)
        if answer["type"] != "GRANT":
            raise TransferError(f"producer refused READ: {answer.get('reason')}")
        try:
            dst, src, lengths = segments(peer["geometry"], self.geometry, remote_blocks, local_blocks, heads)
            rc = self.engine.batch_transfer_sync_read(peer["session"], dst, src, lengths)
        finally:
            send_frame(sock, {"type": "DONE"})
        if rc != 0:
            raise TransferError(f"Mooncake read from {peer['session']} failed (rc={rc})")
        return sum(lengths)

    def close(self) -> None:
        for addr, _ in self.regions:
            self.engine.unregister_memory(addr)
