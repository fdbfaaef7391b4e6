"""The transport contract: how the pages of a held request move from P to D.

Every transport shares one control channel (channel.py: HELLO / READ / FREE
frames over TCP, cluster token, KV layout check) and differs only in how a
READ's bytes travel:

    tcp       the pages follow the DATA frame on the same socket
    shm       P gathers them into a shared-memory segment, D copies them out
              (same host only)
    mooncake  D reads P's registered KV pages straight into its own with the
              Mooncake Transfer Engine (TCP here; RDMA/HCCS elsewhere)

A transport implements `serve_read` (producer) and `fetch` (consumer) and
may add fields to the handshake answer (`offer`).
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the proxy imports the channel and needs no numpy
    import numpy as np


class TransferError(Exception):
    """A read or free did not complete; the consumer treats the request as failed."""


class Pages(Protocol):
    """A paged KV cache seen as pages of any vLLM layout (connectors/kv/pages.py)."""

    page_bytes: int
    num_layers: int
    num_blocks: int

    def layout(self) -> dict: ...

    num_heads: int
    head_bytes: int
    host_visible: bool  # False: device memory, no views (gather/scatter through host buffers)
    memory_order: list[int]  # layers by address: the order of a cross-layer block's pages

    def nbytes(self, n_blocks: int, heads: int | None = None) -> int: ...

    def gather_layer_into(self, layer: int, block_ids: list[int], out: np.ndarray,
                          heads: tuple[int, int] | None = None) -> None: ...

    def scatter_layer(self, layer: int, block_ids: list[int], src: np.ndarray,
                      heads: tuple[int, int] | None = None) -> None: ...

    # staged pages (host_visible False): kv/staging.py moves them through `staging`, a
    # bounded pool of host buffers, with copies that return an event to `wait` for
    staging: object

    def copy_out(self, layer: int | None, block_ids: list[int], host, heads=None): ...

    def copy_in(self, layer: int | None, block_ids: list[int], host, heads=None): ...

    def wait(self, event) -> None: ...

    def layer_views(self, layer: int, block_ids: list[int],
                    heads: tuple[int, int] | None = None) -> list[memoryview]: ...

    def page_views(self, block_ids: list[int], heads: tuple[int, int] | None = None) -> list[list[memoryview]]: ...

    def request_views(self, block_ids: list[int], heads: tuple[int, int] | None = None) -> list[memoryview]:
        """Every run a read of these blocks moves, in transfer order."""

    def request_runs(self, block_ids: list[int], heads: tuple[int, int] | None = None):
        """`request_views` as addresses (transport/native.Runs), for the native data path."""

    def layer_runs(self, layer: int, block_ids: list[int], heads: tuple[int, int] | None = None):
        """`layer_views` as addresses."""

    def whole_blocks(self) -> bool:
        """Whether whole-page reads move cross-layer blocks as one piece (request_views)."""

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of every allocation holding a layer, for transports that register memory."""

    def geometry(self) -> dict:
        """Where the pages are, as numbers (kv/page_geometry.py)."""


class Holds(Protocol):
    """What a producer holds for consumers. Called from transport threads: thread-safe."""

    def acquire(self, request_id: str, block_ids: list[int]) -> None:
        """Pin `block_ids` of a held request for one read. KeyError if the request is not
        held (unknown, freed or expired); ValueError for blocks it does not hold."""

    def release(self, request_id: str) -> None:
        """The read that `acquire` pinned is over."""

    def free(self, request_id: str) -> None:
        """The consumer is done with `request_id`."""

    def announce(self, request_id: str, block_ids: list[int], ttl_s: float, age_s: float) -> bool:
        """The producer's scheduler holds `block_ids` of `request_id` for `ttl_s` (said
        `age_s` ago), before the engine's next step registers it; True if taken now."""


class PushSink(Protocol):
    """D in push mode: where pushed layers land. Called from transport threads."""

    def check(self, request_id: str, block_ids: list[int]) -> None:
        """KeyError/ValueError unless the request waits for pushed KV in these blocks."""

    def receive(self, request_id: str, layer: int, block_ids: list[int], pages: "np.ndarray") -> None:
        """Store one layer's pages [len(block_ids), page_bytes] (None: already written in
        place); KeyError/ValueError if unexpected."""

    def complete(self, request_id: str, ok: bool) -> None:
        """Every layer of the request arrived (ok) or the producer gave up on it."""


class Transport(ABC):
    name: str
    # Device types whose memory this transport moves itself (a transfer engine that registers
    # device memory). Pages in any other device's memory are staged through host buffers
    # (tcp, shm: kv/staging.py), or refused where the transport only moves registered memory.
    device_memory: frozenset[str] = frozenset()

    def offer(self) -> dict:
        """Extra fields of the producer's handshake answer."""
        return {}

    @abstractmethod
    def serve_read(self, conn: socket.socket, pages: Pages, block_ids: list[int],
                   heads: tuple[int, int] | None) -> None:
        """Producer: deliver the pinned pages of one READ (only heads (first, count) of
        each page when given) to the consumer on `conn`."""

    @abstractmethod
    def fetch(self, sock: socket.socket, offer: dict, pages: Pages, remote_blocks: list[int],
              local_blocks: list[int], heads: tuple[int, int, int] | None, read: bytes) -> int:
        """Consumer: send `read` (the READ frame, encoded) on `sock`, then land the remote pages
        in `local_blocks` (heads = (first on P, first here, count) for a head run); return the
        bytes moved. The transport sends READ itself so that it may send it with the read's
        first bytes (tcp: in the same native call). Raise TransferError (or OSError/FrameError)
        on failure."""

    def close(self) -> None:
        return None
