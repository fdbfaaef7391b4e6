"""router/discovery: the proxy's pools follow the registry; an instance that left it is suspect, not dead."""

from ascendserve.config import ProxyConfig
from ascendserve.discovery import etcd
from ascendserve.protocol.registry import InstanceView, Load, RegistryView
from ascendserve.router.discovery import EtcdWatch, MetaserverWatch, view_of
from ascendserve.router.health import HealthMonitor
from ascendserve.router.pools import ACTIVE, DRAINING, PROBING, SUSPECT, Pools

URL = "http://127.0.0.1:8301"
OTHER = "http://127.0.0.1:8302"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def view(revision: int, *urls: str, running: int = 0) -> RegistryView:
    return RegistryView(revision=revision, heartbeat_timeout_s=6.0, instances=[
        InstanceView(instance_id=f"decode-{u[-4:]}", role="decode", url=u, model="m", version="",
                     load=Load(running=running), age_s=0.0) for u in urls])


def watched(forget_after_s: float = 12.0):
    pools = Pools()
    watch = MetaserverWatch(pools, None, HealthMonitor(pools, None, ProxyConfig()), "http://meta", "", 1.0, 1.0,
                            forget_after_s)
    watch.clock = Clock()
    return pools, watch


def admitted(pools, watch, *urls):
    watch.apply(view(1, *urls))
    for url in urls:
        inst = pools["decode"].instances[url]
        pools["decode"].set_state(inst, ACTIVE)
        inst.last_ok = watch.clock.now - 5  # it last answered before it left
    return [pools["decode"].instances[u] for u in urls]


def test_instance_that_left_the_registry_is_suspect_and_gets_no_new_requests_while_another_is_active():
    pools, watch = watched()
    one, other = admitted(pools, watch, URL, OTHER)
    watch.apply(view(2, OTHER))
    assert one.state == SUSPECT
    pool = pools["decode"]
    for _ in range(5):
        assert pool.select() is other, "a suspect instance is not chosen while its role has an active one"
        pool.lease(other, 100)
    assert [i.url for i in pool.active()] == [OTHER]


def test_a_suspect_instance_is_the_last_resort_of_its_role():
    """The only prefill missed one heartbeat under CPU oversubscription: the proxy kept answering 503.
    Slow is not dead: while nothing else is active, the suspect instance is still routed to."""
    pools, watch = watched()
    (one,) = admitted(pools, watch, URL)
    watch.apply(view(2))
    assert one.state == SUSPECT
    assert pools["decode"].select() is one
    assert pools.has_active("decode") and pools["decode"].active() == [one]
    assert not [m for m in pools.readiness().missing if "decode" in m], "decode can still be served"


def test_suspect_instance_that_answers_is_routed_to_again_without_registering():
    pools, watch = watched()
    one, _ = admitted(pools, watch, URL, OTHER)
    watch.apply(view(2, OTHER))
    assert one.state == SUSPECT
    watch.clock.now += 1
    one.last_ok = watch.clock.now  # a request it served finished, or its /health answered
    watch.review()
    assert one.state == ACTIVE
    watch.clock.now += 100
    watch.review()
    assert one.state == ACTIVE, "it still answers: a lapsed registration alone does not drop it"


def test_suspect_instance_silent_past_the_grace_is_drained_then_forgotten_once_idle():
    pools, watch = watched(forget_after_s=12.0)
    one, _ = admitted(pools, watch, URL, OTHER)
    lease = pools["decode"].lease(one, 10)
    watch.apply(view(2, OTHER))
    watch.clock.now += 11
    watch.review()
    assert one.state == SUSPECT
    watch.clock.now += 2
    watch.review()
    assert one.state == DRAINING
    lease.release(ok=False)
    assert URL not in pools["decode"].instances


def test_instance_back_in_the_registry_while_draining_is_routed_to_again():
    """It was silent long enough to be drained, and registered again before its requests finished."""
    pools, watch = watched(forget_after_s=1.0)
    (one,) = admitted(pools, watch, URL)
    lease = pools["decode"].lease(one, 10)
    watch.apply(view(2))
    watch.clock.now += 2
    watch.review()
    assert one.state == DRAINING
    watch.apply(view(3, URL))
    assert one.state == PROBING, "re-registered: probed and admitted again, not left draining"
    lease.release()
    assert URL in pools["decode"].instances, "its last request ended: a draining instance would be forgotten"


class DeadEngines:
    """The engines' side of the health checks: every GET is refused, as a killed engine's port is."""

    async def get(self, url, timeout_s):
        from ascendserve.web.upstream import UpstreamError

        raise UpstreamError(url, None, "Connection refused")


