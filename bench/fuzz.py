"""Fuzz every decoder of socket bytes for longer than CI does, and report inputs per target.

    python -m bench.fuzz [--seconds 60] [--keep-corpus] [TARGET ...]

Each target of tests/fuzz/targets.py runs under atheris (coverage-guided,
half of its mutations structure-aware) for `--seconds` in its own process,
one after another. The table gives the inputs run, inputs per second,
coverage reached, and the CI run's size beside it (tests/fuzz/test_decoders.py
runs CI_RUNS inputs per target). With `--keep-corpus` the inputs that
reached new code stay under bench/results/fuzz-corpus/<target>/ and the
next run starts from them. A finding prints its traceback and the saved
input (bench/results/fuzz-artifacts/); turn it into a case of
tests/fuzz/test_regressions.py once fixed. Exit status 1 if anything was found.
"""

from __future__ import annotations

import argparse
import sys

from bench._report import RESULTS, save, table
from tests.fuzz.fuzzing import CI_RUNS, fuzz
from tests.fuzz.targets import TARGETS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("targets", nargs="*", help=f"default: all ({', '.join(TARGETS)})")
    ap.add_argument("--seconds", type=int, default=60, help="fuzzing time per target")
    ap.add_argument("--keep-corpus", action="store_true", help="grow bench/results/fuzz-corpus/ across runs")
    args = ap.parse_args()
    names = args.targets or list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        ap.error(f"unknown targets {unknown}; have {', '.join(TARGETS)}")
    artifacts = RESULTS / "fuzz-artifacts"
    rows, results = [], []
    for name in names:
        corpus = RESULTS / "fuzz-corpus" / name if args.keep_corpus else None
        print(f"fuzzing {name} for {args.seconds} s ...", flush=True)
        r = fuzz(name, artifacts, seconds=args.seconds, corpus=corpus, timeout_s=args.seconds + 300)
        if not r.ok:
            print(r.finding(), flush=True)
        rows.append([name, r.runs, round(r.runs / max(r.seconds, 1e-9)), r.coverage, r.features,
                     CI_RUNS[name], "ok" if r.ok else f"FOUND {r.artifact}"])
        results.append({"target": name, "runs": r.runs, "seconds": r.seconds, "coverage": r.coverage,
                        "features": r.features, "ci_runs": CI_RUNS[name], "ok": r.ok, "artifact": r.artifact})
    table(f"Fuzzing, {args.seconds} s per target (atheris)",
          ["target", "inputs", "inputs/s", "cov edges", "features", "CI inputs", "result"], rows)
    save("fuzz", {"seconds_per_target": args.seconds, "targets": results})
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
