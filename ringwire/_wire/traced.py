"""Traced records: a record that carries its sender's W3C trace context (Ext 22).

Theory of operation
-------------------
A channel or broadcast end that traces its records (:func:`ringwire.trace_records`)
sends a record under a current span as one Ext 22 whose payload is a msgpack array of
three, or of four when the sender stamps its records' publish times (``hop_times``)::

    [traceparent (str), tracestate (str, "" for none), the record (its msgpack, as is)]
    [traceparent, tracestate, published (uint 64: CLOCK_MONOTONIC ns), the record]

A stamped record sent with no span current has an empty traceparent.  The publish time
means something only to a receiver on the sender's host (one kernel, one monotonic
clock): such a receiver records the hop's latency; any other ignores it.

The record is embedded, not wrapped in a ``bin``: its bytes are the ones the untraced
encoder made (slot references, typed leaves and all), so wrapping is one join of a
short header and the payload, and a reader that rewrites references in place (a
remote broadcast reader's frames, :func:`ringwire._net.fanout.to_frames`) finds them
by decoding the body as plain msgpack.  A record sent with no span current is the
untraced record, byte for byte.

Reading: :func:`split` recognises an Ext 22 at the top of a message (any of msgpack's
ext encodings) and returns the context, the publish time if stamped and the record's
bytes (a :class:`Traced`), which the caller then
decodes with its own (typed) decoder; an Ext 22 inside a record (or at the top, for an
untyped decoder that does not look) is unwrapped by the codec's ext hook, its context
dropped.  Everything is checked: the array header, two strings of bounded length,
valid UTF-8, a uint 64 in an array of four, and a record after them; a malformed one is a
:class:`~ringwire.DecodeError` naming what was wrong, and only that record fails.

The header is not parsed as W3C here: a traceparent that does not parse starts a new
trace where it is continued (:func:`ringwire._conn.tracing.parent_context`).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from .._errors import DecodeError
from . import ext as X

__all__ = [
    "MAX_TRACEPARENT",
    "MAX_TRACESTATE",
    "Traced",
    "body",
    "head",
    "split",
    "stamp",
    "wrap",
    "wrap_head",
]

MAX_TRACEPARENT = 256  # W3C: 55 characters for version 00; a later version may append
MAX_TRACESTATE = 8192  # W3C: at most 32 members (512 characters recommended)

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_TRACED = X.TRACED
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}


def _str(text: str) -> bytes:
    raw = text.encode()
    n = len(raw)
    if n < 32:
        return bytes((0xA0 | n,)) + raw
    if n < 256:
        return bytes((0xD9, n)) + raw
    return b"\xda" + _U16.pack(n) + raw


class Traced(NamedTuple):
    """What an Ext 22 carries: the context, the publish time (``None``: not stamped)
    and the record's bytes."""

    traceparent: str
    tracestate: str
    record: memoryview
    published_ns: int | None = None


def head(traceparent: str, tracestate: str) -> bytes:
    """The part of an Ext 22 payload before the record (the array header and the two
    strings): made once per span context by a sender.  Raises ``ValueError`` for a
    header longer than the limits (never from a valid span)."""
    if len(traceparent) > MAX_TRACEPARENT or len(tracestate) > MAX_TRACESTATE:
        raise ValueError("a traceparent or tracestate longer than the W3C allows")
    return b"\x93" + _str(traceparent) + _str(tracestate)


def stamp(prefix: bytes, published_ns: int) -> bytes:
    """The head ``prefix`` (from :func:`head`) of a stamped record: an array of four,
    the publish time after the strings."""
    return b"\x94" + prefix[1:] + b"\xcf" + _U64.pack(published_ns)


def wrap_head(prefix: bytes, payload: bytes) -> bytes:
    """``payload`` (a record's msgpack) as an Ext 22 whose payload starts with
    ``prefix`` (made by :func:`head`)."""
    n = len(prefix) + len(payload)
    if n < 256:
        ext = bytes((0xC7, n, _TRACED))
    elif n < 65536:
        ext = b"\xc8" + _U16.pack(n) + bytes((_TRACED,))
    else:
        ext = b"\xc9" + _U32.pack(n) + bytes((_TRACED,))
    return b"".join((ext, prefix, payload))


def wrap(
    payload: bytes, traceparent: str, tracestate: str, published_ns: int | None = None
) -> bytes:
    """``payload`` (a record's msgpack) as an Ext 22 carrying the context (and the
    publish time, if given).  Raises ``ValueError`` for a header longer than the
    limits (never from a valid span)."""
    if published_ns is None:
        return wrap_head(head(traceparent, tracestate), payload)
    return wrap_head(stamp(head(traceparent, tracestate), published_ns), payload)


