"""bench/chaos.py's cluster: metaserver, E/P/D engines registered with it, a proxy following it."""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from ascendserve.launch.shm_ledger import inodes_in_use, mapped_by
from tests.procs import ENGINE_ARGS, PYTHON, Proc, control, free_port_run, start_all, wait_for

TOKEN = "chaos-token"
ROLES = ("encoder", "prefill", "decode")
SHORT = {"encoder": "E", "prefill": "P", "decode": "D"}

HEARTBEAT_TIMEOUT_S = 20.0  # on 2 busy cores a heartbeat thread can go 6 s (the default) unscheduled
SERVING_NICE = 10


@dataclass
class Settings:
    model: Path
    log_dir: Path
    counts: dict = field(default_factory=lambda: {"encoder": 2, "prefill": 2, "decode": 2})
    kills: int = 12
    kill_roles: tuple = ROLES
    interval_s: float = 10.0
    target: str = "mixed"
    concurrency: int = 4
    deadline_s: float = 120.0
    max_tokens: int = 24
    kv_ttl_s: float = 10.0
    pin_ttl_s: float = 10.0
    seed: int = 0
    per_wave: int = 1  # kills at once (staggered by 2 s), restarted together


@dataclass
class EngineProc(Proc):
    """An engine started without a memory reservation (tests/integration/test_chaos.py reserves the
    cluster's); its environment is Proc's (the KV cache is ENGINE_ARGS' 256 MiB)."""

    role: str = ""

    def memory_wanted(self) -> float:
        """Nothing of its own: start_all reserved each engine again on top of the module's
        reservation (the chaos module asked for twice its six engines, waited 226 s for the budget
        and held back the other worker's next cluster for 177 s)."""
        return 0.0

    def start(self) -> "EngineProc":
        env = self.environment()
        self._log = open(self.log_path, "ab")  # a restart appends
        self.popen = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        return self


