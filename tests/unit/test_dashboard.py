"""ascendserve/dashboard: the event feed, the charts' history, the proxy's and the metaserver's
snapshots, and the hub's server-sent events (framing, sharing, events at once, slow pages)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from ascendserve.config import ProxyConfig
from ascendserve.dashboard.events import EventFeed, compose
from ascendserve.dashboard.hub import Hub, frame
from ascendserve.dashboard.kv_rates import KVRates, parse
from ascendserve.dashboard.proxy_view import ProxySource
from ascendserve.dashboard.registry_view import RegistrySource
from ascendserve.dashboard.series import History, Reading, quantile
from ascendserve.metaserver.registry import Registry
from ascendserve.protocol.registry import Load, Registration
from ascendserve.router.discovery import RegistryWatch
from ascendserve.router.health import HealthMonitor
from ascendserve.router.metrics import ITL_BUCKETS, LATENCY_BUCKETS, ProxyMetrics
from ascendserve.router.pools import ACTIVE, EJECTED, Pools
from ascendserve.protocol.registry import InstanceView, RegistryView


# ---- the event feed ----------------------------------------------------------------------------

def test_feed_keeps_the_last_events_in_order_and_tells_listeners_at_once():
    feed = EventFeed(size=3, clock=lambda: 100.0)
    heard = []
    feed.listen(heard.append)
    for n in range(5):
        feed.add("joined", "decode", f"http://d{n}")
    assert [e.url for e in feed.recent()] == ["http://d2", "http://d3", "http://d4"]
    assert [e.seq for e in heard] == [1, 2, 3, 4, 5] and feed.recent(1)[0].seq == 5


def test_health_state_changes_reach_the_feed_beside_the_kv_hook():
    """The feed composes with HealthMonitor's existing on_state hook (KV routing's), not replaces it."""
    pools = Pools()
    inst = pools["decode"].add("http://d")
    pools["decode"].set_state(inst, ACTIVE)
    kv_hook = []
    feed = EventFeed()
    health = HealthMonitor(pools, None, ProxyConfig(eject_after=1), on_state=lambda *a: kv_hook.append(a[1:]))
    health.on_state = compose(health.on_state, feed.on_state)
    inst.last_error = "GET http://d/health: timeout"
    health._set(inst, EJECTED, "ejected after failed health checks")
    health._set(inst, ACTIVE, "admitted")
    assert kv_hook == [(EJECTED, ACTIVE), (ACTIVE, EJECTED)]
    kinds = [(e.kind, e.state) for e in feed.recent()]
    assert kinds == [("ejected", "ejected"), ("readmitted", "active")]
    assert "timeout" in feed.recent()[0].detail


def test_registry_joins_and_leaves_reach_the_feed():
    pools = Pools()
    feed = EventFeed()
    watch = RegistryWatch(pools, HealthMonitor(pools, None, ProxyConfig()), forget_after_s=10, clock=lambda: 0.0)
    watch.on_event = feed.on_registry
    view = RegistryView(revision=1, heartbeat_timeout_s=6, instances=[InstanceView(
        instance_id="d1", role="decode", url="http://d:1", model="m", version="", load=Load(), age_s=0)])
    watch.apply(view)
    inst = pools["decode"].instances["http://d:1"]
    pools["decode"].set_state(inst, ACTIVE)
    inst.last_ok = -1.0  # not answered since it left
    watch.apply(RegistryView(revision=2, heartbeat_timeout_s=6, instances=[]))
    assert [(e.kind, e.url) for e in feed.recent()] == [("joined", "http://d:1"), ("suspect", "http://d:1")]


# ---- history and quantiles ----------------------------------------------------------------------

def test_quantile_interpolates_inside_the_bucket_like_prometheus():
    bounds = (0.1, 0.2, 0.4)
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None
    assert quantile(0.5, bounds, [10, 10, 10, 10]) == pytest.approx(0.05)  # all in the first bucket
    assert quantile(0.5, bounds, [0, 10, 20, 20]) == pytest.approx(0.2)  # the 10th of 20 ends bucket 2
    assert quantile(0.75, bounds, [0, 10, 20, 20]) == pytest.approx(0.3)
    assert quantile(0.99, bounds, [0, 0, 0, 5]) == 0.4  # in +Inf: the largest finite bound


def test_history_rates_and_quantiles_come_from_the_window_not_the_totals():
    h = History({"lat": (0.1, 1.0)}, keep=100, window_s=2)
    for t in range(6):  # 10 requests a second; the last 2 s of latencies are all slow
        slow = max(0, t - 3) * 10
        h.record(Reading(t=float(t), counters={"req": 10.0 * t},
                         histograms={"lat": [10.0 * t - slow, 10.0 * t, 10.0 * t]}))
    point = h.point()
    assert point["req_rate"] == 10.0
    assert point["lat_p50"] > 0.1  # the window saw only slow ones; the totals are mostly fast
    cols = h.columns()
    assert len(cols["t"]) == 6 and cols["req_rate"][0] == 0.0


# ---- the proxy's snapshot ------------------------------------------------------------------------

def _proxy():
    pools = Pools()
    for role, url in (("prefill", "http://p:1"), ("decode", "http://d:1"), ("decode", "http://d:2")):
        pools[role].set_state(pools[role].add(url), ACTIVE)
    metrics = ProxyMetrics(pools)
    return pools, metrics, ProxySource("proxy test", pools, metrics, upstream=None, clock=lambda: 1000.0)


def test_proxy_snapshot_equals_its_metrics():
    pools, metrics, source = _proxy()
    p, d = pools["prefill"].instances["http://p:1"], pools["decode"].instances["http://d:1"]
    pools["prefill"].lease(p, 100, kv=7)
    pools["decode"].lease(d, 50)
    pools["decode"].set_state(pools["decode"].instances["http://d:2"], EJECTED)
    for status in ("200", "200", "503"):
        metrics.requests.labels("completions", status).inc()
    metrics.errors.labels("backend").inc()
    metrics.retries.labels("decode").inc(2)
    metrics.migrations.labels("decode", "stall").inc()
    metrics.encoder_skips.inc(3)
    metrics.fallbacks.inc(1)
    snap = source.snapshot()
    json.dumps(snap)  # what the page gets is JSON
    by_url = {i["url"]: i for i in snap["instances"]}
    assert by_url["http://p:1"]["in_flight"] == 1 and by_url["http://p:1"]["active_kv"] == 7
    assert by_url["http://d:1"]["in_flight"] == 1 and by_url["http://d:2"]["state"] == "ejected"
    assert by_url["http://d:1"]["kv_usage"] is None  # a static instance reports none (no heartbeat)
    t = snap["totals"]
    assert (t["requests"], t["ok"], t["failed"], t["in_flight"]) == (3, 2, 1, 2)
    assert t["errors"] == {"backend": 1} and t["retries"] == {"decode": 2} and t["migrations"] == {"stall": 1}
    assert t["ec_hit_rate"] == pytest.approx(3 / 4)  # 3 skips, 1 fallback, no encoder call
    assert snap["topology"] == "P → D (pull)" and snap["not_measured"] == []
    text = metrics.render().decode()  # the same figures as /metrics
    assert 'ascendserve_proxy_in_flight{instance="http://p:1",role="prefill"} 1.0' in text
    assert 'ascendserve_proxy_requests_total{route="completions",status="200"} 2.0' in text


def test_proxy_history_charts_ttft_percentiles():
    _, metrics, source = _proxy()
    clock = iter(range(1000, 1100))
    source.clock = lambda: float(next(clock))
    source.record()
    for _ in range(20):
        metrics.ttft.observe(0.03)
        metrics.requests.labels("chat", "200").inc()
    source.record()
    point = source.series.point()
    assert point["requests_rate"] == 20.0
    assert LATENCY_BUCKETS[2] < point["ttft_p50"] <= LATENCY_BUCKETS[3]  # 0.03 lies in (0.025, 0.05]
    assert point["e2e_p50"] is None  # nothing observed


def test_proxy_history_charts_inter_token_latency():
    """A streamed request's mean gap between tokens after the first, in finer buckets than TTFT."""
    _, metrics, source = _proxy()
    clock = iter(range(1000, 1100))
    source.clock = lambda: float(next(clock))
    source.record()
    first = time.monotonic() - 0.18  # 10 tokens, the first 180 ms ago: 20 ms a gap
    for _ in range(5):
        metrics.observe_itl(first, 10)
    metrics.observe_itl(first, 1)  # one token: no gap
    metrics.observe_itl(None, 10)  # never streamed a token
    source.record()
    assert metrics.itl._sum.get() == pytest.approx(5 * 0.02, rel=0.25)
    point = source.series.point()
    assert ITL_BUCKETS[4] < point["itl_p50"] <= ITL_BUCKETS[6]  # about 0.02: in (0.015, 0.025]


