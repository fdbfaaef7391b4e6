"""The KV side channel's native data path (transport/native.py, native/csrc/kv_xfer.cpp).

That it is the path taken (the library's own byte counters move by exactly what was read, and
not at all with ASCENDSERVE_KV_NATIVE=0); that it moves the bytes the Python path moves, in
the same order, for every vLLM layout and head range, in both directions (pull and push); that
a P and a D on different paths still exchange pages; and that a peer that dies, stalls or
sends a short or foreign answer fails the read at once or at its deadline, and frees P's hold.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ascendserve.connectors.kv.pages import PagedKV
from ascendserve.connectors.kv.pull_plan import PullMetadata, PullSettings
from ascendserve.connectors.kv.pull_worker import PullWorker
from ascendserve.connectors.transport import make_transport, native
from ascendserve.connectors.transport.base import TransferError
from ascendserve.connectors.transport.channel import ChannelClient
from ascendserve.connectors.transport.tcp import TcpTransport
from ascendserve.protocol import frames
from tests.kv_layouts import HELD, NUM_BLOCKS, Case, build, pages_of, producer_args, producer_seed

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    """The library, from ascendserve/_native/ if built (CI: ./build.sh), else built here."""
    path = native.LIBRARY
    if not os.path.exists(path):
        if shutil.which("cmake") is None or not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
            pytest.skip("cmake or a C++ compiler is missing: native/ cannot be built")
        out = tmp_path_factory.mktemp("xfer")
        subprocess.run(["bash", str(REPO / "native" / "build.sh"), str(out)], check=True, timeout=600,
                       env={**os.environ, "NVCC": "/nonexistent"})
        path = str(out / "libascendserve_xfer.so")
    assert native.load(path), native.why_not()
    return native


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    monkeypatch.delenv(native.ENV, raising=False)


def caches(seed, blocks=16, layers=4):
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn((blocks, 2, 32, 64), generator=g) for i in range(layers)}


@pytest.fixture
def pair(lib):
    settings = PullSettings(host="127.0.0.1", bind_host="127.0.0.1", port=0, ttl_s=30.0, transport="tcp")
    p = PullWorker(settings, "tok", tp_rank=0, producer=True, hold_wait_s=2.0)
    p.register_kv_caches(caches(1))
    d = PullWorker(settings, "tok", tp_rank=0, producer=False)
    d.register_kv_caches(caches(2))
    yield p, d, p.server.port
    p.shutdown(), d.shutdown()


def data_header(n: int) -> bytes:
    return frames.encode({"type": "DATA", "payload": n})


# ---- the runs are the views' bytes, in their order ----------------------------------------------
LAYOUT_CASES = [Case(n, n) for n in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")] + [
    Case("mla", "LBHNC", kind="mla", heads=1), Case("padded-cross-layer", "BLNHC", padded=True),
    Case("kernel-blocks", "LBNHC", kernel_block=8)]


def sent_natively(runs: native.Runs) -> bytes:
    """What the library sends for `runs` (its run generator and coalescing), read back as bytes."""
    a, b = socket.socketpair()
    got = bytearray()

    def reader():
        while chunk := b.recv(1 << 20):
            got.extend(chunk)

    t = threading.Thread(target=reader)
    t.start()
    try:
        a.settimeout(10)
        assert native.move(a, runs, send=True) == runs.nbytes
    finally:
        a.close()
        t.join(10)
        b.close()
    return bytes(got)


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: c.name)
def test_runs_send_the_views_bytes_in_their_order(lib, case):
    kv = PagedKV(build(case, seed=3), NUM_BLOCKS)
    heads = [None] + ([(1, 2), (3, 1)] if kv.num_heads > 1 else [])
    for blocks in HELD:  # HELD[1] repeats a block
        for h in heads:
            runs = kv.request_runs(blocks, h)
            want = b"".join(bytes(v) for v in kv.request_views(blocks, h))
            assert runs.nbytes == len(want) == kv.nbytes(len(blocks), h and h[1])
            assert sent_natively(runs) == want, (case.name, blocks, h)
            for layer in (0, kv.num_layers - 1):
                want = b"".join(bytes(v) for v in kv.layer_views(layer, blocks, h))
                assert sent_natively(kv.layer_runs(layer, blocks, h)) == want


def test_runs_refuse_blocks_outside_the_cache(lib):
    kv = PagedKV(caches(1), None)
    with pytest.raises(ValueError, match="out of range"):
        kv.request_runs([0, 16])


# ---- pull and push go through the library ------------------------------------------------------
def test_pull_is_one_native_read_of_exactly_its_bytes(pair):
    p, d, port = pair
    p.start_load_kv(PullMetadata(send={"r": ([3, 4, 5, 11], 30.0)}))
    before = native.counters()
    moved = d.client.pull("127.0.0.1", port, "r", [3, 4, 5, 11], [7, 1, 9, 10])
    after = native.counters()
    assert moved == d.kv.nbytes(4)
    read = frames.encode({"type": "READ", "request_id": "r", "blocks": [3, 4, 5, 11]})
    # D received the DATA header and the pages; P sent them, D sent the READ (both in this process)
    assert after["received"] - before["received"] == len(data_header(moved)) + moved
    want = len(read) + len(data_header(moved)) + moved
    deadline = time.monotonic() + 5  # P's thread counts its send when sendmsg returns: maybe after D read it
    while native.counters()["sent"] - before["sent"] < want and time.monotonic() < deadline:
        time.sleep(0.01)
    assert native.counters()["sent"] - before["sent"] == want
    for src, dst in zip(p.kv.layers, d.kv.layers):
        assert torch.equal(src[[3, 4, 5, 11]], dst[[7, 1, 9, 10]])


def test_shm_layers_are_copied_by_the_library(lib):
    """shm: P's gathers into the segment and D's scatters out of it are the library's copies
    (both in this process: twice the read), its LAYER and DONE frames the library's I/O."""
    settings = PullSettings(host="127.0.0.1", bind_host="127.0.0.1", port=0, ttl_s=30.0, transport="shm")
    p = PullWorker(settings, "tok", tp_rank=0, producer=True, hold_wait_s=2.0)
    p.register_kv_caches(caches(1))
    d = PullWorker(settings, "tok", tp_rank=0, producer=False)
    d.register_kv_caches(caches(2))
    try:
        p.start_load_kv(PullMetadata(send={"r": ([3, 4, 4, 11], 30.0)}))
        before = native.counters()
        moved = d.client.pull("127.0.0.1", p.server.port, "r", [3, 4, 4, 11], [7, 1, 9, 10])
        deadline = time.monotonic() + 5
        while p._held["r"].readers and time.monotonic() < deadline:
            time.sleep(0.01)
        after = native.counters()
        assert moved == d.kv.nbytes(4) and after["copied"] - before["copied"] == 2 * moved
        layers = len(d.kv.layers)
        frames_in = sum(len(frames.encode({"type": "LAYER", "layer": i})) for i in range(layers))
        done = len(frames.encode({"type": "DONE"}))
        assert after["received"] - before["received"] == frames_in + done  # D the LAYERs, P the DONE
        for src, dst in zip(p.kv.layers, d.kv.layers):
            assert torch.equal(src[[3, 4, 4, 11]], dst[[7, 1, 9, 10]])
    finally:
        p.shutdown(), d.shutdown()


