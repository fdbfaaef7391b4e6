"""Pin the JSON field names other systems depend on."""

import msgspec

from ascendserve.protocol import kv_params
from ascendserve.protocol.registry import Heartbeat, Registration, RegistryView


def test_pull_prefill_params_match_vllm_ascend_proxy():
    assert kv_params.pull_prefill_params() == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}


def test_push_decode_params():
    assert kv_params.push_decode_params("http://m:1/v1/metaserver?ticket=t") == {
        "do_remote_decode": False, "do_remote_prefill": True, "metaserver": "http://m:1/v1/metaserver?ticket=t"}


def test_pull_decode_params_fields():
    assert set(kv_params.PullDecodeParams.__struct_fields__) >= {
        "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
        "remote_host", "remote_port"}


def test_push_prefill_request_is_vllm_ascend_layerwise_body():
    body = {"token_ids": [], "request_id": "chatcmpl-abc", "do_remote_prefill": False, "do_remote_decode": True,
            "remote_block_ids": [[1, 2]], "remote_block_size": [128], "remote_engine_id": "e",
            "remote_host": "10.0.0.2", "remote_port": 7000, "remote_tp_size": 1, "remote_pcp_size": 1,
            "remote_dcp_size": 1, "remote_cached_tokens": 0}
    req = msgspec.json.decode(msgspec.json.encode(body), type=kv_params.PushPrefillRequest)
    assert msgspec.to_builtins(req) == body


def test_engine_request_ids():
    assert kv_params.engine_request_ids("chat", "r1", {}) == ["chatcmpl-r1"]
    assert kv_params.engine_request_ids("completions", "r1", {"prompt": "x"}) == ["cmpl-r1-0"]
    assert kv_params.engine_request_ids("completions", "r1", {"prompt": [1, 2, 3]}) == ["cmpl-r1-0"]
    assert kv_params.engine_request_ids("completions", "r1", {"prompt": ["a", "b"]}) == ["cmpl-r1-0", "cmpl-r1-1"]


def test_registry_messages():
    reg = Registration(instance_id="i", role="decode", url="http://h:1", model="m")
    assert set(msgspec.to_builtins(reg)) == {"instance_id", "role", "url", "model", "version", "load", "seed",
                                             "seed_model", "kv", "cache"}
    assert set(Heartbeat.__struct_fields__) == {"instance_id", "load"}
    assert set(RegistryView.__struct_fields__) == {"revision", "heartbeat_timeout_s", "instances"}
    assert Registration(instance_id="i", role="router", url="http://h:1", model="m").check()
    assert Registration(instance_id="i", role="elastic-server", url="http://h:1", model="m", seed="h:2",
                        seed_model="ab").check() is None


def test_frames_round_trip_and_reject_garbage():
    import socket

    import pytest

    from ascendserve.protocol import frames

    a, b = socket.socketpair()
    with a, b:
        frames.send_frame(a, {"type": "READ", "request_id": "r", "blocks": [1, 2]}, b"x" * 10)
        header = frames.read_frame(b, max_payload=100)
        assert header == {"type": "READ", "request_id": "r", "blocks": [1, 2], "payload": 10}
        assert frames.recv_exact(b, 10) == b"x" * 10
        a.sendall(b"GET / HTTP/1.1\r\n\r\n")
        with pytest.raises(frames.FrameError, match="bad magic"):
            frames.read_frame(b, 100)
    for prefix, body, needle in [
        (frames.PREFIX.pack(frames.MAGIC, 3), b"\x93\x01\x02\x03", "must be a map"),
        (frames.PREFIX.pack(frames.MAGIC, 2), b"\xc1\xc1", "undecodable"),
        (frames.PREFIX.pack(frames.MAGIC, 1), msgspec.msgpack.encode({"type": "X", "payload": -1}), "bad payload"),
    ]:
        with pytest.raises(frames.FrameError, match=needle):
            frames.decode_header(prefix, body)
    with pytest.raises(frames.FrameError, match="exceeds"):
        frames.header_length(frames.PREFIX.pack(frames.MAGIC, frames.MAX_HEADER + 1))
    a, b = socket.socketpair()
    with a, b:
        frames.send_frame(a, {"type": "BIG"}, b"y" * 101)
        with pytest.raises(frames.FrameError, match="exceeds 100"):
            frames.read_frame(b, 100)
