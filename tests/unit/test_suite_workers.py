"""The suite's own machinery for two workers: ports that cannot collide between them, the
memory budget their engines share, and the engines the whole session shares."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest

from tests import memory, ports
from tests.procs import ENGINE_ARGS, KV_CACHE_BYTES, REPO, Proc, engine_ranks, kv_cache_bytes


@pytest.fixture(autouse=True)
def _own_port_ledger(monkeypatch):
    """These tests hand out ports as other workers would, by the thousand; what they hand out
    is not kept from the servers this worker's later tests start (seen: under two workers the
    real share ran dry)."""
    monkeypatch.setattr(ports, "_issued", set(ports._issued))


def _ports_of(worker: int, workers: int, n: int, monkeypatch) -> list[int]:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
    return [ports.free_port() for _ in range(n)]


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_ports_and_their_derived_ports_never_meet(monkeypatch, workers):
    seen: dict[int, int] = {}
    for w in range(workers):
        for base in _ports_of(w, workers, 150, monkeypatch):
            # what an engine role binds beside its port: KV side channel + TP ranks, NetLoader seed
            for p in (base, base + 1000, base + 1001, base + 2000):
                assert ports.owner(p, workers) == w, (p, w)
                assert seen.setdefault(p, w) == w, f"port {p} of worker {w} also belongs to worker {seen[p]}"
                assert ports.LOW <= p < 32768  # never in the kernel's ephemeral range


def test_a_run_for_all_keeps_its_offsets_in_the_share(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    for _ in range(50):
        base = ports.free_port_run(2, offsets=(10, 11, 12, 1010, 1011, 1012))
        for p in [base, base + 1, base + 10, base + 12, base + 1012]:
            assert ports.owner(p, 2) == 1, (base, p)


def test_a_port_is_handed_out_once_and_a_taken_one_never(monkeypatch):
    import socket

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    given = [ports.free_port() for _ in range(300)]
    assert len(set(given)) == len(given)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        taken = s.getsockname()[1]
        assert taken not in given


def test_engine_ranks_from_command_lines():
    py = [sys.executable, "-m"]
    assert engine_ranks(py + ["ascendserve", "--role", "proxy", "--port", "1"]) == 0
    assert engine_ranks(py + ["tests.stub_backend", "--role", "prefill"]) == 0
    assert engine_ranks(py + ["ascendserve", "--role", "pd", "--model", "m"]) == 1
    assert engine_ranks(py + ["ascendserve", "--role", "pd", "--tensor-parallel-size", "2"]) == 2
    assert engine_ranks(py + ["ascendserve", "launch", "--role", "pd", "--dp-size", "2", "--tp-size=2"]) == 4
    assert engine_ranks(py + ["vllm.entrypoints.openai.api_server", "--model", "m"]) == 1
    assert engine_ranks(["/venv/bin/vllm", "serve", "m"]) == 1
    assert engine_ranks(py + ["ascendserve", "--role", "all", "--topology", "1P1D"]) == 2
    assert engine_ranks(py + ["ascendserve", "--role", "pd", "--help"]) == 0


def test_an_engine_is_budgeted_with_the_kv_cache_it_asks_for(tmp_path):
    py = [sys.executable, "-m", "ascendserve", "--role", "pd", "--model", "m", "--port", "1"]
    assert kv_cache_bytes(py + ENGINE_ARGS) == KV_CACHE_BYTES == 256 << 20
    assert kv_cache_bytes(py + ["--vllm-arg=--kv-cache-memory-bytes=1024"]) == 1024
    assert kv_cache_bytes(py + ["--kv-cache-memory-bytes=2048"]) == 2048
    assert kv_cache_bytes(py) is None
    tuned = Proc("pd", py + ENGINE_ARGS, 1, tmp_path / "pd.log")
    plain = Proc("pd", py, 1, tmp_path / "pd.log")
    tp2 = Proc("pd", py + ["--tensor-parallel-size", "2", *ENGINE_ARGS], 1, tmp_path / "pd.log")
    assert tuned.memory_wanted() == pytest.approx(memory.engine_gib(1, 0.25))
    assert plain.memory_wanted() == pytest.approx(memory.engine_gib(1))
    assert plain.memory_wanted() > tuned.memory_wanted() + 0.7
    assert tp2.memory_wanted() == pytest.approx(tuned.memory_wanted() + memory.RANK_GIB + 0.25)
    # the variable would override the argument in vLLM's CPU platform: dropped where an argument
    # is given, unless the Proc sets it itself; kept (1 GiB) for an engine that names no size
    assert "VLLM_CPU_KVCACHE_SPACE" not in tuned.environment()
    assert plain.environment()["VLLM_CPU_KVCACHE_SPACE"] == "1"
    own = Proc("pd", py + ENGINE_ARGS, 1, tmp_path / "pd.log", {"VLLM_CPU_KVCACHE_SPACE": "2"})
    assert own.environment()["VLLM_CPU_KVCACHE_SPACE"] == "2"
    untuned = Proc("pd", py, 1, tmp_path / "pd.log", {"VLLM_CPU_KVCACHE_SPACE": None})  # the role sizes it
    assert untuned.memory_wanted() == pytest.approx(memory.engine_gib(1, memory.ROLE_KV_GIB))


def _wait_for_two(q):
    memory.reserve(2, "the waiting start")
    q.put("held")


def test_waits_for_the_budget_are_summed_for_the_session(ledger, tmp_path, monkeypatch):
    monkeypatch.setenv("ASCENDSERVE_TEST_SHARED_DIR", str(tmp_path))
    assert memory.waits_summary() is None
    key = memory.reserve(4, "the holder")
    q = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_wait_for_two, args=(q,))
    child.start()
    time.sleep(0.6)
    assert q.empty()
    memory.release(key)
    assert q.get(timeout=10) == "held"
    child.join(10)
    summary = memory.waits_summary()
    assert summary.startswith("1 engine start(s) waited for the memory budget (5.0 GiB)"), summary
    assert "the waiting start" in summary
    seconds = float(summary.split(" s in all")[0].rsplit(", ", 1)[1])
    assert 0.5 <= seconds < 10, summary



def test_the_timeline_shows_each_modules_span_and_each_workers_idle_tail(tmp_path, monkeypatch):
    from tests import timeline

    monkeypatch.setenv("ASCENDSERVE_TEST_SHARED_DIR", str(tmp_path))
    assert timeline.summary(1000.0, 1200.0) == []
    timeline.note("tests/a.py::one", "gw0", 1010, 1050)
    timeline.note("tests/b.py::one", "gw1", 1001, 1020)
    timeline.note("tests/a.py::two", "gw0", 1050, 1150)
    timeline.note("tests/b.py::tiny", "gw1", 1020, 1022)
    timeline.note("tests/c.py::x", "gw1", 1100, 1102)  # under 5 s: no module line
    lines = timeline.summary(1000.0, 1200.0)
    rows = [line.split() for line in lines[1:3]]
    assert rows == [["tests/b.py", "gw1", "1", "21"], ["tests/a.py", "gw0", "10", "140"]], lines
    assert not any(line.startswith("tests/c.py") for line in lines)
    assert "worker gw0: busy 140 s, idle 0 s at the end (last test ended 150 s in)" in lines
    assert "worker gw1: busy 23 s, idle 48 s at the end (last test ended 102 s in)" in lines
    assert lines[-1] == "session: 200 s, tests ran until 150 s"


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "LEDGER", tmp_path / "ledger.json")
    monkeypatch.setattr(memory, "POLL_S", 0.05)
    monkeypatch.setenv("ASCENDSERVE_TEST_MEMORY_GIB", "5")
    monkeypatch.setenv("ASCENDSERVE_TEST_LEDGER", str(tmp_path / "ledger.json"))
    monkeypatch.delenv("ASCENDSERVE_TEST_SESSION_PID", raising=False)
    return tmp_path / "ledger.json"


def _hold(gib, hold_s, q):
    key = memory.reserve(gib, "child")
    q.put(("held", time.monotonic()))
    time.sleep(hold_s)
    memory.release(key)


def test_a_start_that_does_not_fit_waits_for_a_release(ledger):
    keys = memory.reserve_many([(2, "a"), (2, "b")])
    q = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_hold, args=(2, 0, q))
    child.start()
    time.sleep(0.5)
    assert q.empty(), "4 + 2 GiB went past a 5 GiB budget"
    released = time.monotonic()
    memory.release(keys[0])
    state, at = q.get(timeout=10)
    assert state == "held" and at >= released
    child.join(10)
    memory.release(keys[1])
    assert memory.held() == []


def _die_holding(q):
    memory.reserve(4, "killed")
    q.put("held")
    q.close()
    q.join_thread()
    os._exit(1)  # killed: no release


def test_a_dead_owners_reservation_is_dropped(ledger):
    q = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_die_holding, args=(q,))
    child.start()
    assert q.get(timeout=10) == "held"
    child.join(10)
    key = memory.reserve(4, "after", wait_s=5)  # would time out if the dead one still counted
    memory.release(key)


def _hold_then_want_more(q):
    memory.reserve(2, "child first")
    q.put("held")
    time.sleep(0.3)
    memory.reserve(3, "child more", wait_s=10)
    q.put("child went ahead")


def test_two_waiters_holding_what_the_other_needs_do_not_hang(ledger):
    mine = memory.reserve(3, "parent first")
    q = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_hold_then_want_more, args=(q,))
    child.start()
    assert q.get(timeout=10) == "held"
    time.sleep(0.1)
    started = time.monotonic()
    more = memory.reserve(3, "parent more", wait_s=10)  # 8 of 5 GiB: only the deadlock rule lets it in
    assert time.monotonic() - started < 5
    memory.release(more)
    memory.release(mine)
    assert q.get(timeout=10) == "child went ahead"
    child.join(10)


def test_waiting_has_a_deadline_naming_the_holders(ledger):
    key = memory.reserve(4, "the big one")
    q = mp.get_context("fork").Queue()

    def want():
        try:
            memory.reserve(2, "late", wait_s=0.5)
            q.put("fitted")
        except TimeoutError as e:
            q.put(str(e))

    # the holder runs (is not waiting): waiting is right, and it ends at the deadline
    child = mp.get_context("fork").Process(target=want)
    child.start()
    msg = q.get(timeout=10)
    child.join(10)
    memory.release(key)
    assert "never fitted" in msg and "the big one" in msg


def test_the_reaper_stops_an_engine_group_when_the_session_dies(tmp_path):
    session = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    reaper = subprocess.Popen([sys.executable, "-m", "tests.reaper", str(session.pid), str(engine.pid)],
                              cwd=str(REPO))
    try:
        time.sleep(1.5)
        assert engine.poll() is None, "reaped while the session lived"
        session.kill()
        session.wait()
        assert engine.wait(15) != 0
        assert reaper.wait(15) == 0
    finally:
        for p in (session, engine, reaper):
            if p.poll() is None:
                p.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a process its default niceness back needs root")
def test_a_process_starts_niced_and_every_thread_gets_the_default_once_it_serves(tmp_path):
    """tests/procs.START_NICE: a Proc starts niced (start-ups yield to serving engines), and
    wait_ready gives every thread of its tree the default back, threads started while niced
    and a child's included (Linux's nice is per thread)."""
    from tests.procs import START_NICE, renice_tree

    code = ("import http.server, subprocess, sys, threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler)"
            ".serve_forever()\n")
    port = ports.free_port()
    proc = Proc("niced", [sys.executable, "-c", code, str(port)], port, tmp_path / "niced.log", ready_path="/")
    proc.start()
    try:
        def nices() -> list[int]:
            import psutil

            tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
            return [os.getpriority(os.PRIO_PROCESS, int(t)) for p in tree for t in os.listdir(f"/proc/{p}/task")]

        deadline = time.monotonic() + 10
        while len(nices()) < 3 and time.monotonic() < deadline:  # main and sleeper thread, the child
            time.sleep(0.05)
        assert set(nices()) == {START_NICE}
        proc.wait_ready(timeout=30)
        assert set(nices()) == {0} and len(nices()) >= 3
        assert renice_tree(proc.pid, 0) >= 3
    finally:
        proc.stop(timeout=5)
