"""The supervisor's children do not outlive it, even when it is SIGKILLed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

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
