"""Start real ascendserve / vLLM processes on 127.0.0.1 and stop them cleanly."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from ascendserve.engine import host_defaults
from ascendserve.launch.children import kill_group
from tests import memory, shared_tls
from tests.ports import free_port, free_port_run  # noqa: F401 (per-worker ports; re-exported for the tests)

shared_tls.install()  # every httpx.get/post here and in the tests: one TLS context, not one per call

PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[1]
# An untuned engine (compilation on) takes ~105 s to ready on this 2-core host when alone
# (2026-12-02, test_moe / test_epd untuned setup); in CI, with two workers and three such
# starts at once, two of them missed a 240 s deadline. 360 s still fails a hung start.
READY_TIMEOUT_S = 360.0

# Deterministic, quiet CPU settings for every engine the tests start.
ENGINE_ENV = {
    "OMP_NUM_THREADS": "1",
    # the suite runs several engines on 2 cores: their idle readers nap instead of spinning
    # (engine/patches/idle_poll.py); untuned engines leave it to engine.host_defaults
    "ASCENDSERVE_SHM_NAP_MS": "0.5",
    # one OpenMP thread per worker, bound by nobody: vLLM's "auto" binding would pin every
    # engine's worker thread to core 0 here (1 core in the NUMA node list, the other reserved)
    # and give a prefill or decode worker both cores (its reserve for the KV connector leaves
    # none), OMP_NUM_THREADS notwithstanding; with several engines on two cores, every worker's
    # master thread shared core 0 (core 1 ran only API servers, engine cores and P/D's second
    # threads). A test that needs a binding sets its own; untuned engines keep vLLM's auto
    # (UNTUNED_ENV)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# The same engine settings for ours and for plain vLLM, so outputs compare. The KV cache is 256 MiB
# (ENGINE_ENV's 1 GiB is for engines started without these arguments): 131k tokens of the tiny
# text model, 58k of the MLA one, more than any test keeps at once, and 0.75 GiB less per
# instance to allocate and to reserve in the memory budget (tests/memory.py). (Fewer waits for
# the budget did not shorten the suite, measured: the two cores are the limit.) An argument
# given, the variable is dropped (vLLM's CPU platform would let it override the argument).
KV_CACHE_BYTES = 256 << 20
ENGINE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
               "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]


def all_role_port(proxies: int = 1, etcd: bool = False) -> int:
    """A base port for `--role all`: it binds the port, + 1 (metaserver), + 2.. (more proxies), + 10..
    (engines) and their KV side channels (+ 1000), + 20 and + 21 (its own etcd), so a free base port
    alone is not enough."""
    return free_port_run(1 + proxies, offsets=(10, 11, 12, 1010, 1011, 1012, *((20, 21) if etcd else ())))


ENGINE_ROLES = {"encoder", "prefill", "decode", "pd", "all"}
_RANK_FLAGS = {"--tensor-parallel-size": "tp", "-tp": "tp", "--tp-size": "tp", "--data-parallel-size": "dp",
               "--dp-size": "dp", "--data-parallel-size-local": "dp"}


def engine_ranks(argv: list) -> int:
    """How many vLLM ranks a command line runs (tensor x data parallel); 0 when it is no engine.
    `all` counts as two instances: its 1P1D (its mono is one, over-counted)."""
    args = [str(a) for a in argv]
    role = args[args.index("--role") + 1] if "--role" in args[:-1] else None
    ours = any(a == "ascendserve" or a.endswith("/ascendserve") for a in args)  # -m ascendserve, the bundle
    vllm = any("vllm.entrypoints" in a for a in args) or (args[0].endswith("vllm") and args[1:2] == ["serve"])
    if not (vllm or (ours and (role in ENGINE_ROLES or "launch" in args))) or "--help" in args or "--version" in args:
        return 0
    sizes = {"tp": 1, "dp": 1}
    for i, a in enumerate(args):
        flag, _, value = a.partition("=")
        if flag in _RANK_FLAGS:
            value = value or (args[i + 1] if i + 1 < len(args) else "1")
            if value.isdigit():
                sizes[_RANK_FLAGS[flag]] = int(value)
    return sizes["tp"] * sizes["dp"] * (2 if role == "all" else 1)


def kv_cache_bytes(argv: list) -> int | None:
    """The KV cache size a command line asks for (--kv-cache-memory-bytes, also through
    --vllm-arg=...), or None."""
    args = [str(a) for a in argv]
    for i, a in enumerate(args):
        a = a.removeprefix("--vllm-arg=")
        flag, eq, value = a.partition("=")
        if flag == "--kv-cache-memory-bytes":
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            return int(value) if value.isdigit() else None
    return None


def _terminate_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (a pytest worker
    killed without its teardown), so that it stops its own tree instead of outliving the run."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def pinned_core() -> int | None:
    """With ASCENDSERVE_TEST_PIN_CORES=1 under several xdist workers: the core this worker's
    engines run on (worker i on core i mod cores), so that one worker's load does not move
    the other's latencies. Off by default (an experiment: README "Two workers")."""
    from tests.ports import worker

    index, workers = worker()
    if workers < 2 or os.environ.get("ASCENDSERVE_TEST_PIN_CORES", "0") != "1":
        return None
    return index % (os.cpu_count() or 1)


