"""CUDA tensors by reference (Ext 5) on a real GPU, across processes.

Skipped where CUDA is absent (CI).  ``perf/gpu_check.sh`` runs this file and the GPU
benchmark in one go on a machine with a GPU.  The same protocol runs on CPU in
``tests/unit/test_cuda.py`` and ``tests/process/test_cuda.py`` through a simulated
backend; the four defects of issue 13 that only a GPU shows for real have a test each
here: a reused block under an earlier reader (1), GPU memory after a killed or a
CUDA-less reader (2), records read after the producer closed (3), device numbers
that differ between the processes (5, needs two GPUs).

Every producer runs in a spawned process of its own: the process that exports CUDA
memory keeps torch's IPC ref-counter file in /dev/shm while it lives, so the test
process itself never exports (the leak guard checks /dev/shm after every test).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from support.extras import NO_TORCH, torch

from ringwire._conn.pair import PairEnd, pair
from ringwire._errors import DecodeError
from ringwire._pool.cuda import drop_idle_pools, lingering_pools
from ringwire._pool.slotconfig import SlotConfig
from ringwire._wire.slotlayout import SlotClass

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.timeout(400),
    pytest.mark.skipif(torch is None, reason=NO_TORCH),
    pytest.mark.skipif(
        torch is not None and not torch.cuda.is_available(), reason="needs a CUDA device"
    ),
]

SPAWN = mp.get_context("spawn")
MiB = 1 << 20
GPU = SlotConfig(
    cuda_threshold=4096,
    cuda_classes=(SlotClass(1 * MiB, 4), SlotClass(64 * MiB, 2)),
)
DTYPES = ["float32", "bfloat16", "float16", "int64", "uint8", "bool"]
N = MiB // 4  # float32 elements of a 1 MiB tensor


def _two_gpus() -> bool:
    return torch is not None and torch.cuda.is_available() and torch.cuda.device_count() >= 2


# ======================================================================================
# the consumer (a spawned process)


def _consumer(ends: list[PairEnd], mode: str, out: Any, cmd: Any) -> None:
    """Receives, checks on the GPU, reports to ``out``; ``cmd`` carries the producer's
    go-aheads."""
    try:
        if mode == "reuse":  # defect 1: an earlier connection's reader holds a view
            with ends[0].connect_sync(slots=GPU) as ch:
                t = ch.receive(timeout=60)
                ok = bool(torch.equal(t.cpu(), torch.ones(N)))
                del t
                gc.collect()
                ch.receive(timeout=60)  # "bye": the producer has seen the release
            out.put(("closed", ok))
            with ends[1].connect_sync(slots=GPU) as ch:
                y = ch.receive(timeout=60)
                out.put(("holding", bool(torch.equal(y.cpu(), torch.full((N,), 2.0)))))
                assert cmd.get(timeout=120) == "check"
                torch.cuda.synchronize()
                out.put(("intact", bool(torch.equal(y.cpu(), torch.full((N,), 2.0)))))
                del y
            out.put("bye")
            return
        with ends[0].connect_sync(slots=GPU) as ch:
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
            elif mode == "nocuda":  # spawned with CUDA_VISIBLE_DEVICES=""
                try:
                    ch.receive(timeout=60)
                    out.put("not refused")
                except DecodeError as exc:
                    out.put(f"refused: {exc}")
                ch.receive(timeout=60)  # "bye"
            elif mode == "late":  # defect 3: reads only once the producer has closed
                assert cmd.get(timeout=120) == "closed"
                got = [ch.receive(timeout=60) for _ in range(3)]
                out.put([bool(torch.equal(t.cpu(), torch.full((N,), float(i)))) for i, t in enumerate(got)])
                del got
            elif mode == "devices":  # spawned with the devices in the other order
                report = []
                for expect in (1.0, 0.0):
                    t = ch.receive(timeout=60)
                    report.append((t.device.index, bool(torch.equal(t.cpu(), torch.full((N,), expect)))))
                    del t
                out.put(report)
                ch.receive(timeout=60)  # "bye"
        out.put("bye")
    except BaseException as exc:  # report, do not hang the parent
        out.put(("error", repr(exc)))
        raise


# ======================================================================================
# the producers (each in a spawned process)


async def _produce_dtypes(a: list[PairEnd], out: Any, cmd: Any, consumer_pid: int) -> list[Any]:
    async with await a[0].connect(slots=GPU) as ch:
        for name in DTYPES:
            dtype = getattr(torch, name)
            cpu = (torch.arange(256 * 1024) % 7).to(dtype)
            await ch.send({"x": cpu.cuda(), "expect": cpu})
        got = [await anyio.to_thread.run_sync(out.get, True, 120) for _ in DTYPES]
        got.append(await anyio.to_thread.run_sync(out.get, True, 60))
        stats = ch.statistics()
        assert stats.cuda_pools == [0]
        return got


async def _produce_ordering(a: list[PairEnd], out: Any, cmd: Any, consumer_pid: int) -> Any:
    async with await a[0].connect(slots=GPU) as ch:
        x = await ch.loan((16 * MiB // 4,), torch.float32, device="cuda:0")
        x.fill_(1.0)
        torch.cuda._sleep(int(1e9))  # keeps the stream busy for a while ...
        x.fill_(42.0)  # ... and the final value is written after it
        await ch.send({"x": x})  # no synchronize: the event carries the order
        del x
        return await anyio.to_thread.run_sync(out.get, True, 120)


async def _produce_release(a: list[PairEnd], out: Any, cmd: Any, consumer_pid: int) -> Any:
    async with await a[0].connect(slots=GPU) as ch:
        await ch.send(torch.zeros(N, device="cuda:0"))
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


def _allocated() -> int:
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    return int(torch.cuda.memory_allocated(0))


async def _produce_kill(a: list[PairEnd], out: Any, cmd: Any, consumer_pid: int) -> Any:
    torch.ones(1, device="cuda:0")  # CUDA initialised before the baseline
    before = _allocated()
    async with await a[0].connect(slots=GPU, spin_us=0) as ch:
        for i in range(3):
            await ch.send(torch.full((N,), float(i), device="cuda:0"))
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
        took, reclaimed = time.perf_counter() - killed, ch.statistics().slots_reclaimed
    gc.collect()
    freed = drop_idle_pools()
    return took, reclaimed, freed, before, _allocated()


async def _produce_nocuda(a: list[PairEnd], out: Any, cmd: Any, consumer_pid: int) -> Any:
    torch.ones(1, device="cuda:0")
    before = _allocated()
    async with await a[0].connect(slots=GPU) as ch:
        await ch.send(torch.ones(N, device="cuda:0"))
        got = await anyio.to_thread.run_sync(out.get, True, 120)
        with anyio.fail_after(30):
            while ch.statistics().cuda_slots_in_use:  # refused, and given back
                await anyio.sleep(0.005)
        await ch.send("bye")
    gc.collect()
    freed = drop_idle_pools()
    return got, freed, before, _allocated()


async def _produce_reuse(a: list[PairEnd], out: Any, cmd: Any, consumer_pid: int) -> Any:
    async def get() -> Any:
        return await anyio.to_thread.run_sync(out.get, True, 120)

    async with await a[0].connect(slots=GPU) as ch:
        await ch.send(torch.ones(N, device="cuda:0"))
        with anyio.fail_after(60):
            while ch.statistics().cuda_slots_in_use:
                await anyio.sleep(0.005)
        await ch.send("bye")
        assert await get() == ("closed", True)
    ch = await a[1].connect(slots=GPU)
    await ch.send(torch.full((N,), 2.0, device="cuda:0"))
    assert await get() == ("holding", True)
    exports = ch._core.pool.cuda_pools[0].block.exports  # type: ignore[union-attr]
    await ch.aclose()  # while the reader holds its view
    lingering = lingering_pools()
    # the producer's next allocations: were the block freed, they would land in it
    junk = [torch.full((4 * MiB // 4,), 7.0, device="cuda:0") for _ in range(64)]
    torch.cuda.synchronize()
    cmd.put("check")
    intact = await get()
    del junk
    assert await get() == "bye"
    return exports, lingering, intact


async def _produce_late(a: list[PairEnd], out: Any, cmd: Any, consumer_pid: int) -> Any:
    torch.ones(1, device="cuda:0")
    before = _allocated()
    async with await a[0].connect(slots=GPU) as ch:
        for i in range(3):
            torch.cuda._sleep(int(2e8))  # the copies are still queued when we close
            await ch.send(torch.full((N,), float(i), device="cuda:0"))
    gc.collect()
    cmd.put("closed")
    got = await anyio.to_thread.run_sync(out.get, True, 120)
    assert await anyio.to_thread.run_sync(out.get, True, 60) == "bye"
    with anyio.fail_after(10):
        while lingering_pools():  # settled once the reader closed and unmapped
            drop_idle_pools()
            await anyio.sleep(0.01)
    drop_idle_pools()
    return got, before, _allocated()


async def _produce_devices(a: list[PairEnd], out: Any, cmd: Any, consumer_pid: int) -> Any:
    async with await a[0].connect(slots=GPU) as ch:
        await ch.send(torch.full((N,), 1.0, device="cuda:1"))
        await ch.send(torch.full((N,), 0.0, device="cuda:0"))
        got = await anyio.to_thread.run_sync(out.get, True, 120)
        await ch.send("bye")
        return got


PRODUCERS = {
    f.__name__: f
    for f in (
        _produce_dtypes,
        _produce_ordering,
        _produce_release,
        _produce_kill,
        _produce_nocuda,
        _produce_reuse,
        _produce_late,
        _produce_devices,
    )
}


def _producer_main(
    name: str, ends: list[PairEnd], out: Any, cmd: Any, result: Any, consumer_pid: int
) -> None:
    try:
        result.put(("ok", anyio.run(PRODUCERS[name], ends, out, cmd, consumer_pid)))
    except BaseException as exc:
        result.put(("error", repr(exc)))
    finally:
        drop_idle_pools()


@contextlib.contextmanager
def _env(changes: dict[str, str] | None) -> Iterator[None]:
    """``os.environ`` with ``changes`` while a child is spawned (it copies it)."""
    saved = {k: os.environ.get(k) for k in changes or {}}
    os.environ.update(changes or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run(mode: str, producer: str, *, pairs: int = 1, consumer_env: dict[str, str] | None = None) -> Any:
    ends = [pair() for _ in range(pairs)]
    a, b = [e[0] for e in ends], [e[1] for e in ends]
    out, cmd, result = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Queue()
    cons = SPAWN.Process(target=_consumer, args=(b, mode, out, cmd), daemon=True)
    with _env(consumer_env):
        cons.start()
    prod = SPAWN.Process(
        target=_producer_main, args=(producer, a, out, cmd, result, cons.pid), daemon=True
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
        for q in (out, cmd, result):
            q.close()
            q.join_thread()
    assert status == "ok", value
    return value


# ======================================================================================
# the tests


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


def test_consumer_kill_with_slots_in_flight_returns_them_and_frees_the_block() -> None:
    """Defect 2: the killed reader's deleter never ran; the block must not stay in
    torch's limbo (GPU memory back to where it was)."""
    took, reclaimed, freed, before, after = _run("hold", "_produce_kill")
    assert reclaimed == 3 and took < 1.0, (took, reclaimed)
    assert freed == 1 and after == before, (freed, before, after)


