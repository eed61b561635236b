"""CUDA tensors by reference (Ext 5), on CPU: the protocol through a simulated backend.

Every CUDA call of ringwire goes through a backend object; ``support/cuda_fake.py`` simulates one
(pool memory in a memfd, torch's reference counters and limbo, events that complete on
demand and fail once their exporter destroyed them, device UUIDs).  So these tests
drive the real pools, exports, leases, references, finalizers, release thread, lanes,
reclaim and refusals in CI; ``tests/process/test_cuda_gpu.py`` runs the same shapes of
test against real CUDA where a GPU exists (and tests/process/test_cuda.py this protocol
across processes).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
from support.cuda import (
    GPU,
    KiB,
    MiB,
    cuda_in_use,
    fake_fixture,  # noqa: F401  (the fixture `fake`)
    until,
)
from support.cuda_fake import FakeCudaBackend, default_uuid
from support.extras import torch  # not None: support.cuda_fake skips this module without it
from support.slots import apair, spair

from ringwire._errors import DecodeError, SlotMisuse, SlotsExhausted
from ringwire._pool import cudablocks
from ringwire._pool.cuda import (
    CudaNeed,
    cuda_backend,
    cuda_pool_id,
    cuda_tag,
    drop_idle_pools,
    lingering_pools,
    set_cuda_backend,
    split_tag,
)
from ringwire._pool.cudablocks import Lease, take_lease
from ringwire._pool.slotconfig import SlotConfig
from ringwire._pool.views import release
from ringwire._wire.descriptors import CudaRef
from ringwire._wire.slotlayout import SlotClass

from anyio import BrokenResourceError  # isort: skip

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ======================================================================================
# pure helpers


def test_tags_pool_ids_and_config() -> None:
    assert split_tag(5) is None
    assert split_tag(cuda_tag(0, 5)) == (0, 5)
    assert split_tag(cuda_tag(7, 2**20)) == (7, 2**20)
    ids = {cuda_pool_id(123, d) for d in range(8)}
    assert len(ids) == 8 and 123 not in ids
    assert str(CudaNeed(1, 4096)) == "4096 bytes on cuda:1"
    with pytest.raises(ValueError, match="cuda"):
        SlotConfig(cuda="copy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cuda_threshold"):
        SlotConfig(cuda_threshold=-1)
    with pytest.raises(ValueError, match="cuda_classes"):
        SlotConfig(cuda_classes=())


def test_no_backend_without_cuda() -> None:
    """CPU-only torch: no backend, and importing ringwire touched no CUDA."""
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        pytest.skip("this machine has CUDA")
    set_cuda_backend(None)
    assert cuda_backend() is None


def test_a_test_can_say_probed_no_backend_even_where_cuda_exists(monkeypatch) -> None:
    """Defect 4: ``set_cuda_backend(None)`` means "probe again", which installs the real
    backend on a GPU machine; ``probe=False`` says "probed: no backend"."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    try:
        set_cuda_backend(None)
        assert cuda_backend(import_torch=True) is not None  # probed: the real backend
        set_cuda_backend(None, probe=False)
        assert cuda_backend(import_torch=True) is None  # whatever the machine has
        with pytest.raises(ValueError, match="probe=False"):
            set_cuda_backend(FakeCudaBackend(), probe=False)
        with pytest.raises(TypeError, match="not a CUDA backend"):
            set_cuda_backend(object())
        with pytest.raises(TypeError, match="probe"):
            set_cuda_backend(None, probe=0)  # type: ignore[arg-type]
    finally:
        set_cuda_backend(None)


def test_a_lease_is_held_while_a_consumer_holds_it_and_refuses_forgeries() -> None:
    """The producer sees, with a non-blocking flock, whether anybody maps an export."""
    lease = Lease()
    try:
        assert not lease.held()
        fd = take_lease(lease.descriptor, os.getpid())
        assert lease.held()
        os.close(fd)
        assert not lease.held()
        with pytest.raises(DecodeError, match="malformed"):
            take_lease(b"\0" * 4, os.getpid())
        with pytest.raises(DecodeError, match="pool is pid"):
            take_lease(lease.descriptor, os.getpid() + 1)
        r, w = os.pipe()  # a descriptor of ours that is not a lease
        try:
            with pytest.raises(DecodeError, match="not a ringwire CUDA lease"):
                take_lease(os.getpid().to_bytes(4, "little") + r.to_bytes(4, "little"), os.getpid())
        finally:
            os.close(r)
            os.close(w)
    finally:
        lease.close()
    assert not lease.held()


# ======================================================================================
# sending and receiving


