"""Fuzz targets: every decoder of bytes that arrive from a socket.

Each target feeds one input to the real decoding code and lets only the
errors its contract allows pass; anything else escaping is a finding:

    frames             protocol/frames.py: decode_header, read_frame over a socket
    kv_channel         ChannelServer._serve (P's pull side, D's push side) fed a TCP stream
    kv_channel_client  ChannelClient.pull/free (tcp, shm) against a producer that sends the input
    netloader_seed     Seed._serve fed a joiner's TCP stream
    netloader_client   netloader.client.fetch against a seed that sends the input
    registry           the metaserver's registry/push bodies, the proxy's registry view
    openai_body        the proxy's request checks and what it derives from a body before a hop
    ec_memcached       the EC store's memcached replies and entry headers

A target is `setup() -> one(data)`: setup builds the real parts once (a
listener, a tiny KV cache, a checkpoint) and `one` runs a single input. The
stand-ins are collaborators only (who holds which KV blocks, the HTTP client
the registry watch reads through); the decoder under test is always ours.
`seeds()` are valid conversations, so mutations start inside the protocol.
Run them with tests/fuzz/run.py (atheris) or replay inputs with `replay`.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import shutil
import socket
import struct
import tempfile
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import msgspec

from ascendserve.protocol import frames

TOKEN = "fuzz-cluster-token"
RID = "req-1"


class Finding(AssertionError):
    """A decoder answered bad input in a way its contract does not allow (e.g. a 5xx)."""


@dataclass
class Target:
    name: str
    setup: Callable[[], Callable[[bytes], None]]
    seeds: Callable[[], list[bytes]]
    fmt: str = "bytes"  # how the input is structured (after `skip` selector bytes): bytes, frames, json
    skip: int = 0
    max_len: int = 4096


def frame(header: dict, payload: bytes = b"") -> bytes:
    return frames.encode(header, len(payload)) + payload


# ---- sockets -----------------------------------------------------------------------------
class Loopback:
    """TCP pairs on 127.0.0.1 (the decoders set TCP options, which a socketpair refuses)."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.address = self.listener.getsockname()

    def pair(self, data: bytes) -> tuple[socket.socket, socket.socket]:
        """(our end, the decoder's end); `data` waits on the decoder's end, then EOF."""
        ours = socket.create_connection(self.address)
        theirs, _ = self.listener.accept()
        ours.sendall(data)
        ours.shutdown(socket.SHUT_WR)
        return ours, theirs


def drain(sock: socket.socket) -> threading.Thread:
    """Read and drop what the decoder answers, so its sends never block."""
    def run():
        try:
            while sock.recv(1 << 16):
                pass
        except OSError:
            pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


class Peer:
    """A server that answers every connection with the current input, then EOF: a lying peer."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.host, self.port = self.listener.getsockname()
        self.data = b""
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            conn, _ = self.listener.accept()
            with self._lock:
                data = self.data
                self._conns.append(conn)
            try:
                conn.sendall(data)
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def answer(self, data: bytes) -> None:
        """Answer the next connections with `data` (the previous ones are closed)."""
        with self._lock:
            conns, self._conns, self.data = self._conns, [], data
        for conn in conns:
            conn.close()


# ---- frames ------------------------------------------------------------------------------
def _frames_setup():
    def one(data: bytes) -> None:
        prefix, body = data[:frames.PREFIX.size], data[frames.PREFIX.size:]
        if len(prefix) == frames.PREFIX.size:
            try:
                frames.header_length(prefix)
                frames.decode_header(prefix, body)
            except frames.FrameError:
                pass
        a, b = socket.socketpair()
        with a, b:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)
            try:
                while True:
                    header = frames.read_frame(b, 1024)
                    frames.recv_exact(b, header.get("payload", 0))
            except (frames.FrameError, ConnectionError):
                pass
    return one


def _frames_seeds():
    return [frame({"type": "HELLO", "token": TOKEN}), frame({"type": "DATA"}, b"x" * 16) + frame({"type": "OK"}),
            frame({"type": "READ", "request_id": RID, "blocks": [1, 2], "heads": [0, 1]})]


# ---- KV side channel ----------------------------------------------------------------------
LAYERS, BLOCKS, HEADS = 2, 8, 2
HELD = {RID: frozenset(range(4))}


class HeldBlocks:
    """Holds (transport/base.py) for a fixed set of held requests; nothing expires."""

    def acquire(self, request_id: str, block_ids: list[int]) -> None:
        if request_id not in HELD:
            raise KeyError(f"request {request_id} is not held here")
        if not set(block_ids) <= HELD[request_id]:
            raise ValueError(f"request {request_id} does not hold blocks {sorted(set(block_ids) - HELD[request_id])}")

    def release(self, request_id: str) -> None:
        return None

    def free(self, request_id: str) -> None:
        return None

    def announce(self, request_id: str, block_ids: list[int], ttl_s: float, age_s: float) -> bool:
        return request_id in HELD


class ExpectedPush:
    """PushSink (transport/base.py): D waits for RID's pushed KV in the HELD blocks."""

    def __init__(self, pages):
        self.pages = pages

    def check(self, request_id: str, block_ids: list[int]) -> None:
        HeldBlocks().acquire(request_id, block_ids)

    def receive(self, request_id: str, layer: int, block_ids: list[int], pages) -> None:
        self.check(request_id, block_ids)
        if pages is not None:
            self.pages.scatter_layer(layer, block_ids, pages)

    def complete(self, request_id: str, ok: bool) -> None:
        return None


