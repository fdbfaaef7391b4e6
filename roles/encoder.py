"""Encoder (E): vLLM with --mm-encoder-only, publishing encoder outputs to the EC store."""

from ascendserve.config import Config
from roles._engine import run_engine


def run(config: Config) -> int:
    return run_engine(config)
