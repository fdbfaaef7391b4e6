"""The registry on a real 3-member etcd (127.0.0.1), two proxies sharing the instances.

Engines are stubs (tests/stub_backend.py) registering in etcd exactly as the engine roles do
(discovery/heartbeat.EtcdRegistrar); proxies and metaservers are the real roles. What is under
test is discovery and its failures: an etcd member, a proxy, an engine, a metaserver SIGKILLed
under a steady stream of requests.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.etcd_cluster import EtcdCluster, registry_flags, stub_flags
from tests.procs import Proc, control, start_all, stub, wait_for

pytestmark = pytest.mark.integration
TOKEN = "cluster-secret-etcd"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
TTL = 3


def proxy_conf(path) -> str:
    conf = path / "proxy.toml"
    conf.write_text("[proxy]\nhealth_interval_s = 0.5\neject_after = 2\nretry_backoff_s = 0.02\n")
    return str(conf)


def stats(proc: Proc) -> dict:
    return httpx.get(proc.url + "/stub/stats", timeout=5).json()


def states(proxy: Proc) -> dict[str, str]:
    listed = httpx.get(proxy.url + "/instances", headers=ADMIN, timeout=5).json()["instances"]
    return {i["url"]: i["state"] for i in listed}


def complete(proxy: Proc, i: int = 0, stream: bool = False, timeout: float = 30) -> httpx.Response:
    if i % 2:
        body = {"model": "stub-model", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 3}
        return httpx.post(proxy.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=timeout)
    return httpx.post(proxy.url + "/v1/completions", json={"model": "stub-model", "prompt": f"p {i}",
                                                           "max_tokens": 3, "stream": stream}, timeout=timeout)


class Stream:
    """A steady stream of requests through some proxies, one thread each, until stopped."""

    def __init__(self, *proxies: Proc):
        self.proxies = list(proxies)
        self.ok = {p.name: 0 for p in proxies}
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(p,), daemon=True) for p in proxies]

    def __enter__(self) -> "Stream":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self, proxy: Proc) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                r = complete(proxy, i, stream=i % 3 == 0)
                if r.status_code == 200 and ("[DONE]" in r.text or '"choices"' in r.text):
                    self.ok[proxy.name] += 1
                else:
                    self.failed.append(f"{proxy.name}: {r.status_code} {r.text[:200]}")
            except httpx.HTTPError as exc:
                self.failed.append(f"{proxy.name}: {exc!r}")
            time.sleep(0.02)

    def settle(self, n: int = 10) -> None:
        """Wait until every proxy of the stream served n more requests."""
        before = dict(self.ok)
        wait_for(lambda: all(self.ok[k] >= before[k] + n for k in before), 30, f"{n} more requests each")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd")).start()
    yield cluster
    cluster.stop()


def test_etcd_member_killed_under_traffic_then_a_new_instance_reaches_both_proxies(etcd, tmp_path):
    """3 etcd members, 2 proxies, 1P1D under a steady stream through both: SIGKILL one member
    (the first endpoint, the one everybody talks to) -> 0 failed requests, and an instance
    started afterwards is routed to by both proxies."""
    conf = proxy_conf(tmp_path)
    p = stub("prefill", tmp_path, *stub_flags(etcd, TTL, "member"))
    d1 = stub("decode", tmp_path, "--require-kv", *stub_flags(etcd, TTL, "member"))
    proxies = [control("proxy", tmp_path, "--config", conf, "--cluster-token", TOKEN,
                       *registry_flags(etcd, TTL, "member"), name=f"proxy-{i}") for i in (1, 2)]
    d2 = stub("decode", tmp_path, "--require-kv", *stub_flags(etcd, TTL, "member"))
    try:
        start_all(p, d1, *proxies)
        for proxy in proxies:
            wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 30, "proxy ready through etcd")
        with Stream(*proxies) as stream:
            stream.settle()
            etcd.members[0].popen.send_signal(signal.SIGKILL)
            etcd.members[0].popen.wait(10)
            stream.settle(20)
            time.sleep(TTL + 1)  # past a lease TTL: no instance was lost with the member
            stream.settle(10)
            assert all(states(proxy) == {p.url: "active", d1.url: "active"} for proxy in proxies)
            start_all(d2)
            for proxy in proxies:
                wait_for(lambda: states(proxy).get(d2.url) == "active", 15, f"{proxy.name} admits the new decode")
            stream.settle(10)
        assert not stream.failed, stream.failed[:5]
        for proxy in proxies:  # each proxy, on its own, sends requests to the newcomer
            before = stats(d2)["completed"]
            for i in range(6):
                assert complete(proxy, i).status_code == 200
            assert stats(d2)["completed"] > before, f"{proxy.name} never routed to the instance started later"
    finally:
        for proc in (*proxies, p, d1, d2):
            proc.stop()
        etcd.members[0].start().wait_ready(60)


def test_proxy_killed_the_other_is_unaffected_and_the_restarted_one_routes_at_once(etcd, tmp_path):
    conf = proxy_conf(tmp_path)
    p = stub("prefill", tmp_path, *stub_flags(etcd, TTL, "proxykill"))
    d = stub("decode", tmp_path, "--require-kv", *stub_flags(etcd, TTL, "proxykill"))
    flags = ["--config", conf, "--cluster-token", TOKEN, *registry_flags(etcd, TTL, "proxykill")]
    a, b = (control("proxy", tmp_path, *flags, name=f"proxy-{x}") for x in "ab")
    try:
        start_all(p, d, a, b)
        for proxy in (a, b):
            wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 30, "proxy ready through etcd")
        with Stream(b) as stream:
            stream.settle()
            a.popen.send_signal(signal.SIGKILL)
            a.popen.wait(10)
            stream.settle(20)
            a.start()
            a.wait_ready(30)  # its HTTP server answers
            up = time.monotonic()
            wait_for(lambda: complete(a).status_code == 200, 5, "the restarted proxy routes")
            took = time.monotonic() - up
            stream.settle(5)
        assert not stream.failed, stream.failed[:5]
        assert took < 1.0, f"the restarted proxy routed its first request {took:.2f} s after it started serving"
    finally:
        for proc in (a, b, p, d):
            proc.stop()


def test_engine_killed_every_proxy_stops_routing_to_it_within_its_lease(etcd, tmp_path):
    conf = proxy_conf(tmp_path)
    flags = stub_flags(etcd, TTL, "enginekill")
    p = stub("prefill", tmp_path, *flags)
    d1, d2 = (stub("decode", tmp_path, "--require-kv", *flags) for _ in range(2))
    proxies = [control("proxy", tmp_path, "--config", conf, "--cluster-token", TOKEN,
                       *registry_flags(etcd, TTL, "enginekill"), name=f"proxy-{i}") for i in (1, 2)]
    try:
        start_all(p, d1, d2, *proxies)
        for proxy in proxies:
            wait_for(lambda: states(proxy).get(d2.url) == "active" and states(proxy).get(d1.url) == "active", 30,
                     "both decodes admitted")
        with Stream(*proxies) as stream:
            stream.settle()
            d2.popen.send_signal(signal.SIGKILL)
            d2.popen.wait(10)
            killed = time.monotonic()
            for proxy in proxies:
                wait_for(lambda: states(proxy).get(d2.url) not in ("active", "probing"), TTL + 2,
                         f"{proxy.name} stops routing to the dead decode")
            assert time.monotonic() - killed <= TTL + 2
            stream.settle(10)
        assert not stream.failed, stream.failed[:5]
    finally:
        for proc in (*proxies, p, d1, d2):
            proc.stop()


def test_push_mode_with_two_metaservers_one_killed_mid_stream(etcd, tmp_path):
    """Proxies find the metaservers in etcd; each ticket names the metaserver that issued it. One
    killed while requests are in flight: those at most fail explicitly, new ones all succeed."""
    conf = proxy_conf(tmp_path)
    reg = registry_flags(etcd, TTL, "push")
    metas = [control("metaserver", tmp_path, "--cluster-token", TOKEN, *reg, name=f"meta-{i}") for i in (1, 2)]
    p = stub("prefill", tmp_path, *stub_flags(etcd, TTL, "push"))
    d = stub("decode", tmp_path, "--require-kv", "--token-delay-ms", "20", *stub_flags(etcd, TTL, "push"))
    proxy = control("proxy", tmp_path, "--config", conf, "--cluster-token", TOKEN, "--mode", "push", *reg)
    try:
        start_all(*metas, p, d, proxy)
        wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 30, "proxy ready through etcd")
        wait_for(lambda: len(httpx.get(proxy.url + "/instances", headers=ADMIN).json()["metaservers"]) == 2, 10,
                 "both metaservers announced")
        for i in range(6):  # requests take turns
            assert complete(proxy, i).status_code == 200
        wait_for(lambda: all(httpx.get(m.url + "/metrics").text.count("push_asks_total 0.0") == 0 for m in metas),
                 10, "both metaservers dispatched a prefill")
        results: list[int | str] = []

        def one(i: int) -> None:
            try:
                r = complete(proxy, i, stream=True)
                results.append(r.status_code if r.status_code != 200 or "[DONE]" in r.text else "cut")
            except httpx.HTTPError as exc:
                results.append(repr(exc))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(0.1)
        metas[0].popen.send_signal(signal.SIGKILL)
        metas[0].popen.wait(10)
        for t in threads:
            t.join(60)
        # in flight: done, or an explicit error status (D could not reach the ticket's metaserver)
        assert all(r == 200 or (isinstance(r, int) and r >= 400) for r in results), results
        for i in range(10):
            r = complete(proxy, i, stream=i % 2 == 0)
            assert r.status_code == 200, r.text
    finally:
        for proc in (proxy, p, d, *metas):
            proc.stop()


def test_slow_is_not_dead_a_frozen_sole_prefill_keeps_its_requests(etcd, tmp_path):
    """Measured before: under CPU oversubscription the only prefill missed its heartbeat deadline while
    serving, the registry dropped it and the proxy answered 503 until it registered again. Here the
    prefill is frozen (SIGSTOP) past its lease TTL, which expires: it is suspect, but the last of its
    role, so requests still go to it and complete once it runs again; then it is active again."""
    ttl = 2
    p = stub("prefill", tmp_path, *stub_flags(etcd, ttl, "slow"))
    d = stub("decode", tmp_path, "--require-kv", *stub_flags(etcd, ttl, "slow"))
    # the proxy's default health checks (every 5 s, 3 failures to eject): the registry alone is under test
    proxy = control("proxy", tmp_path, "--cluster-token", TOKEN, *registry_flags(etcd, ttl, "slow"))
    try:
        start_all(p, d, proxy)
        wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 30, "proxy ready through etcd")
        with Stream(proxy) as stream:
            stream.settle(5)
            p.popen.send_signal(signal.SIGSTOP)
            try:
                wait_for(lambda: states(proxy).get(p.url) == "suspect", ttl + 5, "the lapsed lease noticed")
                time.sleep(1.0)
            finally:
                p.popen.send_signal(signal.SIGCONT)
            wait_for(lambda: states(proxy).get(p.url) == "active", 10, "active again once it answers")
            stream.settle(5)
        assert not stream.failed, stream.failed[:5]
    finally:
        for proc in (proxy, p, d):
            proc.stop()


def test_etcd_over_tls_with_a_user(tmp_path):
    """etcd served over https (our CA file) with authentication on: engines and proxies log in with
    registry.username / the password from the environment, log in again when etcd's token expires,
    and a wrong password is an explicit error."""
    import subprocess

    from ascendserve.discovery import etcd as api
    from ascendserve.discovery.heartbeat import EtcdRegistrar, Heartbeat
    from tests.etcd_cluster import ETCD, need_etcd
    from tests.ports import free_port
    from tests.tlstools import write_self_signed

    need_etcd()
    cert, key = write_self_signed(tmp_path, "etcd")
    client, peer = free_port(), free_port()
    endpoint = f"https://127.0.0.1:{client}"
    member = Proc("etcd-tls", [ETCD, "--name", "tls", "--data-dir", str(tmp_path / "data"),
                               "--listen-client-urls", endpoint, "--advertise-client-urls", endpoint,
                               "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                               "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                               "--initial-cluster", f"tls=http://127.0.0.1:{peer}", "--cert-file", str(cert),
                               "--key-file", str(key), "--auth-token-ttl", "2", "--log-level", "warn"],
                  client, tmp_path / "etcd-tls.log", {}, "/health", memory_gib=0.0)
    etcdctl = ["etcdctl", "--endpoints", endpoint, "--cacert", str(cert)]
    stub_pd = stub("pd", tmp_path)
    proxy = None
    heartbeat = None
    try:
        member.start()
        wait_for(lambda: subprocess.run([*etcdctl, "endpoint", "health"], capture_output=True).returncode == 0, 30,
                 "etcd over https")
        for args in (["user", "add", "root", "--new-user-password", "s3cret-pw"], ["auth", "enable"]):
            subprocess.run([*etcdctl, "--user", "root:s3cret-pw", *args] if args[0] == "auth" else [*etcdctl, *args],
                           check=True, capture_output=True)
        good = api.EtcdSettings((endpoint,), "tls", 3, "root", "s3cret-pw", str(cert))
        with pytest.raises(api.EtcdError, match="authentication failed"):
            api.Etcd(api.EtcdSettings((endpoint,), "tls", 3, "root", "wrong", str(cert))).range_prefix("/x")
        with pytest.raises(api.EtcdError):
            api.Etcd(api.EtcdSettings((endpoint,), "tls", 3, tls_ca=str(cert))).range_prefix("/x")  # no user
        stub_pd.start().wait_ready()
        registrar = EtcdRegistrar(good)
        heartbeat = Heartbeat(registrar, "tls-pd", "pd", stub_pd.url, stub_pd.url, "stub-model", 0.5).start()
        wait_for(lambda: [i["url"] for i in api.instances(good)] == [stub_pd.url], 15, "registered over https")
        # etcd's token expires after 2 s unused (--auth-token-ttl 2): a client idle longer logs in again
        idle = api.Etcd(good)
        idle.range_prefix("/ascendserve/")
        time.sleep(3)
        assert [k for k in idle.range_prefix("/ascendserve/tls/")[1]] == ["/ascendserve/tls/instances/tls-pd"]
        proxy = control("proxy", tmp_path, "--cluster-token", TOKEN, "--tls-ca", str(cert),
                        "--registry-backend", "etcd", "--registry-endpoints", endpoint, "--registry-cluster", "tls",
                        "--registry-username", "root")
        proxy.env["ASCENDSERVE_REGISTRY_PASSWORD"] = "s3cret-pw"
        proxy.start().wait_ready()
        wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 30, "the proxy found the pd in etcd")
        assert complete(proxy).status_code == 200
        assert "s3cret-pw" not in proxy.log_text()
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        for proc in (proxy, stub_pd, member):
            if proc is not None:
                proc.stop()
