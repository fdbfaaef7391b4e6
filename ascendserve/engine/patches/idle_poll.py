"""vLLM's shared-memory readers nap instead of spinning.

Each vLLM engine talks to its workers through shared-memory ring buffers
(`shm_broadcast.MessageQueue`). A reader that has read within the last
`SpinCondition.busy_loop_s` (1 s in vLLM 0.32) does not sleep while it waits
for the next block: it calls sched_yield() in a loop. So after every step
the worker (waiting for the next step) and the engine core (waiting for the
worker's output) each hold a core, for a second after the last request. On
a GPU host that buys microseconds a step. On a CPU host whose engines have
more processes than the host has cores (two engines on a 2-core machine,
`all` with three engines, a TP group on a small VM) the spinners take the
cores from the processes that compute: a sched_yield() loop still gets its
fair share of the CPU, so every step waits behind the others' idle spins.

Simply ending the spin (busy_loop_s = 0) does not work: the reader then
sleeps on vLLM's zmq notification after every block, and with the writer's
PUB high-water mark of 1 those notifications are dropped while the previous
one is still being acknowledged; each step then waits for vLLM's 5 s
recheck (measured: 0.2 tokens/s).

So, 20 ms after its last read (SPIN_S: the steps of a running request
follow each other faster than that and keep vLLM's spin) and until vLLM's
busy window ends, a reader naps instead: it sleeps
`ASCENDSERVE_SHM_NAP_MS` milliseconds (a fraction: the kernel's timer slack
adds ~0.05 ms) and then re-checks the buffer, exactly as after a
sched_yield(). A step waits at most one nap longer; a waiting process costs a
wake-up per nap instead of a core. (zmq's poll cannot wait less than 1 ms,
and waiting on the notification would not help: it is the one that gets
dropped.) After the window, vLLM's own idle wait is unchanged.

Set by engine.host_defaults on such CPU hosts, or by hand; unset leaves vLLM
as it is. Feature-tested: installed only where `SpinCondition` has the
reader state it relies on (`is_reader`, `busy_loop_s`, `last_read`);
otherwise apply() raises and nothing is changed.
"""

from __future__ import annotations

import functools
import math
import os
import time

PATCHED = "_ascendserve_fix"
ENV = "ASCENDSERVE_SHM_NAP_MS"
# The first 20 ms after a read still spin as vLLM does: that covers the gap between the
# steps of a running request (a few ms here), so a request's own steps are not slowed.
SPIN_S = 0.02
_NEEDS = ("is_reader", "busy_loop_s", "last_read")


def nap_ms(environ=os.environ) -> float | None:
    """The nap from the environment; None when unset or 0. A value that is not a
    non-negative number is an error naming the variable."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{ENV}={raw!r}: expected milliseconds, a number >= 0")
    return value or None


def napping_wait(wait, ms: float):
    """Wrap SpinCondition.wait(self, timeout_ms=None): from SPIN_S after the last read
    to the end of vLLM's busy window, a sleep of `ms` (at most timeout_ms) instead of a
    sched_yield(); the caller re-checks."""

    @functools.wraps(wait)
    def wrapper(self, timeout_ms=None):
        idle = time.monotonic() - self.last_read
        if not self.is_reader or idle > self.busy_loop_s or idle < SPIN_S:
            return wait(self, timeout_ms)
        time.sleep((ms if timeout_ms is None else min(ms, timeout_ms)) / 1000)

    setattr(wrapper, PATCHED, ms)
    return wrapper


def apply(cls=None, environ=os.environ) -> list[str]:
    """Make readers nap when ASCENDSERVE_SHM_NAP_MS is set. Idempotent."""
    ms = nap_ms(environ)
    if ms is None:
        return []
    if cls is None:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition as cls
    if getattr(cls.wait, PATCHED, None) is not None:
        return []
    names = set(cls.__init__.__code__.co_names) | set(cls.__init__.__code__.co_varnames)
    missing = [n for n in _NEEDS if n not in names]
    if missing:
        raise TypeError(f"{cls.__qualname__} has no {', '.join(missing)}")
    cls.wait = napping_wait(cls.wait, ms)
    return [f"{cls.__name__}.wait naps {ms:g} ms"]
