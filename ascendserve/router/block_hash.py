"""vLLM 0.32 prefix-cache block hashes, computed on the proxy byte-exactly as the engine does.

vLLM hashes each full block as ``hash_fn((parent, tuple(block_token_ids), extra_keys))``, chained
from ``NONE_HASH = hash_fn(seed)`` (kv_cache_utils.hash_block_tokens); hash_fn is sha256 or xxh3_128
of ``pickle.dumps(x, protocol=5)`` ("sha256", "xxhash") or of ``cbor2.dumps(x, canonical=True)``
("sha256_cbor", "xxhash_cbor"). The proxy matches these with the hashes in vLLM's KV events.

The serializers are hand-written because product code never imports pickle or its family
(tests/unit/test_no_pickle.py) and the control plane never imports torch or vLLM. They only
serialize (nothing here deserializes), and only what plain text requests hash: a str (the seed)
and ``(bytes, tuple[int, ...], None)`` (no LoRA, multimodal, cache_salt or prompt embeds), token
ids being ints in [0, 2**64). tests/unit/test_block_hash.py pins byte equality with pickle (the C
pickler of CPython 3.11, 64 KiB frame splits included) and cbor2, and hash equality with vLLM.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from functools import partial
from operator import itemgetter

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_SEED = "vllm-none-hash"  # vLLM's DEFAULT_NONE_HASH_SEED
BlockKey = tuple[bytes, tuple[int, ...], None]
_MASK64 = (1 << 64) - 1
_FRAME = 1 << 16  # the C pickler ends a frame at a save() once it holds >= 64 KiB
_TUPLE_N = (b")", b"\x85", b"\x86", b"\x87")  # EMPTY_TUPLE, TUPLE1..3; longer: MARK ... TUPLE
_Op = bytes | tuple[bytes, bytes] | None


def _pickle_int(x: int) -> bytes:  # a negative x is a ValueError from bytes()
    if x < 0x100:
        return b"K" + bytes((x,))  # BININT1
    if x < 0x10000:
        return b"M" + x.to_bytes(2, "little")  # BININT2
    if x < 0x80000000:
        return b"J" + x.to_bytes(4, "little")  # BININT (signed)
    n = (x.bit_length() >> 3) + 1  # two's complement, room for the sign bit
    return (b"\x8a" + bytes((n,)) if n < 256 else b"\x8b" + n.to_bytes(4, "little")) + x.to_bytes(n, "little")


def _frame(ops: list[_Op]) -> bytes:
    """PROTO 5 and ops in FRAMEs as the C pickler lays them out: None is a save() start, committing
    a frame of >= 64 KiB; a (head, payload) of >= 64 KiB goes unframed; frames < 4 bytes get no FRAME."""
    out, frame, size = [b"\x80\x05"], [], 0

    def commit() -> None:
        out.extend((b"\x95", size.to_bytes(8, "little"), *frame) if size >= 4 else frame)

    for op in ops:
        if isinstance(op, bytes):
            frame.append(op)
            size += len(op)
        elif op is not None and len(op[1]) < _FRAME:
            frame.extend(op)
            size += len(op[0]) + len(op[1])
        elif op is not None or size >= _FRAME:
            commit()
            frame, size = [], 0
            out.extend(op or ())
    commit()
    return b"".join(out)


def pickle_bytes(obj: str | BlockKey) -> bytes:
    """``pickle.dumps(obj, protocol=5)`` for a str or a ``(bytes, tuple[int, ...], None)``."""
    if isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")  # SHORT_BINUNICODE/BINUNICODE, MEMOIZE, STOP
        head = b"\x8c" + bytes((len(data),)) if len(data) < 256 else b"X" + len(data).to_bytes(4, "little")
        return _frame([None, (head, data), b"\x94."])
    parent, tokens, extra = obj
    if extra is not None:
        raise ValueError("only extra_keys=None (plain text requests) is supported")
    head = b"C" + bytes((len(parent),)) if len(parent) < 256 else b"B" + len(parent).to_bytes(4, "little")
    ops: list[_Op] = [None, (head, parent), b"\x94", None]  # SHORT_BINBYTES/BINBYTES, MEMOIZE
    if len(tokens) > 3:
        ops.append(b"(")
    for t in tokens:
        ops += (None, _pickle_int(t))
    ops.append(b"t\x94" if len(tokens) > 3 else _TUPLE_N[len(tokens)] + (b"\x94" if tokens else b""))
    return _frame(ops + [None, b"N\x87\x94."])  # NONE, TUPLE3, MEMOIZE, STOP


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes((major << 5 | n,))
    size = 1 if n < 0x100 else 2 if n < 0x10000 else 4 if n < 0x100000000 else 8  # OverflowError from 2**64
    return bytes((major << 5 | 23 + size.bit_length(),)) + n.to_bytes(size, "big")


def cbor_bytes(obj: str | BlockKey) -> bytes:
    """``cbor2.dumps(obj, canonical=True)`` for a str or a ``(bytes, tuple[int, ...], None)``."""
    if isinstance(obj, str):
        data = obj.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    parent, tokens, extra = obj
    if extra is not None:
        raise ValueError("only extra_keys=None (plain text requests) is supported")
    return b"".join((b"\x83", _cbor_head(2, len(parent)), parent, _cbor_head(4, len(tokens)),
                     *(_cbor_head(0, t) for t in tokens), b"\xf6"))


_TABLE_MAX = 1 << 18  # per-id encodings kept below this id (every common vocabulary fits)
_tables: dict[bool, list[bytes]] = {}


def _encode(ids: Sequence[int], cbor: bool) -> Sequence[bytes]:
    """Each id's encoding, from a table grown copy-on-grow (thread-safe) up to _TABLE_MAX."""
    enc = partial(_cbor_head, 0) if cbor else _pickle_int
    table = _tables.get(cbor) or _tables.setdefault(cbor, [enc(i) for i in range(1 << 16)])
    if ids and min(ids) < 0:  # a negative index would silently wrap around the table
        raise ValueError("token ids must be non-negative ints")
    try:
        return itemgetter(*ids)(table) if len(ids) > 1 else [table[x] for x in ids]  # one C loop
    except IndexError:
        top = min((max(ids) | 0x3FFF) + 1, _TABLE_MAX)
    if top > len(table):
        table = _tables[cbor] = table + [enc(i) for i in range(len(table), top)]
    return [table[x] if x < top else enc(x) for x in ids]


