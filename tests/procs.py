"""Start real ascendserve / vLLM processes on 127.0.0.1 and stop them cleanly."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from ascendserve.launch.children import kill_group

PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 240.0

# Deterministic, quiet CPU settings for every engine the tests start.
ENGINE_ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# The same engine settings for ours and for plain vLLM, so outputs compare.
ENGINE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "4096"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(count: int, offsets: tuple[int, ...] = ()) -> int:
    """A port p with p .. p+count-1 (and p+o for each o in offsets) free on 127.0.0.1."""
    for _ in range(100):
        port = free_port()
        wanted = [port + i for i in range(1, count)] + [port + o for o in offsets]
        if max(wanted, default=port) > 65535:
            continue
        try:
            for p in wanted:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no run of {count} free ports")


def all_role_port() -> int:
    """A base port for `--role all`: it binds the port, + 1 (metaserver), + 10.. (engines) and
    their KV side channels (+ 1000), so a free base port alone is not enough."""
    return free_port_run(2, offsets=(10, 11, 12, 1010, 1011, 1012))


@dataclass
class Proc:
    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict = field(default_factory=dict)
    ready_path: str = "/v1/models"
    popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Proc":
        if self.popen is not None and self.popen.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self.popen.pid}): a second start would "
                               "leave the first process behind")
        self._log = open(self.log_path, "ab")  # a restart appends
        self.popen = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,  # own process group: teardown can reach every child
        )
        return self

    def environment(self) -> dict[str, str]:
        """The test environment with this process's own entries; an entry set to None is removed."""
        env = {**os.environ, **ENGINE_ENV, **self.env}
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
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log_text()[-4000:]}")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.popen.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def shared_memory(self) -> set[str]:
        """The /dev/shm segments the processes of this instance have mapped."""
        from ascendserve.launch.shm_ledger import mapped_by

        return mapped_by([self.popen.pid, *(p.pid for p in self.descendants())])

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL of the whole process group after `timeout`."""
        if self.popen is None:
            return
        # vllm-cpu 0.32's TP communicator (C++ shm manager) never unlinks its
        # vllm_dist_*-cpushm_* segments, even on a clean exit: sweep this instance's
        tp_shm = set() if self.popen.poll() is not None else \
            {n for n in self.shared_memory() if n.startswith("vllm_dist_") and "-cpushm" in n}
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
        for name in tp_shm:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass


# What a user who passes no tuning flag gets: no engine arguments, and no KV size in the
# environment (OMP_NUM_THREADS=1 stays: with 2 threads on 2 cores latency is bimodal).
UNTUNED_ENV = {"VLLM_CPU_KVCACHE_SPACE": None}


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
    ascendserve engine, and only the KV size from ENGINE_ENV (vLLM's own default cannot start here)."""
    port = free_port()
    argv = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), *(ENGINE_ARGS if tuned else ()), *extra]
    return Proc(name, argv, port, log_dir / f"{name}.log", env or {})


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
    """Start several engines at once (they load in parallel), wait for all."""
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
