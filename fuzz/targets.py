"""Fuzz targets for every parser that reads bytes a peer controls.

Each target is a function ``run(data: bytes) -> str`` that feeds ``data`` to one
parser and checks what came out.  It returns the outcome (``"ok"``, ``"refused"``, ...)
when everything is as documented, and raises anything else:

* an exception that is not one of the documented ones (``IndexError``,
  ``struct.error``, ``UnicodeDecodeError``, ``OverflowError``, ``MemoryError`` from a
  lying length...) escapes as it is;
* a documented error that is only a wrapper (the codec's last-resort
  ``DecodeError("Ext N: IndexError: ...")``) and a broken invariant (a release of a slot
  that was never lent, a pool whose bookkeeping no longer matches its table, a frame
  parsed differently by the two ring readers) raise :class:`Finding`.

The same targets are driven by the atheris harness (``fuzz/atheris_fuzz.py``,
coverage-guided, where atheris installs) and by hypothesis in ``tests/unit/test_fuzz.py`` / ``tests/process/test_fuzz.py``.
:func:`seeds` gives each target's seed corpus: valid messages produced by the
ringwire Encoder and the handshake/ring/slot writers, so mutations start deep.

Targets
-------
``decode_untyped``  ``Decoder()`` (copying, ``zero_copy=True`` and ``cuda_fallback="cpu"``);
                    every Ext code 1-11; a decoded value must encode and decode stably.
``decode_typed``    ``Decoder(FuzzItem)``, a Record with typed, untyped, tensor and
                    array fields.
``decode_slots``    the transport's receive path with a resolver: the channel's own
                    ``ShmRecvPool.decode`` (``resolve`` / ``salvage``) over a slot
                    pool in a bytearray; every release must name a slot that was lent,
                    once, and nothing may stay held after the record is dropped.
``descriptor``      ``SlotRef`` / ``CudaRef`` payloads (Ext 4/5) on their own.
``ring``            ring frame parsing: ``RingReader.next_frame`` and ``read_many``
                    against a reference parser, the writer against a lying head, and
                    attach-time header checks.
``ring_native``     the same ring checks on the C lanes (``ringwire._wire._cring``: a
                    parser of peer-controlled bytes in C), mixed C/Python writer and
                    reader pairs, and a differential: the C and the Python reader must
                    read the same frames and raise the same errors, word for word
                    (``"not built"`` where the extension is absent).
``handshake``       ``decode_message``, the client and server handshake state machines,
                    ``validate_hello``.
``release_lane``    the producer's release-lane parsing (``ShmSendPool.poll``) against a
                    model of the pool: refused releases never touch it.
``net_control``, ``net_transport``, ``net_handshake``
                    the TCP transport's parsers (``fuzz/net_targets.py``, loaded here
                    where pyzmq is installed): control messages, the receive path of a
                    NetTransport over a fake socket with Ext 20 resolution, the
                    rendezvous and the attach.
"""

from __future__ import annotations

import array
import gc
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import msgspec
import numpy as np
import torch

from ringwire._errors import (
    DecodeError,
    EncodeError,
    FrameTooLarge,
    HandshakeError,
    RingCorrupted,
    SlotRefused,
)
from ringwire._pool.slotconfig import RELEASE_CAPACITY, SlotConfig
from ringwire._shm.recvpool import ShmRecvPool
from ringwire._shm.sendpool import ShmSendPool
from ringwire._wire import lanes
from ringwire._wire.codec import Decoder, Encoder
from ringwire._wire.control import (
    MAX_MESSAGE,
    Handshake,
    Hello,
    Ready,
    Refused,
    RingSpec,
    SegmentSpec,
    Welcome,
    choose_version,
    decode_message,
    encode_message,
    validate_hello,
)
from ringwire._wire.descriptors import CudaRef, SlotRef, decode_descriptor
from ringwire._wire.dtypes import numpy_dtype_from_wire, torch_dtype_from_wire
from ringwire._wire.record import Record
from ringwire._wire.ring import (
    HEADER_SIZE,
    MIN_CAPACITY,
    WRAP_MARKER,
    RingReader,
    RingWriter,
    check_ring,
    init_ring,
    max_payload,
    ring_size,
)
from ringwire._wire.slotlayout import (
    FREE,
    LOANED,
    SENT,
    SlotClass,
    init_pool,
    pool_size,
    slot_state,
)

__all__ = ["Finding", "TARGETS", "Target", "seeds", "suspect_cause"]

Ext = msgspec.msgpack.Ext


class Finding(AssertionError):
    """A fuzz input broke an invariant (or was refused for an undocumented reason)."""


# The codec's last resort wraps anything unforeseen in an Ext handler as
# DecodeError(f"Ext {code}: {type(exc).__name__}: {exc}"): documented, but each one is a
# check the decoder is missing, so the fuzzer reports it.
_WRAPPED = re.compile(r"Ext -?\d+: (\w+): ")


