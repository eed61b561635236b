"""Tensor slots in one process: SHM pools, Ext 4 references, loans, finalizers, receipts."""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import threading
import time
import warnings
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
from support.extras import needs_torch, torch
from support.slots import POOL, apair, spair

from ringwire._conn.async_channel import Channel
from ringwire._conn.connect import connect
from ringwire._conn.listener import listen
from ringwire._conn.pair import pair
from ringwire._conn.sync_channel import SyncChannel
from ringwire._errors import (
    DecodeError,
    EncodeError,
    FrameTooLarge,
    HandshakeError,
    RingwireError,
    SlotMisuse,
    SlotsExhausted,
    SlotWaitTimeout,
)
from ringwire._pool.segment import Segment
from ringwire._pool.slotconfig import DEFAULT_SLOTS, SlotConfig
from ringwire._pool.views import borrow, copy_out, release
from ringwire._wire import ring as _ringlayout
from ringwire._wire.control import Hello, RingSpec, SegmentSpec, encode_message
from ringwire._wire.descriptors import SlotRef
from ringwire._wire.record import Record
from ringwire._wire.ring import init_ring, ring_size
from ringwire._wire.slotlayout import SlotClass, slot_state

from anyio import BrokenResourceError, EndOfStream, WouldBlock  # isort: skip

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture(params=[pytest.param("asyncio", id="asyncio"), pytest.param("trio", id="trio")])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


def in_use(ch: Channel | SyncChannel) -> int:
    return ch.statistics().slots_in_use  # statistics() is a safe point: releases are processed


def address(x: Any) -> int:
    if isinstance(x, np.ndarray):
        return int(x.__array_interface__["data"][0])
    return int(x.data_ptr())


def in_peer_pool(ch: Channel | SyncChannel, x: Any) -> bool:
    peer = ch._core.peer
    assert peer is not None
    probe = np.frombuffer(peer.seg.buf, np.uint8, count=1)
    lo = address(probe)
    del probe
    return lo <= address(x) < lo + peer.seg.size


def in_peer_pool_any(x: Any) -> bool:
    from ringwire._pool.views import _holder

    return _holder(x) is not None


# ======================================================================================
# configuration


def test_config_validation_and_defaults():
    assert DEFAULT_SLOTS.threshold == 64 * KiB and DEFAULT_SLOTS.policy == "wait"
    assert DEFAULT_SLOTS.pool_bytes > 81 * MiB
    assert "4 x 16 MiB" in DEFAULT_SLOTS.describe()
    with pytest.raises(ValueError, match="policy"):
        SlotConfig(policy="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="classes"):
        SlotConfig(classes=())
    with pytest.raises(ValueError, match="threshold"):
        SlotConfig(threshold=-1)
    with pytest.raises(ValueError, match="wait_timeout"):
        SlotConfig(wait_timeout=-1.0)
    cfg = SlotConfig(classes=[SlotClass(4096, 2)])  # type: ignore[arg-type]
    assert cfg.classes == (SlotClass(4096, 2),)


@pytest.mark.anyio
async def test_default_pool_connects_and_is_unlinked():
    t0 = time.perf_counter()
    a, b = await apair(DEFAULT_SLOTS, DEFAULT_SLOTS)
    elapsed = time.perf_counter() - t0
    async with a, b:
        assert elapsed < 2.0, elapsed
        assert a._core.pool is not None and b._core.peer is not None
        assert a._core.pool.seg.unlinked and b._core.pool is not None and b._core.pool.seg.unlinked
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"rw.{os.getpid()}.")]
        x = np.random.default_rng(0).random((1024, 1024))  # 8 MiB: a 16 MiB slot
        await a.send(x)
        y = await b.receive()
        assert np.array_equal(x, y) and in_peer_pool(b, y)
        del y


@pytest.mark.anyio
async def test_slots_none_sends_inline_and_refuses_refs():
    a, b = await apair(None, None)
    async with a, b:
        x = np.ones(50_000)
        await a.send(x)
        y = await b.receive()
        assert np.array_equal(x, y) and y.flags.writeable and not in_peer_pool_any(y)
        # a reference to a pool this connection does not have
        await a.send(SlotRef(1, 12345, 0, 0, 4096, 8, (1,), "<f8", "numpy"))
        with pytest.raises(DecodeError, match="no slot pool"):
            await b.receive()
        # a misuse of this endpoint, not an exhausted pool: the base error, no subclass
        with pytest.raises(RingwireError, match="no slot pool") as info:
            await a.loan((4,), np.float32)
        assert info.type is RingwireError


# ======================================================================================
# round trips


