"""Proxy workers: N processes serve the one port and share one view of the instances.

- **The port.** granian binds it with SO_REUSEPORT on Linux, so every worker binds the same
  address and the kernel spreads connections over them.
- **Decided once, in worker 0 (the leader).** Health checks and ejection, the registry watch,
  instances added or removed through the admin API. Every SNAPSHOT_S the leader publishes its
  instance table (states, models, connectors, the engines' reported load) into a shared mapping;
  the other workers (followers) mirror it into their own Pools. What a follower learns that the
  leader decides on (a hop that failed, an instance that stalled, an admin add or remove) goes to
  the leader as a datagram on an abstract unix socket (msgspec JSON, no pickle).
- **Load.** Each worker writes its own in-flight counts per instance (requests, tokens, KV blocks)
  into its row of a shared counter table; each chooses by its own counts plus the other rows plus
  what the engines report beyond this proxy. Leases stay per worker and release exactly once.
- **The supervisor** (the process the user started) creates the shared mapping, forks the
  workers, forwards SIGTERM/SIGINT, and restarts a worker that dies (its counter row zeroed first)
  at most RESTARTS times in RESTART_WINDOW_S; past that it stops them all and exits 1. Workers
  die with it (PR_SET_PDEATHSIG). Prometheus counters of every worker are summed at each scrape
  (prometheus_client's multiprocess mode, in a private directory removed at exit).
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import shutil
import signal
import socket
import struct
import tempfile
import time
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass

import msgspec
import structlog

from ascendserve.protocol.kv_connectors import KVInfo
from ascendserve.protocol.kv_events import CacheInfo
from ascendserve.router.pools import DRAINING, ROLES, Instance, Pools

log = structlog.get_logger("ascendserve.proxy")

MAX_WORKERS = 64
AUTO_MAX = 8  # workers = 0: the cores given to the proxy, at most this many
SLOTS = 4096  # instances the counter table holds; a forgotten instance's slot is reused last
SNAP_MAX = 8 << 20  # the largest instance table (bytes of JSON); 1,000 instances take ~1 MiB
SNAPSHOT_S = 0.05  # the leader publishes changes this often, and at once when an instance changes state
POLL_S = 0.01  # followers look for a new table this often (one shared integer read)
RESTARTS, RESTART_WINDOW_S = 5, 60.0
_HEADER = 64  # gen (int64), meta (int64: buffer << 40 | length)
_FIELDS = 4  # requests, tokens, kv in flight; answers given (served)
SESSIONS = 256  # dashboard logins (dashboard/access.py keeps at most as many)
_SESSION = struct.Struct("32sd")  # sha256 of the session id, expiry (CLOCK_MONOTONIC: one clock for all)


def worker_count(configured: int, cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """`configured`, or (0) the cores given to this process: its CPU affinity, bounded by its
    cgroup's CPU quota (a container's --cpus), at most AUTO_MAX."""
    if configured > 0:
        return configured
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = open(cpu_max).read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, min(AUTO_MAX, cores))


class Shared:
    """One anonymous shared mapping, made before the workers are forked: the leader's instance
    table (two buffers, a generation count) and every worker's counters."""

    def __init__(self, workers: int):
        self.workers = workers
        self._counters_at = _HEADER + 2 * SNAP_MAX
        self.sessions_at = self._counters_at + workers * SLOTS * _FIELDS * 8
        size = self.sessions_at + SESSIONS * _SESSION.size
        self.mm = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)  # pages are touched only when used
        self.header = memoryview(self.mm)[:16].cast("q")
        self.counts = memoryview(self.mm)[self._counters_at:self.sessions_at].cast("q")

    # the instance table: one writer (the leader), readers retry a read the writer overtook
    def publish(self, data: bytes) -> bool:
        if len(data) > SNAP_MAX:
            return False
        which = 1 - (self.header[1] >> 40)
        at = _HEADER + which * SNAP_MAX
        self.mm[at:at + len(data)] = data
        self.header[1] = which << 40 | len(data)
        self.header[0] += 1
        return True

    def generation(self) -> int:
        return self.header[0]

    def read(self) -> tuple[int, bytes]:
        while True:
            gen, meta = self.header[0], self.header[1]
            at = _HEADER + (meta >> 40) * SNAP_MAX
            data = self.mm[at:at + (meta & ((1 << 40) - 1))]
            if self.header[0] == gen:
                return gen, data

    def clear_row(self, worker: int) -> None:
        start = worker * SLOTS * _FIELDS
        self.counts[start:start + SLOTS * _FIELDS] = memoryview(bytes(SLOTS * _FIELDS * 8)).cast("q")


