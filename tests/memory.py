"""A machine-wide memory budget for the vLLM instances tests start.

Every pytest process on the host (both xdist workers, and a second suite someone runs beside
CI) reserves an estimate of an engine's memory before starting it and gives it back when it
stops; a start that would take the reserved total over the budget waits until it fits. The
ledger is one JSON file under an flock (LEDGER); a reservation whose owner process died is
dropped when the ledger is next read, so a killed worker frees what it held.

Estimates (GiB of proportional set size, measured on this host with the tiny text model,
2026-12-02): an instance is an API server (~0.4), an engine core (~0.3) and a worker (~0.55)
plus its KV cache, ~1.3 GiB before the KV cache; each further TP/DP rank adds a worker with
its own KV cache. The suite's tuned engines ask for a 256 MiB KV cache (tests/procs.py
ENGINE_ARGS): 1.55 GiB measured for a pd role, against 2.28 GiB with 1 GiB of KV
(VLLM_CPU_KVCACHE_SPACE=1, the estimate for an engine that names no KV size).

Waiting has a deadline (WAIT_S, then TimeoutError naming the holders). Two waiters can block
each other only when each holds what the other needs; when every holder of memory is itself
waiting, the oldest waiter goes ahead over budget (logged on stderr) rather than both hanging:
the budget keeps MARGIN_GIB below the machine's memory for that.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from tests import session_records
from tests.reaper import alive as _alive

LEDGER = Path(os.environ.get("ASCENDSERVE_TEST_LEDGER", "/tmp/ascendserve-test-memory.json"))
INSTANCE_GIB = 1.3  # API server, engine core and one worker, without the KV cache
RANK_GIB = 0.6  # a further worker, without its KV cache
KV_GIB = 1.0  # VLLM_CPU_KVCACHE_SPACE=1 (tests/procs.py ENGINE_ENV), for an engine that names no other size
ROLE_KV_GIB = 0.5  # an untuned engine role sizes its own: 16 sequences of the model's length, 128-256 MiB here
MARGIN_GIB = 3.5  # pytest itself, control-plane roles, memcached, page cache for the models
WAIT_S = 1800.0
POLL_S = 0.5


def budget_gib() -> float:
    override = os.environ.get("ASCENDSERVE_TEST_MEMORY_GIB")
    if override:
        return float(override)
    with open("/proc/meminfo") as f:
        total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return total_kib / 2**20 - MARGIN_GIB


def engine_gib(ranks: int = 1, kv_gib: float = KV_GIB) -> float:
    """An engine instance of `ranks` workers, each with a KV cache of kv_gib."""
    return INSTANCE_GIB + kv_gib + (RANK_GIB + kv_gib) * max(ranks - 1, 0)


@contextmanager
def _locked():
    LEDGER.parent.mkdir(parents=True, exist_ok=True)
    with open(LEDGER.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            try:
                entries = json.loads(LEDGER.read_text() or "{}")
            except (FileNotFoundError, json.JSONDecodeError):
                entries = {}
            entries = {k: v for k, v in entries.items()
                       if _alive(v["owner"]) and (v["state"] == "held" or _alive(v["waiter"]))}
            yield entries
            tmp = LEDGER.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries))
            tmp.replace(LEDGER)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def session_owner() -> int:
    """The suite's controlling process (the xdist controller, or pytest itself without xdist):
    it owns what is shared by the whole session, freed at its end (tests/shared_engines.py)."""
    return int(os.environ.get("ASCENDSERVE_TEST_SESSION_PID") or os.getpid())


def reserve(gib: float, what: str, owner: int | None = None, wait_s: float = WAIT_S) -> str:
    """Reserve gib of the budget for `what`; blocks until it fits. Returns the reservation id."""
    return reserve_many([(gib, what)], owner, wait_s)[0]


def reserve_many(wants: list[tuple[float, str]], owner: int | None = None, wait_s: float = WAIT_S) -> list[str]:
    """Reserve several at once (engines started together): all or none, so that two processes
    never each hold half of what they need. Returns one id per (gib, what)."""
    key = uuid.uuid4().hex[:12]
    keys = [f"{key}-{i}" for i in range(len(wants))]
    me = os.getpid()
    owner = owner or me
    started = time.monotonic()
    deadline = started + wait_s
    budget = budget_gib()
    gib = sum(g for g, _ in wants)
    what = ", ".join(w for _, w in wants)
    announced = False
    while True:
        timed_out = False
        with _locked() as entries:
            held = sum(e["gib"] for e in entries.values() if e["state"] == "held")
            fits = held + gib <= budget + 1e-9
            if fits or _stuck(entries, key) or (held == 0 and gib > budget):
                if not fits:
                    print(f"[tests.memory] {what}: {gib:.1f} GiB over the {budget:.1f} GiB budget with "
                          f"{held:.1f} GiB reserved that waiting cannot free: going ahead", file=sys.stderr)
                entries.pop(key, None)
                for k, (g, w) in zip(keys, wants):
                    entries[k] = {"owner": owner, "waiter": me, "gib": g, "what": w, "state": "held",
                                  "since": time.time()}
                if announced:
                    _note_wait(what, gib, time.monotonic() - started)
                return keys
            entries.setdefault(key, {"owner": owner, "waiter": me, "gib": 0.0, "wants": gib, "what": what,
                                     "state": "waiting", "since": time.time()})
            if time.monotonic() > deadline:
                entries.pop(key, None)
                timed_out = True
                holders = "; ".join(f"{e['what']} {e['gib']:.1f} GiB (pid {e['owner']})"
                                    for e in entries.values() if e["state"] == "held")
        if timed_out:
            raise TimeoutError(f"{what}: {gib:.1f} GiB never fitted the {budget:.1f} GiB test memory budget "
                               f"within {wait_s:.0f} s; held: {holders}")
        if not announced:
            print(f"[tests.memory] {what} waits for {gib:.1f} GiB ({held:.1f} of {budget:.1f} reserved)",
                  file=sys.stderr)
            announced = True
        time.sleep(POLL_S)


WAITS_FILE = "memory-waits.jsonl"  # in the session's shared directory (tests/shared_engines.py)


def _note_wait(what: str, gib: float, seconds: float) -> None:
    """Record a start that waited for the budget, for the session's summary (waits_summary)."""
    session_records.append(WAITS_FILE, {"what": what, "gib": round(gib, 2), "s": round(seconds, 1),
                                        "pid": os.getpid()})


