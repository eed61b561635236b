"""Ring arithmetic on plain bytearrays: no processes, no OS.

Every test runs on both lane implementations (the autouse ``lane_impl`` fixture swaps
this module's ``RingWriter`` / ``RingReader`` names): the pure-Python classes of
``ringwire._wire.ring`` and the C ones of ``ringwire._wire.lanes`` (skipped where the
extension is not built)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.ringmodel import RingModel

from ringwire._errors import EncodeError, FrameTooLarge, RingCorrupted
from ringwire._wire import lanes
from ringwire._wire.ring import (
    HEADER_SIZE,
    MIN_CAPACITY,
    WRAP_MARKER,
    RingReader,
    RingWriter,
    check_ring,
    frame_size,
    init_ring,
    max_payload,
    ring_size,
    validate_capacity,
)

CAP = 1024


@pytest.fixture(autouse=True, params=["pure", "native"])
def lane_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        if lanes.NativeRingWriter is None:
            pytest.skip(f"the C ring is not built: {lanes.REASON}")
        monkeypatch.setitem(globals(), "RingWriter", lanes.NativeRingWriter)
        monkeypatch.setitem(globals(), "RingReader", lanes.NativeRingReader)
    return str(request.param)


def make(cap: int = CAP, offset: int = 0) -> tuple[bytearray, RingWriter, RingReader]:
    buf = bytearray(offset + ring_size(cap))
    init_ring(buf, offset, cap)
    return buf, RingWriter(buf, offset), RingReader(buf, offset)


def read_all(r: RingReader) -> list[bytes]:
    out = []
    while (v := r.next_frame()) is not None:
        out.append(bytes(v))
        v.release()
    r.commit()
    return out


def set_counters(buf: bytearray, pos: int, offset: int = 0) -> None:
    """Pretend ``pos`` bytes have gone through the ring already (head == tail == pos)."""
    struct.pack_into("=Q", buf, offset + 64, pos)
    struct.pack_into("=Q", buf, offset + 128, pos)


# -- sizes -------------------------------------------------------------------------------


def test_sizes():
    assert ring_size(CAP) == HEADER_SIZE + CAP
    assert max_payload(CAP) == CAP // 2 - 4
    assert frame_size(0) == 8
    assert frame_size(4) == 8
    assert frame_size(5) == 16
    assert frame_size(max_payload(CAP)) == CAP // 2
    for bad in (0, 1000, MIN_CAPACITY // 2, 3 * 1024, 1 << 31, 1024.0):
        with pytest.raises(ValueError):
            validate_capacity(bad)  # type: ignore[arg-type]


def test_init_and_check():
    buf = bytearray(64 + ring_size(CAP))
    init_ring(buf, 64, CAP)
    check_ring(buf, 64, CAP)
    with pytest.raises(RingCorrupted):
        check_ring(buf, 64, 2 * CAP)  # does not fit
    with pytest.raises(RingCorrupted):
        check_ring(buf, 0, CAP)  # no magic here
    buf2 = bytearray(ring_size(2048))
    init_ring(buf2, 0, 2048)
    with pytest.raises(RingCorrupted, match="capacity"):
        check_ring(buf2, 0, 1024)
    with pytest.raises(ValueError):
        init_ring(bytearray(100), 0, CAP)
    with pytest.raises(TypeError):
        RingReader(bytes(ring_size(CAP)))


def test_check_ring_refuses_used_ring():
    buf, w, _ = make()
    assert w.try_write(b"x")
    with pytest.raises(RingCorrupted, match="empty"):
        check_ring(buf, 0, CAP)


def test_bad_header_refused():
    buf = bytearray(ring_size(CAP))
    with pytest.raises(RingCorrupted, match="magic"):
        RingReader(buf)
    init_ring(buf, 0, CAP)
    struct.pack_into("=Q", buf, 8, 1000)  # capacity not a power of two
    with pytest.raises(RingCorrupted):
        RingWriter(buf)


# -- basic traffic -------------------------------------------------------------------------


def test_empty_ring_reads_nothing():
    _, w, r = make()
    assert r.next_frame() is None
    assert not r.available()
    assert w.free == CAP
    assert r.fill() == 0


def test_roundtrip_and_order():
    _, w, r = make()
    msgs = [b"", b"a", b"hello", bytes(range(200)), b"x" * 7, b"y" * 8]
    for m in msgs:
        assert w.try_write(m)
    assert r.available()
    assert read_all(r) == msgs
    assert not r.available()
    assert w.free == CAP


def test_frames_are_8_aligned():
    buf, w, r = make()
    w.try_write(b"abc")
    w.try_write(b"defgh")
    d = HEADER_SIZE
    assert struct.unpack_from("=I", buf, d)[0] == 3
    assert buf[d + 4 : d + 7] == b"abc"
    assert struct.unpack_from("=I", buf, d + 8)[0] == 5
    assert struct.unpack_from("=Q", buf, 64)[0] == 8 + 16  # tail


def test_head_published_only_on_commit():
    buf, w, r = make()
    w.try_write(b"12345678")
    v = r.next_frame()
    assert v is not None and bytes(v) == b"12345678"
    v.release()
    assert struct.unpack_from("=Q", buf, 128)[0] == 0
    assert r.pending
    r.commit()
    assert struct.unpack_from("=Q", buf, 128)[0] == 16
    assert not r.pending


def test_mark_reset():
    _, w, r = make()
    w.try_write(b"a")
    w.try_write(b"b")
    m = r.mark()
    v = r.next_frame()
    assert v is not None and bytes(v) == b"a"
    r.reset(m)
    assert read_all(r) == [b"a", b"b"]
    with pytest.raises(ValueError):
        r.reset(0)  # before the committed head


# -- full / empty edges -----------------------------------------------------------------


def test_fill_exactly_then_full():
    _, w, r = make()
    n = 0
    payload = b"z" * 60  # 64-byte frames: exactly CAP / 64 of them fit
    while w.try_write(payload):
        n += 1
    assert n == CAP // 64
    assert w.free == 0
    assert not w.try_write(b"")
    assert not w.fits_now(0)
    got = r.next_frame()
    assert got is not None
    got.release()
    assert not w.try_write(b"")  # not committed yet: still full
    r.commit()
    assert w.try_write(payload)
    assert not w.try_write(b"")
    assert len(read_all(r)) == n


def test_one_byte_short_of_full():
    _, w, r = make()
    assert w.try_write(b"q" * (CAP // 2 - 4))
    assert w.try_write(b"q" * (CAP // 2 - 12))  # leaves exactly 8 bytes
    assert w.free == 8
    assert not w.try_write(b"q" * 5)  # needs 16
    assert w.try_write(b"q" * 4)  # needs 8
    assert w.free == 0
    assert [len(x) for x in read_all(r)] == [CAP // 2 - 4, CAP // 2 - 12, 4]


def test_max_payload_fits_empty_ring_at_any_position():
    big = b"M" * max_payload(CAP)
    for pos in range(0, CAP, 8):
        buf, _, _ = make()
        set_counters(buf, 10 * CAP + pos)
        w, r = RingWriter(buf), RingReader(buf)
        assert w.try_write(big), pos
        got = read_all(r)
        assert got == [big]


def test_too_large_refused_with_pointer_to_slots():
    _, w, _ = make()
    with pytest.raises(FrameTooLarge, match="slots") as ei:
        w.try_write(b"x" * (max_payload(CAP) + 1))
    assert isinstance(ei.value, EncodeError)
    with pytest.raises(FrameTooLarge):
        w.write_many([b"x" * CAP])
    assert w.free == CAP  # nothing written


# -- wraparound ---------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 4, 5, 12, 13, 100, 251, max_payload(CAP)])
def test_wraparound_at_every_offset(size):
    payload = bytes((i * 7 + size) & 0xFF for i in range(size))
    need = frame_size(size)
    for pos in range(0, CAP, 8):
        buf, _, _ = make()
        set_counters(buf, 3 * CAP + pos)
        w, r = RingWriter(buf), RingReader(buf)
        to_end = CAP - pos
        for k in range(3):
            assert w.try_write(payload), (pos, k)
            got = read_all(r)
            assert got == [payload], (pos, k)
        # counters moved by whole frames, plus the skipped tail when a frame wrapped
        tail = struct.unpack_from("=Q", buf, 64)[0]
        first = need if need <= to_end else to_end + need
        assert tail >= 3 * CAP + pos + first


def test_wrap_marker_written():
    buf, _, _ = make()
    set_counters(buf, CAP - 16)  # 16 bytes before the end
    w, r = RingWriter(buf), RingReader(buf)
    assert w.try_write(b"x" * 20)  # needs 24: wraps
    assert struct.unpack_from("=I", buf, HEADER_SIZE + CAP - 16)[0] == WRAP_MARKER
    assert struct.unpack_from("=I", buf, HEADER_SIZE)[0] == 20
    assert read_all(r) == [b"x" * 20]


def test_wrap_needs_room_for_skipped_tail():
    buf, _, _ = make()
    set_counters(buf, CAP - 16)
    w, r = RingWriter(buf), RingReader(buf)
    # 16 bytes before the end; a frame of CAP - 16 would need 16 + CAP - 16 = CAP: fits
    with pytest.raises(FrameTooLarge):
        w.try_write(b"x" * (CAP - 20))
    assert w.try_write(b"a" * 4)  # 8 bytes, no wrap
    assert w.try_write(b"b" * 500)  # 504 bytes: wraps, skipping 8
    assert w.free == CAP - 8 - 8 - 504
    assert read_all(r) == [b"a" * 4, b"b" * 500]


def test_frame_exactly_to_the_end_does_not_wrap():
    buf, _, _ = make()
    set_counters(buf, CAP - 16)
    w, r = RingWriter(buf), RingReader(buf)
    assert w.try_write(b"c" * 12)  # exactly 16 bytes: ends at the end
    assert w.try_write(b"d")  # starts at 0
    assert struct.unpack_from("=I", buf, HEADER_SIZE)[0] == 1
    assert read_all(r) == [b"c" * 12, b"d"]


# -- batches ------------------------------------------------------------------------------


def test_write_many_publishes_once_and_stops_when_full():
    buf, w, r = make()
    payloads = [bytes([i]) * 100 for i in range(20)]  # 104-byte frames
    n, nbytes = w.write_many(payloads)
    assert nbytes == 100 * n
    assert n == CAP // 104
    assert struct.unpack_from("=Q", buf, 64)[0] == n * 104
    got = read_all(r)
    assert got == payloads[:n]
    m, _ = w.write_many(payloads, n)
    assert read_all(r) == payloads[n : n + m]


def test_write_many_too_large_in_the_middle():
    _, w, r = make()
    payloads = [b"a", b"x" * CAP, b"b"]
    assert w.write_many(payloads) == (1, 1)  # publishes the good prefix
    with pytest.raises(FrameTooLarge):
        w.write_many(payloads, 1)
    assert read_all(r) == [b"a"]


def test_write_many_empty():
    buf, w, _ = make()
    assert w.write_many([]) == (0, 0)
    assert struct.unpack_from("=Q", buf, 64)[0] == 0


# -- corruption -----------------------------------------------------------------------


def test_corrupt_length_detected():
    buf, w, r = make()
    w.try_write(b"hello")
    struct.pack_into("=I", buf, HEADER_SIZE, 9999)
    with pytest.raises(RingCorrupted, match="bad frame length"):
        r.next_frame()


def test_length_past_tail_detected():
    buf, w, r = make()
    w.try_write(b"hello")
    struct.pack_into("=I", buf, HEADER_SIZE, 100)  # plausible but beyond the tail
    with pytest.raises(RingCorrupted):
        r.next_frame()


def test_tail_out_of_range_detected():
    buf, w, r = make()
    struct.pack_into("=Q", buf, 64, CAP + 8)
    with pytest.raises(RingCorrupted, match="tail"):
        r.next_frame()


def test_tail_running_backwards_detected():
    buf, w, r = make()
    w.try_write(b"abc")
    assert r.available()
    v = r.next_frame()
    assert v is not None
    v.release()
    r.commit()
    struct.pack_into("=Q", buf, 64, 0)
    with pytest.raises(RingCorrupted):
        r.next_frame()


def test_head_out_of_range_detected_by_writer():
    buf, w, r = make()
    while w.try_write(b"x" * 100):
        pass
    struct.pack_into("=Q", buf, 128, 1 << 40)
    with pytest.raises(RingCorrupted, match="head"):
        w.try_write(b"y" * 100)


def test_misplaced_wrap_marker_detected():
    buf, w, r = make()
    w.try_write(b"hello")
    struct.pack_into("=I", buf, HEADER_SIZE, WRAP_MARKER)
    with pytest.raises(RingCorrupted, match="wrap marker"):
        r.next_frame()


def test_wrap_marker_without_frame_detected():
    buf, _, _ = make()
    set_counters(buf, CAP - 16)
    struct.pack_into("=I", buf, HEADER_SIZE + CAP - 16, WRAP_MARKER)
    struct.pack_into("=Q", buf, 64, CAP)  # tail just after the marker
    r = RingReader(buf)
    with pytest.raises(RingCorrupted):
        r.next_frame()


# -- eventcount flags -------------------------------------------------------------------


def test_reader_park_rings_once_per_park():
    _, w, r = make()
    w.try_write(b"a")
    assert not w.reader_needs_doorbell()  # nobody parked
    r.park()
    assert w.reader_needs_doorbell()
    assert not w.reader_needs_doorbell()  # one byte per park
    r.unpark()
    assert not w.reader_needs_doorbell()
    r.park()
    assert w.reader_needs_doorbell()  # a new park is rung again


def test_writer_park_rings_once_per_park():
    _, w, r = make()
    w.park()
    assert r.writer_needs_doorbell()
    assert not r.writer_needs_doorbell()
    w.unpark()
    assert not r.writer_needs_doorbell()


def test_closed_flags():
    _, w, r = make()
    assert not r.writer_closed and not w.reader_closed
    w.try_write(b"last")
    w.close()
    assert r.writer_closed
    assert read_all(r) == [b"last"]  # what was published is still readable
    r.close()
    assert w.reader_closed
    assert not w.reader_wants_doorbell_for_close()
    r.park()
    assert w.reader_wants_doorbell_for_close()


def test_release_views():
    buf, w, r = make()
    w.release()
    r.release()
    buf.extend(b"x")  # no exported views any more


# -- a model check -------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    start=st.integers(0, 4 * CAP).map(lambda x: x & ~7),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("w"), st.integers(0, max_payload(CAP))),
            st.tuples(st.just("m"), st.lists(st.integers(0, 200), max_size=8)),
            st.tuples(st.just("r"), st.integers(1, 10)),
        ),
        max_size=60,
    ),
)
def test_against_a_queue_model(start, ops):
    """Every write that fits (skip at the end included) succeeds, every one that does
    not fails, and the reader hands back exactly what was written (tests/support/
    ringmodel.py states the rules)."""
    buf, _, _ = make()
    set_counters(buf, start)
    w, r = RingWriter(buf), RingReader(buf)
    model = RingModel(CAP, start)
    counter = 0

    def payload(n: int) -> bytes:
        nonlocal counter
        counter += 1
        return bytes([counter & 0xFF]) * n

    for op, arg in ops:
        if op == "w":
            p = payload(arg)
            fits = model.fits(arg)
            assert w.try_write(p) is model.write(p), f"a {arg}-byte write that fits={fits}"
        elif op == "m":
            ps = [payload(n) for n in arg]
            k, nbytes = w.write_many(ps)
            assert k == model.write_many(ps), [len(p) for p in ps]
            assert nbytes == sum(arg[:k])
        else:
            for _ in range(arg):
                v = r.next_frame()
                want = model.read()
                if v is None:
                    assert want is None
                    break
                assert bytes(v) == want
                v.release()
            r.commit()
            model.commit()
        tail = struct.unpack_from("=Q", buf, 64)[0]
        head = struct.unpack_from("=Q", buf, 128)[0]
        assert (tail, head) == (model.tail, model.head)
        assert 0 <= tail - head <= CAP
        assert sum(frame_size(len(m)) for m in model.payloads()) <= tail - head
    assert read_all(r) == model.payloads()


# -- read_many --------------------------------------------------------------------------


def test_read_many_batches_and_wraps():
    buf, _, _ = make()
    set_counters(buf, CAP - 24)
    w, r = RingWriter(buf), RingReader(buf)
    payloads = [bytes([i]) * (i * 10) for i in range(8)]
    n, _ = w.write_many(payloads)
    assert n == 8
    out: list[bytes] = []
    assert r.read_many(bytes, 3, out) == 0 + 10 + 20
    assert out == payloads[:3]
    assert struct.unpack_from("=Q", buf, 128)[0] == CAP - 24  # not committed
    r.commit()
    out.clear()
    assert r.read_many(bytes, 100, out) == sum(len(p) for p in payloads[3:])
    assert out == payloads[3:]
    assert r.read_many(bytes, 100, out) == 0
    r.commit()
    assert w.free == CAP


def test_read_many_sees_frames_published_meanwhile():
    _, w, r = make()
    w.try_write(b"a")
    out: list[bytes] = []

    def fn(v: memoryview) -> bytes:
        if len(out) == 0:
            w.try_write(b"b")  # published while the batch runs
        return bytes(v)

    r.read_many(fn, 10, out)
    assert out == [b"a", b"b"]


def test_read_many_bad_record():
    _, w, r = make()
    for p in (b"1", b"2", b"bad", b"4"):
        w.try_write(p)

    def fn(v: memoryview) -> int:
        return int(bytes(v))

    out: list[int] = []
    r.read_many(fn, 10, out)
    assert out == [1, 2]  # stops before the bad one
    out.clear()
    with pytest.raises(ValueError):
        r.read_many(fn, 10, out)  # the bad one first: raised, and consumed
    r.read_many(fn, 10, out)
    assert out == [4]


def test_read_many_corrupt_frame():
    buf, w, r = make()
    w.try_write(b"ok")
    w.try_write(b"then garbage")
    struct.pack_into("=I", buf, HEADER_SIZE + 8, 5000)
    out: list[bytes] = []
    r.read_many(bytes, 10, out)
    assert out == [b"ok"]
    with pytest.raises(RingCorrupted):
        r.read_many(bytes, 10, out)
    buf2, w2, r2 = make()
    set_counters(buf2, CAP - 16)
    w2, r2 = RingWriter(buf2), RingReader(buf2)
    w2.try_write(b"x" * 20)  # wraps
    struct.pack_into("=Q", buf2, 64, CAP)  # tail says: only the marker was published
    with pytest.raises(RingCorrupted, match="wrap"):
        r2.read_many(bytes, 10, [])


def test_read_many_on_error_sees_the_payload_and_replaces_the_error():
    _, w, r = make()
    for p in (b"1", b"x2", b"3", b"bad", b"5"):
        w.try_write(p)
    seen: list[tuple[bytes, str]] = []

    def on_error(v: memoryview, exc: Exception) -> int:
        seen.append((bytes(v), type(exc).__name__))  # the payload is still valid here
        if bytes(v) == b"x2":
            return -2  # what it returns is the record
        raise KeyError(bytes(v))  # what it raises replaces the error

    out: list[int] = []
    assert r.read_many(lambda v: int(bytes(v)), 10, out, on_error) == 4  # payload bytes
    assert out == [1, -2, 3]  # stops before the bad one, as without on_error
    assert seen == [(b"x2", "ValueError"), (b"bad", "ValueError")]
    out.clear()
    with pytest.raises(KeyError):
        r.read_many(lambda v: int(bytes(v)), 10, out, on_error)  # first: raised, consumed
    r.read_many(lambda v: int(bytes(v)), 10, out, None)
    assert out == [5]


def test_read_many_on_error_is_not_asked_about_base_exceptions():
    _, w, r = make()
    w.try_write(b"a")

    def fn(v: memoryview) -> None:
        raise KeyboardInterrupt

    def on_error(v: memoryview, exc: Exception) -> None:
        raise AssertionError("called")

    with pytest.raises(KeyboardInterrupt):
        r.read_many(fn, 10, [], on_error)
