"""CUDA tensors by reference (Ext 5) across processes, on CPU: the simulated backend of
``support/cuda_fake.py`` in both processes (tests/unit/test_cuda.py has the protocol in
one process; tests/process/test_cuda_gpu.py runs on real CUDA where a GPU exists).

The simulated backend keeps torch's reference counters and its limbo, event lifetimes
and device UUIDs across processes (in memfds), so these tests check what only shows
between processes: a reader of an earlier connection, a killed reader, a reader
without CUDA, a reader that reads after the producer closed, other device numbers."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from support.cuda import (
    GPU,
    cuda_in_use,
    fake_fixture,  # noqa: F401  (the fixture `fake`)
    until,
)
from support.cuda_fake import default_uuid, install
from support.extras import torch  # not None: support.cuda_fake skips this module without it
from support.slots import apair
from support.spawn import SPAWN, spawned

from ringwire._conn.pair import PairEnd, pair
from ringwire._errors import DecodeError
from ringwire._pool.cuda import drop_idle_pools, set_cuda_backend

from anyio import BrokenResourceError  # isort: skip

pytestmark = pytest.mark.multiprocess  # every test here starts a process


async def get(q: Any, timeout: float = 30) -> Any:
    return await anyio.to_thread.run_sync(q.get, True, timeout)


@contextlib.contextmanager
def queues(n: int) -> Iterator[list[Any]]:
    """``n`` spawn-context queues, closed however the test ends (a queue left open
    would have its semaphore unlinked by the leak guard, failing the next test)."""
    qs = [SPAWN.Queue() for _ in range(n)]
    try:
        yield qs
    finally:
        for q in qs:
            q.close()
            q.join_thread()


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
    """Its slots come back at once; and (defect 2) its mapping's counter, which its
    deleter never decremented, is released: the dropped block is freed, not left in
    torch's limbo until this process exits."""
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
    assert drop_idle_pools() == 1
    assert not fake.limbo, "a killed reader's block waits in torch's limbo until exit"
    assert fake.blocks_freed == 1 and fake.counters_released == 1


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
    with queues(1) as (out,), spawned(child_consume_cuda, b, 6, out):

        async def main() -> Any:
            async with await a.connect(slots=GPU) as ch:
                for i in range(6):
                    await ch.send(fake.tensor(torch.full((8192,), float(i), dtype=torch.bfloat16)))
                await until(lambda: cuda_in_use(ch) == 0)
                await ch.send("bye")
                return await get(out)

        ok, opens, event_opens, waits, synced = anyio.run(main)
    assert ok and opens == 1 and waits == 6 and synced == 6
    assert event_opens <= 3  # one per slot used (the pool has 3), cached after that
    # the child unmapped cleanly (its deleter subtracted), then closed: nothing lingers
    assert drop_idle_pools() == 1 and not fake.limbo


# ======================================================================================
# the defects of issue 13, each across processes


def child_two_connections(first: PairEnd, second: PairEnd, out: Any, cmd: Any) -> None:
    install()
    with first.connect_sync(slots=GPU) as ch:
        t = ch.receive(timeout=20)
        ok = torch.equal(t, torch.ones(8192))
        del t
        gc.collect()
        ch.receive(timeout=20)  # "bye": the producer has seen the release
    out.put(("closed", ok))  # this connection and its mapping are gone
    with second.connect_sync(slots=GPU) as ch:
        y = ch.receive(timeout=20)
        out.put(("holding", torch.equal(y, torch.full((8192,), 2.0))))
        cmd.get(timeout=30)  # the producer closed, and sent other tensors elsewhere
        out.put(("intact", torch.equal(y, torch.full((8192,), 2.0)), float(y[0])))
        del y


@pytest.mark.multiprocess
def test_a_reused_block_keeps_an_earlier_connections_reader_intact(fake) -> None:
    """Defect 1: a block given to a second connection was announced with the first
    export's reference counter, which the first reader had already brought to 0; so
    when the producer closed the second connection while its reader still held a
    view, the block was freed at once -- and handed out again, under that view."""
    a1, b1 = pair()
    a2, b2 = pair()
    with queues(2) as (out, cmd), spawned(child_two_connections, b1, b2, out, cmd):

        async def main() -> Any:
            async with await a1.connect(slots=GPU) as ch:
                await ch.send(fake.tensor(torch.ones(8192)))
                await until(lambda: cuda_in_use(ch) == 0, 20)  # noqa: B023
                await ch.send("bye")
                assert await get(out) == ("closed", True)
            ch = await a2.connect(slots=GPU)
            await ch.send(fake.tensor(torch.full((8192,), 2.0)))
            assert await get(out) == ("holding", True)
            assert fake.pools_allocated == 1  # the first connection's block, reused
            await ch.aclose()  # while the reader still holds its view
            c, d = await apair(GPU, GPU)  # the producer's next tensors, elsewhere
            async with c, d:
                for _ in range(3):
                    await c.send(fake.tensor(torch.full((8192,), 7.0)))
                    assert torch.equal(await d.receive(), torch.full((8192,), 7.0))
            cmd.put("check")
            return await get(out)

        got = anyio.run(main)
    assert got[:2] == ("intact", True), f"the reader's view now reads {got[2]}"
    assert drop_idle_pools() == 2 and not fake.limbo  # settled once the reader closed