def test_a_reader_without_cuda_leaves_no_gpu_memory_behind() -> None:
    """Defect 2: a reader that never opens the pool never decrements its counter."""
    got, freed, before, after = _run(
        "nocuda", "_produce_nocuda", consumer_env={"CUDA_VISIBLE_DEVICES": ""}
    )
    assert got.startswith("refused") and "no CUDA" in got, got
    assert freed == 1 and after == before, (freed, before, after)


def test_a_reused_block_keeps_an_earlier_connections_reader_intact() -> None:
    """Defect 1: the second connection's export has a counter of its own, and the
    block is neither freed nor reused while its reader holds a view."""
    exports, lingering, intact = _run("reuse", "_produce_reuse", pairs=2)
    assert exports == 2  # the first connection's block, exported again
    assert lingering == 1  # kept for the reader after the producer closed
    assert intact == ("intact", True), intact


def test_a_reader_gets_the_cuda_records_sent_right_before_the_producer_closed() -> None:
    """Defect 3: memory and events stay until the reader has read and let go."""
    got, before, after = _run("late", "_produce_late")
    assert got == [True, True, True], got
    assert after == before, (before, after)


@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA devices")
def test_device_numbers_are_mapped_by_uuid_across_processes() -> None:
    """Defect 5: the reader sees the devices in the other order."""
    order = ",".join(str(d) for d in reversed(range(torch.cuda.device_count())))
    got = _run("devices", "_produce_devices", consumer_env={"CUDA_VISIBLE_DEVICES": order})
    last = torch.cuda.device_count() - 1
    assert got == [(last - 1, True), (last, True)], got