NUMPY_DTYPES = [
    "?",
    "i1",
    "u1",
    "<i2",
    ">i2",
    "<u2",
    "<i4",
    ">u4",
    "<i8",
    "<u8",
    "<f2",
    "<f4",
    ">f4",
    "<f8",
    "<c8",
    "<c16",
    "<M8[ns]",
    "<m8[s]",
    "S7",
    "<U3",
]


@pytest.mark.anyio
async def test_every_numpy_dtype_through_slots():
    cfg = SlotConfig(classes=(SlotClass(64 * KiB, 8),), threshold=0)
    a, b = await apair(cfg, cfg)
    async with a, b:
        rng = np.random.default_rng(1)
        for code in [*NUMPY_DTYPES, np.dtype(np.longdouble).str]:
            dt = np.dtype(code)
            raw = rng.integers(0, 256, size=37 * 5 * dt.itemsize, dtype=np.uint8)
            x = raw.view(dt).reshape(37, 5)
            await a.send({"x": x, "t": x.T, "s": x[::3, 1:], "zero": x[:0], "scalar": x[0:1, 0:1]})
            got = await b.receive()
            for key, ref in (("x", x), ("t", x.T), ("s", x[::3, 1:]), ("zero", x[:0])):
                y = got[key]
                assert y.dtype == dt and y.shape == ref.shape, (code, key)
                assert y.tobytes() == np.ascontiguousarray(ref).tobytes(), (code, key)
                assert not y.flags.writeable
            assert in_peer_pool(b, got["x"])
            with pytest.raises(ValueError):
                got["x"][0, 0] = got["x"][1, 1]
            del got, y
            assert in_use(a) == 0
        # 0-d arrays
        await a.send(np.array(3.5))
        z = await b.receive()
        assert z.shape == () and z == 3.5
        del z


TORCH_DTYPES = (
    []
    if torch is None
    else [
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ]
)


@needs_torch
@pytest.mark.anyio
async def test_every_torch_dtype_through_slots():
    cfg = SlotConfig(classes=(SlotClass(64 * KiB, 8),), threshold=0)
    a, b = await apair(cfg, cfg)
    async with a, b:
        for dt in TORCH_DTYPES:
            raw = torch.randint(0, 256, (24 * 10 * dt.itemsize,), dtype=torch.uint8)
            if dt == torch.bool:
                raw = raw % 2
            t = raw.view(dt).reshape(24, 10)
            views = {"t": t, "tt": t.t(), "s": t[::5, 2:], "e": t[:0]}
            await a.send(views)
            got = await b.receive()
            for key, ref in views.items():
                u = got[key]
                assert isinstance(u, torch.Tensor) and u.dtype == dt and u.shape == ref.shape
                assert torch.equal(u.view(torch.uint8), ref.contiguous().view(torch.uint8)), (
                    dt,
                    key,
                )
            assert in_peer_pool(b, got["t"])
            del got, u
            assert in_use(a) == 0
        # a conjugated view is sent with its values resolved; torch tensors are writable
        c = torch.randn(100, 100, dtype=torch.complex64)
        await a.send(c.conj())
        d = await b.receive()
        assert torch.equal(d, c.conj().resolve_conj())
        d += 1  # writes only the slot lent to us
        del d


@needs_torch
@pytest.mark.anyio
async def test_threshold_inline_below_and_mixed_record():
    a, b = await apair()
    async with a, b:
        small, mid, big = np.ones(10), np.ones(4096), np.ones(100_000)  # 80 B, 32 KiB, 800 KB
        t = torch.arange(10_000, dtype=torch.float32)  # 40 KB
        await a.send([small, mid, big, t, (mid, {"k": big[::2]})])
        got = await b.receive()
        assert in_use(a) == 5
        assert not in_peer_pool(b, got[0])
        assert all(in_peer_pool(b, x) for x in (got[1], got[2], got[3], got[4][0], got[4][1]["k"]))
        assert np.array_equal(got[4][1]["k"], big[::2]) and isinstance(got[4], tuple)
        assert torch.equal(got[3], t)
        assert b.statistics().slot_arrays_held == 5
        del got
        assert in_use(a) == 0 and b.statistics().slot_arrays_held == 0
        stats = a.statistics()
        assert stats.releases_received == 5 and stats.slot_bytes_in_use == 0
        assert stats.slots_free == {64 * KiB: 4, 1 * MiB: 2}


@pytest.mark.anyio
async def test_slots_are_aligned():
    a, b = await apair()
    async with a, b:
        await a.send([np.ones(2000, np.uint8), np.ones(200_000, np.uint8)])
        got = await b.receive()
        assert address(got[0]) % 4096 == 0 and address(got[1]) % 4096 == 0
        del got


