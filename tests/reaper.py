"""`python -m tests.reaper WATCH_PID PGID`: kill process group PGID once WATCH_PID is gone.

Started beside each engine shared by a test session (tests/shared_engines.py), in a session
of its own: when the controlling pytest process dies without stopping the engine (SIGKILL, a
CI timeout), the engine's group gets SIGTERM, then SIGKILL 10 s later. Exits as soon as the
group is gone. Polls once a second; nothing else.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str]) -> int:
    watch, pgid = int(argv[0]), int(argv[1])
    while _group_exists(pgid):
        if not alive(watch):
            for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    return 0
                deadline = time.monotonic() + wait_s
                while _group_exists(pgid) and time.monotonic() < deadline:
                    time.sleep(0.2)
            return 0
        time.sleep(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
