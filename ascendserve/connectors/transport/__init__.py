"""Byte movers between a KV/EC producer and its consumers (see base.py)."""

from __future__ import annotations

from ascendserve.connectors.transport.base import Pages, TransferError, Transport

NAMES = ("tcp", "shm", "mooncake")


def make_transport(name: str, pages: Pages, hostname: str = "127.0.0.1") -> Transport:
    if name == "tcp":
        from ascendserve.connectors.transport.tcp import TcpTransport

        return TcpTransport()
    if name == "shm":
        from ascendserve.connectors.transport.shm import ShmTransport

        return ShmTransport()
    if name == "mooncake":
        from ascendserve.connectors.transport.mooncake import MooncakeTransport

        # Its engine starts its own I/O threads, which inherit the caller's CPU mask; on a
        # vLLM CPU worker that is the one core the model spins on, and they starve there.
        return run_unpinned(lambda: MooncakeTransport(pages, hostname))
    raise TransferError(f"unknown KV transport {name!r} (choose from {', '.join(NAMES)})")


def run_unpinned(fn):
    """Run `fn` in a thread allowed on every CPU (threads it starts inherit that)."""
    import threading

    from ascendserve.connectors.transport.threads import unpin_current_thread

    out: dict = {}

    def target():
        unpin_current_thread()
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            out["error"] = exc

    t = threading.Thread(target=target, name="kv-transport-init")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