def _known(algo: str) -> str:
    if algo not in ALGOS:
        raise ValueError(f"unknown prefix-cache hash algorithm {algo!r}; valid: {', '.join(ALGOS)}")
    return algo


def seed_for(algo: str, pythonhashseed: str | None) -> str | None:
    """The NONE_HASH seed vLLM resolves (resolve_none_hash_seed) from the engine's PYTHONHASHSEED;
    None when unknowable: xxhash* without PYTHONHASHSEED draws a random per-process seed."""
    if pythonhashseed is not None and _known(algo):
        return pythonhashseed
    return None if _known(algo).startswith("xxhash") else DEFAULT_SEED


def event_key(h: bytes | int) -> int:
    """A KV event's block hash (bytes, or the int of VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) as the
    64-bit key BlockHasher.keys() gives (vLLM's maybe_convert_block_hash)."""
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(h, "big") & _MASK64
    if isinstance(h, int) and not isinstance(h, bool):
        return h & _MASK64
    raise TypeError(f"a block hash is bytes or int, got {type(h).__name__}")


class BlockHasher:
    """vLLM's chained full-block hashes for one algorithm and NONE_HASH seed."""

    def __init__(self, algo: str, seed: str) -> None:
        self.algo, self._cbor = _known(algo), algo.endswith("_cbor")
        if not isinstance(seed, str):  # seed_for() gives None where vLLM's seed is random
            raise TypeError(f"the NONE_HASH seed is a str, got {seed!r}: unknowable for a random seed")
        if algo.startswith("sha256"):
            self._digest: Callable[[bytes], bytes] = lambda data: hashlib.sha256(data).digest()
        else:
            try:
                from xxhash import xxh3_128_digest
            except ImportError as e:
                raise ImportError(f"prefix-cache hash {algo!r} needs xxhash (with xxh3_128_digest): "
                                  "pip install xxhash") from e
            self._digest = xxh3_128_digest
        self.none_hash: bytes = self._digest(cbor_bytes(seed) if self._cbor else pickle_bytes(seed))

    def hashes(self, token_ids: Sequence[int], block_size: int) -> list[bytes]:
        """The hash of every full block of token_ids (a partial last block is not hashed)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        end = len(token_ids) - len(token_ids) % block_size
        encs, parent, out = _encode(token_ids[:end], self._cbor), self.none_hash, []
        if self._cbor:  # array(3): bytes parent, array(n) of uints, null
            head, mid = b"\x83" + _cbor_head(2, len(parent)), _cbor_head(4, block_size)
            tail, fixed = b"\xf6", 0
        else:  # PROTO FRAME, SHORT_BINBYTES parent MEMOIZE, [MARK] ints TUPLEn MEMOIZE, NONE TUPLE3 ...
            head, mid = b"C" + bytes((len(parent),)), b"\x94(" if block_size > 3 else b"\x94"
            tail = (b"t" if block_size > 3 else _TUPLE_N[block_size]) + b"\x94N\x87\x94."
            fixed = len(head) + len(parent) + len(mid) + len(tail)
        for i in range(0, end, block_size):
            toks = b"".join(encs[i:i + block_size])
            if self._cbor:
                data = b"".join((head, parent, mid, toks, tail))
            elif (size := fixed + len(toks)) - 4 < _FRAME:  # no save() starts on a full frame: one frame
                data = b"".join((b"\x80\x05\x95", size.to_bytes(8, "little"), head, parent, mid, toks, tail))
            else:  # the last save() (None's) would start a new frame
                data = pickle_bytes((parent, tuple(token_ids[i:i + block_size]), None))
            parent = self._digest(data)
            out.append(parent)
        return out

    def keys(self, token_ids: Sequence[int], block_size: int) -> list[int]:
        """hashes() as 64-bit ints: what KV events carry with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES."""
        return [int.from_bytes(h, "big") & _MASK64 for h in self.hashes(token_ids, block_size)]