@needs_torch
@pytest.mark.anyio
async def test_typed_records_and_receive_many():
    class Batch(Record):
        ids: list[int]
        pixels: np.ndarray
        mask: torch.Tensor

    a, b = await apair()
    async with a, b:
        recs = [
            Batch(ids=[i], pixels=np.full((64, 64), i, np.float32), mask=torch.ones(9000) * i)
            for i in range(3)
        ]
        await a.send_many(recs)
        got = await b.receive_many(type=Batch)
        while len(got) < 3:
            got += await b.receive_many(type=Batch)
        for i, r in enumerate(got):
            assert r.ids == [i] and float(r.pixels[0, 0]) == i and float(r.mask[5]) == i
        assert in_use(a) == 6
        del got, r
        assert in_use(a) == 0


# ======================================================================================
# loans


@needs_torch
@pytest.mark.anyio
async def test_loans_are_zero_copy_and_single_use():
    a, b = await apair()
    async with a, b:
        x = await a.loan((256, 256), np.float32)
        assert x.flags.writeable and a.statistics().loans_outstanding == 1
        x[:] = 7
        await a.send(x)
        y = await b.receive()
        assert np.all(y == 7) and in_peer_pool(b, y)
        # the consumer's view is the very slot the producer filled
        assert address(y) - address(
            b._core.peer and np.frombuffer(b._core.peer.seg.buf, np.uint8, 1)
        ) == (
            address(x) - address(np.frombuffer(a._core.pool.seg.buf, np.uint8, 1))  # type: ignore[union-attr]
        )
        with pytest.raises(SlotMisuse, match="sent once"):
            await a.send(x)  # twice
        del y
        assert in_use(a) == 0
        with pytest.raises(SlotMisuse):
            await a.send({"late": x[:10]})  # after it was sent (and released)
        del x
        # torch loans, bfloat16 included; a prefix of a loan may be sent
        t = await a.loan((1000, 64), torch.bfloat16)
        assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
        t.fill_(1.5)
        await a.send(t[:10])
        u = await b.receive()
        assert u.shape == (10, 64) and torch.all(u == 1.5)
        del t, u
        # the same loan twice in one record: refused, and nothing is left half-sent
        v = await a.loan(1000, np.int64)
        with pytest.raises(SlotMisuse):
            await a.send([v, v])
        assert a.statistics().loans_outstanding == 1
        await a.send([v])  # still a live loan
        w = await b.receive()
        assert len(w) == 1
        del v, w
        assert in_use(a) == 0 and a.statistics().loans_outstanding == 0


@pytest.mark.anyio
async def test_dropped_loan_returns_its_slot():
    a, b = await apair()
    async with a, b:
        x = await a.loan((100, 100), np.float64)
        y = x[::2]  # a view keeps the loan alive
        del x
        assert in_use(a) == 1
        del y
        assert in_use(a) == 0 and a.statistics().loans_outstanding == 0


@pytest.mark.anyio
async def test_a_loan_dropped_after_the_peer_went_still_returns_its_slot():
    a, b = await apair()
    async with a:
        x = await a.loan((100, 100), np.float64)
        await b.aclose()
        with anyio.fail_after(5), pytest.raises(EndOfStream):
            await a.receive()  # the peer's close is seen
        assert in_use(a) == 1 and a.statistics().loans_outstanding == 1
        del x
        stats = a.statistics()
        assert stats.slots_in_use == 0 and stats.loans_outstanding == 0


@needs_torch
@pytest.mark.anyio
async def test_loan_limits_and_policies():
    cfg = SlotConfig(classes=(SlotClass(64 * KiB, 2),), policy="error", large_limit=None)
    a, b = await apair(cfg, cfg)
    async with a, b:
        with pytest.raises(ValueError, match="largest slot.*no arena"):
            await a.loan((1 << 20,), np.uint8)
        with pytest.raises(EncodeError, match="cannot be sent") as info:
            await a.loan((4,), object)
        assert info.type is EncodeError
        x1 = await a.loan(10, np.uint8)
        x2 = await a.loan(10, np.uint8)
        with pytest.raises(SlotsExhausted):
            await a.loan(10, np.uint8)
        private = await a.loan((3, 4), torch.float16, slot_policy="inline")
        assert isinstance(private, torch.Tensor) and private.shape == (3, 4)
        assert a.statistics().inline_fallbacks == 1
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.1):
                await a.loan(10, np.uint8, slot_policy="wait")  # no slot comes back...

        async def drop_later() -> None:
            nonlocal x1
            await anyio.sleep(0.05)
            del x1

        await a.send(x2)  # ...unless one is sent and released
        got = await b.receive()
        async with anyio.create_task_group() as tg:
            tg.start_soon(drop_later)
            with anyio.fail_after(5):
                x3 = await a.loan(10, np.uint8, slot_policy="wait")  # the dropped loan's
        del got, x3


# ======================================================================================
# release: finalizers, threads, GC, explicit


