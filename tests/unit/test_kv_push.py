"""Layerwise push without vLLM: the planner's block ranges per step, and PushWorker
P -> D over a real loopback side channel."""

import importlib.util
import os
import time
from types import SimpleNamespace

import pytest
import torch

from ascendserve.connectors.kv.pull_plan import PullSettings
from ascendserve.connectors.kv.push_plan import PushMetadata, PushPlan, PushPlanner
from ascendserve.connectors.kv.push_worker import PushWorker
from ascendserve.protocol.kv_params import base_request_id
from tests.kvtools import results_until

BS = 4


def settings(ttl_s=30.0, transport="tcp"):
    return PullSettings(host="127.0.0.1", bind_host="127.0.0.1", port=0, ttl_s=ttl_s, transport=transport)


TRANSPORTS = ["tcp", "shm", pytest.param("mooncake", marks=pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None, reason="mooncake-transfer-engine not installed"))]


def caches(seed, blocks=16, layers=3):
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.attn": torch.randn((blocks, 2, 4, 32), generator=g) for i in range(layers)}


def step(new=(), cached=(), scheduled=None):
    """A SchedulerOutput with only the fields the planner reads."""
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                              new_block_ids=[(b,) if b else None for _, b, _ in cached],
                                              num_computed_tokens=[c for _, _, c in cached]),
        num_scheduled_tokens=scheduled or {}, total_num_scheduled_tokens=sum((scheduled or {}).values()))


def prefill_request(rid, prompt_len, d_blocks, cached=0, batch=None):
    params = {"request_id": "D-" + rid, "do_remote_decode": True, "remote_block_ids": d_blocks,
              "remote_host": "127.0.0.1", "remote_port": 9, "remote_cached_tokens": cached}
    if batch:
        params["batch_kv_transfer_params"] = batch
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, prompt_token_ids=list(range(prompt_len)))


def test_planner_pushes_each_chunk_and_marks_the_last():
    planner = PushPlanner(settings(), "e", 1, BS)
    req = prefill_request("p1", 10, [40, 41, 42])  # 10 tokens: 3 blocks of 4
    planner.update_state_after_alloc(req, None, 0)
    m1 = planner.build_connector_meta(step(new=[("p1", [7, 8], 0)], scheduled={"p1": 6}))
    assert m1.push == [PushPlan("D-p1", [7, 8], [40, 41], "127.0.0.1", 9, last=False)]
    m2 = planner.build_connector_meta(step(cached=[("p1", [9], 6)], scheduled={"p1": 4}))
    # the partly filled block 8 goes again with the rest of its tokens
    assert m2.push == [PushPlan("D-p1", [8, 9], [41, 42], "127.0.0.1", 9, last=True)]
    assert planner.build_connector_meta(step()).push == []


def test_planner_skips_blocks_decode_already_had():
    planner = PushPlanner(settings(), "e", 1, BS)
    req = prefill_request("p2", 12, [50], cached=8)  # D had the first 2 blocks cached
    planner.update_state_after_alloc(req, None, 0)
    meta = planner.build_connector_meta(step(new=[("p2", [1, 2, 3], 0)], scheduled={"p2": 12}))
    assert meta.push == [PushPlan("D-p2", [3], [50], "127.0.0.1", 9, last=True)]


def test_planner_pushes_the_blocks_prefill_had_cached():
    """P's prefix-cache hit: those blocks are computed before this step and D has none of them."""
    planner = PushPlanner(settings(), "e", 1, BS)
    planner.update_state_after_alloc(prefill_request("p3", 10, [40, 41, 42]), None, 0)
    meta = planner.build_connector_meta(step(new=[("p3", [7, 8, 9], 8)], scheduled={"p3": 2}))
    assert meta.push == [PushPlan("D-p3", [7, 8, 9], [40, 41, 42], "127.0.0.1", 9, last=True)]


def test_planner_with_hits_on_both_sides_pushes_what_decode_lacks():
    planner = PushPlanner(settings(), "e", 1, BS)
    planner.update_state_after_alloc(prefill_request("p4", 10, [50], cached=8), None, 0)  # D had 2 blocks
    meta = planner.build_connector_meta(step(new=[("p4", [7, 8, 9], 8)], scheduled={"p4": 2}))
    assert meta.push == [PushPlan("D-p4", [9], [50], "127.0.0.1", 9, last=True)]
    # P's hit larger than D's: P's cached blocks past D's go too
    planner.update_state_after_alloc(prefill_request("p5", 13, [60, 61, 62], cached=4), None, 0)
    meta = planner.build_connector_meta(step(new=[("p5", [1, 2, 3, 4], 12)], scheduled={"p5": 1}))
    assert meta.push == [PushPlan("D-p5", [2, 3, 4], [60, 61, 62], "127.0.0.1", 9, last=True)]


