"""Fuzzing of every parser a peer feeds: the codec (typed, untyped, with the slot
resolver, every Ext code), descriptors, ring frames, the handshake and the release lane.

The targets live in ``fuzz/targets.py`` (shared with the atheris harness
``fuzz/atheris_fuzz.py``); each one raises for anything but a documented refusal or
a broken invariant.  Here they run in this process:

* under hypothesis (random bytes and mutations of the seed corpus): a few hundred
  inputs per target in CI mode, 20,000 in the long mode (``pytest --long``);
* and every finding so far as a plain regression test at the end of this file.

Under atheris (coverage-guided, in a subprocess) they run in tests/process/test_fuzz.py.
"""

from __future__ import annotations

import base64
import os
import struct
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.fuzz import NAMES, targets

from ringwire import DecodeError, Decoder, Encoder
from ringwire._errors import HandshakeError, RingCorrupted
from ringwire._wire.control import Handshake, decode_message
from ringwire._wire.ring import HEADER_SIZE, RingReader, init_ring, ring_size

Ext = msgspec.msgpack.Ext
LONG = os.environ.get("RINGWIRE_LONG") == "1"


# ---------------------------------------------------------------------------- seeds


def _ext_codes(payload: bytes, depth: int = 0) -> set[int]:
    codes: set[int] = set()

    def hook(code: int, data: memoryview) -> None:
        codes.add(code)
        if code >= 4 and depth < 20:  # msgpack inside: look for nested Ext values
            try:
                codes.update(_ext_codes(bytes(data), depth + 1))
            except msgspec.DecodeError:
                pass

    msgspec.msgpack.Decoder(ext_hook=hook).decode(payload)
    return codes


def test_seed_corpora_are_valid_and_cover_every_ext_code() -> None:
    """The seeds are real messages (so mutations start deep), every target takes each
    of them without raising, and the codec seeds hold every Ext code 1-11."""
    for name in NAMES:
        outcomes: dict[str, int] = {}
        for seed in targets.seeds(name):
            out = targets.TARGETS[name].run(seed)
            outcomes[out] = outcomes.get(out, 0) + 1
        assert sum(outcomes.values()) >= 6, (name, outcomes)
        good = {"ok", "done", "corrupt"}
        assert any(k in good for k in outcomes), (name, outcomes)  # some seeds are valid
    codes: set[int] = set()
    for seed in targets.seeds("decode_untyped"):
        codes |= _ext_codes(seed)
    assert set(range(1, 12)) <= codes
    slot_codes: set[int] = set()
    for seed in targets.seeds("decode_slots"):
        slot_codes |= _ext_codes(seed)
    assert {4, 5} <= slot_codes


# ----------------------------------------------------------------------- hypothesis

_INTERESTING = [0, 1, 7, 8, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**31, 4096]


@st.composite
def _mutated(draw: Any, seeds: list[bytes]) -> bytes:
    buf = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        if not buf:
            buf = bytearray(draw(st.binary(min_size=1, max_size=16)))
            continue
        op = draw(st.integers(0, 5))
        pos = draw(st.integers(0, len(buf) - 1))
        if op == 0:
            del buf[pos:]
        elif op == 1:
            buf[pos] = draw(st.integers(0, 255))
        elif op == 2:
            order = draw(st.sampled_from(["big", "little"]))
            buf[pos : pos + 4] = draw(st.sampled_from(_INTERESTING)).to_bytes(4, order)
        elif op == 3:
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == 4:
            del buf[pos : pos + draw(st.integers(1, 16))]
        else:
            other = draw(st.sampled_from(seeds))
            buf[pos:] = other[draw(st.integers(0, len(other))) :]
    return bytes(buf)