def test_registry_instances_show_the_engines_load():
    pools, _, source = _proxy()
    inst = pools["decode"].instances["http://d:1"]
    inst.source, inst.kv_usage, inst.others = "registry", 0.42, 5
    row = next(i for i in source.snapshot()["instances"] if i["url"] == "http://d:1")
    assert row["kv_usage"] == 0.42 and row["others"] == 5


# ---- KV transfer rates ------------------------------------------------------------------------

def test_kv_rates_from_the_engines_counters():
    text = (b"# HELP x\nascendserve:kv_transfer_bytes_total{engine=\"0\"} 2e9\n"
            b"ascendserve:kv_transfer_bytes_total{engine=\"1\"} 1e9\nascendserve:kv_transfer_seconds_sum 1.5\n"
            b"ascendserve:kv_transfer_bytes_created 5\n")
    assert parse(text) == (3e9, 1.5)
    assert parse(b"vllm:num_requests_running 1\n") is None
    answers = iter([text, text.replace(b"2e9", b"6e9").replace(b"1.5", b"2.5")])
    times = iter([10.0, 12.0])

    async def get(url):
        return next(answers)

    rates = KVRates(get, clock=lambda: next(times))
    asyncio.run(rates.poll(["http://d:1"]))
    assert rates.of("http://d:1")["gbps"] is None  # one reading: no rate yet
    asyncio.run(rates.poll(["http://d:1"]))
    assert rates.of("http://d:1") == {"bytes": 7e9, "gbps": 2.0, "link_gbps": 4.0}


