"""NetLoader's wire version and CRC32C checksums: a real seed and a real joiner over a socketpair.

No network: the seed's own connection handler (`Seed._serve`) and the joiner's
(`client.receive`) talk over `socket.socketpair()`; a version-1 peer is played
by the frames that release sent. tests/integration/test_netloader_wire.py does
the same over TCP, and the engines' own joins are in test_netloader.py.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import zlib
from types import SimpleNamespace

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from ascendserve.netloader import client, wire
from ascendserve.netloader.checkpoint import CheckpointError, CheckpointIndex, MappedSource, MemorySource, identity
from ascendserve.netloader.client import NetLoadError, fetch, open_transfer, receive
from ascendserve.netloader.seed import Seed
from ascendserve.protocol.frames import encode, read_frame, recv_exact, send_frame

TOKEN = "unit-wire-token"
JOIN_INFO = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1}


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Wire"], "model_type": "wire"}))
    gen = torch.Generator().manual_seed(5)
    save_file({"embed.weight": torch.randn(64, 32, generator=gen), "norm.weight": torch.randn(32, generator=gen),
               "head.bias": torch.arange(7, dtype=torch.int64), "empty": torch.zeros(0, 3)},
              str(tmp_path / "model.safetensors"))
    return tmp_path


def _serve(seed: Seed) -> tuple[socket.socket, threading.Thread]:
    """Our end of a socketpair whose other end the seed's connection handler serves on a thread."""
    ours, theirs = socket.socketpair()
    ours.settimeout(10)
    worker = threading.Thread(target=seed._serve, args=(theirs, ("unit", 0)), daemon=True)
    worker.start()
    return ours, worker


def _seed(source) -> Seed:
    return Seed(source, TOKEN, "127.0.0.1", 0, handshake_s=5.0, idle_s=5.0)  # never started: no accept loop


def _join(model, **fields) -> dict:
    join = {"type": "JOIN", "token": TOKEN, "identity": identity(model), **JOIN_INFO, "stream": 0,
            "version": wire.WIRE_VERSION}
    join.update(fields)
    return {k: v for k, v in join.items() if v is not None}


def test_the_checksum_is_crc32c_not_zlibs_crc32():
    assert wire.crc32c(b"123456789") == 0xE3069283  # the CRC32C check value (RFC 3720)
    assert zlib.crc32(b"123456789") == 0xCBF43926 != wire.crc32c(b"123456789")
    data = bytearray(range(256)) * 300
    assert wire.crc32c(memoryview(data)[100:70000]) == wire.crc32c(bytes(data[100:70000]))  # any buffer


@pytest.mark.parametrize("version, upgrade", [(None, "upgrade ascendserve on the joiner"),
                                              (1, "upgrade ascendserve on the joiner"),
                                              (wire.WIRE_VERSION + 1, "upgrade ascendserve on this seed")])
def test_a_join_of_another_version_gets_a_join_nack_saying_what_to_upgrade(model, version, upgrade):
    seed = _seed(MemorySource(CheckpointIndex.scan(model)))
    try:
        ours, worker = _serve(seed)
        with ours:
            send_frame(ours, _join(model, version=version))
            reply = read_frame(ours, 0)
            assert ours.recv(1) == b""  # and closed
        worker.join(10)
    finally:
        seed.stop()
    assert reply["type"] == "JOIN_NACK", reply
    spoken = "no version" if version is None else f"version {version}"
    assert reply["reason"] == (f"NetLoader wire version mismatch: the joiner speaks {spoken}"
                               + (" (version 1, CRC-32 checksums)" if version is None else "")
                               + f", this seed speaks version {wire.WIRE_VERSION} (CRC32C checksums): {upgrade}")
    assert seed.served == 0


def test_a_join_whose_version_is_not_an_integer_is_refused(model):
    seed = _seed(MemorySource(CheckpointIndex.scan(model)))
    try:
        for version in ("2", True, 2.0):
            ours, worker = _serve(seed)
            with ours:
                send_frame(ours, _join(model, version=version))
                reply = read_frame(ours, 0)
            worker.join(10)
            assert reply["type"] == "JOIN_NACK" and "version must be an integer" in reply["reason"], (version, reply)
    finally:
        seed.stop()


