"""The KV side channel's data path off the GIL: libascendserve_xfer.so (native/csrc/kv_xfer.cpp).

Inside a vLLM worker the transfer threads share the GIL with the engine's busy-polling loop.
Python's socket calls release the GIL around each syscall and must win it back after each
one; measured in the engines (bench/kv_transfer.py), a 256 MiB pull took a few hundred
recvmsg calls and ran at a fraction of the same transport outside vLLM. Here a whole read
(D: the READ frame out, the DATA header in, then every page) or a whole answer (P: the DATA
header, then every page) is one call through ctypes, which releases the GIL for all of it:
the pages go straight between the socket and the KV cache by address, with sendmsg/recvmsg
over batches of coalesced runs. The bytes on the wire are the Python path's, so either side
may run either path (a peer of another version included).

`Runs` names the bytes: for a structured spec, for each base (a layer's first page, heads
offset applied), each block id and each offset inside a page, `run` bytes at base + block *
block_stride + offset (PagedKV.request_runs / layer_runs); or explicit buffers (addresses
and lengths of host buffers, e.g. staging buffers). Each call has deadlines: the socket's
timeout without progress, and a whole-call budget (twice that timeout plus its bytes at
MIN_RATE: `_limits`); a peer that closes mid-transfer or sends a short payload fails it at once.
The arrays a Runs names, and what its addresses point into (`keep`), live as long as the Runs:
the caller holds it for the whole call, during which the GIL is released.

The library is loaded once (ascendserve/_native/, built by native/build.sh); without it, or
with ASCENDSERVE_KV_NATIVE=0, the transports use their Python path (tcp.py), which moves the
same bytes. `counters()` are the library's own (bytes sent, received, calls, copied): tests
check the path is really taken.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy only where pages are: the proxy imports the channel, and this module
    import numpy as np

LIBRARY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "_native", "libascendserve_xfer.so")
ENV = "ASCENDSERVE_KV_NATIVE"  # "0": the Python path even where the library is built
ABI_VERSION = 2  # kv_xfer.cpp's kAbiVersion: a library of another version is not loaded
DEFAULT_IDLE_S = 300.0  # a socket without a timeout still gets one
MIN_RATE = 10e6  # bytes/s: a call's whole budget is its idle limit plus its bytes at this rate
HEADER_CAP = 8 + 64 * 1024  # a frame's prefix and its largest header (protocol/frames.py)

_OK, _OTHER_HEADER, _CLOSED, _TIMEOUT, _OS_ERROR, _BAD_ARGS = 0, 1, -1, -2, -3, -4
_lock = threading.Lock()
_lib = None
_tried = False
_why_not = "not loaded yet"


class _Spec(ctypes.Structure):
    """kv_xfer.cpp's AsvSpec."""

    _fields_ = [("bases", ctypes.c_void_p), ("n_bases", ctypes.c_int64), ("blocks", ctypes.c_void_p),
                ("n_blocks", ctypes.c_int64), ("block_stride", ctypes.c_int64), ("offsets", ctypes.c_void_p),
                ("n_offsets", ctypes.c_int64), ("run", ctypes.c_int64), ("lens", ctypes.c_void_p)]


@dataclass(eq=False)
class Runs:
    """Bytes to move, in transfer order (see the module's doc). `keep`: what the addresses point
    into, held for as long as these runs are."""

    bases: np.ndarray  # uint64
    blocks: np.ndarray | None = None  # int64 (structured)
    block_stride: int = 0
    offsets: np.ndarray | None = None  # int64 (structured)
    run: int = 0
    lens: np.ndarray | None = None  # uint64 (explicit buffers)
    keep: object = None

    @classmethod
    def structured(cls, bases, blocks, block_stride: int, offsets, run: int, keep=None) -> "Runs":
        import numpy as np

        return cls(np.asarray(bases, dtype=np.uint64), np.ascontiguousarray(blocks, dtype=np.int64),
                   int(block_stride), np.asarray(offsets, dtype=np.int64), int(run), keep=keep)

    @classmethod
    def buffers(cls, views, writable: bool) -> "Runs | None":
        """Explicit runs over contiguous byte buffers (memoryviews, numpy arrays); None when one
        is not contiguous, or read-only where the bytes are to be written."""
        import numpy as np

        arrays, addrs, lens = [], [], []
        for v in views:
            m = v if isinstance(v, memoryview) else memoryview(v)
            if not m.c_contiguous or (writable and m.readonly):  # (an F-order view cannot be cast)
                return None
            a = np.frombuffer(m.cast("B") if m.format != "B" or m.ndim != 1 else m, dtype=np.uint8)
            if a.size:
                arrays.append(a)
                addrs.append(a.ctypes.data)
                lens.append(a.size)
        return cls(np.asarray(addrs, dtype=np.uint64), lens=np.asarray(lens, dtype=np.uint64), keep=arrays)

    @property
    def nbytes(self) -> int:
        if self.lens is not None:
            return int(self.lens.sum())
        return len(self.bases) * len(self.blocks) * len(self.offsets) * self.run

    def spec(self) -> _Spec:
        def ptr(a):
            return None if a is None or not len(a) else a.ctypes.data

        if self.lens is not None:
            return _Spec(ptr(self.bases), len(self.bases), None, 0, 0, None, 0, 0, ptr(self.lens))
        return _Spec(ptr(self.bases), len(self.bases), ptr(self.blocks), len(self.blocks), self.block_stride,
                     ptr(self.offsets), len(self.offsets), self.run, None)


