"""Helpers of the broadcast tests (tests/unit/test_broadcast*.py, tests/process/
test_broadcast.py): a short socket path, a small slot pool, records, and the reader
processes the process tests spawn (importable by name: spawn passes sys.path on)."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import ringwire
from ringwire._pool.slotconfig import SlotConfig
from ringwire._wire.slotlayout import SlotClass
from support.spawn import SPAWN

SLOTS = SlotConfig(classes=(SlotClass(64 * 1024, 6),), threshold=4096, wait_timeout=None)
SMALL = 4096  # a small ring: wraparound and backpressure


@pytest.fixture(name="bpath")
def bpath_fixture() -> Iterator[str]:
    """A Unix socket path short enough for sun_path, in the session's TMPDIR (the leak
    guard looks there for socket files left behind)."""
    d = tempfile.mkdtemp(prefix="ringwire-b", dir=tempfile.gettempdir())
    try:
        yield os.path.join(d, "b.sock")
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Step(ringwire.Record):
    seq: int
    note: str = ""


def step(seq: int, array_bytes: int = 0) -> Any:
    """Record ``seq``: a Step, or (``array_bytes``) a dict with an array of that size."""
    if not array_bytes:
        return Step(seq=seq, note=f"step {seq}")
    return {"seq": seq, "a": np.full(array_bytes // 8, seq, dtype=np.int64)}


def digest(rec: Any) -> tuple[int, int]:
    """``(seq, crc)`` of a received record, checking its array if it has one."""
    if isinstance(rec, dict):
        a = rec["a"]
        assert (a == rec["seq"]).all(), f"array of record {rec['seq']} is wrong"
        return rec["seq"], zlib.crc32(a.tobytes())
    if isinstance(rec, Step):
        return rec.seq, zlib.crc32(rec.note.encode())
    _, seq, note = rec  # a Step decoded without its type: [extras, seq, note]
    return seq, zlib.crc32(note.encode())


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# -- reader processes -------------------------------------------------------------------


def reader_main(path: str, q: Any, backend: str, opts: dict[str, Any]) -> None:
    """A reader process: join, say ``("ready", rank, pid, start)``, read every record
    (checking it), then say how it ended: ``("end", rank, kind, digests, detail)``.

    ``opts``: ``rank``, ``hold`` (keep every received record alive until the record
    ``step(-1)`` arrives; then say ``("released", rank)``), ``stall_after`` (stop
    reading after that many records, for ``stall`` s), ``spin_us``, ``subscribe``
    (more keyword arguments of the subscribe: a remote reader's ``capacity``...)."""
    rank = opts.get("rank")
    more = opts.get("subscribe", {})
    hold = opts.get("hold", False)
    stall_after = opts.get("stall_after")
    got: list[tuple[int, int]] = []
    kept: list[Any] = []

    def finish(sub: Any, kind: str, detail: str = "") -> None:
        q.put(("end", sub.rank, kind, got, detail))

    if backend == "sync":
        with ringwire.subscribe_sync(
            path, rank=rank, spin_us=opts.get("spin_us", 0), **more
        ) as sub:
            q.put(("ready", sub.rank, os.getpid(), sub.start))
            try:
                while True:
                    rec = sub.receive(timeout=60)
                    seq = digest(rec)[0]
                    if seq == -1:
                        kept.clear()
                        q.put(("released", sub.rank))
                        continue
                    got.append(digest(rec))
                    if hold:
                        kept.append(rec)
                    del rec
                    if stall_after is not None and len(got) == stall_after:
                        time.sleep(opts.get("stall", 60))
            except ringwire.EndOfStream:
                finish(sub, "eos")
            except ringwire.BrokenResourceError as exc:
                finish(sub, "broken", str(exc))
        return

    async def main() -> None:
        sub = await ringwire.subscribe(path, rank=rank, spin_us=opts.get("spin_us", 0), **more)
        async with sub:
            q.put(("ready", sub.rank, os.getpid(), sub.start))
            try:
                while True:
                    rec = await sub.receive()
                    seq = digest(rec)[0]
                    if seq == -1:
                        kept.clear()
                        q.put(("released", sub.rank))
                        continue
                    got.append(digest(rec))
                    if hold:
                        kept.append(rec)
                    del rec
                    if stall_after is not None and len(got) == stall_after:
                        await anyio.sleep(opts.get("stall", 60))
            except ringwire.EndOfStream:
                finish(sub, "eos")
            except ringwire.BrokenResourceError as exc:
                finish(sub, "broken", str(exc))

    anyio.run(main, backend=backend)


def idle_reader_main(path: str, q: Any, backend: str, seconds: float) -> None:
    """Join, then report this process's CPU over ``seconds`` of receiving whatever comes
    (parked in between): ``("cpu", rank, cpu_s, wall_s, records)``; then leave."""
    n = 0

    if backend == "sync":
        with ringwire.subscribe_sync(path) as sub:
            q.put(("ready", sub.rank, os.getpid(), sub.start))
            sub.receive(timeout=60)  # the go record
            c0, t0 = cpu_seconds(), time.monotonic()
            try:
                while time.monotonic() - t0 < seconds:
                    sub.receive(timeout=max(0.001, seconds - (time.monotonic() - t0)))
                    n += 1
            except TimeoutError:
                pass
            q.put(("cpu", sub.rank, cpu_seconds() - c0, time.monotonic() - t0, n))
        return

    async def main() -> None:
        nonlocal n
        async with await ringwire.subscribe(path) as sub:
            q.put(("ready", sub.rank, os.getpid(), sub.start))
            await sub.receive()
            c0, t0 = cpu_seconds(), time.monotonic()
            with anyio.move_on_after(seconds):
                while True:
                    await sub.receive()
                    n += 1
            q.put(("cpu", sub.rank, cpu_seconds() - c0, time.monotonic() - t0, n))

    anyio.run(main, backend=backend)


def writer_main(path: str, inbox: Any, outbox: Any, n: int, array_bytes: int) -> None:
    """A writer process: wait for as many readers as ``inbox`` says, send ``n`` records
    (every tenth with an array), say ``("sent", n)``, then sleep (the test kills it)."""
    with ringwire.broadcast_sync(path, readers=4, capacity=SMALL * 4, slots=SLOTS) as bc:
        bc.wait_ready(int(inbox.get(timeout=30)), timeout=30)
        for i in range(n):
            bc.send(step(i, array_bytes if i % 10 == 0 else 0), timeout=30)
        outbox.put(("sent", n))
        time.sleep(120)


def remote_writer_main(path: str, inbox: Any, outbox: Any, n: int, array_bytes: int) -> None:
    """A writer process serving remote readers too: say ``("tcp", address)``, wait for
    as many readers as ``inbox`` says, send ``n`` records (every tenth and the last with
    an array), say ``("sent", n)`` once every reader released the last, then sleep (the
    test kills it)."""
    with ringwire.broadcast_sync(
        path, readers=4, capacity=SMALL * 4, slots=SLOTS, tcp="tcp://127.0.0.1:0"
    ) as bc:
        outbox.put(("tcp", bc.tcp_address))
        bc.wait_ready(int(inbox.get(timeout=30)), timeout=30)
        for i in range(n - 1):
            bc.send(step(i, array_bytes if i % 10 == 0 else 0), timeout=30)
        # the last one tracked: every reader has read them all when it is released
        bc.send_tracked(step(n - 1, array_bytes), timeout=30).wait(30)
        outbox.put(("sent", n))
        time.sleep(120)


# -- running reader processes (the process tests) --------------------------------------


@contextlib.contextmanager
def readers(target: Any, *args_per_reader: tuple[Any, ...]) -> Iterator[tuple[Any, list[Any]]]:
    """Spawn one process per argument tuple (each gets ``(path, q, *args)`` from the
    caller); one queue for what they say; always reaped and closed."""
    q = SPAWN.Queue()
    procs = [
        SPAWN.Process(target=target, args=(*a[:1], q, *a[1:]), daemon=True) for a in args_per_reader
    ]
    try:
        for p in procs:
            p.start()
        yield q, procs
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        q.close()
        q.join_thread()


def expect(q: Any, kind: str, n: int, timeout: float = 60) -> list[tuple[Any, ...]]:
    """The next ``n`` messages of ``kind`` (others are kept for later)."""
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        msg = q.get(timeout=max(0.1, deadline - time.monotonic()))
        assert msg[0] == kind, msg
        out.append(msg)
    return out


def wait_until(pred: Any, timeout: float = 5.0) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not met in time")
        time.sleep(0.001)
    return time.monotonic() - t0
