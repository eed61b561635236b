"""CUDA tensors by reference (Ext 5) across processes, on CPU: the simulated backend of
``support/cuda_fake.py`` in both processes (tests/unit/test_cuda.py has the protocol in
one process; tests/process/test_cuda_gpu.py runs on real CUDA where a GPU exists)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import anyio
import pytest
import torch
from support.cuda import (
    GPU,
    cuda_in_use,
    fake_fixture,  # noqa: F401  (the fixture `fake`)
    until,
)
from support.cuda_fake import install
from support.spawn import SPAWN, spawned

from ringwire._conn.pair import PairEnd, pair

from anyio import BrokenResourceError  # isort: skip

pytestmark = pytest.mark.multiprocess  # every test here starts a process


# ======================================================================================
# peer death


def child_hold_cuda(end: PairEnd, n: int, ready: Any) -> None:
    install()
    with end.connect_sync(slots=GPU) as ch:
        held = [ch.receive(timeout=20) for _ in range(n)]
        ready.set()
        time.sleep(60)
        del held


@pytest.mark.multiprocess
def test_kill_consumer_with_cuda_slots_in_flight_returns_them(fake) -> None:
    a, b = pair()
    ready = SPAWN.Event()
    with spawned(child_hold_cuda, b, 3, ready) as p:

        async def main() -> None:
            async with await a.connect(slots=GPU, spin_us=0) as ch:
                for i in range(3):
                    await ch.send(fake.tensor(torch.full((8192,), float(i))))
                assert await anyio.to_thread.run_sync(ready.wait, 30)
                assert cuda_in_use(ch) == 3
                killed = time.perf_counter()
                os.kill(p.pid, signal.SIGKILL)
                with pytest.raises(BrokenResourceError):
                    with anyio.fail_after(5):
                        await ch.receive()
                await until(lambda: ch._core.pool.cuda_pools[0].alloc.in_use() == 0)  # type: ignore[union-attr]
                assert time.perf_counter() - killed < 1.0
                stats = ch.statistics()
                assert stats.cuda_slots_in_use == 0 and stats.slots_reclaimed == 3

        anyio.run(main)


def child_consume_cuda(end: PairEnd, n: int, out: Any) -> None:
    fake = install()
    with end.connect_sync(slots=GPU) as ch:
        ok = True
        for i in range(n):
            t = ch.receive(timeout=20)
            ok = ok and torch.equal(t, torch.full((8192,), float(i), dtype=torch.bfloat16))
            del t
        ch.receive(timeout=20)  # "bye": the producer has seen every release
        out.put((ok, fake.pool_opens, fake.event_opens, fake.waits, fake.synchronized))


@pytest.mark.multiprocess
def test_across_processes_the_handle_is_opened_once(fake) -> None:
    a, b = pair()
    out = SPAWN.Queue()
    with spawned(child_consume_cuda, b, 6, out):

        async def main() -> Any:
            async with await a.connect(slots=GPU) as ch:
                for i in range(6):
                    await ch.send(fake.tensor(torch.full((8192,), float(i), dtype=torch.bfloat16)))
                await until(lambda: cuda_in_use(ch) == 0)
                await ch.send("bye")
                return await anyio.to_thread.run_sync(out.get, True, 30)

        ok, opens, event_opens, waits, synced = anyio.run(main)
    out.close()
    out.join_thread()
    assert ok and opens == 1 and waits == 6 and synced == 6
    assert event_opens <= 3  # one per slot used (the pool has 3), cached after that
