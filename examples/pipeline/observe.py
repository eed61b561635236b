"""Traces and metrics of the pipeline: one OpenTelemetry trace per HTTP request, and
Prometheus metrics of every process's ringwire endpoints.

Both are optional: tracing needs ``opentelemetry-api`` and ``opentelemetry-sdk``
(``pip install 'ringwire[observe]' opentelemetry-sdk``), metrics ``prometheus_client``
(the ``observe`` extra).  Without them the pipeline runs exactly as before: this module
imports neither until it is asked to, and says "off" instead.

Traces
------
The front decides once (:func:`trace_choice`, from the environment) and hands the
decision to every worker (the ``trace`` option), so all processes export alike:

* ``RINGWIRE_EXAMPLE_TRACE_FILE=PATH``: every process appends its finished spans to
  PATH, one JSON object a line (:class:`JsonLinesExporter`; for tests and scripts);
* ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set (or
  ``OTEL_TRACES_EXPORTER=otlp``): OTLP, configured by those standard variables, when
  ``opentelemetry-exporter-otlp`` is installed -- otherwise the console, saying why;
* else the console exporter (each finished span printed as JSON on stderr: stdout
  stays for the lines the script prints);
* ``OTEL_TRACES_EXPORTER=none`` or ``OTEL_SDK_DISABLED=true``: off.

Each process is its own ``service.name`` (``pipeline-front``, ``pipeline-tokenizer``,
``pipeline-scheduler``, ``pipeline-rank-R``).  One request's trace::

    POST /generate                          front      (this module's request_span)
      ringwire.call                         front      (ringwire: the call's span)
        ringwire.serve GenerateRequest      tokenizer  (ringwire: continued from the call)
          ringwire.call                     tokenizer
            ringwire.serve TokenizedRequest scheduler
              pipeline.step                 scheduler  (the broadcast and the gather)
                pipeline.rank               rank R     (one per rank)

The calls carry the trace context themselves (ringwire puts it in the call's
envelope).  A broadcast step batches requests of different traces, so the step record
carries one context per request (``Step.trace``, W3C ``[traceparent, tracestate]``)
and each rank continues each request's trace in a ``pipeline.rank`` span.

Metrics
-------
The front's ``/metrics`` serves its own endpoints (:func:`metrics_registry`); with
``--worker-metrics-port`` each worker serves its own at ``http://HOST:PORT/metrics``
(:func:`worker`; port 0: any free one) and writes that URL beside its sockets, where
the front finds it for ``/health`` (:func:`worker_metrics_urls`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

__all__ = [
    "TRACE_FILE_ENV",
    "JsonLinesExporter",
    "carrier",
    "current_context",
    "end_spans",
    "metrics_registry",
    "parent",
    "request_span",
    "ringwire_metrics",
    "setup_tracing",
    "start_spans",
    "trace_choice",
    "traceresponse",
    "tracing",
    "worker",
    "worker_metrics_urls",
]

TRACE_FILE_ENV = "RINGWIRE_EXAMPLE_TRACE_FILE"
OBSERVE_HINT = "pip install 'ringwire[observe]' opentelemetry-sdk"

_tracer: Any = None  # this process's tracer, once setup_tracing() made one


def tracing() -> bool:
    """Whether this process exports spans."""
    return _tracer is not None


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _otlp_exporter_module() -> str | None:
    for module in (
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    ):
        if _installed(module):  # False too when a parent package is absent
            return module
    return None


def trace_choice(environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any] | None, str]:
    """How the pipeline's processes export spans, from ``environ`` (default
    ``os.environ``): ``(config, what)`` -- ``config`` the workers' ``trace`` option
    (``None``: off), ``what`` one line saying what was chosen and why."""
    env = os.environ if environ is None else environ
    wanted = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or wanted == "none":
        return None, "tracing off (OTEL_SDK_DISABLED / OTEL_TRACES_EXPORTER=none)"
    if not (_installed("opentelemetry") and _installed("opentelemetry.sdk")):
        return None, f"tracing off: the OpenTelemetry SDK is not installed ({OBSERVE_HINT})"
    path = env.get(TRACE_FILE_ENV)
    if path:
        return {"exporter": "file", "path": os.path.abspath(path)}, (
            f"traces: JSON lines appended to {os.path.abspath(path)}"
        )
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if endpoint or wanted == "otlp":
        module = _otlp_exporter_module()
        if module is not None:
            config = {"exporter": "otlp", "module": module}
            return config, f"traces: OTLP to {endpoint or 'the default endpoint'}"
        return {"exporter": "console"}, (
            "traces: console (OTLP asked for, but opentelemetry-exporter-otlp is not "
            "installed: pip install opentelemetry-exporter-otlp)"
        )
    return {"exporter": "console"}, "traces: console (set OTEL_EXPORTER_OTLP_ENDPOINT for OTLP)"


class JsonLinesExporter:
    """A span exporter appending one JSON object per finished span to ``path`` (several
    processes may share the file: each export is one ``write`` with ``O_APPEND``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = []
        for s in spans:
            ctx, par = s.context, s.parent
            lines.append(
                json.dumps(
                    {
                        "name": s.name,
                        "service": s.resource.attributes.get("service.name"),
                        "trace_id": f"{ctx.trace_id:032x}",
                        "span_id": f"{ctx.span_id:016x}",
                        "parent_id": None if par is None else f"{par.span_id:016x}",
                        "kind": s.kind.name,
                        "status": s.status.status_code.name,
                        "start": s.start_time,
                        "end": s.end_time,
                        "attributes": dict(s.attributes or {}),
                        "events": [e.name for e in s.events],
                    },
                    default=str,
                )
            )
        data = "".join(line + "\n" for line in lines).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def setup_tracing(config: Mapping[str, Any] | None, service: str) -> Callable[[], None]:
    """Export this process's spans as ``config`` (:func:`trace_choice`) says, as
    ``service``; returns what flushes and stops it at the end.  ``None``: nothing is
    imported, nothing exported."""
    global _tracer
    if config is None:
        return lambda: None
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    kind = config["exporter"]
    if kind == "file":
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(config["path"])))
    elif kind == "otlp":
        import importlib

        exporter = importlib.import_module(config["module"]).OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    else:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("pipeline")

    def stop() -> None:
        global _tracer
        _tracer = None
        provider.shutdown()  # flushes what is batched

    return stop


