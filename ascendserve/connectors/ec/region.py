"""A host-wide shared-memory region of encoder outputs: block allocator, index, LRU, pins.

Layout of /dev/shm/<name> (little-endian, fixed at creation):

    header   magic, version, block_size, num_blocks, max_entries, free list head, clock
    entries  max_entries rows: key (mm_hash), state, dtype, shape, nbytes,
             first block, block count, pins, pin deadline, write deadline, last use
    next     num_blocks int32: the block chain of each entry, and the free list
    data     num_blocks x block_size bytes

Writers allocate blocks (evicting the least recently used unpinned entries),
mark the entry WRITING, copy without the lock, then mark it READY. Readers
pin an entry (so it cannot be evicted) and copy its blocks out with one
batched gather. Every pin and every unfinished write has a deadline on the
host's monotonic clock: a reader or writer that dies leaves nothing that
outlives it for long.

One mutex guards the tables: a POSIX record lock on the file (released by
the kernel if its holder dies) plus a thread lock (record locks are per
process). Every process that maps the region also holds a shared flock on
it; the last one to close gets the exclusive flock and unlinks the name, so
a cluster that stops leaves nothing in /dev/shm, and a stale region left by
a crash is reinitialised by the next process that finds itself alone. A
forked child lets go of the regions it inherited (they would hold the
parent's flock as long as the child lives).

No torch here: it is used by vLLM workers, schedulers and tests alike.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

from ascendserve.ops import gather_pages

SHM_DIR = "/dev/shm"
MAGIC = 0x4153_4543_5245_4731  # "ASECREG1"
VERSION = 1
KEY_BYTES = 160  # blake3/sha256 hex is 64, sha512 hex 128
MAX_DIMS = 4
FREE, WRITING, READY = 0, 1, 2
HEADER_BYTES = 4096

_open_regions: "weakref.WeakSet[Region]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """A process that exits normally (vLLM's engine on SIGTERM included) still gives up its regions."""
    for region in list(_open_regions):
        try:
            region.close()
        except Exception:
            pass


def _disown_inherited() -> None:
    """In a forked child: let go of the parent's regions without touching them.

    The child's copy of a region's descriptor shares the parent's open file, and with it the
    parent's shared flock, for as long as the child lives. An instance's engine core and workers
    are forked from its main process (engine/patches/core_fork.py, worker_fork.py) after the
    main process took the host's region, and vLLM SIGKILLs them at shutdown: while one of them
    lingered, the real last holder found the lock still shared, did not unlink, and the region
    stayed in /dev/shm. Nor may a child's exit close the parent's
    region for it (its atexit would try to unlink the name the parent still uses). The child
    closes its copies only: no lock is taken (one held by another thread at the fork would stay
    held here), nothing in the region is written. A region the child needs, it opens itself."""
    for region in list(_open_regions):
        region._disown()


os.register_at_fork(after_in_child=_disown_inherited)


DTYPES = ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int32", "int64")

_HEADER = np.dtype([("magic", "<u8"), ("version", "<u4"), ("block_size", "<u4"), ("num_blocks", "<u4"),
                    ("max_entries", "<u4"), ("free_head", "<i4"), ("free_count", "<u4"), ("clock", "<u8"),
                    ("evictions", "<u8")])
_ENTRY = np.dtype([("key", f"S{KEY_BYTES}"), ("state", "u1"), ("dtype", "u1"), ("ndim", "u1"), ("pad", "u1"),
                   ("nblocks", "<u4"), ("first", "<i4"), ("pins", "<u4"), ("shape", "<i8", (MAX_DIMS,)),
                   ("nbytes", "<u8"), ("pin_deadline", "<f8"), ("write_deadline", "<f8"), ("last_used", "<u8")])


class RegionError(Exception):
    """The region cannot be used as configured (the message says why)."""


@dataclass(frozen=True)
class Entry:
    """Where one item lives: what a reader needs to copy it out."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    blocks: np.ndarray  # int64 block ids, in order


def _sizes(block_size: int, num_blocks: int, max_entries: int) -> tuple[int, int, int, int]:
    entries_at = HEADER_BYTES
    next_at = entries_at + _ENTRY.itemsize * max_entries
    data_at = -(-(next_at + 4 * num_blocks) // 4096) * 4096
    return entries_at, next_at, data_at, data_at + block_size * num_blocks


class Region:
    """One process's mapping of a named region (created on first use)."""

    def __init__(self, name: str, *, size_bytes: int, block_size: int = 64 * 1024, max_entries: int = 4096):
        if block_size < 4096 or block_size % 4096:
            raise RegionError(f"block_size must be a multiple of 4096, got {block_size}")
        num_blocks = size_bytes // block_size
        if num_blocks < 1:
            raise RegionError(f"region size {size_bytes} is smaller than one block ({block_size})")
        self.name, self.path = name, os.path.join(SHM_DIR, name)
        self.block_size, self.num_blocks, self.max_entries = block_size, num_blocks, max_entries
        self._tlock = threading.Lock()
        self._fd = self._attach()
        st = os.fstat(self._fd)
        self.ident = (st.st_dev, st.st_ino)  # the file this mapping is of, which the name may outlive
        entries_at, next_at, data_at, total = _sizes(block_size, num_blocks, max_entries)
        try:
            with self._locked():
                # Set up by whoever takes the lock first: alone, or the region was never set up
                # (another process opened it and holds it, but has not reached this lock yet:
                # two instances starting at once). Whoever maps it passed this lock with the
                # header complete (magic written last), so an empty file or a zero magic means
                # no process uses it.
                size = os.fstat(self._fd).st_size
                fresh = self._alone() or size == 0
                if fresh and size != total:
                    os.ftruncate(self._fd, total)
                if os.fstat(self._fd).st_size != total:
                    raise RegionError(self._mismatch(os.fstat(self._fd).st_size, total))
                self._mm = mmap.mmap(self._fd, total)
                self._header = np.frombuffer(self._mm, _HEADER, 1, 0)
                self._entries = np.frombuffer(self._mm, _ENTRY, max_entries, entries_at)
                self._next = np.frombuffer(self._mm, np.int32, num_blocks, next_at)
                self._data = np.frombuffer(self._mm, np.uint8, block_size * num_blocks,
                                           data_at).reshape(num_blocks, block_size)
                self._init_or_check(fresh or int(self._header[0]["magic"]) == 0)
        except BaseException:
            os.close(self._fd)
            raise
        self.closed = False
        _open_regions.add(self)

    def _mismatch(self, got: object, want: object) -> str:
        return (f"shared region {self.name} exists with a different layout ({got}, this process wants {want}): "
                "every instance on a host must use the same [ec] shm size and block size")

    # ---- life cycle ----------------------------------------------------------
    def _attach(self) -> int:
        """Open (or create) the file and hold a shared flock on the inode the name points at."""
        for _ in range(50):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)  # the last user unlinked it between our open and our lock
        raise RegionError(f"could not attach {self.path}: it keeps being replaced")

    def _init_or_check(self, alone: bool) -> None:
        h = self._header[0]
        if not alone:
            got = (int(h["magic"]), int(h["version"]), int(h["block_size"]), int(h["num_blocks"]),
                   int(h["max_entries"]))
            want = (MAGIC, VERSION, self.block_size, self.num_blocks, self.max_entries)
            if got != want:
                raise RegionError(self._mismatch(got[1:], want[1:]))
            return
        # first user, or a stale region nobody holds any more: start empty
        self._entries[:] = np.zeros(1, _ENTRY)
        self._next[:-1] = np.arange(1, self.num_blocks, dtype=np.int32)
        self._next[-1] = -1
        h["free_head"], h["free_count"], h["clock"], h["evictions"] = 0, self.num_blocks, 1, 0
        h["block_size"], h["num_blocks"], h["max_entries"], h["version"] = (
            self.block_size, self.num_blocks, self.max_entries, VERSION)
        h["magic"] = MAGIC

    def _alone(self) -> bool:
        """Whether no other open file holds the region (mutex held, so no closer races us).

        A failed flock upgrade drops the shared lock (Linux converts by
        removing first), so it is taken again either way."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            alone = False
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        return alone

    def close(self, settle_s: float = 0.0) -> bool:
        """Unmap; the last process to close unlinks the name. Whether this close unlinked it.

        settle_s: while the shared lock is still held but no process shows the region open, try
        again for up to this long. The kernel releases a dying process's flock a moment after
        its descriptors leave /proc (the last reference is dropped after the fd table goes)."""
        if self.closed:
            return False
        self.closed = True
        deadline = time.monotonic() + settle_s
        while True:
            last, unlinked = self._unlink_if_last()
            if last or time.monotonic() >= deadline or self._holders():
                break
            time.sleep(0.02)
        self._unmap()
        return unlinked

    def _unlink_if_last(self) -> tuple[bool, bool]:
        """(whether no other open file holds the region, whether this call unlinked the name).
        A failed upgrade leaves this process without its shared lock: it is closing."""
        with self._locked():
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False, False
            try:
                if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                    os.unlink(self.path)
                    return True, True
            except FileNotFoundError:
                pass
            return True, False

    def holders(self, group: int | None = None) -> list[int]:
        """Other processes that have this region open (of process group `group` only, if given):
        found by the file's identity in /proc/<pid>/fd, so a process being killed counts until
        its descriptors are gone, and a zombie does not. A process whose main thread has exited
        while its other threads still run (a multithreaded process being killed: the last thread
        tears down its memory and closes its files) shows no descriptors of its own; its
        threads' are looked at instead."""
        return [] if self.closed else self._holders(group)

    def _holders(self, group: int | None = None) -> list[int]:
        ident, me, out = self.ident, os.getpid(), []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            pid = int(name)
            try:
                if group is not None and os.getpgid(pid) != group:
                    continue
                if _has_open(f"/proc/{pid}", ident):
                    out.append(pid)
            except OSError:  # gone, or not ours to read
                continue
        return out

    def lock_pids(self) -> list[int]:
        """The pids /proc/locks names for flocks on this region (who locked them, which for an
        inherited descriptor is the process that took the lock): for the log of a close that
        found the region still held. Readable after the close."""
        return _lock_pids(*self.ident)

    def _disown(self) -> None:
        """Drop this process's mapping and descriptor without the lock or an unlink (after a fork)."""
        if self.closed:
            return
        self.closed = True
        self._unmap()

    def _unmap(self) -> None:
        self._header = self._entries = self._next = self._data = None
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view; the kernel drops it at exit
            pass
        try:
            os.close(self._fd)
        except OSError:
            pass

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- locking -------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self):
        with self._tlock:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, 0)
            try:
                yield
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, 0)

    # ---- table helpers (lock held) -------------------------------------------
    def _find(self, key: bytes) -> int:
        hits = np.flatnonzero((self._entries["key"] == key) & (self._entries["state"] != FREE))
        return int(hits[0]) if hits.size else -1

    def _tick(self) -> int:
        h = self._header[0]
        h["clock"] += 1
        return int(h["clock"])

    def _chain(self, first: int, n: int) -> np.ndarray:
        out = np.empty(n, np.int64)
        b = first
        for i in range(n):
            out[i] = b
            b = int(self._next[b])
        return out

    def _release(self, slot: int) -> None:
        e = self._entries[slot]
        n, first = int(e["nblocks"]), int(e["first"])
        if n:
            blocks = self._chain(first, n)
            h = self._header[0]
            self._next[blocks[-1]] = h["free_head"]
            h["free_head"] = first
            h["free_count"] += n
        self._entries[slot] = np.zeros(1, _ENTRY)[0]

    def _reclaimable(self, now: float) -> np.ndarray:
        """Slots that may be evicted: READY and unpinned (or pins expired), or a dead writer's."""
        e = self._entries
        ready = (e["state"] == READY) & ((e["pins"] == 0) | (e["pin_deadline"] < now))
        dead_writer = (e["state"] == WRITING) & (e["write_deadline"] < now)
        return np.flatnonzero(ready | dead_writer)

    def _make_room(self, nblocks: int, now: float) -> bool:
        h = self._header[0]
        if h["free_count"] >= nblocks and np.any(self._entries["state"] == FREE):
            return True
        victims = self._reclaimable(now)
        order = victims[np.argsort(self._entries["last_used"][victims], kind="stable")]
        for slot in order:
            self._release(int(slot))
            h["evictions"] += 1
            if h["free_count"] >= nblocks and np.any(self._entries["state"] == FREE):
                return True
        return False

    # ---- writers ---------------------------------------------------------------
    def write(self, key: str, data: np.ndarray, dtype: str, shape: tuple[int, ...],
              write_ttl_s: float = 30.0) -> bool:
        """Store `data` (the item's bytes, uint8) under `key`.

        False if the key is already there (or being written), or the item cannot fit."""
        if dtype not in DTYPES or len(shape) > MAX_DIMS:
            raise RegionError(f"cannot store an item of dtype {dtype} with {len(shape)} dims")
        data = data.reshape(-1).view(np.uint8)
        nblocks = max(1, -(-data.size // self.block_size))
        if nblocks > self.num_blocks:
            return False
        kb = key.encode()
        with self._locked():
            if self._find(kb) >= 0:
                return False
            now = time.monotonic()
            if not self._make_room(nblocks, now):
                return False
            slot = int(np.flatnonzero(self._entries["state"] == FREE)[0])
            h = self._header[0]
            first = int(h["free_head"])
            blocks = self._chain(first, nblocks)
            h["free_head"] = self._next[blocks[-1]] if h["free_count"] > nblocks else -1
            h["free_count"] -= nblocks
            e = self._entries[slot]
            e["key"], e["state"], e["dtype"], e["ndim"] = kb, WRITING, DTYPES.index(dtype), len(shape)
            e["shape"][:] = 0
            e["shape"][:len(shape)] = shape
            e["nbytes"], e["first"], e["nblocks"], e["pins"] = data.size, first, nblocks, 0
            e["write_deadline"], e["last_used"] = now + write_ttl_s, self._tick()
        full, tail = divmod(data.size, self.block_size)
        if full:
            self._data[blocks[:full]] = data[: full * self.block_size].reshape(full, self.block_size)
        if tail:
            self._data[blocks[full], :tail] = data[full * self.block_size:]
        with self._locked():
            e = self._entries[slot]
            if e["key"] != kb or e["state"] != WRITING:  # reclaimed: we overran the write deadline
                return False
            e["state"] = READY
        return True

    # ---- readers ---------------------------------------------------------------
    def contains(self, key: str) -> bool:
        with self._locked():
            slot = self._find(key.encode())
            return slot >= 0 and self._entries[slot]["state"] == READY

    def pin(self, key: str, ttl_s: float) -> Entry | None:
        """Pin a READY entry so it stays until `unpin` or `ttl_s` from now; None if absent."""
        with self._locked():
            slot = self._find(key.encode())
            if slot < 0:
                return None
            e = self._entries[slot]
            if e["state"] != READY:
                return None
            now = time.monotonic()
            if e["pin_deadline"] < now:
                e["pins"] = 0
            e["pins"] += 1
            e["pin_deadline"] = max(float(e["pin_deadline"]), now + ttl_s)
            e["last_used"] = self._tick()
            return self._entry(slot)

    def unpin(self, key: str) -> None:
        with self._locked():
            slot = self._find(key.encode())
            if slot >= 0 and self._entries[slot]["pins"] > 0:
                self._entries[slot]["pins"] -= 1

    def _entry(self, slot: int) -> Entry:
        e = self._entries[slot]
        ndim = int(e["ndim"])
        return Entry(key=e["key"].decode(), dtype=DTYPES[int(e["dtype"])],
                     shape=tuple(int(x) for x in e["shape"][:ndim]), nbytes=int(e["nbytes"]),
                     blocks=self._chain(int(e["first"]), int(e["nblocks"])))

    def read_into(self, entry: Entry, out: np.ndarray) -> None:
        """Copy a pinned entry's bytes into `out` (uint8, at least entry.nbytes long)."""
        full, tail = divmod(entry.nbytes, self.block_size)
        if full:
            gather_pages(self._data, entry.blocks[:full], out[: full * self.block_size].reshape(full, self.block_size))
        if tail:
            out[full * self.block_size: entry.nbytes] = self._data[entry.blocks[full], :tail]

    def read(self, entry: Entry) -> np.ndarray:
        """A fresh uint8 array holding a pinned entry's bytes."""
        out = np.empty(entry.nbytes, np.uint8)
        self.read_into(entry, out)
        return out

    def delete(self, key: str) -> bool:
        with self._locked():
            slot = self._find(key.encode())
            if slot < 0 or self._entries[slot]["state"] != READY:
                return False
            self._release(slot)
            return True

    def stats(self) -> dict[str, int]:
        with self._locked():
            h = self._header[0]
            return {"entries": int(np.count_nonzero(self._entries["state"] == READY)),
                    "free_blocks": int(h["free_count"]), "num_blocks": self.num_blocks,
                    "evictions": int(h["evictions"])}


def _open_in(fd_dir: str, ident: tuple[int, int]) -> bool | None:
    """Whether one of the descriptors in fd_dir is the file `ident`; None when it lists none."""
    fds = os.listdir(fd_dir)
    for fd in fds:
        try:
            other = os.stat(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == ident:
            return True
    return False if fds else None


def _has_open(proc: str, ident: tuple[int, int]) -> bool:
    """Whether the process at /proc/<pid> has the file open. A main thread that exited (its
    process being killed, or it called pthread_exit) lists no descriptors while the other
    threads still hold the shared table: then those threads' are read."""
    found = _open_in(f"{proc}/fd", ident)
    if found is not None:
        return found
    for tid in os.listdir(f"{proc}/task"):
        try:
            if _open_in(f"{proc}/task/{tid}/fd", ident):
                return True
        except OSError:
            continue
    return False


def _lock_pids(dev: int, ino: int) -> list[int]:
    """Pids of the /proc/locks entries for the file (dev, ino)."""
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  READ 1234 00:1b:5678 0 EOF" (a blocked waiter has "->" after the index)
        if "->" in parts:
            continue
        if len(parts) >= 6 and parts[5] == want and parts[1] == "FLOCK":
            out.append(int(parts[4]))
    return out


def _observed_entries(name: str, *, strict: bool) -> np.ndarray | None:
    """A copy of a region's entry table, read from outside: without the flock, so the reader
    never becomes a holder (the last holder's close removes the name; an observer that held it
    and outlived the engines, or died without closing it, left it in /dev/shm), and without the
    mutex, so it can be a moment old (an entry being written reads as WRITING). None when the
    region does not exist; an empty table while it is not yet initialised. A region smaller
    than its header says raises RegionError when `strict`, else reads as empty."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            return np.zeros(0, _ENTRY)
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            header = np.frombuffer(mm, _HEADER, 1, 0).copy()[0]
            if int(header["magic"]) != MAGIC:
                return np.zeros(0, _ENTRY)
            entries_at, _, _, total = _sizes(int(header["block_size"]), int(header["num_blocks"]),
                                             int(header["max_entries"]))
            if total > size:
                if strict:
                    raise RegionError(f"region {name} is smaller than its header says")
                return np.zeros(0, _ENTRY)
            view = np.frombuffer(mm, _ENTRY, int(header["max_entries"]), entries_at)
            table = view.copy()  # no view may outlive the mapping
            del view
            return table
    finally:
        os.close(fd)


def ready_keys(name: str, keys: list[str]) -> set[str]:
    """Which of `keys` a region holds READY, read as an observer (_observed_entries): a hint
    for the proxy, which must not keep the region alive."""
    e = _observed_entries(name, strict=False)
    if e is None or not len(e):
        return set()
    ready = set(e["key"][e["state"] == READY].tolist())
    return {k for k in keys if k.encode() in ready}


def snapshot(name: str) -> dict[str, int] | None:
    """Counts of a region's entries read from outside, for monitoring and tests; None when it does not exist.

    `held` = entries a reader has pinned or a writer is writing, whose deadline has not
    passed: what a dead peer could keep. Read as an observer (_observed_entries), so the
    counts can be a moment old."""
    e = _observed_entries(name, strict=True)
    if e is None:
        return None
    now = time.monotonic()
    pinned = int(np.count_nonzero((e["state"] == READY) & (e["pins"] > 0) & (e["pin_deadline"] >= now)))
    writing = int(np.count_nonzero((e["state"] == WRITING) & (e["write_deadline"] >= now)))
    return {"entries": int(np.count_nonzero(e["state"] == READY)), "pinned": pinned, "writing": writing,
            "held": pinned + writing}
