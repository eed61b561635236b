"""Records in one trace across processes: the test process sends records under spans
on a channel (one with an array in a slot) and broadcasts one, a spawned child receives
them on ends that trace their records and continues each sender's span; the OpenTelemetry
SDK with an in-memory exporter in both, the child reporting its finished spans as JSON
over a queue."""

from __future__ import annotations

import gc
from typing import Any

import anyio
import numpy as np
import pytest
from opentelemetry import trace
from support.broadcast import SLOTS, bpath_fixture  # noqa: F401
from support.otel import memory_exporter
from support.spawn import SPAWN, spawned

import ringwire

pytestmark = pytest.mark.multiprocess


def receiver(end: ringwire.PairEnd, bpath: str, spans: Any, joined: Any) -> None:
    """Receive three records on the channel and one broadcast, each handled in a span
    that continues the sender's; report the spans as ``(name, trace, parent)``."""
    exporter = memory_exporter()
    tracer = trace.get_tracer("child")

    async def main() -> None:
        async with await end.connect() as chan, await ringwire.subscribe(bpath) as sub:
            ringwire.trace_records(chan)
            ringwire.trace_records(sub)
            joined.set()
            for _ in range(3):
                rec = await chan.receive()
                with ringwire.continue_trace(), tracer.start_as_current_span(rec["name"]):
                    if "a" in rec:
                        assert (rec["a"] == np.arange(8192)).all()
                del rec
            rec = await sub.receive()
            with ringwire.continue_trace(), tracer.start_as_current_span(rec["name"]):
                pass

    try:
        anyio.run(main)
    finally:
        spans.put(
            [
                (
                    s.name,
                    f"{s.context.trace_id:032x}" if s.context else "",
                    None if s.parent is None else f"{s.parent.span_id:016x}",
                )
                for s in exporter.get_finished_spans()
            ]
        )


def test_a_receiver_continues_the_senders_span_in_another_process(bpath: str) -> None:
    exporter = memory_exporter()
    exporter.clear()
    tracer = trace.get_tracer("tests")
    mine, theirs = ringwire.pair()
    queue = SPAWN.Queue()
    joined = SPAWN.Event()
    sent: dict[str, tuple[str, str]] = {}

    def ids(span: Any) -> tuple[str, str]:
        c = span.get_span_context()
        return f"{c.trace_id:032x}", f"{c.span_id:016x}"

    async def sender() -> None:
        async with ringwire.broadcast(bpath, readers=1, slots=SLOTS) as bc:
            ringwire.trace_records(bc)
            async with await mine.connect(slots=SLOTS) as chan:
                ringwire.trace_records(chan)
                with tracer.start_as_current_span("send one") as span:
                    await chan.send({"name": "one"})
                sent["one"] = ids(span)
                with tracer.start_as_current_span("send array") as span:
                    await chan.send({"name": "array", "a": np.arange(8192, dtype=np.int64)})
                sent["array"] = ids(span)
                await chan.send({"name": "untraced"})
                while not joined.is_set():
                    await anyio.sleep(0.01)
                await bc.wait_ready(1)
                with tracer.start_as_current_span("publish") as span:
                    await bc.send({"name": "broadcast"})
                sent["broadcast"] = ids(span)

    with spawned(receiver, theirs, bpath, queue, joined) as child:
        anyio.run(sender)
        got = queue.get(timeout=30)
        child.join(20)
    assert child.exitcode == 0
    queue.close()
    queue.join_thread()
    del queue, sender  # (the queue's semaphores go now, not after the leak check)
    gc.collect()
    by_name = {name: (tid, parent) for name, tid, parent in got}
    assert set(by_name) == {"one", "array", "untraced", "broadcast"}
    for name in ("one", "array", "broadcast"):
        assert by_name[name] == sent[name], name  # same trace, the sender's span as parent
    untraced_trace, untraced_parent = by_name["untraced"]
    assert untraced_parent is None and untraced_trace not in {t for t, _ in sent.values()}
