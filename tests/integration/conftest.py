"""Session fixtures of the integration tests that run engines the way a user does."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def untuned_text_oracle(text_model, tmp_path_factory):
    """Plain vLLM on the tiny text model with vLLM's own defaults (dtype auto, compilation on):
    the oracle of the topologies started with no tuning flags (one for the session and all its
    workers, tests/shared_engines.py: each instance costs ~2 GiB)."""
    from tests.procs import plain_vllm
    from tests.shared_engines import shared

    return shared("untuned-text-oracle", lambda: plain_vllm(
        text_model, tmp_path_factory.mktemp("untuned-oracle-logs"), name="vllm-untuned", tuned=False))
