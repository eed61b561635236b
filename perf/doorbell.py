"""One question: is an ``eventfd`` doorbell cheaper than today's socket byte?

Run from the repository root::

    python -m perf.doorbell                 # 7 rounds x 4000 round trips per kind
    python -m perf.doorbell --rounds 3 --n 2000

Two processes ping-pong a wake-up, nothing else (no ring, no frames):

* ``sock``: one byte each way over an ``AF_UNIX`` ``SOCK_STREAM`` socketpair, which is
  what ringwire's control socket carries today (``D``/``S`` doorbells);
* ``efd``: a pair of ``eventfd`` s (one per direction) created by the parent and passed
  to the child with ``SCM_RIGHTS`` (``socket.send_fds``/``recv_fds``) over that same
  socketpair; ring is ``eventfd_write(fd, 1)``, wait is ``eventfd_read(fd)``.

Each kind is measured as ``block`` (both sides blocking ``recv``/``eventfd_read``,
the ``SyncWaker`` case), ``efd-poll`` (blocking, but the waiter ``poll`` s the eventfd
*and* the control socket before reading, as a waiter must that still sees peer death
and the ``C``/abort bytes, which stay on the socket) and ``async`` (both sides in an
asyncio loop, the wait is ``loop.add_reader`` on the fd and a future, the
``AsyncWaker`` case).  The child is a
fresh interpreter (``subprocess``), not a fork, so the descriptors really travel over
the socket.  Kinds are interleaved round-robin with the starting kind rotated; the
figure is the median over rounds of the mean round trip in each round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KINDS = ("sock-block", "efd-block", "efd-poll", "sock-async", "efd-async")
_BYTE = b"D"


# --- the ping-pong loops, used by both sides ------------------------------------------


def _block_sock(sock: socket.socket, n: int, first: bool) -> None:
    recv, send = sock.recv, sock.send
    if first:
        for _ in range(n):
            send(_BYTE)
            recv(1)
    else:
        for _ in range(n):
            recv(1)
            send(_BYTE)


def _block_efd(rx: int, tx: int, n: int, first: bool) -> None:
    rd, wr = os.eventfd_read, os.eventfd_write
    if first:
        for _ in range(n):
            wr(tx, 1)
            rd(rx)
    else:
        for _ in range(n):
            rd(rx)
            wr(tx, 1)


def _block_efd_poll(sock: socket.socket, rx: int, tx: int, n: int, first: bool) -> None:
    """A blocking wait that also watches the control socket (liveness): poll, then read."""
    poller = select.poll()
    poller.register(rx, select.POLLIN)
    poller.register(sock.fileno(), select.POLLIN)
    rd, wr, wait = os.eventfd_read, os.eventfd_write, poller.poll
    if first:
        for _ in range(n):
            wr(tx, 1)
            wait()
            rd(rx)
    else:
        for _ in range(n):
            wait()
            rd(rx)
            wr(tx, 1)


async def _async_loop(rx_fd: int, read: object, ring: object, n: int, first: bool) -> None:
    """Await ``rx_fd`` with ``add_reader`` as a parked ringwire waiter does."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] | None = None

    def on_readable() -> None:
        read()  # type: ignore[operator]
        if fut is not None and not fut.done():
            fut.set_result(None)

    loop.add_reader(rx_fd, on_readable)
    try:
        for _ in range(n):
            if first:
                ring()  # type: ignore[operator]
            fut = loop.create_future()
            await fut
            if not first:
                ring()  # type: ignore[operator]
    finally:
        loop.remove_reader(rx_fd)


def _run(kind: str, sock: socket.socket, rx: int, tx: int, n: int, first: bool) -> None:
    if kind == "sock-block":
        _block_sock(sock, n, first)
    elif kind == "efd-block":
        _block_efd(rx, tx, n, first)
    elif kind == "efd-poll":
        _block_efd_poll(sock, rx, tx, n, first)
    elif kind == "sock-async":
        sock.setblocking(False)
        try:
            asyncio.run(
                _async_loop(sock.fileno(), lambda: sock.recv(1), lambda: sock.send(_BYTE), n, first)
            )
        finally:
            sock.setblocking(True)
    elif kind == "efd-async":
        asyncio.run(
            _async_loop(rx, lambda: os.eventfd_read(rx), lambda: os.eventfd_write(tx, 1), n, first)
        )
    else:  # pragma: no cover
        raise ValueError(kind)


# --- child ---------------------------------------------------------------------------


def _child(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    while True:
        msg, fds, _flags, _addr = socket.recv_fds(sock, 64, 2)
        if not msg or msg == b"quit":
            return
        kind, n_s = msg.decode().split()
        rx, tx = (fds[0], fds[1]) if fds else (-1, -1)  # parent sends (to_child, to_parent)
        if fds and kind.endswith("async"):
            os.set_blocking(rx, False)
        sock.send(b"k")
        _run(kind, sock, rx, tx, int(n_s), first=False)
        for f in fds:
            os.close(f)


# --- parent --------------------------------------------------------------------------


def _one(kind: str, sock: socket.socket, n: int) -> float:
    """Mean round trip in µs of one run of ``n`` round trips of ``kind``."""
    fds: list[int] = []
    rx = tx = -1
    if kind.startswith("efd"):
        nb = os.EFD_NONBLOCK if kind.endswith("async") else 0
        to_child, to_parent = os.eventfd(0, os.EFD_CLOEXEC), os.eventfd(0, os.EFD_CLOEXEC | nb)
        fds = [to_child, to_parent]
        rx, tx = to_parent, to_child
    socket.send_fds(sock, [f"{kind} {n}".encode()], fds)
    assert sock.recv(1) == b"k"
    t0 = time.perf_counter_ns()
    _run(kind, sock, rx, tx, n, first=True)
    dt = time.perf_counter_ns() - t0
    for f in fds:
        os.close(f)
    return dt / n / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n", type=int, default=4000, help="round trips per kind per round")
    args = ap.parse_args(argv)

    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        [sys.executable, "-m", "perf.doorbell", "--child", str(child.fileno())],
        pass_fds=[child.fileno()],
        cwd=str(Path(__file__).resolve().parent.parent),
    )
    child.close()
    results: dict[str, list[float]] = {k: [] for k in KINDS}
    try:
        for k in KINDS:  # warm-up
            _one(k, parent, min(args.n, 500))
        for r in range(args.rounds):
            order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
            for k in order:
                results[k].append(_one(k, parent, args.n))
    finally:
        socket.send_fds(parent, [b"quit"], [])
        proc.wait(10)
        parent.close()

    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"load: {os.getloadavg()}  rounds={args.rounds} n={args.n}")
    print("| kind | median round trip (µs) | min | max |")
    print("|---|---|---|---|")
    for k in KINDS:
        print(f"| {k} | {med[k]:.2f} | {min(results[k]):.2f} | {max(results[k]):.2f} |")
    for efd, sock in (
        ("efd-block", "sock-block"),
        ("efd-poll", "sock-block"),
        ("efd-async", "sock-async"),
    ):
        e, s = med[efd], med[sock]
        print(
            f"{efd} / {sock} = {e / s:.3f}  ({(1 - e / s) * 100:+.1f} % saved, {s - e:.2f} µs per round trip)"
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