@needs_torch
@pytest.mark.anyio
async def test_finalizer_fires_when_the_last_view_dies():
    a, b = await apair()
    async with a, b:
        await a.send({"n": np.arange(50_000.0), "t": torch.arange(50_000.0)})
        got = await b.receive()
        n, t = got["n"], got["t"]
        del got
        keep_n: list[Any] = [n[10:20], n.reshape(100, 500).T]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch: "array is not writable"
            keep_n.append(torch.from_numpy(n[::7]))  # a torch view of a numpy view
        keep_t: list[Any] = [t[5:].view(-1, 5), t.numpy()[3:], t.unsqueeze(0), t[::2]]
        del n, t
        for keep, left in ((keep_n, 1), (keep_t, 0)):
            while keep:
                assert in_use(a) == left + 1
                keep.pop(0)
            assert in_use(a) == left


@pytest.mark.anyio
async def test_releases_from_other_threads():
    a, b = await apair(capacity=1 << 20)
    async with a, b:
        n = 200
        q: queue.Queue[Any] = queue.Queue()

        def dropper() -> None:
            while (item := q.get()) is not None:
                del item  # the last reference dies in this thread

        threads = [threading.Thread(target=dropper) for _ in range(3)]
        for th in threads:
            th.start()
        try:

            async def produce() -> None:
                for i in range(n):
                    with anyio.fail_after(10):
                        await a.send(np.full(4096, i, np.float64))  # 32 KiB: 4 slots

            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                for i in range(n):
                    x = await b.receive()
                    assert x[0] == i
                    q.put(x)
                    del x
        finally:
            for _ in threads:
                q.put(None)
            for th in threads:
                th.join()
        with anyio.fail_after(5):
            while in_use(a):
                await anyio.sleep(0.001)
        assert a.statistics().releases_received == n


class Cycle:
    def __init__(self, payload: Any) -> None:
        self.me = self
        self.payload = payload


@pytest.mark.anyio
async def test_gc_triggered_releases_during_receive_loop():
    """Received arrays die only in cyclic garbage collection, which a low threshold
    fires at random points: inside the receive loop, the channel, the codec, the sink."""
    cfg = SlotConfig(classes=(SlotClass(64 * KiB, 4),), threshold=1024, wait_timeout=10)
    a, b = await apair(cfg, cfg, spin_us=0)
    n = 600
    old = gc.get_threshold()
    gc.set_threshold(25, 5, 5)
    try:
        async with a, b:

            async def produce() -> None:
                for i in range(n):
                    await a.send({"i": i, "x": np.full(2048, i, np.int64)})

            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                for i in range(n):
                    rec = await b.receive()
                    assert rec["x"][-1] == i
                    Cycle(rec)  # garbage until the collector finds it
                    junk = [Cycle(j) for j in range(30)]  # enough allocations to collect
                    del rec, junk
            gc.collect()
            assert in_use(a) == 0
            assert a.statistics().releases_received == n
    finally:
        gc.set_threshold(*old)


def test_gc_releases_in_a_sync_consumer_thread_and_finalizers_take_no_locks():
    a, b = spair(POOL, POOL, spin_us=0)
    with a, b:
        n = 400
        errors: list[BaseException] = []
        old = gc.get_threshold()
        gc.set_threshold(25, 5, 5)

        def consume() -> None:
            try:
                for i in range(n):
                    rec = b.receive(timeout=10)
                    assert rec[1][0] == i
                    Cycle(rec)
                    junk = [Cycle(j) for j in range(30)]
                    del rec, junk
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        th = threading.Thread(target=consume)
        th.start()
        try:
            for i in range(n):
                a.send([i, np.full(3000, i, np.float64)], timeout=10)
        finally:
            th.join()
            gc.set_threshold(*old)
        assert not errors
        gc.collect()
        assert in_use(a) == 0

        # A finalizer that interrupts code holding the ring fence lock, the pool lock or
        # the channel's own locks must not deadlock: it takes none of them.
        a.send(np.ones(10_000))
        x = b.receive(timeout=5)
        with _ringlayout._fence_lock, a._core.pool.lock, b._recv_lock, b._send_lock:  # type: ignore[union-attr]
            del x  # the finalizer runs here, in this thread
        assert in_use(a) == 0


