from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


MODEL_CACHE_ENV = "ASCENDSERVE_TEST_MODEL_CACHE"


def model_cache() -> Path:
    """Where the tiny models live between sessions (ASCENDSERVE_TEST_MODEL_CACHE, else
    ~/.cache/ascendserve-tests/models)."""
    value = os.environ.get(MODEL_CACHE_ENV)
    return Path(value) if value else Path.home() / ".cache" / "ascendserve-tests" / "models"


def _model_key(kind: str) -> str:
    """What the tiny model of `kind` is made from: its builder's source and torch's version
    (the seeded generator's stream). The same key is the same bytes."""
    import hashlib
    from importlib.metadata import version
    from importlib.util import find_spec

    digest = hashlib.sha256(Path(find_spec("ascendserve.models.tiny").origin).read_bytes())
    digest.update(f"{kind}\0{version('torch')}".encode())
    return digest.hexdigest()[:12]


def _made_once(out: Path, make) -> Path:
    """`out`, made by make(part) once for every session and worker on this host: under an flock
    next to it, into `<out>.part` (what an interrupted make left there is removed first), then
    renamed into place, so that a directory at `out` is always whole."""
    from tests.shared_engines import _flock

    out.parent.mkdir(parents=True, exist_ok=True)
    with _flock(out.with_name(out.name + ".lock")):
        if not (out / "config.json").exists():
            part = out.with_name(out.name + ".part")
            shutil.rmtree(part, ignore_errors=True)
            make(part)
            part.rename(out)
    return out


def _build(kind: str) -> Path:
    """The tiny model of `kind`, built once per key for every session and worker on this host
    (model_cache()). Its path is stable, and vLLM keys its compiled graphs by the model's path,
    so an untuned (compiling) engine on it loads the graph that an earlier session compiled
    instead of compiling for a minute again (~/.cache/vllm)."""
    return _made_once(model_cache() / f"tiny-{kind}-{_model_key(kind)}", lambda part: subprocess.run(
        [sys.executable, "-m", "ascendserve", "model", "tiny", "--kind", kind, "--out", str(part)],
        check=True, capture_output=True, timeout=300))


def host_copy(model: Path, name: str, ignore=None) -> Path:
    """A copy of a tiny model at a path that stays the same between sessions on this host
    (`<model cache>/copies/<model>/<name>`), made once. vLLM keys its compile cache by the
    model's path among the rest: an untuned engine on a copy under a fresh tmp_path compiled
    from scratch in every session (~1 CPU-minute), one here loads what an earlier start
    compiled, as a user's engine on their own model directory does. `ignore`: as for
    shutil.copytree (a weightless copy)."""
    return _made_once(model_cache() / "copies" / model.name / name,
                      lambda part: shutil.copytree(model, part, ignore=ignore))


@pytest.fixture(scope="session")
def text_model() -> Path:
    return _build("text")


@pytest.fixture(scope="session")
def vl_model() -> Path:
    return _build("vl")


@pytest.fixture(scope="session")
def mla_model() -> Path:
    return _build("mla")


@pytest.fixture(scope="session")
def text_oracle(text_model, tmp_path_factory):
    """One plain vLLM instance on the tiny text model: the correctness oracle every text
    topology is compared with, one for the whole session and all its workers
    (tests/shared_engines.py: each instance costs ~2 GiB and ~20 s)."""
    from tests.procs import plain_vllm
    from tests.shared_engines import shared

    return shared("text-oracle", lambda: plain_vllm(text_model,
                                                    tmp_path_factory.mktemp("oracle-logs")))


@pytest.fixture(scope="session")
def vl_oracle(vl_model, tmp_path_factory):
    """Plain vLLM on the tiny VL model: the oracle of every topology with an encoder (session-wide)."""
    from tests.procs import plain_vllm
    from tests.shared_engines import shared

    return shared("vl-oracle", lambda: plain_vllm(vl_model,
                                                  tmp_path_factory.mktemp("vl-oracle"), name="vllm-vl"))


@pytest.fixture(autouse=True)
def _memory_of_direct_starts(request):
    """A test that starts engines without tests.procs (subprocess.Popen of `all`, bench/'s
    clusters) says what they need, @pytest.mark.memory_gib(GiB), and holds that much of the
    memory budget while it runs (tests/memory.py)."""
    marker = request.node.get_closest_marker("memory_gib")
    if marker is None:
        yield
        return
    from tests import memory

    with memory.reserved(float(marker.args[0]), request.node.nodeid):
        yield


