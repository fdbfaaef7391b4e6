"""The release tarball: unpacked anywhere, it runs with nothing of this machine's Python.

The session fixture tests $ASCENDSERVE_RELEASE_TARBALL when set, else dist/'s
tarball when it was built from this very commit with a clean tree (CI may
build it first), else runs ./build.sh into a temp dir (~6 min on 2 cores cold,
under a minute when its bundle cache matches). Every run has a clean environment
(env -i style): no virtualenv on PATH, no PYTHONPATH, a fresh HOME, another cwd.
The 1P1D test runs the bundle as a user would: their own model, vLLM's default
mode (torch.compile on), no tuning flags, and compares its greedy tokens with
plain vLLM's from the build's environment.
"""

from __future__ import annotations

import atexit
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from ascendserve import __version__
from ascendserve.launch.children import kill_group
from tests.procs import REPO, all_role_port, completion_ids, wait_for

pytestmark = pytest.mark.integration
BUILD_TIMEOUT_S = 1800


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()


def _unpack(tarball: Path, into: Path) -> Path:
    into.mkdir()
    subprocess.run(["tar", "-xzf", str(tarball), "-C", str(into)], check=True)
    (tree,) = into.iterdir()
    return tree


def _built_here(tree: Path) -> bool:
    info = dict(line.split("=", 1) for line in (tree / "BUILD_INFO").read_text().splitlines())
    return info["commit"] == _git("rev-parse", "HEAD") and info["dirty"] == "no" and not _git("status", "--porcelain")


@pytest.fixture(scope="session")
def release(tmp_path_factory) -> Path:
    """The unpacked release tree."""
    given = os.environ.get("ASCENDSERVE_RELEASE_TARBALL")
    if given:
        return _unpack(Path(given), tmp_path_factory.mktemp("given-release") / "unpacked")
    pattern = f"ascendserve-{__version__}-*-{platform.machine()}.tar.gz"
    for tarball in sorted((REPO / "dist").glob(pattern)):
        tree = _unpack(tarball, tmp_path_factory.mktemp("dist-release") / "unpacked")
        if _built_here(tree):
            return tree
    out = tmp_path_factory.mktemp("build")
    # native/ is built whenever the checkout has it; a failed native build fails this test
    flags = [] if (REPO / "native" / "build.sh").is_file() else ["--allow-no-native"]
    subprocess.run([str(REPO / "build.sh"), "--out", str(out), *flags], check=True, timeout=BUILD_TIMEOUT_S)
    (tarball,) = out.glob(pattern)
    return _unpack(tarball, tmp_path_factory.mktemp("release") / "unpacked")


def _clean_env(base: Path) -> dict:
    """A user's environment: no venv, no tuning (OMP_NUM_THREADS=1: the test machine's rule
    for every engine), HOME, TMPDIR and a working directory of its own under base: compile caches
    (vLLM's and, inside it, inductor's under HOME) start empty, as on a new host."""
    for d in ("home", "cwd", "tmp"):
        (base / d).mkdir(exist_ok=True)
    # TMPDIR by a short path: vLLM puts its ZMQ ipc sockets there, and a Unix socket path has at
    # most 107 bytes (pytest-xdist's popen-gwN/ directories took base past that)
    tmp = Path(tempfile.mkdtemp(prefix="asf-tmp-"))
    atexit.register(shutil.rmtree, tmp, True)
    (base / "tmp").rmdir()
    (base / "tmp").symlink_to(tmp)
    return {"PATH": "/usr/bin:/bin", "HOME": str(base / "home"), "TMPDIR": str(tmp), "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1"}


@pytest.fixture
def clean_env(tmp_path):
    env = _clean_env(tmp_path)
    yield env
    # not left to atexit alone: an xdist worker's exit skipped it, and each test's TMPDIR
    # kept its compile caches and vLLM's sockets (150 MB) in /tmp
    shutil.rmtree(env["TMPDIR"], ignore_errors=True)


