"""A small memcached client (text protocol) for the EC store, and the entry format.

One EC entry is a header plus value chunks, so items larger than the
server's item limit (`-I`, 1 MiB by default) still fit:

    asf-ec:<mm_hash>                  msgpack {v, dtype, shape, nbytes, chunk, n, nonce}
    asf-ec:<mm_hash>:<nonce>:<i>      bytes [i*chunk, (i+1)*chunk) of the item

Writers store the chunks first and the header last, so a reader that sees
the header finds its chunks (unless memcached evicted one since: a miss).
Every key carries an expiry: an entry whose writer died still goes away.

`Client` is blocking (vLLM worker threads); `AsyncClient` answers "which of
these hashes are stored" for the proxy. Neither imports numpy or torch.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from dataclasses import dataclass

import msgspec

from ascendserve.protocol.wire import decode_msgpack

PREFIX = "asf-ec:"
_HEADER_VERSION = 1
MAX_VALUE_BYTES = 1 << 30  # memcached's own largest item (-I 1024m)
MAX_HEADER_BYTES = 1 << 16  # an entry header is a few dozen bytes
# one encoder output (image or video embeddings); a reader allocates what the header declares
MAX_ENTRY_BYTES = 4 << 30


class StoreError(Exception):
    """The store could not be reached or answered nonsense (the message says which)."""


def header_key(mm_hash: str) -> str:
    return PREFIX + mm_hash


def chunk_key(mm_hash: str, nonce: str, i: int) -> str:
    return f"{PREFIX}{mm_hash}:{nonce}:{i}"


class Header(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    v: int
    dtype: str
    shape: list[int]
    nbytes: int
    chunk: int
    n: int
    nonce: str


def new_header(dtype: str, shape: tuple[int, ...], nbytes: int, chunk: int) -> Header:
    return Header(v=_HEADER_VERSION, dtype=dtype, shape=list(shape), nbytes=nbytes, chunk=chunk,
                  n=max(1, -(-nbytes // chunk)), nonce=os.urandom(4).hex())


def decode_header(raw: bytes) -> Header | None:
    try:
        h = decode_msgpack(raw, type=Header)
    except msgspec.DecodeError:
        return None
    if h.v != _HEADER_VERSION or not 0 < h.chunk <= MAX_VALUE_BYTES or not 0 <= h.nbytes <= MAX_ENTRY_BYTES:
        return None
    # what readers allocate and how many chunk keys they ask for follow from these: they must agree
    return h if h.n == max(1, -(-h.nbytes // h.chunk)) else None


@dataclass
class _Value:
    key: str
    size: int


def _value(line: bytes, limit: int = MAX_VALUE_BYTES) -> _Value:
    """A `VALUE <key> <flags> <bytes>` line; StoreError for anything else (never trust its length)."""
    parts = line.split()
    if len(parts) < 4 or parts[0] != b"VALUE" or not parts[3].isdigit() or int(parts[3]) > limit:
        raise StoreError(f"memcached get: {line[:100]!r}")
    return _Value(parts[1].decode(errors="replace"), int(parts[3]))


def parse_url(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("memcached://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"memcached address must be host:port, got {url!r}")
    return host.strip("[]"), int(port)


class Client:
    """Blocking client; one connection, reconnected after any error. Thread-safe (one lock)."""

    def __init__(self, url: str, timeout_s: float = 2.0):
        self.host, self.port = parse_url(url)
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock, self._buf = None, bytearray()

    def _conn(self) -> socket.socket:
        if self._sock is None:
            try:
                self._sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
            except OSError as exc:
                raise StoreError(f"memcached {self.host}:{self.port} unreachable: {exc}") from None
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._sock

    def _call(self, fn):
        with self._lock:
            # a kept connection may have died with a server restart since its last use: one fresh try
            for attempt in (0, 1):
                reused = self._sock is not None
                try:
                    return fn(self._conn())
                except (StoreError, OSError, ValueError) as exc:
                    self._drop()
                    if attempt == 0 and reused:
                        continue
                    if isinstance(exc, StoreError):
                        raise
                    raise StoreError(f"memcached {self.host}:{self.port}: {exc}") from None

    # ---- framing ---------------------------------------------------------------
    def _line(self, sock: socket.socket) -> bytes:
        while True:
            i = self._buf.find(b"\r\n")
            if i >= 0:
                line = bytes(self._buf[:i])
                del self._buf[: i + 2]
                return line
            chunk = sock.recv(65536)
            if not chunk:
                raise StoreError("memcached closed the connection")
            self._buf += chunk

    def _exact_into(self, sock: socket.socket, out: memoryview) -> None:
        take = min(len(self._buf), len(out))
        out[:take] = self._buf[:take]
        del self._buf[:take]
        got = take
        while got < len(out):
            n = sock.recv_into(out[got:])
            if not n:
                raise StoreError("memcached closed the connection")
            got += n

    def _skip(self, sock: socket.socket, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 16)))
        while n > 0:
            take = min(n, len(scratch))
            self._exact_into(sock, scratch[:take])
            n -= take

    def _skip_crlf(self, sock: socket.socket) -> None:
        crlf = bytearray(2)
        self._exact_into(sock, memoryview(crlf))
        if crlf != b"\r\n":
            raise StoreError("memcached: malformed value framing")

    # ---- commands ----------------------------------------------------------------
    def set(self, key: str, value: bytes | memoryview, exptime: int) -> bool:
        def run(sock: socket.socket) -> bool:
            data = memoryview(value).cast("B")
            sock.sendall(f"set {key} 0 {exptime} {len(data)}\r\n".encode())
            sock.sendall(data)
            sock.sendall(b"\r\n")
            reply = self._line(sock)
            if reply == b"STORED":
                return True
            if reply.startswith((b"SERVER_ERROR", b"NOT_STORED")):
                return False
            raise StoreError(f"memcached set: {reply[:100]!r}")
        return self._call(run)

    def get_many(self, keys: list[str], max_bytes: int = MAX_VALUE_BYTES) -> dict[str, bytes]:
        """Values by key; one over `max_bytes` counts as missing (and is read past, never held)."""
        out: dict[str, bytes] = {}

        def sink(value: _Value, sock: socket.socket) -> None:
            if value.size > max_bytes:
                return self._skip(sock, value.size)
            buf = bytearray(value.size)
            self._exact_into(sock, memoryview(buf))
            out[value.key] = bytes(buf)
        self._get(keys, sink)
        return out

    def get_into(self, targets: dict[str, memoryview]) -> set[str]:
        """Read each key's value into its buffer (sizes must match); returns the keys found."""
        found: set[str] = set()

        def sink(value: _Value, sock: socket.socket) -> None:
            dest = targets.get(value.key)
            if dest is None or len(dest) != value.size:
                return self._skip(sock, value.size)
            self._exact_into(sock, dest)
            found.add(value.key)
        self._get(list(targets), sink)
        return found

    def _get(self, keys: list[str], sink) -> None:
        if not keys:
            return

        def run(sock: socket.socket) -> None:
            for start in range(0, len(keys), 64):
                sock.sendall(("get " + " ".join(keys[start:start + 64]) + "\r\n").encode())
                while True:
                    line = self._line(sock)
                    if line == b"END":
                        break
                    sink(_value(line), sock)
                    self._skip_crlf(sock)
        self._call(run)

    def delete(self, key: str) -> bool:
        def run(sock: socket.socket) -> bool:
            sock.sendall(f"delete {key}\r\n".encode())
            return self._line(sock) == b"DELETED"
        return self._call(run)

    def stats(self) -> dict[str, str]:
        def run(sock: socket.socket) -> dict[str, str]:
            sock.sendall(b"stats\r\n")
            out = {}
            while (line := self._line(sock)) != b"END":
                _, k, v = line.decode().split(" ", 2)
                out[k] = v
            return out
        return self._call(run)

    def keys(self) -> list[str]:
        """Every live key, once (memcached's LRU crawler metadump); for tests and operators."""
        def run(sock: socket.socket) -> list[str]:
            from urllib.parse import unquote

            sock.sendall(b"lru_crawler metadump all\r\n")
            # one item per "\n"-terminated line, then END\r\n (or an error line)
            while not (self._buf.endswith(b"END\r\n") or self._buf.startswith((b"ERROR", b"CLIENT_ERROR", b"BUSY"))
                       and self._buf.endswith(b"\r\n")):
                chunk = sock.recv(65536)
                if not chunk:
                    raise StoreError("memcached closed the connection")
                self._buf += chunk
            text, self._buf = bytes(self._buf), bytearray()
            if not text.endswith(b"END\r\n"):
                raise StoreError(f"memcached metadump: {text[:100]!r}")
            # the crawler can list an item twice (it moved between LRU segments mid-crawl): each key once
            return list(dict.fromkeys(unquote(line.split()[0][4:].decode())
                                      for line in text.split(b"\n") if line.startswith(b"key=")))
        return self._call(run)