async def test_cuda_tensors_travel_by_reference_and_the_pool_opens_once(fake) -> None:
    a, b = await apair(GPU, GPU)
    async with a, b:
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16):
            x = fake.tensor(torch.arange(4096).to(dtype))
            await a.send({"x": x, "note": "hi"})
            got = await b.receive()
            assert got["note"] == "hi"
            y = got["x"]
            assert y.dtype == dtype and y.shape == x.shape and torch.equal(y, x)
            assert fake.is_device_tensor(y)  # a view of the pool, "on the device"
            del got, y
            gc.collect()
            await until(lambda: cuda_in_use(a) == 0)
        # exported once (one connection), mapped once (in this process: found locally,
        # as a CUDA IPC handle cannot be opened by the process that exported it)
        assert fake.pools_allocated == 1 and fake.exports == 1 and fake.pool_opens == 0
        assert fake.copies == 5 and fake.waits == 5  # waited on the producer's event each time
        assert b._core.peer is not None and b._core.peer.cuda_opens == 1
        stats = a.statistics()
        assert stats.cuda_pools == [0] and stats.releases_received == 5


async def test_a_closed_connections_gpu_block_is_reused_only_when_nobody_reads_it(fake) -> None:
    for _ in range(3):  # clean closes with every slot back: one block, one export each
        a, b = await apair(GPU, GPU)
        async with a, b:
            await a.send(fake.tensor(torch.ones(4096)))
            assert torch.equal(await b.receive(), torch.ones(4096))
            await until(lambda: cuda_in_use(a) == 0)  # noqa: B023
    assert fake.pools_allocated == 1
    # a producer that closes while the consumer still reads a view: not reused
    a, b = await apair(GPU, GPU)
    await a.send(fake.tensor(torch.full((4096,), 2.0)))
    y = await b.receive()
    await a.aclose()
    c, d = await apair(GPU, GPU)
    async with c, d:
        await c.send(fake.tensor(torch.zeros(4096)))
        assert torch.equal(await d.receive(), torch.zeros(4096))
        assert fake.pools_allocated == 2
        assert torch.equal(y, torch.full((4096,), 2.0))  # untouched by the new connection
        await until(lambda: cuda_in_use(c) == 0)
    del y
    gc.collect()
    assert lingering_pools() == 1  # a's block: b is still connected
    await b.aclose()  # b opens nothing any more, and maps nothing: a's block is free
    assert lingering_pools() == 0
    assert drop_idle_pools() == 2  # c's block, and a's once b let go of it
    assert not fake.limbo and fake.blocks_freed == 2


async def test_a_reused_block_is_exported_again_with_a_fresh_counter(fake) -> None:
    """Defect 1: every connection gets an export (and reference counter) of its own;
    the counter of an earlier connection, already released, is never announced again."""
    for i in range(3):
        a, b = await apair(GPU, GPU)
        async with a, b:
            await a.send(fake.tensor(torch.ones(4096)))
            assert torch.equal(await b.receive(), torch.ones(4096))
            await until(lambda: cuda_in_use(a) == 0)  # noqa: B023
            assert fake.exports == i + 1, "the block was announced with an old export"
            assert fake.counter(fake.exported[-1]) == 1  # fresh, not yet released
    assert fake.pools_allocated == 1  # one block, three exports
    assert [fake.counter(e) for e in fake.exported] == [0, 0, 0]  # each released at close


async def test_small_cuda_tensors_go_inline(fake) -> None:
    a, b = await apair(GPU, GPU)
    async with a, b:
        await a.send(fake.tensor(torch.ones(10)))
        got = await b.receive()
        assert torch.equal(got, torch.ones(10))
        assert fake.pools_allocated == 0


async def test_release_waits_for_the_consumers_event(fake) -> None:
    """The slot is acknowledged only once the consumer's release event completed."""
    a, b = await apair(GPU, GPU)
    async with a, b:
        await a.send(fake.tensor(torch.ones(4096)))
        y = await b.receive()
        assert cuda_in_use(a) == 1
        fake.gate.clear()  # the consumer's "kernels" are still running
        del y
        gc.collect()
        await until(lambda: fake.release_events == 1)
        await anyio.sleep(0.05)
        assert cuda_in_use(a) == 1 and fake.synchronized == 0
        fake.gate.set()
        await until(lambda: cuda_in_use(a) == 0)
        assert fake.synchronized == 1


