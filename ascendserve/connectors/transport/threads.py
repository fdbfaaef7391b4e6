"""Transfer threads run on every CPU the machine allows.

vLLM's CPU worker pins its process to the cores its OpenMP team spins on;
threads started there inherit that mask and starve behind the spinning
(seen here: a one-block pull took 50 s). On Linux, sched_setaffinity(0)
applies to the calling thread only, so each transfer thread widens its own
mask first thing.
"""

from __future__ import annotations

import os


def _allowed_cpus() -> set[int]:
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective") as f:
            return _parse(f.read())
    except (OSError, ValueError):
        return set(range(os.cpu_count() or 1))


def _parse(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cpus.update(range(int(lo), int(hi) + 1))
        elif part:
            cpus.add(int(part))
    if not cpus:
        raise ValueError("empty cpuset")
    return cpus


def unpin_current_thread() -> None:
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, _allowed_cpus())
        except OSError:
            pass