def suspect_cause(exc: BaseException) -> BaseException | None:
    """The unforeseen exception behind a last-resort ``DecodeError``, if any."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 32:
        m = _WRAPPED.match(str(e)) if isinstance(e, DecodeError) else None
        cause = e.__cause__
        if m and cause is not None and type(cause).__name__ == m.group(1):
            if not isinstance(cause, (DecodeError, RecursionError)):
                return cause
        e = cause
        seen += 1
    return None


def _refused(exc: DecodeError) -> str:
    cause = suspect_cause(exc)
    if cause is not None:
        raise Finding(f"a last-resort DecodeError hides {type(cause).__name__}: {exc}") from exc
    return "refused"


# ---------------------------------------------------------------------------- codec

_enc = Encoder()


class FuzzItem(Record):
    """A record shaped like an inference server's: typed, untyped and tensor fields."""

    modality: str = ""
    hash: Optional[int] = None
    offsets: Optional[list[tuple[int, int]]] = None
    feature: object = None
    array: Optional[np.ndarray] = None
    tensor: Optional[torch.Tensor] = None
    grid: tuple[int, ...] = ()
    meta: dict[str, object] = {}


_dec_any = Decoder()
_dec_zero = Decoder(zero_copy=True)
_dec_cpu = Decoder(cuda_fallback="cpu")
_dec_typed = Decoder(FuzzItem)
_dec_typed_list = Decoder(list[FuzzItem])


def _stable(dec: Decoder, value: Any, what: str) -> None:
    """A value the decoder produced must encode, and decode again to the same bytes."""
    try:
        once = _enc.encode(value)
    except EncodeError as exc:
        raise Finding(f"{what}: a decoded value cannot be encoded again: {exc}") from exc
    try:
        twice = _enc.encode(dec.decode(once))
    except DecodeError as exc:
        raise Finding(f"{what}: a re-encoded value does not decode: {exc}") from exc
    if once != twice:
        raise Finding(f"{what}: encode(decode(x)) is not stable:\n{once!r}\n{twice!r}")


def decode_untyped(data: bytes) -> str:
    outcome = "refused"
    for dec, what in ((_dec_any, "untyped"), (_dec_zero, "zero_copy"), (_dec_cpu, "cpu")):
        try:
            value = dec.decode(data)
        except DecodeError as exc:
            _refused(exc)
            continue
        _stable(_dec_any, value, what)
        outcome = "ok"
    return outcome


def decode_typed(data: bytes) -> str:
    outcome = "refused"
    for dec, what in ((_dec_typed, "typed"), (_dec_typed_list, "typed list")):
        try:
            value = dec.decode(data)
        except DecodeError as exc:
            _refused(exc)
            continue
        _stable(dec, value, what)
        outcome = "ok"
    return outcome


def descriptor(data: bytes) -> str:
    if not data:
        return "empty"
    cls = SlotRef if data[0] & 1 else CudaRef
    try:
        ref = decode_descriptor(cls, memoryview(data)[1:])
    except DecodeError as exc:
        return _refused(exc)
    if ref.kind == "numpy":
        itemsize = numpy_dtype_from_wire(ref.dtype).itemsize
    else:
        itemsize = torch_dtype_from_wire(ref.dtype).itemsize
    n = 1
    for d in ref.shape:
        n *= d
    if ref.version != 1 or n * itemsize != ref.nbytes:
        raise Finding(f"an inconsistent descriptor was accepted: {ref!r}")
    if decode_descriptor(cls, memoryview(msgspec.msgpack.encode(ref))) != ref:
        raise Finding(f"descriptor does not round-trip: {ref!r}")
    return "ok"


# ---------------------------------------------------------------- codec + slot resolver

POOL_ID = 0x5EED_F00D_0000_0001
POOL_CLASSES = (SlotClass(256, 3), SlotClass(4096, 3))
_PSIZE = pool_size(POOL_CLASSES)


def _sent_pool() -> tuple[bytearray, Any]:
    """A pool in a bytearray: slots 0-3 SENT (slot 1 at generation 3), 4 LOANED, 5 FREE."""
    buf = bytearray(_PSIZE + ring_size(RELEASE_CAPACITY))
    layout = init_pool(buf, POOL_CLASSES, pool_id=POOL_ID)
    init_ring(buf, _PSIZE, RELEASE_CAPACITY)
    for slot, gen, status in (
        (0, 0, SENT),
        (1, 3, SENT),
        (2, 0, SENT),
        (3, 0, SENT),
        (4, 0, LOANED),
    ):
        struct.pack_into("=Q", buf, 64 + 32 * slot + 16, gen << 2 | status)
    return buf, layout


_rbuf, _rlayout = _sent_pool()
_LENT = {(s, slot_state(_rbuf, s)[0]) for s in range(6) if slot_state(_rbuf, s)[1] == SENT}
_recv = ShmRecvPool(SimpleNamespace(buf=_rbuf, close=lambda: True), _rlayout, lambda: None, False)
_lane = RingReader(_rbuf, _PSIZE)
_slot_decoders = (
    Decoder(resolver=_recv.resolve),
    Decoder(FuzzItem, resolver=_recv.resolve),
)


