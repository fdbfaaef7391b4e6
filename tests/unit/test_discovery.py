"""router/discovery: the proxy's pools follow the metaserver registry."""

from ascendserve.config import ProxyConfig
from ascendserve.protocol.registry import InstanceView, Load, RegistryView
from ascendserve.router.discovery import RegistryWatch
from ascendserve.router.health import HealthMonitor
from ascendserve.router.pools import ACTIVE, DRAINING, PROBING, Pools

URL = "http://127.0.0.1:8301"


def view(revision: int, *urls: str) -> RegistryView:
    return RegistryView(revision=revision, heartbeat_timeout_s=6.0, instances=[
        InstanceView(instance_id=f"decode-{u[-4:]}", role="decode", url=u, model="m", version="", load=Load(),
                     age_s=0.0) for u in urls])


def test_instance_back_in_the_registry_while_draining_is_routed_to_again():
    """It missed a heartbeat (or was restarted) while serving: the registry dropped it, the
    proxy began draining it, and it registered again before its requests finished."""
    pools = Pools()
    watch = RegistryWatch(pools, None, HealthMonitor(pools, None, ProxyConfig()), "http://meta", "", 1.0, 1.0)
    pool = pools["decode"]
    watch.apply(view(1, URL))
    pool.set_state(pool.instances[URL], ACTIVE)
    lease = pool.lease(pool.instances[URL], 10)
    watch.apply(view(2))
    assert pool.instances[URL].state == DRAINING
    watch.apply(view(3, URL))
    assert pool.instances[URL].state == PROBING, "re-registered: probed and admitted again, not left draining"
    lease.release()
    assert URL in pool.instances, "its last request ended: a draining instance would be forgotten for good"


def test_instance_gone_from_the_registry_is_forgotten_once_idle():
    pools = Pools()
    watch = RegistryWatch(pools, None, HealthMonitor(pools, None, ProxyConfig()), "http://meta", "", 1.0, 1.0)
    watch.apply(view(1, URL))
    watch.apply(view(2))
    assert URL not in pools["decode"].instances