@needs_torch
@pytest.mark.anyio
async def test_explicit_release_borrow_and_copy_out():
    class Req(Record):
        image: np.ndarray
        emb: torch.Tensor

    a, b = await apair()
    async with a, b:
        await a.send(Req(image=np.ones((200, 200)), emb=torch.ones(5000)))
        rec = await b.receive(type=Req)
        assert in_use(a) == 2
        assert release(rec.image[10:]) == 1  # any view finds its slot
        assert release(rec.image) == 0  # idempotent
        assert release([rec]) == 1
        assert in_use(a) == 0
        del rec

        await a.send({"a": [np.zeros(30_000)], "t": torch.zeros(30_000)})
        with borrow(await b.receive()) as got:
            assert in_use(a) == 2
            assert got["a"][0].sum() == 0
        assert in_use(a) == 0
        del got

        rec2 = Req(image=np.arange(40_000.0).reshape(200, 200), emb=torch.arange(5000.0))
        rec2.note = "extras travel too"
        await a.send(rec2)
        got2 = await b.receive(type=Req)
        mine = copy_out(got2)
        assert in_use(a) == 0
        assert mine.note == "extras travel too" and mine is not got2
        assert np.array_equal(mine.image, rec2.image) and mine.image.flags.writeable
        assert not in_peer_pool(b, mine.image) and not in_peer_pool(b, mine.emb)
        assert torch.equal(mine.emb, rec2.emb)
        mine.image[0, 0] = -1
        assert copy_out([1, "x", np.ones(3)])[0] == 1  # nothing slot-backed: unchanged
        del got2


@needs_torch
@pytest.mark.anyio
async def test_copy_out_is_the_receiving_sides_keyword():
    # the receiver has no send pool of its own (slots=None): copy_out is its choice
    # as a receiver all the same
    a, b = await apair(POOL, None, b_copy_out=True)
    async with a, b:
        await a.send([np.ones(50_000), torch.ones(50_000)])
        x, t = await b.receive()
        assert in_use(a) == 0  # released at once
        assert x.flags.writeable and not in_peer_pool(b, x) and not in_peer_pool(b, t)
        x[0] = 5
        assert b.statistics().slot_arrays_received == 2 and b.statistics().slot_arrays_held == 0


# ======================================================================================
# receipts and statistics


@pytest.mark.anyio
async def test_receipts():
    a, b = await apair()
    async with a, b:
        r0 = await a.send_tracked({"small": np.ones(3)})
        assert r0.consumed and r0.slots == 0
        await r0.wait()
        assert (await b.receive())["small"].shape == (3,)
        r1 = await a.send_tracked([np.ones(20_000), np.ones(20_000)])
        assert r1.slots == 2 and not r1.consumed
        got = await b.receive()

        async def consume_later() -> None:
            nonlocal got
            await anyio.sleep(0.05)
            del got

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume_later)
            with anyio.fail_after(5):
                await r1.wait()
        assert time.perf_counter() - t0 >= 0.04
        assert r1.consumed and "consumed" in repr(r1)


def test_sync_receipts_loans_and_timeouts():
    cfg = SlotConfig(classes=(SlotClass(64 * KiB, 2),), threshold=1024)
    a, b = spair(cfg, cfg)
    with a, b:
        x = a.loan((100,), np.float32, timeout=1)
        x[:] = 2
        r = a.send_tracked(x)
        del x
        with pytest.raises(TimeoutError):
            r.wait(timeout=0.05)
        y = b.receive(timeout=5)
        assert float(y.sum()) == 200
        del y
        r.wait(timeout=5)
        assert r.consumed
        # exhaustion, sync: "wait" times out with TimeoutError; "error" raises
        a.send(np.ones(4000))
        a.send(np.ones(4000))
        held = [b.receive(timeout=5), b.receive(timeout=5)]
        with pytest.raises(TimeoutError):
            a.send(np.ones(4000), timeout=0.05)
        with pytest.raises(SlotsExhausted):
            a.send(np.ones(4000), slot_policy="error")
        with pytest.raises(WouldBlock):
            a.send_nowait(np.ones(4000))
        assert in_use(a) == 2
        threading.Timer(0.05, held.clear).start()
        a.send(np.ones(4000), timeout=5)  # a release arrives while waiting
        b.receive(timeout=5)
        shapes: list[Any] = []
        th = threading.Thread(
            target=lambda: shapes.extend(b.receive(timeout=5).shape for _ in range(5))
        )
        th.start()
        a.send_many([np.ones(4000)] * 5, timeout=5)  # waits for releases as it goes
        th.join()
        assert shapes == [(4000,)] * 5
        assert in_use(a) == 0


# ======================================================================================
# exhaustion