class SharedSessions(MutableMapping):
    """The dashboard's login sessions in the shared mapping: a login through one worker holds in all.
    Two logins at the same instant may take one slot: the first is then lost (log in again)."""

    EMPTY = bytes(32)

    def __init__(self, shared: Shared):
        self.mm, self.at = shared.mm, shared.sessions_at

    def _entries(self) -> Iterator[tuple[int, bytes, float]]:
        for i in range(SESSIONS):
            digest, expiry = _SESSION.unpack_from(self.mm, self.at + i * _SESSION.size)
            if digest != self.EMPTY:
                yield i, digest, expiry

    def _find(self, key: bytes) -> tuple[int, float] | None:
        return next(((i, e) for i, d, e in self._entries() if d == key), None)

    def __getitem__(self, key: bytes) -> float:
        found = self._find(key)
        if found is None:
            raise KeyError(key)
        return found[1]

    def __setitem__(self, key: bytes, expiry: float) -> None:
        found = self._find(key)
        if found is not None:
            slot = found[0]
        else:
            used = {i: e for i, _, e in self._entries()}
            slot = next((i for i in range(SESSIONS) if i not in used), None)
            if slot is None:
                slot = min(used, key=used.__getitem__)  # full: the oldest goes
        _SESSION.pack_into(self.mm, self.at + slot * _SESSION.size, key, expiry)

    def __delitem__(self, key: bytes) -> None:
        found = self._find(key)
        if found is None:
            raise KeyError(key)
        _SESSION.pack_into(self.mm, self.at + found[0] * _SESSION.size, self.EMPTY, 0.0)

    def __iter__(self) -> Iterator[bytes]:
        return iter([d for _, d, _ in self._entries()])

    def __len__(self) -> int:
        return sum(1 for _ in self._entries())


class Counters:
    """One worker's view of the counter table: it writes its own row, reads the others'."""

    def __init__(self, shared: Shared, worker: int):
        self.shared, self.worker = shared, worker
        self.counts = shared.counts
        self.row = worker * SLOTS * _FIELDS
        self.stride = SLOTS * _FIELDS
        self.rows = [w * self.stride for w in range(shared.workers) if w != worker]
        self.on_learned: Callable[[Instance], None] | None = None  # a follower: tell worker 0

    def learned(self, inst: Instance) -> None:
        """This worker learned something of `inst` the others want (its fingerprint)."""
        if self.on_learned is not None:
            self.on_learned(inst)

    def write(self, inst: Instance) -> None:
        if inst.slot >= 0:
            at = self.row + inst.slot * _FIELDS
            self.counts[at], self.counts[at + 1], self.counts[at + 2], self.counts[at + 3] = (
                inst.active_requests, inst.active_tokens, inst.active_kv, inst.served)

    def clear(self, slot: int) -> None:
        """This worker's counts in `slot` back to zero (the instance moved to another slot)."""
        at = self.row + slot * _FIELDS
        self.counts[at] = self.counts[at + 1] = self.counts[at + 2] = self.counts[at + 3] = 0

    def others(self, slot: int) -> tuple[int, int, int]:
        c, base = self.counts, slot * _FIELDS
        requests = tokens = kv = 0
        for row in self.rows:
            at = row + base
            requests += c[at]
            tokens += c[at + 1]
            kv += c[at + 2]
        return requests, tokens, kv

    def served(self, slot: int) -> int:
        """Answers the other workers got from the instance in `slot`."""
        at = slot * _FIELDS + 3
        return sum(self.counts[row + at] for row in self.rows)


class Entry(msgspec.Struct, kw_only=True):
    url: str
    role: str
    slot: int
    state: str
    source: str = "static"
    instance_id: str = ""
    models: list[str] = []
    root: str = ""
    cards: list[dict] = []
    last_error: str = ""
    kv: KVInfo | None = None
    cache: CacheInfo | None = None
    others: int = 0
    kv_usage: float = 0.0
    failures: int = 0
    fingerprint: str | None = None


class Table(msgspec.Struct, kw_only=True):
    instances: list[Entry]
    metaservers: list[str] = []


class Note(msgspec.Struct, kw_only=True):
    """Follower -> leader: `failure` (a hop failed), `suspect` (it stalled), `add`, `drain` (the
    admin API), `wake` (probe now), `fingerprint` (its system_fingerprint is `value`)."""
    op: str
    role: str = ""
    url: str = ""
    value: str = ""


