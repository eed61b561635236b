"""ringwire._wire.lanes: which ring lane implementation runs, and the C lanes against
the pure ones on one buffer (the wire layout is the contract): every writer/reader
pairing, the release lane, the eventcount, and the payload views' lifetime.  The ring's
own tests (tests/unit/test_ring.py) run on both implementations; a native process and a
pure one over one segment are in tests/process/test_lanes.py."""

from __future__ import annotations

import mmap
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.ringmodel import RingModel

import ringwire
from ringwire._errors import RingCorrupted
from ringwire._wire import lanes
from ringwire._wire.ring import init_ring, ring_size

CAP = 1024
native = pytest.mark.skipif(
    lanes.NativeRingWriter is None, reason=f"the C ring is not built: {lanes.REASON}"
)
IMPLS = ["pure", "native"]


def writer_cls(impl: str):
    return lanes.PureRingWriter if impl == "pure" else lanes.NativeRingWriter


def reader_cls(impl: str):
    return lanes.PureRingReader if impl == "pure" else lanes.NativeRingReader


def fresh(cap: int = CAP) -> bytearray:
    buf = bytearray(ring_size(cap))
    init_ring(buf, 0, cap)
    return buf


def test_the_active_path_is_public() -> None:
    assert ringwire.native is lanes.NATIVE
    assert ringwire.native_reason == lanes.REASON
    assert lanes.NATIVE == (lanes.REASON == "")
    if lanes.NATIVE:
        assert lanes.RingWriter is lanes.NativeRingWriter
        assert lanes.RingReader is lanes.NativeRingReader
        assert lanes.ReleaseLaneWriter is lanes.NativeReleaseLaneWriter
    else:
        assert lanes.RingWriter is lanes.PureRingWriter
        assert lanes.ReleaseLaneWriter is lanes.PureReleaseLaneWriter


# -- a C end and a Python end on one ring -------------------------------------------------

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, 300)),
        st.tuples(st.just("many"), st.lists(st.integers(0, 200), max_size=8)),
        st.tuples(st.just("read"), st.integers(1, 6)),
        st.tuples(st.just("batch"), st.integers(1, 6)),
    ),
    max_size=60,
)


