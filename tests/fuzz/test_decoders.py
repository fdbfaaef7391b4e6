"""Coverage-guided fuzzing (atheris) of every decoder of socket bytes, bounded for CI.

Each target (targets.py) runs a fixed number of inputs, starting from valid
conversations, in its own process; the test fails with the traceback and the
saved input if any input raised an error the decoder's contract does not
allow, hung, or ran the process out of memory. A failure is fixed in the
product and its input becomes a case in test_regressions.py. The inputs run
per target are printed (`pytest -s`) and also reported by bench/fuzz.py,
which runs the long version.
"""

from __future__ import annotations

import pytest

from tests.fuzz.fuzzing import CI_RUNS, fuzz
from tests.fuzz.targets import TARGETS, replay

pytest.importorskip("atheris")


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz_run_finds_nothing(name, tmp_path):
    result = fuzz(name, tmp_path, runs=CI_RUNS[name], timeout_s=300)
    print(f"\nfuzz {name}: {result.runs} inputs in {result.seconds} s, coverage {result.coverage} edges "
          f"/ {result.features} features")
    assert result.ok, result.finding()
    assert result.runs >= CI_RUNS[name] and result.coverage > 0, result.output[-3000:]


def test_the_harness_reports_a_planted_bug_with_its_input(tmp_path):
    """A run that cannot fail proves nothing: a decoder that uses a peer's value as a dict
    key (the bug the KV side channel and the NetLoader client had) is caught, and the
    saved input replays the same error."""
    result = fuzz("planted", tmp_path, runs=20_000, timeout_s=300)
    assert not result.ok and "TypeError: unhashable type" in result.output, result.output[-3000:]
    assert result.artifact is not None
    with open(result.artifact, "rb") as f:
        crash = f.read()
    with pytest.raises(TypeError, match="unhashable"):
        replay("planted", [crash])