# A process the tests start runs at this niceness until it answers (Proc.wait_ready), then at
# the default: a start-up (imports, compiles, several engines at once) yields the CPU to the
# engines that already serve, whose requests the other worker's tests time (a repeat's 2x bound
# failed once by 7 s while the other worker started five engines). Giving the default back
# needs root (CI, this host); elsewhere a process keeps START_NICE.
START_NICE = 5


def renice_tree(pid: int, value: int) -> int:
    """Every thread of pid and of its descendants to niceness `value` (Linux's nice is per
    thread: the threads an engine started while it was niced keep it otherwise); how many."""
    try:
        pids = [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return 0
    done = 0
    for p in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{p}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, value)
                done += 1
            except OSError:  # gone, or not ours to raise (not root)
                pass
    return done


def _in_child(core: int | None):
    def setup() -> None:
        _terminate_with_parent()
        os.nice(START_NICE)
        if core is not None:
            os.sched_setaffinity(0, {core})
    return setup


@dataclass
class Proc:
    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict = field(default_factory=dict)
    ready_path: str = "/v1/models"
    popen: subprocess.Popen | None = None
    attached_pid: int | None = None  # a process this one did not start (a session-wide engine): stop() leaves it
    memory_gib: float | None = None  # reserved in tests/memory.py while it runs; None: estimated from argv
    memory_owner: int | None = None  # whose reservation (None: this process)
    memory_keys: list = field(default_factory=list)
    outlive_parent: bool = False  # a session-wide engine: the session stops it, not its starter's exit
    host: str = "127.0.0.1"  # where it answers (its --host, when that is another address)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else self.attached_pid

    def memory_wanted(self) -> float:
        if self.memory_gib is not None:
            return self.memory_gib
        ranks = engine_ranks(self.argv)
        if not ranks:
            return 0.0
        kv = kv_cache_bytes(self.argv)
        if kv is not None:
            return memory.engine_gib(ranks, kv / 2**30)
        space = self.environment().get("VLLM_CPU_KVCACHE_SPACE")
        if space:
            return memory.engine_gib(ranks, float(space))
        # neither: an ascendserve role sizes its own (16 sequences of the model's length), plain vLLM
        # takes 0.92 of memory and refuses to start here
        return memory.engine_gib(ranks, memory.ROLE_KV_GIB)

    def reserve_memory(self) -> None:
        if not self.memory_keys and self.memory_wanted() > 0:
            self.memory_keys = memory.reserve_many([(self.memory_wanted(), self.name)], self.memory_owner)

    def release_memory(self) -> None:
        for key in self.memory_keys:
            memory.release(key)
        self.memory_keys = []

    def start(self) -> "Proc":
        if self.attached_pid is not None:
            raise RuntimeError(f"{self.name} is the session's (pid {self.attached_pid}): it is not started here")
        if self.popen is not None and self.popen.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self.popen.pid}): a second start would "
                               "leave the first process behind")
        self.reserve_memory()
        if str(self.env.get("VLLM_RPC_BASE_PATH") or "").startswith(PLAIN_IPC_PREFIX):
            remove_plain_ipc_dir(self.env["VLLM_RPC_BASE_PATH"])
            os.makedirs(self.env["VLLM_RPC_BASE_PATH"], mode=0o700)
        self._log = open(self.log_path, "ab")  # a restart appends
        core = None if self.outlive_parent else pinned_core()
        self.popen = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.environment(core),
            start_new_session=True,  # own process group: teardown can reach every child
            preexec_fn=None if self.outlive_parent else _in_child(core),
        )
        return self

    def environment(self, core: int | None = None) -> dict[str, str]:
        """The test environment with this process's own entries; an entry set to None is removed.
        `core`: the core its engines are pinned to (pinned_core), if any."""
        pin = {} if core is None else {"VLLM_CPU_OMP_THREADS_BIND": str(core)}  # vLLM binds its own threads
        env = {**os.environ, **ENGINE_ENV, **pin, **self.env}
        if kv_cache_bytes(self.argv) is not None and "VLLM_CPU_KVCACHE_SPACE" not in self.env:
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the argument (ENGINE_ARGS)
        return {k: v for k, v in env.items() if v is not None}

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> "Proc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log_text()[-4000:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    renice_tree(self.pid, 0)  # it serves: no longer behind anyone (START_NICE)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log_text()[-4000:]}")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def shared_memory(self) -> set[str]:
        """The /dev/shm segments the processes of this instance have mapped."""
        from ascendserve.launch.shm_ledger import mapped_by

        return mapped_by([self.pid, *(p.pid for p in self.descendants())])

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL of the whole process group after `timeout`; the memory it held
        is given back. A session-wide engine (attached) is left to the session."""
        if self.popen is None:
            self.release_memory()  # reserved by start_all for a start that never happened
            return
        try:
            self._stop(timeout)
        finally:
            self.release_memory()

    def _stop(self, timeout: float) -> None:
        # vllm-cpu 0.32's TP communicator (C++ shm manager) never unlinks its
        # vllm_dist_*-cpushm_* segments, even on a clean exit: sweep this instance's
        tp_shm = set() if self.popen.poll() is not None else tp_segments(self.shared_memory())
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        exited = self.popen.poll() is not None
        kill_group(self.popen.pid, grace_s=5.0 if exited else 0.0)
        self.popen.wait(5)
        self._log.close()
        unlink_segments(tp_shm)
        remove_plain_ipc_dir(self.env.get("VLLM_RPC_BASE_PATH"))


def tp_segments(names: set[str]) -> set[str]:
    """The vllm_dist_*-cpushm_* segments among names: vllm-cpu 0.32's TP communicator (a C++ shm
    manager) never unlinks them, even on a clean exit, so whoever stops an instance sweeps them."""
    return {n for n in names if n.startswith("vllm_dist_") and "-cpushm" in n}


def unlink_segments(names) -> None:
    for name in names:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except FileNotFoundError:
            pass


# What a user who passes no tuning flag gets: no engine arguments, and no KV size in the
# environment, and vLLM's own thread binding (which sets a worker's thread count itself;
# OMP_NUM_THREADS=1 stays for the other processes).
UNTUNED_ENV = {"VLLM_CPU_KVCACHE_SPACE": None, "ASCENDSERVE_SHM_NAP_MS": None, "VLLM_CPU_OMP_THREADS_BIND": None}


def ascendserve(role: str, model: Path, log_dir: Path, *extra: str, name: str | None = None, env: dict | None = None,
                tuned: bool = True) -> Proc:
    """An engine role; tuned=False starts it the way a user does, with no tuning flag at all."""
    port = free_port()
    argv = [PYTHON, "-m", "ascendserve", "--role", role, "--model", str(model), "--port", str(port),
            *(ENGINE_ARGS if tuned else ()), *extra]
    env = {**(env or {}), **({} if tuned else UNTUNED_ENV)}
    name = name or role
    return Proc(name, argv, port, log_dir / f"{name}.log", env or {})


def plain_vllm(model: Path, log_dir: Path, *extra: str, name: str = "vllm", env: dict | None = None,
               tuned: bool = True) -> Proc:
    """Plain vLLM; tuned=False: vLLM's defaults (dtype auto, compilation on), like an untuned
    ascendserve engine, and only the KV size (vLLM's own default cannot start here) and the idle
    readers' nap from ENGINE_ENV. On a CPU without bf16 instructions an untuned ascendserve engine
    runs float32 (engine.host_defaults.engine_dtype: bf16 may die with SIGILL there) while vLLM's
    auto still picks bf16, so the untuned oracle is given float32 there too: the same dtype, or
    the tokens would not compare (CI of 2026-12-04 on an AMD EPYC without avx512_bf16: the
    tarball's untuned 1P1D and the MoE untuned 1P1D differed from the oracle from token 0/9)."""
    port = free_port()
    same_dtype = () if tuned or host_defaults.cpu_has_bf16() else ("--dtype", "float32")
    argv = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), *(ENGINE_ARGS if tuned else ()), *same_dtype, *extra]
    # its ZMQ sockets in a directory of its own, removed at its stop (vLLM leaves those of the
    # workers it force-kills in /tmp; our engine roles do the same for themselves)
    return Proc(name, argv, port, log_dir / f"{name}.log", {"VLLM_RPC_BASE_PATH": str(plain_ipc_dir(port)),
                                                            **(env or {})})


