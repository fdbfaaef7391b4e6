"""Run one fuzz target under atheris (libFuzzer, coverage-guided) in this process.

    python -m tests.fuzz.run TARGET [--runs N] [--seconds S] [--artifacts DIR] [--corpus DIR]

atheris ends the process itself (sys.exit), so callers start this as a
subprocess (tests/fuzz/fuzzing.py does). The seed corpus is the target's valid
conversations; `--corpus` keeps what the fuzzer learns between runs. A
finding is an exception the target's contract does not allow, a hang past
`--input-timeout` seconds or a process over `--rss-mb`: libFuzzer prints the
traceback and writes the input to `<artifacts>/crash-<sha1>` (or timeout-,
oom-), exits non-zero, and the last line of output says so.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import atheris
import structlog


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--runs", type=int, default=-1, help="inputs to run (-1: until --seconds)")
    ap.add_argument("--seconds", type=int, default=0, help="stop after this long (0: no limit)")
    ap.add_argument("--artifacts", default=".", help="where a crashing input is written")
    ap.add_argument("--corpus", default="", help="corpus directory to grow (default: a temporary one)")
    ap.add_argument("--input-timeout", type=int, default=20, help="seconds one input may take")
    ap.add_argument("--rss-mb", type=int, default=1024, help="memory this process may use")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    # one warning per refused connection would drown the fuzzer's output and slow it down
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    with atheris.instrument_imports(include=["ascendserve"]):
        from tests.fuzz.mutate import structured
        from tests.fuzz.targets import target as find_target

        target = find_target(args.target)
        one = target.setup()
    # libFuzzer ends the process with exit(): no atexit clean-up runs, so temporary files
    # go under $TMPDIR, which tests/fuzz/fuzzing.py points at a directory it removes
    corpus = Path(args.corpus or tempfile.mkdtemp(prefix=f"asf-fuzz-{target.name}-"))
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(target.seeds()):
        (corpus / f"seed-{i}").write_bytes(seed)
    Path(args.artifacts).mkdir(parents=True, exist_ok=True)
    argv = [sys.argv[0], str(corpus), f"-seed={args.seed}", f"-max_len={target.max_len}",
            f"-timeout={args.input_timeout}", f"-rss_limit_mb={args.rss_mb}",
            f"-artifact_prefix={Path(args.artifacts).resolve()}/", "-print_final_stats=1"]
    if args.runs >= 0:
        argv.append(f"-runs={args.runs}")
    if args.seconds:
        argv.append(f"-max_total_time={args.seconds}")
    if target.fmt == "bytes":
        atheris.Setup(argv, one)
    else:  # half structure-aware mutations (mutate.py); the whole size limit from the start, and the
        # valid conversations stay whole in the corpus (a shorter input of the same coverage would
        # replace one, dropping fields whose values the structured mutations need to vary)
        argv += ["-len_control=0", "-reduce_inputs=0"]
        atheris.Setup(argv, one, custom_mutator=structured(target.fmt, target.skip))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