# -- spans ------------------------------------------------------------------------------


@contextlib.contextmanager
def request_span(method: str, path: str, headers: Mapping[str, str]) -> Iterator[Any]:
    """The front's span of one HTTP request (kind SERVER, current inside), continuing a
    ``traceparent`` header if the client sent one; ``None`` when tracing is off."""
    if _tracer is None:
        yield None
        return
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    upstream = propagate.extract(dict(headers))
    with _tracer.start_as_current_span(
        f"{method} {path}",
        context=upstream,
        kind=SpanKind.SERVER,
        attributes={"http.request.method": method, "url.path": path},
    ) as span:
        yield span


def traceresponse(span: Any) -> str:
    """The W3C ``traceresponse`` header naming ``span`` (how a client finds its trace)."""
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def current_context() -> Any:
    """The current OpenTelemetry context (to parent spans started later, elsewhere);
    ``None`` when tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry import context

    return context.get_current()


def carrier(span: Any) -> list[str]:
    """``span``'s W3C context as ``[traceparent, tracestate]`` (``[]``: no span)."""
    if span is None:
        return []
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    out: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(out, trace.set_span_in_context(span))
    return [out.get("traceparent", ""), out.get("tracestate", "")] if out else []


def parent(field: Sequence[str]) -> Any:
    """The context a ``[traceparent, tracestate]`` field continues (``None``: none, or
    tracing is off)."""
    if _tracer is None or not field:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    headers = {"traceparent": field[0]}
    if len(field) > 1 and field[1]:
        headers["tracestate"] = field[1]
    return TraceContextTextMapPropagator().extract(headers)


def start_spans(name: str, parents: Sequence[Any], attributes: Mapping[str, Any]) -> list[Any]:
    """One span ``name`` per parent context (``None`` parents get none): the spans of
    one batch, each in its own request's trace.  ``[]`` when tracing is off."""
    if _tracer is None:
        return []
    return [
        None if p is None else _tracer.start_span(name, context=p, attributes=dict(attributes))
        for p in parents
    ]


def end_spans(spans: Sequence[Any], exc: BaseException | None = None) -> None:
    """End ``spans``; ``exc``: the batch failed with it (recorded, status ERROR)."""
    if not spans:
        return
    from opentelemetry.trace import Status, StatusCode

    for span in spans:
        if span is None:
            continue
        if exc is not None:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        span.end()


# -- metrics ----------------------------------------------------------------------------


def metrics_registry() -> Any:
    """A new ``prometheus_client`` registry, or ``None`` when ``prometheus_client`` is
    not installed.  :func:`ringwire_metrics` puts this process's endpoints on it."""
    if not _installed("prometheus_client"):
        return None
    import prometheus_client

    return prometheus_client.CollectorRegistry()


@contextlib.contextmanager
def ringwire_metrics(registry: Any) -> Iterator[None]:
    """ringwire's collector (every live endpoint of this process, read at scrape time)
    on ``registry`` for the length of the block (nothing when ``registry`` is None)."""
    if registry is None:
        yield
        return
    import ringwire.metrics

    collector = ringwire.metrics.register(registry)
    try:
        yield
    finally:
        ringwire.metrics.unregister(collector, registry)


def _metrics_file(directory: str, name: str) -> str:
    return os.path.join(directory, f"{name}.metrics")


@contextlib.contextmanager
def worker(ctx: Any) -> Iterator[None]:
    """A worker's observability, for the length of the block: its spans exported as
    the ``trace`` option says, and with the ``metrics`` option (``{"host", "port"}``,
    the port per worker) its endpoints served at ``http://HOST:PORT/metrics`` (its URL
    written into the pipeline's directory for the front)."""
    metrics = ctx.options.get("metrics")
    registry = None if metrics is None else metrics_registry()
    with contextlib.ExitStack() as stack:
        stack.callback(setup_tracing(ctx.options.get("trace"), f"pipeline-{ctx.name}"))
        stack.enter_context(ringwire_metrics(registry))
        if registry is not None:
            import prometheus_client

            server, thread = prometheus_client.start_http_server(
                int(metrics["port"]), metrics["host"], registry
            )
            stack.callback(thread.join, 10)
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
            host, port = server.server_address[:2]
            path = _metrics_file(ctx.options["dir"], ctx.name)
            with open(path + ".tmp", "w") as f:
                f.write(f"http://{host}:{port}/metrics")
            os.replace(path + ".tmp", path)
        yield


def worker_metrics_urls(directory: str, names: Sequence[str]) -> dict[str, str]:
    """The workers' metrics URLs (those that serve them)."""
    urls = {}
    for name in names:
        try:
            with open(_metrics_file(directory, name)) as f:
                urls[name] = f.read()
        except FileNotFoundError:
            pass
    return urls