def _run(release: Path, env: dict, cwd: Path, *args: str, timeout: float = 60) -> tuple[str, float]:
    start = time.monotonic()
    done = subprocess.run([str(release / "bin" / "ascendserve"), *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout, time.monotonic() - start


def test_checksums_verify(release):
    done = subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=release, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (release / "conf" / "all.toml").is_file() and (release / "README.md").is_file()


def test_version_and_help_start_fast(release, clean_env, tmp_path):
    out, version_s = _run(release, clean_env, tmp_path / "cwd", "version")
    assert out.strip() == f"ascendserve {__version__}"
    out, help_s = _run(release, clean_env, tmp_path / "cwd", "--role", "proxy", "--help")
    assert "--port" in out
    assert version_s < 5 and help_s < 5, (version_s, help_s)  # neither imports torch or vLLM


def test_bundle_loads_our_plugins(release, clean_env, tmp_path):
    """vLLM finds our plugin, torch our torchvision hook, through ascendserve's dist-info:
    without it both are silently skipped. Also exercises the entry's `-c`."""
    code = ("from importlib.metadata import entry_points; "
            "print([p.value for p in entry_points(group='torch.backends')]); "
            "from vllm.plugins import load_plugins_by_group; "
            "register = load_plugins_by_group('vllm.general_plugins')['ascendserve']; register(); "
            "print(register.__module__)")
    out, _ = _run(release, clean_env, tmp_path / "cwd", "-c", code, timeout=120)
    assert "ascendserve.engine.torchvision_compat:autoload" in out
    assert "ascendserve.engine.plugin" in out


def test_bundle_loads_the_native_libraries(release, clean_env, tmp_path):
    """The tarball ships ascendserve/_native/ (build.sh copies our packages from the checkout)
    and each library is found from the bundle's own copy of the package: the block-copy ops
    (ops.py) and the KV side channel's I/O (transport/native.py)."""
    code = ("from ascendserve import ops; from ascendserve.connectors.transport import native; "
            "print('ops', ops.load_native(), ops.LIBRARY); print('xfer', native.enabled(), native.LIBRARY, "
            "native.why_not())")
    out, _ = _run(release, clean_env, tmp_path / "cwd", "-c", code, timeout=120)
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("ops ", "xfer ")))
    for name in ("ops", "xfer"):
        loaded, path = lines[name].split()[:2]
        assert loaded == "True" and Path(path).resolve().is_relative_to((release / "bin").resolve()), out


def test_bundle_checks_netloader_weights_with_the_c_crc32c(release, clean_env, tmp_path):
    """NetLoader's CRC32C in the bundle: google-crc32c's C extension and the library beside it
    (google_crc32c.libs/) collected, not its pure-Python fallback, which NetLoader refuses."""
    code = ("import google_crc32c; from ascendserve.netloader import wire; wire.require_checksum(); "
            "print(google_crc32c.implementation, wire.crc32c(memoryview(b'123456789')))")
    out, _ = _run(release, clean_env, tmp_path / "cwd", "-c", code)
    assert out.split() == ["c", str(0xE3069283)]  # the CRC32C check value (RFC 3720)


def _group_alive(pgid: int) -> list[psutil.Process]:
    alive = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


@pytest.mark.memory_gib(2.0)  # tests/memory.py: the bundle's `all` starts its engine itself
def test_all_mono_serves_from_the_bundle_and_stops_clean(release, clean_env, tmp_path):
    port = all_role_port()
    url = f"http://127.0.0.1:{port}"
    run_dir = tmp_path / "run"
    log = open(tmp_path / "all.log", "w")
    start = time.monotonic()
    proc = subprocess.Popen([str(release / "bin" / "ascendserve"), "--role", "all", "--topology", "mono",
                             "--port", str(port), "--runtime-dir", str(run_dir), "--log-format", "json"],
                            env=clean_env, cwd=tmp_path / "cwd", stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, (tmp_path / "all.log").read_text()[-4000:]
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 400, "the bundle's cluster never became healthy")
        ready_s = time.monotonic() - start
        body = {"model": str(run_dir / "demo-model-text"), "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["choices"][0]["text"]
        # the dashboard's page, script and style ship in the tarball (package data, no CDN)
        for path, needle in (("/dashboard", "dashboard.js"), ("/dashboard/static/dashboard.js", "EventSource"),
                             ("/dashboard/static/dashboard.css", "--active")):
            r = httpx.get(url + path, timeout=10)
            assert r.status_code == 200 and needle in r.text, (path, r.status_code, r.text[:200])

        everything = psutil.Process(proc.pid).children(recursive=True)
        assert len(everything) >= 4  # metaserver, engine (+ vLLM's engine core), proxy
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in everything), 30,
                 "children outlived --role all")
        wait_for(lambda: not _group_alive(proc.pid), 30, "processes left in the process group")
        print(f"bundle: --role all mono healthy after {ready_s:.1f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_group(proc.pid)
        log.close()


# --- as a user runs it: 1P1D, their model, compilation on, no tuning flags -----------------

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]
CHAT = [{"role": "user", "content": "Say hello in three words."}]


