"""Which blocks each engine's prefix cache holds, from the engine's own KV events.

One `CacheIndex` per pd / prefill instance: the 64-bit keys (router/block_hash.py) of the
blocks its vLLM published as stored and not yet removed, for its KV cache group 0 on the
device (the group and medium a prefix hit is served from). `KVEvents` follows every
instance's publishers (protocol/kv_events.py) on the proxy's event loop:

    first message, or a sequence gap   -> the missed batches from the replay endpoint; the
                                          index is unknown until they are applied. A gap the
                                          replay cannot fill (gone from vLLM's buffer, no
                                          replay, no answer within REPLAY_TIMEOUT_S): the index
                                          is cleared and relearned from the next events (what
                                          it then holds is a subset of the engine's cache)
    a sequence that starts over        -> the engine restarted: cleared, replayed from 0
    the publisher's connection drops   -> cleared and unknown (its engine stopped: a restarted one
                                          comes back empty); reconnected: replayed from 0
    ejected by the health checks       -> cleared and unknown; re-admitted: replayed from 0
    requests routed there but no event -> unknown (`silence_s` after a request that filled a
      for `silence_s`                     block), until the next event
    more than `max_blocks` keys        -> cleared, relearned (memory is bounded)

An unknown index makes the router choose by load (router/kv_route.py). Nothing here blocks:
a dead publisher only leaves its index unknown or stale-but-subset.
"""

from __future__ import annotations

import asyncio
import ipaddress
import sys
import time
from dataclasses import dataclass, field

import msgspec
import structlog
import zmq
from urllib.parse import urlsplit
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ascendserve.protocol.kv_events import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, CacheInfo, \
    EventBatch, decode_batch
from ascendserve.router.block_hash import event_key
from ascendserve.router.pools import ACTIVE, EJECTED, SUSPECT

ROUTED_ROLES = ("pd", "prefill")

log = structlog.get_logger("ascendserve.router.kv_index")

REPLAY_TIMEOUT_S = 3.0
DEVICE_MEDIA = (None, "GPU")  # vLLM names every accelerator's medium GPU; CPU/STORAGE are offload tiers


@dataclass
class Publisher:
    endpoint: str
    replay: str = ""
    last: int | None = None  # sequence of the last batch applied
    skip_until: int = -1  # after a replay: live batches up to here were applied already