@pytest.mark.anyio
async def test_exhaustion_policies():
    cfg = SlotConfig(classes=(SlotClass(64 * KiB, 2),), threshold=1024)
    a, b = await apair(cfg, cfg, spin_us=0)
    async with a, b:
        x = np.ones(4096)  # 32 KiB
        await a.send(x)
        await a.send(x)
        held = [await b.receive(), await b.receive()]
        assert in_use(a) == 2
        with pytest.raises(SlotsExhausted, match="policy 'error'"):
            await a.send([np.ones(2000), x], slot_policy="error")
        assert in_use(a) == 2  # the first array's slot was given back
        await a.send(x, slot_policy="inline")
        y = await b.receive()
        assert np.array_equal(y, x) and not in_peer_pool(b, y)
        assert a.statistics().inline_fallbacks == 1
        # "wait": cancellation leaves nothing behind
        with anyio.move_on_after(0.05) as scope:
            await a.send(x)
        assert scope.cancelled_caught and in_use(a) == 2
        with pytest.raises(WouldBlock):
            a.send_nowait(x)
        # "wait" until a release arrives (a doorbell wakes the parked sender)
        t0 = time.perf_counter()

        async def consume() -> None:
            await anyio.sleep(0.05)
            held.pop()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with anyio.fail_after(5):
                await a.send(x)
        assert time.perf_counter() - t0 >= 0.04
        assert a.statistics().slots_in_use == 2
        assert np.array_equal(await b.receive(), x)
        held.clear()
        assert in_use(a) == 0


@pytest.mark.anyio
async def test_wait_timeout_and_impossible_records():
    cfg = SlotConfig(classes=(SlotClass(64 * KiB, 2),), threshold=1024, wait_timeout=0.05)
    a, b = await apair(cfg, cfg)
    async with a, b:
        with pytest.raises(SlotsExhausted, match="more slots than the pool has") as futile:
            await a.send([np.ones(4000)] * 3)  # never fits, whatever is released
        assert not isinstance(futile.value, TimeoutError)  # it did not wait
        assert in_use(a) == 0
        await a.send([np.ones(4000)] * 2)
        held = await b.receive()
        t0 = time.perf_counter()
        with pytest.raises(SlotWaitTimeout, match="within 0.05 s") as waited:
            await a.send(np.ones(4000))
        assert time.perf_counter() - t0 >= 0.04
        # a wait that timed out is a TimeoutError, and still a SlotsExhausted
        assert isinstance(waited.value, TimeoutError)
        assert isinstance(waited.value, SlotsExhausted)
        del held


@pytest.mark.anyio
async def test_arrays_too_large_for_any_slot():
    """Without an arena (large_limit=None) an array larger than every slot goes inline
    if the ring takes it, else FrameTooLarge; with one (the default) it goes by
    reference, in memory of its own."""
    cfg = SlotConfig(classes=(SlotClass(4096, 2),), threshold=1024, large_limit=None)
    a, b = await apair(cfg, cfg, capacity=1 << 20)
    async with a, b:
        x = np.ones(20_000)  # 160 KB: no slot, but the ring takes it
        await a.send(x)
        assert np.array_equal(await b.receive(), x)
        assert a.statistics().inline_fallbacks == 1
        with pytest.raises(FrameTooLarge, match="2 x 4 KiB"):
            await a.send(np.ones(200_000))  # fits neither
        assert in_use(a) == 0
    cfg = SlotConfig(classes=(SlotClass(4096, 2),), threshold=1024)
    a, b = await apair(cfg, cfg, capacity=1 << 20)
    async with a, b:
        for n in (20_000, 200_000):
            x = np.arange(n, dtype=np.float64)
            await a.send(x)
            y = await b.receive()
            assert np.array_equal(y, x) and not y.flags.writeable
            assert a.statistics().large_in_use == 1
            del y
            await a.send(0)  # a safe point that reads the release
            assert await b.receive() == 0
            await a.send(0)
            assert await b.receive() == 0
        st = a.statistics()
        assert st.large_sent == 2 and st.large_in_use == 0 and st.inline_fallbacks == 0


@pytest.mark.anyio
async def test_unpublished_record_gives_its_slots_back():
    a, b = await apair(capacity=4096, spin_us=0)
    async with a, b:
        while True:  # fill the ring
            try:
                a.send_nowait(b"x" * 500)
            except WouldBlock:
                break
        x = await a.loan(100, np.float32)
        with pytest.raises(WouldBlock):
            a.send_nowait([np.ones(10_000), x])
        assert in_use(a) == 1 and a.statistics().loans_outstanding == 1  # the loan is back
        with anyio.move_on_after(0.05):
            await a.send([np.ones(10_000), x])  # parks on the full ring, cancelled
        assert in_use(a) == 1 and a.statistics().loans_outstanding == 1
        with anyio.move_on_after(0.05):
            await a.send_many([np.ones(10_000), x])
        assert in_use(a) == 1 and a.statistics().loans_outstanding == 1
        # (the event loop may keep the last cancellation's traceback, and x with it)


# ======================================================================================
# attacks and bad peers


def ref_like(ref: SlotRef, **changes: Any) -> SlotRef:
    return msgspec.structs.replace(ref, **changes)