def _drain_releases() -> list[tuple[int, int]]:
    out = []
    while (view := _lane.next_frame()) is not None:
        vals = struct.unpack(f"={len(view) // 8}Q", view)
        view.release()
        out.extend(zip(vals[::2], vals[1::2]))
    _lane.commit()
    return out


def decode_slots(data: bytes) -> str:
    outcome = "refused"
    for dec in _slot_decoders:
        view = memoryview(data)
        try:
            value = _recv.decode(dec, view)
            outcome = "ok"
        except DecodeError as exc:
            _refused(exc)
            value = None
        del value
        if _recv.held:
            gc.collect()
        if _recv.held:
            raise Finding(f"slots still held after the record was dropped: {_recv.held}")
        _recv.flush()
        if len(_recv.queue):
            raise Finding("releases stuck in the queue")
        released = _drain_releases()
        if len(set(released)) != len(released):
            raise Finding(f"a slot was released twice by one record: {released}")
        bad = [r for r in released if r not in _LENT]
        if bad:
            raise Finding(f"released slots that were never lent: {bad}")
    return outcome


# ------------------------------------------------------------------------------- ring

CAP = MIN_CAPACITY
_MAXP = max_payload(CAP)


def _reference_frames(data: bytes, head: int, tail: int) -> tuple[list[bytes], bool]:
    """An independent reading of the frame format: (payloads, corrupt?)."""
    if tail < head or tail - head > CAP:
        return [], True
    out = []
    h = head
    while h != tail:
        pos = h % CAP
        (n,) = struct.unpack_from("=I", data, pos)
        if n == WRAP_MARKER:
            if pos == 0 or h + CAP - pos >= tail:
                return out, True
            h += CAP - pos
            pos = 0
            (n,) = struct.unpack_from("=I", data, 0)
        need = (n + 11) & ~7
        if n > _MAXP or h + need > tail or pos + need > CAP:  # frames never cross the end
            return out, True
        out.append(bytes(data[pos + 4 : pos + 4 + n]))
        h += need
    return out, False


def _ring_with(head: int, tail: int, area: bytes) -> bytearray:
    buf = bytearray(ring_size(CAP))
    init_ring(buf, 0, CAP)
    struct.pack_into("=QQ", buf, 64, head, 0)
    struct.pack_into("=Q", buf, 128, head)
    buf[HEADER_SIZE : HEADER_SIZE + len(area)] = area
    return buf


def _publish(buf: bytearray, tail: int) -> None:
    struct.pack_into("=Q", buf, 64, tail)


def _ring_read(data: bytes, R: Any = RingReader) -> str:
    if len(data) < 12:
        return "short"
    head = int.from_bytes(data[:8], "little") % (1 << 63) & ~7  # the reader's heads are 8-aligned
    delta = int.from_bytes(data[8:12], "little") - 64
    tail = max(0, min(head + delta, 2**64 - 1))
    area = data[12 : 12 + CAP].ljust(CAP, b"\x00")
    want, corrupt = _reference_frames(area, head, tail)

    # next_frame, one at a time
    buf = _ring_with(head, tail, area)
    reader = R(buf)
    _publish(buf, tail)
    got: list[bytes] = []
    bad = False
    for _ in range(CAP):
        try:
            v = reader.next_frame()
        except RingCorrupted:
            bad = True
            break
        if v is None:
            break
        got.append(bytes(v))
        v.release()
    else:
        raise Finding("next_frame did not stop")
    reader.commit()
    if got != want or bad != corrupt:
        raise Finding(f"next_frame read {got!r} (corrupt {bad}), expected {want!r} ({corrupt})")

    # read_many in batches, with a decoder that refuses payloads starting with 0xEE
    buf = _ring_with(head, tail, area)
    reader = R(buf)
    _publish(buf, tail)
    seen: list[bytes] = []
    refused: list[bytes] = []
    bad = False

    def fn(v: memoryview) -> bytes:
        b = bytes(v)
        if b[:1] == b"\xee":
            refused.append(b)
            raise DecodeError("refused")
        return b

    batch = (data[12] % 7 + 1) if len(data) > 12 else 3
    for _ in range(2 * CAP):
        out: list[bytes] = []
        try:
            reader.read_many(fn, batch, out)
        except RingCorrupted:
            bad = True
            break
        except DecodeError:
            seen.append(refused[-1])  # the first frame of a batch: consumed
        else:
            if not out:
                break
        seen.extend(out)
        reader.commit()
    else:
        raise Finding("read_many did not stop")
    if seen != want or bad != corrupt:
        raise Finding(f"read_many read {seen!r} (corrupt {bad}), expected {want!r} ({corrupt})")
    return "corrupt" if corrupt else "ok"


