"""vLLM's KV cache events as the proxy reads them, and what an engine says of its prefix cache.

The engines publish vLLM's own ZMQ stream (`vllm/distributed/kv_events.py`, `--kv-events-config`):
multipart messages (topic, 8-byte big-endian sequence number, msgpack payload) on a PUB socket,
and on a ROUTER socket the batches kept for replay: a request of (empty frame, 8-byte start
sequence) is answered with (empty, topic, sequence, payload) per kept batch from there and a
last (empty, b"", -1, b""). The payload is an `EventBatch` (array: ts, events, data parallel
rank) of tagged events, mirrored here field for field with defaults, so that the proxy decodes
them without vLLM and a vLLM that adds fields is still read.

`CacheInfo` is what an engine role tells the proxy about its prefix cache (GET /cache_info on
the engine, and its registration): where its events are published, how its blocks are hashed
(vLLM's `--prefix-caching-hash-algo` and the seed of its first block; `hash_seed` is None when
the proxy cannot know it: xxhash with a random per-process seed) and whether the per-request
cached-token count in its usage was turned on by us (`details_added`: the proxy sets it back to
vLLM's null for clients, who did not ask for it).
"""

from __future__ import annotations

import msgspec

END_SEQ = -1  # the replay stream's last message


class BlockStored(msgspec.Struct, tag=True, kw_only=True, forbid_unknown_fields=False):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, kw_only=True, forbid_unknown_fields=False):
    block_hashes: list[bytes | int]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, kw_only=True, forbid_unknown_fields=False):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EventBatch)


def decode_batch(payload: bytes) -> EventBatch:
    """One published batch; msgspec.DecodeError / ValidationError on anything else."""
    return _decoder.decode(payload)


class CacheInfo(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    endpoints: list[str] = []  # ZMQ PUB, one per data parallel rank behind this server
    replay: list[str] = []  # ZMQ ROUTER of each, same order ([] without replay)
    topic: str = ""
    hash_algo: str = "sha256"
    hash_seed: str | None = "vllm-none-hash"
    block_size: int = 0  # 0: not set by the user (the proxy learns it from the events)
    hash_block_size: int = 0  # vLLM's --prefix-match-unit when set: blocks are hashed in these steps
    details_added: bool = False

    def check(self) -> str | None:
        for endpoint in (*self.endpoints, *self.replay):
            if not endpoint.startswith("tcp://") or endpoint.rfind(":") <= len("tcp://"):
                return f"kv events endpoint must be tcp://host:port, got {endpoint!r}"
        if self.replay and len(self.replay) != len(self.endpoints):
            return "kv events: one replay endpoint per publisher"
        return None