@dataclass
class Worker:
    """What one forked worker knows of the others."""
    index: int
    count: int
    shared: Shared
    address: str  # the leader's datagram socket (abstract namespace)
    metrics_dir: str

    @property
    def leader(self) -> bool:
        return self.index == 0

    def counters(self) -> Counters:
        return Counters(self.shared, self.index)


class Leader:
    """Worker 0's side: publishes the table, takes the followers' notes."""

    def __init__(self, worker: Worker, pools: Pools, health, metaservers: Callable[[], list[str]] | None):
        self.worker, self.pools, self.health = worker, pools, health
        self.metaservers = metaservers or (lambda: [])
        self._last = b""
        self._next_slot = 0
        self._sock: socket.socket | None = None
        self.on_add: Callable[[str, str], None] = lambda role, url: None
        self.on_drain: Callable[[str, str], None] = lambda role, url: None
        self.on_change: Callable[[], None] = lambda: None  # the table changed (published)

    def _slot(self, inst: Instance, used: set[int]) -> None:
        for _ in range(SLOTS):
            slot, self._next_slot = self._next_slot, (self._next_slot + 1) % SLOTS
            if slot not in used:
                inst.slot = slot
                used.add(slot)
                self.pools[inst.role].peers.write(inst)
                return

    def table(self) -> bytes:
        entries = []
        instances = list(self.pools.all_instances())
        used: set[int] | None = None  # the slots taken, gathered once when an instance needs one
        for inst in instances:
            if inst.slot < 0:
                if used is None:
                    used = {i.slot for i in instances}
                self._slot(inst, used)
            entries.append(Entry(url=inst.url, role=inst.role, slot=inst.slot, state=inst.state, source=inst.source,
                                 instance_id=inst.instance_id, models=list(inst.models), root=inst.root,
                                 cards=list(inst.cards), last_error=inst.last_error, kv=inst.kv, cache=inst.cache,
                                 others=inst.others, kv_usage=inst.kv_usage, failures=inst.failures,
                                 fingerprint=inst.fingerprint))
        return msgspec.json.encode(Table(instances=entries, metaservers=list(self.metaservers())))

    def publish(self) -> None:
        data = self.table()
        if data != self._last:
            if not self.worker.shared.publish(data):
                log.error("instance table too large to share with the other workers", bytes=len(data))
                return
            self._last = data
            self.on_change()

    def note(self, raw: bytes) -> None:
        try:
            note = msgspec.json.decode(raw, type=Note)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("unreadable note from a proxy worker", size=len(raw))
            return
        if note.op == "wake":
            self.health.wake()
        elif note.op in ("add", "drain") and note.role in ROLES:
            (self.on_add if note.op == "add" else self.on_drain)(note.role, note.url)
            self.publish()  # the worker that asked waits to see it
        elif note.op == "fingerprint" and note.role in ROLES and note.value and \
                (inst := self.pools[note.role].instances.get(note.url)):
            inst.fingerprint = note.value
        elif note.op in ("failure", "suspect") and (inst := self.pools[note.role].instances.get(note.url)):
            (self.health.report_failure if note.op == "failure" else self.health.suspect)(inst)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._sock = sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(self.worker.address)
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._readable)
        try:
            while True:
                self.publish()
                await asyncio.sleep(SNAPSHOT_S)
        finally:
            loop.remove_reader(sock.fileno())
            sock.close()

    def _readable(self) -> None:
        while True:
            try:
                raw = self._sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            self.note(raw)


class Relay:
    """A follower's HealthMonitor: what the pipeline and the admin API report goes to the leader."""

    def __init__(self, worker: Worker):
        self.address = worker.address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self.on_state = lambda inst, state, before: None

    def tell(self, op: str, role: str = "", url: str = "", value: str = "") -> None:
        try:
            self._sock.sendto(msgspec.json.encode(Note(op=op, role=role, url=url, value=value)), self.address)
        except OSError as exc:  # the leader is restarting: its health checks see the same
            log.warning("proxy worker 0 did not take a note", op=op, url=url, error=repr(exc))

    def wake(self) -> None:
        self.tell("wake")

    def report_failure(self, inst: Instance) -> None:
        self.tell("failure", inst.role, inst.url)

    def suspect(self, inst: Instance) -> None:
        self.tell("suspect", inst.role, inst.url)


