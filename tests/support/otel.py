"""OpenTelemetry helpers of the tracing tests (the SDK: tests only, never the library)."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def memory_exporter() -> InMemorySpanExporter:
    """An in-memory exporter on this process's SDK provider (set once per process)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    out = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(out))
    return out