# ---- entries -----------------------------------------------------------------------
def put_entry(client: Client, mm_hash: str, data: memoryview, dtype: str, shape: tuple[int, ...],
              chunk: int, ttl_s: int) -> bool:
    """Store one item as chunks then header; False if the server refused a piece."""
    data = memoryview(data).cast("B")
    h = new_header(dtype, shape, len(data), chunk)
    for i in range(h.n):
        if not client.set(chunk_key(mm_hash, h.nonce, i), data[i * chunk:(i + 1) * chunk], ttl_s):
            for j in range(i):
                client.delete(chunk_key(mm_hash, h.nonce, j))
            return False
    return client.set(header_key(mm_hash), msgspec.msgpack.encode(h), ttl_s)


def get_header(client: Client, mm_hash: str) -> Header | None:
    raw = client.get_many([header_key(mm_hash)], MAX_HEADER_BYTES).get(header_key(mm_hash))
    return decode_header(raw) if raw is not None else None


def read_entry_into(client: Client, mm_hash: str, h: Header, out: memoryview) -> bool:
    """Read an item's chunks into `out` (h.nbytes long); False if a chunk is gone."""
    out = memoryview(out).cast("B")
    targets = {chunk_key(mm_hash, h.nonce, i): out[i * h.chunk: min(h.nbytes, (i + 1) * h.chunk)]
               for i in range(h.n)}
    return len(client.get_into(targets)) == h.n