@dataclass(eq=False)
class CacheIndex:
    url: str
    info: CacheInfo
    blocks: set[int] = field(default_factory=set)
    block_size: int = 0
    known: bool = False
    why: str = "not followed yet"
    events: int = 0
    gaps: int = 0
    lost: int = 0
    restarts: int = 0
    disconnects: int = 0
    last_event: float = 0.0
    expecting_since: float = 0.0  # a request that fills a block was routed here; no event since

    def __post_init__(self):
        self.block_size = self.info.block_size

    def overlap(self, keys: list[int]) -> int:
        """How many of `keys` (a prompt's blocks, in order) this instance holds from the first."""
        n = 0
        for key in keys:
            if key not in self.blocks:
                break
            n += 1
        return n

    def clear(self, known: bool, why: str) -> None:
        self.blocks.clear()
        self.known, self.why = known, why

    def apply(self, batch: EventBatch, max_blocks: int) -> None:
        self.events += 1
        self.last_event = time.monotonic()
        self.expecting_since = 0.0
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.group_idx not in (None, 0) or ev.medium not in DEVICE_MEDIA:
                    continue
                if ev.block_size > self.block_size and not self.info.block_size:
                    self.block_size = ev.block_size  # the largest stored is a whole block
                self.blocks.update(event_key(h) for h in ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                if ev.group_idx not in (None, 0) or ev.medium not in DEVICE_MEDIA:
                    continue
                self.blocks.difference_update(event_key(h) for h in ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.blocks.clear()
        if len(self.blocks) > max_blocks:
            self.clear(True, f"more than {max_blocks} blocks: cleared, relearning")
            log.warning("KV index above its bound; cleared", url=self.url, max_blocks=max_blocks)

    def nbytes(self) -> int:
        return sys.getsizeof(self.blocks) + 32 * len(self.blocks)  # the set's table and its int keys


class KVEvents:
    """Every followed instance's index, and the tasks that keep them."""

    def __init__(self, max_blocks: int = 2_000_000, silence_s: float = 30.0, can_reach=None):
        self.max_blocks, self.silence_s = max_blocks, silence_s
        self.can_reach = can_reach or reachable
        self.indexes: dict[str, CacheIndex] = {}
        self.skipped: dict[str, CacheInfo] = {}  # instances whose events this proxy cannot reach
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self.replays = 0
        self.decode_errors = 0

    @property
    def ctx(self) -> zmq.asyncio.Context:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    def get(self, url: str) -> CacheIndex | None:
        idx = self.indexes.get(url)
        if idx is not None and idx.known and idx.expecting_since and self.silence_s \
                and time.monotonic() - idx.expecting_since > self.silence_s:
            idx.known, idx.why = False, f"no event for {self.silence_s:g} s after a request that filled a block"
            log.warning("KV event publisher silent; routing to it by load", url=url, why=idx.why)
        return idx

    def follow(self, url: str, info: CacheInfo) -> CacheIndex | None:
        """Start (or keep) following `url`'s publishers; restarts when its info changed."""
        current = self.indexes.get(url)
        if current is not None and current.info == info:
            return current
        self.forget(url)
        unreachable = [e for e in info.endpoints if not self.can_reach(url, e)]
        if unreachable or not info.endpoints:
            if self.skipped.get(url) != info:
                log.warning("KV events not reachable from this proxy; routing to this instance by load",
                            url=url, endpoints=info.endpoints,
                            hint="the engine binds them on kv_events.host (127.0.0.1 unless set)")
            self.skipped[url] = info
            return None
        idx = CacheIndex(url, info)
        self.indexes[url] = idx
        pubs = [Publisher(e, info.replay[i] if i < len(info.replay) else "") for i, e in enumerate(info.endpoints)]
        self._tasks[url] = [asyncio.create_task(self._follow(idx, p), name=f"kv-events {p.endpoint}") for p in pubs]
        return idx

    def forget(self, url: str) -> None:
        self.skipped.pop(url, None)
        for task in self._tasks.pop(url, []):
            task.cancel()
        self.indexes.pop(url, None)

    def reset(self, url: str, why: str) -> None:
        """The instance may have lost its cache (ejected, restarted): unknown until replayed."""
        idx = self.indexes.get(url)
        if idx is None:
            return
        self.forget(url)
        if (fresh := self.follow(url, idx.info)) is not None:
            fresh.clear(False, why)

    def expect(self, url: str) -> None:
        """A request that fills at least one block went to `url`: an event should follow."""
        idx = self.indexes.get(url)
        if idx is not None and not idx.expecting_since:
            idx.expecting_since = time.monotonic()

    async def close(self) -> None:
        tasks = [t for ts in self._tasks.values() for t in ts]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # ---- one publisher ---------------------------------------------------------------
    async def _follow(self, idx: CacheIndex, pub: Publisher) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, idx.info.topic.encode())
        # the connection's own events: a publisher that goes away (its engine stopped or restarted,
        # maybe before it published anything again) takes its cache with it, as far as we know
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        sub.connect(pub.endpoint)
        try:
            await self._replay(idx, pub, 0)  # what it published before we subscribed
            while True:
                ready = dict(await poller.poll(1000))
                if not ready:
                    self.get(idx.url)  # the silence check
                    continue
                if monitor in ready:
                    await self._on_connection(idx, pub, parse_monitor_message(await monitor.recv_multipart()))
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) != 3 or len(frames[1]) != 8:
                        self.decode_errors += 1
                        continue
                    await self._on_batch(idx, pub, int.from_bytes(frames[1], "big", signed=True), frames[2])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never let one publisher's bytes take the proxy's loop down
            idx.clear(False, f"follower stopped: {exc!r}")
            log.error("KV event follower stopped; routing to this instance by load", url=idx.url, error=repr(exc))
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _on_connection(self, idx: CacheIndex, pub: Publisher, event: dict) -> None:
        if event["event"] == zmq.EVENT_DISCONNECTED:
            idx.disconnects += 1
            idx.clear(False, "publisher disconnected")
            pub.last, pub.skip_until = None, -1
            log.info("KV event publisher disconnected; index cleared until it is back", url=idx.url)
        elif event["event"] == zmq.EVENT_CONNECTED and not idx.known:
            await self._replay(idx, pub, 0)

    async def _on_batch(self, idx: CacheIndex, pub: Publisher, seq: int, payload: bytes) -> None:
        if pub.skip_until >= 0:
            if seq <= pub.skip_until:
                return  # applied by the replay already
            pub.skip_until = -1
        if pub.last is not None and seq <= pub.last:
            idx.restarts += 1  # a new publisher counts from 0 again: the engine restarted
            log.info("KV event publisher restarted; index cleared", url=idx.url, seq=seq, last=pub.last)
            idx.clear(False, "publisher restarted")
            pub.last = None
        if pub.last is None:  # nothing applied yet (the first replay found no answer), or restarted
            if seq == 0:
                idx.known, idx.why = True, ""
            else:
                await self._replay(idx, pub, 0)
                if pub.last is not None and seq <= pub.last:
                    return
        elif seq > pub.last + 1:
            idx.gaps += 1
            idx.known, idx.why = False, f"sequence gap {pub.last + 1}..{seq - 1}"
            await self._replay(idx, pub, pub.last + 1)
            if pub.last is not None and seq <= pub.last:
                return
        self._apply(idx, pub, seq, payload)

    def _apply(self, idx: CacheIndex, pub: Publisher, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.decode_errors += 1
            log.warning("undecodable KV event batch; skipped", url=idx.url, seq=seq, error=str(exc)[:200])
            pub.last = seq
            return
        idx.apply(batch, self.max_blocks)
        pub.last = seq

    async def _replay(self, idx: CacheIndex, pub: Publisher, start: int) -> None:
        """Apply the batches vLLM kept from `start` on. From 0 (a first look, a restart) what the
        buffer still has is all there is to know: the index is known once it answered. A gap
        (start > 0) the buffer no longer covers, or no answer: cleared and relearned."""
        answered = False
        if pub.replay:
            self.replays += 1
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(pub.replay)
            try:
                await dealer.send_multipart([b"", start.to_bytes(8, "big")])
                while await dealer.poll(int(REPLAY_TIMEOUT_S * 1000)):
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4 or len(frames[2]) != 8:  # (empty, topic, sequence, payload)
                        self.decode_errors += 1
                        continue
                    seq = int.from_bytes(frames[2], "big", signed=True)
                    if seq == END_SEQ:
                        answered = True
                        break
                    if not answered and start > 0 and seq > start:
                        self._lost(idx, start)  # the buffer moved past the gap
                    answered = True
                    if pub.last is None or seq > pub.last:
                        self._apply(idx, pub, seq, frames[3])
            finally:
                dealer.close(linger=0)
        if pub.last is not None:
            pub.skip_until = pub.last
        if answered or (start == 0 and not pub.replay):
            idx.known, idx.why = True, ""
        elif start > 0:
            self._lost(idx, start)

    def _lost(self, idx: CacheIndex, start: int) -> None:
        idx.clear(True, "events lost and not replayed: cleared, relearning")
        idx.lost += 1
        log.warning("KV events lost and not replayed; index cleared", url=idx.url, start=start)


# ---- the proxy's instances -> what is followed --------------------------------------------
def reachable(url: str, endpoint: str) -> bool:
    """An endpoint on loopback is this host's: only an instance on this host can mean it."""
    ep_host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    url_host = (urlsplit(url).hostname or "")
    return not _loopback(ep_host) or _loopback(url_host)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def follow_states(events: KVEvents):
    """HealthMonitor's on_state: an ejected instance may come back with an empty cache (its index
    is cleared and unknown); re-admitted, its index is replayed from vLLM's buffer."""

    def on_state(inst, state: str, before: str) -> None:
        if inst.role not in ROUTED_ROLES or inst.cache is None:
            return
        if state == EJECTED and (idx := events.indexes.get(inst.url)) is not None:
            idx.clear(False, "ejected by the health checks")
        elif state == ACTIVE and before == EJECTED:
            events.reset(inst.url, "re-admitted after ejection")
        elif state == ACTIVE:
            events.follow(inst.url, inst.cache)

    return on_state


def sync(events: KVEvents, pools) -> None:
    """After each round of health checks: follow every active pd / prefill instance that
    publishes, forget the ones gone or draining."""
    live = {}
    for role in ROUTED_ROLES:
        for inst in pools[role].instances.values():
            if inst.state in (ACTIVE, EJECTED, SUSPECT) and inst.cache is not None:
                live[inst.url] = inst
    for url in list(events.indexes):
        if url not in live:
            events.forget(url)
    for url, inst in live.items():
        if inst.state == ACTIVE and url not in events.indexes and events.skipped.get(url) != inst.cache:
            events.follow(url, inst.cache)