def _answers(url: str, model: str) -> dict:
    """Greedy token ids of each prompt, the first one again (a prefix-cache hit), and a chat reply;
    12 tokens each (ignore_eos: in float32, on a host without bf16, the tiny model may end early)."""
    out = {prompt: completion_ids(url, model, prompt, max_tokens=12, ignore_eos=True) for prompt in PROMPTS}
    out["again: " + PROMPTS[0]] = completion_ids(url, model, PROMPTS[0], max_tokens=12, ignore_eos=True)
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": model, "messages": CHAT, "max_tokens": 12, "temperature": 0, "return_token_ids": True,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    out["chat"] = choice.get("token_ids") or choice["message"]["content"]
    return out


@pytest.fixture(scope="module")
def user_model(release, text_model, tmp_path_factory) -> Path:
    """A tiny model of the user's own (not the demo's), written by the bundle's `model tiny`:
    byte for byte the suite's text model, which the environment the bundle was frozen from
    built with the same command (so the session's plain vLLM on that model is the reference)."""
    base = tmp_path_factory.mktemp("user-model")
    out = base / "models" / "tiny-qwen"
    env = _clean_env(base)
    try:
        _run(release, env, base / "cwd", "model", "tiny", "--kind", "text", "--out", str(out), timeout=180)
    finally:
        shutil.rmtree(env["TMPDIR"], ignore_errors=True)
    assert (out / "config.json").is_file()
    ours, suite = (sorted(p.name for p in d.glob("*.safetensors")) for d in (out, text_model))
    assert ours == suite and ours
    for name in ours:
        assert (out / name).read_bytes() == (text_model / name).read_bytes(), f"the bundle's {name} differs"
    return out


@pytest.mark.memory_gib(4.0)  # the bundle's P and D (the reference is the session's, reserved apart)
def test_1p1d_compiled_serves_like_plain_vllm(release, user_model, text_model, untuned_text_oracle, clean_env,
                                              tmp_path):
    env = clean_env
    cwd = tmp_path / "cwd"
    model = str(user_model)
    # the reference: plain vLLM from the environment the bundle was frozen from, default mode too,
    # on the same weights (user_model): the session's (tests/integration/conftest.py)
    ref = untuned_text_oracle
    port = all_role_port()
    url = f"http://127.0.0.1:{port}"
    run_dir = tmp_path / "run"
    log_path = tmp_path / "all.log"
    log = open(log_path, "w")
    start = time.monotonic()
    proc = subprocess.Popen([str(release / "bin" / "ascendserve"), "--role", "all", "--topology", "1P1D",
                             "--model", model, "--port", str(port), "--runtime-dir", str(run_dir)],
                            env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log_path.read_text()[-6000:]
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 600, "the bundle's 1P1D cluster never became healthy")
        ready_s = time.monotonic() - start
        ours = _answers(url, model)
        expected = _answers(ref.url, str(text_model))
        assert ours == expected
        assert all(len(ids) == 12 for key, ids in ours.items() if key != "chat" and isinstance(ids, list))
        text = log_path.read_text()
        assert "No such file or directory" not in text, text[-6000:]
        # compilation was on: vLLM saved the compiled model, and inductor's C++ kernels, built here
        # with the host's g++ and the bundle's headers, in its cache under the fresh HOME
        compiled = tmp_path / "home" / ".cache" / "vllm" / "torch_compile_cache"
        assert list(compiled.glob("**/inductor_cache/**/*.so")), sorted(map(str, compiled.rglob("*")))[:40]
        # P and D found the cache empty together: one compiled and saved, the other waited for
        # it and loaded (engine/patches/compile_cache.py's lock), instead of both compiling
        assert text.count("saved AOT compiled function") == 1, text[-6000:]
        assert text.count("Directly load AOT compilation") == 1, text[-6000:]
        assert "Compiling model again" not in text
        assert list(cwd.iterdir()) == []  # nothing resolved against, or written into, the working directory
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        print(f"bundle: --role all 1P1D (compiled) healthy after {ready_s:.1f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_group(proc.pid)
        log.close()