def test_planner_with_a_prefix_hit_and_chunked_prefill():
    planner = PushPlanner(settings(), "e", 1, BS)
    planner.update_state_after_alloc(prefill_request("p6", 20, [70, 71, 72, 73, 74]), None, 0)
    m1 = planner.build_connector_meta(step(new=[("p6", [1, 2, 3, 4], 8)], scheduled={"p6": 6}))
    assert m1.push == [PushPlan("D-p6", [1, 2, 3, 4], [70, 71, 72, 73], "127.0.0.1", 9, last=False)]
    m2 = planner.build_connector_meta(step(cached=[("p6", [5], 14)], scheduled={"p6": 6}))
    assert m2.push == [PushPlan("D-p6", [4, 5], [73, 74], "127.0.0.1", 9, last=True)]


def test_a_prefill_that_ends_before_its_push_tells_decode_at_the_next_step():
    planner = PushPlanner(settings(), "e", 1, BS)
    req = prefill_request("p7", 10, [40, 41, 42])
    planner.update_state_after_alloc(req, None, 0)
    planner.build_connector_meta(step(new=[("p7", [7, 8], 0)], scheduled={"p7": 6}))
    planner.request_finished(req, [7, 8])  # aborted mid-prompt
    meta = planner.build_connector_meta(step())
    assert meta.push == [PushPlan("D-p7", [], [], "127.0.0.1", 9, last=True, abandon=True)]
    assert planner.build_connector_meta(step()).push == []


def test_decode_stops_waiting_soon_after_the_prefill_finished(monkeypatch):
    from ascendserve.connectors.kv import push_worker

    monkeypatch.setattr(push_worker, "PREFILLED_GRACE_S", 0.3)
    d = PushWorker(settings(ttl_s=120.0), "tok", tp_rank=0, producer=False)
    d.register_kv_caches(caches(2))
    try:
        d.start_load_kv(PushMetadata(expect={"lost": [1]}))
        started = time.monotonic()
        d.start_load_kv(PushMetadata(prefilled=["lost"]))  # P is done, but nothing came
        _, _, failed = results_until(d, lambda g: "lost" in g[1], timeout=10)
        assert "lost" in failed and time.monotonic() - started < 5  # not the 120 s TTL
    finally:
        d.shutdown()


def test_planner_finds_its_prompt_in_a_batch():
    planner = PushPlanner(settings(), "e", 1, BS)
    batch = {"cmpl-x-0-aaaaaaaa": {"request_id": "cmpl-x-0-aaaaaaaa", "remote_block_ids": [1], "remote_host": "h",
                                   "remote_port": 1},
             "cmpl-x-1-bbbbbbbb": {"request_id": "cmpl-x-1-bbbbbbbb", "remote_block_ids": [2], "remote_host": "h",
                                   "remote_port": 1}}
    req = prefill_request("cmpl-x-1-cccccccc", 3, [0], batch=batch)
    planner.update_state_after_alloc(req, None, 0)
    meta = planner.build_connector_meta(step(new=[("cmpl-x-1-cccccccc", [5], 0)], scheduled={"cmpl-x-1-cccccccc": 3}))
    assert meta.push[0].request_id == "cmpl-x-1-bbbbbbbb" and meta.push[0].remote_blocks == [2]
    assert base_request_id("cmpl-x-1-bbbbbbbb") == "cmpl-x-1" and base_request_id("chatcmpl-abc") == "chatcmpl-abc"


@pytest.fixture(params=TRANSPORTS)
def pair(request):
    d = PushWorker(settings(transport=request.param), "tok", tp_rank=0, producer=False, expect_wait_s=2.0)
    d.register_kv_caches(caches(2))
    p = PushWorker(settings(transport=request.param), "tok", tp_rank=0, producer=True)
    p.register_kv_caches(caches(1))
    yield p, d, d.server.port
    p.shutdown(), d.shutdown()


def run_step(p, plans):
    meta = PushMetadata(push=plans)  # vLLM binds it before the forward, starts loads after
    for name in sorted(p.kv.layer_index()):
        p.save_kv_layer(name, meta)
    p.wait_for_save(meta)
    p.start_load_kv(meta)


def test_layers_arrive_and_complete(pair):
    p, d, port = pair
    d.start_load_kv(PushMetadata(expect={"r": [9, 3, 4]}))
    run_step(p, [PushPlan("r", [1, 2], [9, 3], "127.0.0.1", port, last=False)])
    run_step(p, [PushPlan("r", [2, 5], [3, 4], "127.0.0.1", port, last=True)])
    _, recvd, failed = results_until(d, lambda g: "r" in g[1])
    assert not failed
    for src, dst in zip(p.kv.layers, d.kv.layers):
        assert torch.equal(src[[1, 2, 5]], dst[[9, 3, 4]])
    # shm: the segment's name left /dev/shm once D had mapped it
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"asf-kv-{os.getpid()}-")]


def test_push_into_blocks_not_reserved_fails_the_request(pair):
    p, d, port = pair
    # the request has failed (and is no longer expected) after layer 0: each later layer waits this
    # long for it to be expected again before it is refused (the fixture's 2 s, twice, held P's sender)
    d.expect_wait_s = 0.2
    d.start_load_kv(PushMetadata(expect={"r": [9]}))
    run_step(p, [PushPlan("r", [1], [10], "127.0.0.1", port, last=True)])
    _, recvd, failed = results_until(d, lambda g: "r" in g[1])
    assert "r" in failed
    if d.settings.transport != "mooncake":  # a one-sided write lands before D can look at it:
        # with mooncake, D's safety is that P writes only the blocks D itself sent
        assert not torch.equal(p.kv.layers[0][1], d.kv.layers[0][10])


