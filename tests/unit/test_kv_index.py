"""router/kv_index.py against vLLM's own publisher (ZmqEventPublisher), on 127.0.0.1.

The batches are vLLM's classes (KVEventBatch of BlockStored / BlockRemoved / AllBlocksCleared)
sent by vLLM's publisher thread with its sequence numbers and replay buffer; the proxy side is
ours. Gaps are made by dropping sends on the publisher's PUB socket (the replay buffer still
has them, or not, with a tiny buffer); a restart is a new publisher on the same ports."""

from __future__ import annotations

import asyncio
import functools
import time

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,  # noqa: E402
                                        ZmqEventPublisher)

from ascendserve.engine.patches import kv_events_bind  # noqa: E402
from ascendserve.protocol.kv_events import CacheInfo, decode_batch  # noqa: E402
from ascendserve.router.block_hash import event_key  # noqa: E402
from ascendserve.router.kv_index import KVEvents, reachable  # noqa: E402
from tests.ports import free_port  # noqa: E402

BS = 16


def run(fn):
    """An async test run on its own event loop (the suite has no asyncio plugin)."""
    @functools.wraps(fn)
    def test(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return test


@pytest.fixture(autouse=True, scope="module")
def bind_loopback():
    # vLLM connects a PUB endpoint without a wildcard; the engine role's patch binds it
    assert kv_events_bind.apply({kv_events_bind.ENV: "127.0.0.1"}) == ["kv_events_bind"]


class Engine:
    """vLLM's publisher on two loopback ports, restartable on the same ones."""

    def __init__(self, buffer_steps: int = 100):
        self.port, self.replay_port = free_port(), free_port()
        self.buffer_steps = buffer_steps
        self.pub: ZmqEventPublisher | None = None
        self.drop: set[int] = set()  # batch numbers (0-based, per publisher) not sent on PUB
        self.start()

    @property
    def info(self) -> CacheInfo:
        return CacheInfo(endpoints=[f"tcp://127.0.0.1:{self.port}"], replay=[f"tcp://127.0.0.1:{self.replay_port}"],
                         block_size=BS)

    def start(self) -> None:
        import zmq

        deadline = time.monotonic() + 5
        while True:  # a restart on the same ports: ZMQ closes the old sockets in its own thread
            try:
                self.pub = ZmqEventPublisher(0, endpoint=f"tcp://127.0.0.1:{self.port}",
                                             replay_endpoint=f"tcp://127.0.0.1:{self.replay_port}",
                                             buffer_steps=self.buffer_steps)
                break
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        sent = {"n": 0}
        real = self.pub._pub.send_multipart

        def send(frames, *a, **kw):
            n = sent["n"]
            sent["n"] += 1
            if n not in self.drop:
                return real(frames, *a, **kw)

        self.pub._pub.send_multipart = send

    def stop(self) -> None:
        self.pub.shutdown()

    def publish(self, *events) -> None:
        self.pub.publish(KVEventBatch(ts=time.time(), events=list(events)))


def stored(*hashes, parent=None) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(range(BS * len(hashes))),
                       block_size=BS, lora_id=None, medium="GPU", lora_name=None)


def removed(*hashes) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


def h(n: int) -> bytes:
    return n.to_bytes(32, "big")


