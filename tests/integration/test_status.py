"""`ascendserve status` as an operator runs it (a subprocess) against a running 1P1D cluster: stub
engines (tests/stub_backend.py) registering with a real metaserver, a real proxy following it.
Also: a stub stopped and restarted, Ctrl-C under --watch, https with --tls-ca, and etcd directly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import PYTHON, REPO, Proc, control, signal_group, start_all, stub, wait_for

pytestmark = pytest.mark.integration
TOKEN = "cluster-secret-status"
HEALTH_INTERVAL_S = 0.5


def environment(token: str | None = TOKEN) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCENDSERVE_")}
    env["PYTHONPATH"] = str(REPO)
    if token is not None:
        env["ASCENDSERVE_CLUSTER_TOKEN"] = token
    return env


def status(*args: str, token: str | None = TOKEN, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "ascendserve", "status", *args], capture_output=True, text=True,
                          timeout=timeout, env=environment(token))


def rows(r: subprocess.CompletedProcess) -> dict[str, dict]:
    return {i["url"]: i for i in json.loads(r.stdout)["instances"]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A metaserver, a prefill and a decode stub registered with it, a proxy following it."""
    logs = tmp_path_factory.mktemp("status-logs")
    meta_conf, proxy_conf = logs / "meta.toml", logs / "proxy.toml"
    # a registration outlives a SIGKILL long enough for the proxy's health checks to judge it
    meta_conf.write_text("[metaserver]\nheartbeat_timeout_s = 30.0\n")
    proxy_conf.write_text(f"[proxy]\nhealth_interval_s = {HEALTH_INTERVAL_S}\neject_after = 2\n"
                          "health_timeout_s = 1.0\nregistry_poll_s = 0.5\n")
    meta = control("metaserver", logs, "--cluster-token", TOKEN, "--config", str(meta_conf))
    start_all(meta)
    registered = ("--metaserver-url", meta.url, "--cluster-token", TOKEN)
    p, d = stub("prefill", logs, *registered), stub("decode", logs, "--require-kv", *registered)
    proxy = control("proxy", logs, "--config", str(proxy_conf), "--metaserver-url", meta.url, "--cluster-token", TOKEN)
    procs = [meta, p, d, proxy]
    try:
        start_all(p, d, proxy)
        wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 30, "the proxy never became ready")
        yield meta, p, d, proxy
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_proxy_shows_one_row_per_instance_with_its_role_and_health(cluster):
    meta, p, d, proxy = cluster
    r = status("--proxy", proxy.url, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["source"] == "proxy" and doc["ready"] is True and doc["missing"] == [] and doc["error"] is None
    assert {url: (i["role"], i["state"], i["healthy"]) for url, i in rows(r).items()} == {
        p.url: ("prefill", "active", True), d.url: ("decode", "active", True)}
    assert rows(r)[d.url]["instance_id"] == f"stub-decode-{d.port}"
    httpx.post(proxy.url + "/v1/completions", json={"model": "stub-model", "prompt": "x", "max_tokens": 2},
               timeout=30).raise_for_status()
    r = status("--proxy", proxy.url, "--json")
    assert rows(r)[p.url]["served"] >= 1 and rows(r)[d.url]["served"] >= 1
    assert json.loads(r.stdout)["totals"]["requests"] >= 1

    table = status("--proxy", proxy.url)  # piped: a table without colour
    assert table.returncode == 0 and "\033" not in table.stdout
    lines = table.stdout.splitlines()
    assert "READY" in lines[0] and lines[2].startswith("ROLE")
    assert [line.split()[:4] for line in lines[3:]] == [
        ["prefill", p.url, f"stub-prefill-{p.port}", "active"], ["decode", d.url, f"stub-decode-{d.port}", "active"]]


def test_metaserver_shows_the_registered_instances(cluster):
    meta, p, d, proxy = cluster
    r = status("--metaserver", meta.url, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["source"] == "metaserver" and doc["ready"] is True and doc["push_pending"] == 0
    assert {url: (i["role"], i["state"], i["model"]) for url, i in rows(r).items()} == {
        p.url: ("prefill", "registered", "stub-model"), d.url: ("decode", "registered", "stub-model")}
    assert all(i["age_s"] >= 0 and i["running"] == 0 for i in doc["instances"])


def test_without_the_token_it_says_so_and_exits_2(cluster):
    meta, p, d, proxy = cluster
    for flag, url in (("--proxy", proxy.url), ("--metaserver", meta.url)):
        r = status(flag, url, token=None)
        assert r.returncode == 2 and "set ASCENDSERVE_CLUSTER_TOKEN or pass --token-file" in r.stderr, r.stderr
        wrong = status(flag, url, token="not-the-token")
        assert wrong.returncode == 2 and "from $ASCENDSERVE_CLUSTER_TOKEN was refused" in wrong.stderr
        assert "not-the-token" not in wrong.stderr + wrong.stdout
        assert "Traceback" not in r.stderr + wrong.stderr


def test_a_stopped_stub_is_not_active_and_the_cluster_not_ready_until_it_returns(cluster):
    meta, p, d, proxy = cluster
    signal_group(d, signal.SIGKILL)  # no deregistration: the proxy's health checks must notice
    d.popen.wait(10)
    stopped = time.monotonic()
    wait_for(lambda: status("--proxy", proxy.url).returncode == 1, 15, "status never said not ready")
    # ejected after eject_after failed checks, one health interval apart (each up to its timeout)
    assert time.monotonic() - stopped < 2 * (HEALTH_INTERVAL_S + 1.0) + 5
    r = status("--proxy", proxy.url, "--json")
    assert r.returncode == 1 and not json.loads(r.stdout)["ready"]
    assert "no healthy decode instance" in " ".join(json.loads(r.stdout)["missing"])
    assert rows(r)[d.url]["state"] != "active" and not rows(r)[d.url]["healthy"]
    assert rows(r)[d.url]["last_error"] and rows(r)[p.url]["healthy"]
    table = status("--proxy", proxy.url)
    assert table.returncode == 1 and "NOT READY" in table.stdout

    d.start()  # the same port, registering again
    d.wait_ready()
    wait_for(lambda: status("--proxy", proxy.url).returncode == 0, 30, "status never saw the stub return")
    assert rows(status("--proxy", proxy.url, "--json"))[d.url]["state"] == "active"


def test_an_unreachable_proxy_exits_1(cluster):
    r = status("--proxy", "http://127.0.0.1:9", "--timeout", "2")
    assert r.returncode == 1 and "UNREACHABLE" in r.stdout and "connection refused" in r.stdout


def _as_from_a_shell() -> None:
    """The child's SIGINT as a shell gives it (default, not blocked): whether Ctrl-C works must
    not depend on what the pytest worker's earlier modules left in its own signal state."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stuck(pid: int) -> str:
    """What a process that did not exit was doing: its signal masks, where it sleeps, its stack."""
    out = []
    with contextlib.suppress(OSError):
        out += [x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(("State", "Sig", "Shd"))]
        out.append("wchan: " + Path(f"/proc/{pid}/wchan").read_text())
    spy = Path(PYTHON).with_name("py-spy")
    if spy.exists():
        out.append(subprocess.run([str(spy), "dump", "--pid", str(pid)], capture_output=True, text=True,
                                  timeout=20).stdout)
    return "\n".join(out)


def test_watch_prints_a_document_per_round_and_ctrl_c_exits_0(cluster):
    proxy = cluster[3]
    watch = subprocess.Popen([PYTHON, "-m", "ascendserve", "status", "--proxy", proxy.url, "--watch", "0.2", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(),
                             preexec_fn=_as_from_a_shell)
    try:
        docs = [json.loads(watch.stdout.readline()) for _ in range(3)]
        assert all(doc["ready"] for doc in docs) and docs[0]["time"] < docs[1]["time"] < docs[2]["time"]
        watch.send_signal(signal.SIGINT)
        try:
            code = watch.wait(10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"status --watch did not exit within 10 s of SIGINT:\n{_stuck(watch.pid)}")
        assert code == 0
        assert "Traceback" not in watch.stderr.read()
    finally:
        watch.kill()
        watch.wait()


def test_https_needs_the_cluster_ca(tmp_path):
    from tests.tlstools import write_self_signed

    cert, key = write_self_signed(tmp_path)
    pd = stub("pd", tmp_path)
    proxy = control("proxy", tmp_path, "--tls-cert", str(cert), "--tls-key", str(key), "--pd", f"127.0.0.1:{pd.port}",
                    "--cluster-token", TOKEN)
    url = f"https://127.0.0.1:{proxy.port}"
    try:
        start_all(pd)
        proxy.start()
        wait_for(lambda: status("--proxy", url, "--tls-ca", str(cert)).returncode == 0, 60,
                 f"the https proxy never became ready:\n{proxy.log_text()[-2000:]}")
        untrusted = status("--proxy", url)
        assert untrusted.returncode == 1 and "TLS certificate not trusted" in untrusted.stdout
        assert "pass --tls-ca" in untrusted.stdout
        bad_ca = status("--proxy", url, "--tls-ca", str(tmp_path / "missing.pem"))
        assert bad_ca.returncode == 2 and "--tls-ca" in bad_ca.stderr
    finally:
        for proc in (proxy, pd):
            proc.stop()


def test_etcd_rows_straight_from_the_registry(tmp_path):
    from tests.etcd_cluster import EtcdCluster, stub_flags

    etcd = EtcdCluster(tmp_path / "etcd", members=1).start()
    procs: list[Proc] = []
    try:
        procs = [stub("prefill", tmp_path, *stub_flags(etcd, name="c1")),
                 stub("decode", tmp_path, *stub_flags(etcd, name="c1"))]
        start_all(*procs)
        wait_for(lambda: status("--etcd", *etcd.endpoints, "--cluster", "c1").returncode == 0, 30,
                 "the stubs never appeared in etcd")
        r = status("--etcd", *etcd.endpoints, "--cluster", "c1", "--json", token=None)
        assert {url: (i["role"], i["state"]) for url, i in rows(r).items()} == {
            procs[0].url: ("prefill", "registered"), procs[1].url: ("decode", "registered")}
        other = status("--etcd", *etcd.endpoints, "--cluster", "c2")
        assert other.returncode == 1 and "no engine instance registered yet" in other.stdout
    finally:
        for proc in procs:
            proc.stop()
        etcd.stop()