async def test_receipts_complete_when_the_cuda_slots_come_back(fake) -> None:
    a, b = await apair(GPU, GPU)
    async with a, b:
        receipt = await a.send_tracked({"x": fake.tensor(torch.ones(4096)), "n": 1})
        got = await b.receive()
        await anyio.sleep(0.05)
        assert not receipt.consumed and receipt.slots == 1
        del got
        gc.collect()
        with anyio.fail_after(5):
            await receipt.wait()
        assert receipt.consumed


async def test_explicit_release_and_copy_out(fake) -> None:
    a, b = await apair(GPU, GPU)
    async with a, b:
        await a.send([fake.tensor(torch.ones(4096)), fake.tensor(torch.zeros(4096))])
        got = await b.receive()
        assert release(got) == 2
        await until(lambda: cuda_in_use(a) == 0)
    c, d = await apair(GPU, None, b_copy_out=True)
    async with c, d:
        await c.send(fake.tensor(torch.full((4096,), 3.0)))
        y = await d.receive()
        # a private clone: memory of its own, in no pool mapping (the fake's clone of a
        # view is host memory; on a GPU it is a device tensor of its own)
        assert not fake.is_device_tensor(y)
        await until(lambda: cuda_in_use(c) == 0)  # the slot went back, y alive
        # the slot is used again: a view into it (a use after release) would now read 9
        await c.send(fake.tensor(torch.full((4096,), 9.0)))
        z = await d.receive()
        assert torch.equal(z, torch.full((4096,), 9.0))
        assert torch.equal(y, torch.full((4096,), 3.0))


async def test_loans_on_the_device_are_zero_copy(fake) -> None:
    a, b = await apair(GPU, GPU)
    async with a, b:
        x = await a.loan((256, 64), torch.float32, device="cuda:0")
        assert fake.is_device_tensor(x) and fake.pools_allocated == 1
        x.fill_(7.0)
        await a.send({"x": x})
        with pytest.raises(SlotMisuse):
            await a.send({"x": x})  # a loan is sent once
        got = await b.receive()
        assert torch.equal(got["x"], torch.full((256, 64), 7.0))
        assert fake.copies == 0
        del got, x
        gc.collect()
        await until(lambda: cuda_in_use(a) == 0)
        # a loan dropped unsent returns its slot
        z = await a.loan(1000, torch.int32, device="cuda")
        del z
        gc.collect()
        await until(lambda: cuda_in_use(a) == 0)
        with pytest.raises(ValueError, match="largest slot"):
            await a.loan((4 * MiB,), torch.uint8, device="cuda:0")
        with pytest.raises(TypeError, match="torch dtype"):
            await a.loan(10, np.float32, device="cuda:0")


def test_sync_loans_and_policies(fake) -> None:
    a, b = spair(GPU, GPU)
    with a, b:
        held = []
        for _ in range(2):  # the two 64 KiB CUDA slots
            a.send(fake.tensor(torch.ones(8192)))
            held.append(b.receive(timeout=5))
        # the 1 MiB slot takes a third small tensor (smallest free that fits)
        a.send(fake.tensor(torch.ones(8192)))
        held.append(b.receive(timeout=5))
        with pytest.raises(SlotsExhausted):
            a.send(fake.tensor(torch.ones(8192)), slot_policy="error")
        a.send(fake.tensor(torch.ones(8192)), slot_policy="inline")  # through the host
        assert torch.equal(b.receive(timeout=5), torch.ones(8192))
        assert a.statistics().inline_fallbacks == 1

        def drop_later() -> None:
            time.sleep(0.2)
            held.pop()
            gc.collect()

        t = threading.Thread(target=drop_later)
        t.start()
        a.send(fake.tensor(torch.full((8192,), 2.0)), timeout=10)  # policy wait
        t.join()
        assert torch.equal(b.receive(timeout=5), torch.full((8192,), 2.0))
        loan = a.loan(100, torch.float32, device="cuda:0", slot_policy="inline")
        assert loan.shape == (100,)
        held.clear()
        del loan


async def test_stage_policy_sends_through_host_slots(fake) -> None:
    cfg = SlotConfig(
        classes=(SlotClass(64 * KiB, 4),), threshold=1024, cuda="stage", cuda_threshold=1024
    )
    a, b = await apair(cfg, cfg)
    async with a, b:
        await a.send(fake.tensor(torch.arange(4096)))
        y = await b.receive()
        assert torch.equal(y, torch.arange(4096)) and not fake.is_device_tensor(y)
        assert fake.pools_allocated == 0
        stats = a.statistics()
        assert stats.cuda_staged == 1 and stats.slots_in_use == 1
        del y


