"""Start-up failures and stops: an engine role and `all` honour SIGTERM while vLLM starts; `all`
gives up on an engine that cannot start instead of restarting it for ever."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.procs import ENGINE_ENV, ShmWatch, free_port, free_port_run

pytestmark = pytest.mark.integration
STOP_WITHIN_S = 10.0


SHM = ("psm_", "sem.mp-")  # Python multiprocessing's shared memory and semaphores (vLLM's queues)


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _wait_for_vllm_engine(pid: int, timeout_s: float = 180.0) -> list[psutil.Process]:
    """Block until vLLM's engine core runs under `pid` (the start is then loading, compiling...)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tree = _tree(pid)
        if any("EngineCore" in " ".join(p.cmdline()) or p.name().startswith("VLLM") for p in _alive(tree)):
            return tree
        time.sleep(0.2)
    raise AssertionError("vLLM's engine core never started")


def _sigterm_and_time(proc: subprocess.Popen, watched: list[psutil.Process]) -> float:
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    while _alive(watched) and time.monotonic() - started < 60:
        time.sleep(0.05)
    return time.monotonic() - started


def _start(argv: list[str], log: Path, **env) -> tuple[subprocess.Popen, ShmWatch]:
    proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **ENGINE_ENV, **env})
    return proc, ShmWatch(proc.pid, SHM)


def _cleanup(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    for p in _alive(_tree(proc.pid)):
        p.kill()



def _assert_no_shm_left(watch: ShmWatch, wait_s: float = 5.0) -> None:
    """None of the segments the instance's processes mapped is left in /dev/shm (vLLM's last
    processes get a moment to unlink what they made). Scoped to this test's processes: another
    worker's engines create and remove segments meanwhile."""
    seen = watch.stop()
    deadline = time.monotonic() + wait_s
    while watch.left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not watch.left(), f"left in /dev/shm: {watch.left()} (of {len(seen)} seen)"


SLOW_EXIT = """\
import os, time
class _SlowFinalizer:
    def __del__(self):
        time.sleep(60)
if os.environ.pop("ASF_TEST_SLOW_EXIT", None):  # this process only, not its children
    _held = _SlowFinalizer()
"""


def _slow_interpreter_exit(tmp_path: Path) -> dict[str, str]:
    """Environment under which the started process's interpreter finalization takes 60 s (a
    module global's finalizer, run after daemon threads stop running): what CI saw once, a pd
    role that logged "stopped" during start-up and then did not exit for 7.7 s."""
    site = tmp_path / "slow-exit-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_EXIT)
    path = os.environ.get("PYTHONPATH")
    return {"ASF_TEST_SLOW_EXIT": "1", "PYTHONPATH": str(site) + (os.pathsep + path if path else "")}


@pytest.mark.memory_gib(2.0)  # tests/memory.py: the engine starts without tests.procs
@pytest.mark.parametrize("delay_s", [0.0, 3.0])
def test_an_engine_role_stops_within_10_s_of_sigterm_during_start_up(text_model, tmp_path, delay_s):
    """SIGTERM as soon as vLLM's engine core runs, and a little later (loading, compiling): vLLM's own
    start-up handler's KeyboardInterrupt was swallowed there and the instance came up regardless.
    The role's interpreter is made slow to finalize: the stop must not wait on that."""
    port = free_port()
    proc, watch = _start([sys.executable, "-m", "ascendserve", "--role", "pd", "--model", str(text_model), "--port",
                   str(port), "--runtime-dir", str(tmp_path / "run"), "--log-format", "json"], tmp_path / "pd.log",
                   **_slow_interpreter_exit(tmp_path))
    try:
        tree = _wait_for_vllm_engine(proc.pid)
        time.sleep(delay_s)
        tree = [psutil.Process(proc.pid), *tree, *_tree(proc.pid)]
        took = _sigterm_and_time(proc, tree)
        log = (tmp_path / "pd.log").read_text(errors="replace")
        assert took < STOP_WITHIN_S, f"took {took:.1f} s:\n{log[-3000:]}"
        assert proc.returncode == 0, log[-3000:]
        assert "stopped during start-up" in log
        assert not _alive(tree)
        assert "Application startup complete" not in log  # it did not go on starting
        _assert_no_shm_left(watch)
    finally:
        _cleanup(proc)


@pytest.mark.memory_gib(2.0)
def test_all_stops_within_10_s_of_sigterm_while_its_engine_starts(text_model, tmp_path):
    port = free_port_run(11)
    proc, watch = _start([sys.executable, "-m", "ascendserve", "--role", "all", "--topology", "mono", "--model",
                   str(text_model), "--port", str(port), "--runtime-dir", str(tmp_path / "run"),
                   "--log-format", "json"], tmp_path / "all.log")
    try:
        _wait_for_vllm_engine(proc.pid)
        time.sleep(2.0)
        tree = [psutil.Process(proc.pid), *_tree(proc.pid)]
        took = _sigterm_and_time(proc, tree)
        log = (tmp_path / "all.log").read_text(errors="replace")
        assert took < STOP_WITHIN_S, f"took {took:.1f} s:\n{log[-3000:]}"
        assert proc.returncode == 0 and not _alive(tree), log[-3000:]
        assert "ignored SIGTERM" not in log
        _assert_no_shm_left(watch)
    finally:
        _cleanup(proc)


@pytest.mark.memory_gib(4.0)
def test_all_gives_up_on_engines_that_cannot_start(text_model, tmp_path):
    """1P1D on a model directory without weights: the engines' start fails every time; `all`
    gives up after --start-limit failures in a row, prints vLLM's error and exits 1, leaving
    nothing running. Meanwhile the proxy says why it cannot serve (503, not an empty model list)."""
    broken = tmp_path / "no-weights"
    shutil.copytree(text_model, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    port = free_port_run(12)
    started = time.monotonic()
    out, err = tmp_path / "all.out", tmp_path / "all.err"
    proc = subprocess.Popen([sys.executable, "-m", "ascendserve", "--role", "all", "--topology", "1P1D", "--model",
                             str(broken), "--port", str(port), "--runtime-dir", str(tmp_path / "run"),
                             "--start-limit", "2", "--log-format", "json"],
                            stdout=open(out, "wb"), stderr=open(err, "wb"), start_new_session=True,
                            env={**os.environ, **ENGINE_ENV})
    watch = ShmWatch(proc.pid, SHM)
    url = f"http://127.0.0.1:{port}"
    try:
        seen = set()
        while proc.poll() is None and time.monotonic() - started < 300:
            try:
                models = httpx.get(url + "/v1/models", timeout=2)
                health = httpx.get(url + "/health", timeout=2)
                seen.add((models.status_code, models.json()["error"]["message"], health.status_code))
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(1.0)
        took = time.monotonic() - started
        assert proc.poll() == 1, f"all still running or exit {proc.poll()} after {took:.0f} s"
        errors = err.read_text(errors="replace")
        assert "failed to start 2 time(s) in a row" in errors
        report = errors.split("giving up and stopping the others.", 1)[1]
        assert "Cannot find any model weights" in report, report[:3000]
        assert "children stopped" in errors
        assert errors.count("child exited before it was up; restarting") >= 1
        assert seen, "the proxy never answered"
        assert all(status == 503 and h == 503 and "no engine instance registered" in message
                   for status, message, h in seen), seen
        assert not _alive(_tree(proc.pid))
        _assert_no_shm_left(watch)
        assert took < 240
    finally:
        _cleanup(proc)
