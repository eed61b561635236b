"""A hostile peer speaking the protocol.

Each attack is made by a client that connected properly and then writes raw bytes
where an honest peer would not: forged Ext 4 / Ext 5 references, releases it has no
right to, frames with lying lengths, garbage on the control socket.  A listener also
faces raw-socket clients with oversized or malformed handshakes, and a client faces a
hostile listener.  For every one:

* it is refused with a clear error (the listener logs why it dropped the connection);
* it breaks only that connection: another client on the same Listener goes on sending
  and receiving tensors through slots both ways;
* it never corrupts a producer's pool: the statistics of every pool stay right
  (nothing in use once everything is released, nothing freed that was not released)
  and later sends work.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
from support.extras import TORCH_ABSENT_ERROR, needs_torch, torch, torch_error

from ringwire import DecodeError
from ringwire._conn.async_channel import Channel
from ringwire._conn.connect import connect, connect_sync
from ringwire._conn.listener import Listener, listen
from ringwire._conn.pair import pair
from ringwire._conn.sync_listener import SyncListener
from ringwire._errors import HandshakeError, ProtocolError, RingCorrupted, SlotRefused
from ringwire._pool.segment import SHM_DIR, Segment
from ringwire._pool.slotconfig import SlotConfig
from ringwire._shm.sockets import bind_unix_socket
from ringwire._wire.control import (
    MAX_MESSAGE,
    Hello,
    Refused,
    RingSpec,
    SegmentSpec,
    Welcome,
    encode_message,
)
from ringwire._wire.descriptors import CudaRef, SlotRef
from ringwire._wire.ring import WRAP_MARKER, ring_size
from ringwire._wire.slotlayout import SENT, SlotClass, slot_state

from anyio import BrokenResourceError, EndOfStream  # isort: skip

KiB, MiB = 1 << 10, 1 << 20
POOL = SlotConfig(classes=(SlotClass(64 * KiB, 4), SlotClass(1 * MiB, 2)), threshold=1024)
FREE_ALL = {64 * KiB: 4, 1 * MiB: 2}
Ext = msgspec.msgpack.Ext

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


def our_names() -> set[str]:
    prefix = f"rw.{os.getpid()}."
    return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}


# ------------------------------------------------------------------------ the scene


@dataclass
class Scene:
    lst: Listener
    good: Channel  # an honest client
    srv_good: Channel  # the listener's end of it
    bad: Channel  # the client that turns hostile
    srv_bad: Channel

    def drop_reasons(self, caplog: pytest.LogCaptureFixture) -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "ringwire" and ("dropped" in r.getMessage() or "broken" in r.getMessage())
        ]


@contextlib.asynccontextmanager
async def scene(tmp_path: Any, bad_capacity: int = 1 << 20) -> AsyncIterator[Scene]:
    path = str(tmp_path / "h.sock")
    async with listen(path, slots=POOL, spin_us=0) as lst:
        good = await connect(path, slots=POOL, spin_us=0)
        srv_good = await lst.accept()
        bad = await connect(path, slots=POOL, spin_us=0, capacity=bad_capacity)
        srv_bad = await lst.accept()
        try:
            yield Scene(lst, good, srv_good, bad, srv_bad)
        finally:
            for c in (good, bad):
                await c.aclose()


def pool_stats(ch: Channel) -> dict[str, Any]:
    s = ch.statistics()  # a safe point: pending releases are processed
    return {
        "in_use": s.slots_in_use,
        "free": s.slots_free,
        "releases": s.releases_received,
        "held": s.slot_arrays_held,
    }


def _sent(c: Channel) -> int:
    st = c.statistics()
    return st.slots_in_use - st.loans_outstanding


async def settle(*chans: Channel) -> None:
    """Let finalizer releases reach their producers (loans stay in use)."""
    with anyio.fail_after(5):
        while any(_sent(c) for c in chans):
            await anyio.sleep(0.005)


async def good_round_trip(s: Scene, n: int = 3) -> None:
    """The honest client and the listener exchange slot tensors both ways."""
    before = (pool_stats(s.good)["releases"], pool_stats(s.srv_good)["releases"])
    for i in range(n):
        x = np.arange(20_000 + i, dtype=np.int64)  # 160 KB: a 1 MiB slot
        await s.good.send({"i": i, "x": x})
        with anyio.fail_after(5):
            conn, rec = await s.lst.receive()
        assert conn is s.srv_good and rec["i"] == i and (rec["x"] == x).all()
        await conn.send({"y": rec["x"] * 2})
        del rec
        with anyio.fail_after(5):
            back = await s.good.receive()
        assert (back["y"] == 2 * x).all()
        del back
    await settle(s.good, s.srv_good)
    for ch, old in zip((s.good, s.srv_good), before):
        st = pool_stats(ch)
        assert st["in_use"] == 0 and st["free"] == FREE_ALL and st["held"] == 0, st
        assert st["releases"] == old + n, (st, old)


async def until_dropped(s: Scene, caplog: pytest.LogCaptureFixture) -> str:
    """Run the listener's fan-in until it drops the hostile connection; its reason."""
    with anyio.fail_after(5):
        while s.lst.statistics().broken < 1:
            with anyio.move_on_after(0.05):
                conn, rec = await s.lst.receive()
                assert conn is s.srv_good, f"the hostile connection delivered {rec!r}"
    assert s.srv_bad not in s.lst.connections and s.srv_good in s.lst.connections
    assert s.srv_bad.closed
    reasons = s.drop_reasons(caplog)
    assert reasons, "the listener did not log why it dropped the connection"
    return reasons[-1]