def _ring_write(data: bytes, W: Any = RingWriter, R: Any = RingReader) -> str:
    """A writer and an honest reader, then a reader that lies about its head."""
    if len(data) < 4:
        return "short"
    start = int.from_bytes(data[:4], "little") * 8
    buf = _ring_with(start, start, b"")
    writer, reader = W(buf), R(buf)
    sent: list[bytes] = []
    got: list[bytes] = []
    i = 4
    outcome = "ok"
    while i < len(data):
        op = data[i]
        i += 1
        if op < 0x80:  # write a frame of op * 5 bytes
            payload = bytes([op]) * (op * 5)
            try:
                if writer.try_write(payload):
                    sent.append(payload)
            except FrameTooLarge:
                if len(payload) <= _MAXP:
                    raise Finding(f"a {len(payload)}-byte frame was refused as too large") from None
        elif op < 0xF0:  # the reader takes what is there
            while (v := reader.next_frame()) is not None:
                got.append(bytes(v))
                v.release()
            reader.commit()
        else:  # the reader lies about its head
            lie = int.from_bytes(data[i : i + 8].ljust(8, b"\x00"), "little")
            i += 8
            struct.pack_into("=Q", buf, 128, lie)
            try:
                for _ in range(4):
                    writer.try_write(b"x" * 100)
                writer.write_many([b"y" * 10] * 50)
            except RingCorrupted:
                outcome = "corrupt"
            return outcome
    while (v := reader.next_frame()) is not None:
        got.append(bytes(v))
        v.release()
    if got != sent:
        raise Finding("the honest reader did not get exactly what was written")
    return outcome


def _ring_attach(data: bytes, W: Any = RingWriter, R: Any = RingReader) -> str:
    buf = bytearray(ring_size(CAP))
    buf[: len(data)] = data[: len(buf)]
    outcome = "ok"
    try:
        check_ring(buf, 0, CAP)
    except RingCorrupted:
        outcome = "refused"
    try:
        R(buf).release()
        W(buf).release()
    except RingCorrupted:
        outcome = "refused"
    return outcome


def ring(data: bytes) -> str:
    if not data:
        return "empty"
    mode = data[0] % 3
    body = data[1:]
    if mode == 0:
        return _ring_read(body)
    if mode == 1:
        return _ring_write(body)
    return _ring_attach(body)


def _on_error(v: memoryview, exc: Exception) -> bytes:
    b = bytes(v)  # the payload is still valid here
    if b[1:2] == b"\x01":
        return b"recovered:" + b
    raise DecodeError(f"replaced: {exc}")


def _outcomes(reader: Any, how: str, fn: Callable[[memoryview], Any]) -> list[Any]:
    """Everything a reader makes of its ring, errors as ("!", type, message)."""
    got: list[Any] = []
    for _ in range(2 * CAP):
        try:
            if how == "next_frame":
                v = reader.next_frame()
                item = None if v is None else bytes(v)
                if v is not None:
                    v.release()
            elif how == "next_pairs":
                item = reader.next_pairs()
            elif how == "read_many":
                out: list[bytes] = []
                n = reader.read_many(fn, 3, out)
                item = (n, out) if out else None
            else:  # read_many with on_error: what it returns is a record, what it raises wins
                out = []
                n = reader.read_many(fn, 3, out, _on_error)
                item = (n, out) if out else None
        except (RingCorrupted, DecodeError) as exc:
            got.append(("!", type(exc).__name__, str(exc)))
            if isinstance(exc, RingCorrupted):
                return got
            continue
        if item is None:
            return got
        got.append(item)
        reader.commit()
    raise Finding(f"{how} did not stop")


def _ring_differential(data: bytes) -> str:
    """The C reader and the Python reader over copies of one ring: same frames, same
    errors (type and message), for next_frame, read_many (with and without on_error)
    and next_pairs."""
    if len(data) < 12:
        return "short"
    head = int.from_bytes(data[:8], "little") % (1 << 63) & ~7
    delta = int.from_bytes(data[8:12], "little") - 64
    tail = max(0, min(head + delta, 2**64 - 1))
    area = data[12 : 12 + CAP].ljust(CAP, b"\x00")

    def fn(v: memoryview) -> bytes:
        b = bytes(v)
        if b[:1] == b"\xee":
            raise DecodeError("refused")
        return b

    results = []
    for how in ("next_frame", "read_many", "read_many_on_error", "next_pairs"):
        pair = []
        for R in (lanes.PureRingReader, lanes.NativeRingReader):
            buf = _ring_with(head, tail, area)
            reader = R(buf)
            _publish(buf, tail)
            pair.append(_outcomes(reader, how, fn))
            reader.release()
        if pair[0] != pair[1]:
            raise Finding(f"{how}: the Python reader got {pair[0]!r}, the C one {pair[1]!r}")
        results.append(pair[0])
    corrupt = any(
        r and isinstance(r[-1], tuple) and r[-1][:2] == ("!", "RingCorrupted") for r in results
    )
    return "corrupt" if corrupt else "ok"


def ring_native(data: bytes) -> str:
    if lanes.NativeRingReader is None:
        return "not built"
    if not data:
        return "empty"
    mode = data[0] % 5
    body = data[1:]
    NW, NR = lanes.NativeRingWriter, lanes.NativeRingReader
    if mode == 0:
        return _ring_read(body, NR)
    if mode == 1:  # the C writer, and either reader
        return _ring_write(body, NW, NR if data[0] & 0x80 else lanes.PureRingReader)
    if mode == 2:  # the Python writer, the C reader
        return _ring_write(body, lanes.PureRingWriter, NR)
    if mode == 3:
        return _ring_attach(body, NW, NR)
    return _ring_differential(body)