def test_a_current_join_gets_a_versioned_crc32c_manifest(model):
    index = CheckpointIndex.scan(model)
    seed = _seed(MemorySource(index))
    try:
        ours, worker = _serve(seed)
        with ours:
            send_frame(ours, _join(model))
            ack = read_frame(ours, wire.MAX_MANIFEST_BYTES)
            manifest = msgspec.msgpack.decode(recv_exact(ours, ack["payload"]))  # the payload, not the header
        worker.join(10)
    finally:
        seed.stop()
    assert ack["type"] == "JOIN_ACK" and ack["version"] == wire.WIRE_VERSION and "manifest" not in ack
    assert set(ack) == {"type", "version", "identity", "total_bytes", "payload"}
    raw = (model / "model.safetensors").read_bytes()
    assert len(manifest) == len(index.entries) == 4
    for e, entry in zip(manifest, index.entries):
        assert set(e) == {"name", "dtype", "shape", "nbytes", "crc32c"}
        assert e["crc32c"] == wire.crc32c(raw[entry.offset:entry.offset + entry.nbytes])


@pytest.mark.parametrize("kind", [MemorySource, MappedSource])
def test_received_tensors_equal_the_checkpoint(model, kind):
    seed = _seed(kind(CheckpointIndex.scan(model)))
    try:
        ours, worker = _serve(seed)
        with ours:
            got = dict(receive(ours, "unit", TOKEN, identity(model), JOIN_INFO, 10.0))
        worker.join(10)
    finally:
        seed.stop()
    want = load_file(str(model / "model.safetensors"))
    assert set(got) == set(want) and seed.served == 1
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape and got[name].equal(tensor), name


