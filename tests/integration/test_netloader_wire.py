"""NetLoader's seed and fetch over loopback sockets, without an engine.

Good transfers equal the checkpoint byte for byte; every failure (wrong or no
token, garbage, a joiner of an older wire version, another model's manifest,
a flipped byte, a seed that dies mid-transfer or never answers) is a
NetLoadError or a JOIN_NACK with the reason, within the deadline, and the
seed keeps serving others. tests/unit/test_netloader_wire.py has the wire
version and CRC32C cases over socketpairs.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time

import pytest
from safetensors.torch import load_file

from ascendserve.netloader.checkpoint import CheckpointError, CheckpointIndex, MappedSource, MemorySource, identity
from ascendserve.netloader.client import NetLoadError, fetch
from ascendserve.netloader.seed import Seed
from ascendserve.protocol.frames import encode, read_frame, send_frame

pytestmark = pytest.mark.integration
TOKEN = "wire-token"


@pytest.fixture(scope="module")
def index(text_model) -> CheckpointIndex:
    return CheckpointIndex.scan(text_model)


def _seed(source, **kw) -> Seed:
    return Seed(source, TOKEN, "127.0.0.1", 0, **kw).start()


def _fetch(seed: Seed, model_dir, token=TOKEN, timeout_s=10.0):
    return fetch(f"127.0.0.1:{seed.port}", token, identity(model_dir), {"tp_rank": 0, "tp_size": 1}, timeout_s)


@pytest.mark.parametrize("kind", [MemorySource, MappedSource])
def test_fetch_equals_the_checkpoint(text_model, index, kind):
    seed = _seed(kind(index))
    try:
        got = dict(_fetch(seed, text_model))
    finally:
        seed.stop()
    want = load_file(str(text_model / "model.safetensors"))
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert got[name].view(-1).view(dtype=tensor.dtype).equal(tensor.view(-1)), name
    assert seed.served == 1


def test_large_tensors_from_the_page_cache(tmp_path):
    """Tensors far larger than a socket buffer, sent with sendfile under the socket's timeout."""
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text('{"architectures": ["Big"]}')
    big = {"a": torch.randn(12 << 20), "b": torch.arange(3 << 20, dtype=torch.int64)}
    save_file(big, str(tmp_path / "model.safetensors"))
    seed = _seed(MappedSource(CheckpointIndex.scan(tmp_path)))
    try:
        got = dict(_fetch(seed, tmp_path))
    finally:
        seed.stop()
    assert got["a"].equal(big["a"]) and got["b"].equal(big["b"])


def test_refuses_wrong_token_no_token_and_garbage_and_keeps_serving(text_model, index):
    seed = _seed(MemorySource(index), handshake_s=1.0)
    try:
        with pytest.raises(NetLoadError, match="cluster token"):
            _fetch(seed, text_model, token="wrong")
        with pytest.raises(NetLoadError, match="cluster token"):
            _fetch(seed, text_model, token="")
        for junk in (b"GET / HTTP/1.1\r\n\r\n", b"ASF1\xff\xff\xff\xff", encode({"type": "GET"}), b""):
            with socket.create_connection(("127.0.0.1", seed.port), timeout=5) as s:
                s.sendall(junk)
                s.settimeout(5)
                try:
                    reply = s.recv(1 << 16)
                except ConnectionResetError:
                    reply = b""
                except TimeoutError:
                    pytest.fail(f"seed kept a connection open after {junk!r}")
                assert b"JOIN_ACK" not in reply and b"manifest" not in reply
        assert seed.refused >= 3
        assert len(_fetch(seed, text_model)) == len(index.entries)  # still serving
    finally:
        seed.stop()


def test_an_old_joiner_is_refused_with_the_reason_and_the_seed_keeps_serving(text_model, index):
    seed = _seed(MemorySource(index))
    try:
        for version in (None, 1):  # what a version-1 joiner sent (no version), and an explicit older one
            join = {"type": "JOIN", "token": TOKEN, "identity": identity(text_model), "tp_rank": 0, "tp_size": 1}
            with socket.create_connection(("127.0.0.1", seed.port), timeout=5) as s:
                send_frame(s, join if version is None else {**join, "version": version})
                reply = read_frame(s, 0)
            assert reply["type"] == "JOIN_NACK", reply
            assert reply["reason"].startswith("NetLoader wire version mismatch: the joiner speaks ") and \
                reply["reason"].endswith("this seed speaks version 2 (CRC32C checksums): upgrade ascendserve on "
                                         "the joiner"), reply
        assert len(_fetch(seed, text_model)) == len(index.entries) and seed.served == 1  # still serving
    finally:
        seed.stop()