def child_without_cuda(end: PairEnd, out: Any) -> None:
    set_cuda_backend(None, probe=False)  # this process has no CUDA, whatever the machine
    with end.connect_sync(slots=GPU) as ch:
        try:
            ch.receive(timeout=20)
            out.put("not refused")
        except DecodeError as exc:
            out.put(f"refused: {exc}")
        ch.receive(timeout=20)  # "bye"


@pytest.mark.multiprocess
def test_a_reader_that_never_opens_the_pool_leaves_no_block_in_limbo(fake) -> None:
    """Defect 2: a reader without CUDA refuses the Ext 5 and never opens the pool, so
    nothing decrements the export's counter; ringwire releases it itself."""
    a, b = pair()
    with queues(1) as (out,), spawned(child_without_cuda, b, out):

        async def main() -> Any:
            async with await a.connect(slots=GPU) as ch:
                await ch.send(fake.tensor(torch.ones(8192)))
                got = await get(out)
                await until(lambda: cuda_in_use(ch) == 0)  # refused, and given back
                await ch.send("bye")
                return got

        got = anyio.run(main)
    assert got.startswith("refused") and "no CUDA" in got, got
    assert drop_idle_pools() == 1
    assert not fake.limbo, "the never-opened block waits in torch's limbo until exit"
    assert fake.counters_released == 1


def child_reads_late(end: PairEnd, out: Any, cmd: Any) -> None:
    install()
    with end.connect_sync(slots=GPU) as ch:
        cmd.get(timeout=30)  # the producer has closed
        try:
            got = [ch.receive(timeout=20) for _ in range(3)]
            out.put([torch.equal(t, torch.full((8192,), float(i))) for i, t in enumerate(got)])
        except Exception as exc:
            out.put(repr(exc))


@pytest.mark.multiprocess
def test_a_reader_gets_the_cuda_records_sent_right_before_the_producer_closed(fake) -> None:
    """Defect 3: ``close`` dropped the pool's events while records were in flight; the
    reader then used events their exporter had destroyed (undefined behaviour in CUDA,
    an error in the simulated backend)."""
    a, b = pair()
    with queues(2) as (out, cmd), spawned(child_reads_late, b, out, cmd):

        async def main() -> Any:
            async with await a.connect(slots=GPU) as ch:
                for i in range(3):
                    await ch.send(fake.tensor(torch.full((8192,), float(i))))
            gc.collect()  # whatever close dropped is gone now (as CUDA objects die at once)
            cmd.put("closed")
            return await get(out)

        got = anyio.run(main)
    assert got == [True, True, True], got
    assert drop_idle_pools() == 1 and not fake.limbo  # settled once the reader closed


def child_other_devices(end: PairEnd, out: Any) -> None:
    # as with another CUDA_VISIBLE_DEVICES: the producer's cuda:1 is our cuda:0, and
    # its cuda:0 is not visible here
    fake = install(2, uuids=[default_uuid(1), default_uuid(2)])
    with end.connect_sync(slots=GPU) as ch:
        t = ch.receive(timeout=20)
        out.put(("mapped", fake.device_index(t), torch.equal(t, torch.ones(8192))))
        del t
        try:
            ch.receive(timeout=20)
            out.put(("not refused",))
        except DecodeError as exc:
            out.put(("refused", str(exc)))
        ch.receive(timeout=20)  # "bye"


@pytest.mark.multiprocess
def test_device_numbers_are_mapped_by_uuid_across_processes(fake) -> None:
    """Defect 5: the reader used the producer's device number as its own."""
    two = install(2)  # cuda:0 and cuda:1, uuids fake-gpu-00 and -01
    a, b = pair()
    with queues(1) as (out,), spawned(child_other_devices, b, out):

        async def main() -> Any:
            async with await a.connect(slots=GPU) as ch:
                await ch.send(two.tensor(torch.ones(8192), device=1))
                mapped = await get(out)
                await ch.send(two.tensor(torch.ones(8192), device=0))
                refused = await get(out)
                await until(lambda: cuda_in_use(ch) == 0)  # both came back
                await ch.send("bye")
                return mapped, refused

        mapped, refused = anyio.run(main)
    assert mapped == ("mapped", 0, True), mapped
    assert refused[0] == "refused" and "does not see" in refused[1], refused
    assert drop_idle_pools() == 2 and not two.limbo