def _crc32_preserving_change(data: bytes, at: int) -> bytes:
    """`data` with bits of data[at:at+8] flipped so that zlib's CRC-32 stays the same.

    CRC-32 is affine over GF(2): crc(x ^ d) = crc(x) ^ crc(d) ^ crc(0). 64 bit flips span
    at most 32 dimensions, so some non-empty set of them leaves the CRC-32 unchanged."""
    zero = zlib.crc32(bytes(len(data)))
    basis: dict[int, tuple[int, int]] = {}  # leading bit -> (crc difference, which flips make it)
    for j in range(64):
        flip = bytearray(len(data))
        flip[at + j // 8] = 1 << (j % 8)
        diff, combo = zlib.crc32(flip) ^ zero, 1 << j
        while diff and (diff.bit_length() - 1) in basis:
            other, others = basis[diff.bit_length() - 1]
            diff, combo = diff ^ other, combo ^ others
        if diff:
            basis[diff.bit_length() - 1] = (diff, combo)
            continue
        out = bytearray(data)
        for k, b in enumerate(combo.to_bytes(8, "little")):
            out[at + k] ^= b
        return bytes(out)
    raise AssertionError("unreachable: 64 vectors in a 32-dimensional space")


def test_a_corruption_crc32_cannot_see_is_caught_by_crc32c(model):
    index = CheckpointIndex.scan(model)
    source = MemorySource(index)
    entry = next(e for e in index.entries if e.name == "embed.weight")
    view = source.view(entry)
    original = bytes(view)
    corrupted = _crc32_preserving_change(original, 1000)
    assert corrupted != original and zlib.crc32(corrupted) == zlib.crc32(original)  # invisible to version 1
    view[:] = corrupted
    seed = _seed(source)
    try:
        ours, worker = _serve(seed)
        with ours, pytest.raises(NetLoadError, match="checksum mismatch in embed.weight$"):
            receive(ours, "unit", TOKEN, identity(model), JOIN_INFO, 10.0)
        worker.join(10)
    finally:
        seed.stop()


def _old_seed(model, ack: dict) -> tuple[socket.socket, threading.Thread, dict]:
    """A seed of another release: answers JOIN with `ack`, then records whether a GET came."""
    ours, theirs = socket.socketpair()
    seen: dict = {}

    def run():
        with theirs:
            theirs.settimeout(10)
            seen["join"] = read_frame(theirs, 0)
            send_frame(theirs, ack)
            try:
                seen["next"] = read_frame(theirs, 0)["type"]
            except ConnectionError:
                seen["next"] = "EOF"
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return ours, worker, seen


def _version1_ack(model) -> dict:
    """What a version-1 seed answered: no version, zlib's CRC-32 under "crc32"."""
    index = CheckpointIndex.scan(model)
    raw = (model / "model.safetensors").read_bytes()
    manifest = [{"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "nbytes": e.nbytes,
                 "crc32": zlib.crc32(raw[e.offset:e.offset + e.nbytes])} for e in index.entries]
    return {"type": "JOIN_ACK", "identity": index.identity, "manifest": manifest, "total_bytes": index.total_bytes}


def test_the_joiner_refuses_a_version_1_seed_clearly_before_any_data(model):
    ours, worker, seen = _old_seed(model, _version1_ack(model))
    with ours, pytest.raises(NetLoadError) as err:
        receive(ours, "10.0.0.9:11000", TOKEN, identity(model), JOIN_INFO, 10.0)
    worker.join(10)
    assert str(err.value) == ("seed 10.0.0.9:11000: NetLoader wire version mismatch: the seed speaks version 1 "
                              "(no version field, a CRC-32 manifest), this joiner needs version "
                              f"{wire.WIRE_VERSION} (CRC32C checksums): upgrade ascendserve on the seed")
    assert seen == {"join": {**_join(model), "type": "JOIN"}, "next": "EOF"}  # it sent its version, never GET


def test_the_joiner_refuses_a_newer_seed(model):
    ack = {**_version1_ack(model), "version": wire.WIRE_VERSION + 1}
    ours, worker, seen = _old_seed(model, ack)
    with ours, pytest.raises(NetLoadError, match=f"the seed speaks version {wire.WIRE_VERSION + 1}, .*"
                                                 "upgrade ascendserve on this joiner"):
        receive(ours, "unit", TOKEN, identity(model), JOIN_INFO, 10.0)
    worker.join(10)
    assert seen["next"] == "EOF"


def test_a_dead_seed_mid_tensor_is_an_error_within_the_deadline(model):
    """The seed sends the JOIN_ACK and half a tensor, then goes silent (not closed): timeout_s bounds it."""
    index = CheckpointIndex.scan(model)
    source = MemorySource(index)
    ours, theirs = socket.socketpair()
    stop = threading.Event()

    def run():
        with theirs:
            read_frame(theirs, 0)
            send_frame(theirs, {"type": "JOIN_ACK", "version": wire.WIRE_VERSION, "identity": index.identity,
                                "total_bytes": index.total_bytes}, msgspec.msgpack.encode(index.manifest()))
            read_frame(theirs, 0)
            entry = index.entries[0]
            theirs.sendall(encode({"type": "TENSOR", "index": 0, "name": entry.name}, entry.nbytes))
            theirs.sendall(source.view(entry)[:100])
            stop.wait(30)
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    start = time.monotonic()
    with ours, pytest.raises(NetLoadError, match="timed out"):
        receive(ours, "unit", TOKEN, identity(model), JOIN_INFO, 1.0)
    assert time.monotonic() - start < 5
    stop.set()
    worker.join(10)


def test_without_the_crc32c_package_both_sides_say_so(model, monkeypatch):
    monkeypatch.setattr(wire, "_crc", None)
    with pytest.raises(CheckpointError, match="'google-crc32c' package is not installed"):
        CheckpointIndex.scan(model)
    with pytest.raises(NetLoadError, match=r"pip install 'google-crc32c>=1\.5'"):
        fetch("127.0.0.1:9", TOKEN, identity(model), JOIN_INFO, 1.0)  # before any connection


def test_a_crc32c_package_without_its_c_extension_is_refused_not_used(model, monkeypatch):
    """google-crc32c falls back to pure Python without its C extension: hours for a model's weights."""
    import google_crc32c

    monkeypatch.setattr(google_crc32c, "implementation", "python")
    with pytest.raises(CheckpointError, match="without its C extension"):
        CheckpointIndex.scan(model)
    with pytest.raises(NetLoadError, match="without its C extension"):
        fetch("127.0.0.1:9", TOKEN, identity(model), JOIN_INFO, 1.0)


def test_the_checksum_takes_every_buffer_a_tensor_comes_in_without_copying_it(monkeypatch):
    """google_crc32c itself refuses memoryviews, bytearrays and mmaps; wire.crc32c hands it numpy views
    of a slice at a time (of a tensor's storage, a receive buffer, a checkpoint file's mapping)."""
    import mmap

    import google_crc32c
    import numpy

    data = bytes(range(256)) * 4099  # over a megabyte, not a multiple of anything
    want = google_crc32c.value(data)
    with pytest.raises(TypeError):
        google_crc32c.value(memoryview(data))
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    handed: list = []
    monkeypatch.setattr(wire, "SLICE", 100_000)
    monkeypatch.setattr(wire, "_crc", SimpleNamespace(
        implementation="c", value=google_crc32c.value,
        extend=lambda crc, piece: handed.append(piece) or google_crc32c.extend(crc, piece)))

    def check(buf) -> list:
        handed.clear()
        assert wire.crc32c(buf) == want, type(buf)
        assert len(handed) == -(-len(data) // 100_000) and all(isinstance(p, numpy.ndarray) for p in handed)
        addresses = [p.ctypes.data for p in handed]
        handed.clear()
        return addresses

    for buf in (memoryview(data), bytearray(data), tensor.numpy()):
        check(buf)
    assert check(memoryview(tensor.numpy()))[0] == tensor.data_ptr()  # the tensor's own memory, no copy
    with mmap.mmap(-1, len(data)) as m:
        m.write(data)
        check(m)
    assert wire.crc32c(b"") == 0 and wire.crc32c(memoryview(b"")) == 0


def test_recv_exact_reads_into_the_view_it_is_given():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"abcdefgh")
        buf = bytearray(10)
        recv_exact(b, 8, memoryview(buf)[1:9])
        assert bytes(buf) == b"\0abcdefgh\0"


# ---- several streams ---------------------------------------------------------------------------------
def _connector(seed: Seed):
    """open_transfer's `connect`: each call a socketpair whose far end the seed's handler serves."""
    def connect():
        ours, theirs = socket.socketpair()
        threading.Thread(target=seed._serve, args=(theirs, ("unit", 0)), daemon=True).start()
        return ours
    return connect


def _open(seed: Seed, model, streams: int, **kw):
    return open_transfer("unit", TOKEN, identity(model), JOIN_INFO, 5.0, streams=streams, connect=_connector(seed),
                         **kw)


@pytest.fixture
def small_streams(monkeypatch):
    monkeypatch.setattr(client, "STREAM_MIN_BYTES", 1)  # streams for a checkpoint of a few KB


def test_the_plan_covers_every_byte_once_in_balanced_contiguous_parts():
    import random

    rng = random.Random(3)
    for parts in (1, 2, 3, 4, 7):
        for _ in range(200):
            sizes = [rng.choice([0, 0, 1, 5, 100, 4096]) for _ in range(rng.randint(0, 20))]
            plan = wire.plan(sizes, parts)
            assert len(plan) == parts
            pieces: dict[int, list] = {}
            for chunks in plan:
                for i, offset, n in chunks:
                    pieces.setdefault(i, []).append((offset, n))
            for i, n in enumerate(sizes):
                at = 0
                for offset, k in sorted(pieces[i]):
                    assert offset == at and (k > 0 or n == 0)
                    at += k
                assert at == n and (n or pieces[i] == [(0, 0)])
            lengths = [sum(n for _, _, n in chunks) for chunks in plan]
            assert max(lengths) - min(lengths) <= 1
            assert [i for chunks in plan for i, _, _ in chunks] == sorted(i for chunks in plan for i, _, _ in chunks)


@pytest.mark.parametrize("kind", [MemorySource, MappedSource])
def test_three_streams_split_tensors_and_equal_the_checkpoint(model, kind, small_streams):
    index = CheckpointIndex.scan(model)
    plan = wire.plan([e.nbytes for e in index.entries], 3)
    assert any(len({p for p, chunks in enumerate(plan) for i, _, _ in chunks if i == t}) > 1
               for t in range(len(index.entries)))  # a tensor spans two streams
    seed = _seed(kind(index))
    try:
        transfer = _open(seed, model, 3)
        assert transfer.streams == 3
        got = dict(transfer)
    finally:
        seed.stop()
    want = load_file(str(model / "model.safetensors"))
    assert set(got) == set(want) and all(got[k].equal(want[k]) for k in want)
    assert seed.served == 1  # one transfer, however many streams


@pytest.mark.parametrize("max_clients, streams", [(2, 2), (4, 3), (8, 4)])
def test_further_streams_leave_a_quarter_of_the_seeds_slots_free(model, small_streams, max_clients, streams):
    seed = Seed(MemorySource(CheckpointIndex.scan(model)), TOKEN, "127.0.0.1", 0, max_clients=max_clients,
                handshake_s=5.0, idle_s=5.0)
    try:
        transfer = _open(seed, model, 4)
        assert transfer.streams == min(4, max(1, max_clients - max_clients // 4)) == streams
        assert len(dict(transfer)) == 4
    finally:
        seed.stop()


class _StallsBefore(MemorySource):
    """Holds back the chunks of one tensor until released: the joiner shows what it yields meanwhile."""

    def __init__(self, index, name):
        super().__init__(index)
        self.name, self.release = name, threading.Event()

    def send(self, sock, entry, offset=0, count=None):
        if entry.name == self.name:
            self.release.wait(10)
        super().send(sock, entry, offset, count)


def test_verified_tensors_are_yielded_while_the_rest_still_streams(model):
    index = CheckpointIndex.scan(model)
    last = index.entries[-1].name
    source = _StallsBefore(index, last)
    seed = _seed(source)
    try:
        transfer = _open(seed, model, 1)
        it = iter(transfer)
        early = [next(it)[0] for _ in range(len(index.entries) - 1)]  # all but the held-back one
        assert last not in early and not source.release.is_set()
        source.release.set()
        assert [name for name, _ in it] == [last]
    finally:
        source.release.set()
        seed.stop()


class _DiesOnStream(MemorySource):
    """Sends half of one tensor's chunk, then drops that connection (the seed process 'died')."""

    def __init__(self, index, name):
        super().__init__(index)
        self.name = name

    def send(self, sock, entry, offset=0, count=None):
        if entry.name == self.name:
            sock.sendall(self.view(entry)[offset:offset + 8])
            sock.shutdown(socket.SHUT_RDWR)
            raise ConnectionError("seed died")
        super().send(sock, entry, offset, count)


def test_one_stream_dying_fails_the_transfer_at_once_and_ends_every_thread(model, small_streams):
    seed = _seed(_DiesOnStream(CheckpointIndex.scan(model), "norm.weight"))
    try:
        start = time.monotonic()
        transfer = _open(seed, model, 3)
        with pytest.raises(NetLoadError, match="closed|reset|Connection"):
            dict(transfer)
        assert time.monotonic() - start < 4  # well within the 5 s socket deadline
        assert transfer.error and not any(t.is_alive() for t in transfer._threads)
        assert all(s.fileno() == -1 for s in transfer.socks)  # closed
    finally:
        seed.stop()


def test_a_corrupted_tensor_split_over_two_streams_is_caught(model, small_streams):
    index = CheckpointIndex.scan(model)
    plan = wire.plan([e.nbytes for e in index.entries], 2)
    split = next(index.entries[i] for i, offset, _ in plan[1] if offset > 0)  # starts on stream 0
    source = MemorySource(index)
    view = source.view(split)
    at = split.nbytes - 16  # the part stream 1 carries
    view[:] = _crc32_preserving_change(bytes(view), at)
    seed = _seed(source)
    try:
        with pytest.raises(NetLoadError, match=f"checksum mismatch in {split.name}$"):
            dict(_open(seed, model, 2))
    finally:
        seed.stop()


def test_an_abandoned_iteration_closes_the_transfer(model, small_streams):
    seed = _seed(_StallsBefore(CheckpointIndex.scan(model), "norm.weight"))
    try:
        transfer = _open(seed, model, 2)
        it = iter(transfer)
        next(it)
        it.close()  # what happens when the model's load_weights raises part way
        assert transfer.error == "seed unit: transfer abandoned"
        assert not any(t.is_alive() for t in transfer._threads) and all(s.fileno() == -1 for s in transfer.socks)
    finally:
        seed.source.release.set()
        seed.stop()


def test_targets_of_the_same_dtype_and_shape_are_received_in_place(model, small_streams):
    want = load_file(str(model / "model.safetensors"))
    targets = {"embed.weight": torch.empty(64, 32),  # received in place
               "norm.weight": torch.empty(32, dtype=torch.float64),  # another dtype
               "head.bias": torch.empty(14, dtype=torch.int64)[::2],  # not contiguous
               "empty": torch.empty(3, 0)}  # another shape: all three into the host buffer
    seed = _seed(MemorySource(CheckpointIndex.scan(model)))
    try:
        transfer = _open(seed, model, 2, targets=targets)
        assert [transfer.manifest[i]["name"] for i in transfer.in_place] == ["embed.weight"]
        got = dict(transfer)
    finally:
        seed.stop()
    assert got["embed.weight"] is targets["embed.weight"] and targets["embed.weight"].equal(want["embed.weight"])
    assert all(got[k].equal(want[k]) for k in want) and transfer.changed_in_place() == []
    targets["embed.weight"][3, 3] += 1  # what a model transforming it while loading would do
    assert transfer.changed_in_place() == ["embed.weight"]


class _Paced(MemorySource):
    """Sends the next tensor only once the joiner's caller is done with the one before (`done`)."""

    def __init__(self, index):
        super().__init__(index)
        self.done = threading.Semaphore(0)

    def send(self, sock, entry, offset=0, count=None):
        super().send(sock, entry, offset, count)
        self.done.acquire(timeout=10)


def test_a_buffer_the_caller_let_go_of_receives_a_later_tensor_and_one_it_holds_never_does(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Layers"], "model_type": "layers"}))
    gen = torch.Generator().manual_seed(11)
    want = {f"layers.{i}.weight": torch.randn(16, 32, generator=gen) for i in range(8)}
    want["norm.weight"] = torch.randn(32, generator=gen)  # a size of its own: always fresh
    save_file(want, str(tmp_path / "model.safetensors"))
    source = _Paced(CheckpointIndex.scan(tmp_path))
    seed = _seed(source)
    held = {}
    try:
        transfer = _open(seed, tmp_path, 1, recycle=True)
        k = -1
        for name, tensor in transfer:  # (enumerate would hold each item until the next one comes)
            k += 1
            assert tensor.equal(want[name]), name
            if k % 2:
                held[name] = tensor[1:]  # a view holds the buffer as well as the tensor does
            del tensor
            source.done.release()
    finally:
        seed.stop()
    names = [e["name"] for e in transfer.manifest]
    # every tensor after one let go of, of the same size, took that one's buffer
    assert transfer.recycled == sum(1 for k in range(0, len(names) - 1, 2)
                                    if want[names[k]].shape == want[names[k + 1]].shape) >= 3
    assert held and all(view.equal(want[name][1:]) for name, view in held.items())  # never overwritten


def test_without_recycling_every_tensor_has_a_buffer_of_its_own(model, small_streams):
    seed = _seed(MemorySource(CheckpointIndex.scan(model)))
    try:
        transfer = _open(seed, model, 2)
        got = {}
        for name, tensor in transfer:
            got[name] = tensor.clone()
            del tensor
    finally:
        seed.stop()
    want = load_file(str(model / "model.safetensors"))
    assert transfer.recycled == 0 and all(got[k].equal(want[k]) for k in want)


# ---- sizes and deadlines -------------------------------------------------------------------------------
def test_a_manifest_over_the_frame_header_limit_travels_as_the_join_acks_payload(tmp_path, small_streams):
    """A model of thousands of tensors: its manifest is far over a frame header's 64 KiB."""
    from ascendserve.protocol.frames import MAX_HEADER

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Many"], "model_type": "many"}))
    want = {f"model.layers.{i // 64}.mlp.experts.{i % 64}.down_proj.weight": torch.full((3,), float(i))
            for i in range(4000)}
    save_file(want, str(tmp_path / "model.safetensors"))
    index = CheckpointIndex.scan(tmp_path)
    assert len(msgspec.msgpack.encode(index.manifest())) > 4 * MAX_HEADER
    seed = _seed(MemorySource(index))
    try:
        transfer = _open(seed, tmp_path, 2)
        assert transfer.streams == 2  # the further stream got (and compared) the same manifest
        got = dict(transfer)
    finally:
        seed.stop()
    assert len(got) == 4000 and all(got[k].equal(v) for k, v in want.items())


def test_a_manifest_over_the_wire_limit_is_a_clear_error_at_the_seed(model, monkeypatch):
    from ascendserve.netloader.checkpoint import CheckpointError

    monkeypatch.setattr(wire, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(CheckpointError, match=r"the manifest of 4 tensors takes \d+ bytes, over the wire's 100"):
        _seed(MemorySource(CheckpointIndex.scan(model)))


def test_memory_source_sends_under_a_deadline_on_silence_not_on_the_whole_tensor(tmp_path):
    """A tensor that takes longer to send than the socket's timeout, to a joiner that keeps reading:
    one sendall's timeout bounds the whole call; the seed sends in blocks, each with its own."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Big"]}))
    big = torch.arange(8 << 20, dtype=torch.int32)  # 32 MiB
    save_file({"big": big}, str(tmp_path / "model.safetensors"))
    source = MemorySource(CheckpointIndex.scan(tmp_path))
    entry = source.index.entries[0]
    a, b = socket.socketpair()
    got = bytearray()

    def read_slowly():  # ~25 MB/s: the whole tensor takes over a second, any 1 MiB well under 0.5 s
        while len(got) < entry.nbytes:
            chunk = b.recv(256 << 10)
            if not chunk:
                return
            got.extend(chunk)
            time.sleep(0.01)
    reader = threading.Thread(target=read_slowly, daemon=True)
    with a, b:
        a.settimeout(0.5)
        reader.start()
        start = time.monotonic()
        source.send(a, entry)
        assert time.monotonic() - start > 0.5  # longer than the timeout, and it did not time out
        reader.join(10)
    assert bytes(got) == big.numpy().tobytes()


class _Trickles(MemorySource):
    """Sends one tensor in small pieces at a steady pace: slow, never silent."""

    def __init__(self, index, name):
        super().__init__(index)
        self.name = name

    def send(self, sock, entry, offset=0, count=None):
        if entry.name != self.name:
            return super().send(sock, entry, offset, count)
        view = self.view(entry)[offset:offset + (entry.nbytes - offset if count is None else count)]
        for at in range(0, len(view), 512):
            sock.sendall(view[at:at + 512])
            time.sleep(0.05)


def test_a_tensor_arriving_slowly_but_steadily_is_no_stall(model, monkeypatch):
    """The joiner's guard against a stuck transfer watches bytes arriving, not the time to the next tensor
    (a large tensor over a slow link takes long): here one takes ~0.8 s to arrive, the guard is 0.3 s."""
    monkeypatch.setattr(client, "BLOCK", 1024)  # progress every KiB
    seed = _seed(_Trickles(CheckpointIndex.scan(model), "embed.weight"))  # 8 KiB, 512 bytes each 50 ms
    try:
        transfer = _open(seed, model, 1)
        transfer.stall_s = 0.3
        got = dict(transfer)
    finally:
        seed.stop()
    assert got["embed.weight"].equal(load_file(str(model / "model.safetensors"))["embed.weight"])
