"""The endpoint core over the in-memory transport: no process, socket or segment.

Each test drives :class:`Endpoint` and the loops of :mod:`ringwire._conn.waits` by
hand, h11-style: bytes in, what the endpoint does (or would wait for) out.  The same
core runs every real connection, so what is asserted here holds for the
shared-memory transport too (whose own tests are in the process suites).
"""

from __future__ import annotations

import time

import pytest
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream, WouldBlock

from ringwire import DecodeError, FrameTooLarge, ProtocolError, Record, RingwireError
from ringwire._conn import waits
from ringwire._conn.endpoint import EMPTY, Endpoint
from ringwire._conn.memory import memory_pair
from ringwire._conn.transport import FrameReader, FrameWriter, Transport


class Ping(Record):
    seq: int
    text: str = ""


def endpoints(capacity: int = 4096, **kw: object) -> tuple[Endpoint, Endpoint]:
    ta, tb = memory_pair(capacity)
    return Endpoint(ta, spin_us=0, **kw), Endpoint(tb, spin_us=0, **kw)  # type: ignore[arg-type]


def step(loop: waits.Loop[object]) -> waits.Wait | object:
    """Advance a loop: the Wait it yields, or (wrapped) the value it returns."""
    try:
        return next(loop)
    except StopIteration as stop:
        return ("returned", stop.value)


def test_the_memory_transport_implements_the_seam() -> None:
    a, _ = memory_pair()
    assert isinstance(a, Transport)
    assert isinstance(a.tx, FrameWriter) and isinstance(a.rx, FrameReader)
    assert not isinstance(a.rx, FrameWriter)


def test_records_arrive_in_order_and_are_counted() -> None:
    a, b = endpoints()
    for i in range(10):
        assert a.try_send(a.encode(Ping(seq=i, text="x" * i)))
    got = [b.try_receive(b.decoder_for(Ping)) for _ in range(10)]
    assert [g.seq for g in got] == list(range(10))
    assert b.try_receive(b.dec) is EMPTY
    sa, sb = a.statistics(), b.statistics()
    assert sa.records_sent == 10 and sb.records_received == 10
    assert sa.bytes_sent == sb.bytes_received > 0
    assert sa.doorbells_sent == 0  # nobody was parked: no doorbell


def test_batches_publish_once_and_read_many() -> None:
    a, b = endpoints()
    payloads = a.encode_many([{"i": i} for i in range(50)])
    assert a.try_send_many(payloads, 0) == 50
    out = b.try_receive_many(b.dec, 20)
    assert [r["i"] for r in out] == list(range(20))
    assert len(b.try_receive_many(b.dec, 100)) == 30
    with pytest.raises(WouldBlock):
        b.receive_many_nowait(b.dec, 5)


def test_a_parked_receiver_is_rung_once_and_wakes() -> None:
    a, b = endpoints()
    loop = waits.receive(b, b.dec)
    w = step(loop)
    assert isinstance(w, waits.Wait) and w.until is None and w.gen == b.wake_gen
    assert b.statistics().receive_parks == 1
    # the sender sees the parked flag after publishing, and rings once
    assert a.try_send(a.encode("one"))
    assert a.try_send(a.encode("two"))
    assert a.statistics().doorbells_sent == 1
    b.drain()  # what a driver does when the transport's descriptor is readable
    assert b.wake_gen == w.gen + 1
    assert step(loop) == ("returned", "one")
    assert b.rx_parked == 0  # unparked on the way out
    assert b.try_receive(b.dec) == "two"


def test_a_sender_facing_a_full_lane_waits_for_space() -> None:
    a, b = endpoints(capacity=1024)
    payload = a.encode(b"x" * 300)
    sent = 0
    while a.try_send(payload):
        sent += 1
    assert sent == 3
    loop = waits.room(a, payload)
    w = step(loop)
    assert isinstance(w, waits.Wait) and a.statistics().send_parks == 1
    assert b.try_receive(b.dec) == b"x" * 300  # the commit frees space: rings the writer
    assert b.statistics().doorbells_sent == 1
    a.drain()
    assert step(loop) == ("returned", None)
    assert a.statistics().records_sent == 4 and a.tx_parked == 0