# ---- the metaserver's snapshot ----------------------------------------------------------------

def test_metaserver_snapshot_and_registry_events():
    now = [0.0]
    registry = Registry(6.0, clock=lambda: now[0])
    feed = EventFeed()
    source = RegistrySource("metaserver test", registry, feed, upstream=None, heartbeat_interval_s=2.0)
    reg = Registration(instance_id="d1", role="decode", url="http://d:1", model="m",
                       load=Load(running=3, waiting=2, kv_usage=0.5))
    registry.register(reg)
    registry.register(reg)  # registered again while registered: a new process at the same id
    now[0] = 5.0
    snap = source.snapshot()
    (row,) = snap["instances"]
    assert (row["running"], row["waiting"], row["kv_usage"], row["state"]) == (3, 2, 0.5, "late")
    assert snap["totals"]["running"] == 3
    now[0] = 20.0
    registry.expire()
    assert [e.kind for e in feed.recent()] == ["joined", "restarted", "expired"]


# ---- the hub: server-sent events ----------------------------------------------------------------

class _Source:
    def __init__(self):
        self.built = 0
        self.recorded = 0

    def record(self):
        self.recorded += 1

    def snapshot(self):
        self.built += 1
        return {"n": self.built, "text": "line\nbreak"}

    def history(self):
        return {"t": [1.0]}

    async def poll(self):
        pass


def _frames(data: bytes) -> list[tuple[str, object]]:
    out = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((fields.get("event", "retry"), json.loads(fields["data"]) if "data" in fields else fields["retry"]))
    return out


def test_sse_framing_one_json_line_per_frame():
    data = frame("snapshot", b'{"a":"x\\ny"}')
    assert data == b'event: snapshot\ndata: {"a":"x\\ny"}\n\n'


