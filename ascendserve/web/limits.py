"""Process limits a server sets for itself at start-up."""

from __future__ import annotations

import resource


def raise_open_files_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit; returns (before, after).

    Every stream through the proxy holds a client socket and a backend socket
    (plus pooled ones), and 1024, a common default soft limit, ends it at a
    few hundred streams with EMFILE. Raising soft up to hard needs no privilege.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft >= hard:
        return soft, soft
    target = hard
    if hard == resource.RLIM_INFINITY:  # "unlimited" is refused for NOFILE: take the kernel's ceiling
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, target