@pytest.mark.anyio
async def test_forged_references_are_refused():
    a, b = await apair()
    c, d = await apair()
    async with a, b, c, d:
        await a.send(np.ones(8192, np.uint8))
        held = await b.receive()
        assert a._core.pool is not None and c._core.pool is not None
        slot = 0
        gen, status = slot_state(a._core.pool.seg.buf, slot)
        good = a._core.pool.alloc.ref(slot, 8192, (8192,), "|u1", "numpy")
        assert good.generation == gen
        cap = a._core.pool.layout.capacities[slot]
        attacks = {
            "foreign pool": ref_like(good, pool=c._core.pool.layout.pool_id),
            "bad slot": ref_like(good, slot=99),
            "stale generation": ref_like(good, generation=gen + 1),
            "free slot": ref_like(good, slot=1),
            "past the slot": ref_like(good, offset=good.offset + cap - 4096),
            "before the slot": ref_like(good, offset=good.offset - 8192),
            "referenced twice": good,
            "misaligned": ref_like(
                good, offset=good.offset + 1, nbytes=64, shape=(8,), dtype="<f8"
            ),
        }
        for what, forged in attacks.items():
            await a.send(forged)
            with pytest.raises(DecodeError):
                await b.receive()
            assert in_use(a) == 1, what
        # nbytes inconsistent with the shape is refused by the codec itself
        await a.send(ref_like(good, nbytes=16))
        with pytest.raises(DecodeError):
            await b.receive()
        # the connection goes on, and nothing was released twice
        del held
        assert in_use(a) == 0
        await a.send(np.ones(8192, np.uint8))
        assert (await b.receive()).sum() == 8192
        assert a.statistics().releases_received == 2


@pytest.mark.anyio
async def test_listener_drops_a_connection_that_forges_references(tmp_path):
    path = str(tmp_path / "f.sock")
    async with listen(path, slots=POOL) as lst:
        async with await connect(path, slots=POOL) as c:
            await c.send(SlotRef(1, 42, 0, 0, 4096, 8, (1,), "<f8", "numpy"))
            await c.send("after")
            with anyio.fail_after(5):
                while lst.statistics().broken < 1:
                    with anyio.move_on_after(0.1):
                        await lst.receive()
        async with await connect(path, slots=POOL) as c2:
            await c2.send(np.arange(100_000))
            conn, got = await lst.receive()
            assert got[-1] == 99_999 and in_peer_pool(conn, got)
            await conn.send(np.arange(50_000.0))  # the listener's own pool
            back = await c2.receive()
            assert back[-1] == 49_999 and in_peer_pool(c2, back)
            del got, back


@pytest.mark.anyio
async def test_undecodable_record_releases_its_references():
    class Point(Record):
        x: int

    a, b = await apair()
    async with a, b:
        await a.send([np.ones(10_000), "junk", np.ones(10_000)])
        with pytest.raises(DecodeError):
            await b.receive(type=Point)
        assert in_use(a) == 0
        await a.send_many([[np.ones(10_000)], [np.ones(10_000), 5]])
        await anyio.sleep(0.01)
        got = b.receive_many_nowait(type=list[np.ndarray])  # the 2nd ends the batch...
        assert len(got) == 1
        with pytest.raises(DecodeError):  # ...and raises next, without a second decode
            b.receive_many_nowait(type=list[Any])
        del got
        assert in_use(a) == 0 and a.statistics().releases_received == 4
        await a.send([np.ones(10_000), "junk"])
        await a.send([np.ones(10_000)])
        await anyio.sleep(0.01)
        both = b.receive_many_nowait()  # untyped: both fine
        assert len(both) == 2
        del both
        assert in_use(a) == 0


@pytest.mark.anyio
async def test_bogus_release_breaks_only_that_connection():
    a, b = await apair()
    async with a, b:
        await a.send(np.ones(10_000))
        held = await b.receive()
        assert b._core.peer is not None
        b._core.peer.queue.push(3, 0)  # slot 3 was never sent
        with pytest.raises(BrokenResourceError):
            for _ in range(100):
                await a.send(1)
                await anyio.sleep(0.001)
        assert a._core.pool is not None
        assert a._core.pool.alloc.free_by_size() == {64 * KiB: 4, 1 * MiB: 2}  # intact, reclaimed
        del held


def test_handshake_refuses_a_malformed_pool(monkeypatch):
    monkeypatch.setenv("RINGWIRE_SEGMENTS", "named")  # (a hello written by hand: by name)
    a, b = pair()
    sock_a = a._take()
    bad = Segment.create(1 << 16)
    rings = Segment.create(2 * ring_size(4096))
    try:
        init_ring(rings.buf, 0, 4096)
        init_ring(rings.buf, ring_size(4096), 4096)
        hello = Hello(
            versions=[1],
            pid=os.getpid(),
            segments=[
                SegmentSpec(rings.name, rings.size),
                SegmentSpec(bad.name, bad.size, "slots"),
            ],
            c2s=RingSpec(0, 0, 4096),
            s2c=RingSpec(0, ring_size(4096), 4096),
        )
        sock_a.setblocking(True)
        sock_a.sendall(encode_message(hello))
        with pytest.raises(HandshakeError, match="malformed slot pool") as info:
            b.connect_sync(slots=POOL, handshake_timeout=5)
        assert info.type is HandshakeError
    finally:
        sock_a.close()
        for seg in (bad, rings):
            seg.unlink()
            seg.close()


