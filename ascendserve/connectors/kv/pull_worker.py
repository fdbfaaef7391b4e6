"""Pull mode, worker side (each vLLM worker process, one per TP rank).

P: serves the pages of held requests on its side channel (port + TP rank)
   and reports a request as finished sending when D frees it or its
   deadline passes; a read in progress postpones the deadline. A hold is
   registered by whichever comes first: P's scheduler announcing it on the
   side channel the moment the request finished (HOLD, hold_announcer.py),
   or the next engine step's metadata, which under vLLM's async scheduling
   runs only after the step already queued (a long prefill: seconds). The
   second arrival is a no-op.
D: pulls each planned request in a background thread into the blocks the
   scheduler reserved (untouched by the model until the request is
   re-admitted), frees P, and reports it received; any failure is reported
   as received + failed, so vLLM recomputes or fails it by policy.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import structlog

from ascendserve.connectors.kv.pages import PagedKV
from ascendserve.connectors.kv.pull_plan import PullMetadata, PullSettings, RecvPlan
from ascendserve.connectors.kv.stats import StatsRecorder
from ascendserve.connectors.kv.tp_map import plan as plan_heads
from ascendserve.connectors.kv.tp_map import source_ranks
from ascendserve.connectors.transport import make_transport
from ascendserve.connectors.transport.channel import ChannelClient, ChannelServer
from ascendserve.connectors.transport.threads import unpin_current_thread

log = structlog.get_logger("ascendserve.kv.pull")
HOLD_WAIT_S = 30.0
# An announced hold older than this is not taken (the step's metadata registers it instead):
# a late HOLD must never bring back a hold that was already freed and reported.
ANNOUNCE_MAX_AGE_S = 5.0
# How long a finished hold is remembered, so that a late announcement of it is ignored
# (well beyond ANNOUNCE_MAX_AGE_S); at most DONE_MEMORY of them.
DONE_REMEMBER_S = 60.0
DONE_MEMORY = 65536
TRANSFER_THREADS = 4
# An idle engine step (nothing scheduled, only transfers pending) waits this
# long for one to finish. Without it a prefill holding blocks, or a decode
# waiting for them, spins its engine loop flat out; on a small CPU host that
# spinning starved the transfer threads for minutes.
IDLE_STEP_WAIT_S = 0.005
# ... and this long while a transfer is in flight on this worker (D: a pull queued or running;
# P: a read being served) and the KV cache is in host memory. The wait ends the moment the
# transfer does; what it bounds is the delay of a request that reaches an otherwise idle engine
# meanwhile. On a CPU host every idle step has the engine core spin on the worker's answer
# (vLLM's shm reader spins for 20 ms after a read: engine/patches/idle_poll.py), and at one step
# per 5 ms the engine loops of P and D took ~60% of a 2-core host's CPU during a 256 MiB pull
# (measured with bench/kv_transfer.py's engines: pull 1.8 -> 2.4 GB/s at 50 ms). Device hosts
# have cores to spare and keep 5 ms.
TRANSFER_STEP_WAIT_S = 0.05


@dataclass
class _Held:
    blocks: frozenset[int]
    deadline: float
    readers: int = 0
    freed: bool = False


class PullWorker:
    def __init__(self, settings: PullSettings, token: str, tp_rank: int, producer: bool,
                 hold_wait_s: float = HOLD_WAIT_S, tp_size: int = 1, total_kv_heads: int | None = None):
        self.settings, self.token, self.tp_rank, self.producer = settings, token, tp_rank, producer
        self.tp_size, self.total_kv_heads = tp_size, total_kv_heads
        self.hold_wait_s = hold_wait_s
        self.kv: PagedKV | None = None
        self.server: ChannelServer | None = None
        self.client: ChannelClient | None = None
        self._transports: list = []
        self._lock = threading.Lock()
        self._registered = threading.Condition(self._lock)
        self._changed = threading.Condition(self._lock)  # something to report
        self._held: dict[str, _Held] = {}
        # FREE for a hold this worker has not registered yet (P answers the HTTP request
        # before its next engine step registers the hold; the proxy may free at once)
        self._early_frees: dict[str, float] = {}
        # holds registered by an announcement whose step metadata has not come yet (it will:
        # the scheduler queued it when it announced), and holds finished lately (id -> when)
        self._announced: set[str] = set()
        self._done: OrderedDict[str, float] = OrderedDict()
        self._sent: set[str] = set()
        self._recvd: set[str] = set()
        self._failed: set[str] = set()
        # Transfer threads start with the worker, never on the engine's step path:
        # starting a thread from a core-bound worker can wait seconds for a CPU.
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle_step = False
        self._pending = 0  # pulls queued or running
        self._reading = 0  # P: reads being served
        self.stats = StatsRecorder()

    # ---- set-up ----------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict, num_blocks: int | None = None) -> None:
        self.kv = PagedKV(kv_caches, num_blocks, staging_budget=self.settings.staging_mib << 20)
        mine = make_transport(self.settings.transport, self.kv, self.settings.host)
        self._transports.append(mine)
        self.client = ChannelClient(self.token, self.kv, mine)
        if self.producer:
            # P offers what it was configured with plus the transports that cost nothing to
            # offer, so a D configured differently still gets its KV
            offered = {mine.name: mine}
            for name in ("tcp", "shm"):
                if name not in offered:
                    offered[name] = make_transport(name, self.kv)
                    self._transports.append(offered[name])
            port = self.settings.port + self.tp_rank if self.settings.port else 0  # 0: any free port (tests)
            self.server = ChannelServer(self.settings.bind_host, port, self, self.kv, self.token, offered)
            self.server.start()
        for i in range(TRANSFER_THREADS):
            t = threading.Thread(target=self._run_jobs, name=f"kv-pull-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + 2.0
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self.client is not None:
            self.client.close()
        for transport in self._transports:
            transport.close()
        if self.kv is not None:
            self.kv.staging.close()

    def _run_jobs(self) -> None:
        unpin_current_thread()
        while (job := self._jobs.get()) is not None:
            fn, *args = job
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - a job never kills its thread
                log.warning("KV transfer job failed", job=getattr(fn, "__name__", str(fn)), error=str(exc))

    # ---- Holds (producer, called from side-channel threads) ---------------
    def acquire(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            # P answers the HTTP request before its next engine step registers the
            # hold, so a fast D can ask first: wait a little for it.
            self._registered.wait_for(lambda: request_id in self._held, timeout=self.hold_wait_s)
            held = self._held.get(request_id)
            if held is None:
                raise KeyError(f"request {request_id} is not held here (unknown or expired; "
                               f"holding {len(self._held)} requests)")
            if held.freed:
                raise KeyError(f"request {request_id} was already freed")
            if not set(block_ids) <= held.blocks:
                raise ValueError(f"request {request_id} does not hold blocks {sorted(set(block_ids) - held.blocks)}")
            held.readers += 1
            self._reading += 1

    def release(self, request_id: str) -> None:
        with self._lock:
            self._reading -= 1
            held = self._held.get(request_id)
            if held is not None:
                held.readers -= 1
                if not held.freed:  # D reads in parts or retries: give it a moment more
                    held.deadline = max(held.deadline, time.monotonic() + 5.0)
            self._changed.notify_all()  # an idle step waiting for this read goes on

    def free(self, request_id: str) -> None:
        with self._lock:
            held = self._held.get(request_id)
            if held is None:
                # remembered until the hold is registered (or for the wait a read gets)
                self._early_frees[request_id] = time.monotonic() + max(self.hold_wait_s, 30.0)
                return
            if not held.freed:
                held.freed = True
                held.deadline = 0.0  # reported at the next step, once no read is in flight
                self._changed.notify_all()

    def announce(self, request_id: str, block_ids: list[int], ttl_s: float, age_s: float) -> bool:
        """P's scheduler holds `block_ids` of a finished request for D (HOLD on the side
        channel, sent `age_s` ago): register the hold now rather than at the next step.
        Ignored when the step already registered it, it finished lately, or it is old."""
        with self._lock:
            if age_s > ANNOUNCE_MAX_AGE_S or request_id in self._held or request_id in self._done:
                return False
            self._register(request_id, block_ids, ttl_s, time.monotonic())
            self._announced.add(request_id)
            self._registered.notify_all()
        log.debug("KV hold announced", request=request_id, blocks=len(block_ids))
        return True

    def _register(self, request_id: str, blocks, ttl_s: float, now: float) -> None:
        held = self._held[request_id] = _Held(frozenset(blocks), now + ttl_s)
        if self._early_frees.pop(request_id, None) is not None:
            held.freed, held.deadline = True, 0.0

    # ---- per step --------------------------------------------------------
    def start_load_kv(self, meta: PullMetadata) -> None:
        now = time.monotonic()
        self._idle_step = meta.idle
        with self._lock:
            for request_id, (blocks, ttl_s) in meta.send.items():
                if request_id in self._announced:  # registered already (and maybe finished since)
                    self._announced.discard(request_id)
                    continue
                self._register(request_id, blocks, ttl_s, now)
                log.debug("KV held for decode", request=request_id, blocks=len(blocks), ttl_s=ttl_s)
            for request_id in [r for r, until in self._early_frees.items() if until <= now]:
                del self._early_frees[request_id]
            if meta.send:
                self._registered.notify_all()
        with self._lock:
            self._pending += len(meta.recv)
        for plan in meta.recv:
            log.debug("KV pull planned", request=plan.request_id)
            self._jobs.put((self._pull, plan))
        for host, port, remote_id in meta.free_remote:
            self._jobs.put((self.client.free, host, port + self.tp_rank, remote_id))

    def _expire(self) -> None:
        now = time.monotonic()
        for request_id, held in list(self._held.items()):
            if held.readers == 0 and held.deadline <= now:
                if not held.freed:
                    log.warning("KV held for decode past its deadline; freeing", request=request_id)
                    self.stats.expired()
                del self._held[request_id]
                self._sent.add(request_id)
                self._done[request_id] = now
        while self._done and (len(self._done) > DONE_MEMORY
                              or next(iter(self._done.values())) < now - DONE_REMEMBER_S):
            self._done.popitem(last=False)

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        with self._lock:
            self._expire()
            if self._idle_step and not (self._sent or self._recvd) and (self._held or self._pending):
                self._changed.wait(self._idle_wait())
                self._expire()
            self._idle_step = False
            sent, recvd, failed = self._sent, self._recvd, self._failed
            self._sent, self._recvd, self._failed = set(), set(), set()
        return sent, recvd, failed

    def _idle_wait(self) -> float:
        """How long an idle step waits for a transfer to finish (called locked)."""
        in_flight = self._pending or self._reading
        return TRANSFER_STEP_WAIT_S if in_flight and self.kv is not None and self.kv.device.type == "cpu" \
            else IDLE_STEP_WAIT_S

    def held_count(self) -> int:
        with self._lock:
            return len(self._held)

    def take_stats(self):
        with self._lock:
            held = sum(len(h.blocks) for h in self._held.values()) if self.producer else None
        return self.stats.take(held)

    # ---- consumer --------------------------------------------------------
    def _sources(self, plan: RecvPlan) -> list[tuple[int, tuple[int, int, int] | None]]:
        """(P rank, head run or None for whole pages) to read, for this D rank."""
        if plan.remote_tp == self.tp_size:
            return [(self.tp_rank, None)]
        total = self.total_kv_heads or self.kv.num_heads * self.tp_size
        out = []
        for seg in plan_heads(total, plan.remote_tp, self.tp_size, self.tp_rank, plan.remote_request_id):
            whole = seg.p_head == 0 and seg.d_head == 0 and seg.heads == self.kv.num_heads
            out.append((seg.p_rank, None if whole else (seg.p_head, seg.d_head, seg.heads)))
        return out

    def _pull(self, plan: RecvPlan) -> None:
        ok = False
        started = time.monotonic()
        log.debug("KV pull starting", request=plan.request_id, peer=f"{plan.host}:{plan.port}",
                  blocks=len(plan.local_blocks), remote_tp=plan.remote_tp)
        moved = 0
        try:
            ranks = source_ranks(plan.remote_tp, self.tp_size, self.tp_rank) if plan.remote_tp != self.tp_size \
                else range(self.tp_rank, self.tp_rank + 1)
        except ValueError as exc:  # P_tp not a multiple of D_tp: fail by policy, say why
            ranks = range(plan.remote_tp) if self.tp_rank == 0 else range(0)
            log.warning("KV pull failed", request=plan.request_id, peer=f"{plan.host}:{plan.port}", error=str(exc))
        else:
            try:
                if plan.local_blocks:
                    for p_rank, heads in self._sources(plan):
                        moved += self.client.pull(plan.host, plan.port + p_rank, plan.remote_request_id,
                                                  plan.remote_blocks, plan.local_blocks, heads)
                ok = True
            except Exception as exc:  # noqa: BLE001 - every failure must reach the scheduler
                log.warning("KV pull failed", request=plan.request_id, peer=f"{plan.host}:{plan.port}",
                            error=str(exc))
        seconds = time.monotonic() - started
        with self._lock:
            self._pending -= 1
            self._recvd.add(plan.request_id)
            if ok:
                self.stats.transfer(moved, seconds)
            else:
                self._failed.add(plan.request_id)
                self.stats.failure()
            self._changed.notify_all()
        if ok:
            log.info("KV pulled", request=plan.request_id, blocks=len(plan.local_blocks), bytes=moved,
                     ms=round(seconds * 1000, 2), gbps=round(moved / seconds / 1e9, 3) if seconds > 0 else None,
                     transport=self.settings.transport)
        # after D's engine may go on: P's release is off the critical path
        for p_rank in ranks:
            self.client.free(plan.host, plan.port + p_rank, plan.remote_request_id)