def test_another_models_manifest_is_refused_before_any_data(text_model, index, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(text_model, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-6) * 10
    (other / "config.json").write_text(json.dumps(config))
    seed = _seed(MemorySource(CheckpointIndex.scan(other)))
    try:
        with pytest.raises(NetLoadError, match="another model"):
            _fetch(seed, text_model)
        time.sleep(0.2)
        assert seed.served == 0  # no GET was sent
    finally:
        seed.stop()


def test_a_flipped_byte_fails_the_checksum(text_model, index):
    source = MemorySource(index)
    entry = index.entries[len(index.entries) // 2]
    view = source.view(entry)
    view[7] ^= 0x01
    seed = _seed(source)
    try:
        with pytest.raises(NetLoadError, match=f"checksum mismatch in {entry.name}"):
            _fetch(seed, text_model)
    finally:
        seed.stop()


class _DiesMidway(MemorySource):
    """Sends a few tensors, then half of one, then the process 'dies' (the socket closes)."""

    def __init__(self, index):
        super().__init__(index)
        self.sent = 0

    def send(self, sock, entry):
        self.sent += 1
        if self.sent > 3:
            sock.sendall(self.view(entry)[: entry.nbytes // 2])
            sock.shutdown(socket.SHUT_RDWR)
            raise ConnectionError("seed died")
        super().send(sock, entry)


def test_seed_dying_mid_transfer_is_an_error_not_a_hang(text_model, index):
    seed = _seed(_DiesMidway(index))
    try:
        start = time.monotonic()
        with pytest.raises(NetLoadError, match="closed|reset|EOF|Connection"):
            _fetch(seed, text_model)
        assert time.monotonic() - start < 5
    finally:
        seed.stop()


def test_a_seed_that_never_answers_times_out(text_model):
    mute = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.append(mute.accept()), daemon=True).start()
    try:
        start = time.monotonic()
        with pytest.raises(NetLoadError, match="timed out|TimeoutError"):
            fetch(f"127.0.0.1:{mute.getsockname()[1]}", TOKEN, identity(text_model), {}, 1.0)
        assert time.monotonic() - start < 5
    finally:
        mute.close()


def test_unreachable_seed_and_bad_directory(text_model, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(NetLoadError, match="unreachable"):
        fetch(f"127.0.0.1:{port}", TOKEN, identity(text_model), {}, 2.0)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        CheckpointIndex.scan(tmp_path)


@pytest.mark.parametrize("kind", [MemorySource, MappedSource])
def test_stop_ends_running_transfers_and_waits_for_their_threads(tmp_path, kind):
    """A joiner that stops reading part way holds the seed's connection thread in a send until `idle_s`
    (60 s here): stop() ends that connection and waits for its thread, within its own deadline."""
    import torch
    from safetensors.torch import save_file

    from ascendserve.netloader.wire import MAX_MANIFEST_BYTES, WIRE_VERSION
    from ascendserve.protocol.frames import recv_exact

    (tmp_path / "config.json").write_text('{"architectures": ["Big"]}')
    save_file({"a": torch.randn(8 << 20)}, str(tmp_path / "model.safetensors"))  # 32 MiB: over any socket buffer
    before = set(threading.enumerate())
    seed = _seed(kind(CheckpointIndex.scan(tmp_path)), idle_s=60.0)
    try:
        with socket.create_connection(("127.0.0.1", seed.port), timeout=10) as s:
            send_frame(s, {"type": "JOIN", "token": TOKEN, "identity": identity(tmp_path), "version": WIRE_VERSION})
            ack = read_frame(s, MAX_MANIFEST_BYTES)
            assert ack["type"] == "JOIN_ACK", ack
            recv_exact(s, ack["payload"])
            send_frame(s, {"type": "GET"})
            assert s.recv(4096)  # the transfer began; this joiner reads no more
            time.sleep(1.0)  # the seed's send blocks on the full socket buffers
            senders = [t for t in set(threading.enumerate()) - before if t.name == "netloader-send"]
            assert len(senders) == 1 and senders[0].is_alive()
            start = time.monotonic()
            seed.stop(timeout_s=10.0)
            assert time.monotonic() - start < 5
            assert not senders[0].is_alive()
    finally:
        seed.stop()


def test_the_seed_keeps_accepting_after_an_accept_error(text_model, index):
    """accept() fails now and then (EMFILE when out of descriptors, ECONNABORTED): the seed's accept
    loop ended on any OSError, and the seed stopped serving for good with no word in its log."""
    import errno

    class Flaky:
        def __init__(self, listener):
            self.listener, self.failures = listener, 2

        def accept(self):
            if self.failures:
                self.failures -= 1
                self.listener.accept()[0].close()  # the connection it was about to hand over
                raise OSError(errno.EMFILE, "Too many open files")
            return self.listener.accept()

        def __getattr__(self, name):
            return getattr(self.listener, name)

    seed = Seed(MemorySource(index), TOKEN, "127.0.0.1", 0)
    seed._listener = Flaky(seed._listener)
    seed.start()
    try:
        for _ in range(2):  # each closed where accept() failed
            with pytest.raises(NetLoadError):
                _fetch(seed, text_model, timeout_s=5.0)
        assert len(_fetch(seed, text_model)) == len(index.entries) and seed.served == 1
    finally:
        seed.stop()