def _tiny_kv():
    import torch

    from ascendserve.connectors.kv.pages import PagedKV

    return PagedKV({f"layers.{i}.attn": torch.zeros((BLOCKS, HEADS, 4, 8)) for i in range(LAYERS)})


def _kv_channel_setup():
    from ascendserve.connectors.transport.channel import ChannelServer
    from ascendserve.connectors.transport.shm import ShmTransport
    from ascendserve.connectors.transport.tcp import TcpTransport

    pages = _tiny_kv()
    transports = {"tcp": TcpTransport(), "shm": ShmTransport()}
    producer = ChannelServer("127.0.0.1", 0, HeldBlocks(), pages, TOKEN, transports, idle_timeout_s=2.0)
    consumer = ChannelServer("127.0.0.1", 0, HeldBlocks(), pages, TOKEN, transports, idle_timeout_s=2.0,
                             sink=ExpectedPush(pages), max_push_blocks=BLOCKS)
    loop = Loopback()

    def one(data: bytes) -> None:
        if not data:
            return
        server = consumer if data[0] & 1 else producer
        ours, theirs = loop.pair(data[1:])
        drainer = drain(ours)
        server._slots.acquire()  # what the accept loop does before _serve, which releases it
        server._serve(theirs, ("127.0.0.1", 0))  # handles every error itself: nothing may escape
        drainer.join()
        ours.close()
    return one


def _kv_hello(transport: str | None = "tcp") -> bytes:
    hello = {"type": "HELLO", "token": TOKEN}
    if transport is not None:
        hello.update(layout=_layout(), transport=transport)
    return frame(hello)


_LAYOUT: dict | None = None


def _layout() -> dict:
    global _LAYOUT
    if _LAYOUT is None:
        _LAYOUT = _tiny_kv().layout()
    return _LAYOUT


def _kv_channel_seeds():
    page = HEADS * 4 * 8 * 4
    pull, push = b"\x00", b"\x01"
    read = frame({"type": "READ", "request_id": RID, "blocks": [0, 1]})
    return [
        pull + _kv_hello() + read + frame({"type": "READ", "request_id": RID, "blocks": [2], "heads": [1, 1]})
        + frame({"type": "FREE", "request_id": RID}),
        pull + _kv_hello("shm") + read + frame({"type": "DONE"}) + frame({"type": "FREE", "request_id": RID}),
        pull + _kv_hello(None) + frame({"type": "FREE", "request_id": RID}),
        pull + _kv_hello(None) + frame({"type": "HOLD", "request_id": RID, "blocks": [0, 1], "ttl_s": 30.0,
                                        "at": 1.7e9}) + frame({"type": "FREE", "request_id": RID}),
        pull + frame({"type": "HELLO", "token": "wrong"}),
        push + _kv_hello() + frame({"type": "PUSH", "request_id": RID, "layer": 1, "blocks": [3]}, b"\x01" * page)
        + frame({"type": "PUSHED", "request_id": RID, "ok": True}),
        push + _kv_hello("shm") + frame({"type": "PUSH", "request_id": RID, "layer": 0, "blocks": [0],
                                         "shm": "asf-kv-0-0"}),
        push + _kv_hello() + frame({"type": "PUSH", "request_id": RID, "layer": 0, "blocks": [0], "written": True}),
    ]


