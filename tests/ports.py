"""Ports for test processes that cannot collide between pytest-xdist workers.

A server the tests start gets its port from here, never from the kernel's ephemeral range
(32768-60999 here), which is where vLLM's own ZMQ and torch.distributed ports and every
outgoing connection's source port come from. The range 10000-29999 is split between the
workers by the last two digits: with W workers, worker i owns the ports whose value mod 100
falls in [i * 100 // W, (i + 1) * 100 // W). The ports ascendserve derives from a server port
keep those digits or add a few units: the KV side channel is port + 1000 (+ TP rank), the
NetLoader seed port + 2000, the KV events port + 1500 and their replay + 2500, `all`'s metaserver port + 1 and its engines port + 10.. — so a
derived port stays in the worker's share as long as the base leaves room below the end of it.
Within a worker no port is handed out twice (the process remembers what it gave), and each
one is checked free with bind() first; a base port also checks its derived ports.
"""

from __future__ import annotations

import os
import random
import socket

LOW, HIGH = 10000, 30000  # + 2500 (KV events replay) stays below the ephemeral range (32768)
DERIVED = (1000, 1001, 1002, 1003, 1500, 2000, 2500)  # what an engine role binds beside --port by default

_issued: set[int] = set()
_rng = random.Random()


def worker() -> tuple[int, int]:
    """(index, count) of this pytest-xdist worker; (0, 1) outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0
    return index % max(count, 1), max(count, 1)


def share(index: int, count: int) -> range:
    """The last-two-digit values worker `index` of `count` owns."""
    width = 100 // count
    return range(index * width, (index + 1) * width)


def owner(port: int, count: int) -> int:
    """Which of `count` workers owns `port` (for tests of this module)."""
    return min((port % 100) // (100 // count), count - 1)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _usable(ports: list[int], digits: range) -> bool:
    return all(LOW <= p < HIGH + 2500 + 100 and p % 100 in digits and p not in _issued for p in ports) and \
        all(_bindable(p) for p in ports)


def free_port_run(count: int = 1, offsets: tuple[int, ...] = (), derived: bool = True) -> int:
    """A base port p of this worker with p .. p+count-1 and p+o for each o in offsets free and
    never handed out before in this process; derived=True also checks (and keeps) the ports an
    engine role would bind beside it (DERIVED)."""
    index, workers = worker()
    digits = share(index, workers)
    extra = tuple(offsets) + (DERIVED if derived else ())
    span = max([count - 1, *(o % 100 for o in extra)]) + 1  # how far past the base the last two digits go
    room = len(digits) - span + 1
    if room <= 0:
        raise RuntimeError(f"{workers} workers leave no room for ports spanning {span} (a share is {len(digits)})")
    def candidates():
        for _ in range(2000):  # random first: two processes of one worker rarely pick the same
            yield _rng.randrange(LOW // 100, HIGH // 100) * 100 + digits.start + _rng.randrange(room)
        every = [h * 100 + digits.start + d for h in range(LOW // 100, HIGH // 100) for d in range(room)]
        _rng.shuffle(every)  # then every base, so that a crowded share still yields what it has
        yield from every

    for base in candidates():
        wanted = [base + i for i in range(count)] + [base + o for o in extra]
        if _usable(wanted, digits):
            _issued.update(wanted)
            return base
    raise RuntimeError(f"no run of {count} free ports in worker {index}'s share of {LOW}-{HIGH}")


def free_port() -> int:
    """A port for one server (its derived ports checked free too)."""
    return free_port_run(1)