# --- Which tests start a real engine; --quick; wip --------------------------------------------
#
# `real_engine` marks every test that starts a real vLLM engine (an ascendserve engine role,
# plain vLLM, a cluster of them). It is applied here; test files need not mark anything:
#   - every module under tests/integration/ is real_engine unless NO_ENGINE_MODULES lists it
#     (so a new integration module lands in the full suite, never silently in the quick one);
#   - anywhere else, a test that uses an ENGINE_FIXTURES fixture, or whose module imports an
#     ENGINE_HELPERS name from tests.procs or anything from bench/ (its harnesses start clusters);
#   - a test marked real_engine explicitly.
# `--quick` (scripts/test.sh --quick) deselects them and the `slow` ones (SLOW_TESTS), and
# refuses to start an engine at all: a tests.procs.Proc that would run one raises, and a
# watchdog fails (and kills) any test under which a vLLM process (title VLLM::..., or
# vllm.entrypoints) appears in pytest's process tree.
#
# `wip` tests are deselected unless `--run-wip` or an -m expression that names wip (e.g.
# `-m wip`), whatever else -m selects.

import ast
import re
import threading
import time

import psutil

REPO = Path(__file__).resolve().parents[1]
# tests/integration modules verified to start no engine: stub engines (tests/stub_backend.py),
# control-plane roles, raw sockets, local memcached/Mooncake servers. Add a module here only
# when it starts no vLLM; the --quick guard fails it otherwise.
NO_ENGINE_MODULES = {
    "tests/integration/test_proxy_stubs.py",
    "tests/integration/test_kv_connector_flows.py",
    "tests/integration/test_security.py",
    "tests/integration/test_load.py",
    "tests/integration/test_netloader_wire.py",
    "tests/integration/test_doctor.py",
    "tests/integration/test_ec_store_backends.py",
    "tests/integration/test_install_pins.py",
    "tests/integration/test_dashboard.py",  # stub engines, a proxy, a metaserver and Chromium
    "tests/integration/test_status.py",
    "tests/integration/test_proxy_workers.py",  # stub engines behind 2 or 3 proxy workers
    "tests/integration/test_h1_client.py",  # raw asyncio servers
}
# Long runs without an engine, left to the full suite so --quick stays under 3 minutes: the
# atheris fuzz campaigns (test_regressions.py replays what they found, and stays quick), the
# 1,500-stream load acceptance, the vLLM patch checks that spawn torch.distributed ranks
# importing vLLM (7-10 s each on 2 cores) or fork two gloo ranks twice (~10 s), and
# `ascendserve doctor` (each run imports the engine stack to probe devices: ~6 s a test).
# Node id prefixes; marked `slow`.
SLOW_TESTS = (
    "tests/fuzz/test_decoders.py::test_fuzz_run_finds_nothing",
    "tests/integration/test_load.py::test_1500_concurrent_streams_through_one_proxy_worker",
    "tests/unit/test_vllm_patches.py::test_all_gatherv_and_reduce_scatterv_on_two_gloo_ranks",
    "tests/unit/test_vllm_patches.py::test_expert_parallel_ranks_sum_to_the_dense_moe",
    "tests/unit/test_vllm_patches.py::test_without_the_fix_expert_parallel_does_not_match",
    "tests/integration/test_doctor.py::",
    # resolves the CUDA and Ascend install pins against PyPI (~15 s): needs the network
    "tests/integration/test_install_pins.py::",
    "tests/unit/test_gloo_device.py::test_two_ranks_share_one_device_per_process",
    # Inductor compiles a C++ kernel: 10-30 s
    "tests/unit/test_compile_cache_patch.py::test_vllm_loads_a_function_stock_inductor_compiled_only_with_the_fix",
)
ENGINE_FIXTURES = {"text_oracle", "vl_oracle", "untuned_text_oracle"}
ENGINE_HELPERS = {"ascendserve", "plain_vllm", "pd_cluster"}  # tests/procs.py names that start vLLM
def pytest_addoption(parser):
    group = parser.getgroup("ascendserve")
    group.addoption("--quick", action="store_true",
                    help="the inner loop: deselect real_engine and slow tests, and refuse to start a vLLM engine")
    group.addoption("--run-wip", action="store_true", help="also run tests marked wip (deselected by default)")


_engine_module_cache: dict[Path, bool] = {}


def _module_starts_engines(path: Path) -> bool:
    """Whether a test module imports something that starts a real engine."""
    if path not in _engine_module_cache:
        try:
            tree = ast.parse(path.read_text())
        except (OSError, SyntaxError):
            tree = ast.Module(body=[], type_ignores=[])
        found = False
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "tests.procs" and {a.name for a in node.names} & ENGINE_HELPERS:
                    found = True
                elif node.module == "bench" or node.module.startswith("bench."):
                    found = True
            elif isinstance(node, ast.Import) and any(a.name == "bench" or a.name.startswith("bench.")
                                                      for a in node.names):
                found = True
            elif isinstance(node, ast.Attribute) and node.attr in ENGINE_HELPERS and \
                    isinstance(node.value, ast.Name) and node.value.id == "procs":
                found = True  # `from tests import procs; procs.plain_vllm(...)`
        _engine_module_cache[path] = found
    return _engine_module_cache[path]