class Cluster:
    def __init__(self, s: Settings):
        self.s = s
        self.shm_name = f"asf-ec-chaos-{os.getpid()}"
        self.engines: dict[str, list[Proc]] = {r: [] for r in ROLES}
        self.meta: Proc | None = None
        self.proxy: Proc | None = None
        self.seen_shm: set[str] = {self.shm_name}  # every segment any of our processes mapped

    def _toml(self, name: str, text: str) -> str:
        path = self.s.log_dir / name
        path.write_text(text)
        return str(path)

    def _engine(self, role: str, i: int, core: int) -> Proc:
        s = self.s
        port = free_port_run(1, offsets=(1000,))  # the API port and the KV side channel's
        ec = ["--ec-connector", "shm", "--ec-shm-name", self.shm_name, "--ec-shm-size-mb", "64"]
        extra = {"encoder": ec, "prefill": ["--kv-connector", "pull", "--kv-ttl", str(s.kv_ttl_s), "--ec-enabled", *ec],
                 "decode": ["--kv-connector", "pull"]}[role]
        config = self._toml("engine.toml", f"[ec]\npin_ttl_s = {s.pin_ttl_s}\n")
        argv = [PYTHON, "-m", "ascendserve", "--role", role, "--model", str(s.model), "--port", str(port),
                *ENGINE_ARGS, "--config", config, "--cluster-token", TOKEN, "--metaserver-url", self.meta.url,
                "--log-format", "json", *extra]  # ENGINE_ARGS: a 256 MiB KV cache
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(core)}
        name = f"{SHORT[role]}{i}"
        return EngineProc(name, argv, port, s.log_dir / f"{name}.log", env, role=role)

    def start(self) -> None:
        s = self.s
        meta_toml = self._toml("metaserver.toml", f"[metaserver]\nheartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}\n")
        self.meta = control("metaserver", s.log_dir, "--config", meta_toml, "--cluster-token", TOKEN,
                            name="metaserver")
        start_all(self.meta)
        core = 0
        for role in ROLES:
            for i in range(s.counts[role]):
                self.engines[role].append(self._engine(role, i, core))
                core = 1 - core
        start_all(*self.all_engines())
        for proc in self.all_engines():
            yield_to_starts(proc)
        proxy_toml = self._toml("proxy.toml", "[proxy]\nhealth_interval_s = 2.0\nhealth_timeout_s = 10.0\n")
        self.proxy = control("proxy", s.log_dir, "--config", proxy_toml, "--cluster-token", TOKEN,
                             "--metaserver-url", self.meta.url, "--ec-connector", "shm", "--ec-shm-name",
                             self.shm_name, "--ec-shm-size-mb", "64", name="proxy")
        start_all(self.proxy)
        wait_for(lambda: all(self.admitted(p) for p in self.all_engines()), 120,
                 "the proxy never admitted every instance from the registry")
        self.note_shm()

    def all_engines(self) -> list[Proc]:
        return [p for r in ROLES for p in self.engines[r]]

    def procs(self) -> list[Proc]:
        return [p for p in [self.meta, *self.all_engines(), self.proxy] if p is not None]

    def stop(self) -> dict[str, int | None]:
        """SIGTERM everything; the exit status of each instance that was running."""
        codes = {}
        for p in reversed(self.procs()):
            if p.popen is not None:
                running = p.popen.poll() is None
                p.stop(timeout=30)
                if running:
                    codes[p.name] = p.popen.returncode
        return codes

    def instances(self) -> dict[int, dict]:
        """The proxy's view: port -> its summary (state, active_requests, ...)."""
        r = httpx.get(self.proxy.url + "/instances", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10)
        r.raise_for_status()
        return {port_of(i["url"]): i for i in r.json()["instances"]}

    def admitted(self, proc: Proc) -> bool:
        try:
            return self.instances().get(proc.port, {}).get("state") == "active"
        except httpx.HTTPError:
            return False

    def wait_busy(self, proc: Proc, timeout: float = 20.0) -> int:
        """Wait (bounded) until the proxy has a request on `proc`; how many it has."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                n = self.instances().get(proc.port, {}).get("active_requests", 0)
            except httpx.HTTPError:
                n = 0
            if n or time.monotonic() > deadline:
                return n
            time.sleep(0.02)

    def note_shm(self) -> None:
        for proc in self.procs():
            if proc.popen is not None and proc.popen.poll() is None:
                self.seen_shm |= set(tree_shm(proc))

    def in_flight(self) -> int:
        return int(httpx.get(self.proxy.url + "/healthcheck", timeout=10).json()["request_num"])


def yield_to_starts(proc: Proc) -> None:
    """Run a serving instance (its vLLM engine core and workers busy-poll for a second
    after every step) at nice 10, so that an instance restarting at nice 0 is not starved
    for minutes on a small host. Each instance is a session of its own: with the kernel's
    autogroup scheduling (the default) CPU is shared between sessions first, and only the
    session's autogroup nice counts across them; without it, nice is per thread."""
    try:
        Path(f"/proc/{proc.popen.pid}/autogroup").write_text(str(SERVING_NICE))
    except OSError:
        pass
    for p in [psutil.Process(proc.popen.pid), *proc.descendants()]:
        try:
            for t in p.threads():
                os.setpriority(os.PRIO_PROCESS, t.id, SERVING_NICE)
        except (psutil.Error, OSError):
            pass


def port_of(url: str) -> int:
    return int(re.search(r":(\d+)/?$", url).group(1))


def tree_pids(proc: Proc) -> list[int]:
    return [proc.popen.pid, *(p.pid for p in proc.descendants())]


def tree_shm(proc: Proc) -> set[str]:
    return mapped_by(tree_pids(proc))


def unused(names: set[str]) -> set[str]:
    """Those of `names` that exist in /dev/shm and that no live process maps or holds open."""
    busy = inodes_in_use()
    out = set()
    for name in names:
        try:
            if os.stat(os.path.join("/dev/shm", name)).st_ino not in busy:
                out.add(name)
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