# -------------------------------------------------------------------------- handshake

_HELLO = Hello(
    versions=[1],
    pid=123,
    segments=[SegmentSpec("/rw.123.0123456789ab", 2 * ring_size(4096), "rings")],
    c2s=RingSpec(0, 0, 4096),
    s2c=RingSpec(0, ring_size(4096), 4096),
)


def _hs_expect_failed(hs: Handshake, exc: HandshakeError) -> str:
    if hs.state != "failed" and not str(exc).startswith("not expecting"):
        raise Finding(f"handshake raised {exc!r} but stays in state {hs.state!r}")
    return "refused"


def handshake(data: bytes) -> str:
    if not data:
        return "empty"
    mode, body = data[0] % 3, data[1:]
    if mode == 0:
        try:
            msg = decode_message(body)
        except HandshakeError:
            return "refused"
        if isinstance(msg, Hello):
            try:
                choose_version(msg.versions)
                validate_hello(msg)
            except HandshakeError:
                return "invalid hello"
        return "ok"
    role = "server" if mode == 1 else "client"
    hs = Handshake(role)
    if role == "client":
        hs.send(_HELLO)
    step, stream = (max(1, body[0]), body[1:]) if body else (1, b"")
    pieces = [stream[k : k + step] for k in range(0, len(stream), step)] + [b""]  # then EOF
    try:
        for piece in pieces:
            hs.receive_data(piece)
            for _ in range(4):
                if hs.state == "done":
                    break
                msg = hs.next_message()
                if msg is None:
                    break
                if isinstance(msg, Hello):
                    try:
                        version = choose_version(msg.versions)
                        validate_hello(msg)
                    except HandshakeError as exc:
                        hs.send(Refused(str(exc)))  # what the listener does
                        return "invalid hello"
                    hs.send(Welcome(version=version, pid=1))
                elif isinstance(msg, Welcome):
                    hs.send(Ready())
            if hs.state == "done":
                return "done"
    except HandshakeError as exc:
        return _hs_expect_failed(hs, exc)
    return "incomplete"


# --------------------------------------------------------------------- release lane

LANE_CLASSES = (SlotClass(64, 4), SlotClass(4096, 4))
_LPSIZE = pool_size(LANE_CLASSES)
_LCONFIG = SlotConfig(classes=LANE_CLASSES, threshold=0)
_LBUF = bytearray(_LPSIZE + ring_size(RELEASE_CAPACITY))
_ZERO_LANE = bytes(RELEASE_CAPACITY)


def _fresh_send_pool() -> ShmSendPool:
    """Slots 0-5 SENT (slot 0 at generation 1), 6 LOANED, 7 FREE at generation 1."""
    buf = _LBUF
    layout = init_pool(buf, LANE_CLASSES, pool_id=POOL_ID)
    init_ring(buf, _LPSIZE, RELEASE_CAPACITY)
    buf[_LPSIZE + HEADER_SIZE :] = _ZERO_LANE  # same size: allowed while views exist
    pool = ShmSendPool(SimpleNamespace(buf=buf), layout, _LCONFIG, 1 << 16)  # type: ignore[arg-type]
    alloc = pool.alloc
    slots = [alloc.allocate(1) for _ in range(8)]
    assert slots == list(range(8))
    for s in range(6):
        alloc.mark_sent(s)
    alloc.cancel(7)
    alloc.release(0, 0)
    assert alloc.allocate(1) == 0
    alloc.mark_sent(0)
    return pool


def _pool_state(pool: ShmSendPool) -> list[tuple[int, int]]:
    return [(pool.alloc.generation(s), pool.alloc.status(s)) for s in range(8)]


def _check_pool(pool: ShmSendPool, before: list[tuple[int, int]]) -> None:
    alloc = pool.alloc
    buf = _LBUF
    for s in range(8):
        if slot_state(buf, s) != (alloc.generation(s), alloc.status(s)):
            raise Finding(f"slot {s}: the table and the bookkeeping disagree")
        gen0, st0 = before[s]
        gen, st = alloc.generation(s), alloc.status(s)
        if st0 != SENT and (gen, st) != (gen0, st0):
            raise Finding(f"slot {s} was not lent but changed from {(gen0, st0)} to {(gen, st)}")
        if st0 == SENT and (gen, st) not in ((gen0, SENT), (gen0 + 1, FREE)):
            raise Finding(f"slot {s} went from {(gen0, st0)} to {(gen, st)}")
    free = [s for lst in alloc._free.values() for s in lst]
    if sorted(free) != [s for s in range(8) if alloc.status(s) == FREE]:
        raise Finding(f"free lists {alloc._free} do not match the slot states")
    stats = pool.statistics()
    if stats["slots_in_use"] + sum(stats["slots_free"].values()) != 8:
        raise Finding(f"statistics do not add up: {stats}")
    # later sends still work: every free slot can be allocated, once
    got = []
    while (s := alloc.allocate(1)) is not None:
        got.append(s)
    if sorted(got) != sorted(free):
        raise Finding(f"allocated {got}, free were {free}")


