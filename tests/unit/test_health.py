"""router/health: when failed requests eject an instance."""

import asyncio

from ascendserve.config import ProxyConfig
from ascendserve.router.health import HealthMonitor
from ascendserve.router.pools import ACTIVE, EJECTED, Pools


class _Down:
    """An upstream where every instance is unreachable."""

    async def get(self, url, timeout_s, headers=None):
        from ascendserve.web.upstream import UpstreamError

        raise UpstreamError(url, None, "connection refused")


def _pools(*urls):
    pools = Pools()
    for url in urls:
        pools["prefill"].set_state(pools["prefill"].add(url), ACTIVE)
    return pools


def test_failed_requests_eject_an_instance_that_has_peers():
    pools = _pools("http://a", "http://b")
    health = HealthMonitor(pools, _Down(), ProxyConfig(eject_after=3))
    a = pools["prefill"].instances["http://a"]
    for _ in range(3):
        health.report_failure(a)
    assert a.state == EJECTED


def test_the_last_active_instance_is_left_to_its_health_check():
    """A burst of connect timeouts on the only prefill must not take the role down for a whole
    health interval; a real outage is still found, by the check they trigger at once."""
    pools = _pools("http://only")
    health = HealthMonitor(pools, _Down(), ProxyConfig(eject_after=3))
    only = pools["prefill"].instances["http://only"]
    for _ in range(5):
        health.report_failure(only)
    assert only.state == ACTIVE
    assert health._wake.is_set(), "its health check was not asked for"
    asyncio.run(health.check_all())  # /health fails too: now it goes
    assert only.state == EJECTED
