"""The send pool's arena: arrays larger than every slot class, by reference.

The allocator alone (ranges, the byte limit, releases checked, memory given back), the
consumer's checks of a reference, and a connection carrying arrays that fit no slot --
numpy and torch, 256 MiB -- with the memory back once the views die.
"""

from __future__ import annotations

import gc
import os

import anyio
import msgspec
import numpy as np
import pytest
from support.extras import needs_torch, torch
from support.slots import apair, spair

from ringwire import DecodeError, SlotClass, SlotConfig, SlotsExhausted
from ringwire._errors import SlotMisuse, SlotRefused
from ringwire._pool.arena import (
    ARENA_SIZE,
    ArenaAllocator,
    ArenaFile,
    ArenaMapper,
    arena_pool_id,
    big_tag,
)
from ringwire._pool.segment import memfd_supported

MiB = 1 << 20
SMALL = SlotConfig(classes=(SlotClass(64 << 10, 2),), threshold=1024, wait_timeout=5)

pytestmark = pytest.mark.skipif(not memfd_supported(), reason="needs memory files")


def _blocks(fd: int) -> int:
    """Bytes of memory a file holds now."""
    return os.fstat(fd).st_blocks * 512


@pytest.fixture
def alloc():
    a = ArenaAllocator(ArenaFile(), 8 * MiB, pool_id=7)
    yield a
    a.close()


def test_ranges_are_reserved_aligned_and_given_back(alloc: ArenaAllocator) -> None:
    fd = alloc.arena.fd
    assert os.fstat(fd).st_size == ARENA_SIZE and _blocks(fd) == 0  # sparse
    i = alloc.allocate(3 * MiB)
    j = alloc.allocate(100_000)
    assert i is not None and j is not None and i != j
    assert alloc.offset_of(i) % (2 * MiB) == 0  # huge-page aligned when that large
    assert alloc.offset_of(j) % 4096 == 0
    assert _blocks(fd) >= 4 * MiB + 100_000  # reserved before use (no SIGBUS later)
    view = alloc.view(i, 3 * MiB)
    view[:4] = b"abcd"
    view.release()
    alloc.mark_sent(i)
    gen = alloc.generation(i)
    alloc.release(i, gen)
    assert alloc.generation(i) == gen + 1 and alloc.status(i) == 0
    assert _blocks(fd) < 4 * MiB  # punched: the memory went back at once
    alloc.cancel(j)
    assert alloc.outstanding == 0 and alloc.in_use() == 0 and _blocks(fd) == 0


def test_the_limit_bounds_what_is_outstanding_but_refuses_no_size(alloc: ArenaAllocator) -> None:
    a = alloc.allocate(6 * MiB)
    assert a is not None
    assert not alloc.can_allocate(4 * MiB) and alloc.allocate(4 * MiB) is None  # 6 + 4 > 8
    assert alloc.allocate(2 * MiB) is not None  # 6 + 2 fits
    for k in list(alloc._entries):
        alloc.cancel(k)
    big = alloc.allocate(20 * MiB)  # alone, larger than the limit: it goes
    assert big is not None and alloc.outstanding == 20 * MiB
    assert alloc.allocate(4096) is None  # ...and nothing beside it
    alloc.cancel(big)


def test_releases_are_checked(alloc: ArenaAllocator) -> None:
    i = alloc.allocate(MiB)
    assert i is not None
    with pytest.raises(SlotRefused):
        alloc.release(i, alloc.generation(i))  # loaned, never sent
    alloc.mark_sent(i)
    g = alloc.generation(i)
    with pytest.raises(SlotRefused):
        alloc.release(i, g + 1)  # another generation
    with pytest.raises(SlotRefused):
        alloc.release(i + 1000, 0)  # never lent
    alloc.release(i, g)
    with pytest.raises(SlotRefused):
        alloc.release(i, g)  # twice
    assert alloc.outstanding == 0


def test_free_ranges_merge(alloc: ArenaAllocator) -> None:
    idx = [alloc.allocate(MiB) for _ in range(4)]
    assert None not in idx
    for k in (idx[1], idx[3], idx[2], idx[0]):
        alloc.cancel(k)  # type: ignore[arg-type]
    assert alloc._free == [(0, ARENA_SIZE)]


