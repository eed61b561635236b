"""Tests of ringwire._wire.envelope: the call envelope's wire bytes (the five-position
forms pinned as they were before tracing, the seven-position traced forms beside them),
what each side decodes of the other's, and hostile tracing positions."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from ringwire import DecodeError, Decoder, Encoder
from ringwire._wire.envelope import (
    CALL,
    CANCEL,
    ERROR,
    REPLY,
    Envelope,
    ErrorInfo,
    TracedEnvelope,
    envelope_type,
)

enc = Encoder()
TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

GOLDEN = [
    # the forms of every untraced call: unchanged by tracing, byte for byte
    (Envelope(CALL, 1, None, "x"), "950101c0a178c0"),
    (Envelope(CALL, 7, 2.5, [1, 2]), "950107cb4004000000000000920102c0"),
    (Envelope(REPLY, 1, None, "y"), "950201c0a179c0"),
    (
        Envelope(ERROR, 3, None, None, ErrorInfo("ValueError", "bad")),
        "950303c0c093aa56616c75654572726f72a3626164c0",
    ),
    (Envelope(CANCEL, 9), "950409c0c0c0"),
    # a traced CALL: [.., trace=[traceparent, tracestate], timing=nil]
    (
        TracedEnvelope(CALL, 1, None, "x", None, [TP, "k=v"]),
        "970101c0a178c092d937" + TP.encode().hex() + "a36b3d76c0",
    ),
    # timings asked, no context
    (TracedEnvelope(CALL, 1, None, "x", None, []), "970101c0a178c090c0"),
    # the answer to a traced call: timing=[queued, handled]
    (
        TracedEnvelope(REPLY, 1, None, "y", None, None, [0.25, 1.5]),
        "970201c0a179c0c092cb3fd0000000000000cb3ff8000000000000",
    ),
]


@pytest.mark.parametrize(("env", "hexbytes"), GOLDEN)
def test_golden_envelope_bytes(env: Envelope, hexbytes: str) -> None:
    wire = bytes.fromhex(hexbytes)
    assert enc.encode(env) == wire
    back = Decoder(envelope_type(Any)).decode(wire)
    assert (back.kind, back.id, back.time_left, back.payload, back.error) == (
        env.kind,
        env.id,
        env.time_left,
        env.payload,
        env.error,
    )
    assert back.trace == getattr(env, "trace", None)
    assert back.timing == getattr(env, "timing", None)


class OldEnvelope(msgspec.Struct, array_like=True):
    """The envelope as a peer that predates tracing decodes it."""

    kind: int
    id: int
    time_left: Any = None
    payload: Any = None
    error: Any = None


def test_a_peer_that_predates_tracing_ignores_the_new_positions() -> None:
    for env, hexbytes in GOLDEN[5:]:
        old = Decoder(OldEnvelope).decode(bytes.fromhex(hexbytes))
        assert (old.kind, old.id, old.payload) == (env.kind, env.id, env.payload)


def test_the_received_type_has_every_position_and_a_typed_payload() -> None:
    tp = envelope_type(int)
    assert envelope_type(int) is tp
    back = Decoder(tp).decode(enc.encode(TracedEnvelope(CALL, 2, None, 5, None, [TP])))
    assert (back.payload, back.trace, back.timing) == (5, [TP], None)
    # a later version's extra positions (and extra list items) are ignored
    later = enc.encode([CALL, 2, None, 5, None, [TP, "a=b", "baggage"], None, "more"])
    back = Decoder(tp).decode(later)
    assert back.trace == [TP, "a=b", "baggage"]


@pytest.mark.parametrize(
    "bad",
    [
        [CALL, 1, None, "x", None, "not a list"],
        [CALL, 1, None, "x", None, [1, 2]],
        [CALL, 1, None, "x", None, ["x" * 8193]],
        [CALL, 1, None, "x", None, ["t"] * 17],
        [REPLY, 1, None, "y", None, None, [-1.0, 0.0]],
        [REPLY, 1, None, "y", None, None, [float("nan"), 0.0]],
        [REPLY, 1, None, "y", None, None, "soon"],
    ],
)
def test_hostile_tracing_positions_are_decode_errors(bad: list[Any]) -> None:
    with pytest.raises(DecodeError):
        Decoder(envelope_type(Any)).decode(enc.encode(bad))