def _model(frames: list[bytes], state: list[tuple[int, int]]) -> tuple[int, int, bool]:
    """What ShmSendPool.poll + reclaim must do with well-framed releases:
    (releases accepted, slots reclaimed, broken)."""
    state = list(state)
    accepted = 0
    broken = False
    i = 0
    for _ in range(2):  # poll; then, if it broke, the reclaim's own last poll
        while i < len(frames):
            payload = frames[i]
            i += 1
            if len(payload) % 16:
                broken = True
                break
            vals = struct.unpack(f"={len(payload) // 8}Q", payload)
            refused = False
            for slot, gen in zip(vals[::2], vals[1::2]):
                if slot < 8 and state[slot] == (gen, SENT):
                    state[slot] = (gen + 1, FREE)
                    accepted += 1
                else:
                    refused = True
                    break
            if refused:
                broken = True
                break
        if not broken:
            break
    reclaimed = sum(1 for _, st in state if st == SENT) if broken else 0
    return accepted, reclaimed, broken


def release_lane(data: bytes) -> str:
    if not data:
        return "empty"
    pool = _fresh_send_pool()
    before = _pool_state(pool)
    lane = _LPSIZE
    frames: list[bytes] | None = None
    if data[0] & 1:  # raw bytes in the lane's data area, and a tail
        tail = int.from_bytes(data[1:5].ljust(4, b"\x00"), "little")
        area = data[5 : 5 + 4096]
        _LBUF[lane + HEADER_SIZE : lane + HEADER_SIZE + len(area)] = area
        struct.pack_into("=Q", _LBUF, lane + 64, tail)
    else:  # well-framed: [u8 length][payload] ...
        writer = RingWriter(_LBUF, lane)
        frames = []
        i = 1
        while i < len(data):
            n = data[i]
            payload = data[i + 1 : i + 1 + n]
            i += 1 + n
            if not writer.try_write(payload):
                break
            frames.append(payload)
        writer.release()
    broken = False
    try:
        pool.poll()
    except (SlotRefused, RingCorrupted):
        broken = True
        pool.reclaim()  # what the channel does when it breaks the connection
    _check_pool(pool, before)
    if frames is not None:
        want = _model(frames, before)
        got = (pool.releases_received, pool.reclaimed, broken)
        if got != want:
            raise Finding(f"release lane: (accepted, reclaimed, broken) = {got}, model {want}")
    pool.reader.release()
    return "broken" if broken else "ok"


# ------------------------------------------------------------------------------ seeds


def _layout(meta: Any, raw: bytes) -> bytes:
    m = msgspec.msgpack.encode(meta)
    return len(m).to_bytes(4, "big") + m + raw


def _codec_values() -> list[Any]:
    ref = SlotRef(1, 7, 0, 0, 4096, 16, (2, 2), "<i4", "numpy")
    cref = CudaRef(1, 7, 0, 2, 1, 0, 8, (4,), "bfloat16", b"\x01" * 64)
    item = FuzzItem(
        modality="image",
        hash=2**64 - 1,
        offsets=[(0, 4), (5, 9)],
        feature=(1, torch.Size([2, 3]), torch.bfloat16, np.dtype("<u2")),
        array=np.arange(6, dtype="<f4").reshape(2, 3),
        tensor=torch.arange(4, dtype=torch.float16),
        grid=(1, 2, 2),
        meta={"k": np.int64(3), "d": torch.device("cpu"), "a": array.array("i", [1, 2])},
    )
    return [
        array.array("d", [1.5, -2.0]),
        array.array("B", b"xyz"),
        torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        torch.zeros(0, 3, dtype=torch.float8_e4m3fn),
        torch.tensor([1 + 2j], dtype=torch.complex64),
        np.arange(12, dtype=">i2").reshape(3, 4),
        np.array(["ab", "c"], dtype="<U2"),
        np.array([b"xy"], dtype="S2"),
        np.array(["2024-01-01"], dtype="M8[D]"),
        np.zeros((0, 5), dtype="<c16"),
        np.float16(1.5),
        np.str_("hé"),
        np.datetime64(5, "ns"),
        ref,
        cref,
        (1, (2, (3,)), []),
        torch.Size([4, 5]),
        torch.float8_e5m2,
        torch.device("cpu"),
        np.dtype(">f8"),
        np.dtype("M8[us]"),
        item,
        [item, item],
        {"nested": [{"t": (np.uint8(1), np.bool_(True))}], 1: None, "x": 2.5},
        Ext(42, b"future"),
    ]


def _deep(n: int) -> bytes:
    payload = msgspec.msgpack.encode([])
    for _ in range(n):
        payload = msgspec.msgpack.encode(Ext(6, payload))
    return payload