class Mirror:
    """A follower's copy of the leader's table, applied to its own Pools."""

    def __init__(self, worker: Worker, pools: Pools, on_state=None, after=None):
        self.worker, self.pools = worker, pools
        self.on_state = on_state or (lambda inst, state, before: None)
        self.after = after or (lambda: None)
        self.metaservers: list[str] = []
        self.generation = -1

    def apply(self, table: Table) -> None:
        seen = set()
        for e in table.instances:
            pool = self.pools[e.role]
            inst = pool.instances.get(e.url)
            if inst is None:
                inst = pool.add(e.url, e.source, e.instance_id)
            seen.add((e.role, e.url))
            inst.source, inst.instance_id, inst.models, inst.root = e.source, e.instance_id, tuple(e.models), e.root
            inst.cards, inst.last_error, inst.kv, inst.cache = tuple(e.cards), e.last_error, e.kv, e.cache
            inst.others, inst.kv_usage, inst.failures = e.others, e.kv_usage, e.failures
            if e.fingerprint is not None:
                inst.fingerprint = e.fingerprint
            if inst.slot != e.slot:  # new, or a restarted worker 0 numbered the slots anew
                if inst.slot >= 0:
                    pool.peers.clear(inst.slot)
                inst.slot = e.slot
                pool.touch(inst)
            if inst.state != e.state:
                before, inst.state = inst.state, e.state
                pool.touch(inst)
                self.on_state(inst, e.state, before)
        for inst in self.pools.all_instances():
            if (inst.role, inst.url) not in seen:
                if inst.active_requests:
                    inst.state = DRAINING  # gone from the leader: ours finish, then it is forgotten
                else:
                    self.pools[inst.role].forget(inst.url)
        self.metaservers = table.metaservers
        self.after()

    def poll(self) -> None:
        if self.worker.shared.generation() == self.generation:
            return
        self.generation, data = self.worker.shared.read()
        if data:
            self.apply(msgspec.json.decode(data, type=Table))

    async def run(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(POLL_S)

    async def until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Look at the leader's table until `done()` holds (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            if done():
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)


# --- the supervisor ---------------------------------------------------------------------------

def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


METRICS_PREFIX = "ascendserve-proxy-metrics-"


def sweep_metrics_dirs(parent: str | None = None) -> list[str]:
    """Remove the metrics directories of supervisors that are gone (SIGKILLed: their `finally` never
    ran): named `METRICS_PREFIX<pid>-...`, the pid no longer alive. A pid that is alive again (reused)
    keeps its directory: never a live supervisor's. Returns what was removed."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        pid = name[len(METRICS_PREFIX):].split("-", 1)[0] if name.startswith(METRICS_PREFIX) else ""
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(parent, name)
        if os.path.isdir(path) and not os.path.islink(path) and os.stat(path).st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def supervise(count: int, serve: Callable[[Worker], int]) -> int:
    """Fork `count` workers, each running `serve(worker)`; return once they all ended."""
    for path in sweep_metrics_dirs():
        log.info("removed the metrics directory of a proxy that was killed", path=path)
    metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{os.getpid()}-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    shared = Shared(count)
    address = f"\0ascendserve-proxy-{os.getpid()}-{time.monotonic_ns()}"
    children: dict[int, int] = {}  # pid -> worker index
    stopping = False
    deaths: list[float] = []
    rc = 0

    def start(index: int) -> None:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _die_with_parent()
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
                    signal.signal(sig, signal.SIG_DFL)
                structlog.contextvars.bind_contextvars(worker=index)
                code = serve(Worker(index, count, shared, address, metrics_dir))
            except BaseException as exc:  # noqa: BLE001 - a forked child must never return into the caller
                log.exception("proxy worker failed", worker=index, error=repr(exc))
            finally:
                os._exit(code)
        children[pid] = index

    def stop(*_args) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("proxy workers starting", workers=count)
    try:
        for index in range(count):
            start(index)
        while children:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            index = children.pop(pid, None)
            if index is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            if stopping:
                rc = max(rc, code if code > 0 else 0)
                continue
            now = time.monotonic()
            deaths[:] = [t for t in deaths if now - t < RESTART_WINDOW_S] + [now]
            shared.clear_row(index)
            if len(deaths) > RESTARTS:
                log.error("proxy workers keep dying; stopping", worker=index, exit=code, deaths=len(deaths),
                          window_s=RESTART_WINDOW_S)
                rc = 1
                stop()
                continue
            log.error("proxy worker died; restarting it", worker=index, exit=code)
            time.sleep(0.2)
            if not stopping:
                start(index)
    finally:
        stop()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return rc