def _kv_client_setup():
    from ascendserve.connectors.transport.base import TransferError
    from ascendserve.connectors.transport.channel import ChannelClient
    from ascendserve.connectors.transport.shm import ShmTransport
    from ascendserve.connectors.transport.tcp import TcpTransport

    pages = _tiny_kv()
    transports = [TcpTransport(), ShmTransport(), None]
    peer = Peer()

    def one(data: bytes) -> None:
        if not data:
            return
        transport = transports[data[0] % 3]
        peer.answer(data[1:])
        client = ChannelClient(TOKEN, pages if transport else None, transport, connect_timeout_s=2.0,
                               io_timeout_s=2.0)
        try:
            if transport is None:
                client.free(peer.host, peer.port, RID)  # best effort: True or False, never an error
            else:
                heads = (0, 1, 1) if data[0] & 4 else None
                client.pull(peer.host, peer.port, RID, [0, 1], [2, 3], heads)
        except TransferError:
            pass
        finally:
            client.close()
    return one


def _kv_client_seeds():
    page = HEADS * 4 * 8 * 4
    ok = frame({"type": "OK"})
    return [
        b"\x00" + ok + frame({"type": "DATA"}, b"\x02" * (2 * LAYERS * page)),
        b"\x04" + ok + frame({"type": "DATA"}, b"\x02" * (2 * LAYERS * page // HEADS)),
        b"\x00" + frame({"type": "ERR", "reason": "invalid cluster token"}),
        b"\x01" + ok + frame({"type": "SHM", "name": "asf-kv-1-1", "size": 2 * LAYERS * page})
        + frame({"type": "LAYER", "layer": 0}) + frame({"type": "LAYER", "layer": 1}),
        b"\x02" + ok + frame({"type": "OK"}),
    ]


# ---- NetLoader ------------------------------------------------------------------------------
_CHECKPOINT: Path | None = None


def _tiny_checkpoint() -> Path:
    """A two-tensor safetensors model directory (removed when the process exits)."""
    global _CHECKPOINT
    if _CHECKPOINT is not None:
        return _CHECKPOINT
    root = _CHECKPOINT = Path(tempfile.mkdtemp(prefix="asf-fuzz-ckpt-"))
    atexit.register(shutil.rmtree, root, True)
    (root / "config.json").write_text(json.dumps({"architectures": ["Fuzz"], "model_type": "fuzz"}))
    tensors = {"a.weight": ("F32", [2, 3], b"\x01" * 24), "b.bias": ("BF16", [4], b"\x02" * 8)}
    header, blob = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(raw)]}
        blob += raw
    head = json.dumps(header).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + blob)
    return root


def _netloader_seed_setup():
    from ascendserve.netloader.checkpoint import CheckpointIndex, MemorySource
    from ascendserve.netloader.seed import Seed

    seed = Seed(MemorySource(CheckpointIndex.scan(_tiny_checkpoint())), TOKEN, "127.0.0.1", 0,
                handshake_s=2.0, idle_s=2.0)
    loop = Loopback()

    def one(data: bytes) -> None:
        ours, theirs = loop.pair(data)
        drainer = drain(ours)
        seed._serve(theirs, ("127.0.0.1", 0))  # handles every error itself: nothing may escape
        drainer.join()
        ours.close()
    return one


def _join() -> dict:
    from ascendserve.netloader.wire import WIRE_VERSION

    return {"type": "JOIN", "token": TOKEN, "identity": {"config_sha256": "0" * 64}, "tp_rank": 0, "tp_size": 1,
            "pp_rank": 0, "pp_size": 1, "version": WIRE_VERSION}


def _netloader_seed_seeds():
    old = {k: v for k, v in _join().items() if k != "version"}  # a version-1 joiner: refused with a reason
    return [frame(_join()) + frame({"type": "GET"}), frame(_join()), frame({**_join(), "token": "nope"}),
            frame({"type": "GET"}), frame(old) + frame({"type": "GET"}),
            frame({**_join(), "stream": 1}) + frame({"type": "GET", "part": 1, "parts": 2})]  # a further stream


