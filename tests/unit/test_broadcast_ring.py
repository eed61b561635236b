"""Broadcast ring arithmetic and the join messages on plain bytearrays: no processes, no OS."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringwire._errors import FrameTooLarge, HandshakeError, RingCorrupted
from ringwire._wire.broadcast_control import (
    BROADCAST_VERSIONS,
    Join,
    Joined,
    MessageReader,
    Refused,
    Started,
    encode_broadcast_message,
    validate_join,
    validate_joined,
)
from ringwire._wire.broadcast_ring import (
    BROADCAST_WORDS,
    ENTRY_SIZE,
    ENTRY_WORDS,
    MAX_READERS,
    BroadcastReader,
    BroadcastWriter,
    broadcast_ring_size,
    init_broadcast_ring,
    read_broadcast_header,
    table_offset,
)
from ringwire._wire.control import SegmentSpec, choose_version
from ringwire._wire.ring import HEADER_SIZE, RingReader, max_payload

CAP = 1024


def make(n: int = 3, cap: int = CAP) -> tuple[bytearray, BroadcastWriter]:
    buf = bytearray(broadcast_ring_size(cap, n))
    init_broadcast_ring(buf, 0, cap, n)
    return buf, BroadcastWriter(buf)


def join(buf: bytearray, w: BroadcastWriter, rank: int, pid: int = 100) -> BroadcastReader:
    w.admit(rank, pid + rank)
    return BroadcastReader(buf, rank)


def drain(r: BroadcastReader) -> list[bytes]:
    out = []
    while (v := r.next_frame()) is not None:
        out.append(bytes(v))
        v.release()
    r.commit()
    return out


def word(buf: bytearray, index: int) -> int:
    return struct.unpack_from("=Q", buf, 8 * index)[0]


def entry_word(buf: bytearray, rank: int, field: str) -> int:
    off = table_offset(CAP) + rank * ENTRY_SIZE + 8 * ENTRY_WORDS[field]
    return struct.unpack_from("=Q", buf, off)[0]


def set_entry_word(buf: bytearray, rank: int, field: str, value: int) -> None:
    off = table_offset(CAP) + rank * ENTRY_SIZE + 8 * ENTRY_WORDS[field]
    struct.pack_into("=Q", buf, off, value)


# -- layout -------------------------------------------------------------------------------


def test_sizes_and_header():
    assert table_offset(CAP) == HEADER_SIZE + CAP
    assert broadcast_ring_size(CAP, 4) == HEADER_SIZE + CAP + 4 * ENTRY_SIZE
    buf, w = make(4)
    assert read_broadcast_header(buf) == (CAP, 4)
    assert word(buf, BROADCAST_WORDS["readers"]) == 4
    assert word(buf, BROADCAST_WORDS["table_offset"]) == HEADER_SIZE + CAP
    assert buf[:6] == b"RWRING"  # it is a ring lane first
    assert buf[16:22] == b"RWBCST"
    assert w.readers == 4 and w.live == [] and w.max_payload == max_payload(CAP)
    for bad in (0, MAX_READERS + 1, 2.0):
        with pytest.raises(ValueError):
            broadcast_ring_size(CAP, bad)  # type: ignore[arg-type]


def test_every_reader_word_has_its_own_cache_line():
    lines = {v // 8 for k, v in ENTRY_WORDS.items() if k in ("head", "parked", "closed")}
    assert len(lines) == 3 and ENTRY_WORDS["state"] // 8 not in lines
    assert ENTRY_SIZE % 64 == 0 and table_offset(CAP) % 64 == 0


def test_a_plain_ring_or_a_short_buffer_is_not_a_broadcast_ring():
    from ringwire._wire.ring import init_ring, ring_size

    plain = bytearray(ring_size(CAP))
    init_ring(plain, 0, CAP)
    with pytest.raises(RingCorrupted, match="no broadcast ring"):
        read_broadcast_header(plain)
    buf, _ = make(3)
    with pytest.raises(RingCorrupted, match="outside the buffer"):
        read_broadcast_header(buf[: len(buf) - 1])
    struct.pack_into("=Q", buf, 8 * BROADCAST_WORDS["readers"], MAX_READERS + 1)
    with pytest.raises(RingCorrupted):
        BroadcastWriter(buf)
    with pytest.raises(RingCorrupted, match="outside the reader table"):
        BroadcastReader(make(2)[0], 2)


# -- publishing to several readers ------------------------------------------------------


def test_every_reader_gets_every_frame_in_order():
    buf, w = make(3)
    readers = [join(buf, w, r) for r in range(3)]
    frames = [bytes([i]) * (i % 40) for i in range(30)]
    for f in frames[:10]:
        assert w.try_write(f)
    assert [drain(r) for r in readers] == [frames[:10]] * 3
    for f in frames[10:]:
        assert w.try_write(f)
    assert drain(readers[1]) == frames[10:]
    assert drain(readers[0]) == frames[10:]
    assert drain(readers[2]) == frames[10:]


def test_space_is_reused_only_after_the_slowest_live_reader():
    buf, w = make(2)
    fast, slow = join(buf, w, 0), join(buf, w, 1)
    big = b"x" * max_payload(CAP)
    assert w.try_write(big) and w.try_write(big)
    assert not w.try_write(b"y")  # full
    assert drain(fast) == [big, big]
    assert not w.try_write(b"y")  # the slow one still holds everything
    assert w.laggards(1) == [1]
    assert len(drain(slow)) == 2
    assert w.try_write(b"y")
    assert w.used() == 8 and w.free == CAP - 8


def test_with_no_reader_every_byte_is_free():
    _, w = make(2)
    for _ in range(10):
        assert w.try_write(b"z" * max_payload(CAP))
    assert w.used() == 0


def test_write_many_publishes_a_prefix_and_keeps_the_slow_reader_safe():
    buf, w = make(2)
    r0, r1 = join(buf, w, 0), join(buf, w, 1)
    payloads = [bytes([i]) * 100 for i in range(20)]
    n, nbytes = w.write_many(payloads)
    assert 0 < n < 20 and nbytes == 100 * n
    assert drain(r0) == payloads[:n]
    m, _ = w.write_many(payloads, n)
    assert m == 0  # r1 has not read anything
    assert drain(r1) == payloads[:n]
    m, _ = w.write_many(payloads, n)
    assert m > 0
    assert drain(r0) == payloads[n : n + m] == drain(r1)


def test_frame_size_limit_is_the_lanes():
    _, w = make(1)
    with pytest.raises(FrameTooLarge):
        w.try_write(b"x" * (max_payload(CAP) + 1))


# -- joining, leaving, being dropped ----------------------------------------------------


def test_a_late_joiner_starts_at_the_current_tail():
    buf, w = make(3)
    r0 = join(buf, w, 0)
    for i in range(5):
        w.try_write(bytes([i]))
    late = join(buf, w, 2, pid=7)
    assert late.start == 5 * 8 and entry_word(buf, 2, "state") == 9
    assert entry_word(buf, 2, "admissions") == 1
    w.try_write(b"new")
    assert drain(late) == [b"new"]
    assert len(drain(r0)) == 6
    with pytest.raises(ValueError, match="already admitted"):
        w.admit(2, 1)
    with pytest.raises(ValueError, match="outside the reader table"):
        w.admit(3, 1)


def test_a_removed_reader_stops_holding_space_and_learns_it_was_overtaken():
    buf, w = make(2)
    live, gone = join(buf, w, 0), join(buf, w, 1)
    big = b"q" * (max_payload(CAP) - 4)
    w.try_write(big)
    w.try_write(big)
    assert gone.next_frame() is not None  # mid-read when it is dropped
    w.remove(1)
    assert entry_word(buf, 1, "state") == 0 and gone.state == 0
    drain(live)
    assert w.try_write(b"overwrites")  # reuses the bytes `gone` was reading
    with pytest.raises(RingCorrupted, match="overtaken"):
        gone.commit()
    assert gone.lapped
    with pytest.raises(RingCorrupted):
        gone.available()
    # the live reader never trips the horizon check
    assert drain(live) == [b"overwrites"]


def test_a_reader_that_was_not_overtaken_commits_normally_after_removal():
    buf, w = make(2)
    r0, r1 = join(buf, w, 0), join(buf, w, 1)
    w.try_write(b"a")
    w.remove(1)
    assert drain(r1) == [b"a"]  # nothing was reused yet
    assert drain(r0) == [b"a"]


def test_a_head_out_of_range_marks_the_reader_faulty():
    buf, w = make(3)
    r0 = join(buf, w, 0)
    join(buf, w, 1)
    w.try_write(b"x" * max_payload(CAP))
    w.try_write(b"x" * max_payload(CAP))
    set_entry_word(buf, 1, "head", 1 << 40)  # past the tail
    drain(r0)
    assert w.try_write(b"y")  # reader 1 no longer counts
    assert w.faulty == [1] and w.live == [0]
    w.faulty.clear()
    join(buf, w, 2)
    w.try_write(b"z")
    set_entry_word(buf, 2, "head", 0)  # backwards
    for _ in range(4):
        w.try_write(b"w" * 300)
    drain(r0)
    w.free  # noqa: B018  (a fresh look at the heads)
    assert w.faulty == [2]


def test_a_reader_entry_that_lies_is_refused_at_attach():
    buf, w = make(2)
    w.admit(0, 1)
    set_entry_word(buf, 0, "head", 1 << 20)  # beyond the tail
    with pytest.raises(RingCorrupted, match="not within"):
        BroadcastReader(buf, 0)


def test_closed_flags_both_ways():
    buf, w = make(2)
    r = join(buf, w, 1)
    assert not w.reader_closed_flag(1) and not r.reader_closed
    r.close()
    assert w.reader_closed_flag(1) and r.reader_closed
    assert not r.writer_closed
    w.close()
    assert r.writer_closed
    assert not w.reader_closed  # the lane protocol's flag: a broadcast has no one reader


# -- the eventcount ---------------------------------------------------------------------


def test_the_writer_rings_each_parked_reader_once_per_park():
    buf, w = make(3)
    readers = [join(buf, w, r) for r in range(3)]
    w.try_write(b"a")
    assert not w.reader_needs_doorbell()
    readers[0].park()
    readers[2].park()
    w.try_write(b"b")
    assert w.reader_needs_doorbell() and w.to_ring == [0, 2]
    w.try_write(b"c")
    assert not w.reader_needs_doorbell()  # rung for these parks already
    readers[2].unpark()
    readers[2].park()  # a new park: a new sequence number
    assert w.reader_needs_doorbell() and w.to_ring == [2]
    readers[1].park()
    w.close()
    assert w.reader_wants_doorbell_for_close() and w.to_ring == [0, 1, 2]


def test_every_reader_rings_a_parked_writer_once_per_park():
    buf, w = make(2)
    r0, r1 = join(buf, w, 0), join(buf, w, 1)
    w.try_write(b"x" * max_payload(CAP))
    w.try_write(b"x" * max_payload(CAP))
    w.park()
    drain(r0)
    assert r0.writer_needs_doorbell()
    assert not r0.writer_needs_doorbell()
    drain(r1)
    assert r1.writer_needs_doorbell()  # each reader rings for itself
    w.unpark()
    assert not RingReader.writer_needs_doorbell(r1)


# -- the whole thing, shuffled -----------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("w"), st.integers(0, max_payload(CAP))),
            st.tuples(st.just("r"), st.integers(0, 2)),
            st.tuples(st.just("drop"), st.integers(0, 2)),
            st.tuples(st.just("join"), st.integers(0, 2)),
        ),
        max_size=120,
    )
)
def test_random_interleavings_deliver_every_frame_once_in_order(ops):
    buf, w = make(3)
    readers: dict[int, BroadcastReader] = {r: join(buf, w, r) for r in range(3)}
    expected: dict[int, list[bytes]] = {r: [] for r in range(3)}
    seq = 0
    for op, arg in ops:
        if op == "w":
            payload = seq.to_bytes(4, "little") * (arg // 4)
            if w.try_write(payload):
                seq += 1
                for r in w.live:
                    expected[r].append(payload)
        elif op == "r" and arg in readers:
            got = drain(readers[arg])
            assert got == expected[arg]
            expected[arg] = []
        elif op == "drop" and arg in readers and len(readers) > 1:
            w.remove(arg)
            readers.pop(arg).release()
            expected[arg] = []
        elif op == "join" and arg not in readers:
            readers[arg] = join(buf, w, arg)
    for r, reader in readers.items():
        assert drain(reader) == expected[r]
    assert not w.faulty


# -- the join messages ------------------------------------------------------------------


def joined(**kw):
    base = dict(
        version=1,
        pid=1,
        rank=0,
        start=0,
        capacity=CAP,
        readers=2,
        ring=SegmentSpec("/rw.1.aaaaaaaaaaaa", 4096, "broadcast"),
        pool=SegmentSpec("/rw.1.bbbbbbbbbbbb", 1 << 20, "slots"),
        lane_offset=4096,
        fds=2,
    )
    base.update(kw)
    return Joined(**base)


def test_messages_round_trip_in_pieces():
    msgs = [Join(versions=[1], pid=5, rank=2), joined(), Refused("no"), Started()]
    data = b"".join(encode_broadcast_message(m) for m in msgs) + b"DS"
    reader = MessageReader()
    got = []
    for i in range(0, len(data), 7):
        reader.feed(data[i : i + 7])
        while (m := reader.next()) is not None:
            got.append(m)
            if isinstance(m, Started):
                break
    assert got == msgs
    assert reader.rest == b"DS"


def test_bad_messages_are_handshake_errors():
    r = MessageReader()
    r.feed(struct.pack(">I", 10) + b"\xc1" * 10)
    with pytest.raises(HandshakeError, match="malformed"):
        r.next()
    r = MessageReader()
    r.feed(struct.pack(">I", 1 << 30))
    with pytest.raises(HandshakeError, match="bytes"):
        r.next()
    with pytest.raises(HandshakeError, match="version"):
        choose_version([7], BROADCAST_VERSIONS, "broadcast protocol")
    assert choose_version([1, 7], BROADCAST_VERSIONS, "broadcast protocol") == 1
    with pytest.raises(HandshakeError, match="magic"):
        validate_join(Join(magic="x", versions=[1], pid=1), 4)
    with pytest.raises(HandshakeError, match="rank"):
        validate_join(Join(versions=[1], pid=1, rank=4), 4)
    validate_join(Join(versions=[1], pid=1, rank=-1), 4)


@pytest.mark.parametrize(
    ("kw", "fds", "match"),
    [
        ({"version": 9}, 2, "version"),
        ({"capacity": 1000}, 2, "capacity"),
        ({"rank": 2}, 2, "rank"),
        ({}, 1, "descriptor"),
        ({"pool": None, "fds": 1}, 2, "descriptor"),
        ({"lane_offset": 0}, 2, "lane"),
        ({"start": -1}, 2, "start"),
    ],
)
def test_validate_joined(kw, fds, match):
    validate_joined(joined(), 2)
    validate_joined(joined(pool=None, fds=1), 1)
    with pytest.raises(HandshakeError, match=match):
        validate_joined(joined(**kw), fds)
