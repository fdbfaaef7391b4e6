"""Start-up to ready for each role, next to plain vLLM on the same model.

    python -m bench.startup [--repeat N] [--bundle DIR] [--only SUBSTR ...]

--bundle DIR also times every ascendserve case from an unpacked release
tree (DIR/bin/ascendserve, ./build.sh's output) next to the venv.

Ready = /v1/models answers 200. Besides the roles as they start by default:
"worker spawned" is the same pd with ASCENDSERVE_WORKER_START=spawn (before
engine/patches/worker_fork.py; "TP=2, ranks spawned" the same for a two-rank pd), "engine core and worker spawned" adds
ASCENDSERVE_ENGINE_CORE_START=spawn (vLLM's CPU start, before core_fork.py); the untuned pd (no
--enforce-eager: vLLM compiles) starts twice on a compile cache of its own,
empty at the first start (vLLM 0.32 under torch 2.13 cannot load what it
saved: the second start compiles again, README "Engine defaults on a CPU
host"); the floor is one process importing vLLM's engine core, which every
start pays at least once.
Control-plane commands (`--role proxy
--help`, `version`) are timed as whole processes: they must never import
torch or vLLM, so they stay well under a second.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._report import save, table
from tests.procs import ascendserve, control, plain_vllm


def build_models(root: Path) -> dict[str, Path]:
    out = {}
    for kind in ("text", "vl"):
        out[kind] = root / kind
        subprocess.run([sys.executable, "-m", "ascendserve", "model", "tiny", "--kind", kind, "--out", str(out[kind])],
                       check=True, capture_output=True)
    return out


def time_ready(make) -> float:
    proc = make()
    start = time.monotonic()
    proc.start()
    try:
        proc.wait_ready()
        return time.monotonic() - start
    finally:
        proc.stop()


def _frozen(proc, exe: str):
    """The same process from the release bundle: bin/ascendserve instead of python -m ascendserve."""
    assert proc.argv[1:3] == ["-m", "ascendserve"], proc.argv
    proc.argv = [exe, *proc.argv[3:]]
    proc.name += "-bundle"
    proc.log_path = proc.log_path.with_name(proc.name + ".log")
    return proc


def _elastic(model: Path, logs: Path):
    proc = control("elastic-server", logs, "--model", str(model), "--cluster-token", "bench")
    proc.ready_path = "/health"
    return proc


def time_command(argv: list[str], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.monotonic()
        subprocess.run(argv, check=False, capture_output=True)
        samples.append(time.monotonic() - start)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1, help="engine starts per role")
    ap.add_argument("--bundle", type=Path, help="an unpacked release tree: time its bin/ascendserve too")
    ap.add_argument("--only", nargs="+", help="cases whose name contains one of these")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = build_models(root)
        logs = root / "logs"
        logs.mkdir()
        cache, fresh = root / "vllm-cache", itertools.count()

        def compile_cache() -> str:
            """Empty at every start of the compiling case; its first start fills `cache`."""
            n = next(fresh)
            return str(cache if n == 0 else root / f"vllm-cache-{n}")
        cases = {
            "plain vLLM (text, peer)": lambda: plain_vllm(models["text"], logs),
            "pd (text)": lambda: ascendserve("pd", models["text"], logs),
            "pd (text), worker spawned": lambda: ascendserve(
                "pd", models["text"], logs, name="pd-spawn-worker", env={"ASCENDSERVE_WORKER_START": "spawn"}),
            "pd (text), engine core and worker spawned": lambda: ascendserve(
                "pd", models["text"], logs, name="pd-spawn", env={"ASCENDSERVE_ENGINE_CORE_START": "spawn",
                                                                  "ASCENDSERVE_WORKER_START": "spawn"}),
            "pd (text, untuned), compiling": lambda: ascendserve(
                "pd", models["text"], logs, name="pd-untuned", tuned=False, env={"VLLM_CACHE_ROOT": compile_cache()}),
            "pd (text, untuned), its graph saved": lambda: ascendserve(
                "pd", models["text"], logs, name="pd-untuned-again", tuned=False, env={"VLLM_CACHE_ROOT": str(cache)}),
            "pd (text, TP=2)": lambda: ascendserve("pd", models["text"], logs, "--tensor-parallel-size", "2",
                                                   name="pd-tp2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
            "pd (text, TP=2), ranks spawned": lambda: ascendserve(
                "pd", models["text"], logs, "--tensor-parallel-size", "2", name="pd-tp2-spawn",
                env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "ASCENDSERVE_WORKER_START": "spawn"}),
            "prefill (text)": lambda: ascendserve("prefill", models["text"], logs, "--kv-path", str(root / "kv")),
            "decode (text)": lambda: ascendserve("decode", models["text"], logs, "--kv-path", str(root / "kv")),
            "plain vLLM (vl, peer)": lambda: plain_vllm(models["vl"], logs, name="vllm-vl"),
            "encoder (vl)": lambda: ascendserve("encoder", models["vl"], logs, "--ec-path", str(root / "ec")),
            "pd (vl, EC consumer)": lambda: ascendserve("pd", models["vl"], logs, "--ec-path", str(root / "ec"), "--ec-enabled"),
            "proxy": lambda: control("proxy", logs),
            "metaserver": lambda: control("metaserver", logs),
            "elastic-server (text)": lambda: _elastic(models["text"], logs),
        }
        if args.bundle:
            exe = str(args.bundle / "bin" / "ascendserve")
            for name, make in list(cases.items()):
                if "plain vLLM" not in name:
                    cases[f"{name} [bundle]"] = lambda make=make: _frozen(make(), exe)
        if args.only:
            cases = {n: m for n, m in cases.items() if "plain vLLM" in n or any(o in n for o in args.only)}
        engine = {name: statistics.median(time_ready(make) for _ in range(args.repeat)) for name, make in cases.items()}
        engine["import vLLM's engine core (floor)"] = time_command(
            [sys.executable, "-c", "import vllm.v1.engine.core"], args.repeat)
    cli = {
        "ascendserve --role proxy --help": time_command([sys.executable, "-m", "ascendserve", "--role", "proxy", "--help"], 5),
        "ascendserve version": time_command([sys.executable, "-m", "ascendserve", "version"], 5),
        "python -c pass (floor)": time_command([sys.executable, "-c", "pass"], 5),
    }
    peer = {"text": engine["plain vLLM (text, peer)"], "vl": engine["plain vLLM (vl, peer)"]}
    rows = [[name, secs, secs / peer["vl" if "vl" in name else "text"]] for name, secs in engine.items()]
    if args.bundle:
        exe = str(args.bundle / "bin" / "ascendserve")
        cli["bin/ascendserve --role proxy --help [bundle]"] = time_command([exe, "--role", "proxy", "--help"], 5)
        cli["bin/ascendserve version [bundle]"] = time_command([exe, "version"], 5)
    table("start-up to ready (s), ratio to plain vLLM on the same model", ["role", "seconds", "x plain vLLM"], rows)
    floor = cli["python -c pass (floor)"]
    table("control-plane commands (s)", ["command", "seconds", "x interpreter floor"],
          [[name, secs, secs / floor] for name, secs in cli.items()])
    save("startup", {"engine_ready_s": engine, "cli_s": cli})


if __name__ == "__main__":
    main()
