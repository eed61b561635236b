"""Tensor slots across processes: peer death, a soak, an interpreter exiting with views."""

from __future__ import annotations

import gc
import heapq
import os
import random
import signal
import time
from typing import Any

import anyio
import numpy as np
import pytest
from support.spawn import SPAWN, spawned

from ringwire._conn.pair import PairEnd, pair
from ringwire._pool.slotconfig import SlotConfig
from ringwire._wire.slotlayout import SlotClass

from anyio import BrokenResourceError  # isort: skip

pytestmark = pytest.mark.multiprocess  # every test here starts a process

KiB, MiB = 1 << 10, 1 << 20


# ======================================================================================
# an interpreter that exits holding views (a script in a subprocess)


def test_interpreter_exit_with_live_views_is_clean(tmp_path):
    """A process that exits holding received views and loans: no crash, no
    BufferError, no traceback."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import numpy as np, threading, ringwire as c\n"
        "a, b = c.pair()\n"
        "out = []\n"
        "t = threading.Thread(target=lambda: out.append(b.connect_sync()))\n"
        "t.start(); ca = a.connect_sync(); t.join(); cb = out[0]\n"
        "ca.send(np.ones(100_000)); x = cb.receive(timeout=5)\n"
        "loan = ca.loan((10,), np.float32)\n"
        "keep = (x, loan, ca, cb)\n"
        "print('ok', flush=True)\n"
    )
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-X", "dev", str(script)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    assert "BufferError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# ======================================================================================
# across processes: peer death, soak


def child_hold(end: PairEnd, n: int, ready: Any) -> None:
    with end.connect_sync(slots=None) as ch:
        held = [ch.receive(timeout=20) for _ in range(n)]
        ready.set()
        time.sleep(60)
        del held


def run_kill_consumer(backend: str, where: str) -> None:
    cfg = SlotConfig(classes=(SlotClass(64 * KiB, 3),), threshold=1024)
    a, b = pair()
    ready = SPAWN.Event()
    with spawned(child_hold, b, 3, ready) as p:

        async def main() -> None:
            async with await a.connect(slots=cfg, spin_us=0) as ch:
                for i in range(3):
                    await ch.send(np.full(4096, i))
                assert await anyio.to_thread.run_sync(ready.wait, 30)
                assert ch._core.pool is not None and ch._core.pool.alloc.in_use() == 3
                killed: list[float] = []
                back: list[float] = []

                async def killer() -> None:
                    await anyio.sleep(0.1)  # parked by now
                    killed.append(time.perf_counter())
                    os.kill(p.pid, signal.SIGKILL)

                async def watch() -> None:
                    while ch._core.pool.alloc.in_use():  # type: ignore[union-attr]
                        await anyio.sleep(0.001)
                    back.append(time.perf_counter())

                async with anyio.create_task_group() as tg:
                    tg.start_soon(killer)
                    tg.start_soon(watch)
                    with pytest.raises(BrokenResourceError):
                        with anyio.fail_after(5):
                            if where == "receive":
                                await ch.receive()
                            else:
                                await ch.send(np.ones(4096))  # parks waiting for a slot
                assert back[0] - killed[0] < 0.1, back[0] - killed[0]
                stats = ch.statistics()
                assert stats.slots_in_use == 0 and stats.slots_reclaimed == 3

        anyio.run(main, backend=backend)


@pytest.mark.multiprocess
def test_kill_consumer_slots_return_within_100ms_parked_in_receive():
    run_kill_consumer("asyncio", "receive")


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_kill_consumer_slots_return_within_100ms_waiting_for_a_slot(backend):
    run_kill_consumer(backend, "slot")


def child_produce_then_hang(end: PairEnd, n: int, ready: Any) -> None:
    cfg = SlotConfig(classes=(SlotClass(64 * KiB, 4), SlotClass(1 * MiB, 2)), threshold=1024)
    with end.connect_sync(slots=cfg) as ch:
        for i in range(n):
            x = ch.loan((128, 64), np.float32)
            x[:] = i
            ch.send({"i": i, "x": x, "copy": np.full(100_000, i, np.int64)})
            del x
        ready.set()
        time.sleep(60)


def mapped_names(pid: int) -> list[str]:
    """Our mappings of segments ``pid`` made: named (``/dev/shm/rw.<pid>.…``) or memory
    files (``/memfd:rw.<pid>.…``)."""
    with open("/proc/self/maps") as f:
        return [line for line in f if f"/rw.{pid}." in line or f"/memfd:rw.{pid}." in line]


@pytest.mark.multiprocess
def test_kill_producer_views_stay_valid_and_memory_goes_with_them():
    a, b = pair()
    ready = SPAWN.Event()
    with spawned(child_produce_then_hang, b, 2, ready) as p:

        async def main() -> None:
            ch = await a.connect(slots=None, spin_us=0)
            got = [await ch.receive(), await ch.receive()]
            assert await anyio.to_thread.run_sync(ready.wait, 30)
            os.kill(p.pid, signal.SIGKILL)
            await anyio.to_thread.run_sync(p.join, 10)
            with pytest.raises(BrokenResourceError):
                with anyio.fail_after(5):
                    await ch.receive()
            for i, rec in enumerate(got):
                assert np.all(rec["x"] == i) and np.all(rec["copy"] == i)
            assert mapped_names(p.pid)  # still mapped: the views are alive
            with pytest.warns(ResourceWarning):
                await ch.aclose()
            assert np.all(got[1]["copy"] == 1)
            got.clear()
            del rec
            gc.collect()
            assert not mapped_names(p.pid)  # the last view took the mapping with it

        anyio.run(main)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"rw.{p.pid}.")]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child_soak_consumer(end: PairEnd, seed: int) -> None:
    rng = random.Random(seed)
    with end.connect_sync(slots=None, spin_us=20) as ch:
        heap: list[tuple[float, int, Any]] = []
        k = 0
        samples = []
        while True:
            rec = ch.receive(timeout=30)
            if isinstance(rec, str):
                break
            now = time.perf_counter()
            k += 1
            assert int(rec[1][0]) == rec[0]
            heapq.heappush(heap, (now + rng.random() * 0.0005, k, rec))
            del rec
            while heap and heap[0][0] <= now:
                heapq.heappop(heap)
            if k in (20_000, 100_000):
                samples.append(rss())
        heap.clear()
        ch.send(samples, timeout=10)
        ch.receive(timeout=30)  # the producer says goodbye


@pytest.mark.multiprocess
def test_soak_100k_tensor_sends_random_hold_times():
    n = 100_000
    cfg = SlotConfig(classes=(SlotClass(4 * KiB, 48), SlotClass(64 * KiB, 8)), threshold=1024)
    a, b = pair()
    with spawned(child_soak_consumer, b, 5) as p:
        with a.connect_sync(slots=cfg, spin_us=20) as ch:
            x = np.zeros(512)
            samples = []
            t0 = time.perf_counter()
            for i in range(n):
                if i % 4 == 3:
                    y = ch.loan((512,), np.float64, timeout=10)
                    y[0] = i
                    ch.send((i, y), timeout=10)
                    del y
                else:
                    x[0] = i
                    ch.send((i, x), timeout=10)
                if i + 1 in (20_000, n):
                    samples.append(rss())
            elapsed = time.perf_counter() - t0
            ch.send("done")
            child_samples = ch.receive(timeout=30)
            deadline = time.monotonic() + 5
            while ch.statistics().slots_in_use and time.monotonic() < deadline:
                time.sleep(0.001)
            stats = ch.statistics()
            assert stats.slots_in_use == 0 and stats.loans_outstanding == 0, stats
            assert stats.releases_received == n
            assert stats.slots_free == {4 * KiB: 48, 64 * KiB: 8}
            ch.send("bye")
        assert samples[1] - samples[0] < 8 * MiB, samples
        assert child_samples[1] - child_samples[0] < 8 * MiB, child_samples
        print(f"soak: {n} sends in {elapsed:.1f} s ({elapsed / n * 1e6:.1f} us each)")
    assert p.exitcode == 0
