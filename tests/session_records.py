"""Records the workers of one test session append to a file in its shared directory
(tests/shared_engines.py), for the controlling process's summaries at the end: one JSON
object per line. Outside such a session (no shared directory) nothing is written or read."""

from __future__ import annotations

import json
import os
from pathlib import Path

DIR_ENV = "ASCENDSERVE_TEST_SHARED_DIR"


def _path(name: str) -> Path | None:
    value = os.environ.get(DIR_ENV)
    return Path(value) / name if value else None


def append(name: str, record: dict) -> None:
    """One line of the session's file `name`; a summary is not worth failing a test over."""
    path = _path(name)
    if path is None:
        return
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError:
        pass


def read(name: str) -> list[dict]:
    """Every record of the session's file `name`, in the order they were appended."""
    path = _path(name)
    if path is None or not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