@pytest.mark.parametrize("consumer_gone", [True, False])
def test_reclaim_punches_only_when_the_consumer_is_gone(consumer_gone: bool) -> None:
    """A dead consumer's ranges go back to the kernel; a closing producer leaves the
    pages to the consumer's live views (they go with its mappings)."""
    alloc = ArenaAllocator(ArenaFile(), 8 * MiB, pool_id=7)
    try:
        fd = alloc.arena.fd
        i = alloc.allocate(2 * MiB)
        assert i is not None
        alloc.mark_sent(i)
        assert alloc.reclaim_sent(publish=consumer_gone) == 1
        assert alloc.outstanding == 0
        assert (_blocks(fd) >= 2 * MiB) is (not consumer_gone)
    finally:
        alloc.close()


def test_the_consumer_maps_only_page_aligned_ranges_inside_the_arena() -> None:
    arena = ArenaFile(size=16 * MiB)
    mapper = ArenaMapper(os.dup(arena.fd), arena.size, pool_id=3)
    try:
        assert mapper.pool_id == arena_pool_id(3) != 3
        mapper.map(4096, 100).close()
        for offset, nbytes in ((100, 10), (-4096, 10), (16 * MiB - 4096, 8192), (0, 0)):
            with pytest.raises(ValueError, match="page-aligned range inside"):
                mapper.map(offset, nbytes)
    finally:
        mapper.close()
        arena.close()
    with pytest.raises(ValueError, match="closed"):
        mapper.map(0, 10)


def test_named_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGWIRE_SEGMENTS", "named")
    arena = ArenaFile(size=16 * MiB)
    try:
        assert arena.kind == "named" and os.path.exists("/dev/shm" + arena.name)
        a = ArenaAllocator(arena, 8 * MiB, 1)
        i = a.allocate(MiB)
        assert i is not None
        a.cancel(i)
    finally:
        arena.close()
    assert not os.path.exists("/dev/shm" + arena.name)