PLAIN_IPC_PREFIX = "/tmp/asf-vllm-ipc-"


def plain_ipc_dir(port: int) -> Path:
    return Path(f"{PLAIN_IPC_PREFIX}{port}")


def remove_plain_ipc_dir(path: str | None) -> None:
    if path and path.startswith(PLAIN_IPC_PREFIX):
        shutil.rmtree(path, ignore_errors=True)


def stub(role: str, log_dir: Path, *extra: str, name: str | None = None) -> Proc:
    """A fake engine instance (tests/stub_backend.py) for fault and load tests of the proxy."""
    port = free_port()
    argv = [PYTHON, "-m", "tests.stub_backend", "--role", role, "--port", str(port), *extra]
    name = name or f"stub-{role}-{port}"
    return Proc(name, argv, port, log_dir / f"{name}.log", {"PYTHONPATH": str(REPO)})


def control(role: str, log_dir: Path, *extra: str, name: str | None = None, port: int | None = None) -> Proc:
    """A control-plane role (proxy, metaserver) of ascendserve."""
    port = port or free_port()
    argv = [PYTHON, "-m", "ascendserve", "--role", role, "--port", str(port), "--log-format", "json", *extra]
    name = name or f"{role}-{port}"
    ready = "/healthcheck" if role == "proxy" else "/health"
    return Proc(name, argv, port, log_dir / f"{name}.log", {}, ready)


