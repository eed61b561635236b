"""Records in OpenTelemetry traces: channels and broadcasts that carry the sender's
trace context, opted into per end.

Theory of operation
-------------------
**Opting in.**  :func:`trace_records` takes an open end (a :class:`~ringwire.Channel`
or :class:`~ringwire.SyncChannel` -- connected, a pair's, or one a listener accepted --,
a :class:`~ringwire.Listener` / :class:`~ringwire.SyncListener`, which applies it to
every connection it has accepted and will accept, a :class:`~ringwire.Broadcaster` /
:class:`~ringwire.SyncBroadcaster`, a :class:`~ringwire.Subscriber` /
:class:`~ringwire.SyncSubscriber`) and swaps two objects of its endpoint core: the
*encoder* for a :class:`TracingEncoder` around it, and the *decoders* for
:class:`TracingDecoder` s.  Nothing else changes: no send or receive method knows of
tracing, so an end that did not opt in runs exactly the code it ran before (no byte
added, no check, no Python frame).  Both ends opt in: the sender to send the context,
the receiver to read it (an untyped receiver that did not opt in still gets the
record, its context dropped by the codec's Ext 22 hook; a typed one cannot decode it).

**Sending.**  The tracing encoder encodes the record with the endpoint's own encoder
(so slot references, a TCP record's frames and receipts are what they were), then,
when the application has imported ``opentelemetry.trace`` and a valid span is
current, wraps the payload in an Ext 22 with that span's ``[traceparent,
tracestate]`` (:mod:`ringwire._wire.traced`).  No span is made per record: the
record continues the sender's current span.  With no span current the record is the
untraced one, byte for byte; the cost is a ``sys.modules`` lookup and one
``get_current_span()``.  The head of a span's records (the two strings) is made once
per span context and kept for the next record.  A batch on an end with a slot pool
is encoded record by record (the reusing fast path is for the plain encoder only).

**Costs** (the in-process encode + decode of a 56-byte record, a loaded 2-core AMD
EPYC): untraced 1.1 us; opted in, no span current 2.0 us; a span current (the SDK)
4.3 us, and 62 bytes more on the wire (a traceparent, an empty tracestate).

**Receiving.**  A tracing decoder looks at a message's first bytes: an Ext 22 is
split, the record decoded (with the decoder's type) and its context remembered for
the receiving task or thread (a :class:`contextvars.ContextVar`); any other message
is decoded as before and the remembered context cleared.  So, in the task (asyncio,
trio) or thread that received it, right after a receive::

    record = await channel.receive()
    with ringwire.continue_trace():          # the sender's span is the parent here
        with tracer.start_as_current_span("handle"):
            ...

:func:`received_trace` returns the W3C headers (``{"traceparent": ..., "tracestate":
...}``, ``None`` when the last record carried none), for a propagator or a log line.
A batch (``receive_many``) leaves the context of its *last* record: receive one at a
time where each record's trace matters.

Without ``opentelemetry-api`` installed, :func:`trace_records` still opts in (the
wire stays untraced: nothing is current), the decoders still unwrap what a traced
peer sends, :func:`received_trace` works, and :func:`continue_trace` is a no-op;
nothing of OpenTelemetry is imported by any of it until a span could be current.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Mapping

from .._wire.codec import Decoder, Encoder, Placer
from .._wire.traced import head, split, stamp, wrap_head
from . import observed
from .endpoint import Endpoint
from .tracing import OTEL_TRACE, api, installed, parent_context, traceparent_of

__all__ = [
    "TracingDecoder",
    "TracingEncoder",
    "continue_trace",
    "enable",
    "received_trace",
    "trace_records",
]

# (traceparent, tracestate) of the last record this task or thread received, if traced
_RECEIVED: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "ringwire_received_trace", default=None
)


# (span context, the Ext 22 head of its records): the last one a record was sent under
# (one tuple, replaced whole: threads may race to replace it, never to read half of it)
_last: tuple[Any, bytes] = (None, b"")


def _current_head() -> bytes | None:
    """The Ext 22 head (:func:`ringwire._wire.traced.head`) of the current span's
    context, or ``None`` (no span, or the application never imported OpenTelemetry)."""
    global _last
    if OTEL_TRACE not in sys.modules:
        return None
    otel = api()
    span = otel.current_span()
    if span is otel.invalid_span:
        return None
    context = span.get_span_context()
    last = _last
    if last[0] is context:  # (held here, so no other object can have its id)
        return last[1]
    if not context.is_valid:
        return None
    field = traceparent_of(context)
    prefix = head(field[0], field[1] if len(field) > 1 else "")
    _last = (context, prefix)
    return prefix


def _wrap(payload: bytes, prefix: bytes) -> bytes:
    out = wrap_head(prefix, payload)
    frames = getattr(payload, "frames", None)
    if frames is not None:  # a TCP record's buffers travel beside it (Framed)
        framed: Any = type(payload)(out)  # (the payload's own class: Framed)
        framed.frames = frames
        return framed
    return out


_UNTRACED = head("", "")  # a stamped record's head with no span current


class TracingEncoder:
    """An endpoint's encoder (``inner``) that wraps each record sent under a current
    span in an Ext 22 with the span's context -- and, if ``stamped``, every record,
    with its publish time.  Raises what ``inner`` raises."""

    __slots__ = ("inner", "stamped")

    def __init__(self, inner: Encoder, stamped: bool = False) -> None:
        self.inner = inner
        self.stamped = stamped

    def __getattr__(self, name: str) -> Any:  # profile, placer: the inner encoder's
        return getattr(self.inner, name)

    def _head(self) -> bytes | None:
        prefix = _current_head()
        if self.stamped:
            return stamp(_UNTRACED if prefix is None else prefix, time.monotonic_ns())
        return prefix

    def encode(self, obj: Any) -> bytes:
        payload = self.inner.encode(obj)
        prefix = self._head()
        return payload if prefix is None else _wrap(payload, prefix)

    def encode_with(self, obj: Any, placer: Placer) -> bytes:
        payload = self.inner.encode_with(obj, placer)
        prefix = self._head()
        return payload if prefix is None else _wrap(payload, prefix)

    def encode_many_with(
        self, items: Sequence[Any], start: int, placer: Any, out: list[bytes]
    ) -> int:
        """:meth:`Encoder.encode_many_with`, each record wrapped (those encoded before
        an exception too: a batch that stops for a slot sends them)."""
        first = len(out)
        try:
            return self.inner.encode_many_with(items, start, placer, out)
        finally:
            prefix = self._head()
            if prefix is not None:
                for i in range(first, len(out)):
                    out[i] = _wrap(out[i], prefix)

    def encode_into(self, obj: Any, buffer: bytearray, offset: int = 0) -> None:
        payload = self.encode(obj)
        if offset < 0:
            offset = len(buffer)
        buffer[offset:] = payload


class TracingDecoder(Decoder):
    """A :class:`~ringwire._wire.codec.Decoder` that reads a traced record's context
    into the receiving task or thread (:func:`received_trace`), and hands a stamped
    record's publish time to :attr:`hop` (set on a per-end subclass, :func:`enable`).
    :meth:`decode` raises :class:`~ringwire.DecodeError` for a malformed message, a
    malformed Ext 22 too."""

    hop: Callable[[int], None] | None = None

    def decode(self, buf: bytes | bytearray | memoryview) -> Any:
        _RECEIVED.set(None)  # (a record that fails to decode leaves none either)
        traced = split(buf)
        if traced is None:
            return Decoder.decode(self, buf)
        obj = Decoder.decode(self, traced.record)
        if traced.traceparent:
            _RECEIVED.set((traced.traceparent, traced.tracestate))
        if traced.published_ns is not None and self.hop is not None:
            self.hop(traced.published_ns)
        return obj


def _hop_sink(core: Endpoint) -> Callable[[int], None] | None:
    """What records a stamped record's hop received by ``core``: on this host only
    (a TCP peer's clock is another's), while a metrics exporter is on."""
    if not getattr(core.transport, "same_host", True):
        return None
    ref = weakref.ref(core)  # (the decoders are the core's: no cycle through them)

    def hop(published_ns: int) -> None:
        if observed.recording and (c := ref()) is not None:
            seconds = max(0, time.monotonic_ns() - published_ns) / 1e9
            kind = "subscriber" if observed.kind_of(c) == "subscriber" else "channel"
            observed.hop_timed(str(c.name), kind, seconds)

    return hop


def enable(core: Endpoint, on: bool = True, hop_times: bool = False) -> None:
    """Make ``core`` trace its records (``on``; ``hop_times``: stamp them all with
    their publish time too) or stop (its encoder and decoders swapped; see the module
    docstring)."""
    enc = core.enc
    inner = enc.inner if isinstance(enc, TracingEncoder) else enc
    core.enc = TracingEncoder(inner, hop_times) if on else inner  # type: ignore[assignment]
    if on == isinstance(core.dec, TracingDecoder):
        return
    cls: type[Decoder] = Decoder
    if on:  # the end's own subclass: decoders of other types (made as type(core.dec)) too
        sink = _hop_sink(core)
        cls = type("TracingDecoder", (TracingDecoder,), {"hop": sink and staticmethod(sink)})
    core.decoders.clear()  # (every type asked for: made again, of cls, when asked)
    core.dec = core.decoders[core.type] = cls(core.type, resolver=core.resolver)


def trace_records(end: Any, enabled: bool = True, *, hop_times: bool = False) -> Any:
    """Make ``end`` carry the W3C trace context on its records (``enabled=False``:
    stop), and return it.

    ``end`` is a :class:`~ringwire.Channel` / :class:`~ringwire.SyncChannel` (any:
    connected, either end of a pair, accepted), a :class:`~ringwire.Listener` /
    :class:`~ringwire.SyncListener` (every connection it has accepted and will
    accept), a :class:`~ringwire.Broadcaster` / :class:`~ringwire.SyncBroadcaster`
    (to local and remote readers alike), or a :class:`~ringwire.Subscriber` /
    :class:`~ringwire.SyncSubscriber`.  A record sent while an OpenTelemetry span is
    current carries that span's context (a record sent with none carries nothing);
    the receiving end, if it opted in too, makes it available to the task or thread
    that received the record: :func:`received_trace`, :func:`continue_trace`.  Both
    ends must be of a ringwire that knows Ext 22 (this one or later).

    ``hop_times=True`` stamps *every* record ``end`` sends with its publish time (9
    bytes more; a record with no span current is an Ext 22 with an empty traceparent):
    a receiving end on this host that opted in too records each record's hop, publish
    -> receive, in the ``ringwire_hop_latency_seconds`` histogram while a metrics
    exporter is registered in its process (:mod:`ringwire.metrics`).  A receiver
    across TCP ignores the stamp (another host's clock).

    Raises ``TypeError`` for anything else (it names what was given)."""
    conns = getattr(end, "_conns", None)
    if conns is not None and hasattr(end, "traces_records"):  # a listener
        end.traces_records = bool(enabled)
        end.stamps_records = bool(enabled and hop_times)
        for conn in list(conns):
            enable(conn.core, enabled, hop_times)
        return end
    core = getattr(end, "_core", None)
    if not isinstance(core, Endpoint):
        raise TypeError(
            "trace_records() takes a Channel, SyncChannel, Listener, SyncListener, "
            "Broadcaster, SyncBroadcaster, Subscriber or SyncSubscriber, not "
            f"{type(end).__name__}"
        )
    enable(core, enabled, hop_times)
    return end


def received_trace() -> dict[str, str] | None:
    """The W3C trace context of the last record this task or thread received from an
    end that traces its records: ``{"traceparent": ..., "tracestate": ...}`` (the
    latter only when the sender had one), or ``None`` (it carried none, or nothing was
    received here).  Raises nothing."""
    got = _RECEIVED.get()
    if got is None:
        return None
    out = {"traceparent": got[0]}
    if got[1]:
        out["tracestate"] = got[1]
    return out


@contextlib.contextmanager
def continue_trace(carrier: Mapping[str, str] | None = None) -> Iterator[None]:
    """Within the block, the sender's span of the last record received here (or of
    ``carrier``: W3C headers, as :func:`received_trace` returns them) is the current
    span's parent, so spans started there join the sender's trace.  A no-op when there
    is no context (the record carried none, a traceparent that does not parse) or
    ``opentelemetry-api`` is not installed.  Raises nothing of its own."""
    if carrier is None:
        carrier = received_trace()
    header = carrier.get("traceparent") if carrier else None
    if not header or not installed():
        yield
        return
    assert carrier is not None
    otel = api()
    context = parent_context(otel, [header, carrier.get("tracestate", "")])
    if context is None:
        yield
        return
    token = otel.context.attach(context)
    try:
        yield
    finally:
        otel.context.detach(token)