def test_missing_layers_fail_and_deadline_expires():
    d = PushWorker(settings(ttl_s=0.5), "tok", tp_rank=0, producer=False)
    d.register_kv_caches(caches(2))
    try:
        d.start_load_kv(PushMetadata(expect={"never": [1]}))
        _, _, failed = results_until(d, lambda g: "never" in g[1])
        assert "never" in failed
        d.start_load_kv(PushMetadata(expect={"partial": [1]}))
        d.receive("partial", 0, [1], d.kv.gather_layer(0, [2]))
        d.complete("partial", ok=True)  # only one layer of three arrived
        _, _, failed = results_until(d, lambda g: "partial" in g[1])
        assert "partial" in failed
    finally:
        d.shutdown()


def test_metaserver_failure_fails_the_load(pair):
    _, d, _ = pair
    d.start_load_kv(PushMetadata(expect={"r": [1]}))
    d.start_load_kv(PushMetadata(failed=["r"]))
    _, _, failed = results_until(d, lambda g: "r" in g[1])
    assert "r" in failed


def test_dead_decode_does_not_block_the_producer():
    p = PushWorker(settings(), "tok", tp_rank=0, producer=True)
    p.register_kv_caches(caches(1))
    try:
        started = time.monotonic()
        run_step(p, [PushPlan("r", [1], [2], "127.0.0.1", 1, last=True)])
        assert time.monotonic() - started < 1.0  # the step never waits on the network
        deadline, stats = time.monotonic() + 10, None
        while time.monotonic() < deadline and stats is None:
            stats = p.stats.take(None)
            time.sleep(0.05)
        assert stats is not None and stats.data["failures"] == 1  # the sender gave up, counted
    finally:
        p.shutdown()


def test_tp_mismatch_abandons_the_push_and_decode_fails_fast(pair):
    p, d, port = pair
    planner = PushPlanner(settings(), "e", 2, BS)  # this P runs TP 2; D says TP 1
    req = prefill_request("p9", 4, [3])
    req.kv_transfer_params.update(remote_port=port, remote_tp_size=1, request_id="D-p9")
    planner.update_state_after_alloc(req, None, 0)
    meta = planner.build_connector_meta(step(new=[("p9", [1], 0)], scheduled={"p9": 4}))
    assert meta.push[0].abandon
    d.start_load_kv(PushMetadata(expect={"D-p9": [3]}))
    run_step(p, meta.push)
    _, _, failed = results_until(d, lambda g: "D-p9" in g[1], timeout=5)
    assert "D-p9" in failed


def test_producer_gone_mid_push_fails_at_once(pair):
    import socket as _socket

    from ascendserve.protocol import frames

    _, d, port = pair
    d.start_load_kv(PushMetadata(expect={"r": [1, 2]}))
    with _socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        frames.send_frame(s, {"type": "HELLO", "token": "tok", "layout": d.kv.layout(), "transport": "tcp"})
        assert frames.read_frame(s, 0)["type"] == "OK"
        frames.send_frame(s, {"type": "PUSH", "request_id": "r", "layer": 0, "blocks": [1]},
                          d.kv.gather_layer(0, [5]).tobytes())
    started = time.monotonic()
    _, _, failed = results_until(d, lambda g: "r" in g[1], timeout=5)
    assert "r" in failed and time.monotonic() - started < 5  # long before its 30 s deadline


def test_decode_asks_the_metaserver_and_reports_a_refusal():
    planner = PushPlanner(settings(ttl_s=5.0), "e", 1, BS)
    try:
        req = SimpleNamespace(request_id="cmpl-x-0-abcdef12", prompt_token_ids=list(range(9)),
                              kv_transfer_params={"do_remote_prefill": True,
                                                  "metaserver": "http://127.0.0.1:1/v1/metaserver?ticket=t"})
        assert planner.get_num_new_matched_tokens(req, 0) == (9, True)
        blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [[6, 7, 8]])
        planner.update_state_after_alloc(req, blocks, 9)
        assert req.kv_transfer_params["do_remote_prefill"] is False  # asked once
        meta = planner.build_connector_meta(step())
        assert meta.expect == {"cmpl-x-0-abcdef12": [6, 7, 8]}
        # nothing listens on port 1: refused at once, so the refusal may already be in that first
        # step's metadata (it was, once in CI: a loop that looked only at later steps never saw it);
        # the asking thread starts its HTTP client first, which can take seconds on a loaded host:
        # the bound is generous, and every thread's stack is printed if it is ever reached
        deadline, failed = time.monotonic() + 60, list(meta.failed)
        while not failed and time.monotonic() < deadline:
            failed = planner.build_connector_meta(step()).failed
            time.sleep(0.05)
        if not failed:
            import faulthandler
            import sys

            faulthandler.dump_traceback(sys.stderr, all_threads=True)
        assert failed == ["cmpl-x-0-abcdef12"]
    finally:
        planner.shutdown()