def _fuzz_with_hypothesis(name: str, n: int) -> dict[str, int]:
    target = targets.TARGETS[name]
    outcomes: dict[str, int] = {}

    @settings(
        max_examples=n,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(st.one_of(st.binary(max_size=600), _mutated(target.seeds())))
    def check(data: bytes) -> None:
        out = target.run(data)
        outcomes[out] = outcomes.get(out, 0) + 1

    check()
    print(f"\nhypothesis {name}: {sum(outcomes.values())} inputs {outcomes}")
    return outcomes


@pytest.mark.parametrize("name", NAMES)
def test_hypothesis_fuzz(name: str) -> None:
    outcomes = _fuzz_with_hypothesis(name, 600)
    assert sum(outcomes.values()) >= 300


@pytest.mark.slow
@pytest.mark.timeout(0)
@pytest.mark.parametrize("name", NAMES)
def test_hypothesis_fuzz_long(name: str) -> None:
    outcomes = _fuzz_with_hypothesis(name, 20_000)
    assert sum(outcomes.values()) >= 10_000


# -------------------------------------------------------- regressions (fuzz findings)

enc, dec = Encoder(), Decoder()


def _layout(meta: Any, raw: bytes) -> bytes:
    m = msgspec.msgpack.encode(meta)
    return len(m).to_bytes(4, "big") + m + raw


def _ext(code: int, payload: bytes) -> bytes:
    return msgspec.msgpack.encode(Ext(code, payload))


def _no_last_resort(exc: pytest.ExceptionInfo[DecodeError]) -> None:
    assert targets.suspect_cause(exc.value) is None, exc.value


@pytest.mark.parametrize("zero_copy", [False, True])
def test_regression_text_past_the_last_code_point(zero_copy: bool) -> None:
    """Found by atheris: a numpy ``U`` scalar (Ext 11) holding 0xFFFFFFFF made numpy
    raise SystemError (wrapped by the last resort); an array (Ext 3) of them decoded,
    and failed on the first read of an item."""
    d = Decoder(zero_copy=zero_copy)
    scalar = _ext(11, msgspec.msgpack.encode(["<U1", b"\xff\xff\xff\xff"]))
    with pytest.raises(DecodeError, match="code point") as ei:
        d.decode(scalar)
    _no_last_resort(ei)
    arr = _ext(3, _layout([[2], ">U1"], b"\x00\x00\x00a\x00\x11\x00\x00"))
    with pytest.raises(DecodeError, match="code point"):
        d.decode(arr)
    ok = np.array(["a", "\U0010ffff", ""], dtype="<U1")
    assert (d.decode(enc.encode(ok)) == ok).all()
    assert d.decode(enc.encode(np.str_("\U0010ffff"))) == "\U0010ffff"


def test_regression_dtype_that_is_not_hashable() -> None:
    """Found by atheris: a dtype given as a msgpack array reached an lru_cache, which
    raised TypeError (unhashable list) instead of the allow-list's DecodeError."""
    cases = [
        _ext(3, _layout([[1], ["<i4"]], b"\x00" * 4)),
        _ext(10, msgspec.msgpack.encode(["<i4"])),
        _ext(11, msgspec.msgpack.encode([{"x": 1}, b"\x00"])),
    ]
    for wire in cases:
        with pytest.raises(DecodeError, match="numpy dtype must be a short string") as ei:
            dec.decode(wire)
        _no_last_resort(ei)


def test_regression_set_order_follows_the_hash_seed() -> None:
    """Found by atheris in CI: a frozenset (Ext 13) of ``"<f1"`` and ``b"\\x00>"``
    re-encoded with its items swapped under some string hash seeds (134, 137, ...),
    which broke the round-trip check.  Items now go in the order of their encoded
    bytes (a deterministic test of that is in test_codec.py)."""
    wire = base64.b64decode("AMcJDZKjPGYxxAIAPg==")[1:]  # the crash file, less the target byte
    assert targets.TARGETS["decode_untyped"].run(wire) == "ok"
    assert enc.encode(dec.decode(wire)) == wire


def test_regression_empty_numpy_strings_round_trip() -> None:
    """Found by the fuzzer's round-trip check: ``np.str_("")``, ``np.bytes_(b"")`` and
    the unsized ``np.dtype(str)`` / ``np.dtype(bytes)`` encoded to messages that the
    decoder refused (an item size of 0)."""
    for value in (np.str_(""), np.bytes_(b""), np.dtype(str), np.dtype(bytes), np.dtype(">U")):
        back = dec.decode(enc.encode(value))
        assert type(back) is type(value) and back == value
        assert enc.encode(back) == enc.encode(value)
    # items of size 0 are still refused: an absurd count of them would cost nothing to send
    with pytest.raises(DecodeError, match="item size 0"):
        dec.decode(_ext(3, _layout([[2**40], "<U0"], b"")))


def test_regression_frame_across_the_end_of_the_ring() -> None:
    """Found by atheris (the reference parser disagreed): a frame whose length ran past
    the end of the data area was returned truncated, and the reader carried on from a
    position no writer uses; the module documents it as RingCorrupted."""
    cap = 1024
    head = cap - 16

    def reader_facing_a_lie() -> RingReader:
        buf = bytearray(ring_size(cap))
        init_ring(buf, 0, cap)
        struct.pack_into("=Q", buf, 64, head)  # tail
        struct.pack_into("=Q", buf, 128, head)  # head
        reader = RingReader(buf)
        struct.pack_into("=I", buf, HEADER_SIZE + head, 100)  # 100 bytes, 16 before the end
        struct.pack_into("=Q", buf, 64, head + 112)  # published as if they fitted
        return reader

    with pytest.raises(RingCorrupted, match="across the end"):
        reader_facing_a_lie().next_frame()
    with pytest.raises(RingCorrupted, match="across the end"):
        reader_facing_a_lie().read_many(bytes, 8, [])


def test_regression_handshake_with_bad_utf8() -> None:
    """Found by atheris: a handshake message with invalid UTF-8 in a string raised
    UnicodeDecodeError out of decode_message (and so out of connect())."""
    body = msgspec.msgpack.encode({"type": "reject", "reason": "x"}).replace(b"\xa1x", b"\xa1\xff")
    with pytest.raises(HandshakeError, match="malformed"):
        decode_message(body)
    hs = Handshake("server")
    hs.receive_data(len(body).to_bytes(4, "big") + body)
    with pytest.raises(HandshakeError):
        hs.next_message()
    assert hs.state == "failed"
    assert targets.handshake(b"\x00" + body) == "refused"
