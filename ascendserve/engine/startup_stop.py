"""Stopping an engine role that is still starting (SIGTERM/SIGINT while vLLM imports, loads,
compiles or allocates): vLLM's processes get SIGTERM at once and SIGKILL shortly after, and
the role leaves without an interpreter finalization (exit_now)."""

from __future__ import annotations

import os
import signal
import sys
import threading

from ascendserve.logging import get_logger


def still_running(proc) -> bool:
    """A live descendant other than multiprocessing's resource tracker (it lives until we exit)."""
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def exit_now(code: int) -> None:
    """End this process once its own cleanup is done, skipping the interpreter's finalization.

    After a stop during start-up, vLLM's half-built state is torn down by module finalization,
    where a daemon thread can no longer run: CI saw a pd role log "stopped" and then not exit
    for 7.7 s (its supervisor killed it; _StartupStop's watchdog never got to run). atexit
    callbacks (multiprocessing's, logging's flush) still run; then stdio is flushed."""
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(code)


STARTUP_GRACE_S = 1.0  # SIGTERM during start-up: vLLM's processes get this long after their SIGTERM, then SIGKILL
STARTUP_EXIT_S = 6.0  # and this process exits this long after the signal, whatever it is stuck in


class StartupInterrupted(SystemExit):
    """SIGTERM or SIGINT while vLLM starts (imports, model load, compilation, KV allocation).

    vLLM's own start-up handler raises KeyboardInterrupt, and vLLM swallows it: the engine-core
    handshake (`wait_for_engine_startup`) runs inside `zmq_socket_ctx`, which catches
    KeyboardInterrupt and only logs it at debug level, so the start went on, uvicorn then put its
    own handlers in place and the signal was lost (a pd role SIGTERMed while loading served on;
    a supervisor waited for it until its own SIGKILL deadline). A SystemExit is caught by nothing
    on that path (vLLM's `except BaseException` blocks re-raise; uvloop re-raises SystemExit from
    callbacks, where another BaseException would be logged and dropped)."""

    def __init__(self, signum: int):
        super().__init__(0)
        self.signum = signum


class _StartupStop:
    """This process's SIGTERM/SIGINT handler until uvicorn installs its own (`_run_server`).

    The first signal raises StartupInterrupted in the main thread, so vLLM's start-up unwinds
    through its cleanup and ours (heartbeat, shared-memory ledger). A start has nothing to drain,
    and vLLM's engine core and workers, busy loading or compiling, were seen to take more than
    5 s over a SIGTERM (vLLM's own grace before SIGKILL): a watchdog sends them SIGTERM at once
    and SIGKILL STARTUP_GRACE_S later (never to multiprocessing's resource tracker: it unlinks
    the shared memory the killed leave when this process exits), and ends this process
    STARTUP_EXIT_S after the signal if it is still there (an interpreter exit waiting on some
    thread)."""

    def __init__(self, grace_s: float = STARTUP_GRACE_S, exit_s: float = STARTUP_EXIT_S):
        self.grace_s, self.exit_s = grace_s, exit_s
        self.signum: int | None = None
        self.install()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            return  # already stopping: a second signal must not interrupt the cleanup
        self.signum = signum
        _become_subreaper()
        threading.Thread(target=self._watchdog, name="ascendserve-startup-stop", daemon=True).start()
        raise StartupInterrupted(signum)

    def _watchdog(self) -> None:
        import time

        started = time.monotonic()
        killed = self.reap(self.grace_s)
        if killed:
            get_logger("ascendserve.engine").info("vLLM processes killed after the start-up stop grace",
                                                  pids=killed, grace_s=self.grace_s)
        time.sleep(max(0.0, self.exit_s - (time.monotonic() - started)))
        get_logger("ascendserve.engine").warning("still stopping after the start-up stop deadline; exiting now",
                                                 deadline_s=self.exit_s)
        self.reap(0.0)
        os._exit(0)  # a daemon thread: this runs only while the process is still there

    @staticmethod
    def reap(grace_s: float) -> list[int]:
        """SIGTERM this process's descendants (not the resource tracker), SIGKILL what is left after
        `grace_s` (at once for 0), then SIGKILL any that appeared meanwhile, for up to 2 s.
        Returns the pids that had to be killed."""
        import time

        import psutil

        def descendants():
            return [p for p in psutil.Process().children(recursive=True) if still_running(p)]

        def signal_all(procs, kill: bool) -> None:
            for p in procs:
                try:
                    p.kill() if kill else p.terminate()
                except psutil.Error:
                    pass

        procs = descendants()
        signal_all(procs, kill=not grace_s)
        _, alive = psutil.wait_procs(procs, timeout=grace_s) if grace_s else ([], procs)
        signal_all(alive, kill=True)
        psutil.wait_procs(alive, timeout=2.0)
        killed = [p.pid for p in alive]
        # a worker that its engine core was still spawning when the signal came appears only now,
        # re-parented to this process (a subreaper since the signal) rather than to init
        deadline = time.monotonic() + 2.0
        while (late := descendants()) and time.monotonic() < deadline:
            signal_all(late, kill=True)
            psutil.wait_procs(late, timeout=0.5)
            killed += [p.pid for p in late]
        return killed


def _become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process instead of init (Linux
    PR_SET_CHILD_SUBREAPER), so that a stop still finds and reaps them."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass
