"""Run child processes, restart the ones that die, stop them all on the way out.

Each child gets its own process group, so stopping it reaches whatever it
spawned (vLLM's engine core and workers) even if the child itself was
SIGKILLed; and each child gets SIGTERM if the supervisor itself dies.

A child is *up* once its readiness probe (`Child.ready_url`: its /health or
/healthcheck) has answered 200. One that was up and then exits is restarted
after an exponential backoff (1 s, 2 s, 4 s ... up to `backoff_max_s`, reset
once it has stayed up for a minute). One that exits before it was ever up
failed to start: after `start_limit` such failures in a row (systemd's start
limit) the supervisor gives up: it prints the child's last output lines, stops
every other child and `run()` returns (`gave_up` names the child), so the
caller exits non-zero instead of restarting a broken start for ever.

Children's stdout and stderr go through the supervisor: every line is
forwarded to the supervisor's own stdout/stderr as it comes, and the last
`TAIL_LINES` of each child's current run are kept for that report.
"""

from __future__ import annotations

import collections
import glob
import json
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import structlog

from ascendserve.launch.children import kill_group

log = structlog.get_logger("ascendserve.supervisor")
STABLE_AFTER_S = 60.0
GROUP_GRACE_S = 5.0
TAIL_LINES = 200  # kept per child (its current run)
ERROR_LINES = 20  # error lines kept per child (its current run)
REPORT_LINES = 20  # last lines printed when it is given up, after its error lines
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 1.0
DEFAULT_START_LIMIT = 3


def self_command() -> list[str]:
    """The command that runs this program again: the frozen bundle's binary, or `python -m ascendserve`."""
    return [sys.executable] if getattr(sys, "frozen", False) else [sys.executable, "-m", "ascendserve"]


def device_nodes() -> dict[str, int]:
    """Accelerator device files on this host (drivers present, whatever torch sees)."""
    return {"davinci": len(glob.glob("/dev/davinci[0-9]*")), "nvidia": len(glob.glob("/dev/nvidia[0-9]*"))}


def child_log_format(fmt: str) -> str:
    """The log format children should use: what `auto` means for the supervisor's own stderr
    (children write into a pipe, where `auto` would always mean JSON)."""
    if fmt != "auto":
        return fmt
    return "console" if sys.stderr.isatty() else "json"


def probe_host(host: str) -> str:
    """Where a server bound to `host` answers on this machine."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


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
    ready_url: str = ""  # GET -> 200 once the child is up; "" = up as soon as it runs
    popen: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    next_start: float = 0.0
    backoff_s: float = 1.0
    ready: bool = False  # this run has answered its readiness probe
    failed_starts: int = 0  # runs in a row that exited before they were up
    last_probe: float = 0.0
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    errors: collections.deque = field(default_factory=lambda: collections.deque(maxlen=ERROR_LINES))
    readers: list[threading.Thread] = field(default_factory=list)


_SSL = ssl.create_default_context()
_SSL.check_hostname = False
_SSL.verify_mode = ssl.CERT_NONE  # a loopback liveness probe, not a trust decision


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(: .*)?$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def error_summary(line: str) -> str | None:
    """The error a child's output line reports, in one line, or None: a JSON log record at level
    error or critical (its event, and the last line of its traceback: the exception itself), a
    console record at those levels, or the last line of a traceback written raw."""
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            if str(record.get("level", "")).lower() not in ("error", "critical", "exception"):
                return None
            summary = str(record.get("event", ""))
            exc = record.get("exception")
            if isinstance(exc, str) and exc.strip():
                summary += ": " + exc.strip().splitlines()[-1]
            return summary[:1000]
    plain = _ANSI.sub("", line).strip()
    if "[error" in plain or "[critical" in plain or _EXCEPTION_LINE.match(plain):
        return plain[:1000]
    return None


def probe(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=_SSL if url.startswith("https") else None) as r:
            return r.status == 200
    except (OSError, ValueError, urllib.error.HTTPError):
        return False


class _TextSink:
    """Bytes written to a text stream that has no binary buffer (a replaced sys.stdout)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, raw: bytes) -> None:
        self.stream.write(raw.decode(errors="replace"))

    def flush(self) -> None:
        self.stream.flush()


def _binary(stream):
    return getattr(stream, "buffer", None) or _TextSink(stream)


class Supervisor:
    def __init__(self, children: list[Child], base_env: dict[str, str], backoff_max_s: float = 30.0,
                 start_limit: int = DEFAULT_START_LIMIT, stop_timeout_s: float = 30.0,
                 probe_fn=probe, out=None, err=None):
        self.children = children
        self.base_env = base_env
        self.backoff_max_s = backoff_max_s
        self.start_limit = start_limit  # 0: never give up
        self.stop_timeout_s = stop_timeout_s
        self.stopping = threading.Event()
        self.gave_up: Child | None = None
        self._probe = probe_fn
        self._out = out if out is not None else _binary(sys.stdout)
        self._err = err if err is not None else _binary(sys.stderr)
        self._write_lock = threading.Lock()

    # ---- output ---------------------------------------------------------
    def _forward(self, child: Child, stream, sink) -> None:
        """Copy one pipe of a child to `sink` line by line, keeping the last lines."""
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip("\r\n")
                child.tail.append(line)
                if (summary := error_summary(line)) is not None:
                    child.errors.append(summary)
                with self._write_lock:
                    try:
                        sink.write(raw)
                        sink.flush()
                    except (OSError, ValueError):  # our own output is gone: keep draining the child
                        pass
        finally:
            stream.close()

    def _start(self, child: Child) -> None:
        child.tail.clear()
        child.errors.clear()
        child.ready, child.last_probe = False, 0.0
        child.popen = subprocess.Popen(child.argv, env={**self.base_env, **child.env}, start_new_session=True,
                                       preexec_fn=_die_with_parent, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        child.readers = [threading.Thread(target=self._forward, args=(child, pipe, sink), daemon=True,
                                          name=f"supervisor-{child.name}-{which}")
                         for pipe, sink, which in ((child.popen.stdout, self._out, "out"),
                                                   (child.popen.stderr, self._err, "err"))]
        for t in child.readers:
            t.start()
        child.started_at = time.monotonic()
        log.info("started", child=child.name, pid=child.popen.pid)

    def _drain(self, child: Child, timeout_s: float = 2.0) -> None:
        deadline = time.monotonic() + timeout_s
        for t in child.readers:
            t.join(max(0.0, deadline - time.monotonic()))

    def start_all(self) -> None:
        for child in self.children:
            self._start(child)

    # ---- supervision ------------------------------------------------------
    def _check_ready(self, child: Child, now: float) -> None:
        if child.ready:
            return
        if not child.ready_url:
            child.ready = True
        elif now - child.last_probe >= PROBE_INTERVAL_S:
            child.last_probe = now
            child.ready = self._probe(child.ready_url)
        if child.ready:
            child.failed_starts = 0
            log.info("child is up", child=child.name, pid=child.popen.pid,
                     after_s=round(now - child.started_at, 1))

    def poll_once(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if self.stopping.is_set():
                return
            if child.popen is None:
                if now >= child.next_start:
                    self._start(child)
                continue
            code = child.popen.poll()
            if code is None:
                self._check_ready(child, now)
                if child.ready and now - child.started_at > STABLE_AFTER_S:
                    child.backoff_s = 1.0
                continue
            kill_group(child.popen.pid, GROUP_GRACE_S)  # whatever it left behind
            self._drain(child)
            was_up = child.ready
            child.popen = None
            if not was_up:
                child.failed_starts += 1
                if self.start_limit and child.failed_starts >= self.start_limit:
                    self._give_up(child, code)
                    return
            child.restarts += 1
            child.next_start = now + child.backoff_s
            log.warning("child exited; restarting" if was_up else "child exited before it was up; restarting",
                        child=child.name, exit_code=code, restart_in_s=child.backoff_s, restarts=child.restarts,
                        **({} if was_up else {"failed_starts": child.failed_starts,
                                              "start_limit": self.start_limit or None}))
            child.backoff_s = min(child.backoff_s * 2, self.backoff_max_s)

    def _give_up(self, child: Child, code: int) -> None:
        self.gave_up = child
        log.error("child failed to start; giving up", child=child.name, exit_code=code,
                  failed_starts=child.failed_starts, start_limit=self.start_limit)
        lines = list(child.tail)[-REPORT_LINES:]
        report = [f"ascendserve: {child.name} failed to start {child.failed_starts} time(s) in a row "
                  f"(last exit code {code}); giving up and stopping the others."]
        if child.errors:
            report.append(f"Errors of its last run ({child.name}):")
            report += [f"  {child.name} ! {line}" for line in child.errors]
        report.append(f"Last {len(lines)} output line(s) of {child.name}:" if lines else f"{child.name} wrote nothing.")
        report += [f"  {child.name} | {line}" for line in lines]
        with self._write_lock:
            try:
                self._err.write(("\n".join(report) + "\n").encode())
                self._err.flush()
            except (OSError, ValueError):
                pass
        self.stopping.set()

    def run(self) -> None:
        while not self.stopping.wait(0.5):
            self.poll_once()

    def exit_code(self) -> int:
        return 1 if self.gave_up is not None else 0

    def stop_all(self, timeout_s: float | None = None) -> None:
        timeout_s = self.stop_timeout_s if timeout_s is None else timeout_s
        alive = [c for c in reversed(self.children) if c.popen is not None]
        for child in alive:
            if child.popen.poll() is None:
                child.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in alive:
            try:
                child.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("child ignored SIGTERM; killing", child=child.name, after_s=timeout_s)
            exited = child.popen.poll() is not None
            # a killed group's resource tracker gets a moment to unlink the shared memory the others leaked
            kill_group(child.popen.pid, GROUP_GRACE_S if exited else 0.0, tracker_grace_s=2.0)
            try:
                child.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass
            self._drain(child)
        log.info("all children stopped")
