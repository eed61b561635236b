"""Does a copy-in split across threads pay here?  One ``np.copyto`` against the same
copy cut in 2 (or more) parts, the parts after the first on worker threads
(``np.copyto`` releases the GIL for a large copy), into the memory a copy-in writes.

Run from the repository root::

    python -m perf.copysplit                 # 8 and 64 MiB, 1 / 2 threads, ~20 s
    python -m perf.copysplit --sizes 8 --threads 1 2 3 --rounds 60

The destination is a shared-memory mapping (``/dev/shm``, the name unlinked at once,
touched before the run: a slot's pages), the source a private array; the caches are
evicted before every sample (:class:`perf.slots.Evictor`), as in the copy-in tables of
:mod:`perf.slots`.  The variants run interleaved (one sample of each per round, the
order rotating) and the table gives medians and the ratio to the one-thread copy
(above 1.00×: the split is faster).  ``ringwire._shm.sendpool`` copies on the
sending thread; this is the measurement behind keeping it so (see perf/README.md).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from perf._common import format_table, machine_info
from perf.slots import Evictor

MiB = 1 << 20


def shm_array(nbytes: int) -> tuple[Any, mmap.mmap]:
    """A touched ``uint8`` array over a fresh ``/dev/shm`` mapping (name unlinked)."""
    name = f"/dev/shm/rw-copysplit.{os.getpid()}.{nbytes}"
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.unlink(name)
        os.ftruncate(fd, nbytes)
        m = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    arr = np.frombuffer(m, np.uint8)
    arr[:] = 1
    return arr, m


def split_copy(pool: ThreadPoolExecutor | None, parts: int, dst: Any, src: Any) -> None:
    """``np.copyto(dst, src)`` in ``parts`` page-aligned pieces, all but the first on
    ``pool``'s threads."""
    if pool is None or parts == 1:
        np.copyto(dst, src)
        return
    n = len(src)
    step = max(4096, (n // parts) // 4096 * 4096)
    cuts = [(i * step, n if i == parts - 1 else (i + 1) * step) for i in range(parts)]
    futs = [pool.submit(np.copyto, dst[a:b], src[a:b]) for a, b in cuts[1:]]
    a, b = cuts[0]
    np.copyto(dst[a:b], src[a:b])
    for f in futs:
        f.result()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64], help="MiB")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args(argv)
    if 1 not in args.threads:
        args.threads.insert(0, 1)
    info = machine_info()
    print("## Copy-in split across threads")
    print()
    print(
        f"- CPU: {info['cpu']}; cpus: {info['cpu_count']} ({info['cpus_usable']} usable); "
        f"load average at start: {os.getloadavg()[0]:.2f}; {args.rounds} rounds, interleaved"
    )
    ev = Evictor()
    workers = max(args.threads) - 1
    pool = ThreadPoolExecutor(workers) if workers else None
    rows = []
    try:
        for size in args.sizes:
            nbytes = size * MiB
            src = np.ones(nbytes, np.uint8)
            dst, m = shm_array(nbytes)
            times: dict[int, list[int]] = {t: [] for t in args.threads}
            for r in range(args.rounds):
                k = len(args.threads)
                for j in range(k):
                    t = args.threads[(r + j) % k]
                    ev.evict()
                    t0 = time.perf_counter_ns()
                    split_copy(pool, t, dst, src)
                    times[t].append(time.perf_counter_ns() - t0)
            one = statistics.median(times[1])
            for t in args.threads:
                med = statistics.median(times[t])
                rows.append(
                    [
                        f"{size} MiB",
                        f"{t}",
                        f"{med / 1e3:.0f}",
                        f"{nbytes / med:.1f}",
                        f"{one / med:.2f}×",
                    ]
                )
            del dst
            m.close()
    finally:
        if pool is not None:
            pool.shutdown()
    print()
    print(format_table(["size", "threads", "median µs", "GB/s", "× one thread"], rows, "lrrrr"))
    print(f"\n(load average at end: {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
