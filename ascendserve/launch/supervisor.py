"""Run child processes, restart the ones that die, stop them all on the way out.

Each child gets its own process group, so stopping it reaches whatever it
spawned (vLLM's engine core and workers) even if the child itself was
SIGKILLed; and each child gets SIGTERM if the supervisor itself dies.
A crashed child is restarted after an exponential backoff
(1 s, 2 s, 4 s ... up to `backoff_max_s`), reset once it has stayed up for
a minute.
"""

from __future__ import annotations

import glob
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import structlog

from ascendserve.launch.children import kill_group

log = structlog.get_logger("ascendserve.supervisor")
STABLE_AFTER_S = 60.0
GROUP_GRACE_S = 5.0


def self_command() -> list[str]:
    """The command that runs this program again: the frozen bundle's binary, or `python -m ascendserve`."""
    return [sys.executable] if getattr(sys, "frozen", False) else [sys.executable, "-m", "ascendserve"]


def device_nodes() -> dict[str, int]:
    """Accelerator device files on this host (drivers present, whatever torch sees)."""
    return {"davinci": len(glob.glob("/dev/davinci[0-9]*")), "nvidia": len(glob.glob("/dev/nvidia[0-9]*"))}


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies, even by SIGKILL.

    Children run in sessions of their own (so stopping one reaches everything
    it spawned), which also means nothing else takes them down with a killed
    supervisor: without this they would serve on as orphans."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the supervisor's own stop path still applies
        pass


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    next_start: float = 0.0
    backoff_s: float = 1.0


class Supervisor:
    def __init__(self, children: list[Child], base_env: dict[str, str], backoff_max_s: float = 30.0):
        self.children = children
        self.base_env = base_env
        self.backoff_max_s = backoff_max_s
        self.stopping = threading.Event()

    def _start(self, child: Child) -> None:
        child.popen = subprocess.Popen(child.argv, env={**self.base_env, **child.env}, start_new_session=True,
                                       preexec_fn=_die_with_parent)
        child.started_at = time.monotonic()
        log.info("started", child=child.name, pid=child.popen.pid)

    def start_all(self) -> None:
        for child in self.children:
            self._start(child)

    def poll_once(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.popen is None:
                if now >= child.next_start:
                    self._start(child)
                continue
            code = child.popen.poll()
            if code is None:
                if now - child.started_at > STABLE_AFTER_S:
                    child.backoff_s = 1.0
                continue
            kill_group(child.popen.pid, GROUP_GRACE_S)  # whatever it left behind
            child.restarts += 1
            child.next_start = now + child.backoff_s
            log.warning("child exited; restarting", child=child.name, exit_code=code,
                        restart_in_s=child.backoff_s, restarts=child.restarts)
            child.backoff_s = min(child.backoff_s * 2, self.backoff_max_s)
            child.popen = None

    def run(self) -> None:
        while not self.stopping.wait(0.5):
            self.poll_once()

    def stop_all(self, timeout_s: float = 30.0) -> None:
        alive = [c for c in reversed(self.children) if c.popen is not None]
        for child in alive:
            if child.popen.poll() is None:
                child.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in alive:
            try:
                child.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("child ignored SIGTERM; killing", child=child.name)
            kill_group(child.popen.pid, GROUP_GRACE_S if child.popen.poll() is not None else 0.0)
            try:
                child.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass
        log.info("all children stopped")

