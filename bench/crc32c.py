"""NetLoader's checksum: CRC32C implementations on one buffer, and what each leaves the other threads.

    python -m bench.crc32c [--mib 256] [--rounds 5]

Side by side, in one run, on one buffer of random bytes (rounds interleaved,
so load on the host hits each alike):
1. ours: `netloader.wire.crc32c` (google-crc32c, Apache-2.0, handed numpy
   views of 4 MiB slices: no copy, and the GIL free between slices);
2. google-crc32c on the whole buffer as one numpy view (the GIL held throughout);
3. google-crc32c on `bytes` (its floor: the only input it checks with the GIL released);
4. the `crc32c` package (LGPL-2.1+, what the branch used first) on a memoryview,
   when installed;
5. zlib's CRC-32 (NetLoader's wire version 1).
GB/s (best and median), the ratio to the `crc32c` package, and how far a
pure-Python thread gets meanwhile (% of what it does alone): a joiner's
streams need the GIL between their reads while the checker runs.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import zlib

import google_crc32c
import numpy

from ascendserve.netloader import wire
from bench._report import save, table


def _spin(stop: threading.Event, out: list) -> None:
    n = 0
    while not stop.is_set():
        n += 1
    out.append(n)


def _beside(fn, seconds_alone: float, alone: int) -> float:
    """A spinning thread's progress while `fn` runs back to back, as a fraction of its pace alone."""
    stop, out = threading.Event(), []
    spinner = threading.Thread(target=_spin, args=(stop, out))
    spinner.start()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds_alone:
        fn()
    elapsed = time.perf_counter() - start
    stop.set()
    spinner.join()
    return out[0] / elapsed / (alone / seconds_alone)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    n = args.mib << 20
    arr = numpy.random.default_rng(1).integers(0, 256, n, dtype=numpy.uint8)
    raw = arr.tobytes()
    view = memoryview(arr)
    candidates = {"ours: wire.crc32c (google-crc32c, 4 MiB numpy slices)": lambda: wire.crc32c(view),
                  "google-crc32c, one numpy view": lambda: google_crc32c.value(arr),
                  "google-crc32c, bytes": lambda: google_crc32c.value(raw)}
    try:
        import crc32c

        candidates["crc32c package (LGPL), memoryview"] = lambda: crc32c.crc32c(view)
    except ImportError:
        crc32c = None
    candidates["zlib CRC-32 (wire version 1)"] = lambda: zlib.crc32(view)
    want = google_crc32c.value(raw)
    assert wire.crc32c(view) == want and (crc32c is None or crc32c.crc32c(view) == want)

    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(args.rounds):
        for name, fn in candidates.items():
            for _ in range(3):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    stop, alone = threading.Event(), []
    spinner = threading.Thread(target=_spin, args=(stop, alone))
    spinner.start()
    time.sleep(1.0)
    stop.set()
    spinner.join()
    peer = "crc32c package (LGPL), memoryview"
    peer_best = min(times[peer]) if peer in times else None
    rows, data = [], {}
    for name, fn in candidates.items():
        best, median = min(times[name]), statistics.median(times[name])
        beside = _beside(fn, 1.0, alone[0])
        ratio = f"{peer_best / best:.2f}x" if peer_best else "-"
        rows.append([name, round(n / best / 1e9, 2), round(n / median / 1e9, 2), ratio, f"{beside:.0%}"])
        data[name] = {"best_s": best, "median_s": median, "gb_per_s_best": n / best / 1e9,
                      "other_thread_fraction": beside}
    table(f"CRC of {args.mib} MiB (GB/s; x: speed relative to the crc32c package, best of "
          f"{args.rounds * 3}; other thread: a pure-Python thread's pace meanwhile)",
          ["implementation", "GB/s best", "GB/s median", "x crc32c", "other thread"], rows)
    save("crc32c", {"mib": args.mib, "rounds": args.rounds, "results": data})


if __name__ == "__main__":
    main()