def load(path: str | None = None) -> bool:
    """Load the library (default LIBRARY) once; False, with `why_not()`, if it cannot load."""
    global _lib, _tried, _why_not
    with _lock:
        if _lib is not None or (_tried and path is None):
            return _lib is not None
        _tried = True
        path = path or LIBRARY
        try:
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path} not found (build it: native/build.sh)")
            lib = ctypes.CDLL(path)  # CDLL, not PyDLL: every call releases the GIL
            if lib.asv_xfer_abi_version() != ABI_VERSION:
                raise OSError(f"{path} has ABI {lib.asv_xfer_abi_version()}, this code wants {ABI_VERSION}")
            i64, vp = ctypes.c_int64, ctypes.c_void_p
            lib.asv_xfer_move.argtypes = [ctypes.c_int, ctypes.c_int, vp, i64, ctypes.POINTER(_Spec), i64, i64,
                                          ctypes.POINTER(i64), ctypes.c_char_p, i64]
            lib.asv_xfer_fetch.argtypes = [ctypes.c_int, vp, i64, vp, i64, vp, i64, ctypes.POINTER(i64),
                                           ctypes.POINTER(_Spec), i64, i64, ctypes.POINTER(i64), ctypes.c_char_p,
                                           i64]
            shm = [ctypes.c_int, ctypes.POINTER(_Spec), vp, i64, vp, i64, vp, vp, i64, vp, i64, ctypes.POINTER(i64)]
            lib.asv_xfer_shm_serve.argtypes = [*shm, i64, i64, ctypes.c_char_p, i64]
            lib.asv_xfer_shm_fetch.argtypes = [*shm, ctypes.POINTER(i64), i64, i64, ctypes.c_char_p, i64]
            for fn in (lib.asv_xfer_move, lib.asv_xfer_fetch, lib.asv_xfer_shm_serve, lib.asv_xfer_shm_fetch):
                fn.restype = ctypes.c_int
            lib.asv_xfer_counters.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
            _lib, _why_not = lib, ""
        except (OSError, AttributeError) as exc:
            _why_not = f"{type(exc).__name__}: {exc}"
        _log(path)
        return _lib is not None


def _log(path: str) -> None:
    from ascendserve.logging import log_library

    log_library("ascendserve.kv.native", _lib is not None, path, "KV transfer I/O: native (off the GIL)",
                "KV transfer I/O: Python sockets", _why_not)


def enabled() -> bool:
    """Whether the transports move pages through the library (loads it on first use)."""
    if os.environ.get(ENV, "").strip() == "0":
        return False
    return _lib is not None or load()


def why_not() -> str:
    return _why_not


def counters() -> dict[str, int]:
    """The library's own counts since it was loaded: bytes sent, bytes received, calls, bytes
    copied between pages and a shared-memory segment."""
    if _lib is None:
        return {"sent": 0, "received": 0, "calls": 0, "copied": 0}
    out = (ctypes.c_uint64 * 4)()
    _lib.asv_xfer_counters(out)
    return {"sent": out[0], "received": out[1], "calls": out[2], "copied": out[3]}


def _limits(sock: socket.socket, nbytes: int) -> tuple[int, int]:
    idle = sock.gettimeout()
    idle = DEFAULT_IDLE_S if idle is None or idle <= 0 else idle
    return max(1, int(idle * 1000)), int((2 * idle + nbytes / MIN_RATE) * 1000)


def _raise(rc: int, err: ctypes.Array) -> None:
    msg = err.value.decode(errors="replace") or f"KV transfer failed ({rc})"
    if rc == _CLOSED:
        raise ConnectionError(msg)
    if rc == _TIMEOUT:
        raise TimeoutError(msg)
    if rc == _BAD_ARGS:
        raise ValueError(msg)
    raise OSError(msg)


def _fd(sock: socket.socket) -> int:
    fd = sock.fileno()
    if fd < 0:
        raise OSError("the socket is closed")
    return fd


def move(sock: socket.socket, runs: Runs, send: bool, prefix: bytes = b"") -> int:
    """Send `prefix` then `runs`' bytes on `sock`, or receive exactly `runs`' bytes from it, with
    the GIL released throughout. Returns the bytes moved; raises ConnectionError (peer closed,
    short payload), TimeoutError (stalled, or past the call's budget) or OSError."""
    if prefix and not send:
        raise ValueError("a prefix is sent, never received")
    nbytes = runs.nbytes + len(prefix)
    idle_ms, total_ms = _limits(sock, nbytes)
    done, err = ctypes.c_int64(0), ctypes.create_string_buffer(256)
    spec = runs.spec()
    rc = _lib.asv_xfer_move(_fd(sock), int(send), prefix or None, len(prefix), ctypes.byref(spec), idle_ms,
                            total_ms, ctypes.byref(done), err, len(err))
    if rc != _OK:
        _raise(rc, err)
    return done.value


