"""Chaos in CI: one encoder, one prefill and one decode SIGKILLed under load, then restarted.

bench/chaos.py's cluster (metaserver, 2 E, 2 P, 2 D, proxy; tiny Qwen2.5-VL;
pull KV, shm EC) and its checks (no request may fail, every answer's token ids equal plain
vLLM's), in one short run shared by the module: one
wave of three kills two seconds apart, each of a random instance of a role
while the proxy has a request on it, one kill style each (the role process;
the whole process group, resource tracker included; the vLLM worker), the
three restarted together on the same ports. `python -m bench.chaos` runs ten
and more kills.
"""

from __future__ import annotations

import pytest

from bench.chaos import ROLES, Settings, print_report, run
from tests import memory
from tests.procs import KV_CACHE_BYTES

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def _chaos_memory():
    """bench.chaos starts its six engines itself (not through tests.procs): their memory is
    reserved here for the module (tests/memory.py)."""
    with memory.reserved(6 * memory.engine_gib(kv_gib=KV_CACHE_BYTES / 2**30), "chaos cluster (2 E, 2 P, 2 D)"):
        yield


@pytest.fixture(scope="module")
def report(_chaos_memory, vl_model, tmp_path_factory):
    s = Settings(model=vl_model, log_dir=tmp_path_factory.mktemp("chaos"), kills=3, per_wave=3, interval_s=3.0,
                 target="mixed", concurrency=3, max_tokens=16, kv_ttl_s=10.0, pin_ttl_s=10.0, seed=7)
    r = run(s)
    print_report(r)
    return r


def test_each_role_was_killed_once_in_each_style(report):
    assert report["kills_per_role"] == {role: 1 for role in ROLES}
    assert sorted(k["target"] for k in report["kills"]) == ["group", "main", "worker"]
    assert report["ok"] > 0
    assert any(k["hit"] for k in report["kills"]), "no kill caught a request in flight: the test proves nothing"


def test_no_request_fails_or_hangs_and_every_answer_equals_plain_vllms(report):
    """Streams on a killed decode continue elsewhere (router/migrate.py: token ids, or a replay for
    the image chats), a killed prefill or encoder is retried or worked around before D's first byte."""
    assert report["hung"] == 0, report["bad"]
    assert report["failed-other"] == 0, report["bad"]
    assert report["failed-explicit"] == 0, report["explicit"]
    assert report["compared"] == report["ok"] > 0
    assert report["differs"] == 0, report["differing"]


def test_killed_instances_leave_no_process_and_no_shared_memory(report):
    assert report["orphans"] == 0, [k["orphans"] for k in report["kills"]]
    assert report["shm_after_kills"] == 0, [k["shm_left"] for k in report["kills"]]
    assert report["restart_failures"] == 0, [k["restart_error"] for k in report["kills"]]
    assert report["silent_engine_deaths"] == 0, "an instance whose engine died exited 0"


def test_nothing_is_held_once_the_load_stops(report):
    assert report["leaked_kv"] == 0, report["held"]
    assert report["leaked_ec"] == 0, report["held"]


def test_nothing_is_left_once_the_cluster_stopped(report):
    assert report["leaked_shm"] == [], report["leaked_shm"]
    assert report["unclean_stops"] == {}, report["unclean_stops"]
