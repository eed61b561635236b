"""Metrics of every queue: export ringwire's numbers to Prometheus or OpenTelemetry.

Every live connection (:class:`~ringwire.Channel`, :class:`~ringwire.SyncChannel`),
subscriber, broadcast writer (and each of its readers) and listener of this process is
registered, weakly, when it is made; an exporter reads their counters when it is
scraped, so records pay nothing extra and a closed endpoint is gone from the next
scrape.  Two ways out, each an optional package, imported only when asked for::

    import prometheus_client, ringwire.metrics
    ringwire.metrics.register()                 # on prometheus_client.REGISTRY
    prometheus_client.start_http_server(9100)   # /metrics

    ringwire.metrics.otel()                     # observable instruments on the global
                                                # MeterProvider (opentelemetry-api)

``pip install 'ringwire[observe]'`` installs both (``prometheus_client`` and
``opentelemetry-api``; an OpenTelemetry *SDK* is the application's choice).  Without
them, ``import ringwire`` imports neither and nothing changes.

What is exported (Prometheus names; OpenTelemetry's are ``ringwire.<rest>`` without
``_total``, with units): records and payload bytes each way
(``ringwire_records_total``, ``ringwire_payload_bytes_total``, label ``direction`` =
``send`` / ``receive``), unread bytes, ring capacity and fill per lane
(``ringwire_unread_bytes``, ``ringwire_unread_records``, ``ringwire_ring_capacity_bytes``,
``ringwire_ring_fill_ratio``), parks and doorbells each way, tensor slots in use / free
per class (``slot_size``) / loaned / released / reclaimed, inline fallbacks, slot
waits, received arrays held and releases pending, errors by kind
(``ringwire_errors_total{error=...}``), a listener's connections, a broadcast's
readers, joins, leaves and stalls and, per reader (``rank``), its unread bytes and
slots held, and two histograms: ``ringwire_call_seconds{role, part}`` (a call's round
trip and its parts: queued, wire, handled) and ``ringwire_hop_latency_seconds`` (a
record's publish -> receive), fed by the call layer and by receivers of records that
carry their publish time (:func:`ringwire._conn.observed.call_timed` /
``hop_timed``), recorded only while an exporter is registered.  A client's or a
server's channel is reported with ``kind="client"`` / ``"server"`` once the call layer
marks it (``ringwire._conn.observed.mark(channel, "client")``).
:data:`FAMILIES` lists them all with their help text.

Labels stay bounded: ``endpoint`` (the path or name the endpoint was made with),
``kind`` (channel, subscriber, broadcast, listener, client, server), ``peer_pid`` (the
process at the other end: one series per live connection), ``direction``,
``slot_size``, ``rank``, ``host`` (a remote reader's), ``error``, ``role``, ``part``.
Never a label per record or per request.  Live endpoints with equal labels are summed.

Reading happens on the exporter's thread (prometheus_client's HTTP server, the SDK's
reader) without touching the endpoints (no safe point, no drain): each number is one
the endpoint really had, not a consistent cut across them.  The unread depth is in
bytes (the rings' headers count bytes) and, for a channel's rings, in records too:
those are counted by walking the unread frames at scrape time (exact up to 1024 per
lane; past them, the rest is estimated at the walked frames' mean size).  A broadcast reports its
readers' depth in bytes only.  A lane's fill ratio is its unread bytes over its
capacity.  ``ringwire_hop_latency_seconds`` needs senders that stamp their records
(``ringwire.trace_records(end, hop_times=True)``) and receivers that opted in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from ._conn import observed
from ._conn.observed import CALL_PARTS, FAMILIES, LATENCY_BUCKETS, Family, Sample

__all__ = [
    "CALL_PARTS",
    "FAMILIES",
    "LATENCY_BUCKETS",
    "Family",
    "OtelMetrics",
    "PrometheusCollector",
    "Sample",
    "otel",
    "register",
    "samples",
    "unregister",
]

_on_lock = threading.Lock()
_exporters = 0  # registered collectors + open OtelMetrics: call timings record while > 0


def _exporter_on() -> None:
    global _exporters
    with _on_lock:
        _exporters += 1
        observed.recording = True


def _exporter_off() -> None:
    global _exporters
    with _on_lock:
        _exporters -= 1
        if _exporters <= 0:
            _exporters = 0
            observed.recording = False
            observed.reset_timings()


def samples() -> list[Sample]:
    """Every number now, as :class:`Sample` (family name, label values in the
    family's order, value; a histogram's value is ``(cumulative bucket counts, sum)``,
    the last bucket +Inf).  What both exporters read; needs neither package."""
    return observed.samples()


def _need(module: str, extra_pkg: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"ringwire.metrics needs {extra_pkg} for this ({module} could not be "
            f"imported): pip install 'ringwire[observe]' (or pip install {extra_pkg})",
            name=exc.name,
        ) from exc


# -- Prometheus -----------------------------------------------------------------------


class PrometheusCollector:
    """A ``prometheus_client`` collector of every live ringwire endpoint, read at scrape
    time.  Register it with ``registry.register(PrometheusCollector())`` or use
    :func:`register`.  Making one imports nothing; :meth:`collect` imports
    ``prometheus_client`` (``ModuleNotFoundError`` naming the extra if it is absent).
    While one is registered through :func:`register`, call timings are recorded."""

    def describe(self) -> Iterator[Any]:
        """The families, empty (so a registry learns the names without a scrape)."""
        return self._families({})

    def collect(self) -> Iterator[Any]:
        """The families with every live endpoint's numbers."""
        by_family: dict[str, list[Sample]] = {}
        for s in observed.samples():
            by_family.setdefault(s.family, []).append(s)
        return self._families(by_family)

    def _families(self, by_family: dict[str, list[Sample]]) -> Iterator[Any]:
        core = _need("prometheus_client.core", "prometheus_client")
        for name, fam in FAMILIES.items():
            labels = list(fam.labels)
            if fam.type == "counter":
                m = core.CounterMetricFamily(name, fam.help, labels=labels)
                for s in by_family.get(name, ()):
                    m.add_metric(list(s.labels), s.value)
            elif fam.type == "gauge":
                m = core.GaugeMetricFamily(name, fam.help, labels=labels)
                for s in by_family.get(name, ()):
                    m.add_metric(list(s.labels), s.value)
            else:
                m = core.HistogramMetricFamily(name, fam.help, labels=labels)
                for s in by_family.get(name, ()):
                    counts, total = s.value
                    bounds = [*map(_bound, LATENCY_BUCKETS), "+Inf"]
                    m.add_metric(list(s.labels), list(zip(bounds, counts)), total)
            yield m


