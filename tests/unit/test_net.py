"""The TCP transport (ringwire._net) in one process: arrays beside the record, receipts,
loans, addresses, the listener, hostile peers."""

from __future__ import annotations

import gc

import anyio
import numpy as np
import pytest
from support.channel import small_slot_pools  # noqa: F401  (an autouse fixture)
from support.extras import needs_torch, torch

import ringwire

zmq = pytest.importorskip("zmq")

from support.net import tcp_pair  # noqa: E402

pytestmark = pytest.mark.anyio
BIG = ringwire.SlotConfig(classes=(ringwire.SlotClass(1 << 20, 8),))  # an 8 MiB budget


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def zeromq_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the ZeroMQ frames (Ext 20): NIXL off even where it is
    installed (tests/unit/test_nixl.py has the NIXL twins)."""
    monkeypatch.setenv("RINGWIRE_NIXL", "0")


@needs_torch
async def test_arrays_travel_as_frames_and_the_receipt_waits_for_the_view() -> None:
    a, b = await tcp_pair(slots=BIG)
    async with a, b:
        x = np.arange(1 << 16, dtype=np.float32)  # 256 KiB: above the threshold
        t = torch.arange(1 << 15, dtype=torch.bfloat16)
        receipt = await a.send_tracked({"x": x, "t": t, "small": np.arange(3)})
        rec = await b.receive()
        np.testing.assert_array_equal(rec["x"], x)
        assert not rec["x"].flags.writeable  # a view of the received frame
        assert torch.equal(rec["t"], t) and rec["t"].dtype == torch.bfloat16
        assert b.statistics().slot_arrays_held == 2
        with anyio.move_on_after(0.2) as scope:
            await receipt.wait()
        assert scope.cancelled_caught  # the receiver still holds the views
        del rec
        gc.collect()
        await b.send("tick")  # a safe point on the receiving side
        with anyio.fail_after(5):
            await receipt.wait()
        assert await a.receive() == "tick"
        assert a.statistics().releases_received == 2
        assert a.statistics().slot_bytes_in_use == 0


@needs_torch
async def test_loan_is_sent_without_a_copy_and_only_once() -> None:
    """A loan is the very buffer the frame is sent from, and can be sent once: again
    (before or after the receiver let go of it), twice in one record or a slice of it
    after it was sent is a SlotMisuse, and its memory is not reused while the user
    still holds it.  (The loan's finalizer used to sit on a slice that numpy's view
    collapsing let die at once: the loan came back while the user filled it, the send
    copied it -- into the loan's own memory, taken from the cache -- and a second send
    went out too; a later loan could alias the first.)"""
    a, b = await tcp_pair(slots=BIG)
    async with a, b:
        pool = a._core.pool
        buf = await a.loan((256, 256), np.float32)
        gc.collect()
        assert a.statistics().loans_outstanding == 1  # still out while the user holds it
        buf[:] = 7.0
        await a.send({"buf": buf})
        assert [b_.loan for b_ in pool.sent.values()] == [True]  # the loan itself, no copy
        with pytest.raises(ringwire.SlotMisuse, match="sent once"):
            await a.send(buf)  # twice, not yet released
        with pytest.raises(ringwire.SlotMisuse):
            await a.send({"late": buf[:10]})  # a slice of it, after it was sent
        got = await b.receive()
        assert got["buf"].shape == (256, 256) and float(got["buf"].sum()) == 7.0 * 65536
        del got
        gc.collect()
        await b.send("tick")  # the release goes out at this safe point
        assert await a.receive() == "tick"
        assert a.statistics().slot_bytes_in_use == 0
        with pytest.raises(ringwire.SlotMisuse):
            await a.send(buf)  # after it was released
        again = await a.loan((256, 256), np.float32)
        assert not np.shares_memory(again, buf)  # the user still holds buf: not reused
        del again
        t = await a.loan(1 << 15, torch.float16)
        t.fill_(2)
        await a.send(t[:100])  # a prefix of a loan may be sent
        got_t = await b.receive()
        assert torch.equal(got_t, torch.full((100,), 2, dtype=torch.float16))
        del got_t, t
        # the same loan twice in one record: refused, and nothing is left half-sent
        v = await a.loan(1000, np.int64)
        with pytest.raises(ringwire.SlotMisuse):
            await a.send([v, v])
        assert a.statistics().loans_outstanding == 1
        v[:] = 3
        await a.send([v])  # still a live loan
        w = await b.receive()
        assert len(w) == 1 and int(w[0].sum()) == 3000
        del w
        # a loan of another connection is an ordinary array here: copied
        c, d = await tcp_pair(slots=BIG)
        async with c, d:
            other = await c.loan(1000, np.int64)
            other[:] = 5
            await a.send(other)
            assert int((await b.receive()).sum()) == 5000
            del other
        # once the user lets go of a sent loan its memory is reused again
        del buf, v
        gc.collect()
        await b.send("tock")
        assert await a.receive() == "tock"
        assert not pool.spent and a.statistics().loans_outstanding == 0
        assert a.statistics().slot_bytes_in_use == 0
        x = await a.loan(4, np.uint8)
    with pytest.raises(ringwire.ClosedResourceError):
        await a.send(x)  # after close


async def test_budget_policies() -> None:
    cfg = ringwire.SlotConfig(classes=(ringwire.SlotClass(64 << 10, 2),), policy="error")
    a, b = await tcp_pair(slots=cfg)
    async with a, b:
        x = np.ones(64 << 10, np.uint8)
        await a.send(x)
        await a.send(x)
        with pytest.raises(ringwire.SlotsExhausted):
            await a.send(x)  # the receiver holds both (not received yet)
        first, second = await b.receive(), await b.receive()
        del first, second
        gc.collect()
        await b.send(0)
        assert await a.receive() == 0
        await a.send(x, slot_policy="error")  # released: room again
        with pytest.raises(ringwire.FrameTooLarge):
            await a.send(np.ones(1 << 20, np.uint8))  # larger than budget and lane


async def test_bad_addresses_name_themselves() -> None:
    with pytest.raises(ValueError, match="tcp://nohost"):
        await ringwire.connect("tcp://nohost")
    with pytest.raises(ValueError, match="port 70000"):
        await ringwire.connect("tcp://127.0.0.1:70000")
    with pytest.raises(OSError, match="does-not-exist.invalid"):
        await ringwire.connect("tcp://does-not-exist.invalid:5555", handshake_timeout=2)
    with pytest.raises(ConnectionRefusedError, match="tcp://127.0.0.1:1"):
        await ringwire.connect("tcp://127.0.0.1:1", handshake_timeout=5)
    with pytest.raises(ValueError, match="insecure=True"):
        ringwire.listen("tcp://0.0.0.0:0")
    with pytest.raises(ValueError, match="heartbeat"):
        await ringwire.connect("tcp://127.0.0.1:5", heartbeat=0)


async def test_listener_fan_in_and_sync_twin() -> None:
    async with ringwire.listen("tcp://127.0.0.1:0") as lst:
        assert lst.path.startswith("tcp://127.0.0.1:") and not lst.path.endswith(":0")
        chans = [await ringwire.connect(lst.path) for _ in range(3)]
        for i, c in enumerate(chans):
            await c.send_many([(i, k) for k in range(5)])
        got = [await lst.receive() for _ in range(15)]
        for i in range(3):
            assert [rec for _, rec in got if rec[0] == i] == [(i, k) for k in range(5)]
        conn, _ = got[0]
        await conn.send("reply")
        assert await chans[got[0][1][0]].receive() == "reply"
        for c in chans:
            await c.aclose()
    with ringwire.SyncListener("tcp://127.0.0.1:0") as sl:

        def client() -> None:
            with ringwire.connect_sync(sl.path) as c:
                c.send({"hi": 1}, timeout=5)
                assert c.receive(timeout=5) == "ok"

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, client)
            conn = await anyio.to_thread.run_sync(sl.accept, 5)
            with conn:
                assert await anyio.to_thread.run_sync(conn.receive, 5) == {"hi": 1}
                conn.send("ok")


async def test_garbage_breaks_only_that_connection() -> None:
    a, b = await tcp_pair()
    c, d = await tcp_pair()
    async with a, b, c, d:
        t = a._core.transport
        with t._lock:
            t._sock.send_multipart((b"", b"Z?"))  # an unknown control message
        with pytest.raises(anyio.BrokenResourceError):
            with anyio.fail_after(5):
                await b.receive()
        await c.send(1)
        assert await d.receive() == 1  # the other connection is untouched


async def test_forged_reference_is_a_decode_error() -> None:
    a, b = await tcp_pair()
    async with a, b:
        forged = ringwire.wire.NetRef(1, 99, 1, 3, 8, (2,), "<f4", "numpy")
        await a.send({"x": forged})  # names frame 3 of a record that has none
        with pytest.raises(ringwire.DecodeError, match="frame 3"):
            await b.receive()
        await a.send("next")
        assert await b.receive() == "next"


async def test_send_many_goes_as_batches_in_order() -> None:
    a, b = await tcp_pair(slots=BIG)
    async with a, b:
        x = np.arange(1 << 16, dtype=np.float32)  # an array: its record goes on its own
        items = [*range(300), {"x": x}, *range(300, 600)]
        await a.send_many(items)
        got: list = []
        while len(got) < len(items):
            got += await b.receive_many(1000)
        assert got[:300] == list(range(300)) and got[301:] == list(range(300, 600))
        np.testing.assert_array_equal(got[300]["x"], x)
        assert b.statistics().records_received == len(items)
        del got


@pytest.mark.parametrize(
    "body",
    [
        b"M" + (3).to_bytes(4, "big") + b"\x01\x02",  # a length past the end
        b"M" + (1).to_bytes(4, "big") + b"\x01",  # one record only
        b"M" + (0).to_bytes(4, "big") + (1).to_bytes(4, "big") + b"\x01",  # an empty one
        b"M" + (1).to_bytes(4, "big") + b"\x01\x00\x00",  # cut short in a length
        b"M" + ((1 << 19).to_bytes(4, "big") + b"\x01" * (1 << 19)) * 2,  # past the credit
    ],
)
async def test_lying_batch_breaks_only_that_connection(body: bytes) -> None:
    a, b = await tcp_pair()
    c, d = await tcp_pair()
    async with a, b, c, d:
        t = a._core.transport
        with t._lock:
            t._sock.send_multipart((b"", body))
        with pytest.raises(anyio.BrokenResourceError):
            with anyio.fail_after(5):
                await b.receive()
        await c.send_many([1, 2])
        assert await d.receive() == 1 and await d.receive() == 2