def _starts_engine(item) -> bool:
    if item.get_closest_marker("real_engine"):
        return True
    path = Path(str(item.path)).resolve()
    try:
        rel = path.relative_to(REPO).as_posix()
    except ValueError:
        rel = path.as_posix()
    if rel.startswith("tests/integration/") and rel not in NO_ENGINE_MODULES:
        return True
    if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    return _module_starts_engines(path)


@pytest.hookimpl(tryfirst=True)  # before -m filters, so `-m real_engine` / `-m "not real_engine"` see the marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not item.get_closest_marker("real_engine") and _starts_engine(item):
            item.add_marker(pytest.mark.real_engine)
        if item.nodeid.startswith(SLOW_TESTS) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    markexpr = config.getoption("markexpr") or ""
    run_wip = config.getoption("run_wip") or re.search(r"\bwip\b", markexpr)
    quick = config.getoption("quick")
    keep, drop = [], []
    for item in items:
        wip = not run_wip and item.get_closest_marker("wip")
        heavy = quick and (item.get_closest_marker("real_engine") or item.get_closest_marker("slow"))
        if wip or heavy:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    _heaviest_first(items)


# --- Two workers (pytest-xdist, scripts/test.sh) ---------------------------------------------
#
# scripts/test.sh runs `-n 2 --dist loadscope --no-loadscope-reorder` (ASCENDSERVE_TEST_WORKERS
# changes the number, README): a worker takes a whole
# module at a time (xdist's scope of a test function), so a module's fixtures start once, on
# one worker. (`--dist loadgroup` would group across modules, but xdist 3.8 cannot set its group
# suffix on pytest 9.2's node ids: every test would go out alone.) Modules go out in collection
# order, which is sorted here heaviest first (MODULE_SECONDS, measured with --durations on this
# 2-core host; a module not listed counts as light), so that the last one to start is short.
# What the workers share (the models, the oracles: tests/shared_engines.py), their ports
# (tests/ports.py) and the memory budget that keeps their engines within the host's memory
# (tests/memory.py) are set up by the controlling process.
MODULE_SECONDS = {  # the module's test seconds on one of two workers, fixtures included (CI run of 2026-12-02)
    "tests/integration/test_tarball.py": 738,  # 318 prebuilt (CI); first anyway: a local run builds it
    "tests/integration/test_epd.py": 549,
    "tests/integration/test_netloader.py": 485,  # + 65 s: the etcd joiner, measured alone 2026-12-05
    "tests/integration/test_kv_mla.py": 396,  # 140 s of it waited for the memory budget
    "tests/integration/test_moe.py": 375,  # 80 s of it waited for the memory budget
    "tests/integration/test_kv_pull.py": 260,
    "tests/integration/test_defaults.py": 242,
    "tests/integration/test_chaos.py": 228,
    "tests/integration/test_kv_failures.py": 184,
    "tests/integration/test_startup_stop.py": 169,
    "tests/integration/test_kv_push.py": 167,
    "tests/integration/test_kv_nixl.py": 230,  # measured alone, 2026-12-04
    "tests/integration/test_migration_kill.py": 260,  # measured alone, 2026-12-04
    "tests/integration/test_migration_splice.py": 65,  # measured alone, 2026-12-04 (oracle up)
    "tests/integration/test_kv_routing.py": 160,  # measured alone, 2026-12-05 (both oracles up)
    "tests/integration/test_topologies.py": 123,
    "tests/integration/test_all_role.py": 140,  # + 35 s: all on etcd, measured alone 2026-12-05
    "tests/integration/test_launch.py": 59,
    "tests/integration/test_kv_hetero_tp.py": 42,
    "tests/integration/test_proxy_stubs.py": 35,
    "tests/integration/test_etcd_registry.py": 25,  # measured alone, 2026-12-05
    "tests/integration/test_pd_role.py": 34,
    "tests/fuzz/test_decoders.py": 31,
    "tests/integration/test_load.py": 40,  # + 10 s: 1,500 streams with a dashboard page open (2026-12-05)
    "tests/unit/test_vllm_patches.py": 22,
    "tests/integration/test_security.py": 18,
    "tests/integration/test_dashboard.py": 38,  # measured alone, 2026-12-05
}


def _heaviest_first(items) -> None:
    def weight(item) -> float:
        return MODULE_SECONDS.get(item.nodeid.split("::", 1)[0], 0.0)

    items.sort(key=lambda item: -weight(item))  # stable: a module keeps its own order


