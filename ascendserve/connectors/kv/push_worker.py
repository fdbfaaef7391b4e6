"""Layerwise push mode, worker side (one per TP rank).

P: `save_kv_layer` copies the pages this step computed for each pushed request
   out of the layer (memory speed, on the model's thread: the blocks can be freed
   or overwritten as soon as the step ends) and queues them for a sender thread,
   which streams them to D while the next layers compute. After the step that
   completes the prompt, PUSHED tells D that every layer was sent.
D: a side-channel server takes PUSH frames into the blocks the scheduler
   reserved (checked against them) and reports the request received when
   PUSHED arrives with every layer seen, or failed when P gives up, the
   metaserver could not get the prompt prefilled, or the deadline passes.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import structlog

from ascendserve.connectors.kv.page_geometry import addresses
from ascendserve.connectors.kv.pages import PagedKV
from ascendserve.connectors.kv.pull_plan import PullSettings
from ascendserve.connectors.kv.push_plan import PushMetadata, PushPlan
from ascendserve.connectors.kv.stats import StatsRecorder
from ascendserve.connectors.transport import make_transport
from ascendserve.connectors.transport.base import TransferError
from ascendserve.connectors.transport.channel import ChannelServer, _tune
from ascendserve.connectors.transport.mooncake import coalesce
from ascendserve.connectors.transport.tcp import TcpTransport, send_views
from ascendserve.connectors.transport.threads import unpin_current_thread
from ascendserve.protocol.frames import FrameError, encode, read_frame, send_frame

log = structlog.get_logger("ascendserve.kv.push")
SENDER_THREADS = 4
EXPECT_WAIT_S = 30.0  # a push may arrive before D's worker has heard of the request
IDLE_STEP_WAIT_S = 0.005
MAX_QUEUED_BYTES = 1 << 30  # per sender thread; beyond it a request's push is abandoned
DIRECT_WAIT_S = 60.0  # longest a step waits for shm/mooncake pushes reading its pages
# Once P has finished the prompt, its last frames are at most this far behind; past it the push
# was lost (or never started) and D fails the load at once rather than at the KV TTL.
PREFILLED_GRACE_S = 10.0


@dataclass
class _Expected:
    blocks: frozenset[int]
    deadline: float
    layers: set[int] = field(default_factory=set)
    bytes: int = 0
    started: float | None = None
    prefilled: bool = False  # the metaserver answered: P finished the prompt


class _Sender:
    """One thread, many destinations: the frames of one request keep their order."""

    def __init__(self, worker: "PushWorker", index: int):
        self.worker = worker
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.queued = 0
        self.lock = threading.Lock()
        self.socks: dict[tuple[str, int], object] = {}
        self.offers: dict[tuple[str, int], dict] = {}
        self.dead: set[str] = set()  # requests whose push was abandoned
        self.first_push: dict[str, float] = {}
        self.sent: dict[str, int] = {}
        self.thread = threading.Thread(target=self._run, name=f"kv-push-{index}", daemon=True)
        self.thread.start()

    def put(self, job: tuple, nbytes: int = 0) -> bool:
        with self.lock:
            if self.queued + nbytes > MAX_QUEUED_BYTES:
                return False
            self.queued += nbytes
        self.jobs.put(job)
        return True

    def _sock(self, host: str, port: int):
        sock = self.socks.get((host, port))
        if sock is None:
            sock = socket.create_connection((host, port), timeout=5.0)
            _tune(sock)
            sock.settimeout(60.0)
            send_frame(sock, {"type": "HELLO", "token": self.worker.token, "layout": self.worker.kv.layout(),
                              "transport": self.worker.settings.transport})
            answer = read_frame(sock, 0)
            if answer["type"] != "OK":
                sock.close()
                raise TransferError(f"decode refused the push connection: {answer.get('reason')}")
            self.socks[(host, port)] = sock
            self.offers[(host, port)] = answer
        return sock

    def _push_direct(self, sock, host: str, port: int, request_id: str, layer: int, blocks: list[int],
                     remote: list[int]) -> int:
        """shm / mooncake: straight from P's pages (the step waits for these jobs)."""
        kv = self.worker.kv
        size = len(blocks) * kv.page_bytes
        header = {"type": "PUSH", "request_id": request_id, "layer": layer, "blocks": remote}
        if self.worker.settings.transport == "shm":
            seg = self.worker.shm.push_segment((host, port), size)
            out = np.ndarray((len(blocks), kv.page_bytes), dtype=np.uint8, buffer=seg.buf)
            kv.gather_layer_into(layer, blocks, out)
            del out
            send_frame(sock, {**header, "shm": seg.name})
            if read_frame(sock, 0)["type"] != "ACK":
                raise TransferError("decode did not acknowledge a pushed layer")
            self.worker.shm.push_mapped((host, port))
            return size
        peer = self.offers[(host, port)].get("mooncake")
        if not isinstance(peer, dict):
            raise TransferError("decode does not offer the mooncake transport")
        mc = self.worker.mooncake
        src, run = addresses(mc.geometry, layer, blocks, None)
        dst, peer_run = addresses(peer["geometry"], layer, remote, None)
        if run != peer_run or len(src) != len(dst):
            raise TransferError(f"page runs differ: {len(src)} x {run} bytes here, {len(dst)} x {peer_run} on D")
        dst, src, lengths = coalesce(dst, src, run)
        if mc.engine.batch_transfer_sync_write(peer["session"], src, dst, lengths) != 0:
            raise TransferError(f"Mooncake write to {peer['session']} failed")
        send_frame(sock, {**header, "written": True})
        return size

    def _run(self) -> None:
        unpin_current_thread()
        while (job := self.jobs.get()) is not None:
            kind, host, port, request_id = job[:4]
            data = job[6] if kind == "PUSH" else None
            nbytes = data.nbytes if data is not None else 0
            try:
                if kind == "ABANDON":  # tell D at once rather than at its deadline
                    self.dead.add(request_id)
                    self.first_push.pop(request_id, None)
                    self.sent.pop(request_id, None)
                    send_frame(self._sock(host, port), {"type": "PUSHED", "request_id": request_id, "ok": False})
                    read_frame(self._sock(host, port), 0)
                    continue
                if request_id in self.dead:
                    if kind == "PUSHED":
                        self.dead.discard(request_id)
                        self.first_push.pop(request_id, None)
                        self.sent.pop(request_id, None)
                    continue
                sock = self._sock(host, port)
                if kind == "PUSH":
                    layer, remote = job[4], job[5]
                    self.first_push.setdefault(request_id, time.monotonic())
                    if data is None:
                        moved = self._push_direct(sock, host, port, request_id, layer, job[7], remote)
                    else:
                        header = {"type": "PUSH", "request_id": request_id, "layer": layer, "blocks": remote}
                        # the header and the pages in one native call (GIL released) where built
                        send_views(sock, [memoryview(data.reshape(-1))], prefix=encode(header, nbytes))
                        moved = nbytes
                    self.sent[request_id] = self.sent.get(request_id, 0) + moved
                else:
                    send_frame(sock, {"type": "PUSHED", "request_id": request_id, "ok": True})
                    if read_frame(sock, 0)["type"] != "OK":
                        raise TransferError("decode did not acknowledge PUSHED")
                    started = self.first_push.pop(request_id, time.monotonic())
                    moved = self.sent.pop(request_id, 0)
                    seconds = time.monotonic() - started
                    self.worker.stats.transfer(moved, seconds)
                    log.info("KV pushed", request=request_id, bytes=moved, ms=round(seconds * 1000, 2),
                             peer=f"{host}:{port}")
            except (OSError, FrameError, TransferError) as exc:
                log.warning("KV push failed; decode will recompute or fail the request by policy",
                            request=request_id, peer=f"{host}:{port}", error=str(exc))
                self.worker.stats.failure()
                sock = self.socks.pop((host, port), None)
                if sock is not None:
                    sock.close()
                if self.worker.shm is not None:  # a new connection gets a new segment
                    self.worker.shm.push_peer_gone((host, port))
                if kind == "PUSH":
                    self.dead.add(request_id)
                self.first_push.pop(request_id, None)
                self.sent.pop(request_id, None)
            finally:
                with self.lock:
                    self.queued -= nbytes
                if kind == "PUSH" and data is None:
                    self.worker.direct_done()

    def stop(self) -> None:
        self.offers.clear()
        self.jobs.put(None)
        self.thread.join(2.0)
        for sock in self.socks.values():
            sock.close()


