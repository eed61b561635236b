"""One question: does one ``FUTEX_WAKE`` on a shared word wake N parked readers sooner
than N doorbell bytes (what a broadcast writer sends today, one per parked reader)?

Run from the repository root (Linux x86_64 or aarch64)::

    python -m perf.futex_wake                # 4 readers, 5 rounds x 400 wake-ups
    python -m perf.futex_wake --readers 8 --rounds 3

N forked reader processes park, nothing else (no ring, no frames, no Python codec):

* ``socket``: each blocks in ``recv`` on its own ``AF_UNIX`` socketpair; the writer
  sends one byte on each in turn (ringwire's doorbell);
* ``futex``: each blocks in ``FUTEX_WAIT`` on one 32-bit word of a shared mapping
  while it holds the value it last saw; the writer stores the step number and calls
  ``FUTEX_WAKE`` once for all waiters (one system call).

Each reader writes its clock (``time.perf_counter_ns``, CLOCK_MONOTONIC) into the
shared mapping as soon as it runs; the writer reads the clock before its wake call(s)
and after them, then sleeps 1.2-1.8 ms (so the readers run without it on a core, and
park again) before collecting the stamps.  Figures: the last reader's wake-up after the
writer's first clock (p50, p99) and the writer's time inside its wake call(s), per
round, the two kinds interleaved with the first one alternating.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import platform
import random
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf._common import format_table, machine_info

clock = time.perf_counter_ns
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
FUTEX_WAIT, FUTEX_WAKE = 0, 1
STAMPS = 64  # offset of the readers' stamps (8 bytes each) in the mapping


def _futex(libc: ctypes.CDLL, addr: int, op: int, val: int) -> int:
    return int(libc.syscall(SYS_FUTEX, ctypes.c_void_p(addr), op, val, None, None, 0))


def _reader(r: int, kind: str, shm: mmap.mmap, word: int, sock: socket.socket, n: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    seen = 0
    while seen < n:
        if kind == "futex":
            while (cur := struct.unpack_from("I", shm, 0)[0]) == seen:
                _futex(libc, word, FUTEX_WAIT, seen)
            seen = cur
        else:
            if not sock.recv(1):
                return
            seen += 1
        struct.pack_into("q", shm, STAMPS + 8 * r, clock())


def run_round(
    kind: str, n_readers: int, steps: int, rng: random.Random
) -> tuple[list[int], list[int]]:
    """(last reader's wake-up ns, writer's wake-call ns) for each step after 20."""
    libc = ctypes.CDLL(None, use_errno=True)
    shm = mmap.mmap(-1, 4096)
    word = ctypes.addressof(ctypes.c_char.from_buffer(shm))
    pairs = [socket.socketpair() for _ in range(n_readers)]
    pids = []
    for r in range(n_readers):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 0
            try:
                _reader(r, kind, shm, word, pairs[r][1], steps)
            except BaseException:
                code = 1
            os._exit(code)
        pids.append(pid)
    last, cost = [], []
    try:
        time.sleep(0.3)
        for k in range(1, steps + 1):
            shm[STAMPS : STAMPS + 8 * n_readers] = bytes(8 * n_readers)
            t0 = clock()
            if kind == "futex":
                struct.pack_into("I", shm, 0, k)
                _futex(libc, word, FUTEX_WAKE, 0x7FFFFFFF)
            else:
                for a, _ in pairs:
                    a.send(b"\0")
            t1 = clock()
            time.sleep(0.0012 * (1 + rng.random() / 2))
            deadline = time.monotonic() + 10
            while not all(stamps := struct.unpack_from(f"{n_readers}q", shm, STAMPS)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{kind}: a reader did not wake for step {k}")
                time.sleep(0.0005)
            if k > 20:
                last.append(max(stamps) - t0)
                cost.append(t1 - t0)
    finally:
        for a, b in pairs:
            a.close()
            b.close()
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            if status:
                raise RuntimeError(f"{kind}: a reader failed (status {status})")
        shm.close()
    return last, cost


def _pct(v: list[int], q: float) -> float:
    s = sorted(v)
    return s[max(0, min(len(s) - 1, int(q * len(s)) - 1))] / 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args(argv)
    if SYS_FUTEX is None or sys.platform != "linux":
        print(f"perf.futex_wake: Linux x86_64/aarch64 only (this is {platform.machine()})")
        return 2
    rng = random.Random(1)
    per: dict[str, list[tuple[float, float, float]]] = {"socket": [], "futex": []}
    for r in range(args.rounds):
        for kind in ("socket", "futex") if r % 2 == 0 else ("futex", "socket"):
            last, cost = run_round(kind, args.readers, args.steps, rng)
            per[kind].append((_pct(last, 0.5), _pct(last, 0.99), _pct(cost, 0.5)))
    rows = []
    for kind, vals in per.items():
        rows.append(
            [
                f"{args.readers} × doorbell byte" if kind == "socket" else "one FUTEX_WAKE",
                f"{statistics.median(v[0] for v in vals):.1f}",
                f"{statistics.median(v[1] for v in vals):.1f}",
                f"{statistics.median(v[2] for v in vals):.1f}",
                " ".join(f"{v[0]:.0f}" for v in vals),
            ]
        )
    s50 = statistics.median(v[0] for v in per["socket"])
    f50 = statistics.median(v[0] for v in per["futex"])
    info = machine_info()
    print(
        f"Waking {args.readers} parked reader processes, {args.rounds} rounds x "
        f"{args.steps}; medians over rounds. CPU: {info['cpu']}, {info['cpus_usable']} "
        f"usable cores."
    )
    print()
    print(
        format_table(
            [
                "wake-up",
                "last reader p50 µs",
                "last reader p99 µs",
                "writer's wake call p50 µs",
                "p50 per round",
            ],
            rows,
            "lrrrl",
        )
    )
    print(f"\nfutex ÷ doorbells, last reader p50: {f50 / s50:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
