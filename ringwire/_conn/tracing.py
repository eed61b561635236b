"""Calls in OpenTelemetry traces: the glue between the call drivers and
``opentelemetry-api`` (an optional dependency, the ``observe`` extra; never the SDK).

Theory of operation
-------------------
**One trace across every hop.**  When a span is current as a caller calls
(:meth:`ringwire.Client.call`, :meth:`ringwire.SyncClient.call`), the call is a span of
its own, ``ringwire.call`` (kind CLIENT, a child of the current one), and its CALL
envelope carries that span's W3C trace context (``[traceparent, tracestate]``, the
envelope's ``trace`` position).  The server (:func:`ringwire.serve`,
:func:`ringwire.serve_sync`) continues it: the handler runs with a span
``ringwire.serve <type>`` (kind SERVER, ``<type>`` the request's class name) current,
so a call the handler makes is a child of it and carries the same trace id on to the
next hop.  The answer to a traced call carries the server's ``[queued, handled]``
seconds (the envelope's ``timing``), and the caller's span gets the hop's parts as
attributes::

    ringwire.call.queued_s    the call waited this long on the server for a handler
    ringwire.call.handled_s   its handler ran this long (start to the answer)
    ringwire.call.wire_s      the rest of the round trip: the rings (or the network)
                              both ways, and waking the caller

(and ``rpc.system`` = ``ringwire``, ``ringwire.call.id``, ``ringwire.peer.pid``).  A
failed call records its exception on the span (an ``exception`` event, status ERROR:
:class:`~ringwire.RemoteError`, :class:`~ringwire.DeadlineExceeded`, a timeout, a
broken connection); a cancelled one (the caller cancelled, or interrupted) ends with
``ringwire.call.cancelled`` = true and its status unset: giving up is the caller's
choice, not a failure of the hop.  The server's span does the same for the handler
(raised: ERROR; cancelled by its client: ``cancelled``; stopped at its deadline:
ERROR ``DeadlineExceeded``).

**What it costs, and what it imports.**  Nothing of OpenTelemetry is imported by
ringwire until it is used: a caller looks whether the application has imported
``opentelemetry.trace`` (``sys.modules``: a dict lookup, no call) and only then asks
whether a span is current; without one, that question is the whole cost and the call
is the untraced five-position envelope, byte for byte.  A server imports
``opentelemetry`` when a traced CALL arrives and the package is installed (looked up
once, :func:`installed`); when it is not, the call is served untraced (and still
answered with its ``timing``).  Without the SDK (the API's no-op provider) spans do not
record, but the context still flows: a middle process without an SDK passes its
caller's trace on unchanged.

**Timings without tracing (for metrics).**  A client whose core has an ``on_timing``
hook (:attr:`ringwire._conn.callcore.ClientCore.on_timing`: a callable taking
``(queued, wire, handled)`` seconds, set by whoever exports metrics) sends ``trace =
[]`` when no span is current -- no context, but asking for the timings -- and the hook
is called once per answered call whose server reported them (traced calls included).
The hook runs in the caller (its task, its thread), after the answer is in; it must not
block, and what it raises is logged and dropped (logger ``ringwire.calls``).

Records on channels and broadcasts carry the context too where an end opts in
(:func:`ringwire.trace_records`, :mod:`ringwire._conn.record_tracing`), with the same
headers as a CALL's ``trace``.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import time
from typing import Any, Callable, Optional

from .._wire.envelope import CALL, ERROR, TracedEnvelope, remote_error

__all__ = [
    "OTEL_TRACE",
    "CallTrace",
    "ServeSpan",
    "api",
    "call_trace",
    "installed",
    "parent_context",
    "serve_span",
    "traceparent_of",
]

logger = logging.getLogger("ringwire.calls")

# the module whose presence in sys.modules says the application uses OpenTelemetry
OTEL_TRACE = "opentelemetry.trace"

TimingHook = Callable[[float, float, float], None]

_installed: Optional[bool] = None
_otel: Any = None  # the _Otel of what was imported, once


def installed() -> bool:
    """Whether ``opentelemetry-api`` can be imported (looked up once; nothing imported)."""
    global _installed
    if _installed is None:
        try:
            _installed = importlib.util.find_spec("opentelemetry") is not None
        except (ImportError, ValueError):  # refused by a meta-path finder, a broken path
            _installed = False
    return _installed


class _Otel:
    """What the glue uses of ``opentelemetry-api``, imported on first use."""

    def __init__(self) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import (
            NonRecordingSpan,
            SpanContext,
            SpanKind,
            Status,
            StatusCode,
            TraceFlags,
            TraceState,
        )

        self.context = context
        self.trace = trace
        self.client, self.server = SpanKind.CLIENT, SpanKind.SERVER
        self.error = StatusCode.ERROR
        self.status = Status
        self.current_span = trace.get_current_span
        self.invalid_span = trace.INVALID_SPAN
        self.remote_span = NonRecordingSpan
        self.span_context = SpanContext
        self.flags = TraceFlags
        self.state = TraceState
        self.tracer = trace.get_tracer(
            "ringwire", getattr(sys.modules.get("ringwire"), "__version__", None)
        )  # a proxy until set


def _api() -> _Otel:
    global _otel
    if _otel is None:
        _otel = _Otel()
    return _otel


def api() -> _Otel:
    """What the glue uses of ``opentelemetry-api`` (imported on the first call)."""
    return _otel or _api()


def _traceparent(context: Any) -> list[str]:
    """A span's context as the CALL's ``trace``: ``[traceparent, tracestate]`` (the
    W3C headers, version 00; the tracestate only when there is one)."""
    field = [f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"]
    state = context.trace_state
    if state:
        field.append(state.to_header())
    return field


_HEX = frozenset("0123456789abcdef")


def _parent(otel: _Otel, field: list[str]) -> Any:
    """The context a CALL's ``trace`` continues, or ``None`` (start a new trace) for a
    traceparent that does not parse -- the W3C rules: ``version-traceid-parentid-flags``
    in lowercase hex, version ``ff`` invalid, version 00 exactly four fields, a later
    version may append fields, an all-zero trace or parent id invalid."""
    header = field[0]
    parts = header.split("-")
    if len(parts) < 4:
        return None
    version, trace_id, span_id, flags = parts[:4]
    if (
        not _HEX.issuperset(version + trace_id + span_id + flags)
        or len(version) != 2
        or version == "ff"
        or (version == "00" and len(parts) != 4)
        or len(trace_id) != 32
        or len(span_id) != 16
        or len(flags) != 2
        or trace_id == "0" * 32
        or span_id == "0" * 16
    ):
        return None
    state = None
    if len(field) > 1 and field[1]:
        state = otel.state.from_header([field[1]])
    context = otel.span_context(
        int(trace_id, 16),
        int(span_id, 16),
        is_remote=True,
        trace_flags=otel.flags(int(flags, 16)),
        trace_state=state,
    )
    return otel.trace.set_span_in_context(otel.remote_span(context))


traceparent_of = _traceparent  # (the names other modules use)
parent_context = _parent


def _end(otel: _Otel, span: Any, exc: BaseException | None, cancelled: bool) -> None:
    """End ``span``: ``exc`` recorded (status ERROR) unless the call was ``cancelled``
    (attribute ``ringwire.call.cancelled``, status unset)."""
    if cancelled:
        span.set_attribute("ringwire.call.cancelled", True)
    elif exc is not None:
        span.record_exception(exc)
        span.set_status(otel.status(otel.error, f"{type(exc).__name__}: {exc}"))
    span.end()


def _is_cancel(exc: BaseException) -> bool:
    """A cancellation (asyncio's, trio's: a ``BaseException``) or an interrupt
    (``KeyboardInterrupt``, ``SystemExit``), not a failure (an ``Exception``)."""
    return not isinstance(exc, Exception)


# -- the caller ----------------------------------------------------------------------------


class CallTrace:
    """One traced (or timed) call on the caller's side: its ``ringwire.call`` span (or
    ``None``: timings only), what its CALL carries, when it was sent.  A context
    manager around the call: leaving ends the span, with the exception if any."""

    __slots__ = ("cid", "field", "on_timing", "peer_pid", "sent", "span")

    def __init__(self, span: Any, field: list[str], on_timing: TimingHook | None, pid: int) -> None:
        self.span = span
        self.field = field
        self.on_timing = on_timing
        self.peer_pid = pid
        self.sent = 0.0
        self.cid = 0

    def envelope(self, cid: int, time_left: float | None, request: Any) -> TracedEnvelope:
        """The CALL to send (the clock of the round trip starts now)."""
        self.cid = cid
        self.sent = time.perf_counter()
        return TracedEnvelope(CALL, cid, time_left, request, None, self.field)

    def answered(self, env: Any) -> None:
        """The call's answer ``env`` (a REPLY or an ERROR; ``None``: it failed) is in:
        the hop's timings onto the span and to the hook."""
        if env is None:
            return
        rtt = time.perf_counter() - self.sent
        timing = env.timing
        if timing is None or len(timing) < 2:  # a server that predates timings
            if self.span is not None:
                self.span.set_attributes(
                    {"ringwire.call.id": self.cid, "ringwire.call.round_trip_s": rtt}
                )
            return
        queued, handled = timing[0], timing[1]
        wire = max(0.0, rtt - queued - handled)
        span = self.span
        if span is not None:
            span.set_attributes(
                {
                    "ringwire.call.id": self.cid,
                    "ringwire.call.round_trip_s": rtt,
                    "ringwire.call.queued_s": queued,
                    "ringwire.call.wire_s": wire,
                    "ringwire.call.handled_s": handled,
                }
            )
        hook = self.on_timing
        if hook is not None:
            try:
                hook(queued, wire, handled)
            except Exception:
                logger.exception("the call timing hook %r raised", hook)

    def __enter__(self) -> CallTrace:
        return self

    def __exit__(self, tp: Any, exc: BaseException | None, tb: Any) -> None:
        self.end(exc)

    def end(self, exc: BaseException | None) -> None:
        """The call is over: its span ends, ``exc`` (if any) recorded, or marked
        cancelled for a cancellation or an interrupt."""
        if self.span is not None:
            _end(_api(), self.span, exc, exc is not None and _is_cancel(exc))


