"""CUDA tensors by reference (Ext 5) on a real GPU, across processes.

Skipped where CUDA is absent (CI).  ``perf/gpu_check.sh`` runs this file and the GPU
benchmark in one go on a machine with a GPU.  The same protocol runs on CPU in
``test_cuda.py`` through a simulated backend.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import anyio
import pytest
import torch

from ringwire._conn.pair import PairEnd, pair
from ringwire._shm.cuda import drop_idle_pools
from ringwire._shm.slotconfig import SlotConfig
from ringwire._wire.slotlayout import SlotClass

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.timeout(400),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SPAWN = mp.get_context("spawn")
MiB = 1 << 20
GPU = SlotConfig(
    cuda_threshold=4096,
    cuda_classes=(SlotClass(1 * MiB, 4), SlotClass(64 * MiB, 2)),
)
DTYPES = ["float32", "bfloat16", "float16", "int64", "uint8", "bool"]


def _consumer(end: PairEnd, mode: str, out: Any) -> None:
    """Runs in a spawned process: receives, checks on the GPU, reports to ``out``."""
    try:
        with end.connect_sync(slots=GPU) as ch:
            if mode == "dtypes":
                for _ in DTYPES:
                    rec = ch.receive(timeout=60)
                    t = rec["x"]
                    ok = t.is_cuda and torch.equal(t.cpu(), rec["expect"])
                    out.put((str(t.dtype), str(t.device), bool(ok)))
                    del t, rec
                out.put(("opened", ch.statistics().cuda_pools_opened))
            elif mode == "ordering":
                rec = ch.receive(timeout=60)
                t = rec["x"]
                # no synchronize here: the stream wait on the producer's event orders it
                out.put(("min", float(t.min().item()), "max", float(t.max().item())))
                del t, rec
            elif mode == "release_after_kernel":
                t = ch.receive(timeout=60)
                torch.cuda._sleep(int(2e9))  # a long kernel on the current stream ...
                t.add_(1)  # ... then one that uses the slot
                out.put("enqueued")
                del t  # the release must wait for both kernels
                gc.collect()
                ch.receive(timeout=60)  # "done" from the producer
            elif mode == "hold":
                held = [ch.receive(timeout=60) for _ in range(3)]
                out.put("holding")
                time.sleep(120)
                del held
            out.put("bye")
    except BaseException as exc:  # report, do not hang the parent
        out.put(("error", repr(exc)))
        raise


async def _produce_dtypes(a: PairEnd, out: Any, consumer_pid: int) -> list[Any]:
    async with await a.connect(slots=GPU) as ch:
        for name in DTYPES:
            dtype = getattr(torch, name)
            cpu = (torch.arange(256 * 1024) % 7).to(dtype)
            await ch.send({"x": cpu.cuda(), "expect": cpu})
        got = [await anyio.to_thread.run_sync(out.get, True, 120) for _ in DTYPES]
        got.append(await anyio.to_thread.run_sync(out.get, True, 60))
        stats = ch.statistics()
        assert stats.cuda_pools == [0]
        return got


async def _produce_ordering(a: PairEnd, out: Any, consumer_pid: int) -> Any:
    async with await a.connect(slots=GPU) as ch:
        x = await ch.loan((16 * MiB // 4,), torch.float32, device="cuda:0")
        x.fill_(1.0)
        torch.cuda._sleep(int(1e9))  # keeps the stream busy for a while ...
        x.fill_(42.0)  # ... and the final value is written after it
        await ch.send({"x": x})  # no synchronize: the event carries the order
        del x
        return await anyio.to_thread.run_sync(out.get, True, 120)


async def _produce_release(a: PairEnd, out: Any, consumer_pid: int) -> Any:
    async with await a.connect(slots=GPU) as ch:
        await ch.send(torch.zeros(MiB // 4, device="cuda:0"))
        assert await anyio.to_thread.run_sync(out.get, True, 120) == "enqueued"
        t0 = time.perf_counter()
        await anyio.sleep(0.05)
        early = ch.statistics().cuda_slots_in_use  # the consumer's kernels still run
        with anyio.fail_after(60):
            while ch.statistics().cuda_slots_in_use:
                await anyio.sleep(0.005)
        waited = time.perf_counter() - t0
        await ch.send("done")
        return early, waited


async def _produce_kill(a: PairEnd, out: Any, consumer_pid: int) -> Any:
    async with await a.connect(slots=GPU, spin_us=0) as ch:
        for i in range(3):
            await ch.send(torch.full((MiB // 4,), float(i), device="cuda:0"))
        assert await anyio.to_thread.run_sync(out.get, True, 120) == "holding"
        assert ch.statistics().cuda_slots_in_use == 3
        killed = time.perf_counter()
        os.kill(consumer_pid, signal.SIGKILL)
        with pytest.raises(anyio.BrokenResourceError):
            with anyio.fail_after(10):
                await ch.receive()
        with anyio.fail_after(5):
            while ch.statistics().cuda_slots_in_use:
                await anyio.sleep(0.001)
        return time.perf_counter() - killed, ch.statistics().slots_reclaimed


PRODUCERS = {
    f.__name__: f for f in (_produce_dtypes, _produce_ordering, _produce_release, _produce_kill)
}


def _producer_main(name: str, end: PairEnd, out: Any, result: Any, consumer_pid: int) -> None:
    """Runs in a spawned process too: the process that exports CUDA memory keeps
    torch's IPC ref-counter file in /dev/shm while it lives, so the test process
    itself never exports."""
    try:
        result.put(("ok", anyio.run(PRODUCERS[name], end, out, consumer_pid)))
    except BaseException as exc:
        result.put(("error", repr(exc)))
    finally:
        drop_idle_pools()


def _run(mode: str, producer: str) -> Any:
    a, b = pair()
    out, result = SPAWN.Queue(), SPAWN.Queue()
    cons = SPAWN.Process(target=_consumer, args=(b, mode, out), daemon=True)
    cons.start()
    prod = SPAWN.Process(
        target=_producer_main, args=(producer, a, out, result, cons.pid), daemon=True
    )
    prod.start()
    try:
        status, value = result.get(timeout=300)
    finally:
        for p in (prod, cons):
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        for q in (out, result):
            q.close()
            q.join_thread()
    assert status == "ok", value
    return value


def test_two_processes_exchange_cuda_tensors_of_several_dtypes() -> None:
    got = _run("dtypes", "_produce_dtypes")
    assert [g[0] for g in got[:-1]] == [f"torch.{d}" for d in DTYPES]
    assert all(g[1] == "cuda:0" and g[2] for g in got[:-1]), got
    assert got[-1] == ("opened", 1)  # the handle was opened once for six tensors


def test_stream_ordering_under_a_long_producer_kernel() -> None:
    got = _run("ordering", "_produce_ordering")
    assert got == ("min", 42.0, "max", 42.0)


def test_release_waits_for_the_consumers_kernels() -> None:
    early, waited = _run("release_after_kernel", "_produce_release")
    assert early == 1
    assert waited > 0.1, waited  # released only once the long kernel had finished


def test_consumer_kill_with_slots_in_flight_returns_them() -> None:
    took, reclaimed = _run("hold", "_produce_kill")
    assert reclaimed == 3 and took < 1.0, (took, reclaimed)
