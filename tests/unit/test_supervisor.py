"""The supervisor: children do not outlive it, a child that never starts is given up, one that
was up and crashed is restarted, every line of the children is forwarded."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ascendserve.launch import supervisor
from ascendserve.launch.supervisor import Child, Supervisor

SCRIPT = """
import sys
from ascendserve.launch.supervisor import Child, Supervisor
sup = Supervisor([Child("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"])], {})
sup.start_all()
print("PID", sup.children[0].popen.pid, flush=True)
sup.run()
"""


def test_children_die_with_a_killed_supervisor():
    parent = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        line = next(line for line in parent.stdout if line.startswith("PID "))
        child = psutil.Process(int(line.split()[1]))
        assert child.is_running()
        parent.send_signal(signal.SIGKILL)  # no chance to stop its children itself
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.1)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    finally:
        parent.kill()


class _Sink(io.BytesIO):
    """What the supervisor forwards to (its stdout or stderr), readable while it runs."""

    def text(self) -> str:
        return self.getvalue().decode()


def _supervisor(children, **kw) -> tuple[Supervisor, _Sink, _Sink]:
    out, err = _Sink(), _Sink()
    # readiness: the child's ready_url is a file the child creates once it is "up"
    kw.setdefault("probe_fn", lambda url: Path(url).exists())
    return Supervisor(children, {}, out=out, err=err, **kw), out, err


@pytest.fixture
def fast_polls(monkeypatch):
    """A child is probed at every poll (0.05 s apart in _run), not once a second."""
    monkeypatch.setattr(supervisor, "PROBE_INTERVAL_S", 0.0)


def _run(sup: Supervisor, timeout_s: float, until=lambda: False) -> None:
    """Supervisor.run()'s loop (poll_once until `stopping` is set, as when it gives up), polling every
    0.05 s rather than 0.5 s, until `until()` holds or `timeout_s` has passed."""
    sup.start_all()
    deadline = time.monotonic() + timeout_s
    while not sup.stopping.wait(0.05) and not until() and time.monotonic() < deadline:
        sup.poll_once()


def _alive(child: Child) -> bool:
    return child.popen is not None and child.popen.poll() is None


def test_a_child_that_never_starts_is_given_up_with_its_last_lines(tmp_path, fast_polls):
    crasher = Child("engine", [sys.executable, "-c",
                               "import json, sys; print('loading weights', flush=True); "
                               "print(json.dumps({'event': 'WorkerProc failed to start.', 'level': 'error', "
                               "'exception': 'Traceback ...\\nRuntimeError: Cannot find any model weights'}), "
                               "file=sys.stderr); "
                               "[print(f'noise {i}', file=sys.stderr) for i in range(300)]; "
                               "print('RuntimeError: no safetensors in /models/x', file=sys.stderr); sys.exit(3)"],
                    ready_url=str(tmp_path / "never"), backoff_s=0.05)
    sleeper = Child("metaserver", [sys.executable, "-c", "import time; time.sleep(120)"])
    sup, out, err = _supervisor([sleeper, crasher], backoff_max_s=0.5, start_limit=3)
    started = time.monotonic()
    _run(sup, 30)
    try:
        assert sup.gave_up is crasher and sup.exit_code() == 1
        assert crasher.failed_starts == 3 and crasher.restarts == 2
        assert time.monotonic() - started < 15
        report = err.text().split("giving up", 1)[1]
        assert "engine failed to start" in err.text()
        assert "engine | RuntimeError: no safetensors in /models/x" in report
        assert "engine | noise 299" in report and "engine | noise 0\n" not in report  # the last lines only
        # the root cause, long scrolled out of the last lines, is kept among the error lines
        assert "engine ! WorkerProc failed to start.: RuntimeError: Cannot find any model weights" in report
        assert "engine ! RuntimeError: no safetensors in /models/x" in report
        assert "engine ! noise" not in report
        assert out.text().count("loading weights") == 3  # each run's stdout was forwarded
        assert _alive(sleeper)  # stop_all's job, not poll_once's
    finally:
        sup.stop_all(timeout_s=5)
    assert not _alive(sleeper)


def test_a_child_that_was_up_and_crashes_is_restarted_and_not_counted(tmp_path, fast_polls):
    marker = tmp_path / "up"
    # up at once (the marker), crashes after 1 s: a crash after a good start
    code = f"import pathlib, sys, time; pathlib.Path({str(marker)!r}).touch(); time.sleep(1.0); sys.exit(1)"
    flaky = Child("decode", [sys.executable, "-c", code], ready_url=str(marker), backoff_s=0.05)
    sup, _, err = _supervisor([flaky], backoff_max_s=0.5, start_limit=1)
    _run(sup, 12, until=lambda: flaky.restarts >= 3)  # a crash counted as a failed start gives up at once
    try:
        assert sup.gave_up is None and sup.exit_code() == 0, err.text()
        assert flaky.restarts >= 3 and flaky.failed_starts == 0
    finally:
        sup.stop_all(timeout_s=5)


def test_failed_starts_count_in_a_row_only(tmp_path, fast_polls):
    """A good start in between resets the count: three failures with a good run after the first
    two are not a start limit of 3."""
    runs, marker = tmp_path / "runs", tmp_path / "up"
    code = (f"import pathlib, sys, time\nr = pathlib.Path({str(runs)!r})\nn = len(r.read_text()) if r.exists() else 0\n"
            f"r.write_text('x' * (n + 1))\nm = pathlib.Path({str(marker)!r})\n"
            "if n == 2:\n    m.touch(); time.sleep(1.0); m.unlink(); sys.exit(1)\n"
            "if n >= 5:\n    time.sleep(60)\nsys.exit(2)\n")
    child = Child("prefill", [sys.executable, "-c", code], ready_url=str(marker), backoff_s=0.05)
    sup, _, err = _supervisor([child], backoff_max_s=0.3, start_limit=3)
    _run(sup, 15, until=lambda: runs.exists() and len(runs.read_text()) >= 6)
    try:
        # runs 0, 1 fail; run 2 is up then crashes; runs 3, 4 fail; run 5 stays: never 3 in a row
        assert sup.gave_up is None, err.text()
        assert len(runs.read_text()) == 6 and _alive(child)
    finally:
        sup.stop_all(timeout_s=5)


def test_start_limit_zero_never_gives_up(tmp_path):
    child = Child("proxy", [sys.executable, "-c", "raise SystemExit(1)"], ready_url=str(tmp_path / "never"),
                  backoff_s=0.05)
    sup, _, _ = _supervisor([child], backoff_max_s=0.2, start_limit=0)
    deadline = time.monotonic() + 20
    sup.start_all()
    while child.failed_starts < 4 and time.monotonic() < deadline:  # past the default limit of 3
        sup.poll_once()
        time.sleep(0.1)
    assert sup.gave_up is None and child.failed_starts >= 4
    sup.stop_all(timeout_s=5)


def test_all_children_argv_and_probes():
    """`all`: each engine is told how many engines share the host, gets nothing a user's model
    would not (no demo-only flags), and is probed on its /health; the proxy on /healthcheck."""
    from ascendserve.config import load
    from roles.all import _children

    config = load("all", None, {"all__topology": "1E1P1D", "server__port": 8000}, env={})
    children = {c.name: c for c in _children(config, "/models/m", {})}
    assert set(children) == {"metaserver", "encoder", "prefill", "decode", "proxy"}
    for name in ("encoder", "prefill", "decode"):
        argv = children[name].argv
        assert argv[argv.index("--host-engines") + 1] == "3"
        assert not {"--enforce-eager", "--gpu-memory-utilization", "--dtype", "--max-model-len"} & set(argv)
    assert children["prefill"].ready_url == "http://127.0.0.1:8011/health"
    assert children["metaserver"].ready_url == "http://127.0.0.1:8001/health"
    assert children["proxy"].ready_url == "http://127.0.0.1:8000/healthcheck"
    argv = children["proxy"].argv
    assert argv[argv.index("--log-format") + 1] in ("json", "console")  # resolved: children write to a pipe
    mono = load("all", None, {"all__topology": "mono"}, env={})
    pd = next(c for c in _children(mono, "/models/m", {}) if c.name == "pd")
    assert pd.argv[pd.argv.index("--host-engines") + 1] == "1"


def test_start_limit_flag_and_env():
    from ascendserve.config import load

    assert load("all", None, {}, env={}).all.start_limit == 3
    assert load("all", None, {}, env={"ASCENDSERVE_START_LIMIT": "5"}).all.start_limit == 5
