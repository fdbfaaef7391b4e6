"""What a NetLoader seed and joiner must agree on: the wire version and the checksum.

Version 2 (this release): JOIN and JOIN_ACK carry `"version": 2`, the
manifest is the JOIN_ACK's payload, and every manifest entry carries
`"crc32c"`, the CRC32C (Castagnoli) of its bytes, from the `google-crc32c`
package (Apache-2.0; Google's crc32c library: SSE 4.2 / ARMv8 CRC
instructions, over 10 GB/s). Version 1 (earlier releases): no version
field, and `"crc32"` (zlib's CRC-32, under 1 GB/s) in the manifest.

Both sides refuse the other version rather than misread it: a seed answers
a JOIN without a version, or with another one, with a JOIN_NACK naming the
side to upgrade (an old joiner logs that reason and loads from disk); a
joiner refuses a JOIN_ACK without its version (an old seed) the same way,
a NetLoadError, so it tries the next seed and then the disk.
"""

from __future__ import annotations

try:
    import google_crc32c as _crc
except ImportError:  # a broken install: said clearly where a checksum is needed, never a slow stand-in
    _crc = None

WIRE_VERSION = 2
CHECKSUM = "crc32c"  # the manifest's checksum field since version 2
MISSING = ("the 'google-crc32c' package is not installed: NetLoader checksums every tensor with CRC32C "
           "(pip install 'google-crc32c>=1.5'; ascendserve depends on it, so reinstalling ascendserve brings it)")
NOT_C = ("the 'google-crc32c' package runs without its C extension (pure Python, far too slow for "
         "weights): reinstall it from a wheel for this platform (pip install --force-reinstall google-crc32c)")
# google_crc32c takes only buffers without a release hook (bytes, numpy arrays; not memoryview, bytearray
# or mmap) and keeps the GIL for anything but bytes: a tensor is checked a slice at a time, numpy views
# of its bytes (no copy), so the joiner's streams get the GIL between slices
SLICE = 4 << 20


class ChecksumUnavailable(RuntimeError):
    """The google-crc32c package is missing, or has no C extension."""


def require_checksum() -> None:
    """Raise ChecksumUnavailable without the package or its C extension."""
    if _crc is None:
        raise ChecksumUnavailable(MISSING)
    if _crc.implementation != "c":
        raise ChecksumUnavailable(NOT_C)


def crc32c(data) -> int:
    """CRC32C of a contiguous buffer (bytes, memoryview, mmap, numpy array), without copying it where
    numpy is installed (every engine); without numpy (an elastic-server installed on its own), a slice
    at a time copied into bytes, which google_crc32c checks with the GIL released."""
    require_checksum()
    if isinstance(data, bytes):
        return _crc.value(data)
    view = memoryview(data).cast("B")
    try:
        import numpy
    except ImportError:
        numpy = None
    crc = 0
    for at in range(0, len(view), SLICE):
        piece = view[at:at + SLICE]
        crc = _crc.extend(crc, numpy.frombuffer(piece, dtype=numpy.uint8) if numpy else bytes(piece))
    return crc


def _spoken(version) -> str:
    return "no version (version 1, CRC-32 checksums)" if version is None else f"version {version}"


def join_refusal(join: dict) -> str | None:
    """The JOIN_NACK reason for a joiner of another wire version (None: it speaks ours)."""
    version = join.get("version")
    if type(version) is int and version == WIRE_VERSION:
        return None
    if type(version) is not int and version is not None:
        return f"JOIN's version must be an integer, got {str(version)[:40]!r}"
    upgrade = "upgrade ascendserve on the joiner" if version is None or version < WIRE_VERSION \
        else "upgrade ascendserve on this seed"
    return (f"NetLoader wire version mismatch: the joiner speaks {_spoken(version)}, this seed speaks "
            f"version {WIRE_VERSION} (CRC32C checksums): {upgrade}")


def ack_refusal(ack: dict) -> str | None:
    """Why a joiner refuses this seed's JOIN_ACK as another wire version (None: it speaks ours)."""
    version = ack.get("version")
    if type(version) is int and version == WIRE_VERSION:
        return None
    if type(version) is not int and version is not None:
        return f"JOIN_ACK's version must be an integer, got {str(version)[:40]!r}"
    if version is None:
        manifest = ack.get("manifest")
        old = isinstance(manifest, list) and bool(manifest) and isinstance(manifest[0], dict) \
            and "crc32" in manifest[0]
        spoken = "version 1 (no version field" + (", a CRC-32 manifest)" if old else ")")
    else:
        spoken = f"version {version}"
    upgrade = "upgrade ascendserve on the seed" if version is None or version < WIRE_VERSION \
        else "upgrade ascendserve on this joiner"
    return (f"NetLoader wire version mismatch: the seed speaks {spoken}, this joiner needs version "
            f"{WIRE_VERSION} (CRC32C checksums): {upgrade}")


MAX_STREAMS = 16  # connections one joiner may split a transfer over
# The manifest travels as the JOIN_ACK's payload (msgpack), not in its header, whose frames.MAX_HEADER
# (64 KiB) a model of a few hundred tensors already exceeds; ~150 bytes a tensor, so this bounds it at
# about a million tensors (client.MAX_TENSORS)
MAX_MANIFEST_BYTES = 256 << 20


def plan(sizes: list[int], parts: int) -> list[list[tuple[int, int, int]]]:
    """The checkpoint split over `parts` streams: for each, its chunks (tensor index, offset, length) in order.

    Stream j carries bytes [total*j/parts, total*(j+1)/parts) of the tensors laid end to end, so a
    tensor may start on one stream and end on the next; an empty tensor rides on the stream where
    its position falls. Seed and joiner compute it alike from the manifest and GET's `parts`."""
    total = sum(sizes)
    bounds = [total * j // parts for j in range(parts + 1)]
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    pos, j = 0, 0
    for i, n in enumerate(sizes):
        if n == 0:
            while j < parts - 1 and pos >= bounds[j + 1]:
                j += 1
            out[j].append((i, 0, 0))
            continue
        done = 0
        while done < n:
            while pos + done >= bounds[j + 1]:
                j += 1
            take = min(n - done, bounds[j + 1] - (pos + done))
            out[j].append((i, done, take))
            done += take
        pos += n
    return out
