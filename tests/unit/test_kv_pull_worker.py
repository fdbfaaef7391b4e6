"""PullWorker producer and consumer over a real loopback side channel, without vLLM,
for every transport (tcp, shm, and mooncake when its engine is installed)."""

import importlib.util
import os
import socket
import threading
import time

import pytest
import torch

from ascendserve.connectors.kv import pull_worker
from ascendserve.connectors.kv.hold_announcer import HoldAnnouncer
from ascendserve.connectors.kv.pull_plan import PullMetadata, PullPlanner, PullSettings, RecvPlan
from ascendserve.connectors.kv.pull_worker import PullWorker
from ascendserve.connectors.transport.base import TransferError
from ascendserve.connectors.transport.channel import ChannelClient, free_remote
from ascendserve.connectors.transport.mooncake import segments
from ascendserve.connectors.transport.tcp import TcpTransport
from ascendserve.protocol import frames
from tests.kvtools import results_until
from tests.ports import free_port_run

HAS_MOONCAKE = importlib.util.find_spec("mooncake") is not None
TRANSPORTS = ["tcp", "shm", pytest.param("mooncake", marks=pytest.mark.skipif(
    not HAS_MOONCAKE, reason="mooncake-transfer-engine not installed"))]


def caches(seed, blocks=16):
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn": torch.randn((blocks, 2, 32, 64), generator=g) for i in range(4)}


def settings(transport="tcp", ttl_s=30.0):
    return PullSettings(host="127.0.0.1", bind_host="127.0.0.1", port=0, ttl_s=ttl_s, transport=transport)


@pytest.fixture(params=TRANSPORTS)
def pair(request):
    p = PullWorker(settings(request.param), "tok", tp_rank=0, producer=True, hold_wait_s=2.0)
    p.register_kv_caches(caches(1))
    d = PullWorker(settings(request.param), "tok", tp_rank=0, producer=False)
    d.register_kv_caches(caches(2))
    yield p, d, p.server.port
    p.shutdown(), d.shutdown()


def shm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"asf-kv-{os.getpid()}-")}


def test_pull_moves_pages_and_frees_producer(pair):
    p, d, port = pair
    p.start_load_kv(PullMetadata(send={"req-p": ([3, 4, 5, 11], 30.0)}))
    d.start_load_kv(PullMetadata(recv=[RecvPlan("req-d", [7, 1, 9, 10], [3, 4, 5, 11], "127.0.0.1", port, "req-p")]))
    sent, recvd, failed = results_until(d, lambda g: "req-d" in g[1])
    assert not failed
    for src, dst in zip(p.kv.layers, d.kv.layers):
        assert torch.equal(src[[3, 4, 5, 11]], dst[[7, 1, 9, 10]])
    untouched = [b for b in range(16) if b not in (7, 1, 9, 10)]
    for fresh, dst in zip(caches(2).values(), d.kv.layers):
        assert torch.equal(fresh[untouched], dst[untouched])
    sent, _, _ = results_until(p, lambda g: "req-p" in g[0])
    assert p.held_count() == 0


def test_many_requests_reuse_connections(pair):
    p, d, port = pair
    for i in range(12):
        p.start_load_kv(PullMetadata(send={f"p{i}": ([i], 30.0)}))
    d.start_load_kv(PullMetadata(recv=[RecvPlan(f"d{i}", [15 - i], [i], "127.0.0.1", port, f"p{i}")
                                       for i in range(12)]))
    _, recvd, failed = results_until(d, lambda g: len(g[1]) == 12)
    assert not failed
    for src, dst in zip(p.kv.layers, d.kv.layers):
        assert torch.equal(src[list(range(12))], dst[[15 - i for i in range(12)]])
    results_until(p, lambda g: len(g[0]) == 12)


def test_read_that_arrives_before_the_hold_waits_for_it(pair, monkeypatch):
    p, d, port = pair
    waiting = threading.Event()
    wait_for = p._registered.wait_for

    def wait_for_and_tell(predicate, timeout=None):
        waiting.set()  # under P's lock: the hold below is registered once this wait has released it
        return wait_for(predicate, timeout)

    monkeypatch.setattr(p._registered, "wait_for", wait_for_and_tell)
    d.start_load_kv(PullMetadata(recv=[RecvPlan("req-d", [0], [2], "127.0.0.1", port, "late")]))
    assert waiting.wait(10)  # the READ is in and waits for a hold P has not registered yet
    p.start_load_kv(PullMetadata(send={"late": ([2], 30.0)}))
    _, recvd, failed = results_until(d, lambda g: "req-d" in g[1])
    assert not failed