def fetch(sock: socket.socket, request: bytes, expect: bytes, runs: Runs) -> bytes | None:
    """D's half of a READ, GIL released throughout: send `request` (the READ frame), read the
    answer's frame header and, when it is byte for byte `expect` (the DATA header of the
    expected payload), the payload into `runs`: None. Any other header (ERR, another size,
    another encoding): its prefix and header bytes, no payload byte read (the caller decodes
    them, protocol/frames.py). Raises as `move`."""
    nbytes = runs.nbytes + len(request)
    idle_ms, total_ms = _limits(sock, nbytes)
    header, header_len = ctypes.create_string_buffer(HEADER_CAP), ctypes.c_int64(0)
    done, err = ctypes.c_int64(0), ctypes.create_string_buffer(256)
    spec = runs.spec()
    rc = _lib.asv_xfer_fetch(_fd(sock), request, len(request), expect, len(expect), header, HEADER_CAP,
                             ctypes.byref(header_len), ctypes.byref(spec), idle_ms, total_ms, ctypes.byref(done),
                             err, len(err))
    return _header_or_none(rc, header, header_len, err)


def _header_or_none(rc: int, header, header_len, err) -> bytes | None:
    """A call's outcome: None when it went as expected, the bytes of a header other than the
    expected one (for the caller to decode), or the error it raises."""
    if rc == _OK:
        return None
    if rc == _OTHER_HEADER:
        return header.raw[:header_len.value]
    _raise(rc, err)


# ---- shm: pages through a shared-memory segment, frames through the socket ------------------------
def _frames(layers: int) -> tuple[bytes, "ctypes.Array"]:
    """The LAYER frames of layers 0..layers-1 back to back, and where each ends."""
    from ascendserve.protocol.frames import encode

    parts = [encode({"type": "LAYER", "layer": i}) for i in range(layers)]
    ends = (ctypes.c_int64 * max(1, layers))()
    total = 0
    for i, part in enumerate(parts):
        total += len(part)
        ends[i] = total
    return b"".join(parts), ends


def _fits(runs: Runs, segment_len: int) -> None:
    if runs.nbytes > segment_len:  # the library refuses it too: nothing is copied past the segment
        raise ValueError(f"a read of {runs.nbytes} bytes does not fit a segment of {segment_len}")


def shm_serve(sock: socket.socket, runs: Runs, segment: int, segment_len: int, done: bytes) -> bytes | None:
    """P's side of an shm READ after its SHM frame, GIL released throughout: for each layer (a
    base of `runs`, layer-major), its pages gathered into the segment at `segment` (an address,
    `segment_len` bytes there, at least runs.nbytes) and its LAYER frame sent; then D's answer
    read. None when it was byte for byte `done`; else its prefix and header bytes for the
    caller to decode."""
    _fits(runs, segment_len)
    frames_, ends = _frames(len(runs.bases))
    idle_ms, total_ms = _limits(sock, runs.nbytes)
    header, header_len = ctypes.create_string_buffer(HEADER_CAP), ctypes.c_int64(0)
    err = ctypes.create_string_buffer(256)
    spec = runs.spec()
    rc = _lib.asv_xfer_shm_serve(_fd(sock), ctypes.byref(spec), segment, segment_len, frames_, len(frames_), ends,
                                 done, len(done), header, HEADER_CAP, ctypes.byref(header_len), idle_ms, total_ms,
                                 err, len(err))
    return _header_or_none(rc, header, header_len, err)


def shm_fetch(sock: socket.socket, runs: Runs, segment: int, segment_len: int,
              done: bytes) -> tuple[int, bytes] | None:
    """D's side after the SHM frame, GIL released throughout: for each layer its LAYER frame read
    and its pages scattered from the segment at `segment` (`segment_len` bytes mapped there) into
    `runs`' base of that layer; then `done` sent. None when every layer came as expected; else
    (layer, the frame's bytes) of the first frame that differed (nothing of that layer copied)
    for the caller to go on with."""
    _fits(runs, segment_len)
    frames_, ends = _frames(len(runs.bases))
    idle_ms, total_ms = _limits(sock, runs.nbytes)
    header, header_len = ctypes.create_string_buffer(HEADER_CAP), ctypes.c_int64(0)
    layers_done, err = ctypes.c_int64(0), ctypes.create_string_buffer(256)
    spec = runs.spec()
    rc = _lib.asv_xfer_shm_fetch(_fd(sock), ctypes.byref(spec), segment, segment_len, frames_, len(frames_), ends,
                                 done, len(done), header, HEADER_CAP, ctypes.byref(header_len),
                                 ctypes.byref(layers_done), idle_ms, total_ms, err, len(err))
    other = _header_or_none(rc, header, header_len, err)
    return None if other is None else (layers_done.value, other)
