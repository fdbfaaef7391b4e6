"""PullWorker producer and consumer over a real loopback side channel, without vLLM."""

import time

import pytest
import torch

from ascendserve.connectors.kv.pull_plan import PullMetadata, PullSettings, RecvPlan
from ascendserve.connectors.kv.pull_worker import PullWorker
from ascendserve.connectors.transport.base import TransferError
from ascendserve.connectors.transport.tcp import TcpClient


def caches(seed, blocks=16):
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn((blocks, 2, 32, 64), generator=g) for i in range(4)}


@pytest.fixture()
def pair():
    settings = PullSettings(host="127.0.0.1", bind_host="127.0.0.1", port=0, ttl_s=30.0)
    p = PullWorker(settings, "tok", tp_rank=0, producer=True, hold_wait_s=2.0)
    p.register_kv_caches(caches(1))
    d = PullWorker(settings, "tok", tp_rank=0, producer=False)
    d.register_kv_caches(caches(2))
    yield p, d, p.server.port
    p.shutdown(), d.shutdown()


def results_until(worker, pred, timeout=10.0):
    got = [set(), set(), set()]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for acc, new in zip(got, worker.get_transfer_results()):
            acc |= new
        if pred(got):
            return got
        time.sleep(0.01)
    raise AssertionError(f"not reached: {got}")


def test_pull_moves_pages_and_frees_producer(pair):
    p, d, port = pair
    p.start_load_kv(PullMetadata(send={"req-p": ([3, 4, 5], 30.0)}))
    d.start_load_kv(PullMetadata(recv=[RecvPlan("req-d", [7, 1, 9], [3, 4, 5], "127.0.0.1", port, "req-p")]))
    sent, recvd, failed = results_until(d, lambda g: "req-d" in g[1])
    assert not failed
    for src, dst in zip(p.kv.layers, d.kv.layers):
        assert torch.equal(src[[3, 4, 5]], dst[[7, 1, 9]])
    sent, _, _ = results_until(p, lambda g: "req-p" in g[0])
    assert p.held_count() == 0


def test_read_that_arrives_before_the_hold_waits_for_it(pair):
    p, d, port = pair
    d.start_load_kv(PullMetadata(recv=[RecvPlan("req-d", [0], [2], "127.0.0.1", port, "late")]))
    time.sleep(0.3)
    p.start_load_kv(PullMetadata(send={"late": ([2], 30.0)}))
    _, recvd, failed = results_until(d, lambda g: "req-d" in g[1])
    assert not failed


def test_unknown_request_fails_and_expiry_frees(pair):
    p, d, port = pair
    d.start_load_kv(PullMetadata(recv=[RecvPlan("req-d", [0], [2], "127.0.0.1", port, "never-held")]))
    _, recvd, failed = results_until(d, lambda g: "req-d" in g[1], timeout=15)
    assert "req-d" in failed
    p.start_load_kv(PullMetadata(send={"short": ([1], 0.2)}))
    results_until(p, lambda g: "short" in g[0])


def test_dead_producer_fails_fast():
    settings = PullSettings(host="127.0.0.1", bind_host="127.0.0.1", port=0, ttl_s=30.0)
    d = PullWorker(settings, "tok", tp_rank=0, producer=False)
    d.register_kv_caches(caches(2))
    try:
        d.start_load_kv(PullMetadata(recv=[RecvPlan("r", [0], [1], "127.0.0.1", 1, "x")]))
        _, recvd, failed = results_until(d, lambda g: "r" in g[1])
        assert "r" in failed
    finally:
        d.shutdown()


def test_wrong_token_and_layout_refused(pair):
    p, d, port = pair
    with pytest.raises(TransferError, match="invalid cluster token"):
        TcpClient("nope", d.kv.layout()).read("127.0.0.1", port, "x", [0], memoryview(bytearray(1)))
    with pytest.raises(TransferError, match="layout mismatch"):
        TcpClient("tok", {"layers": 1}).read("127.0.0.1", port, "x", [0], memoryview(bytearray(1)))
    assert p.server.rejected == 2