# -- over a connection ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["memfd", "named"])
def test_256_mib_numpy_by_reference_and_the_memory_comes_back(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RINGWIRE_SEGMENTS", kind)
    x = np.arange(256 * MiB // 8, dtype=np.int64)
    ca, cb = spair(SMALL, SMALL)
    with ca, cb:
        if True:
            arena_fd = ca._core.pool.big.arena.fd  # type: ignore[attr-defined]
            ca.send({"pixels": x})
            got = cb.receive(timeout=10)["pixels"]
            assert got.dtype == x.dtype and got.shape == x.shape
            assert got[12345] == 12345 and got[-1] == x[-1] and not got.flags.writeable
            st = ca.statistics()
            assert st.large_sent == 1 and st.large_bytes_in_use == 256 * MiB
            assert cb.statistics().slot_arrays_held == 1
            assert _blocks(arena_fd) >= 256 * MiB
            del got
            gc.collect()
            ca.send(0)  # a safe point: the release is read
            assert cb.receive(timeout=5) == 0
            ca.send(0)
            assert cb.receive(timeout=5) == 0
            assert ca.statistics().large_in_use == 0
            assert _blocks(arena_fd) == 0  # given back to the kernel


@needs_torch
@pytest.mark.anyio
async def test_a_256_mib_tensor_by_reference() -> None:
    a, b = await apair(SMALL, SMALL)
    async with a, b:
        t = torch.arange(64 * MiB, dtype=torch.float32)  # 256 MiB
        await a.send([t, "after"])
        got, tail = await b.receive()
        assert tail == "after" and got.dtype == torch.float32 and got.shape == t.shape
        assert float(got[-1]) == float(t[-1])
        assert a.statistics().large_sent == 1
        del got
        gc.collect()
        await a.send(0)
        assert await b.receive() == 0
        await a.send(0)
        assert await b.receive() == 0
        assert a.statistics().large_in_use == 0


@pytest.mark.anyio
async def test_a_send_waits_for_the_limit_like_a_full_pool() -> None:
    cfg = SlotConfig(
        classes=(SlotClass(4096, 1),), threshold=1024, large_limit=3 * MiB, wait_timeout=5
    )
    a, b = await apair(cfg, cfg)
    async with a, b:
        await a.send(np.ones(2 * MiB, np.uint8))
        held = await b.receive()
        with anyio.move_on_after(0.2) as scope:
            await a.send(np.ones(2 * MiB, np.uint8))  # 2 + 2 > 3: waits
        assert scope.cancelled_caught
        with pytest.raises(SlotsExhausted):
            await a.send(np.ones(2 * MiB, np.uint8), slot_policy="error")

        async def drop_later() -> None:
            nonlocal held
            await anyio.sleep(0.1)
            del held
            gc.collect()

        async with anyio.create_task_group() as tg:
            tg.start_soon(drop_later)
            await a.send(np.full(2 * MiB, 7, np.uint8))  # goes once the first is released
        assert (await b.receive())[0] == 7


@pytest.mark.anyio
async def test_a_forged_arena_reference_breaks_the_connection_with_a_clear_error() -> None:
    from ringwire._wire.descriptors import SlotRef

    a, b = await apair(SMALL, SMALL)
    async with a, b:
        await a.send(np.ones(MiB, np.uint8))
        got = await b.receive()
        pool = b._core.transport.recv_pool  # type: ignore[attr-defined]
        ref = SlotRef(
            version=1,
            pool=pool.arena.pool_id,
            slot=1,
            generation=0,
            offset=ARENA_SIZE,
            nbytes=4096,
            shape=(4096,),
            dtype="u1",
            kind="numpy",
        )  # fmt: skip
        with pytest.raises(DecodeError, match="page-aligned range inside"):
            pool.resolve(ref)
        with pytest.raises(DecodeError, match="referenced twice"):
            pool.resolve(msgspec.structs.replace(ref, offset=0, slot=0))
        assert big_tag(0) in pool.held
        del got
        gc.collect()


def test_a_broadcast_sends_an_array_larger_than_every_slot_to_every_reader(
    tmp_path: pytest.TempPathFactory,
) -> None:
    import threading

    import ringwire

    path = str(tmp_path / "b.sock")  # type: ignore[operator]
    with ringwire.broadcast_sync(path, readers=2, slots=SMALL) as w:
        subs: list = []
        ts = [
            threading.Thread(target=lambda r=r: subs.append(ringwire.subscribe_sync(path, rank=r)))
            for r in range(2)
        ]
        for t in ts:
            t.start()
        w.wait_ready(2, timeout=10)
        for t in ts:
            t.join()
        try:
            x = np.arange(4 * MiB // 8, dtype=np.int64)  # 4 MiB: no slot of SMALL holds it
            w.send({"x": x})
            got = [s.receive(timeout=10)["x"] for s in subs]
            assert all(np.array_equal(g, x) and not g.flags.writeable for g in got)
            big = w._core.pool.send.big  # type: ignore[attr-defined]
            assert big.in_use() == 1
            del got[0]
            gc.collect()
            w.send(1)
            assert [s.receive(timeout=5) for s in subs] == [1, 1]
            assert big.in_use() == 1  # one reader still holds it
            del got
            gc.collect()
            for _ in range(2):
                w.send(1)
                assert [s.receive(timeout=5) for s in subs] == [1, 1]
            assert big.in_use() == 0 and big.outstanding == 0
        finally:
            for s in subs:
                s.close()


@pytest.mark.anyio
async def test_a_loan_larger_than_every_slot_comes_from_the_arena_and_is_sent_without_a_copy() -> (
    None
):
    a, b = await apair(SMALL, SMALL)
    async with a, b:
        x = await a.loan((3 * MiB,), np.uint8)  # no slot of SMALL holds it
        big = a._core.pool.big  # type: ignore[attr-defined]
        assert big.in_use() == 1 and a.statistics().loans_outstanding == 1
        x[:] = 9
        x[-1] = 7
        await a.send({"x": x})
        got = (await b.receive())["x"]
        assert got[0] == 9 and got[-1] == 7 and got.shape == (3 * MiB,)
        st = a.statistics()
        assert st.loans_outstanding == 0 and st.large_sent == 1 and st.large_in_use == 1
        with pytest.raises(SlotMisuse, match="no longer loaned"):
            await a.send(x)  # a loan goes once
        del got, x
        gc.collect()
        for _ in range(2):
            await a.send(0)
            assert await b.receive() == 0
        assert big.in_use() == 0 and big.outstanding == 0
        y = await a.loan((2 * MiB,), np.uint8)  # dropped unsent: it comes back
        assert big.in_use() == 1
        del y
        gc.collect()
        await a.send(0)
        assert await b.receive() == 0
        assert big.in_use() == 0 and a.statistics().loans_outstanding == 0