def delete_entry(client: Client, mm_hash: str) -> None:
    raw = client.get_many([header_key(mm_hash)], MAX_HEADER_BYTES).get(header_key(mm_hash))
    client.delete(header_key(mm_hash))
    h = decode_header(raw) if raw is not None else None
    if h is not None:
        for i in range(h.n):
            client.delete(chunk_key(mm_hash, h.nonce, i))


class AsyncClient:
    """The proxy's view: which of these hashes have an entry. A fresh connection per call."""

    def __init__(self, url: str, timeout_s: float = 0.5):
        self.host, self.port = parse_url(url)
        self.timeout_s = timeout_s

    async def present(self, mm_hashes: list[str]) -> set[str]:
        if not mm_hashes:
            return set()
        return await asyncio.wait_for(self._present(mm_hashes), self.timeout_s)

    async def _present(self, mm_hashes: list[str]) -> set[str]:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError as exc:
            raise StoreError(f"memcached {self.host}:{self.port} unreachable: {exc}") from None
        try:
            keys = [header_key(h) for h in mm_hashes]
            writer.write(("get " + " ".join(keys) + "\r\n").encode())
            await writer.drain()
            found = set()
            while True:
                line = (await reader.readuntil(b"\r\n"))[:-2]
                if line == b"END":
                    return found
                value = _value(line, MAX_HEADER_BYTES)
                raw = await reader.readexactly(value.size + 2)
                if decode_header(raw[:-2]) is not None:
                    found.add(value.key.removeprefix(PREFIX))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise StoreError(f"memcached {self.host}:{self.port}: {exc}") from None
        finally:
            writer.close()