async def test_a_block_with_a_live_loan_is_not_given_to_another_connection(fake) -> None:
    a, b = await apair(GPU, GPU)
    async with a, b:
        x = await a.loan(1000, torch.float32, device="cuda:0")  # kept past the close
    c, d = await apair(GPU, GPU)
    async with c, d:
        await c.send(fake.tensor(torch.ones(4096)))
        assert torch.equal(await d.receive(), torch.ones(4096))
    assert fake.pools_allocated == 2  # a's block still has the loan: not reused
    x.fill_(1.0)  # and its memory is still there
    del x
    gc.collect()
    assert drop_idle_pools() == 1  # c's; a's went with the loan
    assert not fake.limbo and fake.blocks_freed == 2


async def test_a_block_is_exported_a_bounded_number_of_times(fake, monkeypatch) -> None:
    """torch nests one sent-data record per export until the block is freed."""
    monkeypatch.setattr(cudablocks, "MAX_EXPORTS", 2)
    for _ in range(3):
        a, b = await apair(GPU, GPU)
        async with a, b:
            await a.send(fake.tensor(torch.ones(4096)))
            assert torch.equal(await b.receive(), torch.ones(4096))
    assert fake.exports == 3 and fake.pools_allocated == 2  # freed after two, then anew
    assert drop_idle_pools() == 1 and not fake.limbo


async def test_without_cuda_the_consumer_refuses_ext5_clearly(fake) -> None:
    a, b = await apair(GPU, GPU)
    async with a, b:
        await a.send(fake.tensor(torch.ones(4096)))
        set_cuda_backend(None, probe=False)  # the consumer process has no CUDA
        with pytest.raises(DecodeError, match="no CUDA"):
            await b.receive()
        set_cuda_backend(fake)
        await until(lambda: cuda_in_use(a) == 0)  # refused, and its slot given back
    assert drop_idle_pools() == 1
    assert not fake.limbo and fake.blocks_freed == 1  # nobody opened it: released


async def test_a_dropped_block_is_freed_not_left_in_torchs_limbo(fake) -> None:
    """Defect 2: a consumer in this process never opens the IPC handle, so nothing
    decrements the block's counter; ringwire releases it itself before dropping."""
    a, b = await apair(GPU, GPU)
    async with a, b:
        await a.send(fake.tensor(torch.ones(4096)))
        y = await b.receive()
        assert torch.equal(y, torch.ones(4096))
        del y
        gc.collect()
        await until(lambda: cuda_in_use(a) == 0)
    assert drop_idle_pools() == 1
    assert not fake.limbo, "the dropped block waits in torch's limbo until exit"
    assert fake.blocks_freed == 1
    assert fake.counters_released == 1 and fake.collects >= 1


async def test_closing_right_after_sending_keeps_cuda_records_readable(fake) -> None:
    """Defect 3: ``aclose`` promises the peer receives what was sent; the GPU block,
    its events and the local entry stay until the consumer is done."""
    a, b = await apair(GPU, GPU)
    await a.send([fake.tensor(torch.full((4096,), 3.0)), "x"])
    await a.send(fake.tensor(torch.arange(4096.0)))
    await a.aclose()  # at once: nothing was read yet
    got = await b.receive()
    assert torch.equal(got[0], torch.full((4096,), 3.0)) and got[1] == "x"
    assert lingering_pools() == 1  # a's block waits for b
    y = await b.receive()
    assert torch.equal(y, torch.arange(4096.0))
    c, d = await apair(GPU, GPU)  # another connection meanwhile gets another block
    async with c, d:
        await c.send(fake.tensor(torch.zeros(4096)))
        assert torch.equal(await d.receive(), torch.zeros(4096))
    assert fake.pools_allocated == 2
    assert torch.equal(y, torch.arange(4096.0)) and torch.equal(got[0], torch.full((4096,), 3.0))
    del got, y
    gc.collect()
    await b.aclose()
    assert lingering_pools() == 0
    assert drop_idle_pools() == 2 and not fake.limbo


async def test_a_device_this_process_does_not_see_is_refused_by_uuid(fake) -> None:
    """Defect 5: the reference names its device by UUID; a consumer that does not see
    that device refuses it clearly (it would otherwise use the producer's number)."""
    a, b = await apair(GPU, GPU)
    async with a, b:
        await a.send(fake.tensor(torch.ones(4096)))
        other = FakeCudaBackend(1, uuids=[default_uuid(7)])  # another GPU as cuda:0
        set_cuda_backend(other)
        with pytest.raises(DecodeError, match="does not see"):
            await b.receive()
        set_cuda_backend(fake)
        await until(lambda: cuda_in_use(a) == 0)  # refused, and its slot given back
        await a.send(fake.tensor(torch.ones(4096)))
        assert torch.equal(await b.receive(), torch.ones(4096))  # the connection lives on


