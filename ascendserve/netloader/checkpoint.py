"""A model directory's safetensors weights as named byte ranges, and who holds them.

    index = CheckpointIndex.scan("/models/M")     # parses headers only; no torch
    source = MappedSource(index)                   # bytes through the page cache (engine seed)
    source = MemorySource(index)                   # bytes read into RAM once (elastic-server)

The manifest a seed sends is this index: tensor name, dtype, shape, byte
size and the CRC32C of the bytes (wire.py), plus the model's identity (a
digest of its config.json), so a joiner can refuse another model before any
data moves.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ascendserve.netloader import wire
from ascendserve.protocol.frames import send_blocks

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
# safetensors dtype -> bytes per element (what a receiver needs to size a buffer)
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


class CheckpointError(Exception):
    """The model directory cannot be served: no weights, or a malformed file."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors spelling: F32, BF16, ...
    shape: tuple[int, ...]
    nbytes: int
    crc32c: int
    file: str
    offset: int  # of the first byte in `file`


def identity(model_dir: str | os.PathLike) -> dict:
    """What makes two model directories the same model: their config.json, canonicalised."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return {"config_sha256": hashlib.sha256(canonical).hexdigest(),
            "architectures": list(config.get("architectures") or []),
            "model_type": str(config.get("model_type", ""))}


def read_header(path: Path) -> tuple[int, dict]:
    """(offset of the data section, header map) of one safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: truncated safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header of {length} bytes")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise CheckpointError(f"{path}: bad header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a map")
    return 8 + length, header


class CheckpointIndex:
    def __init__(self, model_dir: str, entries: list[TensorEntry], ident: dict):
        self.model_dir = model_dir
        self.entries = entries
        self.identity = ident
        self.total_bytes = sum(e.nbytes for e in entries)

    @classmethod
    def scan(cls, model_dir: str | os.PathLike) -> "CheckpointIndex":
        root = Path(model_dir)
        try:
            wire.require_checksum()
        except wire.ChecksumUnavailable as exc:
            raise CheckpointError(str(exc)) from None
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{root}: no *.safetensors weights to serve")
        entries = []
        for path in files:
            data_start, header = read_header(path)
            size = path.stat().st_size
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                for name, meta in sorted(header.items()):
                    if name == "__metadata__":
                        continue
                    try:
                        begin, end = (int(x) for x in meta["data_offsets"])
                        shape = tuple(int(x) for x in meta["shape"])
                        dtype = str(meta["dtype"])
                    except (KeyError, TypeError, ValueError):
                        raise CheckpointError(f"{path}: bad entry {name!r}") from None
                    if dtype not in DTYPE_BYTES or not 0 <= begin <= end or data_start + end > size:
                        raise CheckpointError(f"{path}: entry {name!r} out of bounds or of unknown dtype {dtype}")
                    crc = wire.crc32c(memoryview(m)[data_start + begin:data_start + end])
                    entries.append(TensorEntry(name, dtype, shape, end - begin, crc, str(path), data_start + begin))
        return cls(str(root), entries, identity(root))

    def manifest(self) -> list[dict]:
        return [{"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "nbytes": e.nbytes,
                 wire.CHECKSUM: e.crc32c}
                for e in self.entries]


class MappedSource:
    """Serves bytes straight from the files (the page cache): an engine's own checkpoint."""

    def __init__(self, index: CheckpointIndex):
        self.index = index
        self._files = {path: open(path, "rb") for path in {e.file for e in index.entries}}

    def send(self, sock, entry: TensorEntry, offset: int = 0, count: int | None = None) -> None:
        """`count` bytes of the tensor from `offset` (all of it by default), as do MemorySource's."""
        count = entry.nbytes - offset if count is None else count
        # socket.sendfile: the kernel copies from the page cache, and it honours the socket's
        # timeout (a bare os.sendfile on a socket with a timeout fails with EAGAIN once the
        # send buffer is full). It reads at an explicit offset, so streams may share the file.
        # Nothing to send sends nothing (sendfile refuses count=0 with a ValueError, which
        # ended the connection's thread)
        if not count:
            return
        sent = sock.sendfile(self._files[entry.file], offset=entry.offset + offset, count=count)
        if sent != count:
            raise ConnectionError(f"sent {sent} of {count} bytes of {entry.name} (file truncated?)")

    def close(self) -> None:
        for f in self._files.values():
            f.close()


class MemorySource:
    """Holds every byte in this process's memory: the elastic-server, independent of the page cache."""

    def __init__(self, index: CheckpointIndex):
        self.index = index
        self._bytes: dict[str, memoryview] = {}
        for path in sorted({e.file for e in index.entries}):
            with open(path, "rb") as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(buf)
            self._bytes[path] = memoryview(buf)

    def view(self, entry: TensorEntry) -> memoryview:
        return self._bytes[entry.file][entry.offset:entry.offset + entry.nbytes]

    def send(self, sock, entry: TensorEntry, offset: int = 0, count: int | None = None) -> None:
        view = self.view(entry)
        send_blocks(sock, view[offset:] if count is None else view[offset:offset + count])

    def close(self) -> None:
        self._bytes.clear()


def seed_registration(config) -> dict:
    """The registry fields announcing an instance's seed (none when it serves no weights)."""
    if not (config.netloader.serve or config.role == "elastic-server"):
        return {}
    host = config.cluster.advertise_host
    return {"seed": f"[{host}]:{config.netloader.port}" if ":" in host else f"{host}:{config.netloader.port}",
            "seed_model": identity(config.model.path)["config_sha256"]}