def start_all(*procs: Proc) -> None:
    """Start several engines at once (they load in parallel), wait for all. Their memory is
    reserved for all of them together first (tests/memory.py), so that two workers never each
    hold half of what they need."""
    wanted = [p for p in procs if not p.memory_keys and p.memory_wanted() > 0]
    owners = {p.memory_owner for p in wanted}
    if len(wanted) > 1 and len(owners) == 1:
        keys = memory.reserve_many([(p.memory_wanted(), p.name) for p in wanted], owners.pop())
        for p, key in zip(wanted, keys):
            p.memory_keys = [key]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.wait_ready()
    except Exception:
        for p in procs:
            p.stop(timeout=5)
        raise


_KV_USAGE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\}\s+([0-9.eE+-]+)", re.MULTILINE)


def kv_usage(proc: Proc) -> float:
    """vLLM's KV-cache usage gauge of an engine instance (0.0 when idle)."""
    return float(_KV_USAGE.search(httpx.get(proc.url + "/metrics", timeout=10).text).group(1))


def signal_group(proc: Proc, sig) -> None:
    """Send sig to every process of an instance (SIGSTOP freezes it mid-transfer)."""
    os.killpg(proc.popen.pid, sig)


def crash(proc: Proc, segments: set[str] | None = None) -> None:
    """SIGKILL every process of an instance at once (multiprocessing's resource tracker
    excepted: it then unlinks the shared memory the dead left, as after a real crash),
    and check that none of the instance's segments is left behind. `segments`: the instance's,
    read beforehand (reading every process's maps under load took seconds once in CI, and the
    kill came after the requests it was meant to hit had ended)."""
    segments = segments or proc.shared_memory()
    assert segments, "an engine instance maps vLLM's shared-memory queues"
    kill_group(proc.popen.pid, grace_s=0.0, tracker_grace_s=10.0)
    wait_for(lambda: not segments & set(os.listdir("/dev/shm")), 15,
             f"shared memory left by a crashed instance: {sorted(segments & set(os.listdir('/dev/shm')))}")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} (after {timeout:.0f} s)")


