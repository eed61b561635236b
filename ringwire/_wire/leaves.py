"""Typed leaves for the standard library's value types: Ext 12-19.

msgspec writes these types natively, but as something that decodes to another type
in an untyped position: a ``set`` becomes an array (a list), a naive ``datetime``, a
``date``, a ``time``, a ``timedelta``, a ``UUID`` and a ``Decimal`` become strings.
The codec's lift pass turns each one found in an untyped position into its Ext here,
so it arrives as the type it was.  Typed fields are left to msgspec (its typed decoder
restores all of them from its own forms), exactly as for tuples.

Every one of these types can be rebuilt from bytes without naming any user code, which
is the line the codec draws: user classes (enums, dataclasses, attrs classes, Structs,
NamedTuple classes) travel in msgspec's form and come back as their class only where
the position is typed.

A subclass of one of these types is written as its base type (``datetime.isoformat``
of a ``pandas.Timestamp``, say) and arrives as the base type.  Aware datetimes and
times arrive with a fixed-offset ``datetime.timezone`` equal to the sender's
``utcoffset()`` (the zone's name, and ``fold``, are not sent).

Decoding trusts nothing: each payload's msgpack type and size is checked, and any
parse failure is a :class:`~ringwire.DecodeError`.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from .._errors import DecodeError
from . import ext as X

__all__ = ["LEAF_ENCODERS", "leaf_encoder", "leaf_decoders"]

Ext = msgspec.msgpack.Ext
_str_encoder = msgspec.msgpack.Encoder()
_MAX_ISO = 64  # the longest isoformat() is 38 characters


def _timedelta(v: _dt.timedelta) -> Ext:
    return Ext(X.TIMEDELTA, _str_encoder.encode([v.days, v.seconds, v.microseconds]))


# type -> encoder, for exact types; subclasses are found by leaf_encoder()
LEAF_ENCODERS: dict[type, Callable[[Any], Ext]] = {
    _dt.datetime: lambda v: Ext(X.DATETIME, _str_encoder.encode(_dt.datetime.isoformat(v))),
    _dt.date: lambda v: Ext(X.DATE, _str_encoder.encode(_dt.date.isoformat(v))),
    _dt.time: lambda v: Ext(X.TIME, _str_encoder.encode(_dt.time.isoformat(v))),
    _dt.timedelta: _timedelta,
    uuid.UUID: lambda v: Ext(X.UUID, _str_encoder.encode(v.bytes)),
    decimal.Decimal: lambda v: Ext(X.DECIMAL, _str_encoder.encode(decimal.Decimal.__str__(v))),
}


def leaf_encoder(t: type) -> Callable[[Any], Ext] | None:
    """The encoder of ``t`` or of its nearest base in :data:`LEAF_ENCODERS`."""
    for base in t.__mro__:
        fn = LEAF_ENCODERS.get(base)
        if fn is not None:
            return fn
    return None


# --------------------------------------------------------------------------- decoding


def _iso(value: Any, parse: Callable[[str], Any], what: str) -> Any:
    if not isinstance(value, str) or len(value) > _MAX_ISO:
        raise DecodeError(f"{what}: payload must be a short ISO 8601 string")
    try:
        return parse(value)
    except ValueError as exc:
        raise DecodeError(f"{what}: {value!r} is not an ISO 8601 value ({exc})") from exc


def _timedelta_from(value: Any) -> _dt.timedelta:
    what = "Ext 17 (timedelta)"
    if not (isinstance(value, list) and len(value) == 3 and all(type(x) is int for x in value)):
        raise DecodeError(f"{what}: payload must be [days, seconds, microseconds]")
    try:
        return _dt.timedelta(days=value[0], seconds=value[1], microseconds=value[2])
    except OverflowError as exc:
        raise DecodeError(f"{what}: {value} is out of range ({exc})") from exc


def _uuid_from(value: Any) -> uuid.UUID:
    if not isinstance(value, bytes) or len(value) != 16:
        raise DecodeError("Ext 18 (UUID): payload must be 16 bytes")
    return uuid.UUID(bytes=value)


def _decimal_from(value: Any) -> decimal.Decimal:
    if not isinstance(value, str):
        raise DecodeError("Ext 19 (Decimal): payload must be a string")
    try:
        return decimal.Decimal(value)
    except decimal.InvalidOperation as exc:
        raise DecodeError(f"Ext 19 (Decimal): {value!r:.40} is not a number") from exc


def _items(kind: type, what: str) -> Callable[[Any], Any]:
    def build(value: Any) -> Any:
        if not isinstance(value, list):
            raise DecodeError(f"{what}: payload is not an array")
        try:
            return kind(value)
        except TypeError as exc:  # an unhashable item: only a forged message has one
            raise DecodeError(f"{what}: an item is not hashable ({exc})") from exc

    return build


_BUILDERS: dict[int, tuple[str, Callable[[Any], Any]]] = {
    X.SET: ("Ext 12 (set)", _items(set, "Ext 12 (set)")),
    X.FROZENSET: ("Ext 13 (frozenset)", _items(frozenset, "Ext 13 (frozenset)")),
    X.DATETIME: (
        "Ext 14 (datetime)",
        lambda v: _iso(v, _dt.datetime.fromisoformat, "Ext 14 (datetime)"),
    ),
    X.DATE: ("Ext 15 (date)", lambda v: _iso(v, _dt.date.fromisoformat, "Ext 15 (date)")),
    X.TIME: ("Ext 16 (time)", lambda v: _iso(v, _dt.time.fromisoformat, "Ext 16 (time)")),
    X.TIMEDELTA: ("Ext 17 (timedelta)", _timedelta_from),
    X.UUID: ("Ext 18 (UUID)", _uuid_from),
    X.DECIMAL: ("Ext 19 (Decimal)", _decimal_from),
}


def leaf_decoders(
    decode_any: Callable[[memoryview, str], Any],
) -> dict[int, Callable[[memoryview], Any]]:
    """Ext handlers for codes 12-19; ``decode_any(payload, what)`` decodes the msgpack
    inside an Ext (the decoder's own, so nested typed leaves are restored too)."""

    def handler(what: str, build: Callable[[Any], Any]) -> Callable[[memoryview], Any]:
        return lambda data: build(decode_any(data, what))

    return {code: handler(what, build) for code, (what, build) in _BUILDERS.items()}