def test_hub_sends_history_events_snapshot_then_shares_one_snapshot_per_tick():
    async def run():
        source, feed = _Source(), EventFeed()
        hub = Hub(source, feed, interval_s=1.0)
        feed.add("joined", "decode", "http://d")
        streams = [hub.stream() for _ in range(50)]
        first = await streams[0].__anext__()
        for s in streams[1:]:
            await s.__anext__()
        subs = list(hub.subscribers)
        kinds = [k for k, _ in _frames(first)]
        assert kinds == ["retry", "history", "events", "snapshot"]
        built = source.built
        hub.tick()
        assert source.built == built + 1  # one snapshot for 50 pages
        assert len(subs) == 50 and all(s.frames[0] is subs[0].frames[0] for s in subs)  # the very same bytes
        feed.add("ejected", "decode", "http://d", "ejected")  # an event goes out at once, not at the next tick
        got = _frames(await streams[0].__anext__())
        assert [k for k, _ in got] == ["snapshot", "event"] and got[1][1]["kind"] == "ejected"
        assert got[0][1]["text"] == "line\nbreak"
        assert got[0][1]["dashboard"]["pages"] == 50 and got[0][1]["dashboard"]["cpu_ms"] >= 0
        hub.snapshot_json()
        assert source.built == built + 1  # asked again within the second: the cached one
        for s in streams:
            await s.aclose()
        assert not hub.subscribers
        hub.tick()  # no page: a reading for the charts, no snapshot
        assert source.built == built + 1 and source.recorded == 2

    asyncio.run(run())


def test_a_page_that_stops_reading_is_dropped():
    async def run():
        source, feed = _Source(), EventFeed()
        hub = Hub(source, feed, max_queued=5)
        slow, reader = hub.subscribe(), hub.subscribe()
        stream = hub.stream(reader)
        for _ in range(10):
            hub.tick()
            await stream.__anext__()
        assert slow.closed and slow not in hub.subscribers
        assert not reader.closed and reader in hub.subscribers
        await stream.aclose()
        await hub.close()

    asyncio.run(run())


def test_metaserver_on_etcd_lists_the_registry_and_tells_joins_and_leaves(monkeypatch):
    from ascendserve.dashboard import registry_view
    from ascendserve.discovery.etcd import EtcdSettings

    listings = iter([
        [{"instance_id": "p1", "role": "prefill", "url": "http://p:1", "model": "m", "load": {"running": 2}}],
        [{"instance_id": "d1", "role": "decode", "url": "http://d:1", "model": "m", "future_field": 1},
         {"instance_id": "bad", "role": "router", "url": "http://x:1", "model": "m"}],
    ])
    monkeypatch.setattr(registry_view.etcd, "instances", lambda settings: next(listings))
    feed = EventFeed()
    source = RegistrySource("metaserver test", Registry(6.0), feed, upstream=None, heartbeat_interval_s=2.0,
                            etcd_settings=EtcdSettings(("http://127.0.0.1:2379",), "default", 10))
    source.kv.poll = _no_poll
    asyncio.run(source.poll())
    snap = source.snapshot()
    assert [(i["url"], i["running"]) for i in snap["instances"]] == [("http://p:1", 2)] and not feed.recent()
    asyncio.run(source.poll())
    assert [i["url"] for i in source.snapshot()["instances"]] == ["http://d:1"]  # the bad entry is skipped
    assert sorted((e.kind, e.url) for e in feed.recent()) == [("joined", "http://d:1"), ("left", "http://p:1")]


async def _no_poll(urls):
    return None


def test_stopping_ends_every_stream_and_takes_no_new_one():
    """web/server calls the app's stop_hooks on SIGTERM: granian waits for open responses, and an
    event stream never ends by itself."""
    async def run():
        hub = Hub(_Source(), EventFeed())
        stream = hub.stream()
        await stream.__anext__()
        hub.stop()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        late = hub.stream()
        with pytest.raises(StopAsyncIteration):
            await late.__anext__()
        assert not hub.subscribers

    asyncio.run(run())


def test_the_apps_give_the_server_their_stop_hooks():
    from ascendserve.config import load
    from ascendserve.metaserver.app import create_app as metaserver_app
    from ascendserve.router.app import create_app as proxy_app

    for app in (proxy_app(load("proxy", None, {}, env={})), metaserver_app(load("metaserver", None, {}, env={}))):
        (hook,) = app.state.stop_hooks
        assert hook.__self__.__class__ is Hub