async def test_the_release_thread_waits_with_the_events_device_current(fake) -> None:
    """The release thread makes the event's device current (no context on GPU 0)."""
    two = FakeCudaBackend(2)
    set_cuda_backend(two)
    try:
        a, b = await apair(GPU, GPU)
        async with a, b:
            await a.send(two.tensor(torch.ones(4096), device=1))
            y = await b.receive()
            assert two.device_index(y) == 1
            del y
            gc.collect()
            await until(lambda: cuda_in_use(a) == 0)
        assert two.sync_devices == [1]
    finally:
        set_cuda_backend(fake)
    assert drop_idle_pools() == 1


async def test_a_record_dropped_unread_releases_its_cuda_slots(fake) -> None:
    a, b = await apair(GPU, GPU)
    async with a, b:
        await a.send(fake.tensor(torch.ones(4096)))  # opens the pool
        del_me = await b.receive()
        del del_me
        gc.collect()
        await until(lambda: cuda_in_use(a) == 0)
        await a.send([fake.tensor(torch.ones(4096)), "x"])
        with pytest.raises(DecodeError):
            await b.receive(type=list[int])
        await until(lambda: cuda_in_use(a) == 0)


# ======================================================================================
# refusals


def forged(good: CudaRef, **changes: Any) -> CudaRef:
    return msgspec.structs.replace(good, **changes)


async def test_forged_cuda_references_are_refused(fake) -> None:
    a, b = await apair(GPU, GPU)
    c, d = await apair(GPU, GPU)
    async with a, b, c, d:
        await a.send(fake.tensor(torch.ones(4096)))
        held = await b.receive()
        await c.send(fake.tensor(torch.ones(4096)))
        other = await d.receive()
        pool = a._core.pool.cuda_pools[0]  # type: ignore[union-attr]
        good = pool.ref(0, pool.layout.offsets[0], 16384, torch.ones(4096))
        foreign = c._core.pool.cuda_pools[0]  # type: ignore[union-attr]
        peer = b._core.peer
        assert peer is not None
        attacks = {
            "foreign pool": forged(good, pool=foreign.layout.pool_id),
            "unannounced pool": forged(good, pool=cuda_pool_id(peer.layout.pool_id, 1), device=0),
            "device not visible": forged(
                good,
                device=3,
                pool=cuda_pool_id(peer.layout.pool_id, 3),
                device_uuid=default_uuid(3),
            ),
            "device out of range (no uuid)": forged(
                good, device=3, pool=cuda_pool_id(peer.layout.pool_id, 3), device_uuid=b""
            ),
            "another pool's announcement": forged(  # device 1's id, cuda:0's uuid
                good, device=1, pool=cuda_pool_id(peer.layout.pool_id, 1)
            ),
            "bad slot": forged(good, slot=9),
            "held twice / stale": good,
            "old generation": forged(good, generation=0, slot=0),
            "past the slot": forged(good, offset=good.offset + 64 * KiB - 1024),
            "misaligned": forged(good, offset=good.offset + 2, nbytes=8, shape=(2,)),
        }
        for what, ref in attacks.items():
            with pytest.raises(DecodeError):
                peer.resolve(ref)
            assert cuda_in_use(a) == 1, what
        # an unknown pool with an announcement that does not parse
        bad = forged(good, pool=cuda_pool_id(peer.layout.pool_id, 0) ^ 1)
        with pytest.raises(DecodeError, match="not this connection"):
            peer.resolve(bad)
        # over the wire: the bad record breaks nothing else
        await a.send(forged(good, slot=9))
        with pytest.raises(DecodeError):
            await b.receive()
        del held, other
        gc.collect()
        await until(lambda: cuda_in_use(a) == 0 and cuda_in_use(c) == 0)
        await a.send(fake.tensor(torch.full((4096,), 5.0)))
        assert torch.equal(await b.receive(), torch.full((4096,), 5.0))


async def test_forged_cuda_releases_break_only_that_connection(fake) -> None:
    a, b = await apair(GPU, GPU)
    async with a, b:
        await a.send(fake.tensor(torch.ones(4096)))
        y = await b.receive()
        peer = b._core.peer
        assert peer is not None
        peer.queue.push(cuda_tag(0, 1), 0)  # a slot never given
        with pytest.raises(BrokenResourceError):
            with anyio.fail_after(5):
                while True:
                    a.statistics()
                    await a.send(b"ping")
                    await anyio.sleep(0.01)
        del y