def test_without_the_library_the_python_path_moves_the_same_bytes(pair, monkeypatch):
    p, d, port = pair
    p.start_load_kv(PullMetadata(send={"r": ([2, 6], 30.0), "s": ([2, 6], 30.0)}))
    d.client.pull("127.0.0.1", port, "r", [2, 6], [0, 1])
    native_pages = [t[[0, 1]].clone() for t in d.kv.layers]
    deadline = time.monotonic() + 5
    while p._held["r"].readers and time.monotonic() < deadline:  # P's send returned, counted
        time.sleep(0.01)
    monkeypatch.setenv(native.ENV, "0")
    before = native.counters()
    d.client.pull("127.0.0.1", port, "s", [2, 6], [8, 9])
    assert native.counters() == before  # not a byte through the library
    for src, a, dst in zip(p.kv.layers, native_pages, d.kv.layers):
        assert torch.equal(src[[2, 6]], a) and torch.equal(a, dst[[8, 9]])


def test_staged_buffers_go_through_the_library(lib):
    """Device pages' staging units (here host pages on that path) are sent and received natively."""
    from ascendserve.connectors.transport.tcp import recv_staged, send_staged

    src = PagedKV(caches(1), None, staging=True, staging_budget=256 << 10)
    dst = PagedKV(caches(2), None, staging=True, staging_budget=256 << 10)
    a, b = socket.socketpair()
    a.settimeout(10), b.settimeout(10)
    before = native.counters()
    t = threading.Thread(target=send_staged, args=(a, src, [1, 2, 3, 9], None))
    t.start()
    recv_staged(b, dst, [4, 5, 6, 7], None)
    t.join(10)
    a.close(), b.close()
    assert native.counters()["received"] - before["received"] == src.nbytes(4)
    for s, d_ in zip(src.layers, dst.layers):
        assert torch.equal(s[[1, 2, 3, 9]], d_[[4, 5, 6, 7]])


