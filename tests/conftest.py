from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def _build(kind: str, out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "ascendserve", "model", "tiny", "--kind", kind, "--out", str(out)],
        check=True, capture_output=True, timeout=300,
    )
    return out


@pytest.fixture(scope="session")
def text_model(tmp_path_factory) -> Path:
    return _build("text", tmp_path_factory.mktemp("models") / "tiny-text")


@pytest.fixture(scope="session")
def vl_model(tmp_path_factory) -> Path:
    return _build("vl", tmp_path_factory.mktemp("models") / "tiny-vl")


@pytest.fixture(scope="session")
def text_oracle(text_model, tmp_path_factory):
    """One plain vLLM instance on the tiny text model: the correctness oracle
    every text topology is compared with (shared: each instance costs ~3 GB)."""
    from tests.procs import plain_vllm, start_all

    oracle = plain_vllm(text_model, tmp_path_factory.mktemp("oracle-logs"))
    start_all(oracle)
    yield oracle
    oracle.stop()