def call_trace(
    otel_imported: bool, on_timing: TimingHook | None, peer_pid: int
) -> CallTrace | None:
    """The trace of a call about to be made: with a span current (``otel_imported``:
    the application imported OpenTelemetry), a new ``ringwire.call`` span and its
    context; else, with ``on_timing``, timings only; else ``None`` (untraced)."""
    if otel_imported:
        otel = _otel or _api()
        current = otel.current_span()
        if current is not otel.invalid_span and current.get_span_context().is_valid:
            span = otel.tracer.start_span(
                "ringwire.call",
                kind=otel.client,
                attributes={"rpc.system": "ringwire", "ringwire.peer.pid": peer_pid},
            )
            return CallTrace(span, _traceparent(span.get_span_context()), on_timing, peer_pid)
    if on_timing is not None:
        return CallTrace(None, [], on_timing, peer_pid)
    return None


# -- the server ----------------------------------------------------------------------------


class ServeSpan:
    """A traced call's handler on the server: its ``ringwire.serve <type>`` span, made
    current in the handler's task or thread from :meth:`enter` to :meth:`leave`."""

    __slots__ = ("otel", "span", "token")

    def __init__(self, otel: _Otel, span: Any) -> None:
        self.otel = otel
        self.span = span
        self.token: Any = None

    def enter(self) -> None:
        """Make the span current here (the handler's task or thread)."""
        otel = self.otel
        self.token = otel.context.attach(otel.trace.set_span_in_context(self.span))

    def leave(self) -> None:
        """The handler is done: the span is no longer current here."""
        token, self.token = self.token, None
        if token is not None:
            self.otel.context.detach(token)

    def end(self, exc: BaseException | None = None, *, cancelled: bool = False) -> None:
        """End the span: ``exc`` (the handler's, or the ``DeadlineExceeded`` that
        answered it) recorded, or marked ``cancelled``."""
        self.leave()
        _end(self.otel, self.span, exc, cancelled)

    def answer(self, env: Any, exc: BaseException | None = None) -> None:
        """End the span with what answers the call: ``exc``, what the handler raised,
        or else an ERROR's data is recorded; no answer (``None``): cancelled."""
        if exc is None and env is not None and env.kind == ERROR and env.error is not None:
            exc = remote_error(env.error)
        self.end(exc, cancelled=env is None)


def serve_span(field: list[str], request: Any, cid: int, queued: float) -> ServeSpan | None:
    """The span a traced call's handler runs in, continuing the context in ``field``
    (the CALL's ``trace``); ``None`` when there is none to continue (``[]``: timings
    only) or OpenTelemetry is not installed."""
    if not field or not installed():
        return None
    otel = _api()
    span = otel.tracer.start_span(
        f"ringwire.serve {type(request).__name__}",
        context=_parent(otel, field),
        kind=otel.server,
        attributes={
            "rpc.system": "ringwire",
            "ringwire.call.id": cid,
            "ringwire.call.queued_s": queued,
        },
    )
    return ServeSpan(otel, span)
