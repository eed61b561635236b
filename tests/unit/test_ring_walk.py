"""Tests of ringwire._wire.ring_walk: counting a ring's records by walking its frames."""

from __future__ import annotations

from ringwire._wire import ring_walk
from ringwire._wire.broadcast_ring import (
    BroadcastReader,
    BroadcastWriter,
    broadcast_ring_size,
    init_broadcast_ring,
)
from ringwire._wire.ring import HEADER_SIZE, RingReader, RingWriter, init_ring, ring_size

CAP = 1024


def ring() -> tuple[bytearray, RingWriter, RingReader]:
    buf = bytearray(ring_size(CAP))
    init_ring(buf, 0, CAP)
    return buf, RingWriter(buf), RingReader(buf)


def tail_of(w: RingWriter) -> int:
    return int(w.header[8])  # (ring.py's TAIL word)


def span(buf: bytearray, start: int, end: int) -> bytes:
    """The data-area bytes between counters ``start`` and ``end``."""
    data = buf[HEADER_SIZE : HEADER_SIZE + CAP]
    off = start % CAP
    first = min(end - start, CAP - off)
    return bytes(data[off : off + first]) + bytes(data[: end - start - first])


def test_count_frames_follows_frames_and_wrap_markers() -> None:
    buf, w, r = ring()
    start = 0
    for sizes in ([1, 2, 3], [100, 200], [300], [5] * 20, [250, 250]) * 2:  # wraps
        for n in sizes:
            assert w.try_write(b"x" * n)
        end = tail_of(w)
        assert ring_walk.count_frames(span(buf, start, end), start, CAP) == len(sizes)
        while r.next_frame() is not None:
            pass
        r.commit()
        start = end
    assert start > 2 * CAP  # the counters went round the ring more than once
    assert ring_walk.count_frames(b"", 0, CAP) == 0


def test_count_frames_refuses_what_is_not_a_chain_of_frames() -> None:
    buf, w, _ = ring()
    for n in (10, 20, 30):
        assert w.try_write(b"y" * n)
    data = span(buf, 0, tail_of(w))
    assert ring_walk.count_frames(data, 0, CAP) == 3
    assert ring_walk.count_frames(data[:-8], 0, CAP) is None  # ends inside a frame
    assert ring_walk.count_frames(data + bytes(4), 0, CAP) is None  # a torn length
    bad = bytearray(data)
    bad[0:4] = (CAP).to_bytes(4, "little")  # longer than the largest payload
    assert ring_walk.count_frames(bytes(bad), 0, CAP) is None
    bad[0:4] = (CAP // 2 - 4).to_bytes(4, "little")  # a frame crossing the end of the area
    assert ring_walk.count_frames(bytes(bad), CAP - 64, CAP) is None


def test_unread_records_counts_what_the_reader_has_not_consumed() -> None:
    buf, w, r = ring()
    assert ring_walk.unread_records(w) == ring_walk.unread_records(r) == 0
    for _ in range(6):  # the counters go round the ring
        for n in (7, 100, 30, 300):
            assert w.try_write(b"q" * n)
        assert ring_walk.unread_records(w) == ring_walk.unread_records(r) == 4
        assert r.next_frame() is not None
        assert ring_walk.unread_records(r) == 4  # read, not committed: still unread
        r.commit()
        assert ring_walk.unread_records(w) == 3
        while r.next_frame() is not None:
            pass
        r.commit()
        assert ring_walk.unread_records(r) == 0
    for _ in range(30):
        assert w.try_write(b"z" * 10)
    assert ring_walk.unread_records(w, max_frames=30) == 30
    assert ring_walk.unread_records(w, max_frames=10) == 30  # estimated: frames of one size
    r.next_frame()
    r.commit()
    assert ring_walk.unread_records(w, max_frames=5) == 29


def test_unread_records_is_none_for_what_is_not_a_chain_of_frames() -> None:
    buf, w, r = ring()
    for n in (10, 20, 30):
        assert w.try_write(b"y" * n)
    assert ring_walk.unread_records(r) == 3
    buf[HEADER_SIZE : HEADER_SIZE + 4] = (CAP).to_bytes(4, "little")  # longer than a payload
    assert ring_walk.unread_records(r) is None


def test_a_broadcast_reader_counts_from_its_own_head() -> None:
    cap, n = 1024, 2
    buf = bytearray(broadcast_ring_size(cap, n))
    init_broadcast_ring(buf, 0, cap, n)
    w = BroadcastWriter(buf)
    for r in range(n):
        w.admit(r, pid=1000 + r)
    readers = [BroadcastReader(buf, r) for r in range(n)]
    for i in range(5):
        assert w.try_write(b"s" * (10 + i))
    assert [ring_walk.unread_records(r) for r in readers] == [5, 5]
    for _ in range(3):
        assert readers[0].next_frame() is not None
    readers[0].commit()
    assert [ring_walk.unread_records(r) for r in readers] == [2, 5]