def test_unknown_request_fails_and_expiry_frees(pair):
    p, d, port = pair
    p.hold_wait_s = 0.2  # how long a READ waits for its hold to be registered (the fixture's 2 s)
    d.start_load_kv(PullMetadata(recv=[RecvPlan("req-d", [0], [2], "127.0.0.1", port, "never-held")]))
    _, recvd, failed = results_until(d, lambda g: "req-d" in g[1], timeout=15)
    assert "req-d" in failed
    p.start_load_kv(PullMetadata(send={"short": ([1], 0.2)}))
    results_until(p, lambda g: "short" in g[0])


def test_blocks_the_request_does_not_hold_are_refused(pair):
    p, d, port = pair
    p.start_load_kv(PullMetadata(send={"r": ([1, 2], 30.0)}))
    d.start_load_kv(PullMetadata(recv=[RecvPlan("d", [0, 3], [2, 9], "127.0.0.1", port, "r")]))
    _, _, failed = results_until(d, lambda g: "d" in g[1])
    assert "d" in failed
    assert not torch.equal(p.kv.layers[0][9], d.kv.layers[0][3])


def test_dead_producer_fails_fast():
    d = PullWorker(settings(), "tok", tp_rank=0, producer=False)
    d.register_kv_caches(caches(2))
    try:
        d.start_load_kv(PullMetadata(recv=[RecvPlan("r", [0], [1], "127.0.0.1", 1, "x")]))
        _, recvd, failed = results_until(d, lambda g: "r" in g[1])
        assert "r" in failed
    finally:
        d.shutdown()


def test_idle_step_waits_for_a_transfer_instead_of_spinning(pair):
    p, d, port = pair
    p.start_load_kv(PullMetadata(send={"r": ([1], 30.0)}, idle=True))
    started = time.monotonic()
    assert p.get_transfer_results() == (set(), set(), set())
    assert time.monotonic() - started >= 0.004  # held something, nothing happened: it waited
    p.start_load_kv(PullMetadata(idle=False))
    waits = []
    monkeypatch_wait = p._changed.wait
    p._changed.wait = lambda timeout=None: waits.append(timeout) or monkeypatch_wait(timeout)
    p.get_transfer_results()
    assert waits == []  # a busy step never waits on purpose, even while something is held


def test_wrong_token_layout_and_transport_refused(pair):
    p, d, port = pair
    with pytest.raises(TransferError, match="invalid cluster token"):
        ChannelClient("nope", d.kv, TcpTransport()).pull("127.0.0.1", port, "x", [0], [0])
    other = PullWorker(settings(), "tok", tp_rank=0, producer=False)
    other.register_kv_caches({"layers.0.attn": torch.zeros((4, 2, 32, 64))})
    try:
        with pytest.raises(TransferError, match="layout mismatch"):
            other.client.pull("127.0.0.1", port, "x", [0], [0])
    finally:
        other.shutdown()
    assert p.server.rejected == 2


def test_control_session_frees_but_cannot_read(pair):
    p, d, port = pair
    p.start_load_kv(PullMetadata(send={"held": ([4], 30.0)}))
    assert free_remote("tok", "127.0.0.1", port, "held") == 1
    results_until(p, lambda g: "held" in g[0])
    assert free_remote("wrong", "127.0.0.1", port, "held") == 0
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        frames.send_frame(s, {"type": "HELLO", "token": "tok"})
        assert frames.read_frame(s, 0)["type"] == "OK"
        frames.send_frame(s, {"type": "READ", "request_id": "held", "blocks": [4]})
        assert "control session" in frames.read_frame(s, 0)["reason"]