def _netloader_client_setup():
    from ascendserve.netloader.checkpoint import identity
    from ascendserve.netloader.client import NetLoadError, fetch

    ident = identity(_tiny_checkpoint())
    peer = Peer()
    join_info = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1}

    def one(data: bytes) -> None:
        peer.answer(data)
        try:  # max_bytes: the loader always passes the host's headroom
            fetch(f"{peer.host}:{peer.port}", TOKEN, ident, join_info, timeout_s=2.0, max_bytes=1 << 20)
        except NetLoadError:
            pass
    return one


def _netloader_client_seeds():
    from ascendserve.netloader.checkpoint import CheckpointIndex, MemorySource

    from ascendserve.netloader.wire import CHECKSUM, WIRE_VERSION, crc32c

    source = MemorySource(CheckpointIndex.scan(_tiny_checkpoint()))
    index = source.index
    def ack_of(manifest: list) -> bytes:  # version 2: the manifest is the JOIN_ACK's payload
        return frame({"type": "JOIN_ACK", "version": WIRE_VERSION, "identity": index.identity,
                      "total_bytes": index.total_bytes}, msgspec.msgpack.encode(manifest))

    ack = ack_of(index.manifest())
    tensors = b"".join(frame({"type": "TENSOR", "index": i, "name": e.name}, bytes(source.view(e)))
                       for i, e in enumerate(index.entries))
    bad_crc = [{**e, CHECKSUM: crc32c(b"other")} for e in index.manifest()]
    # what a version-1 seed sent: no version, zlib's CRC-32 (refused before any GET)
    old = [{k: v for k, v in e.items() if k != CHECKSUM} | {"crc32": zlib.crc32(bytes(source.view(entry)))}
           for e, entry in zip(index.manifest(), index.entries)]
    return [ack + tensors + frame({"type": "DONE"}), ack,
            frame({"type": "JOIN_NACK", "reason": "busy"}),
            ack_of(bad_crc) + tensors + frame({"type": "DONE"}),
            frame({"type": "JOIN_ACK", "identity": index.identity, "manifest": old,
                   "total_bytes": index.total_bytes}) + tensors + frame({"type": "DONE"})]


# ---- registry (metaserver bodies, the proxy's view of the registry) ------------------------
def _registry_setup():
    from ascendserve.config import ProxyConfig
    from ascendserve.metaserver.app import _decode, _Expect
    from ascendserve.metaserver.push import PushDispatcher, PushError
    from ascendserve.metaserver.registry import Registry
    from ascendserve.protocol.kv_params import PushPrefillRequest
    from ascendserve.protocol.openai import APIError
    from ascendserve.protocol.registry import Deregistration, Heartbeat, Registration, RegistryView
    from ascendserve.router.discovery import MetaserverWatch
    from ascendserve.router.health import HealthMonitor
    from ascendserve.router.pools import Pools

    loop = asyncio.new_event_loop()
    registry = Registry(heartbeat_timeout_s=60.0)

    async def prefilled(url: str, body: dict, headers: dict) -> dict:  # P answers at once
        return {"id": "cmpl-x"}

    push = PushDispatcher(prefilled, ttl_s=0.02)  # asks that wait for sibling prompts end soon (504)

    class Metaserver:  # what MetaserverWatch reads the registry through (web/upstream.Upstream.get)
        raw = b""

        async def get(self, url: str, timeout_s: float, headers: dict | None = None) -> tuple[int, bytes]:
            return 200, self.raw

    metaserver = Metaserver()
    pools = Pools()
    watch = MetaserverWatch(pools, metaserver, HealthMonitor(pools, metaserver, ProxyConfig()), "http://ms",
                          TOKEN, 1.0, 1.0)
    kinds = [Registration, Heartbeat, Deregistration, _Expect, PushPrefillRequest]

    def client_error(exc: APIError | PushError) -> None:
        # 504: D asked for one prompt of a request whose other prompts never asked (by design:
        # push.py waits for all of them until the expectation's deadline); P never fails here
        if exc.status >= 500 and exc.status != 504:
            raise Finding(f"{exc.status} for a bad body: {exc}")

    async def ask(req: PushPrefillRequest, ticket: str) -> None:
        await asyncio.wait_for(push.ask(ticket, req), 5.0)

    def one(data: bytes) -> None:
        if not data:
            return
        which, raw = data[0] % 6, data[1:]
        if which == 5:  # the proxy: GET /v1/registry/instances answered with these bytes
            metaserver.raw = raw
            loop.run_until_complete(watch.sync_once())
            return
        try:
            body = _decode(raw, kinds[which])
            if isinstance(body, Registration):
                if (problem := body.check()) is not None:
                    raise APIError(400, problem)
                registry.register(body)
            elif isinstance(body, Heartbeat):
                registry.heartbeat(body.instance_id, body.load)
            elif isinstance(body, Deregistration):
                registry.remove(body.instance_id)
            elif isinstance(body, _Expect):
                push.expect(body.request_id, body.engine_request_ids, body.path, body.body, body.prefill_url)
            else:  # D's ticket: the expectation's, or (to fuzz it too) remote_engine_id when set
                exp = push._by_engine_id.get(body.request_id)
                ticket = body.remote_engine_id if body.remote_engine_id is not None else exp.ticket if exp else ""
                loop.run_until_complete(ask(body, ticket))
        except (APIError, PushError) as exc:
            client_error(exc)
        view = msgspec.json.encode(registry.view())  # GET /v1/registry/instances
        msgspec.json.decode(view, type=RegistryView)
        push.expire()
    return one


