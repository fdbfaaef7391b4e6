"""The proxy's prefix-cache block hashes equal vLLM 0.32's, byte for byte.

ascendserve/router/block_hash.py serializes by hand (product code never imports pickle), so
these tests pin its bytes against pickle.dumps(protocol=5) and cbor2.dumps(canonical=True),
frame splits past 64 KiB included, and its hash chains against vLLM's own hash_block_tokens,
get_request_block_hasher and resolve_none_hash_seed, with PYTHONHASHSEED unset and set.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import pickletools
import random
import sys
import types

import cbor2
import pytest

from ascendserve.router import block_hash as bh
from ascendserve.router.block_hash import ALGOS, BlockHasher, cbor_bytes, event_key, pickle_bytes, seed_for

MASK64 = (1 << 64) - 1
EDGE_INTS = (0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40)
SEEDS = ("", "0", "a", "12345", "vllm-none-hash", "x" * 255, "x" * 256, "y" * 1000, "é",
         "種子-🌱" * 40, "ü" * 128)
PARENTS = (b"", b"\x00" * 32, bytes(range(32)), b"\xff" * 16, b"p" * 255, b"q" * 256)


def _pickle(obj) -> bytes:
    return pickle.dumps(obj, protocol=5)


def _cbor(obj) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def _frames(data: bytes) -> int:
    return sum(op.name == "FRAME" for op, _, _ in pickletools.genops(data))


def _ids(rng: random.Random, n: int, top: int = 200_000) -> list[int]:
    """Token ids spread over every encoding width: < 256, < 65536 and beyond."""
    return [rng.randrange(rng.choice((256, 65536, top))) for _ in range(n)]


def _ref_chain(algo: str, seed: str, tokens, block_size: int, digest=None) -> list[bytes]:
    """The chain computed with the real pickle / cbor2, independent of block_hash.py."""
    digest = digest or (lambda b: hashlib.sha256(b).digest())
    ser = _cbor if algo.endswith("_cbor") else _pickle
    parent, out = digest(ser(seed)), []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = digest(ser((parent, tuple(tokens[i:i + block_size]), None)))
        out.append(parent)
    return out


# --- serializer bytes ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_seed_bytes_equal_pickle_and_cbor2(seed):
    assert pickle_bytes(seed) == _pickle(seed)
    assert cbor_bytes(seed) == _cbor(seed)


def _block_keys():
    rng = random.Random(1)
    for parent in PARENTS:
        yield parent, (), None
        for v in EDGE_INTS:
            yield parent, (v,), None
            yield parent, (v, 7), None
            yield parent, (3, v, 70_000), None
        yield parent, EDGE_INTS, None
    for n in (1, 2, 3, 4, 16, 128, 1024, 4096):
        yield rng.randbytes(32), tuple(_ids(rng, n)), None


@pytest.mark.parametrize("key", list(_block_keys()), ids=lambda k: f"{len(k[0])}b-{len(k[1])}t")
def test_block_key_bytes_equal_pickle_and_cbor2(key):
    assert pickle_bytes(key) == _pickle(key)
    assert cbor_bytes(key) == _cbor(key)


def test_pickle_frames_split_past_64k_like_the_c_pickler():
    rng = random.Random(2)
    # 36 bytes before the ints (SHORT_BINBYTES, MEMOIZE, MARK), 6 after (TUPLE ... STOP): 13099
    # BININTs and a BININT1 put 65535 bytes before None's save(), so one frame; one byte more
    # (a BININT2) and that save() starts on a full 64 KiB frame, so None opens a second.
    one = (b"h" * 32, (70_000,) * 13_099 + (1,), None)
    two = (b"h" * 32, (70_000,) * 13_099 + (300,), None)
    assert (_frames(_pickle(one)), _frames(_pickle(two))) == (1, 2)
    cases = [one, two, (b"h" * 32, tuple(range(65_536, 65_536 + 40_000)), None)]
    cases += [(rng.randbytes(32), tuple(_ids(rng, n, 2**31 + 5)), None) for n in (13_000, 13_100, 13_200, 20_000)]
    cases += [(b"b" * n, (1, 2, 3, 4), None) for n in (65_535, 65_536, 70_000)]  # big payloads: unframed
    cases += [(b"b" * 65_536, (), None), "s" * 65_535, "s" * 65_536, "s" * 70_000]
    for obj in cases:
        assert pickle_bytes(obj) == _pickle(obj)
    assert _frames(_pickle(cases[2])) == 4 and _frames(_pickle("s" * 65_536)) == 0


def test_large_and_odd_ints():
    for v in (2**63, 2**64 - 1, 2**64, 2**2100):  # LONG1, and LONG4 past 255 bytes
        assert pickle_bytes((b"p", (v,), None)) == _pickle((b"p", (v,), None))
    assert cbor_bytes((b"p", (2**64 - 1,), None)) == _cbor((b"p", (2**64 - 1,), None))
    with pytest.raises(OverflowError):  # the documented bound: cbor2 would write a bignum tag
        cbor_bytes((b"p", (2**64,), None))
    for serialize in (pickle_bytes, cbor_bytes):
        with pytest.raises(ValueError):
            serialize((b"p", (1, -1), None))
        with pytest.raises(ValueError, match="extra_keys"):
            serialize((b"p", (1,), ("lora",)))


# --- BlockHasher against the real serializers ---------------------------------------------------

@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_hashes_equal_reference_chain(algo, monkeypatch):
    monkeypatch.setattr(bh, "_tables", {})  # start from the 64 Ki table, so growth is exercised
    rng = random.Random(algo)
    for block_size in (1, 2, 3, 4, 16, 128, 1024, 4096):
        tokens = _ids(rng, 3 * block_size + block_size // 2 + 1)
        assert BlockHasher(algo, "vllm-none-hash").hashes(tokens, block_size) \
            == _ref_chain(algo, "vllm-none-hash", tokens, block_size)
    # ids past the table (2**18) and past BININT
    tokens = _ids(rng, 30_000, 300_000) + [2**31, 2**33, 12, 2**18] + _ids(rng, 3_000, 2**40)
    for block_size in (16, 4096):
        assert BlockHasher(algo, "0").hashes(tokens, block_size) == _ref_chain(algo, "0", tokens, block_size)
    assert len(bh._tables[algo.endswith("_cbor")]) == 2**18


def test_hashes_of_blocks_pickled_in_two_frames(monkeypatch):
    hasher, slow = BlockHasher("sha256", "vllm-none-hash"), []
    monkeypatch.setattr(bh, "pickle_bytes", lambda obj: slow.append(len(obj[1])) or pickle_bytes(obj))
    one = [70_000] * 13_099 + [1]  # one frame (see the test above), two frames with [300]
    for tokens in (one + one, one + [70_000] * 13_099 + [300], [70_000] * 40_000):
        for block_size in (13_100, 20_000):
            assert hasher.hashes(tokens, block_size) == _ref_chain("sha256", "vllm-none-hash", tokens, block_size)
    # the fallback ran for exactly the blocks that need two frames
    assert slow == [20_000, 13_100, 20_000, 13_100, 13_100, 13_100, 20_000, 20_000]


def test_hashes_edges():
    hasher = BlockHasher("sha256", "vllm-none-hash")
    assert hasher.hashes([], 16) == [] and hasher.hashes(list(range(15)), 16) == []
    assert len(hasher.hashes(list(range(16)), 16)) == 1
    assert hasher.hashes(tuple(range(40)), 16) == hasher.hashes(list(range(32)), 16)
    assert hasher.hashes(range(32), 16) == hasher.hashes(list(range(32)), 16)
    with pytest.raises(ValueError, match="block_size"):
        hasher.hashes([1, 2], 0)
    with pytest.raises(ValueError, match="non-negative"):
        hasher.hashes([1, -2], 1)
    assert BlockHasher("sha256", "1").none_hash != hasher.none_hash
    with pytest.raises(TypeError, match="seed"):
        BlockHasher("sha256", seed_for("xxhash", None))


# --- against vLLM itself ------------------------------------------------------------------------

@pytest.fixture
def vllm_kv(monkeypatch):
    """vLLM's kv_cache_utils and hashing; its NONE_HASH globals are put back afterwards."""
    kvu = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    hashing = pytest.importorskip("vllm.utils.hashing")
    for name in ("NONE_HASH", "_NONE_HASH_SEED"):
        monkeypatch.setattr(kvu, name, getattr(kvu, name, None), raising=False)  # undone at teardown
    return kvu, hashing


