"""A stop during start-up reaps the processes that appear while it stops.

Seen in the suite under load: SIGTERM came while vLLM's engine core was spawning its worker;
the stop killed the engine core (the only descendant it had listed), the half-spawned worker
was re-parented to init and went on importing torch for 17 s. Here a child that ignores
SIGTERM starts a grandchild during the stop's grace, then is killed: the grandchild must not
outlive the stop.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil

SCRIPT = textwrap.dedent("""
    import os, subprocess, sys, time
    from ascendserve.engine.startup_stop import _StartupStop, _become_subreaper

    child = subprocess.Popen([sys.executable, "-c", '''
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(sys.argv[1] + ".ready", "w").close()
    time.sleep(0.4)
    late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    open(sys.argv[1], "w").write(str(late.pid))
    time.sleep(120)
    ''', sys.argv[1]])
    # the stop begins once the child runs: under the suite's load its interpreter can take
    # longer to start than the grace, and a child killed before its 0.4 s were up has no
    # grandchild at all (the likely cause of one --quick failure; its message was not kept)
    deadline = time.monotonic() + 30
    while not os.path.exists(sys.argv[1] + ".ready") and time.monotonic() < deadline:
        time.sleep(0.01)
    if sys.argv[2] == "subreaper":
        _become_subreaper()  # as the signal handler does
    print(_StartupStop.reap(2.0), flush=True)  # the grandchild appears 0.4 s into the grace
""")


def _stop_with_a_late_grandchild(tmp_path, mode: str) -> tuple[int, str]:
    pid_file = tmp_path / f"late-{mode}.pid"
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(pid_file), mode], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return int(pid_file.read_text()), out.stdout


def _gone(pid: int, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_process_spawned_during_the_grace_is_reaped_too(tmp_path):
    late, killed = _stop_with_a_late_grandchild(tmp_path, "subreaper")
    assert _gone(late), f"the grandchild {late} outlived the stop (killed: {killed})"
    assert str(late) in killed


def test_without_the_subreaper_the_grandchild_escapes(tmp_path):
    """What the fix is for: re-parented to init, the grandchild is out of the stop's sight."""
    late, _ = _stop_with_a_late_grandchild(tmp_path, "plain")
    try:
        assert not _gone(late, within_s=1.0)
    finally:
        try:
            psutil.Process(late).kill()
        except psutil.NoSuchProcess:
            pass