def _registry_seeds():
    enc = msgspec.json.encode
    reg = {"instance_id": "pd-1", "role": "pd", "url": "http://127.0.0.1:8000", "model": "m", "version": "1",
           "load": {"running": 1, "waiting": 0}, "seed": "127.0.0.1:9000", "seed_model": "ab"}
    view = {"revision": 3, "heartbeat_timeout_s": 6.0, "instances": [
        {**{k: reg[k] for k in ("instance_id", "role", "url", "model", "version", "load")}, "age_s": 1.5}]}
    expect = {"request_id": "r1", "engine_request_ids": ["cmpl-r1-0"], "path": "/v1/completions",
              "body": {"model": "m", "prompt": "hi"}, "prefill_url": "http://127.0.0.1:8100"}
    ask = {"request_id": "cmpl-r1-0", "token_ids": [1, 2], "remote_block_ids": [[4, 5]], "remote_host": "127.0.0.1",
           "remote_port": 7000, "remote_engine_id": "d"}
    return [b"\x00" + enc(reg), b"\x01" + enc({"instance_id": "pd-1", "load": {"running": 2}}),
            b"\x02" + enc({"instance_id": "pd-1"}), b"\x03" + enc(expect), b"\x04" + enc(ask),
            b"\x05" + enc(view)]


# ---- the proxy's client bodies ---------------------------------------------------------------
def _openai_setup():
    from ascendserve.protocol import kv_params
    from ascendserve.protocol.mm_hash import part_hash
    from ascendserve.protocol.openai import (APIError, estimated_tokens, max_new_tokens, mm_parts, only_part,
                                             parse)
    from ascendserve.router.media import encoder_tokens, image_size, part_url

    def one(data: bytes) -> None:
        if not data:
            return
        kind = "completions" if data[0] & 1 else "chat"
        try:
            body = parse(data[1:], kind)
        except APIError as exc:
            if exc.status >= 500:
                raise Finding(f"{exc.status} for a bad body: {exc}") from None
            return
        # what the pipeline derives from a checked body before (and while) it routes it
        estimated_tokens(body)
        max_new_tokens(body)
        kv_params.engine_request_ids(kind, "rid", body)
        if kind == "chat":
            parts = mm_parts(body)
            encoder_tokens([p for _, _, p in parts])
            for i, j, part in parts:
                only_part(body, i, j)
                image_size(part_url(part))
                part_hash(part, "/models/m", "sha256")
    return one


