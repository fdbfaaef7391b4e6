"""Helpers for the KV connector tests that drive workers without vLLM."""

from __future__ import annotations

import time


def results_until(worker, pred, timeout: float = 10.0) -> list[set]:
    """Accumulate a worker's (finished sending, received, failed) until `pred` holds."""
    got = [set(), set(), set()]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for acc, new in zip(got, worker.get_transfer_results()):
            acc |= new
        if pred(got):
            return got
        time.sleep(0.01)
    raise AssertionError(f"not reached after {timeout} s: {got}")