def test_suspect_instance_that_fails_its_health_checks_is_ejected_and_the_role_is_missing():
    """A SIGKILLed engine left the registry (suspect) before its health checks had ejected it:
    it stayed suspect, a last resort answering nothing, and /health said 200 until its
    restart registered again (CI: test_all_role's crash was never noticed)."""
    import asyncio

    pools, watch = watched()
    (one,) = admitted(pools, watch, URL)
    health = HealthMonitor(pools, DeadEngines(), ProxyConfig())
    watch.apply(view(2))
    assert one.state == SUSPECT
    for _ in range(ProxyConfig().eject_after):
        asyncio.run(health.check_all())
    assert one.state == "ejected" and not pools.has_active("decode")
    assert [m for m in pools.readiness().missing if "no healthy decode" in m]
    watch.apply(view(3, URL))  # its restart registers again: admitted once its health check answers
    assert one.state == "ejected" and one.missing_since is None


def test_suspect_instance_back_in_the_registry_is_active_at_once():
    pools, watch = watched()
    one, _ = admitted(pools, watch, URL, OTHER)
    watch.apply(view(2, OTHER))
    watch.apply(view(3, URL, OTHER))
    assert one.state == ACTIVE and one.missing_since is None


def test_engine_reported_load_beyond_this_proxys_own_steers_requests_away():
    """Another proxy's traffic: the engine reports 6 running, this proxy has 1 there."""
    pools, watch = watched()
    one, other = admitted(pools, watch, URL, OTHER)
    pool = pools["decode"]
    mine = pool.lease(one, 100)
    watch.apply(RegistryView(revision=2, heartbeat_timeout_s=6.0, instances=[
        InstanceView(instance_id="a", role="decode", url=URL, model="m", version="", load=Load(running=6), age_s=0),
        InstanceView(instance_id="b", role="decode", url=OTHER, model="m", version="", load=Load(), age_s=0)]))
    assert one.others == 5 and other.others == 0
    for _ in range(4):
        pool.lease(other, 100)
    assert pool.select() is other, "400 of mine there weigh less than 100 of mine + 5 requests of others here"
    mine.release()


def test_etcd_entries_become_a_registry_view_skipping_bad_ones():
    good = b'{"instance_id": "pd-1", "role": "pd", "url": "http://10.0.0.1:8000", "model": "m", "load": {"running": 2}}'
    kvs = {"/ascendserve/default/instances/pd-1": good,
           "/ascendserve/default/instances/bad": b"not json",
           "/ascendserve/default/instances/list": b"[1, 2]",
           "/ascendserve/default/instances/newer": good.replace(b'"pd-1"', b'"pd-2"').replace(
               b'"load"', b'"a_field_of_a_newer_version": 1, "load"'),
           "/ascendserve/default/instances/wrong-role": good.replace(b'"pd"', b'"proxy"')}
    v = view_of(kvs, 7)
    assert v.revision == 7
    assert [(i.instance_id, i.url, i.load.running) for i in v.instances] == [
        ("pd-2", "http://10.0.0.1:8000", 2), ("pd-1", "http://10.0.0.1:8000", 2)]  # by key: .../newer after .../list


def test_etcd_settings_reach_a_child_process_as_a_dict_without_the_password():
    """The NetLoader's settings carry the registry's etcd settings (to_dict); the loader reads them back
    with from_dict and the password from the environment."""
    import json

    import pytest

    settings = etcd.EtcdSettings(("https://e1:2379", "https://e2:2379"), "c1", 7, "root", "s3cret", "/ca.pem",
                                 "/cert.pem", "/key.pem")
    sent = json.dumps(settings.to_dict())
    assert "s3cret" not in sent
    assert etcd.EtcdSettings.from_dict(json.loads(sent), "s3cret") == settings
    assert etcd.EtcdSettings.from_dict({"endpoints": ["http://e:2379/"]}) == etcd.EtcdSettings(("http://e:2379",))
    for bad in ([], {"endpoints": "http://e:2379"}, {"endpoints": [1]}, {"endpoints": [], "lease_ttl_s": "10"},
                {"endpoints": [], "username": 5}, {"endpoints": [], "cluster": ["c"]}):
        with pytest.raises(ValueError):
            etcd.EtcdSettings.from_dict(bad)


def test_etcd_watch_messages_and_keys():
    assert etcd.prefix_end("/ascendserve/default/") == etcd.b64("/ascendserve/default0")
    message = {"result": {"header": {"revision": "9"}, "events": [
        {"kv": {"key": etcd.b64("/a/x"), "value": etcd.b64("1")}},
        {"type": "DELETE", "kv": {"key": etcd.b64("/a/y")}}]}}
    events = etcd.parse_watch(message)
    assert events.revision == 9 and events.changes == [("/a/x", b"1"), ("/a/y", None)]
    assert etcd.parse_watch({"result": {"canceled": True, "compact_revision": "4"}}).compact_revision == 4
    pools = Pools()
    w = EtcdWatch(pools, HealthMonitor(pools, None, ProxyConfig()), etcd.EtcdSettings(("http://e:2379",), "c1"))
    w.kvs = {"/ascendserve/c1/metaservers/m1": b'{"url": "http://10.0.0.9:8001/"}',
             "/ascendserve/c1/metaservers/m2": b'{"url": "file:///etc/passwd"}'}
    w._publish()
    assert w.metaservers == ["http://10.0.0.9:8001"]
