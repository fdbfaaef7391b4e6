"""What a NetLoader transport is: the one seam for moving weights another way.

A transport takes a seed address, does the handshake and returns a
WeightTransfer, or raises NetLoadError with the reason (then no data has
moved); iterating the transfer yields the model's tensors, each verified, as
they arrive, and raises NetLoadError if the seed fails part way. The loader
(loader.py) owns what happens next (vLLM's weight loading, the next seed,
the disk fallback). This release ships one transport, "tcp"
(client.open_transfer: the seed's frame protocol over one or more TCP
connections, into host memory), because it is the only one tested here.
Device-to-device transports (HCCL on Ascend, Mooncake's transfer engine over
RDMA) would keep the JOIN/JOIN_ACK handshake and manifest checks over TCP
and move the tensor bytes on their own channel straight into device buffers.
"""

from __future__ import annotations

from typing import Iterator, Protocol


class WeightTransfer(Protocol):
    address: str
    error: str | None  # why it failed, once it has
    manifest: list[dict]
    in_place: dict  # manifest index -> the target tensor it was received straight into

    def __iter__(self) -> Iterator[tuple]:
        """(name, tensor) of every tensor the seed serves, each once verified; NetLoadError on failure."""

    def close(self) -> None:
        """Release the connections (also part way through); idempotent."""

    def changed_in_place(self) -> list[str]:
        """Names of tensors received in place whose target no longer holds their bytes."""


class WeightTransport(Protocol):
    def __call__(self, address: str, token: str, expect_identity: dict, join_info: dict, timeout_s: float,
                 max_bytes: int | None = None, *, streams: int = 1, targets: dict | None = None,
                 recycle: bool = False) -> WeightTransfer:
        """The joined transfer from the seed at `address`; NetLoadError (before any data) otherwise.
        `targets`: name -> tensor to receive that tensor straight into, where dtype and shape match.
        `recycle`: a tensor's memory may receive a later tensor once the caller let go of it."""
