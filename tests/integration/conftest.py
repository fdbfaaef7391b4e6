"""Session fixtures of the integration tests that run engines the way a user does."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def untuned_text_oracle(text_model, tmp_path_factory):
    """Plain vLLM on the tiny text model with vLLM's own defaults (dtype auto, compilation on):
    the oracle of the topologies started with no tuning flags (shared: each instance costs ~3 GB)."""
    from tests.procs import plain_vllm, start_all

    oracle = plain_vllm(text_model, tmp_path_factory.mktemp("untuned-oracle-logs"), name="vllm-untuned",
                        tuned=False)
    start_all(oracle)
    yield oracle
    oracle.stop()
