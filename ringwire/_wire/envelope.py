"""The call envelope: how calls, replies, errors and cancels travel in a channel's records,
and how an exception becomes error data and back (never a pickle).

Every record of a call connection (:class:`ringwire.Client` <-> :func:`ringwire.serve`)
is one :class:`Envelope`, an array-like msgpack record of five positions::

    [kind, id, time_left, payload, error]

    kind       1 CALL (client -> server), 2 REPLY, 3 ERROR (server -> client),
               4 CANCEL (client -> server)
    id         the call's correlation id: an int >= 1 chosen by the client, unique
               among its calls in flight (clients count up from 1)
    time_left  CALL only: seconds the caller will still wait, measured when it sent
               the call (nil: no deadline).  Relative, not a clock reading, so the two
               sides need no common clock (the gRPC choice); the server's deadline is
               its receive time plus ``time_left``
    payload    CALL: the request; REPLY: the reply.  Any value ringwire encodes,
               arrays and tensors included (by slot reference or inline, as the
               channel places them)
    error      ERROR only: ``[type name, message, details]``, details a map or nil
    trace      CALL only: the caller's W3C trace context, ``[traceparent]`` or
               ``[traceparent, tracestate]`` (the two headers' values), when a span was
               current as it called; ``[]``: no context, but the caller asks for the
               hop's timings.  Nil or absent: neither (the server adds nothing)
    timing     REPLY / ERROR only, when the CALL carried ``trace``: the server's
               ``[queued, handled]`` seconds -- how long the call waited for a handler
               (arrival to start) and how long it was handled (start to the answer);
               the caller's round trip less these is the time on the wire

Positions are append-only (a later version may add fields at the end; a decoder
ignores positions it does not know).  Decoding is typed: a ``kind`` outside 1..4, an
``id`` below 1, a non-finite or absurd ``time_left`` or a payload of the wrong type is
a :class:`~ringwire.DecodeError`, which the call layer treats as a broken connection.
An untraced call and its answer are the five-position forms, byte for byte as before
tracing existed; a peer that predates ``trace`` and ``timing`` ignores them (so it
neither continues the trace nor reports timings), and a traced caller of such a server
simply gets no ``timing`` back.  A ``trace`` whose traceparent does not parse is not an
error: the server starts a new trace (the W3C rule).

This module does no I/O.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

import msgspec

from .._errors import DeadlineExceeded, RemoteError

__all__ = [
    "CALL",
    "CANCEL",
    "DEADLINE_TYPE",
    "ERROR",
    "KIND_NAMES",
    "REPLY",
    "Envelope",
    "TracedEnvelope",
    "ErrorInfo",
    "envelope_type",
    "error_info",
    "remote_error",
]

CALL, REPLY, ERROR, CANCEL = 1, 2, 3, 4
KIND_NAMES = {CALL: "call", REPLY: "reply", ERROR: "error", CANCEL: "cancel"}
# the error type name of a call refused or cancelled at its deadline
DEADLINE_TYPE = "DeadlineExceeded"

_MAX_TIME_LEFT = 1e9  # ~31 years: more is a bug or a hostile peer
_MAX_MESSAGE = 16 << 10  # an error message longer than this is cut
Kind = Annotated[int, msgspec.Meta(ge=CALL, le=CANCEL)]
CallId = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
TimeLeft = Optional[Annotated[float, msgspec.Meta(ge=-_MAX_TIME_LEFT, le=_MAX_TIME_LEFT)]]
# bounded, but loosely: a later version may append (baggage, more timings)
Trace = Optional[
    Annotated[list[Annotated[str, msgspec.Meta(max_length=8192)]], msgspec.Meta(max_length=16)]
]
Timing = Optional[
    Annotated[
        list[Annotated[float, msgspec.Meta(ge=0.0, le=_MAX_TIME_LEFT)]], msgspec.Meta(max_length=16)
    ]
]


class ErrorInfo(msgspec.Struct, array_like=True, frozen=True):
    """What an ERROR envelope carries: the handler's exception, as plain data."""

    type: str
    message: str = ""
    details: Optional[dict[str, Any]] = None


class Envelope(msgspec.Struct, array_like=True):
    """One record of a call connection (see the module docstring).  Sent as it is
    (``payload`` untyped, so the codec keeps tuples and arrays in it); received as
    :func:`envelope_type` of the payload type the receiver expects."""

    kind: Kind
    id: CallId
    time_left: TimeLeft = None
    payload: Any = None
    error: Optional[ErrorInfo] = None


class TracedEnvelope(Envelope, array_like=True):
    """An :class:`Envelope` with the tracing positions: a traced CALL (``trace``) or the
    answer to one (``timing``).  Only ever sent: every envelope is received as
    :func:`envelope_type`, which has all seven positions (absent ones nil)."""

    trace: Optional[list[str]] = None
    timing: Optional[list[float]] = None


_TYPES: dict[Any, type] = {}


def envelope_type(payload_type: Any) -> type:
    """The envelope class that decodes its payload as ``payload_type`` (``Any``: as
    the codec decodes untyped values), with all seven positions (the ones a peer did
    not send are nil).  One class per type, made once.  Raises
    ``TypeError`` for a type msgspec cannot decode (for instance a union of two
    untagged record classes)."""
    try:
        return _TYPES[payload_type]
    except KeyError:
        pass
    except TypeError:  # an unhashable annotation
        return _make(payload_type)
    tp = _TYPES[payload_type] = _make(payload_type)
    return tp


def _make(payload_type: Any) -> type:
    name = getattr(payload_type, "__qualname__", None) or repr(payload_type)
    tp = msgspec.defstruct(
        f"Envelope[{name}]",
        [
            ("kind", Kind),
            ("id", CallId),
            ("time_left", TimeLeft, None),
            ("payload", Optional[payload_type], None),
            ("error", Optional[ErrorInfo], None),
            ("trace", Trace, None),
            ("timing", Timing, None),
        ],
        array_like=True,
        module=__name__,
    )
    msgspec.msgpack.Decoder(tp)  # refuse an undecodable payload type now, not per record
    return tp


# -- errors as data ------------------------------------------------------------------


def _type_name(tp: type) -> str:
    """``ValueError``; ``mypkg.errors.ModelError``; ``ringwire.SlotsExhausted`` (the
    module path up to its first private part)."""
    parts = []
    for p in tp.__module__.split("."):
        if p.startswith("_"):
            break
        parts.append(p)
    mod = ".".join(parts)
    return tp.__qualname__ if mod in ("", "builtins", "__main__") else f"{mod}.{tp.__qualname__}"


def error_info(exc: BaseException) -> ErrorInfo:
    """An exception as the data an ERROR envelope carries: type name, ``str()``, and
    its ``details`` attribute when that is a dict.  A :class:`RemoteError` passes
    through with its own type name and details."""
    if isinstance(exc, RemoteError):
        name, message, details = exc.type_name, exc.message, exc.details
    else:
        name = _type_name(type(exc))
        try:
            message = str(exc)
        except Exception:  # a broken __str__
            message = f"<{name}: str() failed>"
        details = getattr(exc, "details", None)
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + " [cut]"
    return ErrorInfo(str(name), str(message), details if isinstance(details, dict) else None)


def remote_error(info: ErrorInfo) -> RemoteError:
    """The exception a caller raises for an ERROR envelope."""
    cls = DeadlineExceeded if info.type == DEADLINE_TYPE else RemoteError
    return cls(info.type, info.message, info.details)