def waits_summary() -> str | None:
    """One line on the session's waits for the budget (engine starts held back while both workers'
    engines filled it): how many, how long in all, the longest; None when nothing waited."""
    waits = session_records.read(WAITS_FILE)
    if not waits:
        return None
    longest = sorted(waits, key=lambda w: -w["s"])[:3]
    return (f"{len(waits)} engine start(s) waited for the memory budget ({budget_gib():.1f} GiB), "
            f"{sum(w['s'] for w in waits):.0f} s in all; longest: "
            + "; ".join(f"{w['what']} {w['s']:.0f} s" for w in longest))


def _stuck(entries: dict, key: str) -> bool:
    """Whether waiting cannot help `key`: no held reservation can be freed, because each belongs to
    the whole session (owned by the suite's controlling process, freed at its end) or to a process
    that is itself waiting; then the oldest waiter goes ahead."""
    waiting = {k: e for k, e in entries.items() if e["state"] == "waiting"}
    if key not in waiting or min(waiting, key=lambda k: waiting[k]["since"]) != key:
        return False
    blocked = {e["waiter"] for e in waiting.values()}
    session = session_owner()
    return not any(e["owner"] != session and e["waiter"] not in blocked
                   for e in entries.values() if e["state"] == "held")


def release(key: str | None) -> None:
    if not key:
        return
    with _locked() as entries:
        entries.pop(key, None)


def held() -> list[dict]:
    """The live reservations (for reports and tests)."""
    with _locked() as entries:
        return [dict(e, key=k) for k, e in entries.items()]


@contextmanager
def reserved(gib: float, what: str):
    """Hold gib of the budget while the block runs (tests that start engines with subprocess)."""
    key = reserve(gib, what)
    try:
        yield
    finally:
        release(key)