def _codec_seeds() -> list[bytes]:
    out = [_enc.encode(v) for v in _codec_values()]
    e = msgspec.msgpack.encode
    out += [
        e(Ext(2, _layout([[2], "float32", "cuda:0"], b"\x00" * 8))),  # a CUDA tensor
        e(Ext(2, _layout([[1], "uint8", "mps"], b"\x07"))),
        e(Ext(3, _layout([[0, 2**47], "<f8"], b""))),  # empty, absurd other dimension
        e(Ext(11, e(["<U1", b"\xff\xff\xff\xff"]))),  # not a code point
        e(Ext(1, _layout("q", b"\x00" * 16))),
        e([Ext(6, e([])), Ext(7, e([1, 2])), Ext(8, e("int8")), Ext(9, e("cuda:1"))]),
        _enc.encode([np.dtype(str), np.str_(""), np.bytes_(b""), np.dtype(">U")]),
        _deep(3000),
    ]
    return out


def _slot_refs() -> dict[str, Any]:
    def ref(
        slot: int, gen: int, off: int, n: int, shape: tuple[int, ...], dt: str, kind: str
    ) -> SlotRef:
        off += _rlayout.offsets[slot]
        return SlotRef(1, POOL_ID, slot, gen, off, n, shape, dt, kind)  # type: ignore[arg-type]

    return {
        "good": ref(0, 0, 0, 64, (4, 4), "<f4", "numpy"),
        "tensor": ref(1, 3, 16, 32, (16,), "bfloat16", "torch"),
        "big": ref(3, 0, 0, 4096, (1024,), "<i4", "numpy"),
        "other": ref(2, 0, 0, 8, (1,), "<f8", "numpy"),
        "stale": ref(1, 0, 0, 8, (2,), "<i4", "numpy"),
        "loaned": ref(4, 0, 0, 8, (2,), "<i4", "numpy"),
        "past": ref(0, 0, 250, 8, (2,), "<i4", "numpy"),
        "misaligned": ref(0, 0, 1, 8, (1,), "<f8", "numpy"),
        "foreign": SlotRef(1, POOL_ID + 1, 0, 0, _rlayout.offsets[0], 8, (1,), "<f8", "numpy"),
        "cuda": CudaRef(1, POOL_ID, 0, 0, 0, 0, 8, (4,), "bfloat16"),
    }


def _slot_seeds() -> list[bytes]:
    """Records whose arrays travel as references, made by an Encoder whose placer
    hands out the references above (the transport's own path)."""
    r = _slot_refs()
    arrays = {k: np.zeros(1, np.uint8) for k in r}
    arrays["tensor"] = torch.zeros(16, dtype=torch.bfloat16)  # type: ignore[assignment]
    by_id = {id(a): r[k] for k, a in arrays.items()}
    enc = Encoder(placer=lambda obj: by_id.get(id(obj)))
    a = arrays
    values: list[Any] = [
        a["good"],
        [a["good"], a["tensor"], a["big"]],
        FuzzItem(array=a["good"], tensor=a["tensor"], feature=[a["big"]], meta={"x": a["other"]}),
        [FuzzItem(array=a["big"]), FuzzItem(meta={"t": (a["other"],)})],
        [a["good"], a["good"]],  # referenced twice
        [a["good"], "junk", a["other"]],
        FuzzItem(array=a["good"], tensor=a["big"]),  # a tensor field holding a numpy array
        *([a[k], a["good"]] for k in ("stale", "loaned", "past", "misaligned", "foreign", "cuda")),
    ]
    out = [enc.encode(v) for v in values]
    raw = msgspec.msgpack.Encoder()
    out.append(raw.encode({"a": Ext(4, raw.encode(r["good"])), "b": Ext(3, b"\x00")}))
    return out


def _descriptor_seeds() -> list[bytes]:
    out = []
    for ref in _slot_refs().values():
        out.append((b"\x01" if isinstance(ref, SlotRef) else b"\x00") + msgspec.msgpack.encode(ref))
    out.append(b"\x00" + msgspec.msgpack.encode(_codec_values()[14]))
    return out


def _ring_seeds() -> list[bytes]:
    out = []
    for head in (0, CAP - 16, 5 * CAP - 8):
        buf = _ring_with(head, head, b"")
        w = RingWriter(buf)
        w.try_write(b"hello")
        w.try_write(b"\xeebad")
        w.write_many([b"x" * 40, b"", b"y" * 300])
        tail = struct.unpack_from("=Q", buf, 64)[0]
        area = bytes(buf[HEADER_SIZE:])
        out.append(
            b"\x00" + head.to_bytes(8, "little") + (tail - head + 64).to_bytes(4, "little") + area
        )
    out.append(b"\x01" + (3).to_bytes(4, "little") + bytes([10, 90, 0x90, 100, 50, 0x90, 2]))
    out.append(
        b"\x01"
        + (0).to_bytes(4, "little")
        + bytes([10, 0x90, 0xF5])
        + (1 << 40).to_bytes(8, "little")
    )
    hdr = _ring_with(0, 0, b"")[:HEADER_SIZE]
    out.append(b"\x02" + bytes(hdr))
    return out