def test_shm_segment_names_leave_dev_shm_once_decode_has_mapped_them():
    p = PullWorker(settings("shm"), "tok", tp_rank=0, producer=True)
    p.register_kv_caches(caches(1))
    d = PullWorker(settings("shm"), "tok", tp_rank=0, producer=False)
    d.register_kv_caches(caches(2))
    try:
        for i in range(3):  # the same connection, its segment mapped on both sides, no name left
            p.start_load_kv(PullMetadata(send={f"r{i}": ([1 + i, 2 + i], 30.0)}))
            d.start_load_kv(PullMetadata(recv=[RecvPlan(f"d{i}", [5 + i, 9 + i], [1 + i, 2 + i], "127.0.0.1",
                                                        p.server.port, f"r{i}")]))
            _, _, failed = results_until(d, lambda g, i=i: f"d{i}" in g[1])
            assert not failed and not shm_segments()
            for src, dst in zip(p.kv.layers, d.kv.layers):
                assert torch.equal(src[[1 + i, 2 + i]], dst[[5 + i, 9 + i]])
    finally:
        d.shutdown()
        p.shutdown()
    assert not shm_segments()


def test_mooncake_segments_coalesce_runs():
    def geometry(base, heads, page_heads_outermost=True):
        # pages of `heads` heads x 1 token x 5 bytes, heads outermost (the CPU layout)
        return {"bases": [base, base + 10_000], "order": "khn", "extent": {"k": 1, "h": heads, "n": 1},
                "stride": {"k": heads * 5, "h": 5, "n": 5}, "content": 5, "block_stride": heads * 5}

    dst, src, lengths = segments(geometry(1000, 2), geometry(0, 2), remote_blocks=[3, 4, 5, 9], local_blocks=[0, 1, 2, 7])
    assert src == [1030, 1090, 11030, 11090] and dst == [0, 70, 10000, 10070] and lengths == [30, 10, 30, 10]
    # one head run per page: P pages of 4 heads x 5 bytes, D pages of 2 heads x 5 bytes
    dst, src, lengths = segments(geometry(1000, 4), geometry(0, 2), remote_blocks=[3, 4], local_blocks=[0, 1],
                                 heads=(2, 0, 2))
    assert src[:2] == [1070, 1090] and dst[:2] == [0, 10] and lengths[:2] == [10, 10]


def test_free_that_arrives_before_the_hold_is_not_lost(pair):
    """P answers before its next step registers the hold; a FREE in between must still free it."""
    p, d, port = pair
    assert free_remote("tok", "127.0.0.1", port, "early") == 1
    p.start_load_kv(PullMetadata(send={"early": ([5, 6], 30.0)}))
    results_until(p, lambda g: "early" in g[0])  # reported as sent at once, not at its 30 s deadline
    assert p.held_count() == 0


# ---- holds announced by P's scheduler (hold_announcer.py), before the step registers them ----

def _sent_once(p, request_id: str, seconds: float = 0.3) -> None:
    """P reports `request_id` finished sending exactly once, now and in the steps after."""
    sent, _, _ = results_until(p, lambda g: request_id in g[0])
    later = [set(), set(), set()]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for acc, new in zip(later, p.get_transfer_results()):
            acc |= new
        time.sleep(0.01)
    assert request_id not in later[0], "reported twice: vLLM's scheduler would free a request it no longer has"


def test_announced_hold_is_read_before_any_step_registers_it(pair):
    """Under async scheduling P's next step may run only after a long prefill: D's READ must not
    wait for it. The step's metadata arriving later registers nothing a second time."""
    p, d, port = pair  # no step registers "req-p" before D reads it: only the announcement can
    announcer = HoldAnnouncer("127.0.0.1", port, 1, "tok")
    try:
        announcer.announce("req-p", [3, 4], 30.0)
        d.start_load_kv(PullMetadata(recv=[RecvPlan("req-d", [7, 1], [3, 4], "127.0.0.1", port, "req-p")]))
        _, _, failed = results_until(d, lambda g: "req-d" in g[1])
        # the announcer's thread counts its HOLD once sendall returns: on a loaded host P may have served
        # D's READ of it before that thread runs again
        deadline = time.monotonic() + 2
        while announcer.sent < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not failed and announcer.sent == 1
        for src, dst in zip(p.kv.layers, d.kv.layers):
            assert torch.equal(src[[3, 4]], dst[[7, 1]])
        _sent_once(p, "req-p")  # D freed it: reported, and the hold is gone
        p.start_load_kv(PullMetadata(send={"req-p": ([3, 4], 0.05)}))  # the step that was queued behind
        later = [set(), set(), set()]
        deadline = time.monotonic() + 0.3  # past the metadata's 0.05 s TTL: a second hold would expire
        while time.monotonic() < deadline:
            for acc, new in zip(later, p.get_transfer_results()):
                acc |= new
            time.sleep(0.01)
        assert "req-p" not in later[0] and p.held_count() == 0
    finally:
        announcer.close()


