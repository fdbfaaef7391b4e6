"""Shared memory a killed engine instance left in /dev/shm, removed when the instance starts again.

An instance killed whole at once (SIGKILL to its process group or cgroup: a
container kill, an OOM kill of the unit) takes multiprocessing's resource
tracker with it, and nothing unlinks what its processes created: vLLM's
message queues (psm_*, hundreds of MB each), multiprocessing semaphores
(sem.mp-*), the EC region when it was the last holder. /dev/shm is memory.

While the instance runs, its role process keeps the names its processes map
in `{runtime_dir}/shm-{instance_id}.json` (the id names role, host and port,
so a restart finds its predecessor's file). The next start removes those of
them that no live process maps or holds open. A killed instance that
multiprocessing's tracker survives needs none of this: the tracker unlinks
them once the instance's processes are gone.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import psutil

SHM_DIR = "/dev/shm"


def _shm_maps(pid: int) -> list[tuple[str, int]]:
    """(name, inode) of each /dev/shm mapping of a process."""
    out = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(SHM_DIR + "/"):
                    out.append((fields[5].strip()[len(SHM_DIR) + 1:].removesuffix(" (deleted)"), int(fields[4])))
    except (OSError, ValueError):
        pass
    return out


def mapped_by(pids: list[int]) -> set[str]:
    """The /dev/shm names these processes map, under the names the files have now (glibc's
    sem_open creates a semaphore under a temporary name and renames it: its creator's
    mapping shows the temporary one)."""
    maps = [m for pid in pids for m in _shm_maps(pid)]
    inodes = {inode for _, inode in maps}
    names = {name for name, _ in maps if "/" not in name}
    try:
        names |= {e.name for e in os.scandir(SHM_DIR) if e.inode() in inodes}
    except OSError:
        pass
    return names


def inodes_in_use() -> set[int]:
    """Inodes in /dev/shm that a live process we can see maps or holds open (by inode, not
    name: see mapped_by)."""
    inodes: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        inodes |= {inode for _, inode in _shm_maps(int(entry))}
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}").startswith(SHM_DIR + "/"):
                    inodes.add(os.stat(f"/proc/{entry}/fd/{fd}").st_ino)
            except OSError:
                pass
    return inodes


class ShmLedger:
    def __init__(self, runtime_dir: str, instance_id: str, interval_s: float = 5.0):
        self.path = Path(runtime_dir) / f"shm-{instance_id}.json"
        self.interval_s = interval_s
        self._recorded: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ascendserve-shm-ledger", daemon=True)

    def sweep(self) -> list[str]:
        """At start: remove what the previous run of this instance left and nobody uses."""
        try:
            names = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return []
        busy = inodes_in_use()
        removed = []
        for name in names if isinstance(names, list) else []:
            if not isinstance(name, str) or "/" in name or name in (".", ".."):
                continue
            path = os.path.join(SHM_DIR, name)
            try:
                if os.stat(path).st_ino in busy:
                    continue
                os.unlink(path)
                removed.append(name)
            except OSError:
                pass
        self.path.unlink(missing_ok=True)
        return removed

    def start(self) -> "ShmLedger":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def record(self) -> None:
        """Add what this process and its descendants map now (names are kept: a dead child's too)."""
        try:
            pids = [os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))]
        except psutil.Error:
            return
        names = self._recorded | mapped_by(pids)
        if names == self._recorded:
            return
        self._recorded = names
        tmp = self.path.with_suffix(".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(sorted(names)))
            tmp.replace(self.path)
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.record()