def _openai_seeds():
    import base64

    png = base64.b64encode(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + struct.pack(">II", 64, 32)
                           + b"\x08\x02\x00\x00\x00")
    jpeg = base64.b64encode(b"\xff\xd8\xff\xc0\x00\x11\x08\x00\x20\x00\x40\x03\x01\x22\x00")
    enc = msgspec.json.encode
    chat = {"model": "m", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [
                             {"type": "text", "text": "what is this"},
                             {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png.decode()}},
                             {"type": "image_url", "image_url": "data:image/jpeg;base64," + jpeg.decode(),
                              "uuid": ""}]}]}
    return [b"\x00" + enc(chat), b"\x01" + enc({"model": "m", "prompt": ["a", "b"], "n": 1}),
            b"\x00" + enc({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2}),
            b"\x01" + enc({"model": "m", "prompt": [1, 2, 3], "stream": False})]


# ---- EC store (memcached) ----------------------------------------------------------------------
def _ec_memcached_setup():
    from ascendserve.connectors.ec import memcached
    from ascendserve.connectors.ec.memcached import AsyncClient, Client, StoreError

    peer = Peer()
    loop = asyncio.new_event_loop()
    url = f"{peer.host}:{peer.port}"

    def one(data: bytes) -> None:
        if not data:
            return
        which, raw = data[0] % 3, data[1:]
        memcached.decode_header(raw)
        peer.answer(raw)
        try:
            if which == 0:
                loop.run_until_complete(AsyncClient(url, timeout_s=2.0).present(["h1", "h2"]))
            else:
                client = Client(url, timeout_s=2.0)
                try:
                    if which == 1:
                        header = memcached.get_header(client, "h1")
                        if header is not None and header.nbytes <= 1 << 16:
                            memcached.read_entry_into(client, "h1", header, memoryview(bytearray(header.nbytes)))
                    else:
                        client.get_into({"asf-ec:h1": memoryview(bytearray(8))})
                finally:
                    client.close()
        except (StoreError, TimeoutError):
            pass
    return one


def _ec_memcached_seeds():
    from ascendserve.connectors.ec import memcached

    header = msgspec.msgpack.encode(memcached.new_header("float32", (2, 2), 16, 8))
    value = b"VALUE asf-ec:h1 0 %d\r\n" % len(header) + header + b"\r\nEND\r\n"
    chunks = b"".join(b"VALUE asf-ec:h1:%s:%d 0 8\r\n" % (b"n", i) + b"\x00" * 8 + b"\r\n" for i in range(2))
    return [b"\x00" + value, b"\x01" + value + chunks + b"END\r\n", b"\x02" + b"END\r\n",
            b"\x02VALUE asf-ec:h1 0 8\r\n12345678\r\nEND\r\n"]


TARGETS = {t.name: t for t in [
    Target("frames", _frames_setup, _frames_seeds, "frames"),
    Target("kv_channel", _kv_channel_setup, _kv_channel_seeds, "frames", 1),
    Target("kv_channel_client", _kv_client_setup, _kv_client_seeds, "frames", 1),
    Target("netloader_seed", _netloader_seed_setup, _netloader_seed_seeds, "frames"),
    Target("netloader_client", _netloader_client_setup, _netloader_client_seeds, "frames"),
    Target("registry", _registry_setup, _registry_seeds, "json", 1),
    Target("openai_body", _openai_setup, _openai_seeds, "json", 1),
    Target("ec_memcached", _ec_memcached_setup, _ec_memcached_seeds),
]}


def _planted_setup():
    """A decoder with a bug of the kind found here (a peer's value used as a dict key): the
    harness must report it, with the input, within a CI-sized run (test_decoders.py)."""
    transports = {"tcp": 1}

    def one(data: bytes) -> None:
        prefix, body = data[:frames.PREFIX.size], data[frames.PREFIX.size:]
        try:
            hello = frames.decode_header(prefix, body[:frames.header_length(prefix)])
        except (frames.FrameError, struct.error):
            return
        if "transport" in hello:  # as the side channel did once HELLO carried a layout
            transports.get(hello["transport"])
    return one


# not in TARGETS: it fails by design
PLANTED = Target("planted", _planted_setup, lambda: [frame({"type": "HELLO", "token": TOKEN, "transport": "tcp"})],
                 "frames")


def target(name: str) -> Target:
    return PLANTED if name == PLANTED.name else TARGETS[name]


def replay(name: str, inputs: list[bytes]) -> None:
    """Run inputs through a target in this process (regression tests); a finding raises."""
    one = target(name).setup()
    for data in inputs:
        one(data)