# the longest prefix of a payload body() looks at: the array header, and both strings
# at their limits with str16 headers
_PREFIX = 1 + 3 + MAX_TRACEPARENT + 3 + MAX_TRACESTATE
_SHORT = 128  # enough for a version-00 traceparent and a short tracestate


def split(buf: Any) -> Traced | None:
    """The :class:`Traced` of a message that is one Ext 22, or ``None`` (any other message: not looked into).  Raises
    :class:`~ringwire.DecodeError` for a malformed Ext 22."""
    b0 = buf[0] if len(buf) > 2 else 0
    if b0 < 0xC7 or (0xC9 < b0 < 0xD4) or b0 > 0xD8:  # not an ext: the usual case
        return None
    view = memoryview(buf)
    n = len(view)
    if b0 == 0xC7:
        size, start = view[1], 3
    elif b0 == 0xC8:
        if n < 4:
            return None
        size, start = _U16.unpack_from(view, 1)[0], 4
    elif b0 == 0xC9:
        if n < 6:
            return None
        size, start = _U32.unpack_from(view, 1)[0], 6
    else:
        size, start = _FIXEXT[b0], 2
    if view[start - 1] != _TRACED:
        return None
    if start + size != n:
        raise DecodeError(
            f"Ext 22 (traced record): its length {size} does not match the "
            f"{n - start} bytes after its header"
        )
    return body(view[start:])


def _read_str(data: bytes, at: int, limit: int, what: str, total: int) -> tuple[str, int] | None:
    """The string at ``at`` of ``data`` (a prefix of a ``total``-byte payload) and the
    position after it; ``None`` when it runs past a prefix shorter than the payload."""
    n = len(data)
    if at + 3 > n and n < total:
        return None
    if at >= n:
        raise DecodeError(f"Ext 22 (traced record): the payload ends before its {what}")
    b = data[at]
    if 0xA0 <= b <= 0xBF:
        size, at = b & 0x1F, at + 1
    elif b == 0xD9 and at + 2 <= n:
        size, at = data[at + 1], at + 2
    elif b == 0xDA and at + 3 <= n:
        size, at = _U16.unpack_from(data, at + 1)[0], at + 3
    else:
        raise DecodeError(f"Ext 22 (traced record): its {what} is not a string")
    if size > limit:
        raise DecodeError(f"Ext 22 (traced record): a {size}-byte {what} (at most {limit})")
    if at + size > n:
        if n < total:
            return None
        raise DecodeError(f"Ext 22 (traced record): its {what} runs past the payload")
    try:
        return data[at : at + size].decode(), at + size
    except UnicodeDecodeError as exc:
        raise DecodeError(f"Ext 22 (traced record): its {what} is not UTF-8") from exc


def body(data: memoryview) -> Traced:
    """An Ext 22 payload's :class:`Traced`.  Raises :class:`~ringwire.DecodeError` for
    a malformed one."""
    total = len(data)
    if not total or data[0] not in (0x93, 0x94):
        raise DecodeError(
            "Ext 22 (traced record): the payload is not an array of "
            "[traceparent, tracestate, (published,) record]"
        )
    # the strings are read from a short copy (bytes index and slice fast); a long
    # tracestate needs a longer one
    prefix = bytes(data[:_SHORT])
    tp = _read_str(prefix, 1, MAX_TRACEPARENT, "traceparent", total)
    ts = None if tp is None else _read_str(prefix, tp[1], MAX_TRACESTATE, "tracestate", total)
    if tp is None or ts is None:  # (never short now: a whole payload, or all one may need)
        prefix = bytes(data[:_PREFIX])
        tp = _read_str(prefix, 1, MAX_TRACEPARENT, "traceparent", len(prefix))
        assert tp is not None
        ts = _read_str(prefix, tp[1], MAX_TRACESTATE, "tracestate", len(prefix))
        assert ts is not None
    traceparent, (tracestate, at) = tp[0], ts
    published = None
    if data[0] == 0x94:
        if at + 9 > total or data[at] != 0xCF:
            raise DecodeError("Ext 22 (traced record): its publish time is not a uint 64")
        published = _U64.unpack_from(data, at + 1)[0]
        at += 9
    if at >= total:
        raise DecodeError("Ext 22 (traced record): the payload holds no record")
    return Traced(traceparent, tracestate, data[at:], published)