async def hostile_end_sees_the_break(bad: Channel) -> None:
    with anyio.fail_after(5):
        with pytest.raises((BrokenResourceError, EndOfStream)):
            while True:
                await bad.send(1)
                await anyio.sleep(0.01)


def producer_pool_is_whole(ch: Channel, *, releases: int, loans: int = 0) -> None:
    """After the break: every slot sent on the connection is back in the pool, nothing
    freed twice, the statistics add up (``releases`` counts only the honest releases;
    ``loans`` slots were loaned by the producer itself and stay loaned)."""
    pool = ch._core.pool
    assert pool is not None
    alloc = pool.alloc
    st = pool.statistics()
    assert st["slots_in_use"] == loans and sum(st["slots_free"].values()) == 6 - loans, st
    assert st["releases_received"] == releases, st
    assert all(alloc.status(i) != SENT for i in range(6))
    free = sorted(s for lst in alloc._free.values() for s in lst)
    assert free == [i for i in range(6) if alloc.status(i) == 0]  # each free slot once


# ------------------------------------------------------------- forged references (Ext 4)


def _ref(**kw: Any) -> SlotRef:
    base = dict(
        version=1,
        pool=0,
        slot=0,
        generation=0,
        offset=0,
        nbytes=8,
        shape=(1,),
        dtype="<f8",
        kind="numpy",
    )
    base.update(kw)
    return SlotRef(**base)  # type: ignore[arg-type]


def _ref_to_slot(pool: Any, slot: int, **kw: Any) -> SlotRef:
    gen, _ = slot_state(pool.seg.buf, slot)
    fields = dict(
        pool=pool.layout.pool_id, slot=slot, generation=gen, offset=pool.layout.offsets[slot]
    )
    fields.update(kw)
    return _ref(**fields)


FORGERIES = [
    "another connection's pool",
    "the listener's own pool",
    "stale generation",
    "slot out of range",
    "past the slot",
    "past the segment",
    "a free slot",
    "a loaned slot",
    "referenced twice",
    "misaligned",
    "inconsistent nbytes",
    "malformed payload",
    "unknown version",
]