async def until(check, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def followed(events: KVEvents, engine: Engine):
    """The engine's index, once replayed at the start and subscribed (the SUB's connection)."""
    idx = events.follow("http://127.0.0.1:1", engine.info)
    await until(lambda: idx.known, "followed")
    await asyncio.sleep(0.3)
    return idx


def keys(*ns: int) -> set[int]:
    return {event_key(h(n)) for n in ns}


@pytest.fixture
def engine():
    e = Engine()
    yield e
    e.stop()


def test_our_mirror_decodes_every_field_vllm_sends():
    import msgspec

    batch = KVEventBatch(ts=1.5, events=[
        BlockStored(block_hashes=[h(1), 7], parent_block_hash=h(9), token_ids=[1, 2, 3], block_size=3, lora_id=4,
                    medium="GPU", lora_name="ad", extra_keys=[("ad", ("mm", 0)), None], group_idx=1,
                    kv_cache_spec_kind="full", session_id="s"),
        removed(h(1)), AllBlocksCleared()], data_parallel_rank=2)
    ours = decode_batch(msgspec.msgpack.encode(batch))
    assert ours.ts == 1.5 and ours.data_parallel_rank == 2
    first = ours.events[0]
    assert first.block_hashes == [h(1), 7] and first.parent_block_hash == h(9) and first.block_size == 3
    assert first.group_idx == 1 and first.lora_name == "ad" and first.token_ids == [1, 2, 3]
    assert [type(e).__name__ for e in ours.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]


@run
async def test_stored_removed_cleared_and_what_was_published_before_the_proxy_came(engine):
    engine.publish(stored(h(1), h(2)))  # before anyone subscribes: only the replay has it
    await asyncio.sleep(0.2)
    events = KVEvents(silence_s=0)
    try:
        idx = events.follow("http://127.0.0.1:1", engine.info)
        await until(lambda: idx.known and idx.blocks == keys(1, 2), f"replayed at start: {idx}")
        assert idx.block_size == BS
        await asyncio.sleep(0.3)  # the SUB socket's connection
        engine.publish(stored(h(3), parent=h(2)))
        await until(lambda: idx.blocks == keys(1, 2, 3), "stored")
        assert idx.overlap([event_key(h(1)), event_key(h(2)), event_key(h(5)), event_key(h(3))]) == 2
        engine.publish(removed(h(2)))
        await until(lambda: idx.blocks == keys(1, 3), "removed")
        assert idx.overlap([event_key(h(1)), event_key(h(2))]) == 1
        # another medium or KV cache group is not where a prefix hit comes from
        engine.publish(BlockStored(block_hashes=[h(8)], parent_block_hash=None, token_ids=list(range(BS)),
                                   block_size=BS, lora_id=None, medium="CPU", lora_name=None),
                       BlockStored(block_hashes=[h(9)], parent_block_hash=None, token_ids=list(range(BS)),
                                   block_size=BS, lora_id=None, medium="GPU", lora_name=None, group_idx=1),
                       stored(h(10)))
        await until(lambda: event_key(h(10)) in idx.blocks, "a third batch")
        assert idx.blocks == keys(1, 3, 10)
        engine.publish(AllBlocksCleared())
        await until(lambda: not idx.blocks, "cleared")
        assert idx.known and idx.gaps == 0 and idx.restarts == 0
    finally:
        await events.close()


@run
async def test_a_gap_is_replayed_and_one_the_buffer_lost_clears_the_index():
    engine = Engine(buffer_steps=3)
    events = KVEvents(silence_s=0)
    try:
        idx = await followed(events, engine)
        engine.publish(stored(h(1)))
        await until(lambda: idx.blocks == keys(1), "first")
        engine.drop = {1}  # the second batch never reaches the subscriber; the buffer has it
        engine.publish(stored(h(2)))
        engine.publish(removed(h(1)))
        await until(lambda: idx.blocks == keys(2) and idx.known, f"gap replayed: {idx}")
        assert idx.gaps == 1 and idx.lost == 0
        # six batches lost, the buffer keeps three: the removal of 2 is gone for good
        engine.drop = {3, 4, 5, 6, 7, 8}
        engine.publish(removed(h(2)))
        for n in (20, 21, 22, 23, 24):
            engine.publish(stored(h(n)))
        engine.publish(stored(h(30)))
        await until(lambda: event_key(h(30)) in idx.blocks, f"relearning: {idx}")
        assert idx.lost == 1 and idx.known
        assert event_key(h(2)) not in idx.blocks, "a stale block survived a gap that could not be replayed"
        assert idx.blocks <= keys(22, 23, 24, 30), idx.blocks  # what the replay still had, and after
    finally:
        await events.close()
        engine.stop()


@run
async def test_a_restarted_publisher_clears_the_index(engine):
    events = KVEvents(silence_s=0)
    try:
        idx = await followed(events, engine)
        engine.publish(stored(h(1)), stored(h(2)))
        engine.publish(stored(h(3)))
        await until(lambda: idx.blocks == keys(1, 2, 3), "before the restart")
        engine.stop()
        # gone: whatever it held is gone with it, before a new process publishes anything
        await until(lambda: not idx.known and not idx.blocks, f"stopped: {idx}")
        engine.start()  # a new process: an empty cache, sequence numbers from 0
        await until(lambda: idx.known, f"back, replayed: {idx}")
        assert not idx.blocks
        engine.publish(stored(h(7)))
        await until(lambda: idx.blocks == keys(7), f"after the restart: {idx}")
        assert idx.disconnects == 1 and idx.known
    finally:
        await events.close()


@run
async def test_reset_makes_the_index_unknown_until_replayed(engine):
    events = KVEvents(silence_s=0)
    try:
        idx = await followed(events, engine)
        engine.publish(stored(h(1)))
        await until(lambda: idx.blocks == keys(1), "stored")
        events.reset("http://127.0.0.1:1", "ejected")
        fresh = events.indexes["http://127.0.0.1:1"]
        assert fresh is not idx and not fresh.known and not fresh.blocks
        await until(lambda: fresh.known and fresh.blocks == keys(1), "replayed from the buffer")
    finally:
        await events.close()


@run
async def test_a_silent_publisher_and_the_memory_bound():
    engine = Engine()
    events = KVEvents(max_blocks=3, silence_s=0.3)
    try:
        idx = events.follow("http://127.0.0.1:1", engine.info)
        await until(lambda: idx.known, "followed")
        events.expect("http://127.0.0.1:1")
        await asyncio.sleep(0.5)
        assert events.get("http://127.0.0.1:1").known is False and "no event" in idx.why
        engine.publish(stored(h(1)))
        await until(lambda: idx.known and idx.blocks == keys(1), "an event makes it known again")
        engine.publish(stored(h(2), h(3), h(4), h(5)))
        await until(lambda: idx.events == 2, "second batch")
        assert not idx.blocks and "more than 3" in idx.why and idx.nbytes() > 0
    finally:
        await events.close()
        engine.stop()


def test_loopback_events_are_followed_only_for_an_instance_on_this_host():
    assert reachable("http://127.0.0.1:8000", "tcp://127.0.0.1:11000")
    assert not reachable("http://10.1.2.3:8000", "tcp://127.0.0.1:11000")
    assert reachable("http://10.1.2.3:8000", "tcp://10.1.2.3:11000")
    assert reachable("http://localhost:8000", "tcp://127.0.0.1:11000")


@run
async def test_unreachable_events_are_not_followed_and_warned_once():
    events = KVEvents()
    info = CacheInfo(endpoints=["tcp://127.0.0.1:5"], replay=[])
    assert events.follow("http://10.0.0.9:8000", info) is None
    assert events.follow("http://10.0.0.9:8000", info) is None
    assert events.indexes == {} and events.skipped == {"http://10.0.0.9:8000": info}
    await events.close()


@run
async def test_sequence_numbers_that_start_over_or_skip_without_a_replay_endpoint():
    """No replay endpoint (another publisher's setup): a sequence that starts over is a new
    publisher (cleared); a gap cannot be filled (cleared, relearned from there)."""
    import msgspec

    from ascendserve.router.kv_index import CacheIndex, Publisher

    events = KVEvents(silence_s=0)
    idx = CacheIndex("http://x:1", CacheInfo(endpoints=["tcp://127.0.0.1:1"], block_size=BS))
    pub = Publisher("tcp://127.0.0.1:1")

    def batch(*evs) -> bytes:
        return msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=list(evs)))

    await events._on_batch(idx, pub, 0, batch(stored(h(1))))
    await events._on_batch(idx, pub, 1, batch(stored(h(2))))
    assert idx.known and idx.blocks == keys(1, 2)
    await events._on_batch(idx, pub, 0, batch(stored(h(3))))  # starts over
    assert idx.restarts == 1 and idx.known and idx.blocks == keys(3)
    await events._on_batch(idx, pub, 5, batch(stored(h(4))))  # 1..4 missing, nothing to replay them
    assert idx.gaps == 1 and idx.lost == 1 and idx.known and idx.blocks == keys(4)
    await events._on_batch(idx, pub, 6, b"not msgpack")
    assert events.decode_errors == 1 and pub.last == 6 and idx.blocks == keys(4)
    await events.close()


def test_an_external_rank_keeps_its_own_ports():
    """vLLM offsets a publisher's ports by its DP index; an external rank of `launch` already has
    ports of its own (the patch leaves them alone, and only then)."""
    from ascendserve.engine.patches.kv_events_bind import NO_OFFSET_ENV

    assert kv_events_bind.apply({kv_events_bind.ENV: "127.0.0.1", NO_OFFSET_ENV: "1"}) == \
        ["kv_events_bind", "kv_events_no_offset"]
    assert ZmqEventPublisher.offset_endpoint_port("tcp://127.0.0.1:9500", 1) == "tcp://127.0.0.1:9500"
    assert ZmqEventPublisher.offset_endpoint_port("tcp://10.0.0.1:9500", 1) == "tcp://10.0.0.1:9501"
