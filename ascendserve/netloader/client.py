"""The joining side of NetLoader: a model's weights from one seed, verified as they arrive.

`open_transfer()` checks the seed's answer before any data moves (the token
and wire version were accepted, the manifest is well formed, it describes
this model, the host has memory for it) and returns a Transfer. Iterating
it receives the tensors over up to `streams` TCP connections at once (one
socket copies at one core's pace; on loopback two carry 1.8x what one does),
each a contiguous byte range of the checkpoint (wire.plan), into a host
buffer of its own per tensor, or straight into a target tensor (the model's
parameter) where one of the same name, dtype and shape is given. With
`recycle` (a loader that copies each tensor into host-resident parameters
and lets it go), the buffer of a tensor the caller has dropped receives a
later tensor of the same size: a model's layers repeat their shapes, so the
host memory a load touches is the window in flight, not the checkpoint (the
first touch of fresh pages was the largest cost of a transfer, README:
NetLoader performance). A second thread checks the
CRC32C of every tensor as it completes, and the Transfer yields each tensor
once it is verified, while the rest stream. So the model's weight loading
copies tensor i into its parameters while tensor i+1 arrives.

A seed that dies, stalls past `timeout_s` on any stream, lies about a byte or
serves another model raises NetLoadError: from open_transfer() before any
data, or from the iteration, after which some parameters may hold bytes of
this seed, so the caller (loader.py) loads every parameter again (from the
next seed, or the disk). `fetch()` collects a whole transfer into a list.
"""

from __future__ import annotations

import math
import queue
import socket
import sys
import threading
import time
import weakref

import msgspec
import structlog

from ascendserve.netloader import wire
from ascendserve.netloader.checkpoint import DTYPE_BYTES
from ascendserve.protocol.frames import FrameError, read_frame, recv_exact, send_frame
from ascendserve.protocol.wire import decode_msgpack

log = structlog.get_logger("ascendserve.netloader")
MAX_TENSORS = 1 << 20
STREAMS = 4  # connections per transfer by default (netloader.streams)
STREAM_MIN_BYTES = 32 << 20  # no stream for less: a connection and a handshake cost more than they save
BLOCK = 4 << 20  # a stream receives a chunk in blocks of this, each counted as progress


class NetLoadError(Exception):
    """This seed could not provide the weights; the message says why."""


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise NetLoadError(f"netloader source {address!r} is not host:port")
    return host.strip("[]"), int(port)


def _check_manifest(ack: dict, raw_manifest: bytes, expect_identity: dict) -> list[dict]:
    try:
        manifest = decode_msgpack(raw_manifest)
    except msgspec.DecodeError as exc:
        raise NetLoadError(f"malformed manifest: {exc}") from None
    identity = ack.get("identity")
    if not isinstance(identity, dict) or not isinstance(manifest, list) or len(manifest) > MAX_TENSORS:
        raise NetLoadError("malformed JOIN_ACK")
    if identity.get("config_sha256") != expect_identity["config_sha256"]:
        raise NetLoadError(f"seed serves another model ({identity.get('architectures')}, config "
                           f"{str(identity.get('config_sha256'))[:12]}), this is {expect_identity['architectures']} "
                           f"config {expect_identity['config_sha256'][:12]}")
    names = set()
    for e in manifest:
        ok = isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("dtype"), str) \
            and e["dtype"] in DTYPE_BYTES \
            and isinstance(e.get("shape"), list) and all(isinstance(d, int) and d >= 0 for d in e["shape"]) \
            and isinstance(e.get(wire.CHECKSUM), int) \
            and e.get("nbytes") == math.prod(e["shape"]) * DTYPE_BYTES[e["dtype"]]
        if not ok or e["name"] in names:
            raise NetLoadError(f"malformed manifest entry {str(e)[:200]}")
        names.add(e["name"])
    if ack.get("total_bytes") != sum(e["nbytes"] for e in manifest):
        raise NetLoadError("manifest sizes do not add up to total_bytes")
    return manifest


