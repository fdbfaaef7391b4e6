"""Every input the fuzzers found (or that reading the decoders after a finding showed) stays fixed.

`regressions/<target>/` holds libFuzzer's saved inputs as found; CASES are
the same bugs minimised to what they need, each with where it used to fail.
Both replay through the target in this process, so a finding raises here.
The tests below them check what the client or peer sees now.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from ascendserve.protocol import frames
from ascendserve.protocol.openai import APIError, parse, prompt_chars
from ascendserve.protocol.wire import decode_json, decode_msgpack
from tests.fuzz.targets import TOKEN, TARGETS, frame, replay

HERE = Path(__file__).resolve().parent / "regressions"
DEEP_JSON = b"[" * 1200 + b"]" * 1200
DEEP_MSGPACK = b"\x91" * 1200 + b"\xc0"


def _hello(**extra) -> bytes:
    from tests.fuzz.targets import _layout

    return frame({"type": "HELLO", "token": TOKEN, "layout": _layout(), **extra})


CASES = [  # (target, input, what it did before the fix)
    ("frames", frames.PREFIX.pack(frames.MAGIC, len(DEEP_MSGPACK)) + DEEP_MSGPACK,
     "RecursionError from decode_header: a KV/NetLoader handler thread died instead of refusing the frame"),
    ("registry", b"\x00" + DEEP_JSON, "RecursionError: the metaserver answered 500"),
    ("registry", b"\x05" + b'{"revision":1,"heartbeat_timeout_s":1,"instances":[],"x":' + DEEP_JSON + b"}",
     "RecursionError: the proxy's registry watch task died and stopped following the metaserver"),
    ("registry", b'\x03{"request_id":"r","engine_request_ids":["e"],"path":"/v1/completions","body":{},'
                 b'"prefill_url":"http://127.0.0.1:1"}', "(the expectation the next input asks for)"),
    ("registry", '\x04{"request_id":"e","remote_engine_id":"\u00e9"}'.encode(),
     "TypeError from compare_digest on a non-ASCII ticket: the metaserver answered 500 (found by schemathesis)"),
    ("openai_body", b"\x00" + DEEP_JSON, "RecursionError: the proxy answered 500"),
    ("openai_body", b'\x00{"model":"m","messages":[{"role":"user","content":[{"type":{}}]}]}',
     "TypeError: unhashable part type, the proxy answered 500"),
    ("openai_body", b'\x00{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":7}]}]}',
     "TypeError: len() of a non-string text part, the proxy answered 500"),
    ("ec_memcached", b"\x00VALUE asf-ec:h1 0 .60\r\n", "ValueError from the proxy's EC lookup: 500"),
    ("ec_memcached", b"\x00VALUE asf-ec:h1 0 -5\r\n", "ValueError from the proxy's EC lookup: 500"),
    ("ec_memcached", b"\x01VALUE asf-ec:h1 0 99999999999999\r\n", "MemoryError: a buffer of the declared length"),
    ("ec_memcached", b"\x00VALUE asf-ec:\xff 0 0\r\n\r\nEND\r\n", "UnicodeDecodeError from the proxy's EC lookup"),
    ("kv_channel", lambda: b"\x00" + _hello(transport={}),
     "TypeError: a HELLO whose transport is a map killed the side-channel thread"),
    ("kv_channel_client", b"\x01" + frame({"type": "OK"}) + frame({"type": "SHM", "name": "asf-kv-\x00",
                                                                   "size": 2 * 2 * 256}),
     "ValueError (embedded null byte) out of ChannelClient.pull instead of TransferError"),
    ("netloader_client", lambda: frame({"type": "JOIN_ACK", "version": 2, "identity": _identity(), "total_bytes": 4},
                                       msgspec.msgpack.encode([{"name": "a", "dtype": {}, "shape": [1], "nbytes": 4,
                                                                "crc32c": 0}])),
     "TypeError out of fetch: the loader stopped instead of trying the next seed or the disk"),
]


def _identity() -> dict:
    from ascendserve.netloader.checkpoint import identity
    from tests.fuzz.targets import _tiny_checkpoint

    return identity(_tiny_checkpoint())


def _input(case) -> bytes:
    data = case[1]
    return data() if callable(data) else data  # some need the tiny cache's layout or model's identity


@pytest.mark.parametrize("target", sorted({t for t, _, _ in CASES}))
def test_minimised_findings_replay_clean(target):
    replay(target, [_input(c) for c in CASES if c[0] == target])


@pytest.mark.parametrize("target", sorted(p.name for p in HERE.iterdir() if p.is_dir()))
def test_saved_fuzzer_inputs_replay_clean(target):
    assert target in TARGETS
    replay(target, [p.read_bytes() for p in sorted((HERE / target).iterdir())])


def test_deep_nesting_is_a_decode_error():
    for decode, raw in ((decode_json, DEEP_JSON), (decode_msgpack, DEEP_MSGPACK)):
        with pytest.raises(msgspec.DecodeError, match="nested too deeply"):
            decode(raw)
    with pytest.raises(frames.FrameError, match="nested too deeply"):
        frames.decode_header(frames.PREFIX.pack(frames.MAGIC, len(DEEP_MSGPACK)), DEEP_MSGPACK)
    with pytest.raises(APIError) as err:
        parse(DEEP_JSON, "chat")
    assert err.value.status == 400


def test_odd_content_parts_are_ignored_by_the_proxy_estimates():
    body = parse(b'{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":7},'
                 b'{"type":"text","text":"abcd"},{"type":{}}]}]}', "chat")
    assert prompt_chars(body) == 4


def test_side_channel_refuses_a_read_of_more_blocks_than_the_cache_has():
    """READ [0]*N passed the holds check (block 0 is held) and made P send, or stage in
    shared memory, N pages for one small frame: now more blocks than exist is refused."""
    import threading

    from ascendserve.connectors.transport.channel import ChannelServer
    from ascendserve.connectors.transport.shm import ShmTransport
    from ascendserve.connectors.transport.tcp import TcpTransport
    from tests.fuzz.targets import BLOCKS, HeldBlocks, Loopback, RID, _tiny_kv

    pages = _tiny_kv()
    server = ChannelServer("127.0.0.1", 0, HeldBlocks(), pages, TOKEN,
                           {"tcp": TcpTransport(), "shm": ShmTransport()}, idle_timeout_s=5.0)
    for transport in ("tcp", "shm"):
        ours, theirs = Loopback().pair(_hello(transport=transport)
                                       + frame({"type": "READ", "request_id": RID, "blocks": [0] * (BLOCKS + 1)}))
        server._slots.acquire()
        t = threading.Thread(target=server._serve, args=(theirs, ("127.0.0.1", 0)))
        t.start()
        assert frames.read_frame(ours, 0)["type"] == "OK"
        refused = frames.read_frame(ours, 0)
        t.join(10)
        ours.close()
        assert refused["type"] == "ERR" and f"at most {BLOCKS}" in refused["reason"], refused
        assert server.rejected == (1 if transport == "tcp" else 2)


def test_health_probe_keeps_only_string_model_ids():
    """A backend listing {"id": [..]} made GET /v1/models answer 500 (unhashable id)."""
    from ascendserve.config import ProxyConfig
    from ascendserve.router.health import HealthMonitor
    from ascendserve.router.pools import Pools

    class Backend:  # what HealthMonitor reads /v1/models through (web/upstream.Upstream.get)
        async def get(self, url, timeout_s, headers=None):
            return 200, b'{"data": [{"id": ["x"]}, {"id": 5}, {"id": "m", "root": "/models/m"}]}'

    pools = Pools()
    inst = pools["pd"].add("http://127.0.0.1:1", source="static")
    assert asyncio.run(HealthMonitor(pools, Backend(), ProxyConfig())._probe(inst))
    assert inst.models == ("m",) and inst.root == "/models/m"


def test_an_ec_store_header_cannot_declare_any_size_or_chunk_count():
    """A memcached entry header is what the EC reader allocates (np.empty(nbytes)) and how many chunk
    keys it asks for (n): both must be bounded and agree with each other."""
    from ascendserve.connectors.ec import memcached

    def raw(**over) -> bytes:
        h = memcached.new_header("float32", (4, 8), 128, 64)
        return msgspec.msgpack.encode(msgspec.structs.replace(h, **over))

    assert memcached.decode_header(raw()) is not None
    assert memcached.decode_header(raw(nbytes=memcached.MAX_ENTRY_BYTES + 1, n=1)) is None
    assert memcached.decode_header(raw(n=10**9)) is None  # 128 bytes in 64-byte chunks is 2, not 10**9
    assert memcached.decode_header(raw(chunk=memcached.MAX_VALUE_BYTES + 1, n=1)) is None
    assert memcached.decode_header(raw(nbytes=-1)) is None
