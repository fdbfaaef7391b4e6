"""Run a fuzz target in a subprocess (tests/fuzz/run.py) and read what libFuzzer reported."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Inputs per target in CI: 3-7 s each on an idle 2-core machine (bench/fuzz.py runs longer).
CI_RUNS = {"frames": 40_000, "kv_channel": 8_000, "kv_channel_client": 12_000, "netloader_seed": 10_000,
           "netloader_client": 10_000, "registry": 40_000, "openai_body": 100_000, "ec_memcached": 12_000}
_EXECUTED = re.compile(r"^stat::number_of_executed_units:\s+(\d+)", re.MULTILINE)
_COVERAGE = re.compile(r"^#\d+\s+\w+\s+cov: (\d+) ft: (\d+)", re.MULTILINE)
# a crash, leak, timeout or out-of-memory input; not "slow-unit-" ones (libFuzzer writes any input
# over 10 s, which on a loaded CI host says nothing of the decoder: -timeout catches hangs)
_ARTIFACT = re.compile(r"Test unit written to (\S*/(?!slow-unit-)[^/\s]+)(?!\S)")


@dataclass
class Result:
    target: str
    runs: int  # inputs executed
    seconds: float
    coverage: int  # libFuzzer's coverage counters (edges) reached
    features: int
    returncode: int
    artifact: str | None  # the input that failed, when one did
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.artifact is None

    def finding(self) -> str:
        """The traceback (or libFuzzer's reason) of a failed run, for an assertion message."""
        start = self.output.find("=== Uncaught Python exception")
        if start < 0:
            start = max(self.output.find("==ERROR"), self.output.find("ERROR: libFuzzer"), 0)
        return self.output[start:start + 4000] + f"\n(input: {self.artifact})"


def fuzz(target: str, artifacts: Path, runs: int = -1, seconds: int = 0, corpus: Path | None = None,
         timeout_s: float = 600.0) -> Result:
    argv = [sys.executable, "-m", "tests.fuzz.run", target, "--runs", str(runs), "--seconds", str(seconds),
            "--artifacts", str(artifacts)]
    if corpus is not None:
        argv += ["--corpus", str(corpus)]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="asf-fuzz-") as scratch:  # the run's temporary files
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TMPDIR": scratch,
               "PYTHONHASHSEED": "0"}  # atheris traces hashes too: the same inputs run each time
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, errors="replace",
                              timeout=timeout_s)
    elapsed = time.monotonic() - started
    out = proc.stdout + proc.stderr
    executed = _EXECUTED.findall(out)
    coverage = _COVERAGE.findall(out)
    artifact = _ARTIFACT.findall(out)
    return Result(target, int(executed[-1]) if executed else 0, round(elapsed, 1),
                  int(coverage[-1][0]) if coverage else 0, int(coverage[-1][1]) if coverage else 0,
                  proc.returncode, artifact[-1] if artifact else None, out)
