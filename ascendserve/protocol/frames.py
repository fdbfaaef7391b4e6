"""Length-prefixed frames for the internal data sockets (KV side channel, later NetLoader).

    b"ASF1" | u32 big-endian header length | msgpack header (a map) | payload bytes

The header says how many raw payload bytes follow (`"payload": n`, default
0). Decoding is defensive: wrong magic, a header over MAX_HEADER bytes, a
header that is not a map, or a payload over the reader's limit raise
FrameError, a typed protocol error. msgpack only; never pickle.
"""

from __future__ import annotations

import socket
import struct

import msgspec

from ascendserve.protocol.wire import decode_msgpack

MAGIC = b"ASF1"
PREFIX = struct.Struct(">4sI")
MAX_HEADER = 64 * 1024


class FrameError(Exception):
    """The peer sent something that is not a valid frame."""


def encode(header: dict, payload_len: int = 0) -> bytes:
    if payload_len:
        header = {**header, "payload": payload_len}
    body = msgspec.msgpack.encode(header)
    if len(body) > MAX_HEADER:
        raise FrameError(f"header of {len(body)} bytes exceeds {MAX_HEADER}")
    return PREFIX.pack(MAGIC, len(body)) + body


def decode_header(prefix: bytes, body: bytes) -> dict:
    """Parse a frame given its 8-byte prefix and its header bytes."""
    magic, _ = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}")
    try:
        header = decode_msgpack(body)
    except msgspec.DecodeError as exc:
        raise FrameError(f"undecodable header: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise FrameError("header must be a map with a string 'type'")
    payload = header.get("payload", 0)
    if not isinstance(payload, int) or isinstance(payload, bool) or payload < 0:
        raise FrameError(f"bad payload length {payload!r}")
    return header


def header_length(prefix: bytes) -> int:
    magic, length = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}")
    if length > MAX_HEADER:
        raise FrameError(f"header length {length} exceeds {MAX_HEADER}")
    return length


def recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> bytes | None:
    """Read exactly n bytes (into `into` when given). ConnectionError on EOF."""
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:n], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return None if into is not None else bytes(buf)


def parse_frame(raw: bytes, max_payload: int) -> dict:
    """`read_frame` of a frame's prefix and header already read (the native data path hands
    back the ones it did not expect)."""
    if len(raw) < PREFIX.size:
        raise FrameError("truncated frame prefix")
    if len(raw) != PREFIX.size + header_length(raw[:PREFIX.size]):
        raise FrameError("truncated frame header")
    header = decode_header(raw[:PREFIX.size], raw[PREFIX.size:])
    if header.get("payload", 0) > max_payload:
        raise FrameError(f"payload of {header['payload']} bytes exceeds {max_payload}")
    return header


def read_frame(sock: socket.socket, max_payload: int) -> dict:
    """Read one frame's header; the caller reads `header["payload"]` bytes after."""
    prefix = recv_exact(sock, PREFIX.size)
    body = recv_exact(sock, header_length(prefix))
    header = decode_header(prefix, body)
    if header.get("payload", 0) > max_payload:
        raise FrameError(f"payload of {header['payload']} bytes exceeds {max_payload}")
    return header


def send_blocks(sock: socket.socket, data, block: int = 1 << 20) -> None:
    """sock.sendall in blocks of `block` bytes, so the socket's timeout bounds each block (a deadline on
    silence): one sendall's timeout bounds the whole call (Python >= 3.5), which a large payload on a
    slow link outlasts while still moving."""
    view = memoryview(data).cast("B")
    for at in range(0, len(view), block):
        sock.sendall(view[at:at + block])


def send_frame(sock: socket.socket, header: dict, payload: memoryview | bytes | None = None) -> None:
    n = len(payload) if payload is not None else 0
    sock.sendall(encode(header, n))
    if n:
        sock.sendall(payload)