def test_the_step_first_then_the_announcement_registers_one_hold(pair):
    p, d, port = pair
    p.start_load_kv(PullMetadata(send={"r": ([2], 0.05)}))
    _sent_once(p, "r")  # expired unread and reported
    assert not p.announce("r", [2], 30.0, age_s=0.0)  # late: it finished lately, not held again
    assert p.held_count() == 0
    assert not p.announce("old", [2], 30.0, age_s=pull_worker.ANNOUNCE_MAX_AGE_S + 1)
    assert p.held_count() == 0


def test_free_before_the_announcement_is_not_lost(pair):
    p, d, port = pair
    assert free_remote("tok", "127.0.0.1", port, "early") == 1
    assert p.announce("early", [5], 30.0, age_s=0.0)
    _sent_once(p, "early")
    p.start_load_kv(PullMetadata(send={"early": ([5], 30.0)}))
    assert p.held_count() == 0


def _hold_frame(**fields) -> dict:
    return {"type": "HOLD", "request_id": "h", "blocks": [1], "ttl_s": 30.0, "at": time.time(), **fields}


@pytest.mark.parametrize("bad, reason", [
    (_hold_frame(blocks=[99]), "block ids"), (_hold_frame(blocks="1"), "block ids"),
    (_hold_frame(ttl_s=float("nan")), "non-negative"), (_hold_frame(at=None), "non-negative"),
    (_hold_frame(ttl_s=True), "non-negative")])
def test_malformed_announcement_is_refused(pair, bad, reason):
    p, d, port = pair
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        frames.send_frame(s, {"type": "HELLO", "token": "tok"})
        assert frames.read_frame(s, 0)["type"] == "OK"
        frames.send_frame(s, bad)
        assert reason in frames.read_frame(s, 0)["reason"]
    assert p.held_count() == 0


def test_announcement_from_another_host_is_refused(pair):
    """HOLD lets a caller name any blocks: only P's own scheduler, on this host, may send it."""
    p, d, port = pair
    with socket.create_server(("127.0.0.1", 0)) as listener:  # a TCP pair; the peer address is made up
        ours = socket.create_connection(listener.getsockname(), timeout=5)
        theirs, _ = listener.accept()
    try:
        ours.settimeout(5)
        frames.send_frame(ours, {"type": "HELLO", "token": "tok"})
        frames.send_frame(ours, _hold_frame())
        p.server._slots.acquire()  # as the accept loop does before _serve
        threading.Thread(target=p.server._serve, args=(theirs, ("192.0.2.7", 40000)), daemon=True).start()
        assert frames.read_frame(ours, 0)["type"] == "OK"
        assert "this host only" in frames.read_frame(ours, 0)["reason"]
    finally:
        ours.close()
    assert p.held_count() == 0