def _ring_native_seeds() -> list[bytes]:
    out = []
    for s in _ring_seeds():
        mode = s[0]  # ring's modes: 0 read, 1 write, 2 attach
        out.append(bytes([{0: 0, 1: 1, 2: 3}[mode]]) + s[1:])
        if mode == 0:
            out.append(b"\x04" + s[1:])  # the differential over the same ring
        if mode == 1:
            out.append(b"\x02" + s[1:])
            out.append(b"\x81" + s[1:])
    return out


def _handshake_seeds() -> list[bytes]:
    hello = encode_message(_HELLO)
    welcome = encode_message(
        Welcome(version=1, pid=9, segments=[SegmentSpec("/rw.9.00000000000a", 8192, "slots")])
    )
    ready = encode_message(Ready())
    reject = encode_message(Refused("no thanks"))
    return [
        b"\x00" + hello[4:],
        b"\x00" + welcome[4:],
        b"\x00" + reject[4:],
        b"\x01\x07" + hello + ready + b"DSC",
        b"\x01\x40" + hello + reject,
        b"\x02\x05" + welcome + b"D",
        b"\x02\xff" + reject,
        b"\x01\x01" + (MAX_MESSAGE + 1).to_bytes(4, "big"),
    ]


def _release_seeds() -> list[bytes]:
    def frame(*pairs: tuple[int, int]) -> bytes:
        payload = b"".join(struct.pack("=QQ", s, g) for s, g in pairs)
        return bytes([len(payload)]) + payload

    out = [
        b"\x00" + frame((0, 1), (1, 0)) + frame((2, 0)),
        b"\x00" + frame((3, 0), (3, 0)) + frame((4, 0)),  # double release, then more
        b"\x00" + frame((6, 0)) + frame((5, 0)),  # a loaned slot
        b"\x00" + frame((7, 1)),  # a free slot
        b"\x00" + frame((0, 0)),  # stale generation
        b"\x00" + frame((2**64 - 1, 0)),  # out of range
        b"\x00" + bytes([8]) + b"\x00" * 8 + frame((1, 0)),  # a frame of 8 bytes
    ]
    raw = bytearray(64)
    struct.pack_into("=IQQ", raw, 0, 16, 1, 0)
    out.append(b"\x01" + (24).to_bytes(4, "little") + bytes(raw))
    struct.pack_into("=I", raw, 0, 0xFFFFFFFF)
    out.append(b"\x01" + (24).to_bytes(4, "little") + bytes(raw))
    return out


# ---------------------------------------------------------------------------- table


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes], str]
    seeds: Callable[[], list[bytes]]
    doc: str = ""
    outcomes: dict[str, int] = field(default_factory=dict, compare=False)


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("decode_untyped", decode_untyped, _codec_seeds, "Decoder(), Ext 1-11"),
        Target("decode_typed", decode_typed, _codec_seeds, "Decoder(Record)"),
        Target("decode_slots", decode_slots, _slot_seeds, "Decoder(resolver=ShmRecvPool.resolve)"),
        Target("descriptor", descriptor, _descriptor_seeds, "SlotRef / CudaRef payloads"),
        Target("ring", ring, _ring_seeds, "RingReader / RingWriter frame parsing"),
        Target("ring_native", ring_native, _ring_native_seeds, "the C ring lanes, and C vs Python"),
        Target("handshake", handshake, _handshake_seeds, "control-socket handshake"),
        Target("release_lane", release_lane, _release_seeds, "ShmSendPool.poll release frames"),
    )
}


def _load_net_targets() -> Any:
    """fuzz/net_targets.py (the TCP transport's parsers), loaded by path beside this file
    and given this module's Finding and last-resort check; ``None`` without pyzmq."""
    import importlib.util
    import pathlib
    import sys

    try:
        import zmq  # noqa: F401
    except ModuleNotFoundError:
        return None
    path = pathlib.Path(__file__).with_name("net_targets.py")
    spec = importlib.util.spec_from_file_location("ringwire_fuzz_net_targets", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mod.Finding = Finding
    mod.refused = _refused
    return mod


_net = _load_net_targets()
if _net is not None:
    for _name, _run, _seeds, _doc in _net.NET_TARGETS:
        TARGETS[_name] = Target(_name, _run, _seeds, _doc)

_ORDER = tuple(TARGETS)


def all_targets(data: bytes) -> str:
    """Every target in one: the first byte picks it (one process for a short run)."""
    if not data:
        return "empty"
    name = _ORDER[data[0] % len(_ORDER)]
    return f"{name}:{TARGETS[name].run(data[1:])}"


def _all_seeds() -> list[bytes]:
    return [bytes([i]) + s for i, name in enumerate(_ORDER) for s in TARGETS[name].seeds()]


TARGETS["all"] = Target("all", all_targets, _all_seeds, "every target; the first byte picks one")


def seeds(name: str) -> list[bytes]:
    return TARGETS[name].seeds()