class PushWorker:
    def __init__(self, settings: PullSettings, token: str, tp_rank: int, producer: bool,
                 expect_wait_s: float = EXPECT_WAIT_S, tp_size: int = 1, total_kv_heads: int | None = None):
        self.settings, self.token, self.tp_rank, self.producer = settings, token, tp_rank, producer
        self.expect_wait_s = expect_wait_s
        self.kv: PagedKV | None = None
        self.server: ChannelServer | None = None
        self.stats = StatsRecorder()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._expected: dict[str, _Expected] = {}
        self._recvd: set[str] = set()
        self._failed: set[str] = set()
        self._senders: list[_Sender] = []
        self._layers: dict[str, int] = {}
        self._idle_step = False
        self._direct = 0  # shm/mooncake pushes of this step still reading P's pages
        self.shm = None
        self.mooncake = None

    # ---- set-up ----------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict, num_blocks: int | None = None) -> None:
        self.kv = PagedKV(kv_caches, num_blocks, staging_budget=self.settings.staging_mib << 20)
        self._layers = self.kv.layer_index()
        transport = self.settings.transport
        if transport == "mooncake":
            self.mooncake = make_transport("mooncake", self.kv, self.settings.host)
        if self.producer:
            if transport == "shm":
                self.shm = make_transport("shm", self.kv)
            self._senders = [_Sender(self, i) for i in range(SENDER_THREADS)]
        else:
            port = self.settings.port + self.tp_rank if self.settings.port else 0
            offered = {"tcp": TcpTransport(), "shm": make_transport("shm", self.kv)}
            if self.mooncake is not None:
                offered["mooncake"] = self.mooncake
            self.server = ChannelServer(self.settings.bind_host, port, self, self.kv, self.token,
                                        offered, sink=self, max_push_blocks=self.kv.num_blocks)
            self.server.start()

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        for sender in self._senders:
            sender.stop()
        for transport in (self.shm, self.mooncake):
            if transport is not None:
                transport.close()
        if self.kv is not None:
            self.kv.staging.close()

    # ---- D: Holds (nothing to read in push mode) and PushSink -------------
    def acquire(self, request_id: str, block_ids: list[int]) -> None:
        raise KeyError("this decode instance receives pushed KV; it holds nothing to read")

    def release(self, request_id: str) -> None:
        return None

    def free(self, request_id: str) -> None:
        return None

    def announce(self, request_id: str, block_ids: list[int], ttl_s: float, age_s: float) -> bool:
        return False

    def check(self, request_id: str, block_ids: list[int]) -> None:
        """Before a layer lands: the request waits for pushed KV in exactly these blocks."""
        with self._lock:
            self._changed.wait_for(lambda: request_id in self._expected, timeout=self.expect_wait_s)
            exp = self._expected.get(request_id)
            if exp is None:
                raise KeyError(f"request {request_id} is not waiting for pushed KV here")
            if not set(block_ids) <= exp.blocks:
                self._finish(request_id, ok=False)
                raise ValueError(f"request {request_id} did not reserve blocks {sorted(set(block_ids) - exp.blocks)}")
            if exp.started is None:
                exp.started = time.monotonic()

    def receive(self, request_id: str, layer: int, block_ids: list[int], pages) -> None:
        """A layer landed: `pages` to copy in, or None when it is already in place."""
        self.check(request_id, block_ids)
        if pages is not None:
            self.kv.scatter_layer(layer, block_ids, pages)
        with self._lock:
            exp = self._expected.get(request_id)
            if exp is not None:
                exp.layers.add(layer)
                exp.bytes += len(block_ids) * self.kv.page_bytes

    def complete(self, request_id: str, ok: bool) -> None:
        with self._lock:
            exp = self._expected.get(request_id)
            if exp is None:
                return
            missing = self.kv.num_layers - len(exp.layers)
            if ok and missing:
                log.warning("pushed KV incomplete", request=request_id, missing_layers=missing)
            good = ok and not missing
            if good:
                seconds = time.monotonic() - (exp.started or time.monotonic())
                self.stats.transfer(exp.bytes, seconds)
                log.info("KV received", request=request_id, bytes=exp.bytes, ms=round(seconds * 1000, 2),
                         transport=self.settings.transport)
            self._finish(request_id, good)

    def _finish(self, request_id: str, ok: bool) -> None:  # under the lock
        self._expected.pop(request_id, None)
        self._recvd.add(request_id)
        if not ok:
            self._failed.add(request_id)
            self.stats.failure()
        self._changed.notify_all()

    # ---- per step --------------------------------------------------------
    def start_load_kv(self, meta: PushMetadata) -> None:
        """D: the requests now waiting for pushed KV (vLLM calls this after the forward)."""
        self._idle_step = meta.idle
        now = time.monotonic()
        with self._lock:
            for request_id, blocks in meta.expect.items():
                self._expected[request_id] = _Expected(frozenset(blocks), now + self.settings.ttl_s)
            for request_id in meta.failed:
                if request_id in self._expected:
                    self._finish(request_id, ok=False)
            for request_id in meta.prefilled:  # P is done: what it pushed is on its way or lost
                exp = self._expected.get(request_id)
                if exp is not None:
                    exp.prefilled = True
                    exp.deadline = min(exp.deadline, now + PREFILLED_GRACE_S)
            if meta.expect:
                self._changed.notify_all()

    def save_kv_layer(self, layer_name: str, meta: PushMetadata) -> None:
        """P: called right after each attention layer of this step's forward."""
        layer = self._layers.get(layer_name)
        if layer is None or not meta.push:
            return
        for plan in meta.push:
            if not plan.local_blocks:
                continue
            sender = self._sender(plan)
            if self.settings.transport != "tcp":  # read straight from the pages; wait_for_save waits
                with self._lock:
                    self._direct += 1
                sender.put(("PUSH", plan.host, plan.port + self.tp_rank, plan.request_id, layer,
                            plan.remote_blocks, None, plan.local_blocks))
                continue
            data = self.kv.gather_layer(layer, plan.local_blocks)  # a copy: safe once the step ends
            if not sender.put(("PUSH", plan.host, plan.port + self.tp_rank, plan.request_id, layer,
                               plan.remote_blocks, data), data.nbytes):
                log.warning("push queue full; abandoning the push of a request", request=plan.request_id)
                sender.put(("ABANDON", plan.host, plan.port + self.tp_rank, plan.request_id))

    def direct_done(self) -> None:
        with self._lock:
            self._direct -= 1
            self._changed.notify_all()

    def wait_for_save(self, meta: PushMetadata) -> None:
        """P: end of the step's forward. tcp pushes copied their pages out already; shm and
        mooncake ones read P's pages in place, so the step ends once they have (the
        layers overlapped the forward; this waits for the tail only)."""
        with self._lock:
            if not self._changed.wait_for(lambda: self._direct <= 0, timeout=DIRECT_WAIT_S):
                log.warning("pushes still reading this step's pages; going on", pending=self._direct)
        for plan in meta.push:
            if plan.abandon:
                if self.tp_rank == 0:
                    self._sender(plan).put(("ABANDON", plan.host, plan.port, plan.request_id))
            elif plan.last:
                self._sender(plan).put(("PUSHED", plan.host, plan.port + self.tp_rank, plan.request_id))

    def _sender(self, plan: PushPlan) -> _Sender:
        return self._senders[hash((plan.host, plan.port)) % len(self._senders)]

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        with self._lock:
            now = time.monotonic()
            for request_id, exp in list(self._expected.items()):
                if exp.deadline <= now:
                    log.warning("pushed KV never completed; failing the load", request=request_id,
                                layers=len(exp.layers), prefill_finished=exp.prefilled)
                    self._finish(request_id, ok=False)
            if self._idle_step and not self._recvd and self._expected:
                self._changed.wait(IDLE_STEP_WAIT_S)
            self._idle_step = False
            recvd, failed = self._recvd, self._failed
            self._recvd, self._failed = set(), set()
        return set(), recvd, failed

    def take_stats(self):
        return self.stats.take(None)
