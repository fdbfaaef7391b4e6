"""The joining side of NetLoader: fetch a model's weights from one seed, verified.

`fetch()` checks the seed's answer before any data moves (the token was
accepted, the manifest is well formed, it describes this model, the host has
memory for it), receives every tensor into one host buffer, verifies each
CRC32C on a second thread while the next tensor arrives, and only then
returns tensors. A seed that dies, stalls past `timeout_s`, lies about a
byte or serves another model raises NetLoadError; nothing has touched the
model's parameters by then, so the caller's disk fallback starts clean.
"""

from __future__ import annotations

import math
import queue
import socket
import sys
import threading
import time

import structlog

from ascendserve.netloader import wire
from ascendserve.netloader.checkpoint import DTYPE_BYTES
from ascendserve.protocol.frames import FrameError, read_frame, recv_exact, send_frame

log = structlog.get_logger("ascendserve.netloader")
ALIGN = 64  # every tensor starts 64-byte aligned in the receive buffer (dtype views need it)
MAX_TENSORS = 1 << 20


class NetLoadError(Exception):
    """This seed could not provide the weights; the message says why."""


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise NetLoadError(f"netloader source {address!r} is not host:port")
    return host.strip("[]"), int(port)


def _check_manifest(ack: dict, expect_identity: dict) -> list[dict]:
    identity, manifest = ack.get("identity"), ack.get("manifest")
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
            and isinstance(e.get(wire.CHECKSUM), int) and e.get("nbytes") == math.prod(e["shape"]) * DTYPE_BYTES[e["dtype"]]
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
        self.start = time.monotonic()
        self._last = 0.0
        self.tty = sys.stderr.isatty()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.tty and (now - self._last > 0.2 or self.done == self.total):
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
          max_bytes: int | None = None, verify: bool = True):
    """[(name, torch.Tensor)] of every tensor the seed at `address` serves, verified.

    `verify=False` skips the CRC32C checks: only bench/netloader.py uses it, to show
    what the checks cost; the loader always verifies."""
    try:
        wire.require_checksum()
    except wire.ChecksumUnavailable as exc:
        raise NetLoadError(str(exc)) from None
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise NetLoadError(f"seed {address} unreachable: {exc}") from None
    with sock:
        return receive(sock, address, token, expect_identity, join_info, timeout_s, max_bytes, verify)


def receive(sock: socket.socket, address: str, token: str, expect_identity: dict, join_info: dict,
            timeout_s: float, max_bytes: int | None = None, verify: bool = True):
    """fetch() on a connected socket (the caller closes it): JOIN, check, GET, receive, verify."""
    import torch

    sock.settimeout(timeout_s)
    try:
        send_frame(sock, {"type": "JOIN", "token": token, "identity": expect_identity, **join_info,
                          "version": wire.WIRE_VERSION})
        ack = read_frame(sock, 0)
        if ack["type"] == "JOIN_NACK":
            raise NetLoadError(f"seed {address} refused: {str(ack.get('reason'))[:500]}")
        if ack["type"] != "JOIN_ACK":
            raise NetLoadError(f"seed {address} answered {ack['type']} to JOIN")
        if (why := wire.ack_refusal(ack)) is not None:
            raise NetLoadError(f"seed {address}: {why}")
        manifest = _check_manifest(ack, expect_identity)
        offsets, total = [], 0
        for e in manifest:
            offsets.append(total)
            total += -(-e["nbytes"] // ALIGN) * ALIGN
        if max_bytes is not None and total > max_bytes:
            raise NetLoadError(f"weights of {total / 2**30:.2f} GiB exceed the {max_bytes / 2**30:.2f} GiB "
                               "this host can hold")
        buf = receive_buffer(total)
        raw = memoryview(buf.numpy())
        send_frame(sock, {"type": "GET"})
        progress = Progress(ack["total_bytes"], f"netloader {address}")
        bad: list[str] = []
        checks: queue.Queue = queue.Queue()
        checker = threading.Thread(target=_verify, args=(checks, manifest, raw, offsets, bad), daemon=True,
                                   name="netloader-crc32c")
        checker.start()
        try:
            for i, e in enumerate(manifest):
                head = read_frame(sock, e["nbytes"])
                if head["type"] != "TENSOR" or head.get("index") != i or head.get("name") != e["name"] \
                        or head.get("payload", 0) != e["nbytes"]:
                    raise NetLoadError(f"seed {address} sent {head.get('type')} {head.get('name')!r} "
                                       f"where tensor {i} ({e['name']}) was due")
                if e["nbytes"]:
                    recv_exact(sock, e["nbytes"], raw[offsets[i]:offsets[i] + e["nbytes"]])
                if verify:
                    checks.put(i)  # checked on the second thread while tensor i+1 streams
                progress.update(e["nbytes"])
            if read_frame(sock, 0)["type"] != "DONE":
                raise NetLoadError(f"seed {address} did not end with DONE")
        finally:
            checks.put(None)
            checker.join()  # CPU-bound over what has arrived: it ends
        seconds = progress.finish()
    except (FrameError, ConnectionError, OSError) as exc:  # socket.timeout is an OSError
        raise NetLoadError(f"seed {address}: {type(exc).__name__}: {exc}") from None
    if bad:
        raise NetLoadError(f"seed {address}: checksum mismatch in {', '.join(bad[:3])}"
                           + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""))
    log.info("netloader: weights received", seed=address, tensors=len(manifest),
             gb=round(ack["total_bytes"] / 1e9, 3), seconds=round(seconds, 2),
             gb_per_s=round(ack["total_bytes"] / 1e9 / max(seconds, 1e-9), 2))
    return [(e["name"], _tensor(buf, offsets[i], e, torch)) for i, e in enumerate(manifest)]


def receive_buffer(nbytes: int):
    """The uint8 tensor every tensor is received into."""
    import torch

    return torch.empty(max(nbytes, 1), dtype=torch.uint8)


def _verify(checks: queue.Queue, manifest: list[dict], raw: memoryview, offsets: list[int], bad: list[str]) -> None:
    while (i := checks.get()) is not None:
        e = manifest[i]
        if wire.crc32c(raw[offsets[i]:offsets[i] + e["nbytes"]]) != e[wire.CHECKSUM]:
            bad.append(e["name"])


TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32",
                "U64": "uint64"}


def _tensor(buf, offset: int, e: dict, torch):
    dtype = getattr(torch, TORCH_DTYPES[e["dtype"]])
    return buf[offset:offset + e["nbytes"]].view(dtype).reshape(e["shape"])