def test_a_deadline_ends_the_wait_with_timeout_and_unparks() -> None:
    a, b = endpoints()
    loop = waits.receive(b, b.dec, deadline=time.monotonic() - 1)
    with pytest.raises(TimeoutError):
        step(loop)
    assert b.rx_parked == 0
    loop = waits.receive(b, b.dec, deadline=time.monotonic() + 60)
    w = step(loop)
    assert isinstance(w, waits.Wait) and w.until is not None
    loop.close()  # what a cancelled driver does
    assert b.rx_parked == 0


class _Stalling(Endpoint):
    """An endpoint with a stall deadline and its own stall error (a broadcast writer's
    shape, on the memory transport)."""

    stall_timeout = 0.05

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.stalled = lambda need, waited, slot: TimeoutError(
            f"stalled: {need} bytes after {waited:.2f} s (slot: {slot})"
        )


def test_the_stall_deadline_bounds_the_shared_wait_for_room() -> None:
    """The stall deadline lives in waits.room, for every shape: the wait yields it as
    its limit, and a send past it raises the endpoint's own error, nothing published."""
    ta, tb = memory_pair(1024)
    a, b = _Stalling(ta, spin_us=0), Endpoint(tb, spin_us=0)
    payload = a.encode(b"x" * 300)
    while a.try_send(payload):
        pass
    loop = waits.room(a, payload, deadline=time.monotonic() + 60)
    w = step(loop)
    assert isinstance(w, waits.Wait) and w.until is not None
    assert w.until < time.monotonic() + 1  # the stall deadline, not the caller's
    time.sleep(0.06)
    with pytest.raises(
        TimeoutError, match=rf"stalled: {len(payload)} bytes after 0.\d+ s \(slot: False"
    ):
        loop.send(None)
    assert a.tx_parked == 0 and a.statistics().records_sent == 3
    assert [b.try_receive(b.dec) for _ in range(4)] == [b"x" * 300] * 3 + [EMPTY]


def test_a_channel_has_no_stall_deadline() -> None:
    """Without one only the caller's deadline bounds a send (the plain TimeoutError)."""
    a, _ = endpoints(capacity=1024)
    assert a.stall_timeout is None and a.stalled is None and waits.wait_limit(a, None) is None
    payload = a.encode(b"x" * 300)
    while a.try_send(payload):
        pass
    loop = waits.room(a, payload)
    w = step(loop)
    assert isinstance(w, waits.Wait) and w.until is None
    loop.close()
    loop = waits.room_many(a, [payload], None, deadline=time.monotonic() - 1)
    with pytest.raises(TimeoutError, match="timed out"):
        step(loop)
    assert a.tx_parked == 0 and a.statistics().records_sent == 3


def test_end_of_stream_comes_after_every_record() -> None:
    a, b = endpoints()
    a.try_send(a.encode(1))
    a.send_eof()
    with pytest.raises(ClosedResourceError):
        a.try_send(a.encode(2))
    assert b.receive_nowait(b.dec) == 1
    with pytest.raises(EndOfStream):
        b.receive_nowait(b.dec)
    with pytest.raises(EndOfStream):
        step(waits.receive(b, b.dec))


def test_a_parked_receiver_is_rung_for_the_close() -> None:
    a, b = endpoints()
    loop = waits.receive(b, b.dec)
    assert isinstance(step(loop), waits.Wait)
    a.send_eof()
    assert b.transport.inbox == bytearray(b"C")
    b.drain()
    with pytest.raises(EndOfStream):
        step(loop)


def test_a_peer_that_hangs_up_leaves_its_records_then_breaks() -> None:
    a, b = endpoints()
    a.try_send(a.encode("last words"))
    a.transport.shutdown()  # the peer's process is gone
    b.drain()
    assert b.eof
    assert b.try_receive(b.dec) == "last words"
    with pytest.raises(BrokenResourceError, match="died or dropped"):
        b.receive_nowait(b.dec)
    with pytest.raises(BrokenResourceError, match="is gone"):
        b.try_send(b.encode("anyone?"))