class Progress:
    """A bar on a terminal (bytes, GB/s, ETA); nothing in between otherwise, a summary line at the end."""

    def __init__(self, total: int, label: str):
        self.total, self.label = total, label
        self.done = 0
        self.start = self.last = time.monotonic()  # last: when bytes last arrived (the transfer's proof of life)
        self._last = 0.0
        self.tty = sys.stderr.isatty()
        self._lock = threading.Lock()  # streams report from their threads

    def update(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = self.last = time.monotonic()
            if not (self.tty and (now - self._last > 0.2 or self.done == self.total)):
                return
            self._last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate else 0.0
            width = 30
            filled = int(width * self.done / max(self.total, 1))
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                             f"{self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB {rate / 1e9:.2f} GB/s "
                             f"ETA {eta:.0f} s ")
            sys.stderr.flush()

    def finish(self) -> float:
        seconds = time.monotonic() - self.start
        if self.tty:
            sys.stderr.write("\n")
        return seconds


def fetch(address: str, token: str, expect_identity: dict, join_info: dict, timeout_s: float,
          max_bytes: int | None = None, verify: bool = True, streams: int = STREAMS):
    """[(name, torch.Tensor)] of every tensor the seed at `address` serves, verified, in manifest order.

    `verify=False` skips the CRC32C checks: only bench/netloader.py uses it, to show
    what the checks cost; the loader always verifies."""
    transfer = open_transfer(address, token, expect_identity, join_info, timeout_s, max_bytes, verify, streams)
    got = dict(transfer)
    return [(e["name"], got[e["name"]]) for e in transfer.manifest]


def receive(sock: socket.socket, address: str, token: str, expect_identity: dict, join_info: dict,
            timeout_s: float, max_bytes: int | None = None, verify: bool = True):
    """fetch() over one connected socket (which the caller also closes)."""
    transfer = open_transfer(address, token, expect_identity, join_info, timeout_s, max_bytes, verify, 1,
                             connect=lambda: sock)
    got = dict(transfer)
    return [(e["name"], got[e["name"]]) for e in transfer.manifest]