@native
@pytest.mark.parametrize("w_impl", IMPLS)
@pytest.mark.parametrize("r_impl", IMPLS)
@settings(max_examples=60, deadline=None)
@given(start=st.integers(0, 4 * CAP // 8).map(lambda x: x * 8), ops=_ops)
def test_any_writer_with_any_reader_against_a_queue_model(w_impl, r_impl, start, ops) -> None:
    buf = fresh()
    struct.pack_into("=Q", buf, 64, start)
    struct.pack_into("=Q", buf, 128, start)
    w, r = writer_cls(w_impl)(buf), reader_cls(r_impl)(buf)
    # every write that fits succeeds and every one that does not fails (the rules:
    # tests/support/ringmodel.py); the reader hands back exactly what was written
    model = RingModel(CAP, start)
    serial = 0

    def payload(n: int) -> bytes:
        nonlocal serial
        serial += 1
        return (serial.to_bytes(4, "little") * (n // 4 + 1))[:n]

    for op, arg in ops:
        if op == "write":
            p = payload(arg)
            fits = model.fits(arg)
            assert w.try_write(p) is model.write(p), f"a {arg}-byte write that fits={fits}"
        elif op == "many":
            ps = [payload(n) for n in arg]
            n, nbytes = w.write_many(ps)
            assert n == model.write_many(ps), arg
            assert nbytes == sum(len(p) for p in ps[:n])
        elif op == "read":
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
        else:
            out: list[bytes] = []
            nbytes = r.read_many(bytes, arg, out)
            assert out == [model.read() for _ in range(min(arg, len(model)))]
            assert nbytes == sum(map(len, out))
            r.commit()
            model.commit()
        assert struct.unpack_from("=Q", buf, 64)[0] == model.tail
        assert struct.unpack_from("=Q", buf, 128)[0] == model.head
    out = []
    r.read_many(bytes, 10_000, out)
    assert out == model.payloads()
    w.release()
    r.release()


@native
@pytest.mark.parametrize("w_impl", IMPLS)
@pytest.mark.parametrize("r_impl", IMPLS)
def test_release_lane_pairs_cross_implementations(w_impl, r_impl) -> None:
    buf = fresh()
    cls = lanes.PureReleaseLaneWriter if w_impl == "pure" else lanes.NativeReleaseLaneWriter
    w, r = cls(buf, 0), reader_cls(r_impl)(buf)
    batches = [[(1, 2)], [(3, 0), (2**64 - 1, 2**63)], [(i, i * 7) for i in range(20)]]
    for b in batches:
        assert w.put_pairs(b)
    for b in batches:
        assert r.next_pairs() == tuple(x for pair in b for x in pair)
    assert r.next_pairs() is None
    r.commit()
    with pytest.raises((OverflowError, struct.error)):
        w.put_pairs([(2**64, 0)])
    with pytest.raises((OverflowError, struct.error)):
        w.put_pairs([(-1, 0)])
    assert r.next_pairs() is None  # nothing was written
    assert w.put(b"\x00" * 24)
    with pytest.raises(RingCorrupted, match="release frame of 24 bytes"):
        r.next_pairs()
    assert r.next_pairs() is None  # the bad frame was consumed
    while w.put_pairs([(5, 5)] * 8):
        pass  # fill the lane: False, nothing torn
    n = 0
    while (vals := r.next_pairs()) is not None:
        assert vals == (5, 5) * 8
        n += 1
    assert n == (CAP - 32) // 136 or n > 0


@native
@pytest.mark.parametrize("w_impl", IMPLS)
@pytest.mark.parametrize("r_impl", IMPLS)
def test_eventcount_cross_implementations(w_impl, r_impl) -> None:
    buf = fresh()
    w, r = writer_cls(w_impl)(buf), reader_cls(r_impl)(buf)
    assert w.try_write(b"a") and not w.reader_needs_doorbell()
    r.park()
    assert w.try_write(b"b")
    assert w.reader_needs_doorbell()
    assert not w.reader_needs_doorbell()  # once per park
    r.park()
    assert w.reader_needs_doorbell()  # a new park is rung again
    r.unpark()
    assert not w.reader_needs_doorbell()
    # the writer parks for room; the reader rings after its commit
    while w.try_write(b"x" * 200):
        pass
    w.park()
    out: list[bytes] = []
    r.read_many(bytes, 100, out)
    r.commit()
    assert r.writer_needs_doorbell() and not r.writer_needs_doorbell()
    w.unpark()
    w.close()
    assert r.writer_closed and not w.reader_closed
    r.park()
    assert w.reader_wants_doorbell_for_close()
    r.close()
    assert w.reader_closed and w.try_write(b"c") is None


@native
@pytest.mark.parametrize("r_impl", IMPLS)
def test_the_same_corruption_raises_the_same_error(r_impl) -> None:
    """A lying length and a lying tail: the same RingCorrupted message on both paths
    (the exhaustive differential is the ring_native fuzz target)."""
    messages: dict[str, list[str]] = {}
    for impl in IMPLS:
        got = messages[impl] = []
        buf = fresh()
        struct.pack_into("=I", buf, 512, 0x7FFFFFF0)
        struct.pack_into("=Q", buf, 64, 64)
        with pytest.raises(RingCorrupted) as ei:
            reader_cls(impl)(buf).next_frame()
        got.append(str(ei.value))
        buf = fresh()
        r = reader_cls(impl)(buf)
        struct.pack_into("=Q", buf, 64, 10 * CAP)  # a tail past head + capacity
        with pytest.raises(RingCorrupted) as ei:
            r.read_many(bytes, 4, [])
        got.append(str(ei.value))
        buf = fresh()
        w = writer_cls(impl)(buf)
        struct.pack_into("=Q", buf, 128, 4096)  # a head past the tail, as the writer sees it
        with pytest.raises(RingCorrupted) as ei:
            while True:
                assert w.try_write(b"y" * 300)
        got.append(str(ei.value))
    assert messages["pure"] == messages["native"]
    assert messages["native"][0].startswith("bad frame length 2147483632")


@native
def test_a_live_payload_view_keeps_the_mapping() -> None:
    m = mmap.mmap(-1, ring_size(CAP))
    init_ring(m, 0, CAP)
    w, r = lanes.NativeRingWriter(m), lanes.NativeRingReader(m)
    assert w.try_write(b"payload")
    view = r.next_frame()
    assert view is not None and bytes(view) == b"payload"
    w.release()
    r.release()
    with pytest.raises(BufferError):
        m.close()  # the view still reads the mapping
    assert bytes(view) == b"payload"
    view.release()
    m.close()
    with pytest.raises(ValueError, match="released ring lane"):
        r.next_frame()
    with pytest.raises(ValueError, match="released ring lane"):
        w.try_write(b"x")


@native
def test_native_lanes_validate_their_buffer() -> None:
    with pytest.raises(TypeError, match="writable"):
        lanes.NativeRingReader(bytes(ring_size(CAP)))
    with pytest.raises(ValueError, match="too small"):
        lanes.NativeRingWriter(bytearray(100))
    with pytest.raises(RingCorrupted, match="bad magic"):
        lanes.NativeRingWriter(bytearray(ring_size(CAP)))
    buf = fresh()
    with pytest.raises(RingCorrupted, match="too small"):
        lanes.NativeRingReader(buf[: ring_size(CAP) - 8])
    struct.pack_into("=Q", buf, 8, 1000)
    with pytest.raises(RingCorrupted, match="power of two"):
        lanes.NativeRingReader(buf)
    with pytest.raises(TypeError):
        lanes.NativeRingWriter(fresh()).try_write("a str is not bytes")
    r = lanes.NativeRingReader(fresh())
    with pytest.raises(TypeError, match="once"):
        r.__init__(fresh())


@native
@pytest.mark.parametrize("impl", IMPLS)
def test_a_batch_with_a_non_payload_publishes_nothing(impl) -> None:
    buf = fresh()
    w, r = writer_cls(impl)(buf), reader_cls(impl)(buf)
    with pytest.raises(TypeError):
        w.write_many([b"a", b"b", 3])
    assert r.next_frame() is None and w.used() == 0
    assert w.write_many([b"c"]) == (1, 1)
    v = r.next_frame()
    assert v is not None and bytes(v) == b"c"
