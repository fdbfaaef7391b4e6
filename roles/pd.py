"""PD: prefill and decode in one vLLM instance; EC consumer when an encoder exists."""

from ascendserve.config import Config
from roles._engine import run_engine


def run(config: Config) -> int:
    return run_engine(config)
