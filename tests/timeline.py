"""Where the suite's wall time went: each worker's modules, in the order it ran them.

Every test's start and end (setup to teardown, wall clock) is appended by the worker that ran it
to a file in the session's shared directory (tests/shared_engines.py); at the end the controlling
process prints one line per module (its worker, when it started after the session did, how long
it ran) and each worker's idle time at the end, so that a schedule that leaves one worker idle
while the other runs a long module (scripts/test.sh's --dist loadscope; MODULE_SECONDS in
tests/conftest.py orders the modules) shows in every run's log.
"""

from __future__ import annotations

import time

from tests import session_records

FILE = "timeline.jsonl"


def note(nodeid: str, worker: str, started: float, ended: float) -> None:
    session_records.append(FILE, {"id": nodeid, "w": worker, "t0": round(started, 2), "t1": round(ended, 2)})


def summary(session_started: float, now: float | None = None) -> list[str]:
    """Lines: per module, in the order modules started: worker, start offset, span (s); then per
    worker, its busy seconds and how long it idled at the end."""
    rows = session_records.read(FILE)
    if not rows:
        return []
    now = time.time() if now is None else now
    modules: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        key = (r["id"].split("::", 1)[0], r["w"])
        span = modules.setdefault(key, [r["t0"], r["t1"]])
        span[0], span[1] = min(span[0], r["t0"]), max(span[1], r["t1"])
    lines = [f"{'module':52s} {'worker':6s} {'start':>6s} {'span':>6s}"]
    for (module, worker), (t0, t1) in sorted(modules.items(), key=lambda kv: kv[1][0]):
        if t1 - t0 >= 5:
            lines.append(f"{module:52s} {worker:6s} {t0 - session_started:6.0f} {t1 - t0:6.0f}")
    last = max(r["t1"] for r in rows)
    for worker in sorted({r["w"] for r in rows}):
        mine = [r for r in rows if r["w"] == worker]
        busy = sum(r["t1"] - r["t0"] for r in mine)
        end = max(r["t1"] for r in mine)
        lines.append(f"worker {worker}: busy {busy:.0f} s, idle {last - end:.0f} s at the end "
                     f"(last test ended {end - session_started:.0f} s in)")
    lines.append(f"session: {now - session_started:.0f} s, tests ran until {last - session_started:.0f} s")
    return lines
