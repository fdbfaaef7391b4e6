"""The transport contract: a producer serves pages of held requests; a consumer reads them.

Producer side (P's worker process): a `TransportServer` answers for one
`PageSource`. Consumer side (D's worker process): a `TransportClient` reads
pages of one remote request into a local buffer and tells the producer to
free them. Implementations: tcp (here). shm and Mooncake plug in behind the
same two classes; HCCL/RDMA variants on Ascend follow the Mooncake API.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol


class TransferError(Exception):
    """A read or free did not complete; the consumer treats the request as failed."""


class PageSource(Protocol):
    """What a producer exposes. Called from transport threads: must be thread-safe."""

    def check_hello(self, hello: dict) -> str | None:
        """None if a consumer with this handshake may read; else the reason it may not."""

    def read(self, request_id: str, block_ids: list[int]) -> memoryview:
        """The pages of `block_ids`, layer-major, as one buffer. KeyError if the
        request is not held (unknown, freed or expired); ValueError for blocks
        the request does not hold."""

    def free(self, request_id: str) -> None:
        """The consumer is done with `request_id`."""


class TransportServer(ABC):
    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self) -> None: ...


class TransportClient(ABC):
    @abstractmethod
    def read(self, host: str, port: int, request_id: str, block_ids: list[int], into: memoryview) -> None:
        """Fill `into` with the remote pages (exactly its length) or raise TransferError."""

    @abstractmethod
    def free(self, host: str, port: int, request_id: str) -> bool:
        """Best effort: tell the producer to release `request_id` now; True if it answered."""

    @abstractmethod
    def close(self) -> None: ...