def _bound(b: float) -> str:
    return repr(float(b))


def register(registry: Any = None) -> PrometheusCollector:
    """Register a :class:`PrometheusCollector` on ``registry`` (default:
    ``prometheus_client.REGISTRY``) and return it (for :func:`unregister`).

    Raises ``ModuleNotFoundError`` if ``prometheus_client`` is not installed, and
    ``ValueError`` (prometheus_client's) if ``registry`` already has ringwire's
    metric names (a second register on one registry)."""
    if registry is None:
        registry = _need("prometheus_client", "prometheus_client").REGISTRY
    else:
        _need("prometheus_client.core", "prometheus_client")
    collector = PrometheusCollector()
    registry.register(collector)
    _exporter_on()
    return collector


def unregister(collector: PrometheusCollector, registry: Any = None) -> None:
    """Take ``collector`` (from :func:`register`) off ``registry`` (default:
    ``prometheus_client.REGISTRY``).  Raises ``KeyError`` if it is not registered
    there."""
    if registry is None:
        registry = _need("prometheus_client", "prometheus_client").REGISTRY
    registry.unregister(collector)
    _exporter_off()


# -- OpenTelemetry ---------------------------------------------------------------------


def _otel_name(name: str) -> str:
    rest = name.removeprefix("ringwire_").removesuffix("_total")
    return f"ringwire.{rest}"


class OtelMetrics:
    """ringwire's OpenTelemetry instruments on one meter (made by :func:`otel`):
    observable counters and gauges read at each collection, and the timing
    histograms (calls, hops).  :meth:`close` stops them reporting (the API cannot remove an
    instrument); it is idempotent."""

    _TTL = 0.2  # one snapshot serves every instrument's callback of one collection

    def __init__(self, meter: Any) -> None:
        self._closed = False
        self._lock = threading.Lock()
        self._cached: tuple[float, dict[str, list[Sample]]] = (-1e9, {})
        self.instruments: dict[str, Any] = {}
        otel_metrics = _need("opentelemetry.metrics", "opentelemetry-api")
        for name, fam in FAMILIES.items():
            oname = _otel_name(name)
            if fam.type == "histogram":
                continue
            make = (
                meter.create_observable_counter
                if fam.type == "counter"
                else meter.create_observable_gauge
            )
            self.instruments[name] = make(
                oname,
                callbacks=[self._callback(name, fam, otel_metrics.Observation)],
                unit=fam.unit,
                description=fam.help,
            )
        self._histograms: dict[str, Any] = {}
        for name in observed.TIMING_FAMILIES:
            self._histograms[name] = self.instruments[name] = meter.create_histogram(
                _otel_name(name), unit="s", description=FAMILIES[name].help
            )
        observed.on_timed.append(self._record)
        _exporter_on()

    def _snapshot(self) -> dict[str, list[Sample]]:
        with self._lock:
            at, by_family = self._cached
            now = time.monotonic()
            if now - at > self._TTL:
                by_family = {}
                for s in observed.samples():
                    by_family.setdefault(s.family, []).append(s)
                self._cached = (now, by_family)
            return by_family

    def _callback(self, name: str, fam: Family, observation: Any) -> Any:
        def observe(options: Any = None) -> Iterable[Any]:
            if self._closed:
                return []
            return [
                observation(s.value, dict(zip(fam.labels, s.labels)))
                for s in self._snapshot().get(name, ())
            ]

        return observe

    def _record(self, family: str, labels: tuple[str, ...], seconds: float) -> None:
        names = FAMILIES[family].labels
        self._histograms[family].record(seconds, dict(zip(names, labels)))

    def close(self) -> None:
        """Stop reporting: the callbacks observe nothing, the call histogram records
        nothing more."""
        if self._closed:
            return
        self._closed = True
        try:
            observed.on_timed.remove(self._record)
        except ValueError:  # pragma: no cover
            pass
        _exporter_off()


def otel(meter_provider: Any = None) -> OtelMetrics:
    """Create ringwire's OpenTelemetry instruments on a meter named ``"ringwire"`` of
    ``meter_provider`` (default: the global one, ``opentelemetry.metrics``); return
    them (:meth:`OtelMetrics.close` stops them).  Uses only ``opentelemetry-api``.
    Raises ``ModuleNotFoundError`` if it is not installed."""
    api = _need("opentelemetry.metrics", "opentelemetry-api")
    provider = meter_provider if meter_provider is not None else api.get_meter_provider()
    return OtelMetrics(provider.get_meter("ringwire"))
