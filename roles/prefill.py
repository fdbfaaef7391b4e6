"""Prefill (P): computes the prompt's KV cache and hands it to decode (KV producer)."""

from ascendserve.config import Config
from roles._engine import run_engine


def run(config: Config) -> int:
    return run_engine(config)