def _is_vllm_process(p: psutil.Process) -> str | None:
    """The command line of p when p is a vLLM engine, API server or worker process, else None."""
    try:
        cmd = p.cmdline()
    except (psutil.Error, OSError):
        return None
    line = " ".join(cmd).strip()  # setproctitle pads the title with spaces
    if line.startswith("VLLM::") or "vllm.entrypoints" in line or (len(cmd) > 1 and cmd[1:2] == ["serve"]
                                                                      and cmd[0].endswith("vllm")):
        return line
    return None


class _EngineWatchdog:
    """Under --quick: notices any vLLM process among pytest's descendants, kills its tree, and
    fails the test it appeared under (checked again at the end of each setup/call/teardown)."""

    INTERVAL_S = 0.5

    def __init__(self):
        self.me = psutil.Process()
        self.found: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="quick-engine-watchdog", daemon=True)

    def _loop(self):
        while not self.stop.wait(self.INTERVAL_S):
            self.scan()

    def scan(self):
        try:
            children = self.me.children(recursive=True)
        except psutil.Error:
            return
        for p in children:
            line = _is_vllm_process(p)
            if line is None:
                continue
            with self.lock:
                self.found.append(f"pid {p.pid}: {line[:300]}")
            self._kill_tree(p)

    def _kill_tree(self, p: psutil.Process):
        # the whole subtree under pytest's child that is p's ancestor (or p itself)
        top = p
        try:
            for parent in p.parents():
                if parent.pid == self.me.pid:
                    break
                top = parent
            victims = [top, *top.children(recursive=True)]
        except psutil.Error:
            victims = [p]
        for v in victims:
            try:
                v.kill()
            except psutil.Error:
                pass

    def take(self) -> list[str]:
        self.scan()
        with self.lock:
            found, self.found = self.found, []
        return found


_watchdog: _EngineWatchdog | None = None


def _refuse_engine(what: str):
    pytest.fail(f"--quick started a real vLLM engine ({what}). A test that starts one belongs to the full suite: "
                "it is marked real_engine automatically when it uses text_oracle, imports plain_vllm/pd_cluster/"
                "ascendserve from tests.procs or bench.*, or lives in tests/integration/ outside NO_ENGINE_MODULES "
                "(tests/conftest.py); else mark it @pytest.mark.real_engine.", pytrace=False)


def _guard_proc_start():
    """tests.procs.Proc.start refuses engine command lines under --quick."""
    from tests import procs

    original = procs.Proc.start

    def start(self, *args, **kwargs):
        if procs.engine_ranks(self.argv):  # the same test that sizes an engine's memory
            _refuse_engine(f"{self.name}: {' '.join(str(a) for a in self.argv)[:300]}")
        return original(self, *args, **kwargs)

    procs.Proc.start = start


def _controller(config) -> bool:
    """The process that runs the session: pytest itself, or xdist's controller (not a worker)."""
    return not hasattr(config, "workerinput")


def pytest_configure(config):
    global _watchdog
    from tests import shared_tls

    shared_tls.install()  # httpx.get/post in any test: one TLS context per process, not 55 ms of CPU each call
    if _controller(config):
        from tests.shared_engines import begin_session

        begin_session()  # before xdist starts the workers: they inherit its environment
    if config.getoption("quick", False) and _watchdog is None:
        os.environ["ASCENDSERVE_TESTS_QUICK"] = "1"
        _guard_proc_start()
        _watchdog = _EngineWatchdog()
        _watchdog.thread.start()


_SESSION_STARTED = time.time()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's wall-clock span, setup to teardown, for the session's timeline (tests/timeline.py)."""
    from tests.timeline import note

    started = time.time()
    try:
        return (yield)
    finally:
        worker = getattr(item.config, "workerinput", {}).get("workerid", "main")
        note(item.nodeid, worker, started, time.time())


def pytest_sessionfinish(session, exitstatus):
    """Stop the session-wide engines (once every worker is done) and check they left nothing."""
    if not _controller(session.config):
        return
    from tests.memory import waits_summary
    from tests.shared_engines import end_session

    from tests.timeline import summary

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter else print
    if reporter:
        reporter.ensure_newline()
    waits = waits_summary()  # before end_session removes the directory it is kept in
    if waits:
        write(f"tests.memory: {waits}")
    timeline = summary(_SESSION_STARTED)
    if len(timeline) > 1:
        write("tests.timeline: modules by start (seconds after the session started)")
        for line in timeline:
            write("  " + line)
    problems = end_session()
    if problems:
        for line in problems:
            (reporter.write_line if reporter else print)(f"session-wide engine left something: {line}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config):
    if _watchdog is not None:
        _watchdog.stop.set()


def _check_engines(phase: str):
    if _watchdog is not None:
        found = _watchdog.take()
        if found:
            _refuse_engine(f"seen during {phase}, killed: " + "; ".join(found))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    try:
        return (yield)
    finally:
        _check_engines("setup")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    finally:
        _check_engines("call")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        _check_engines("teardown")
