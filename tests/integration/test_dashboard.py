"""The dashboard in a real browser (headless Chromium from Debian, driven by Selenium; tests/browser.py).

A 1P1D cluster of stub engines (tests/stub_backend.py) behind the real proxy, with a cluster token
and a health check every second:
- the page loads with no console errors (Chromium's browser log: script errors, failed loads, CSP
  refusals), and its figures equal the proxy's own /metrics and /instances: requests and errors,
  each instance's state and requests in flight while streams are open;
- a stopped decode instance (SIGSTOP) is shown ejected within a health interval (+ its timeout and
  slack) and active again once it is continued, in the table, the topology and the event feed,
  pushed by the server (the page never polls);
- a screenshot goes to the test's tmp dir and artifacts/dashboard.png (CI keeps it);
- a metaserver's page lists what its registry lists, and shows an engine joining and leaving.
From another address, in a network namespace of the test's own (`unshare -n`, 10.231.0.2 on its
loopback device: a client that is not loopback, as in test_front_door.py), the browser meets the
login page: a wrong token is refused, the right one opens the dashboard through an HttpOnly cookie
the page's script cannot read, and logging out closes it again. That part runs this module inside
the namespace (`python -m tests.integration.test_dashboard --login`) and asserts on its JSON.
Skipped, saying why, when chromium or chromedriver is not installed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import browser
from tests.procs import PYTHON, REPO, control, signal_group, start_all, stub, wait_for

pytestmark = pytest.mark.integration
TOKEN = "dashboard-browser-token-0123456789"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S = 1.0, 1.0
SLACK_S = 3.0
ADDRESS = "10.231.0.2"  # in the login test's namespace only
SETUP = f"ip link set lo up && ip addr add {ADDRESS}/32 dev lo"

if (why := browser.missing()) is not None:
    pytest.skip(why, allow_module_level=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("dashboard-logs")
    conf = logs / "proxy.toml"
    conf.write_text(f"[proxy]\nhealth_interval_s = {HEALTH_INTERVAL_S}\nhealth_timeout_s = {HEALTH_TIMEOUT_S}\n"
                    "eject_after = 1\nmigration_limit = 0\n")
    p = stub("prefill", logs)
    d = stub("decode", logs, "--require-kv", "--token-delay-ms", "100")
    start_all(p, d)
    proxy = control("proxy", logs, "--config", str(conf), "--prefill", f"127.0.0.1:{p.port}",
                    "--decode", f"127.0.0.1:{d.port}", "--cluster-token", TOKEN)
    start_all(proxy)
    try:
        wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 30, "proxy never healthy")
        yield proxy, p, d
    finally:
        for proc in (proxy, p, d):
            proc.stop()


@pytest.fixture(scope="module")
def page(cluster):
    driver = browser.chrome()
    try:
        yield driver
    finally:
        driver.quit()


def metrics(proxy) -> dict:
    """{name: {labels tuple: value}} of the proxy's /metrics."""
    out: dict = {}
    for family in text_string_to_metric_families(httpx.get(proxy.url + "/metrics").text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def shown(driver, url: str, field: str) -> str:
    return driver.find_element("css selector", f'#instances-body tr[data-url="{url}"] td[data-field="{field}"]') \
        .get_attribute("data-value")


def tile(driver, key: str) -> str:
    return driver.find_element("id", f"tile-{key}").get_attribute("data-value")


def complete(proxy, max_tokens: int = 2, model: str = "stub-model") -> int:
    return httpx.post(proxy.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": max_tokens},
                      timeout=60).status_code


def test_page_loads_clean_and_shows_what_metrics_say(cluster, page, tmp_path):
    proxy, p, d = cluster
    assert [complete(proxy) for _ in range(4)] == [200] * 4
    assert complete(proxy, model="no-such-model") == 404  # a client error: counted as one
    page.get(proxy.url + "/dashboard")
    browser.wait_until(lambda: page.execute_script("return document.body.dataset.snapshotT"), 15, "no snapshot arrived")
    assert page.find_element("id", "live").text == "live"

    m = metrics(proxy)
    requests_total = int(sum(m["ascendserve_proxy_requests_total"].values()))
    errors_total = int(sum(m["ascendserve_proxy_errors_total"].values()))
    browser.wait_until(lambda: tile(page, "requests") == str(requests_total), 5, "requests differ from /metrics")
    assert requests_total == 5 and tile(page, "errors") == str(errors_total) == "1"

    # three streams held open (~6 s each): the decode instance's in-flight count, as /metrics has it
    import threading

    held = [threading.Thread(target=complete, args=(proxy, 60)) for _ in range(3)]
    for t in held:
        t.start()
    try:
        def in_flight(role, url):
            return int(metrics(proxy)["ascendserve_proxy_in_flight"][(("instance", url), ("role", role))])

        wait_for(lambda: in_flight("decode", d.url) == 3, 10, "streams not in flight")
        browser.wait_until(lambda: shown(page, d.url, "in_flight") == "3", 5, "page's in-flight differs")
        # P's lease lasts until D is done with its KV (pull): 3 there too
        browser.wait_until(lambda: shown(page, p.url, "in_flight") == str(in_flight("prefill", p.url)), 5,
                           "page's prefill in-flight differs")
        listed = httpx.get(proxy.url + "/instances", headers=ADMIN).json()["instances"]
        for inst in listed:
            assert shown(page, inst["url"], "state") == inst["state"] == "active"
            assert page.find_element("css selector", f'#graph g[data-url="{inst["url"]}"]').get_attribute(
                "data-state") == "active"
        hops = int(sum(metrics(proxy)["ascendserve_proxy_in_flight"].values()))
        assert tile(page, "in_flight") == str(hops) == "6"  # 3 on D + the 3 P leases holding their KV
        browser.screenshot(page, tmp_path, "dashboard.png")
    finally:
        for t in held:
            t.join(30)
    # a streamed request: its inter-token latency reaches the page (p50, p99 over the last 10 s)
    r = httpx.post(proxy.url + "/v1/completions", json={"model": "stub-model", "prompt": "hi", "max_tokens": 5,
                                                         "stream": True}, timeout=60)
    assert r.status_code == 200 and "[DONE]" in r.text
    assert metrics(proxy)["ascendserve_proxy_itl_seconds_count"][()] >= 1
    browser.wait_until(lambda: tile(page, "itl") not in ("", "[null,null]"), 5, "no inter-token latency shown")
    assert browser.console_errors(page) == []


def test_a_stopped_instance_turns_unhealthy_on_the_page_and_back(cluster, page):
    proxy, p, d = cluster
    if not page.current_url.endswith("/dashboard"):
        page.get(proxy.url + "/dashboard")
    browser.wait_until(lambda: shown(page, d.url, "state") == "active", 15, "decode not shown active")
    limit = HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S + SLACK_S
    signal_group(d, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        browser.wait_until(lambda: shown(page, d.url, "state") == "ejected", limit, "never shown ejected")
        seen_after = time.monotonic() - stopped
        node = page.find_element("css selector", f'#graph g[data-url="{d.url}"]')
        assert node.get_attribute("data-state") == "ejected"
        assert page.find_elements("css selector", f'#events li[data-kind="ejected"][data-url="{d.url}"]')
        assert httpx.get(proxy.url + "/health").status_code == 503  # the page and the proxy agree
    finally:
        signal_group(d, signal.SIGCONT)
    continued = time.monotonic()
    browser.wait_until(lambda: shown(page, d.url, "state") == "active", limit, "never shown active again")
    back_after = time.monotonic() - continued
    assert page.find_elements("css selector", f'#events li[data-kind="readmitted"][data-url="{d.url}"]')
    print(f"shown ejected {seen_after:.1f} s after SIGSTOP, active {back_after:.1f} s after SIGCONT "
          f"(health interval {HEALTH_INTERVAL_S} s, timeout {HEALTH_TIMEOUT_S} s)")
    assert browser.console_errors(page) == []


def test_metaserver_page_shows_the_registry(page, tmp_path):
    """The metaserver's dashboard: the registered instances as its registry lists them, a join and an
    expiry (the stub does not deregister) in the feed as they happen; the metaserver still stops at
    once with the page's event stream open."""
    conf = tmp_path / "meta.toml"
    conf.write_text("[metaserver]\nheartbeat_timeout_s = 2.0\n")
    meta = control("metaserver", tmp_path, "--config", str(conf), "--cluster-token", TOKEN)
    start_all(meta)
    engine = stub("decode", tmp_path, "--metaserver-url", meta.url, "--cluster-token", TOKEN)
    try:
        page.get(meta.url + "/dashboard")
        browser.wait_until(lambda: page.execute_script("return document.body.dataset.kind") == "metaserver", 15,
                           "no metaserver snapshot")
        engine.start().wait_ready(30)
        url = f"http://127.0.0.1:{engine.port}"
        browser.wait_until(lambda: page.find_elements("css selector", f'#events li[data-kind="joined"][data-url="{url}"]'),
                           10, "no join in the feed")
        (listed,) = httpx.get(meta.url + "/v1/registry/instances", headers=ADMIN).json()["instances"]
        browser.wait_until(lambda: shown(page, url, "state") == "active", 5, "instance not shown")
        assert shown(page, url, "running") == str(listed["load"]["running"])
        assert shown(page, url, "id") == listed["instance_id"] and tile(page, "instances") == "1"
        engine.stop()  # its heartbeats stop: expired after 2 s
        browser.wait_until(lambda: page.find_elements("css selector", f'#events li[data-kind="expired"][data-url="{url}"]'),
                           10, "no expiry in the feed")
        browser.wait_until(lambda: not page.find_elements("css selector", f'#instances-body tr[data-url="{url}"]'),
                           5, "the instance is still listed")
        assert browser.console_errors(page) == []
        started = time.monotonic()
        meta.stop()  # SIGTERM with the page's stream open: the stream is ended, not waited for
        assert time.monotonic() - started < 10
    finally:
        engine.stop()
        meta.stop()


# ---- from another address: the login page ----------------------------------------------------------

def _namespace_refusal() -> str | None:
    import shutil

    if not (shutil.which("unshare") and shutil.which("ip")):
        return "unshare or ip is not installed"
    r = subprocess.run(["unshare", "-n", "sh", "-c", SETUP], capture_output=True, text=True, timeout=30)
    return None if r.returncode == 0 else f"unshare -n is not permitted here: {r.stderr.strip()[:300]}"


def test_login_page_from_another_address(tmp_path):
    refusal = _namespace_refusal()
    if refusal:
        pytest.skip(refusal)
    command = f"{SETUP} && exec {PYTHON} -m tests.integration.test_dashboard --login {tmp_path}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["unshare", "-n", "sh", "-c", command], capture_output=True, text=True, timeout=300,
                       cwd=REPO, env=env)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and lines, f"driver failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    seen = json.loads(lines[-1])
    assert seen["first"].endswith("/dashboard/login"), seen  # sent to the login page
    assert seen["wrong"]["url"].endswith("/dashboard/login") and "not the cluster token" in seen["wrong"]["error"]
    assert seen["after_login"].endswith("/dashboard") and seen["kind"] == "proxy"
    assert seen["document_cookie"] == ""  # HttpOnly: the page's script cannot read the session
    cookie = seen["cookie"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and TOKEN not in cookie["value"]
    assert all(TOKEN not in url for url in seen["urls"])  # never a token in a URL
    assert seen["after_logout"].endswith("/dashboard/login") and seen["events_after_logout"] == 401
    assert seen["console_errors"] == [], seen["console_errors"]


def _login_drive(tmp_dir) -> dict:
    from pathlib import Path

    logs = Path(tmp_dir)
    pd = stub("pd", logs)
    pd.start().wait_ready(30)
    proxy = control("proxy", logs, "--host", ADDRESS, "--pd", f"127.0.0.1:{pd.port}", "--cluster-token", TOKEN)
    proxy.host = ADDRESS
    seen: dict = {"urls": []}
    driver = None
    try:
        proxy.start().wait_ready(30)
        driver = browser.chrome()
        driver.get(proxy.url + "/dashboard")
        seen["first"] = driver.current_url
        seen["urls"].append(driver.current_url)
        driver.find_element("id", "token").send_keys("not-the-token")
        driver.find_element("id", "login").click()
        browser.wait_until(lambda: driver.find_elements("id", "login-error"), 10, "no error shown")
        seen["wrong"] = {"url": driver.current_url, "error": driver.find_element("id", "login-error").text}
        driver.find_element("id", "token").send_keys(TOKEN)
        driver.find_element("id", "login").click()
        browser.wait_until(lambda: driver.execute_script("return document.body.dataset.snapshotT"), 15,
                           "the dashboard never got a snapshot after logging in")
        seen["after_login"] = driver.current_url
        seen["urls"].append(driver.current_url)
        seen["kind"] = driver.execute_script("return document.body.dataset.kind")
        seen["document_cookie"] = driver.execute_script("return document.cookie")
        cookies = driver.get_cookies()
        seen["cookie"] = cookies[0] if cookies else {}
        browser.screenshot(driver, logs, "dashboard-login.png")
        driver.find_element("id", "logout").click()
        browser.wait_until(lambda: driver.current_url.endswith("/dashboard/login"), 10, "logout did not end")
        seen["after_logout"] = driver.current_url
        seen["urls"].append(driver.current_url)
        seen["events_after_logout"] = httpx.get(proxy.url + "/dashboard/events", timeout=5,
                                                cookies={c["name"]: c["value"] for c in cookies}).status_code
        # the wrong token's 401 page is expected to log one failed load; nothing else may
        seen["console_errors"] = [e for e in browser.console_errors(driver) if "401" not in e]
    finally:
        if driver is not None:
            driver.quit()
        proxy.stop(timeout=10)
        pd.stop(timeout=10)
    return seen


if __name__ == "__main__":
    if sys.argv[1:2] == ["--login"]:
        print(json.dumps(_login_drive(sys.argv[2])))