def test_a_sender_nobody_watches_notices_the_hang_up() -> None:
    a, b = endpoints()
    b.transport.shutdown()
    with pytest.raises(BrokenResourceError):
        for _ in range(100):
            a.check_alive()
            a.try_send(a.encode("x"))


def test_garbage_on_the_doorbell_breaks_only_this_connection() -> None:
    a, b = endpoints()
    b.transport.inbox += b"?"
    b.drain()
    assert isinstance(b.broken, ProtocolError)
    assert a.transport.hung_up()  # broken: the transport was shut down, the peer sees it
    with pytest.raises(BrokenResourceError) as info:
        b.try_receive(b.dec)
    assert isinstance(info.value.__cause__, ProtocolError)


def test_an_undecodable_record_fails_alone() -> None:
    a, b = endpoints()
    assert a.tx.try_write(b"\xc1")  # never valid msgpack
    a.try_send(a.encode("fine"))
    with pytest.raises(DecodeError):
        b.try_receive(b.dec)
    assert b.try_receive(b.dec) == "fine"


def test_a_batch_stops_before_an_undecodable_record() -> None:
    a, b = endpoints()
    a.try_send(a.encode(1))
    a.tx.try_write(b"\xc1")
    a.try_send(a.encode(3))
    assert b.try_receive_many(b.dec, 10) == [1]
    with pytest.raises(DecodeError):
        b.try_receive_many(b.dec, 10)
    assert b.try_receive_many(b.dec, 10) == [3]


def test_oversized_records_are_refused_before_anything_is_sent() -> None:
    a, _ = endpoints(capacity=1024)
    with pytest.raises(FrameTooLarge):
        a.encode(b"x" * 2000)
    assert a.statistics().records_sent == 0


def test_no_slot_pool_means_no_loans_and_a_clear_error_for_references() -> None:
    a, b = endpoints()
    # a misuse of this endpoint, not an exhausted pool: the base error, no subclass
    with pytest.raises(RingwireError, match="no slot pool") as info:
        a.require_pool()
    assert info.type is RingwireError
    from ringwire.wire import SlotRef

    ref = SlotRef(
        version=1,
        pool=1,
        slot=0,
        generation=0,
        offset=0,
        nbytes=8,
        shape=(8,),
        dtype="|u1",
        kind="numpy",
    )
    a.try_send(a.encode({"ref": ref}))
    with pytest.raises(DecodeError, match="no slot pool"):
        b.try_receive(b.dec)


def test_closing_marks_both_lanes_and_frees_the_transport() -> None:
    a, b = endpoints()
    assert a.mark_closed() and not a.mark_closed()
    assert a.release() == 0
    assert a.transport.gone and b.transport.hung_up()
    with pytest.raises(ClosedResourceError):
        a.try_receive(a.dec)
    with pytest.raises(BrokenResourceError, match="closed its end"):
        b.try_send(b.encode("x"))


def test_send_nowait_reports_a_full_lane_without_sending() -> None:
    a, _ = endpoints(capacity=1024)
    while a.send_nowait(b"y" * 300, None):
        pass
    assert a.statistics().records_sent == 3


def test_a_drain_wakes_the_drivers_waiters_even_if_its_safe_point_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the wake generation moves before the safe point; the driver's waiters sleep on it,
    # so on_drain must run whatever the safe point does (else a waiter sleeps on a
    # generation that already moved)
    a, _ = endpoints()
    woken = []
    a.on_drain = lambda: woken.append(a.wake_gen)
    a.slots_on = True

    def boom() -> None:
        raise RuntimeError("safe point failed")

    monkeypatch.setattr(a, "slot_safe_point", boom)
    with pytest.raises(RuntimeError, match="safe point failed"):
        a.drain()
    assert woken == [a.wake_gen]