def test_planner_announces_a_finished_prefill_to_every_rank(monkeypatch):
    """P's scheduler side end to end: request_finished sends HOLD to the side channel of each
    of its TP ranks (base port + rank), whose workers then serve a READ with no step at all."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    monkeypatch.setenv("ASCENDSERVE_CLUSTER_TOKEN", "tok")
    base = free_port_run(2, derived=False)  # rank r's side channel listens on base + r
    ranks = []
    for rank in range(2):
        w = PullWorker(PullSettings("127.0.0.1", "127.0.0.1", base, 30.0), "tok", tp_rank=rank, producer=True,
                       hold_wait_s=0.2, tp_size=2)
        w.register_kv_caches(caches(rank))
        ranks.append(w)
    planner = PullPlanner(PullSettings("127.0.0.1", "127.0.0.1", base, 30.0), "engine", tp_size=2)
    try:
        request = SimpleNamespace(request_id="fin", kv_transfer_params={"do_remote_decode": True},
                                  status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=20)
        delay, params = planner.request_finished(request, [2, 3])
        assert delay and params["remote_port"] == base
        for w in ranks:
            wait_for = time.monotonic() + 10
            while w.held_count() == 0 and time.monotonic() < wait_for:
                time.sleep(0.01)
            assert w.held_count() == 1, f"rank {w.tp_rank} never heard of the hold"
        assert planner.announcer.sent == 2
    finally:
        planner.shutdown()
        for w in ranks:
            w.shutdown()


def test_a_refused_announcer_backs_off_instead_of_reconnecting_per_hold(pair):
    """A rank that refuses HOLD (here: blocks it does not have) is named once in the log and left
    alone for a minute; the steps register the holds meanwhile."""
    p, d, port = pair
    announcer = HoldAnnouncer("127.0.0.1", port, 1, "tok")

    def settled(n: int) -> None:
        deadline = time.monotonic() + 10
        while announcer.sent + announcer.dropped < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert announcer.sent + announcer.dropped == n

    try:
        announcer.announce("r0", [999], 30.0)
        settled(1)
        import select

        assert select.select([announcer._socks[0]], [], [], 10)[0]  # P's ERR has arrived
        for i in range(1, 4):
            announcer.announce(f"r{i}", [1], 30.0)
        settled(4)
        assert (announcer.sent, announcer.dropped) == (1, 3) and p.server.rejected == 1
        assert p.held_count() == 0
    finally:
        announcer.close()


def test_a_socket_past_fd_setsize_is_not_taken_for_closed():
    """The announcer checks its connection with poll(), not select(): an engine core may hold
    more than 1,024 descriptors, and select() refuses those (it would reconnect for every hold)."""
    import resource

    from ascendserve.connectors.kv.hold_announcer import _closed

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= 1500:
        pytest.skip("open files limit too low for a descriptor past FD_SETSIZE")
    a, b = socket.socketpair()
    high = socket.socket(fileno=os.dup2(a.fileno(), 1500))
    try:
        assert _closed(high) == (False, None)
        b.close()
        assert _closed(high) == (True, None)
    finally:
        high.close()
        a.close()


def test_an_idle_step_waits_longer_while_a_transfer_is_in_flight_and_no_longer_than_it(pair, monkeypatch):
    """A CPU host's idle steps, one per 5 ms, had the engine loops take most of the cores during
    a pull: while one is in flight an idle step waits up to TRANSFER_STEP_WAIT_S, and returns
    the moment it ends (the pull's own end is never delayed)."""
    p, d, port = pair
    p.start_load_kv(PullMetadata(send={"r": ([1], 30.0)}, idle=True))
    assert p._idle_wait() == pull_worker.IDLE_STEP_WAIT_S  # held, nothing being read
    p.acquire("r", [1])  # a read being served
    assert p._idle_wait() == pull_worker.TRANSFER_STEP_WAIT_S
    # a wait far longer than the read, so that returning early can only be the read's end waking
    # it (not a timer that fired late on a loaded host)
    monkeypatch.setattr(pull_worker, "TRANSFER_STEP_WAIT_S", 10.0)
    threading.Timer(0.1, p.release, args=("r",)).start()
    started = time.monotonic()
    p.get_transfer_results()
    took = time.monotonic() - started
    assert 0.09 < took < 5, took  # it waited for the read, and was woken by its end
    assert p._idle_wait() == pull_worker.IDLE_STEP_WAIT_S
    with d._lock:
        d._pending += 1  # D: a pull queued or running
    assert d._idle_wait() == pull_worker.TRANSFER_STEP_WAIT_S
    with d._lock:
        d._pending -= 1
    staged = PullWorker(settings(), "tok", tp_rank=0, producer=False)
    staged.register_kv_caches(caches(3))
    staged.kv.device = torch.device("cuda")  # what a device's cache reports: its host has cores to spare
    with staged._lock:
        staged._pending += 1
    assert staged._idle_wait() == pull_worker.IDLE_STEP_WAIT_S
    staged.shutdown()