def test_push_layers_go_through_the_library(lib):
    from ascendserve.connectors.kv.push_plan import PushMetadata, PushPlan
    from ascendserve.connectors.kv.push_worker import PushWorker
    from tests.kvtools import results_until

    settings = PullSettings(host="127.0.0.1", bind_host="127.0.0.1", port=0, ttl_s=30.0, transport="tcp")
    d = PushWorker(settings, "tok", tp_rank=0, producer=False, expect_wait_s=2.0)
    d.register_kv_caches(caches(2))
    p = PushWorker(settings, "tok", tp_rank=0, producer=True)
    p.register_kv_caches(caches(1))
    try:
        d.start_load_kv(PushMetadata(expect={"r": [9, 3, 4]}))
        before = native.counters()
        meta = PushMetadata(push=[PushPlan("r", [1, 2, 5], [9, 3, 4], "127.0.0.1", d.server.port, last=True)])
        for name in sorted(p.kv.layer_index()):
            p.save_kv_layer(name, meta)
        p.wait_for_save(meta)
        _, _, failed = results_until(d, lambda g: "r" in g[1])
        assert not failed
        # each layer's pages were sent (after their PUSH header) and received by the library
        assert native.counters()["received"] - before["received"] == p.kv.nbytes(3)
        assert native.counters()["sent"] - before["sent"] > p.kv.nbytes(3)
        for src, dst in zip(p.kv.layers, d.kv.layers):
            assert torch.equal(src[[1, 2, 5]], dst[[9, 3, 4]])
    finally:
        p.shutdown(), d.shutdown()


# ---- P and D on different paths ------------------------------------------------------------------
MIXED = [Case("LBHNC", "LBHNC"), Case("BLHNC", "BLHNC"), Case("tp2-LBNHC", "LBNHC", heads=2, p_tp=2)]


