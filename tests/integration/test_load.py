"""1,500 concurrent streams through one proxy worker (the issue's load acceptance).

Stub P and D (tests/stub_backend.py) stand behind the real proxy process. D
holds every stream after its first token until all 1,500 are open at once, so
the streams really are concurrent. After a warm-up round of the same size, the
proxy's RSS and open file count, read once it holds no connection at all, are
the baseline; after the measured round they must come back within 10 %.
The same 1,500 streams again with a dashboard page subscribed to the proxy's /dashboard/events (in a
process of its own, as a browser's is): no error, the page stays connected and gets its snapshot
every second. (Its CPU cost is the benchmark's business: `bench/load.py --dashboard-pages 1`.)
`bench/load.py` runs the same rounds at rising concurrency.
"""

from __future__ import annotations

import resource

import httpx
import psutil
import pytest

from ascendserve.web.limits import raise_open_files_limit
from tests.dashboard_pages import PagesProcess
from tests.loadgen import reset_stubs, run_round, stub_cluster, stub_stats, wait_idle
from tests.procs import control

pytestmark = pytest.mark.integration
STREAMS = 1500
TOKENS = 4
SLACK = 0.10


def test_proxy_raises_its_open_files_limit(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 1024:
        pytest.skip(f"hard limit {hard}: nothing to raise to")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # what the proxy inherits
    try:
        proxy = control("proxy", tmp_path).start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        proxy.wait_ready(30)
        assert psutil.Process(proxy.popen.pid).rlimit(psutil.RLIMIT_NOFILE) == (hard, hard)
    finally:
        proxy.stop()


def test_1500_concurrent_streams_through_one_proxy_worker(tmp_path):
    _, limit = raise_open_files_limit()  # this process is the 1,500 clients
    if limit < 2 * STREAMS:
        pytest.skip(f"open files hard limit {limit} is below {2 * STREAMS}")
    with stub_cluster(tmp_path, gate_timeout_s=30) as (p, d, proxy):
        pid = proxy.popen.pid

        reset_stubs(p.url, d.url, gate=STREAMS)
        warm = run_round(proxy.url, STREAMS, TOKENS)
        assert warm.error_count == 0, f"warm-up: {dict(warm.errors)}"
        start = wait_idle(pid)
        assert start.sockets == 0, f"proxy still holds {start.sockets} sockets after the warm-up"

        reset_stubs(p.url, d.url, gate=STREAMS)
        result = run_round(proxy.url, STREAMS, TOKENS)
        end = wait_idle(pid, within=start, slack=SLACK)
        ps, ds = stub_stats(p.url), stub_stats(d.url)

        assert result.error_count == 0, dict(result.errors)
        assert result.ok == STREAMS
        assert ds["peak_active"] == STREAMS and ds["gate_timeouts"] == 0, ds  # all open at once
        assert ps["prefills"] == ds["decodes"] == STREAMS, (ps, ds)  # each request went P, then D
        assert ps["protocol_errors"] == ds["protocol_errors"] == 0, (ps, ds)
        assert ds["completed"] == STREAMS and ds["aborted"] == 0, ds
        assert end.sockets == 0, f"proxy still holds {end.sockets} sockets"
        assert end.fds <= start.fds * (1 + SLACK), f"open files {start.fds} after warm-up, {end.fds} after the run"
        assert end.rss_mb <= start.rss_mb * (1 + SLACK), \
            f"RSS {start.rss_mb:.1f} MiB after warm-up, {end.rss_mb:.1f} MiB after the run"
        assert httpx.get(proxy.url + "/healthcheck", timeout=5).json()["request_num"] == 0  # every lease released


def test_1500_concurrent_streams_through_one_proxy_worker_with_a_dashboard_open(tmp_path):
    _, limit = raise_open_files_limit()
    if limit < 2 * STREAMS:
        pytest.skip(f"open files hard limit {limit} is below {2 * STREAMS}")
    with stub_cluster(tmp_path, gate_timeout_s=30) as (p, d, proxy):
        reset_stubs(p.url, d.url, gate=STREAMS)
        with PagesProcess(proxy.url, 1) as page:
            result = run_round(proxy.url, STREAMS, TOKENS)
        ps, ds = stub_stats(p.url), stub_stats(d.url)
        assert result.error_count == 0 and result.ok == STREAMS, dict(result.errors)
        assert ds["peak_active"] == STREAMS and ps["prefills"] == ds["decodes"] == STREAMS, (ps, ds)
        assert page.errors == [] and page.ended == 0, page.errors  # it stayed connected throughout
        assert page.snapshots[0] >= int(page.seconds) - 2, (page.snapshots, page.seconds)  # one a second
        assert wait_idle(proxy.popen.pid).sockets == 0  # the page's stream closed with it
        assert httpx.get(proxy.url + "/healthcheck", timeout=5).json()["request_num"] == 0