@pytest.mark.parametrize("forgery", FORGERIES)
async def test_forged_slot_reference_drops_only_that_connection(
    forgery: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ringwire")
    async with scene(tmp_path) as s:
        assert (
            s.good._core.pool is not None
            and s.bad._core.pool is not None
            and s.srv_bad._core.pool is not None
        )
        # honest traffic first: the good client's array is held by the listener
        held_x = np.arange(10_000.0)
        await s.good.send(held_x)
        conn, held = await s.lst.receive()
        assert conn is s.srv_good
        good_before = pool_stats(s.good)
        assert good_before["in_use"] == 1
        # the listener lends the hostile client a slot of its own pool, held throughout
        await s.srv_bad.send(np.ones(2048))
        kept = await s.bad.receive()
        # the hostile client's pool: slot 0 loaned, slot 1 sent, received and released
        # (so it is free at generation 1 and is the next slot a send takes), 2-5 unused
        bad_pool = s.bad._core.pool
        loaned = await s.bad.loan(512, np.float64)
        await s.bad.send(np.ones(4096))
        conn, got = await s.lst.receive()
        assert conn is s.srv_bad
        del got
        await settle(s.bad)
        nxt = bad_pool.alloc._free[64 * KiB][-1]
        assert (nxt, bad_pool.alloc.generation(nxt), bad_pool.alloc.status(0)) == (1, 1, 1)
        honest_after = True  # send an honest array right after the forgery: it takes
        # slot `nxt`, so that slot is SENT at generation 1 when the listener decodes
        v32k = {"nbytes": 32768, "shape": (4096,)}
        wire: Any
        if forgery == "another connection's pool":  # exactly what srv_good holds
            slot = next(i for i in range(6) if s.good._core.pool.alloc.status(i) == SENT)
            wire = _ref_to_slot(s.good._core.pool, slot, nbytes=80_000, shape=(10_000,))
        elif forgery == "the listener's own pool":
            await s.srv_bad.send(np.ones(2048))  # the listener's pool lends a slot...
            mine = await s.bad.receive()
            wire = _ref_to_slot(
                s.srv_bad._core.pool, 0, nbytes=16384, shape=(2048,)
            )  # ...named back
            del mine
        elif forgery == "stale generation":
            wire = _ref_to_slot(bad_pool, nxt, generation=0, **v32k)
        elif forgery == "slot out of range":
            wire = _ref(pool=bad_pool.layout.pool_id, slot=2**64 - 1, generation=1)
        elif forgery == "past the slot":
            wire = _ref_to_slot(bad_pool, nxt, offset=bad_pool.layout.offsets[nxt] + 64 * KiB - 4)
        elif forgery == "past the segment":
            wire = _ref_to_slot(bad_pool, 5, nbytes=2**40, shape=(2**37,))
        elif forgery == "a free slot":
            wire = _ref_to_slot(bad_pool, 2)
        elif forgery == "a loaned slot":
            wire = _ref_to_slot(bad_pool, 0)
        elif forgery == "referenced twice":
            await s.bad.send(np.ones(4096))
            conn, again = await s.lst.receive()  # held by the listener...
            assert conn is s.srv_bad
            wire = [_ref_to_slot(bad_pool, nxt, **v32k)]  # ...and named again
            honest_after = False
        elif forgery == "misaligned":
            wire = _ref_to_slot(bad_pool, nxt, offset=bad_pool.layout.offsets[nxt] + 4)
        elif forgery == "inconsistent nbytes":
            wire = Ext(4, msgspec.msgpack.encode(_ref_to_slot(bad_pool, nxt, nbytes=7)))
        elif forgery == "malformed payload":
            wire = Ext(4, b"\x99garbage")
        else:
            wire = Ext(4, msgspec.msgpack.encode(_ref_to_slot(bad_pool, nxt, version=2)))
        await s.bad.send(wire)
        if honest_after:
            await s.bad.send(np.ones(4096))
            assert bad_pool.alloc.status(nxt) == SENT and bad_pool.alloc.generation(nxt) == 1
        await s.bad.send("after the forgery")  # never delivered
        if forgery == "referenced twice":
            # the listener closes a connection whose array we still hold: it says so
            with pytest.warns(ResourceWarning, match="received slot array"):
                reason = await until_dropped(s, caplog)
        else:
            reason = await until_dropped(s, caplog)
        assert "slot" in reason.lower() or "Ext 4" in reason, reason
        del loaned, kept
        if forgery == "referenced twice":
            del again
        await hostile_end_sees_the_break(s.bad)
        # the honest connection: its pool untouched by the forgery, traffic goes on
        assert pool_stats(s.good) == good_before
        assert (held == held_x).all()
        del held
        await good_round_trip(s)
        # the listener's own pool for the hostile connection: the slot the hostile
        # client held is reclaimed (by the close: publish=False), the statistics add up
        assert s.srv_bad._core.pool.reclaimed == 1
        producer_pool_is_whole(s.srv_bad, releases=int(forgery == "the listener's own pool"))
    assert not our_names()


async def test_forged_reference_on_a_pair_is_a_clear_decode_error() -> None:
    """Outside a listener the consumer decides: the bad record is a DecodeError naming
    the problem, and the connection goes on (docs/guide/tensors.md)."""
    a, b = pair()
    async with anyio.create_task_group() as tg:
        out: dict[str, Channel] = {}

        async def conn_b() -> None:
            out["b"] = await b.connect(slots=POOL)

        tg.start_soon(conn_b)
        ca = await a.connect(slots=POOL)
    cb = out["b"]
    async with ca, cb:
        assert ca._core.pool is not None
        cases = {
            "not this connection's": _ref(pool=ca._core.pool.layout.pool_id ^ 1),
            "of a 6-slot pool": _ref(pool=ca._core.pool.layout.pool_id, slot=6),
            "lies outside slot": _ref_to_slot(ca._core.pool, 0, offset=0),
            "is stale": _ref_to_slot(ca._core.pool, 0),  # free: never sent
        }
        for match, ref in cases.items():
            await ca.send(ref)
            with pytest.raises(DecodeError, match=match):
                await cb.receive()
        await ca.send(np.arange(9000))
        assert (await cb.receive())[-1] == 8999
        await settle(ca)
        assert pool_stats(ca)["releases"] == 1


# -------------------------------------------------------------------- forged Ext 5


@pytest.mark.parametrize("with_pool", [True, False])
async def test_cuda_reference_without_cuda_support(
    with_pool: bool, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Ext 5 to a receiver that resolves no CUDA references (no CUDA pool on this
    connection, or no pool at all): a clear DecodeError, and only that connection is
    dropped.  (Forged CUDA references against a real CUDA pool -- foreign pool, stale
    generation, bounds -- belong with the CUDA IPC resolver and its GPU tests.)"""
    caplog.set_level(logging.WARNING, logger="ringwire")
    path = str(tmp_path / "c.sock")
    slots = POOL if with_pool else None
    async with listen(path, slots=slots, spin_us=0) as lst:
        async with (
            await connect(path, slots=slots) as good,
            await connect(path, slots=slots) as bad,
        ):
            srv_good = await lst.accept()
            await lst.accept()
            ref = CudaRef(1, 0xC0DA, 0, 0, 0, 0, 16, (4,), "float32", b"\x00" * 64)
            await bad.send({"t": ref})
            s = Scene(lst, good, srv_good, bad, lst.connections[1])
            reason = await until_dropped(s, caplog)
            if torch is None:  # a process without torch cannot check its torch dtype
                assert re.search(TORCH_ABSENT_ERROR, reason), reason
            else:  # (without a pool: _no_pool's "a slot reference ... no slot pool")
                assert "CUDA" in reason or "Ext 5" in reason or "no slot pool" in reason, reason
            await good.send(np.arange(5000))
            conn, got = await lst.receive()
            assert conn is srv_good and got[-1] == 4999
            del got
    # a pair: the DecodeError itself
    a, b = pair()
    async with anyio.create_task_group() as tg:
        out: dict[str, Channel] = {}

        async def conn_b() -> None:
            out["b"] = await b.connect(slots=slots)

        tg.start_soon(conn_b)
        ca = await a.connect(slots=slots)
    async with ca, out["b"] as cb:
        await ca.send(ref)
        with pytest.raises(DecodeError, match=torch_error("CUDA|Ext 5|pool")):
            await cb.receive()
        await ca.send("still fine")
        assert await cb.receive() == "still fine"


CUDA_FORGERIES = [
    "another connection's GPU pool",
    "stale generation",
    "past the slot",
    "slot out of range",
    "a device with no pool",
]


@needs_torch  # the simulated CUDA backend hands out torch tensors
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the GPU path is backend-blind
@pytest.mark.parametrize("forgery", CUDA_FORGERIES)
async def test_forged_cuda_reference_drops_only_that_connection(
    forgery: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Ext 5 against a consumer that does resolve CUDA references (the simulated CUDA
    backend of tests/support/cuda_fake.py): a forged one is refused, only its connection
    is dropped, and every GPU pool's statistics stay right.  (tests/unit/test_cuda.py
    checks the same refusals one by one on a pair.)"""
    import gc

    import torch
    from support.cuda_fake import install

    from ringwire._pool.cuda import cuda_pool_id, drop_idle_pools, set_cuda_backend

    gpu = SlotConfig(
        classes=(SlotClass(64 * KiB, 4),),
        threshold=1024,
        cuda_threshold=1024,
        cuda_classes=(SlotClass(64 * KiB, 2), SlotClass(1 * MiB, 1)),
    )
    fake = install()
    caplog.set_level(logging.WARNING, logger="ringwire")
    path = str(tmp_path / "gpu.sock")
    try:
        async with listen(path, slots=gpu, spin_us=0) as lst:
            good = await connect(path, slots=gpu, spin_us=0)
            srv_good = await lst.accept()
            bad = await connect(path, slots=gpu, spin_us=0)
            srv_bad = await lst.accept()
            try:
                s = Scene(lst, good, srv_good, bad, srv_bad)
                await good.send(fake.tensor(torch.ones(4096)))
                conn, held = await lst.receive()  # the listener holds the good client's slot
                assert conn is srv_good
                await bad.send(fake.tensor(torch.ones(4096)))  # opens bad's pool...
                conn, got = await lst.receive()
                assert conn is srv_bad
                del got  # ...and gives its slot 0 back (generation 1 now)
                gc.collect()
                with anyio.fail_after(5):
                    while bad.statistics().cuda_slots_in_use:
                        await anyio.sleep(0.002)
                mine = bad._core.pool.cuda_pools[0]  # type: ignore[union-attr]
                theirs = good._core.pool.cuda_pools[0]  # type: ignore[union-attr]
                ref = mine.ref(0, mine.layout.offsets[0], 16384, torch.ones(4096))
                if forgery == "another connection's GPU pool":
                    ref = theirs.ref(0, theirs.layout.offsets[0], 16384, torch.ones(4096))
                elif forgery == "stale generation":
                    ref = msgspec.structs.replace(ref, generation=0)
                elif forgery == "past the slot":
                    ref = msgspec.structs.replace(ref, offset=ref.offset + 64 * KiB - 1024)
                elif forgery == "slot out of range":
                    ref = msgspec.structs.replace(ref, slot=2**40)
                else:
                    pool_id = cuda_pool_id(srv_bad._core.peer.layout.pool_id, 3)  # type: ignore[union-attr]
                    ref = msgspec.structs.replace(ref, device=3, pool=pool_id)
                good_gpu = good.statistics().cuda_slots_in_use
                await bad.send({"t": ref})
                reason = await until_dropped(s, caplog)
                assert "CUDA" in reason or "Ext 5" in reason or "pool" in reason, reason
                await hostile_end_sees_the_break(bad)
                assert good.statistics().cuda_slots_in_use == good_gpu == 1
                assert torch.equal(held, torch.ones(4096))
                del held
                gc.collect()
                await good.send(fake.tensor(torch.full((4096,), 3.0)))
                conn, again = await lst.receive()
                assert conn is srv_good and torch.equal(again, torch.full((4096,), 3.0))
                del again
                gc.collect()
                with anyio.fail_after(5):
                    while good.statistics().cuda_slots_in_use:
                        await anyio.sleep(0.002)
                assert good.statistics().cuda_slots_free == {"cuda:0": {64 * KiB: 2, MiB: 1}}
            finally:
                await good.aclose()
                await bad.aclose()
    finally:
        set_cuda_backend(None)
        drop_idle_pools()
        gc.collect()


# ------------------------------------------------------------------- forged releases


RELEASES = [
    "double release",
    "never given",
    "out of range",
    "stale generation",
    "loaned slot",
    "frame not a multiple of 16",
    "lying lane frame length",
    "lane tail past its capacity",
]


@pytest.mark.parametrize("attack", RELEASES)
async def test_forged_release_breaks_only_that_connection(
    attack: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ringwire")
    async with scene(tmp_path) as s:
        prod = s.srv_bad._core.pool  # the listener's send pool for the hostile connection
        peer = s.bad._core.peer  # the hostile client's view of it (its release lane writer)
        assert prod is not None and peer is not None
        # honest: two arrays sent, one released (finalizer), one still held
        await s.srv_bad.send([np.ones(4096), np.full(4096, 2.0)])
        first, kept = await s.bad.receive()
        slot_first = next(iter(peer.held))
        del first
        await settle_until(lambda: prod.statistics()["slots_in_use"] == 1, s.srv_bad)
        assert prod.releases_received == 1
        ((slot_kept, gen_kept),) = peer.held.items()
        gen_first = prod.alloc.generation(slot_first) - 1
        loan = await s.srv_bad.loan(100, np.float64)  # a slot the listener is filling
        slot_loaned = next(i for i in range(6) if prod.alloc.status(i) == 1)
        w = peer._writer

        def put(*pairs: tuple[int, int]) -> None:
            assert w.put(b"".join(struct.pack("=QQ", sl, g) for sl, g in pairs))

        if attack == "double release":
            put((slot_first, gen_first))
        elif attack == "never given":
            put((5, 0))
        elif attack == "out of range":
            put((2**64 - 1, 0))
        elif attack == "stale generation":
            put((slot_kept, gen_kept + 1))
        elif attack == "loaned slot":
            put((slot_loaned, prod.alloc.generation(slot_loaned)))
        elif attack == "frame not a multiple of 16":
            assert w.put(b"\x00" * 24)
        elif attack == "lying lane frame length":
            pos = w._tail & w._mask
            w._d32[pos >> 2] = 0x7FFFFFF0
            w._tail += 16
            w._q[8] = w._tail
        else:
            w._q[8] = w._tail + w.capacity + 8
        s.bad._core.transport._sock.send(b"S")  # "I freed space": the listener processes its lane
        reason = await until_dropped(s, caplog)
        expected = (
            SlotRefused if "lane" not in attack and "multiple" not in attack else RingCorrupted
        )
        assert isinstance(s.srv_bad._core.broken, expected), s.srv_bad._core.broken
        assert "release" in reason or "frame" in reason or "tail" in reason, reason
        del kept, loan
        await hostile_end_sees_the_break(s.bad)
        # the producer's pool: the honest release counted once, the held slot and the
        # loan reclaimed, no slot freed twice -- and the honest connection goes on
        assert prod.releases_received == 1
        producer_pool_is_whole(s.srv_bad, releases=1, loans=1)
        await good_round_trip(s)
    assert not our_names()


async def settle_until(pred: Any, *chans: Channel) -> None:
    with anyio.fail_after(5):
        while True:
            for c in chans:
                c.statistics()
            if pred():
                return
            await anyio.sleep(0.005)


# ------------------------------------------------------------ lying frames in the ring


FRAMES = [
    "length past the largest payload",
    "length past the tail",
    "across the end of the ring",
    "wrap marker at the start",
    "tail runs backwards",
    "tail past head + capacity",
    "garbage doorbell",
]


def _bin_record(n: int) -> bytes:
    """A valid msgpack record (bytes) of exactly ``n`` >= 4 bytes."""
    if n >= 258:
        return b"\xc5" + (n - 3).to_bytes(2, "big") + b"x" * (n - 3)
    return b"\xc4" + bytes([n - 2]) + b"x" * (n - 2)


async def walk_to(s: Scene, left: int) -> None:
    """Honest records until the hostile writer's position is ``left`` bytes before the
    end of its ring (the listener takes them all)."""
    tx = s.bad._core.tx
    while (tx.capacity - (tx._tail & tx._mask)) % tx.capacity != left:
        room = (tx.capacity - (tx._tail & tx._mask)) - left
        if room <= 0:
            room += tx.capacity
        assert tx.try_write(_bin_record(min(room, 2048) - 4))
        s.bad._core.transport._sock.send(b"D")
        with anyio.fail_after(5):
            conn, rec = await s.lst.receive()
        assert conn is s.srv_bad and set(rec) == {ord("x")}


@pytest.mark.parametrize("attack", FRAMES)
async def test_lying_frames_break_only_that_connection(
    attack: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ringwire")
    async with scene(tmp_path, bad_capacity=4096) as s:
        await s.bad.send("honest first")
        conn, rec = await s.lst.receive()
        assert conn is s.srv_bad and rec == "honest first"
        tx = s.bad._core.tx
        pos = tx._tail & tx._mask
        expect = "bad frame length"
        if attack == "length past the largest payload":
            tx._d32[pos >> 2] = 0x7FFFFFF0
            tx._q[8] = tx._tail + 8
        elif attack == "length past the tail":
            tx._d32[pos >> 2] = 1000
            tx._q[8] = tx._tail + 64
        elif attack == "across the end of the ring":
            await walk_to(s, 16)  # 16 bytes before the end, a 100-byte frame is announced
            tx._d32[(tx._tail & tx._mask) >> 2] = 100
            tx._q[8] = tx._tail + 112
            expect = "across the end"
        elif attack == "wrap marker at the start":
            await walk_to(s, 0)  # at offset 0, where no writer puts a wrap marker
            tx._d32[0] = WRAP_MARKER
            tx._q[8] = tx._tail + 8
            expect = "wrap marker at the start"
        elif attack == "tail runs backwards":
            tx._q[8] = tx._tail - 8
            expect = "out of range"
        elif attack == "tail past head + capacity":
            tx._q[8] = tx._tail + tx.capacity + 8
            expect = "out of range"
        else:
            expect = "unexpected bytes on the control socket"
        s.bad._core.transport._sock.send(b"?" if attack == "garbage doorbell" else b"D")
        reason = await until_dropped(s, caplog)
        assert expect in reason, reason
        cause = ProtocolError if attack == "garbage doorbell" else RingCorrupted
        assert isinstance(s.srv_bad._core.broken, cause), s.srv_bad._core.broken
        await hostile_end_sees_the_break(s.bad)
        producer_pool_is_whole(s.srv_bad, releases=0)
        await good_round_trip(s)
    assert not our_names()


# ------------------------------------------------------------- hostile handshakes


def _hello(**kw: Any) -> Hello:
    args: dict[str, Any] = dict(
        versions=[1],
        pid=os.getpid(),
        segments=[SegmentSpec(f"/rw.{os.getpid()}.0123456789ab", 2 * ring_size(1024))],
        c2s=RingSpec(0, 0, 1024),
        s2c=RingSpec(0, ring_size(1024), 1024),
    )
    args.update(kw)
    return Hello(**args)


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


HANDSHAKES: dict[str, Any] = {
    "length past MAX_MESSAGE": (MAX_MESSAGE + 1).to_bytes(4, "big") + b"\x80" * 64,
    "a 4 GiB length": b"\xff\xff\xff\xff" + b"x" * 100,
    "zero length": b"\x00\x00\x00\x00",
    "1 MiB of garbage": b"\x7f" * (1 << 20),
    "a valid length, then a stall": MAX_MESSAGE.to_bytes(4, "big") + b"\x88" * 1000,
    "bad UTF-8": _frame(b"\x82\xa4type\xa5hello\xa5magic\xa2\xff\xfe"),
    "not a hello": encode_message(Welcome(version=1, pid=1)),
    "17 segments": encode_message(_hello(segments=[SegmentSpec("/rw.1.0123456789ab", 4096)] * 17)),
    "a name outside ringwire's": encode_message(
        _hello(segments=[SegmentSpec("/../../etc/passwd", 2 * ring_size(1024))])
    ),
    "a segment that does not exist": encode_message(_hello()),
    # a name another process made (visible in /dev/shm during its own handshake)
    "another process's segment": encode_message(
        _hello(segments=[SegmentSpec("/rw.1.0123456789ab", 2 * ring_size(1024))])
    ),
    "a 1 TiB ring": encode_message(
        _hello(
            segments=[SegmentSpec("/rw.1.0123456789ab", 1 << 40)],
            c2s=RingSpec(0, 0, 1 << 30),
            s2c=RingSpec(0, 1 << 31, 1 << 30),
        )
    ),
    "64 KiB of features": encode_message(_hello(features=["f" * 60] * 1000)),
    "huge versions list": encode_message(_hello(versions=list(range(2, 12_000)))),
}


async def test_hostile_handshakes_are_refused_and_the_listener_keeps_working(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ringwire")
    path = str(tmp_path / "hs.sock")
    before = our_names()
    async with listen(path, slots=POOL, spin_us=0, handshake_timeout=1.0) as lst:
        good = await connect(path, slots=POOL, spin_us=0)
        srv_good = await lst.accept()
        socks = []
        for name, data in HANDSHAKES.items():
            sk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sk.connect(path)
            sk.setblocking(False)
            with contextlib.suppress(BlockingIOError, BrokenPipeError, ConnectionResetError):
                sk.sendall(data)
            socks.append((name, sk))
        # while those are pending (one stalls until the handshake timeout), the honest
        # connection works and a new honest client is accepted
        s = Scene(lst, good, srv_good, good, srv_good)
        await good_round_trip(s, n=2)
        async with await connect(path, slots=POOL) as late:
            await lst.accept()
            await late.send("late")
            conn, rec = await lst.receive()
            assert rec == "late"
        with anyio.fail_after(5):
            while lst.statistics().refused < len(HANDSHAKES):
                await anyio.sleep(0.02)
        replies = {}
        for name, sk in socks:
            with contextlib.suppress(OSError):
                sk.setblocking(True)
                sk.settimeout(1)
                replies[name] = sk.recv(4096)
            sk.close()
        await good_round_trip(s, n=1)
        await good.aclose()
        st = lst.statistics()
        assert st.refused == len(HANDSHAKES) and st.accepted == 2, st
    # every refusal was logged with a reason; Hellos that parse got a Refused saying why
    refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refusals) == len(HANDSHAKES), refusals
    assert b"between 1 and 16 segments" in replies["17 segments"]
    assert b"bad segment name" in replies["a name outside ringwire's"]
    assert b"does not exist" in replies["a segment that does not exist"]
    assert b"not made by the connecting process" in replies["another process's segment"]
    assert b"version" in replies["huge versions list"]
    assert our_names() == before


def _serves_an_honest_client(sl: SyncListener, path: str) -> None:
    """The blocking listener ``sl`` accepts an honest client (after hostile ones) and
    carries a record to it."""
    import threading

    out: list[Any] = []
    t = threading.Thread(
        target=lambda: out.append(connect_sync(path, slots=POOL, handshake_timeout=10))
    )
    t.start()
    conn = sl.accept(timeout=10)
    t.join()
    with conn, out[0] as client:
        client.send(np.arange(10_000))
        assert conn.receive(timeout=5)[-1] == 9_999


def test_sync_listener_survives_hostile_handshakes(tmp_path: Any) -> None:
    """The blocking listener runs each handshake in accept(): a hostile one must be
    refused there, never raised out of accept() (a Hello with bad UTF-8 used to raise
    UnicodeDecodeError through it, ending the server's accept loop)."""

    path = str(tmp_path / "sync.sock")
    before = our_names()
    quick = {k: v for k, v in HANDSHAKES.items() if "stall" not in k}
    with SyncListener(path, slots=POOL, handshake_timeout=1.0) as sl:
        socks = []
        for data in quick.values():
            sk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sk.connect(path)
            sk.setblocking(False)  # accept() has not run yet: the buffer may fill
            with contextlib.suppress(OSError):
                sk.sendall(data)
            socks.append(sk)
        _serves_an_honest_client(sl, path)
        for sk in socks:
            sk.close()
        assert sl.statistics().refused == len(quick)
    assert our_names() == before


HOSTILE_SERVERS = {
    "a 4 GiB length": b"\xff\xff\xff\xff",
    "garbage": b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1",
    "a reject with bad UTF-8": _frame(b"\x82\xa4type\xa6reject\xa6reason\xa2\xff\xfe"),
    "a welcome with an unknown version": encode_message(Welcome(version=7, pid=1)),
    "a welcome naming a missing pool": encode_message(
        Welcome(version=1, pid=1, segments=[SegmentSpec("/rw.1.00000000abcd", 1 << 20, "slots")])
    ),
    "a welcome naming a pool that is not a pool": "fake pool",
    "a reject": encode_message(Refused("go away")),
    "a hello instead of a welcome": encode_message(_hello()),
    "silence, then hang up": b"",
}


@pytest.mark.parametrize("behaviour", list(HOSTILE_SERVERS))
async def test_client_facing_a_hostile_listener(behaviour: str, tmp_path: Any) -> None:
    """connect() raises HandshakeError (never another exception) and leaves nothing in
    /dev/shm, whatever the listener answers."""
    path = str(tmp_path / "evil.sock")
    lsock = bind_unix_socket(path)
    fake: Segment | None = None
    before = our_names()
    try:
        reply: Any = HOSTILE_SERVERS[behaviour]
        if reply == "fake pool":
            fake = Segment.create(1 << 16)  # zeroes: no pool magic
            reply = encode_message(
                Welcome(version=1, pid=1, segments=[SegmentSpec(fake.name, fake.size, "slots")])
            )

        async def serve() -> None:
            while True:
                try:
                    conn, _ = lsock.accept()
                    break
                except BlockingIOError:
                    await anyio.wait_readable(lsock)
            conn.setblocking(True)
            conn.settimeout(2)
            with contextlib.suppress(OSError):
                conn.recv(65536)  # the Hello
                if reply:
                    conn.sendall(reply)
                await anyio.sleep(0.05)
            conn.close()

        async with anyio.create_task_group() as tg:
            tg.start_soon(serve)
            with pytest.raises(HandshakeError):
                await connect(path, slots=POOL, handshake_timeout=5)
    finally:
        lsock.close()
        os.unlink(path)
        if fake is not None:
            fake.unlink()
            fake.close()
    assert our_names() == before


# ---------------------------------------- memory files: hostile descriptors (issue 24)

_LABEL = f"memfd:rw.{os.getpid()}.0123456789ab"
_RINGS = 2 * ring_size(1024)


def _memfd(size: int, seals: int | None) -> int:
    """A memory file of ``size`` bytes, mode 0600, with ``seals`` (``None``: cannot be
    sealed at all)."""
    import fcntl

    flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if seals is not None else 0)
    fd = os.memfd_create(_LABEL.removeprefix("memfd:"), flags)
    os.fchmod(fd, 0o600)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _sealed(size: int) -> int:
    import fcntl

    return _memfd(size, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)


def _memfd_hello(*specs: tuple[int, int]) -> bytes:
    """A Hello announcing memory files (``(size, fd index)`` each), rings in the first."""
    segments = [
        SegmentSpec(_LABEL.replace("0123", f"{i:04x}"), size, fd=fd)
        for i, (size, fd) in enumerate(specs)
    ]
    return encode_message(_hello(segments=segments))


def _pipe() -> int:
    r, w = os.pipe()
    os.close(w)
    return r


# name -> (the descriptors to pass, made fresh; the Hello; what the Refused must say,
# or None where the listener hangs up without one)
DESCRIPTOR_ATTACKS: dict[str, Any] = {
    "a pipe": (lambda: [_pipe()], _memfd_hello((_RINGS, 0)), b"not a shared-memory file"),
    "a regular file on a disk": (
        lambda: [os.open(__file__, os.O_RDONLY | os.O_CLOEXEC)],
        _memfd_hello((_RINGS, 0)),
        b"a file on a disk",
    ),
    "a memory file shorter than announced": (
        lambda: [_sealed(4096)],
        _memfd_hello((_RINGS, 0)),
        b"has 4096 bytes, the peer announced",
    ),
    "a memory file without seals": (
        lambda: [_memfd(_RINGS, None)],
        _memfd_hello((_RINGS, 0)),
        b"not sealed against shrinking and growing",
    ),
    "a forged descriptor index": (
        lambda: [_sealed(_RINGS)],
        _memfd_hello((_RINGS, 5)),
        b"as descriptor 5, but passed 1 descriptor(s)",
    ),
    "a negative descriptor index": (
        lambda: [_sealed(_RINGS)],
        _memfd_hello((_RINGS, -2)),
        b"as descriptor -2",
    ),
    "one descriptor for two segments": (
        lambda: [_sealed(_RINGS)],
        _memfd_hello((_RINGS, 0), (_RINGS, 0)),
        b"(or that one twice)",
    ),
    "more descriptors than segments": (
        lambda: [_sealed(_RINGS), _pipe(), _pipe()],
        _memfd_hello((_RINGS, 0)),
        b"passed 3 descriptor(s) for 1 memory file(s)",
    ),
    "17 descriptors in one message": (
        lambda: [_sealed(_RINGS)] + [_pipe() for _ in range(16)],
        _memfd_hello((_RINGS, 0)),
        b"more descriptors than a handshake message carries (16)",
    ),
}


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memory files here")
async def test_hostile_descriptors_are_refused_and_nothing_leaks(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A client whose Hello announces memory files but passes descriptors of the wrong
    kind (a pipe, a file on a disk), a memory file too short or without seals, a forged
    or negative index, one descriptor for two segments, more descriptors than segments,
    or more than a handshake message carries: each is refused with the reason (in a
    Refused, and in the listener's log), the listener serves honest clients meanwhile
    and after, and not one received descriptor stays open in its process."""
    caplog.set_level(logging.WARNING, logger="ringwire")
    path = str(tmp_path / "fd.sock")
    before = our_names()
    async with listen(path, slots=POOL, spin_us=0, handshake_timeout=1.0) as lst:
        good = await connect(path, slots=POOL, spin_us=0)
        srv_good = await lst.accept()
        s = Scene(lst, good, srv_good, good, srv_good)
        await good_round_trip(s, n=1)
        fds_before = _fd_count()
        replies: dict[str, bytes] = {}
        for name, (make, hello, _) in DESCRIPTOR_ATTACKS.items():
            sk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            fds = make()
            try:
                sk.connect(path)
                socket.send_fds(sk, [hello], fds)
            finally:
                for fd in fds:
                    os.close(fd)
            sk.setblocking(False)
            reply = b""
            with anyio.fail_after(5):
                while True:
                    await anyio.wait_readable(sk)
                    try:
                        chunk = sk.recv(4096)
                    except ConnectionResetError:
                        break
                    if not chunk:
                        break
                    reply += chunk
            sk.close()
            replies[name] = reply
            await good_round_trip(s, n=1)  # the honest connection goes on meanwhile
        async with await connect(path, slots=POOL) as late:  # and a new one is accepted
            async with await lst.accept():
                await late.send("late")
                _, rec = await lst.receive()
                assert rec == "late"
        st = lst.statistics()
        assert st.refused == len(DESCRIPTOR_ATTACKS) and st.accepted == 2, st
        # every descriptor received from the hostile clients was closed (and the late
        # connection's, both ends)
        with anyio.move_on_after(2):
            while _fd_count() != fds_before:
                await anyio.sleep(0.02)
        assert _fd_count() == fds_before, (fds_before, os.listdir("/proc/self/fd"))
        await good.aclose()
        await srv_good.aclose()
    for name, (_, _, says) in DESCRIPTOR_ATTACKS.items():
        if says is not None:
            assert says in replies[name], (name, replies[name])
    refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refusals) == len(DESCRIPTOR_ATTACKS), refusals
    assert any("more descriptors than a handshake message carries" in r for r in refusals), refusals
    assert our_names() == before


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memory files here")
def test_sync_listener_refuses_hostile_descriptors_and_keeps_none(tmp_path: Any) -> None:
    """The blocking listener runs each handshake in accept(): the same descriptor
    attacks are refused there (never raised out of accept()), the honest client after
    them is accepted, and no received descriptor stays open."""

    path = str(tmp_path / "sfd.sock")
    before = our_names()
    with SyncListener(path, slots=POOL, handshake_timeout=1.0) as sl:
        fds_before = _fd_count()
        socks = []
        for make, hello, _ in DESCRIPTOR_ATTACKS.values():
            sk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            fds = make()
            try:
                sk.connect(path)
                socket.send_fds(sk, [hello], fds)
            finally:
                for fd in fds:
                    os.close(fd)
            socks.append(sk)
        _serves_an_honest_client(sl, path)
        for sk in socks:
            sk.close()
        assert sl.statistics().refused == len(DESCRIPTOR_ATTACKS)
        assert _fd_count() == fds_before, (fds_before, os.listdir("/proc/self/fd"))
    assert our_names() == before