def open_transfer(address: str, token: str, expect_identity: dict, join_info: dict, timeout_s: float,
                  max_bytes: int | None = None, verify: bool = True, streams: int = STREAMS,
                  connect=None, targets: dict | None = None, recycle: bool = False) -> "Transfer":
    """JOIN the seed on one connection, check its answer, JOIN on the further streams; NetLoadError else.

    A further stream the seed refuses (busy) or that fails to connect just leaves fewer streams.
    `targets` (name -> tensor, e.g. the model's parameters): a tensor of the manifest whose target
    has its dtype and shape and is contiguous in host memory is received straight into it (and
    yielded as that very tensor), not into a host buffer. `recycle`: the host buffer of a yielded
    tensor that nothing references any more (not the tensor, nor a view of it) receives a later
    tensor of its size; only for a caller whose use of a tensor is over once it lets go of it
    (not one whose asynchronous device copy may still read it)."""
    try:
        wire.require_checksum()
    except wire.ChecksumUnavailable as exc:
        raise NetLoadError(str(exc)) from None
    if connect is None:
        host, port = parse_address(address)

        def connect():
            try:
                return socket.create_connection((host, port), timeout=timeout_s)
            except OSError as exc:
                raise NetLoadError(f"seed {address} unreachable: {exc}") from None
    socks = [connect()]
    try:
        ack, raw_manifest = _join(socks[0], address, token, expect_identity, join_info, timeout_s, 0)
        manifest = _check_manifest(ack, raw_manifest, expect_identity)
        in_place = _in_place(manifest, targets or {})
        total = sum(e["nbytes"] for i, e in enumerate(manifest) if i not in in_place)  # at most, not recycling
        if max_bytes is not None and total > max_bytes:
            raise NetLoadError(f"weights of {total / 2**30:.2f} GiB exceed the {max_bytes / 2**30:.2f} GiB "
                               "this host can hold")
        wanted = max(1, min(int(streams), wire.MAX_STREAMS, -(-ack["total_bytes"] // STREAM_MIN_BYTES)))
        while len(socks) < wanted:
            try:
                sock = connect()
            except NetLoadError as exc:
                log.info("netloader: fewer streams", seed=address, streams=len(socks), reason=str(exc))
                break
            socks.append(sock)
            try:
                other, other_manifest = _join(sock, address, token, expect_identity, join_info, timeout_s,
                                              len(socks) - 1)
                if (other.get("identity"), other_manifest) != (ack["identity"], raw_manifest):
                    raise NetLoadError(f"seed {address} answered another manifest on a further stream")
            except NetLoadError as exc:
                log.info("netloader: fewer streams", seed=address, streams=len(socks) - 1, reason=str(exc))
                socks.pop().close()
                break
        return Transfer(address, socks, manifest, ack["total_bytes"], timeout_s, verify, in_place, recycle)
    except BaseException:
        for sock in socks:
            sock.close()
        raise


def _join(sock: socket.socket, address: str, token: str, expect_identity: dict, join_info: dict,
          timeout_s: float, stream: int) -> tuple[dict, bytes]:
    """JOIN on a connected socket; the seed's JOIN_ACK of our wire version and its manifest's bytes
    (the payload, not yet decoded), or NetLoadError."""
    sock.settimeout(timeout_s)
    try:
        send_frame(sock, {"type": "JOIN", "token": token, "identity": expect_identity, **join_info,
                          "stream": stream, "version": wire.WIRE_VERSION})
        ack = read_frame(sock, wire.MAX_MANIFEST_BYTES)
        if ack["type"] == "JOIN_NACK":
            raise NetLoadError(f"seed {address} refused: {str(ack.get('reason'))[:500]}")
        if ack["type"] != "JOIN_ACK":
            raise NetLoadError(f"seed {address} answered {ack['type']} to JOIN")
        if (why := wire.ack_refusal(ack)) is not None:  # before reading what another version sent
            raise NetLoadError(f"seed {address}: {why}")
        return ack, recv_exact(sock, ack.get("payload", 0))
    except (FrameError, ConnectionError, OSError) as exc:  # socket.timeout is an OSError
        raise NetLoadError(f"seed {address}: {type(exc).__name__}: {exc}") from None


def _in_place(manifest: list[dict], targets: dict) -> dict:
    """{manifest index: target tensor} of the tensors that can be received straight into their target."""
    if not targets:
        return {}
    import torch

    found = {}
    for i, e in enumerate(manifest):
        t = targets.get(e["name"])
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() \
                and t.dtype == getattr(torch, TORCH_DTYPES[e["dtype"]]) and list(t.shape) == e["shape"] \
                and t.untyped_storage().nbytes() >= t.storage_offset() * t.element_size() + e["nbytes"]:
            found[i] = t
    return found


_FAILED = -1  # on the ready queue: look at Transfer.error


class Transfer:
    """One seed's tensors over `socks` (joined, not yet asked): iterate for (name, tensor), each verified.

    Threads: one per stream (receives its chunks into the tensor's buffer, taken when its first chunk
    comes: a recycled one of its size, or fresh pages, faulted in by the stream that fills them;
    touching them first only moves that cost); a tensor whose last chunk lands
    goes to the checker), one checker (CRC32C, a slice at a time: wire.crc32c), and the iterating one, which
    yields what the checker passed. The first failure anywhere shuts every socket down (so no
    thread waits past it) and is raised from the iteration. Every socket has `timeout_s`."""

    def __init__(self, address: str, socks: list, manifest: list[dict], payload_bytes: int, timeout_s: float,
                 verify: bool, in_place: dict | None = None, recycle: bool = False):
        import torch

        self._torch = torch
        self.address, self.socks, self.manifest = address, socks, manifest
        self.timeout_s, self.verify = timeout_s, verify
        # every producer has socket deadlines; this bound on no bytes arriving (not on the time to the next
        # tensor: a large one on a slow link takes long) only guards against a bug of ours
        self.stall_s = timeout_s * 2 + 10
        self.payload_bytes = payload_bytes
        self.error: str | None = None
        self.in_place: dict[int, object] = in_place or {}  # index -> the target its bytes go straight into
        self.recycle = recycle
        self.recycled = 0  # tensors received into a buffer an earlier one had
        self._blocks: list = [None] * len(manifest)  # index -> its host buffer (uint8 tensor), once taken
        self._free: dict[int, list] = {}  # nbytes -> buffers the caller let go of
        self._dest: list = [_bytes_of(self.in_place[i]) if i in self.in_place else None for i in range(len(manifest))]
        self._remaining = [e["nbytes"] for e in manifest]
        # reentrant: a buffer let go of (_let_go) may be handed back by a garbage collection that runs
        # in a stream's thread while it holds the lock
        self._lock = threading.RLock()
        self._checks: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        self._streams_left = len(socks)
        self._threads: list[threading.Thread] = []
        self._started = False

    @property
    def streams(self) -> int:
        return len(self.socks)

    def __iter__(self):
        try:
            self._start()
            progress = self._progress
            for _ in range(len(self.manifest)):
                i = self._next_ready()
                e = self.manifest[i]
                if i in self.in_place:
                    yield e["name"], self.in_place[i]
                else:
                    yield e["name"], self._tensor(i, e)
            if self._next_ready(end=True) is not None:
                raise NetLoadError(f"seed {self.address}: a stream did not end")  # unreachable by design
            seconds = progress.finish()
        finally:
            self.close()
        log.info("netloader: weights received", seed=self.address, tensors=len(self.manifest),
                 streams=self.streams, recycled=self.recycled, gb=round(self.payload_bytes / 1e9, 3),
                 seconds=round(seconds, 2),
                 gb_per_s=round(self.payload_bytes / 1e9 / max(seconds, 1e-9), 2))

    def _start(self) -> None:
        self._started = True
        self._progress = Progress(self.payload_bytes, f"netloader {self.address}")
        plan = wire.plan([e["nbytes"] for e in self.manifest], len(self.socks))
        try:
            for j, sock in enumerate(self.socks):
                send_frame(sock, {"type": "GET", "part": j, "parts": len(self.socks)})
        except (ConnectionError, OSError) as exc:
            raise NetLoadError(f"seed {self.address}: {type(exc).__name__}: {exc}") from None
        self._threads = [threading.Thread(target=self._stream, args=(sock, plan[j]), daemon=True,
                                          name=f"netloader-stream-{j}") for j, sock in enumerate(self.socks)]
        self._threads.append(threading.Thread(target=self._check, daemon=True, name="netloader-crc32c"))
        for t in self._threads:
            t.start()

    def _next_ready(self, end: bool = False):
        """The next verified tensor's index (None at the end); NetLoadError on any failure."""
        while True:
            try:
                i = self._ready.get(timeout=min(self.stall_s, 5.0))
                break
            except queue.Empty:
                if time.monotonic() - self._progress.last > self.stall_s:
                    self._fail(f"seed {self.address}: no bytes and no tensor for {self.stall_s:g} s")
                    i = _FAILED
                    break
        if i == _FAILED or self.error is not None:
            raise NetLoadError(self.error)
        if i is None and not end:
            raise NetLoadError(f"seed {self.address}: the streams ended before every tensor was verified")
        return i

    def _stream(self, sock: socket.socket, chunks: list[tuple[int, int, int]]) -> None:
        try:
            for i, offset, n in chunks:
                e = self.manifest[i]
                head = read_frame(sock, n)
                if head["type"] != "TENSOR" or head.get("index") != i or head.get("name") != e["name"] \
                        or head.get("offset", 0) != offset or head.get("payload", 0) != n:
                    raise NetLoadError(f"seed {self.address} sent {head.get('type')} {head.get('name')!r} "
                                       f"where tensor {i} ({e['name']}) from byte {offset} was due")
                dest = self._dest[i] or self._take(i)
                for at in range(offset, offset + n, BLOCK):
                    k = min(BLOCK, offset + n - at)
                    recv_exact(sock, k, dest[at:at + k])
                    self._progress.update(k)
                with self._lock:
                    self._remaining[i] -= n
                    complete = self._remaining[i] == 0
                if complete:
                    self._checks.put(i)  # checked on the checker thread while the streams go on
            if read_frame(sock, 0)["type"] != "DONE":
                raise NetLoadError(f"seed {self.address} did not end with DONE")
        except NetLoadError as exc:
            self._fail(str(exc))
        except (FrameError, ConnectionError, OSError) as exc:  # socket.timeout is an OSError
            self._fail(f"seed {self.address}: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._streams_left -= 1
                last = self._streams_left == 0
            if last:
                self._checks.put(None)

    def _take(self, i: int) -> memoryview:
        """Tensor i's host buffer, as its first chunk comes: one of its size the caller let go of, or fresh."""
        n = self.manifest[i]["nbytes"]
        with self._lock:
            if self._dest[i] is None:
                free = self._free.get(n)
                if free:
                    self._blocks[i] = free.pop()
                    self.recycled += 1
                else:
                    self._blocks[i] = self._torch.empty(max(n, 1), dtype=self._torch.uint8)
                self._dest[i] = memoryview(self._blocks[i].numpy())[:n]
            return self._dest[i]

    def _tensor(self, i: int, e: dict):
        """Tensor i, viewing its host buffer; with recycling, the buffer is free again once the last
        reference to it (this tensor, a view of it, a numpy array of it) is gone."""
        dtype = getattr(self._torch, TORCH_DTYPES[e["dtype"]])
        if not e["nbytes"]:
            return self._torch.empty(e["shape"], dtype=dtype)
        owner = self._blocks[i].numpy()  # a new array object: the tensor's storage holds it, and only it does
        if self.recycle:
            weakref.finalize(owner, self._let_go, i, self._blocks[i])
        self._blocks[i] = self._dest[i] = None  # the tensor alone holds its buffer now
        return self._torch.frombuffer(owner, dtype=dtype).reshape(e["shape"])

    def _let_go(self, i: int, block) -> None:
        with self._lock:
            if self.recycle:
                self._free.setdefault(self.manifest[i]["nbytes"], []).append(block)

    def _check(self) -> None:
        while (i := self._checks.get()) is not None:
            e = self.manifest[i]
            if self.verify and self.error is None:
                if wire.crc32c(self._dest[i]) != e[wire.CHECKSUM]:
                    self._fail(f"seed {self.address}: checksum mismatch in {e['name']}")
                    continue
            self._ready.put(i)
        self._ready.put(None)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = reason
        self._ready.put(_FAILED)
        for sock in self.socks:  # wakes every stream blocked on its socket
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Stop (if running) and release the sockets; threads end within their socket deadlines."""
        if self._started and any(t.is_alive() for t in self._threads):
            self._fail(self.error or f"seed {self.address}: transfer abandoned")
        for t in self._threads:
            t.join(self.timeout_s + 5)
        for sock in self.socks:
            sock.close()
        with self._lock:
            self.recycle = False  # buffers let go of from now on are freed
            self._free.clear()
        if not any(t.is_alive() for t in self._threads):  # a buffer goes once the tensor yielded from it does
            self._blocks = self._dest = []

    def changed_in_place(self) -> list[str]:
        """Names of the tensors received in place whose target no longer holds their bytes (call it once
        the model's load_weights is done: a model that transforms a tensor while loading it, where
        the source is the target, is caught here)."""
        return [self.manifest[i]["name"] for i, t in self.in_place.items()
                if wire.crc32c(_bytes_of(t)) != self.manifest[i][wire.CHECKSUM]]


TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32",
                "U64": "uint64"}


def _bytes_of(t) -> memoryview:
    """The bytes of a contiguous host tensor, writable in place."""
    import torch

    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
