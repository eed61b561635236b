"""The live endpoints of this process and their numbers, for :mod:`ringwire.metrics`.

Every connection driver (:class:`~ringwire.Channel`, :class:`~ringwire.SyncChannel`),
subscriber, broadcast writer and listener calls :func:`track` once, when it is made;
:func:`samples` reads them all, at scrape time.  The exporters
(:mod:`ringwire.metrics`: a Prometheus collector, OpenTelemetry observable
instruments) turn the samples into their formats.  This module imports neither
package.

Invariants
----------
* **Records pay nothing.**  Tracking costs one weak reference and one dict store per
  endpoint *made*; nothing here runs per record.  Counters are the endpoints' own
  (``Endpoint.n_sent`` ...), read when asked.
* **Weak.**  The registry holds weak references only (to the owner and to its core):
  an endpoint collected unclosed leaves it by its weak reference's callback, which
  only deletes a dict key (callbacks run at any point, on any thread: they take no
  lock).  A closed one is dropped at the next :func:`samples`.
* **No side effects, any thread.**  A scrape runs on whatever thread the exporter
  uses (``prometheus_client``'s HTTP server thread, the OpenTelemetry SDK's reader
  thread) while the endpoint's own thread sends and receives.  So reading never runs
  a safe point, drains a doorbell or prunes a list (``statistics(settle=False)``):
  it reads plain integers (atomic under the GIL) and the rings' headers (8-byte
  loads).  A snapshot is therefore not a consistent cut across counters; each
  number is one the endpoint really had.  A read that meets a container being
  resized by the owner's thread (``RuntimeError``) or memory being released
  (``ValueError`` / ``BufferError``: the endpoint is closing) is retried once and
  then skips that endpoint for this scrape.
* **Bounded labels.**  Every label value names an endpoint (its path or name, its
  kind, its peer's pid), a direction, a slot class size, a broadcast rank, a call
  part or an error kind -- never a record or a request.  Two live endpoints with the
  same labels (two connections from one process to one path) are summed.
* **Timings** (:func:`call_timed`, :func:`hop_timed`) are the one thing recorded per
  event: a fixed-bucket histogram per label set, and only while an exporter is on
  (:data:`recording`); the caller checks that flag first, so with no exporter the
  cost is one attribute load.  Their callers: the call layer (a client's timing hook, :func:`client_hook`) and
  a receiving end that reads records stamped with their publish time
  (``ringwire.trace_records(end, hop_times=True)``, ringwire/_conn/record_tracing.py).
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from .._wire.ring_walk import unread_records
from .statistics import channel_statistics

__all__ = [
    "CALL_PARTS",
    "FAMILIES",
    "LATENCY_BUCKETS",
    "Family",
    "Sample",
    "TIMING_FAMILIES",
    "call_timed",
    "hop_timed",
    "kind_of",
    "mark",
    "on_timed",
    "recording",
    "reset_timings",
    "samples",
    "timings",
    "track",
    "tracked_count",
]

logger = logging.getLogger("ringwire")

KINDS = ("channel", "subscriber", "broadcast", "listener", "client", "server")
CHANNEL_KINDS = ("channel", "subscriber", "client", "server")  # read as a channel
CALL_PARTS = ("round_trip", "queued", "wire", "handled")
# seconds: 10 us .. 10 s (a hop on one host is tens of microseconds; a call may be long)
LATENCY_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class Family(NamedTuple):
    """One metric: its type ("counter", "gauge" or "histogram"), help, unit and labels."""

    type: str
    help: str
    unit: str  # OpenTelemetry's unit ("By", "s", "1", "{record}")
    labels: tuple[str, ...]


class Sample(NamedTuple):
    """One number of one family (a histogram's value is ``(bucket counts, sum)``)."""

    family: str
    labels: tuple[str, ...]  # the values, in the family's label order
    value: Any


_E = ("endpoint", "kind", "peer_pid")  # every endpoint's labels
_D = (*_E, "direction")  # "send" / "receive"

FAMILIES: dict[str, Family] = {
    "ringwire_open_endpoints": Family(
        "gauge", "Live ringwire endpoints (summed when their labels match).", "1", _E
    ),
    "ringwire_records_total": Family("counter", "Records sent / received.", "{record}", _D),
    "ringwire_payload_bytes_total": Family(
        "counter", "Record payload bytes sent / received.", "By", _D
    ),
    "ringwire_unread_bytes": Family(
        "gauge",
        "Bytes published in a ring and not consumed yet (send: by the peer; receive: "
        "by this end; a broadcast: by its slowest live reader).",
        "By",
        _D,
    ),
    "ringwire_unread_records": Family(
        "gauge",
        "Records published in a channel's ring and not consumed yet (send / receive, as "
        "for the bytes; counted by walking the ring's frames at scrape time: exact up "
        "to 1024, past them estimated at the walked frames' mean size).",
        "{record}",
        _D,
    ),
    "ringwire_ring_capacity_bytes": Family("gauge", "A ring's data area.", "By", _D),
    "ringwire_ring_fill_ratio": Family("gauge", "Unread bytes / ring capacity.", "1", _D),
    "ringwire_parks_total": Family(
        "counter",
        "Times this end parked waiting (send: for room; receive: for a record).",
        "{park}",
        _D,
    ),
    "ringwire_doorbells_total": Family(
        "counter",
        "Doorbells rung to the peer (send) / drained from it (receive).",
        "{doorbell}",
        _D,
    ),
    "ringwire_slot_waits_total": Family(
        "counter", "Sends that waited for a free tensor slot.", "{wait}", _E
    ),
    "ringwire_slots_in_use": Family(
        "gauge",
        "This end's tensor slots in use (sent and not released, or loaned).",
        "{slot}",
        _E,
    ),
    "ringwire_slots_in_use_bytes": Family(
        "gauge", "Capacity of this end's tensor slots in use.", "By", _E
    ),
    "ringwire_slots_free": Family(
        "gauge", "Free tensor slots per slot class.", "{slot}", (*_E, "slot_size")
    ),
    "ringwire_loans_out": Family("gauge", "Slots loaned and not sent yet.", "{slot}", _E),
    "ringwire_slot_releases_total": Family(
        "counter", "Slot releases received from the peer(s).", "{release}", _E
    ),
    "ringwire_inline_fallbacks_total": Family(
        "counter", "Arrays sent inline because no slot was free.", "{array}", _E
    ),
    "ringwire_slots_reclaimed_total": Family(
        "counter", "Slots taken back from a peer (or reader) that went.", "{slot}", _E
    ),
    "ringwire_large_arrays_in_use": Family(
        "gauge", "Arrays larger than every slot class, sent and not released.", "{array}", _E
    ),
    "ringwire_received_arrays_held": Family(
        "gauge", "Arrays received in the peer's slots and still alive here.", "{array}", _E
    ),
    "ringwire_releases_pending": Family(
        "gauge",
        "Releases of received arrays queued here, not pushed to the peer yet.",
        "{release}",
        _E,
    ),
    "ringwire_stalls_total": Family(
        "counter",
        "Broadcast sends that gave up on stalled readers (ReaderStalled).",
        "{stall}",
        _E,
    ),
    "ringwire_errors_total": Family(
        "counter",
        "Errors by kind: a broken connection; a listener's refused / broken handshakes; "
        "a broadcast's lost / dropped readers and refused joins.",
        "{error}",
        (*_E, "error"),
    ),
    "ringwire_connections": Family("gauge", "A listener's open connections.", "{connection}", _E),
    "ringwire_accepted_total": Family(
        "counter", "Connections a listener accepted.", "{connection}", _E
    ),
    "ringwire_ended_total": Family(
        "counter", "A listener's connections that ended.", "{connection}", _E
    ),
    "ringwire_broadcast_readers": Family(
        "gauge",
        "A broadcast's admitted readers (ready: attached everything).",
        "{reader}",
        (*_E, "state"),
    ),
    "ringwire_broadcast_joins_total": Family(
        "counter", "Readers admitted to a broadcast so far.", "{reader}", _E
    ),
    "ringwire_broadcast_leaves_total": Family(
        "counter", "Readers that closed their subscription.", "{reader}", _E
    ),
    "ringwire_reader_unread_bytes": Family(
        "gauge",
        "Bytes published to a broadcast that this reader has not consumed.",
        "By",
        ("endpoint", "rank", "host"),
    ),
    "ringwire_reader_slots_held": Family(
        "gauge",
        "Broadcast slots this reader has not released.",
        "{slot}",
        ("endpoint", "rank", "host"),
    ),
    "ringwire_call_seconds": Family(
        "histogram",
        "Calls' timings by part: round_trip (the client's), queued, wire, handled.",
        "s",
        ("endpoint", "role", "part"),
    ),
    "ringwire_hop_latency_seconds": Family(
        "histogram",
        "Records' hops, publish -> receive on one host (only for records that carry "
        "their publish time).",
        "s",
        ("endpoint", "kind"),
    ),
}


# -- the registry ---------------------------------------------------------------------


class _Tracked:
    __slots__ = ("core", "kind", "owner", "read")

    def __init__(
        self,
        owner: weakref.ref[Any],
        core: weakref.ref[Any] | None,
        kind: str,
        read: Callable[[Any], Any] | None,
    ) -> None:
        self.owner = owner
        self.core = core
        self.kind = kind
        self.read = read


_live: dict[int, _Tracked] = {}


def _forget(key: int, ref: weakref.ref[Any]) -> None:
    entry = _live.get(key)
    if entry is not None and entry.owner is ref:
        del _live[key]


def track(owner: Any, core: Any, kind: str, read: Callable[[Any], Any] | None = None) -> None:
    """``owner`` (a driver; ``core`` its endpoint core) is live and of ``kind`` (one of
    :data:`KINDS`).  Keyed by the core: a subscriber, a client or a server that wraps
    a channel re-tracks that channel's core under its own kind.  A listener has no
    core: it passes ``read``, ``read(owner)`` -> its :class:`ListenerStatistics`
    without side effects, or ``None`` once closed.  Raises ``ValueError`` for an
    unknown kind, or a listener without ``read``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if (kind == "listener") != (read is not None) or (core is None) != (kind == "listener"):
        raise ValueError("a listener is tracked with read= and no core, anything else "
                         "with its core and no read=")  # fmt: skip
    key = id(core if core is not None else owner)
    ref = weakref.ref(owner, functools.partial(_forget, key))
    _live[key] = _Tracked(ref, weakref.ref(core) if core is not None else None, kind, read)


def mark(owner: Any, kind: str) -> bool:
    """Report the tracked ``owner`` (a channel) as ``kind`` from now on: a
    :class:`~ringwire.Client` or a server marks its channel "client" / "server".
    Returns whether ``owner`` was tracked (``False``: closed, or never tracked).
    Raises ``ValueError`` for a kind that is not a channel's."""
    if kind not in CHANNEL_KINDS:
        raise ValueError(f"a channel's kind is one of {CHANNEL_KINDS}, not {kind!r}")
    for _, entry in _entries():
        if entry.owner() is owner and entry.read is None:
            entry.kind = kind
            return True
    return False


def kind_of(core: Any) -> str | None:
    """The kind ``core`` (an endpoint core) is tracked as now, or ``None``."""
    entry = _live.get(id(core))
    return entry.kind if entry is not None else None


def tracked_count() -> int:
    """How many endpoints are registered now (closed ones until the next scrape)."""
    return len(_live)


def _entries() -> list[tuple[int, _Tracked]]:
    for _ in range(8):  # a weakref callback may resize it under us (any thread)
        try:
            return list(_live.copy().items())
        except RuntimeError:  # pragma: no cover - a race of microseconds
            continue
    return []  # pragma: no cover


# -- reading --------------------------------------------------------------------------

_scrape_lock = threading.Lock()


def samples() -> list[Sample]:
    """Every live endpoint's numbers now, summed over matching labels, and the call
    timings.  Drops closed endpoints from the registry.  Thread-safe."""
    totals: dict[tuple[str, tuple[str, ...]], Any] = {}
    with _scrape_lock:
        for key, entry in _entries():
            owner = entry.owner()
            core = entry.core() if entry.core is not None else None
            if owner is None or (entry.core is not None and core is None):
                continue
            if core is not None and core.closed:
                _drop(key, entry)
                continue
            for attempt in (0, 1):
                try:
                    got = list(_read(entry, owner, core))
                    break
                except (RuntimeError, ValueError, BufferError) as exc:
                    if attempt:
                        logger.debug("ringwire metrics: %s skipped this scrape: %r", owner, exc)
                        got = []
            for s in got:
                k = (s.family, s.labels)
                totals[k] = totals.get(k, 0) + s.value
        out = [Sample(f, labels, v) for (f, labels), v in totals.items()]
        out += timings()
    return out


def _drop(key: int, entry: _Tracked) -> None:
    if _live.get(key) is entry:
        _live.pop(key, None)


def _read(entry: _Tracked, owner: Any, core: Any) -> Iterator[Sample]:
    if entry.read is not None:
        st = entry.read(owner)
        if st is None:  # closed
            _drop(id(owner), entry)
        else:
            yield from _read_listener(owner, st)
    elif entry.kind == "broadcast":
        yield from _read_broadcast(core)
    else:
        yield from _read_channel(entry.kind, core)


def _read_channel(kind: str, core: Any) -> Iterator[Sample]:
    st = channel_statistics(core, settle=False)
    e = (str(core.name), kind, str(core.peer_pid))
    S, R = (*e, "send"), (*e, "receive")
    yield Sample("ringwire_open_endpoints", e, 1)
    yield Sample("ringwire_records_total", S, st.records_sent)
    yield Sample("ringwire_records_total", R, st.records_received)
    yield Sample("ringwire_payload_bytes_total", S, st.bytes_sent)
    yield Sample("ringwire_payload_bytes_total", R, st.bytes_received)
    for lane, fill, cap, ring in (
        (S, st.send_fill, st.send_capacity, core.tx),
        (R, st.receive_fill, st.receive_capacity, core.rx),
    ):
        if cap:  # a subscriber sends nothing: its sending lane is empty
            yield Sample("ringwire_unread_bytes", lane, fill)
            yield from _unread_records(lane, ring)
            yield Sample("ringwire_ring_capacity_bytes", lane, cap)
            yield Sample("ringwire_ring_fill_ratio", lane, fill / cap)
    yield Sample("ringwire_parks_total", S, st.send_parks)
    yield Sample("ringwire_parks_total", R, st.receive_parks)
    yield Sample("ringwire_doorbells_total", S, st.doorbells_sent)
    yield Sample("ringwire_doorbells_total", R, st.doorbells_received)
    yield Sample("ringwire_slot_waits_total", e, core.slot_waits)
    yield from _slot_samples(e, st)
    yield Sample("ringwire_received_arrays_held", e, st.slot_arrays_held)
    yield Sample("ringwire_releases_pending", e, st.releases_pending)
    yield Sample("ringwire_errors_total", (*e, "broken"), int(core.broken is not None))


def _unread_records(labels: tuple[str, ...], ring: Any) -> Iterator[Sample]:
    if hasattr(ring, "data") and hasattr(ring, "header"):  # a shared-memory ring lane
        n = unread_records(ring, _WALK_FRAMES)
        if n is not None:
            yield Sample("ringwire_unread_records", labels, n)


_WALK_FRAMES = 1024  # frames one scrape walks per lane, at most (past them: estimated)


def _slot_samples(e: tuple[str, ...], st: Any) -> Iterator[Sample]:
    yield Sample("ringwire_slots_in_use", e, st.slots_in_use)
    yield Sample("ringwire_slots_in_use_bytes", e, st.slot_bytes_in_use)
    for size, free in sorted((st.slots_free or {}).items()):
        yield Sample("ringwire_slots_free", (*e, str(size)), free)
    yield Sample("ringwire_loans_out", e, st.loans_outstanding)
    yield Sample("ringwire_slot_releases_total", e, st.releases_received)
    yield Sample("ringwire_inline_fallbacks_total", e, st.inline_fallbacks)
    yield Sample("ringwire_slots_reclaimed_total", e, st.slots_reclaimed)
    yield Sample("ringwire_large_arrays_in_use", e, st.large_in_use)


def _read_broadcast(core: Any) -> Iterator[Sample]:
    st = core.statistics(settle=False)
    path = str(core.hub.path)
    e = (path, "broadcast", "")
    S = (*e, "send")
    yield Sample("ringwire_open_endpoints", e, 1)
    yield Sample("ringwire_records_total", S, st.records_sent)
    yield Sample("ringwire_payload_bytes_total", S, st.bytes_sent)
    yield Sample("ringwire_unread_bytes", S, st.fill)
    yield Sample("ringwire_ring_capacity_bytes", S, st.capacity)
    yield Sample("ringwire_ring_fill_ratio", S, st.fill / st.capacity if st.capacity else 0.0)
    yield Sample("ringwire_parks_total", S, st.send_parks)
    yield Sample("ringwire_doorbells_total", S, st.doorbells_sent)
    yield Sample("ringwire_doorbells_total", (*e, "receive"), st.doorbells_received)
    yield Sample("ringwire_slot_waits_total", e, st.slot_waits)
    yield from _slot_samples(e, st)
    yield Sample("ringwire_stalls_total", e, st.stalls)
    yield Sample("ringwire_errors_total", (*e, "reader_lost"), st.lost)
    yield Sample("ringwire_errors_total", (*e, "reader_dropped"), st.dropped)
    yield Sample("ringwire_errors_total", (*e, "refused"), st.refused)
    yield Sample("ringwire_errors_total", (*e, "broken"), int(core.broken is not None))
    yield Sample("ringwire_broadcast_readers", (*e, "ready"), st.ready_readers)
    yield Sample("ringwire_broadcast_readers", (*e, "joining"), st.readers - st.ready_readers)
    yield Sample("ringwire_broadcast_joins_total", e, st.joined)
    yield Sample("ringwire_broadcast_leaves_total", e, st.left)
    for info in core.readers(settle=False):
        r = (path, str(info.rank), info.host)
        yield Sample("ringwire_reader_unread_bytes", r, info.behind)
        yield Sample("ringwire_reader_slots_held", r, info.slots_held)


def _read_listener(owner: Any, st: Any) -> Iterator[Sample]:
    e = (str(owner.path), "listener", "")
    yield Sample("ringwire_open_endpoints", e, 1)
    yield Sample("ringwire_connections", e, st.open_connections)
    yield Sample("ringwire_accepted_total", e, st.accepted)
    yield Sample("ringwire_ended_total", e, st.ended)
    yield Sample("ringwire_errors_total", (*e, "refused"), st.refused)
    yield Sample("ringwire_errors_total", (*e, "broken"), st.broken)


# -- timings (the one thing recorded per event; only while an exporter is on) ---------

recording = False
"""Set by :mod:`ringwire.metrics` while an exporter is registered: the call layer (and
a receiver that knows a record's publish time) calls :func:`call_timed` /
:func:`hop_timed` only then: ``if observed.recording: observed.call_timed(...)``."""

on_timed: list[Callable[[str, tuple[str, ...], float], None]] = []
"""Further sinks of every timing: ``(family, label values, seconds)`` (the
OpenTelemetry exporter's histograms)."""

TIMING_FAMILIES = ("ringwire_call_seconds", "ringwire_hop_latency_seconds")
_timings: dict[tuple[str, tuple[str, ...]], list[Any]] = {}  # -> [bucket counts, sum]
_timings_lock = threading.Lock()


def call_timed(endpoint: str, role: str, part: str, seconds: float) -> None:
    """Record one call's ``part`` (one of :data:`CALL_PARTS`) on ``endpoint`` (its
    channel's name) for ``role`` ("client" or "server").  Call it only while
    :data:`recording` is true.  Raises ``ValueError`` for an unknown part or role
    (labels stay bounded)."""
    if part not in CALL_PARTS or role not in ("client", "server"):
        raise ValueError(
            f"part must be one of {CALL_PARTS} and role 'client' or 'server', not "
            f"{part!r} / {role!r}"
        )
    _timed("ringwire_call_seconds", (endpoint, role, part), seconds)


def client_hook(endpoint: str) -> Callable[[float, float, float], None]:
    """A call client's timing hook (``ClientCore.on_timing``'s shape) that records
    each answered call's parts on ``endpoint``: the call layer uses it while
    :data:`recording` is true."""

    def timed(queued: float, wire: float, handled: float) -> None:
        if recording:
            _timed(
                "ringwire_call_seconds", (endpoint, "client", "round_trip"), queued + wire + handled
            )
            _timed("ringwire_call_seconds", (endpoint, "client", "queued"), queued)
            _timed("ringwire_call_seconds", (endpoint, "client", "wire"), wire)
            _timed("ringwire_call_seconds", (endpoint, "client", "handled"), handled)

    return timed


def hop_timed(endpoint: str, kind: str, seconds: float) -> None:
    """Record one record's hop, publish -> receive on one host, received on
    ``endpoint`` (its name) of ``kind`` ("channel" or "subscriber").  Call it only
    while :data:`recording` is true.  Raises ``ValueError`` for another kind."""
    if kind not in ("channel", "subscriber"):
        raise ValueError(f"kind must be 'channel' or 'subscriber', not {kind!r}")
    _timed("ringwire_hop_latency_seconds", (endpoint, kind), seconds)


def _timed(family: str, labels: tuple[str, ...], seconds: float) -> None:
    i = bisect.bisect_left(LATENCY_BUCKETS, seconds)
    key = (family, labels)
    with _timings_lock:
        h = _timings.get(key)
        if h is None:
            h = _timings[key] = [[0] * (len(LATENCY_BUCKETS) + 1), 0.0]
        h[0][i] += 1
        h[1] += seconds
    for sink in on_timed:
        sink(family, labels, seconds)


def timings() -> list[Sample]:
    """The timing histograms: per family and labels, cumulative bucket counts (the
    last is +Inf) and the sum."""
    with _timings_lock:
        items = [(k, list(h[0]), h[1]) for k, h in _timings.items()]
    out = []
    for (family, labels), counts, total in items:
        cumulative, n = [], 0
        for c in counts:
            n += c
            cumulative.append(n)
        out.append(Sample(family, labels, (cumulative, total)))
    return out


def reset_timings() -> None:
    """Forget every timing (when the last exporter goes)."""
    with _timings_lock:
        _timings.clear()