def completion_ids(url: str, model: str, prompt: str, max_tokens: int = 16, timeout: float = 300, **extra) -> list[int]:
    """Greedy token ids of one completion; asserts a 200."""
    r = httpx.post(url + "/v1/completions", timeout=timeout, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
        **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@contextmanager
def pd_cluster(model: Path, log_dir: Path, p_args=(), d_args=(), proxy_args=(), p_env=None, d_env=None):
    """A prefill, a decode and a proxy in front of them; stopped on exit."""
    prefill = ascendserve("prefill", model, log_dir, *p_args, env=p_env)
    decode = ascendserve("decode", model, log_dir, *d_args, env=d_env)
    procs = [prefill, decode]
    try:
        start_all(prefill, decode)
        proxy = control("proxy", log_dir, "--prefill", f"127.0.0.1:{prefill.port}", "--decode",
                        f"127.0.0.1:{decode.port}", *proxy_args)
        procs.append(proxy)
        start_all(proxy)
        wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 60, "proxy never healthy")
        yield prefill, decode, proxy
    finally:
        for p in procs:
            p.stop()


def concurrent_ids(url: str, model: str, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
    """Greedy ids of all prompts sent at once (one completion each); asserts every 200."""
    import asyncio

    async def one(client, prompt):
        r = await client.post(url + "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    async def all_at_once():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    return asyncio.run(all_at_once())


class ShmWatch:
    """The /dev/shm segments a process tree maps while it runs, sampled every INTERVAL_S by a
    thread: a leak check scoped to what a test started (another worker's engines create and
    remove segments at the same time, so a before/after listing of /dev/shm is no check).
    `left()`: those of them still in /dev/shm. A segment that is created and dropped between
    two samples is not seen; one that leaks outlives its creator's last sample."""

    INTERVAL_S = 0.1

    def __init__(self, pid: int, prefixes: tuple[str, ...] = ()):
        import threading

        self.pid, self.prefixes = pid, prefixes
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"shm-watch-{pid}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        from ascendserve.launch.shm_ledger import mapped_by

        while True:
            try:
                tree = [self.pid, *(p.pid for p in psutil.Process(self.pid).children(recursive=True))]
            except psutil.Error:
                tree = []
            names = mapped_by(tree) if tree else set()
            self.seen |= {n for n in names if not self.prefixes or n.startswith(self.prefixes)}
            if self._stop.wait(self.INTERVAL_S):
                return

    def stop(self) -> set[str]:
        """Stop sampling; every segment seen."""
        self._stop.set()
        self._thread.join(5)
        return set(self.seen)

    def left(self) -> set[str]:
        return {n for n in self.seen if os.path.exists(os.path.join("/dev/shm", n))}
