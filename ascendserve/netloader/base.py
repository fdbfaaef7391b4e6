"""What a NetLoader transport is: the one seam for moving weights another way.

A transport takes a seed address and returns the model's tensors, verified,
or raises NetLoadError with the reason; the loader (loader.py) owns what
happens next (vLLM's weight loading, the disk fallback). This release ships
one transport, "tcp" (client.fetch: the seed's frame protocol over TCP, into
host memory), because it is the only one tested here. Device-to-device
transports (HCCL on Ascend, Mooncake's transfer engine over RDMA) would keep
the JOIN/JOIN_ACK handshake and manifest checks over TCP and move the tensor
bytes on their own channel straight into device buffers.
"""

from __future__ import annotations

from typing import Protocol


class WeightTransport(Protocol):
    def __call__(self, address: str, token: str, expect_identity: dict, join_info: dict, timeout_s: float,
                 max_bytes: int | None = None) -> list:
        """[(name, tensor)] of every tensor the seed at `address` serves; NetLoadError otherwise."""
