"""Decode (D): loads the KV computed by prefill and generates tokens (KV consumer)."""

from ascendserve.config import Config
from roles._engine import run_engine


def run(config: Config) -> int:
    return run_engine(config)