def _set_seed_env(monkeypatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", value)


def _vllm_chain(kvu, hash_fn, tokens, block_size: int) -> list[bytes]:
    parent, out = None, []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = kvu.hash_block_tokens(hash_fn, parent, tokens[i:i + block_size], None)
        out.append(parent)
    return out


@pytest.mark.parametrize("env", [None, "0", "12345"])
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_hashes_and_keys_equal_vllm(vllm_kv, monkeypatch, algo, env):
    kvu, hashing = vllm_kv
    _set_seed_env(monkeypatch, env)
    hash_fn = hashing.get_hash_fn_by_name(algo)
    kvu.init_none_hash(hash_fn)
    hasher = BlockHasher(algo, seed_for(algo, os.environ.get("PYTHONHASHSEED")))
    assert hasher.none_hash == kvu.NONE_HASH
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    rng = random.Random(f"{algo}-{env}")
    for block_size in (16, 32, 64, 128):
        for n in (block_size - 1, block_size, 5 * block_size + 7, 1000):
            tokens = _ids(rng, n)
            expected = _vllm_chain(kvu, hash_fn, tokens, block_size)
            assert len(expected) == n // block_size
            assert hasher.hashes(tokens, block_size) == expected
            keys = [int.from_bytes(h, "big") & MASK64 for h in expected]
            assert hasher.keys(tokens, block_size) == keys == [event_key(h) for h in expected]
            converted = [kvu.maybe_convert_block_hash(h) for h in expected]
            if all(isinstance(c, int) for c in converted):  # the env switch is read per call unless cached
                assert keys == converted == [event_key(c) for c in converted]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_hashes_equal_vllm_request_block_hasher(vllm_kv, monkeypatch, algo):
    kvu, hashing = vllm_kv
    request_mod = pytest.importorskip("vllm.v1.request")
    sampling = pytest.importorskip("vllm.sampling_params")
    _set_seed_env(monkeypatch, None)
    hash_fn = hashing.get_hash_fn_by_name(algo)
    kvu.init_none_hash(hash_fn)
    tokens = _ids(random.Random(5), 1000)
    request = request_mod.Request("r", tokens, sampling.SamplingParams(max_tokens=1), None,
                                  block_hasher=kvu.get_request_block_hasher(16, hash_fn))
    assert len(request.block_hashes) == 62
    assert BlockHasher(algo, seed_for(algo, None)).hashes(tokens, 16) == list(request.block_hashes)


@pytest.mark.parametrize("env", [None, "0", "12345", "random", ""])
@pytest.mark.parametrize("algo", ALGOS)
def test_seed_for_mirrors_vllm(vllm_kv, monkeypatch, algo, env):
    kvu, hashing = vllm_kv
    _set_seed_env(monkeypatch, env)
    hash_fn = hashing.get_hash_fn_by_name(algo)
    seed = seed_for(algo, env)
    if seed is None:  # a random per-process seed: vLLM draws a fresh one on every call
        assert env is None and algo.startswith("xxhash")
        assert kvu.resolve_none_hash_seed(hash_fn) != kvu.resolve_none_hash_seed(hash_fn)
    else:
        assert seed == kvu.resolve_none_hash_seed(hash_fn)


def test_seed_for_cases():
    assert seed_for("sha256", None) == seed_for("sha256_cbor", None) == "vllm-none-hash"
    assert seed_for("xxhash", None) is None and seed_for("xxhash_cbor", None) is None
    assert [seed_for(a, "42") for a in ALGOS] == ["42"] * 4
    assert seed_for("xxhash", "") == ""
    with pytest.raises(ValueError, match="sha256, sha256_cbor, xxhash, xxhash_cbor"):
        seed_for("md5", None)
    with pytest.raises(ValueError, match="sha256, sha256_cbor, xxhash, xxhash_cbor"):
        BlockHasher("sha1", "0")


def test_event_key():
    h = bytes(range(32))
    assert event_key(h) == int.from_bytes(h[-8:], "big") == event_key(bytearray(h))
    assert event_key(event_key(h)) == event_key(h)
    assert event_key(-1) == MASK64 and event_key(2**70 + 5) == 5 and event_key(b"\x01") == 1
    for bad in ("ab", None, True, 1.0):
        with pytest.raises(TypeError):
            event_key(bad)


# --- xxhash ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_without_the_package_says_how_to_get_it(monkeypatch, algo):
    monkeypatch.setitem(sys.modules, "xxhash", None)  # makes `import xxhash` fail
    with pytest.raises(ImportError, match="pip install xxhash"):
        BlockHasher(algo, "0")


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_wiring_equals_vllm_with_a_stand_in_digest(vllm_kv, monkeypatch, algo):
    """16-byte parents through the same paths, with blake2b-128 standing in for xxh3_128 in both
    vLLM and block_hash.py, so this runs where xxhash is not installed."""
    kvu, hashing = vllm_kv
    fake = types.SimpleNamespace(xxh3_128_digest=lambda b: hashlib.blake2b(b, digest_size=16).digest())
    monkeypatch.setitem(sys.modules, "xxhash", fake)
    monkeypatch.setattr(hashing, "_xxhash", fake)
    _set_seed_env(monkeypatch, "7")
    hash_fn = hashing.get_hash_fn_by_name(algo)
    kvu.init_none_hash(hash_fn)
    tokens = _ids(random.Random(algo), 700)
    hasher = BlockHasher(algo, seed_for(algo, "7"))
    assert hasher.none_hash == kvu.NONE_HASH and len(hasher.none_hash) == 16
    for block_size in (1, 3, 16, 128):
        assert hasher.hashes(tokens, block_size) == _vllm_chain(kvu, hash_fn, tokens, block_size)


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_real_equals_reference_chain(algo):
    xxhash = pytest.importorskip("xxhash")
    tokens = _ids(random.Random(9), 1000)
    assert BlockHasher(algo, "3").hashes(tokens, 16) == _ref_chain(algo, "3", tokens, 16, xxhash.xxh3_128_digest)