def _producer(native_on: bool):
    env = {**os.environ, "OMP_NUM_THREADS": "1", native.ENV: "1" if native_on else "0"}
    proc = subprocess.Popen([sys.executable, "-m", "tests.kv_layouts", *producer_args(MIXED, ["tcp", "shm"])], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    path = None
    for line in proc.stdout:
        if line.startswith("NATIVE "):
            path = line.split()[1]
        if line.startswith("PORTS "):
            if path != str(int(native_on)):  # the producer serves on the path asked for, or the test says so
                proc.kill()
                raise AssertionError(f"the producer's native I/O is {path}, wanted {int(native_on)}")
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, json.loads(line[6:])
    proc.kill()
    raise AssertionError("the producer died before serving")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("p_native, d_native", [(False, True), (True, False)],
                         ids=["P-python-D-native", "P-native-D-python"])
def test_a_native_side_and_a_python_side_exchange_pages(lib, monkeypatch, p_native, d_native, transport):
    """The wire is the same on both paths: a producer process on one, this consumer on the other."""
    if not os.path.exists(native.LIBRARY):
        pytest.skip("the producer process loads ascendserve/_native/'s library, not built there")
    proc, ports = _producer(p_native)
    monkeypatch.setenv(native.ENV, "1" if d_native else "0")
    local = [1, 0, 2, 6]
    try:
        for case in MIXED:
            views = build(case, seed=5, heads=case.heads * case.p_tp)
            kv = PagedKV(views, NUM_BLOCKS)
            mover = make_transport(transport, kv)
            client = ChannelClient("tok", kv, mover)
            before = native.counters()
            for rank in range(case.p_tp):
                h = (0, rank * case.heads, case.heads) if case.p_tp > 1 else None
                client.pull("127.0.0.1", ports[f"{case.name}/host"] + rank, f"{case.name}-{transport}-0", HELD[0],
                            local, h)
            client.close()
            mover.close()
            assert (native.counters()["received"] > before["received"]) == d_native
            for r, lo in zip(HELD[0], local):
                mine = pages_of(views, lo)
                for rank in range(case.p_tp):
                    theirs = pages_of(build(case, producer_seed(case, rank)), r)
                    part = [m[:, rank * case.heads:(rank + 1) * case.heads] for m in mine] if case.p_tp > 1 else mine
                    assert all(torch.equal(x, y) for x, y in zip(part, theirs)), (case.name, rank, r, lo)
    finally:
        proc.stdin.close()
        proc.wait(10)


# ---- peers that die, stall or answer something else --------------------------------------------------
class FakeProducer:
    """A side channel that answers HELLO, reads one READ and then does `answer(conn, size)`."""

    def __init__(self, answer):
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        conn, _ = self.listener.accept()
        try:
            conn.settimeout(10)
            frames.read_frame(conn, 0)
            frames.send_frame(conn, {"type": "OK"})
            frames.read_frame(conn, 0)
            self.answer(conn)
            self.done.wait(30)  # the connection stays open until the test is over (a stall)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.done.set()
        self.listener.close()
        self.thread.join(10)


def reader_kv():
    return PagedKV(caches(2), None)


SIZE = PagedKV(caches(2), None).nbytes(4)


def _pull(answer, io_timeout_s=10.0):
    """D pulls 4 blocks from a FakeProducer answering `answer`; (error or None, seconds, bytes the
    library received, whether any of D's 4 pages changed)."""
    fake = FakeProducer(answer)
    kv = reader_kv()
    pages_before = b"".join(bytes(v) for v in kv.request_views([4, 5, 6, 7]))
    client = ChannelClient("tok", kv, TcpTransport(), io_timeout_s=io_timeout_s)
    before = native.counters()["received"]
    started = time.monotonic()
    try:
        client.pull("127.0.0.1", fake.port, "r", [0, 1, 2, 3], [4, 5, 6, 7])
        error = None
    except TransferError as exc:
        error = str(exc)
    took = time.monotonic() - started
    client.close()
    fake.close()
    written = b"".join(bytes(v) for v in kv.request_views([4, 5, 6, 7])) != pages_before
    return error, took, native.counters()["received"] - before, written


@pytest.fixture(params=["native", "python"])
def io_path(request, lib, monkeypatch):
    """Each failure both ways: the native path must fail as the Python path does (a
    TransferError, at once or at the deadline), and leave D's pages alone where it refuses."""
    monkeypatch.setenv(native.ENV, "1" if request.param == "native" else "0")
    return request.param


def test_a_producer_that_dies_mid_payload_fails_the_read_at_once(io_path):
    def half_then_close(conn):
        conn.sendall(data_header(SIZE) + bytes(SIZE // 2))
        conn.close()

    error, took, received, _ = _pull(half_then_close)
    assert error is not None and "closed the connection" in error, error
    assert took < 5
    if io_path == "native":
        assert "mid-transfer" in error and f"of {SIZE} bytes" in error  # the short payload is named
        assert received == len(data_header(SIZE)) + SIZE // 2  # the native path read it
    else:
        assert received == 0


def test_a_producer_that_stalls_mid_payload_fails_at_the_deadline(io_path):
    def half_then_stall(conn):
        conn.sendall(data_header(SIZE) + bytes(SIZE // 2))

    error, took, _, _ = _pull(half_then_stall, io_timeout_s=0.5)
    assert error is not None and ("no progress" if io_path == "native" else "timed out") in error, error
    assert 0.4 < took < 5


def test_a_producer_that_dies_mid_header_fails_the_read(io_path):
    error, took, _, _ = _pull(lambda conn: conn.sendall(data_header(SIZE)[:5]) or conn.close())
    assert error is not None and "closed" in error and took < 5, error


def test_a_refusal_and_a_wrong_size_are_decoded_and_no_page_is_written(io_path):
    error, _, _, written = _pull(lambda conn: frames.send_frame(conn, {"type": "ERR", "reason": "not held"}))
    assert error is not None and "producer refused READ: not held" in error and not written
    error, _, received, written = _pull(lambda conn: conn.sendall(data_header(SIZE // 2) + bytes(SIZE // 2)))
    assert error is not None and f"expected {SIZE}" in error and not written
    if io_path == "native":  # the header only: no page byte was read
        assert received == len(data_header(SIZE // 2))


def test_a_peer_that_trickles_bytes_meets_the_whole_call_deadline(lib):
    """Progress within every idle limit does not hold a thread for ever: a call also has a budget
    (twice the idle limit plus its bytes at MIN_RATE), and fails past it."""
    a, b = socket.socketpair()
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.05):
            try:
                b.send(b"x")
            except OSError:
                return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    buf = bytearray(1 << 20)  # 1 MiB: 0.1 s at MIN_RATE; the budget is about 1.1 s
    a.settimeout(0.5)
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="past its deadline"):
            native.move(a, native.Runs.buffers([memoryview(buf)], writable=True), send=False)
        took = time.monotonic() - started
    finally:
        stop.set()
        t.join(5)
        a.close(), b.close()
    assert 0.9 < took < 5, took


def test_an_f_order_buffer_is_left_to_the_python_path(lib):
    """A buffer the library cannot name as one byte range is not taken (and does not raise)."""
    f = np.asfortranarray(np.arange(12, dtype=np.uint8).reshape(3, 4))
    assert native.Runs.buffers([memoryview(f)], writable=False) is None
    assert native.Runs.buffers([memoryview(np.ascontiguousarray(f))], writable=False) is not None


def test_a_read_larger_than_its_segment_is_refused_before_a_byte_is_copied(lib, monkeypatch):
    """shm: the segment's length goes with its address; a read that would run past it is refused,
    by native.py and by the library itself, before anything is copied or sent."""
    kv = reader_kv()
    runs = kv.request_runs([0, 1, 2, 3], layer_major=True)
    seg = np.full(runs.nbytes + 4096, 7, dtype=np.uint8)  # the tail: what must stay untouched
    short = runs.nbytes - 1
    a, b = socket.socketpair()
    a.settimeout(2), b.settimeout(2)
    try:
        for call in (native.shm_serve, native.shm_fetch):
            with pytest.raises(ValueError, match="does not fit"):
                call(a, runs, seg.ctypes.data, short, frames.encode({"type": "DONE"}))
        monkeypatch.setattr(native, "_fits", lambda runs, n: None)  # the library's own check
        before = native.counters()
        for call in (native.shm_serve, native.shm_fetch):
            with pytest.raises(ValueError, match="bad shm"):
                call(a, runs, seg.ctypes.data, short, frames.encode({"type": "DONE"}))
        assert native.counters()["copied"] == before["copied"] and native.counters()["sent"] == before["sent"]
        assert (seg == 7).all()
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)  # not a frame was sent
    finally:
        a.close(), b.close()


def test_another_encoding_of_the_data_header_is_still_read(lib):
    """A producer of another version may encode DATA differently: the bytes differ from what the
    native fetch expects, the header is decoded in Python and the pages still land."""
    import msgspec

    body = msgspec.msgpack.encode({"payload": SIZE, "type": "DATA"})  # keys in the other order
    assert body != data_header(SIZE)[8:]
    pages = np.random.default_rng(0).integers(0, 255, SIZE, dtype=np.uint8).tobytes()
    fake = FakeProducer(lambda conn: conn.sendall(frames.PREFIX.pack(frames.MAGIC, len(body)) + body + pages))
    kv = reader_kv()
    client = ChannelClient("tok", kv, TcpTransport())
    try:
        assert client.pull("127.0.0.1", fake.port, "r", [0, 1, 2, 3], [4, 5, 6, 7]) == SIZE
    finally:
        client.close()
        fake.close()
    assert b"".join(bytes(v) for v in kv.request_views([4, 5, 6, 7])) == pages


def test_a_consumer_that_dies_mid_read_releases_the_hold(pair):
    """P's native send fails at once when D goes away; the hold is unpinned and served again."""
    p, d, port = pair
    p.start_load_kv(PullMetadata(send={"r": (list(range(16)), 30.0)}))
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    frames.send_frame(s, {"type": "HELLO", "token": "tok", "layout": d.kv.layout(), "transport": "tcp"})
    assert frames.read_frame(s, 0)["type"] == "OK"
    frames.send_frame(s, {"type": "READ", "request_id": "r", "blocks": list(range(16))})
    assert frames.read_frame(s, 1 << 30)["type"] == "DATA"
    s.recv(1000)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, as a crash leaves
    s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (p._held["r"].readers or p.server._slots._value < p.server.max_connections):
        time.sleep(0.02)
    assert p._held["r"].readers == 0 and p.server._slots._value == p.server.max_connections
    assert d.client.pull("127.0.0.1", port, "r", [5, 6], [5, 6]) == d.kv.nbytes(2)
    for src, dst in zip(p.kv.layers, d.kv.layers):
        assert torch.equal(src[[5, 6]], dst[[5, 6]])



# ---- the point of it: a busy Python thread does not slow the transfer down ---------------------------
def _serve_held(port_q, stop, num_blocks: int, blocks: list[int], holds: int) -> None:
    """P in a process of its own (no spinner there): holds `holds` requests of `blocks`."""
    os.environ["OMP_NUM_THREADS"] = "1"
    settings = PullSettings(host="127.0.0.1", bind_host="127.0.0.1", port=0, ttl_s=600.0, transport="tcp")
    p = PullWorker(settings, "tok", tp_rank=0, producer=True)
    p.register_kv_caches(caches(1, blocks=num_blocks, layers=8))
    p.start_load_kv(PullMetadata(send={f"r{i}": (blocks, 600.0) for i in range(holds)}))
    port_q.put(p.server.port)
    while not stop.wait(0.05):
        p.get_transfer_results()
    p.shutdown()


def test_a_python_thread_holding_the_gil_does_not_throttle_a_native_pull(lib, monkeypatch):
    """What vLLM's busy engine loop did to the transfer threads, made deterministic: a thread that
    only runs bytecode keeps the GIL for a whole switch interval (here 0.1 s) whenever the transfer
    thread gives it up. The Python path gives it up at every recvmsg (a socket buffer per interval,
    at most); the native path once per read. The same pull, both ways, in this process."""
    import multiprocessing as mp

    blocks = list(range(256))  # 8 layers x 256 blocks x 16 KiB pages: 32 MiB
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_serve_held, args=(q, stop, 256, blocks, 4), daemon=True)
    proc.start()
    settings = PullSettings(host="127.0.0.1", bind_host="127.0.0.1", port=0, ttl_s=30.0, transport="tcp")
    d = PullWorker(settings, "tok", tp_rank=0, producer=False)
    d.register_kv_caches(caches(2, blocks=256, layers=8))
    halt = threading.Event()
    interval = sys.getswitchinterval()
    try:
        port = q.get(timeout=120)
        d.client.pull("127.0.0.1", port, "r0", blocks, blocks)  # connected, warm

        def spin():
            while not halt.is_set():
                pass

        spinner = threading.Thread(target=spin, daemon=True)
        sys.setswitchinterval(0.1)
        spinner.start()
        took = {}
        for i, mode in ((1, "1"), (2, "0"), (3, "1")):
            monkeypatch.setenv(native.ENV, mode)
            started = time.monotonic()
            assert d.client.pull("127.0.0.1", port, f"r{i}", blocks, blocks) == d.kv.nbytes(256)
            took.setdefault(mode, []).append(time.monotonic() - started)
    finally:
        halt.set()
        sys.setswitchinterval(interval)
        stop.set()
        proc.join(30)
        d.shutdown()
    native_s, python_s = min(took["1"]), took["0"][0]
    # the Python path waits an interval per socket buffer (4-8 MiB: >= 4 here); the native one
    # an interval or two per read
    assert python_s > 0.3, took
    assert native_s < python_s / 2, took