@pytest.mark.anyio
async def test_release_lane_full_is_retried_at_safe_points():
    """More releases than the lane holds: the rest wait in the queue, the producer
    rings back when it drains the lane, nothing is lost."""
    n = 6000
    cfg = SlotConfig(classes=(SlotClass(64, n),), threshold=0)
    a, b = await apair(cfg, cfg, capacity=1 << 22)
    async with a, b:
        await a.send([np.ones(8) for _ in range(n)])
        got = await b.receive()
        assert in_use(a) == n
        del got
        assert b._core.peer is not None and len(b._core.peer.queue) > 0  # the lane filled up
        with anyio.fail_after(5):
            while in_use(a):  # the producer drains and rings; the consumer's wake flushes
                await anyio.sleep(0.001)
                with contextlib.suppress(WouldBlock):
                    b.receive_nowait()
        assert a.statistics().releases_received == n


@needs_torch
@pytest.mark.anyio
async def test_close_with_live_views_warns_and_stays_valid():
    a, b = await apair()
    await a.send([np.arange(10_000.0), torch.arange(10_000.0)])
    x, t = await b.receive()
    await a.aclose()
    with pytest.warns(ResourceWarning, match="2 received slot array"):
        await b.aclose()
    assert x[-1] == 9999 and float(t[-1]) == 9999  # still mapped
    del x, t
    gc.collect()


def test_no_warnings_leak_from_finalizers_after_close():
    """Views that die after the channel closed release nothing and raise nothing."""
    a, b = spair()
    a.send(np.ones(20_000))
    x = b.receive(timeout=5)
    a.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b.close()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)]
    del x
    gc.collect()


@needs_torch
@pytest.mark.anyio
async def test_records_sent_before_a_clean_close_still_resolve():
    """A producer that closes cleanly right after sending must not invalidate the slot
    references in records the consumer has not read yet: the consumer receives them
    (valid views), then EndOfStream -- as it would after a crash."""
    a, b = await apair()
    async with b:
        big = np.arange(100_000, dtype=np.float64)  # 800 KB: travels in a slot
        t = torch.arange(50_000, dtype=torch.float32)
        receipt = await a.send_tracked({"x": big, "t": t})
        await a.aclose()
        assert receipt.consumed  # our side is closed: nothing to wait for
        got = await b.receive()
        assert np.array_equal(got["x"], big) and torch.equal(got["t"], t)
        with pytest.raises(anyio.EndOfStream):
            await b.receive()
        del got


def test_send_many_mixes_records_with_and_without_arrays():
    cfg = SlotConfig(classes=(SlotClass(64 * KiB, 2),), threshold=1024)
    a, b = spair(cfg, None)
    with a, b:
        items: list[Any] = [1, np.full(4000, 7.0), "x", {"k": np.full(4000, 8.0)}, (2, 3), 4]
        a.send_many(items, timeout=5)
        got = [b.receive(timeout=5) for _ in items]
        assert got[0] == 1 and got[2] == "x" and got[4] == (2, 3) and got[5] == 4
        assert float(got[1][0]) == 7.0 and float(got[3]["k"][0]) == 8.0
        assert in_use(a) == 2
        del got
        # more arrays than slots, records without arrays between them: the batch goes
        # out in parts, each waiting for the releases of the one before
        shapes: list[Any] = []

        def consume() -> None:
            for _ in range(7):
                x = b.receive(timeout=5)
                shapes.append(getattr(x, "shape", x))

        th = threading.Thread(target=consume)
        th.start()
        a.send_many([0, np.ones(4000), 1, np.ones(4000), np.ones(4000), 2, 3], timeout=5)
        th.join()
        assert shapes == [0, (4000,), 1, (4000,), (4000,), 2, 3]
        assert in_use(a) == 0


def test_a_receipt_of_a_record_without_arrays_stays_done():
    cfg = SlotConfig(classes=(SlotClass(64 * KiB, 2),), threshold=1024)
    a, b = spair(cfg, None)
    with a, b:
        plain = a.send_tracked({"no": "arrays"})
        assert plain.consumed
        a.send_many([1, 2, 3], timeout=5)  # placements that placed nothing are used again
        held = a.send_tracked(np.ones(4000))
        assert plain.consumed and not held.consumed  # the empty one was not reused by it
        got = [b.receive(timeout=5) for _ in range(5)]
        del got
        held.wait(timeout=5)
        assert in_use(a) == 0
