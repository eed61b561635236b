"""One trace across processes: a front (the test process) calls a middle (a spawned
child serving calls) whose handler calls a back (another child); the OpenTelemetry SDK
with an in-memory exporter in each, each child reporting its finished spans as JSON
over a queue.  One request's spans share one trace id and chain parent -> child across
both hops, for a call that succeeds, one that fails (RemoteError on the spans) and one
that is cancelled (every span marked cancelled)."""

from __future__ import annotations

import gc
from typing import Any

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from support.otel import memory_exporter
from support.spawn import SPAWN, spawned

import ringwire
from ringwire import Client, RemoteError, serve

pytestmark = pytest.mark.multiprocess


def as_json(span: ReadableSpan, where: str) -> dict[str, Any]:
    assert span.context is not None
    return {
        "where": where,
        "name": span.name,
        "trace": f"{span.context.trace_id:032x}",
        "id": f"{span.context.span_id:016x}",
        "parent": None if span.parent is None else f"{span.parent.span_id:016x}",
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "exceptions": [
            str(dict(e.attributes or {}).get("exception.type"))
            for e in span.events
            if e.name == "exception"
        ],
    }


# -- the children ---------------------------------------------------------------------------


def back(end: ringwire.PairEnd, spans: Any, slow_started: Any) -> None:
    exporter = memory_exporter()

    async def handler(x: str) -> str:
        if x == "boom":
            raise ValueError("boom at the back")
        if x == "slow":
            slow_started.set()
            await anyio.sleep(60)
        return x + " (back)"

    async def main() -> None:
        async with await end.connect() as chan:
            await serve(chan, handler)

    try:
        anyio.run(main)
    finally:
        spans.put([as_json(s, "back") for s in exporter.get_finished_spans()])


def middle(front_end: ringwire.PairEnd, back_end: ringwire.PairEnd, spans: Any) -> None:
    exporter = memory_exporter()

    async def main() -> None:
        async with await front_end.connect() as chan:
            async with Client(await back_end.connect()) as client:

                async def handler(x: str) -> str:
                    return str(await client.call(x)) + " (middle)"

                await serve(chan, handler)

    try:
        anyio.run(main)
    finally:
        spans.put([as_json(s, "middle") for s in exporter.get_finished_spans()])


# -- the test -------------------------------------------------------------------------------


def test_one_trace_chains_across_three_processes() -> None:
    exporter = memory_exporter()
    exporter.clear()
    tracer = trace.get_tracer("tests")
    front_end, middle_end = ringwire.pair()
    middle_to_back, back_end = ringwire.pair()
    queue = SPAWN.Queue()
    slow_started = SPAWN.Event()
    roots: dict[str, str] = {}

    async def front() -> None:
        async with Client(await front_end.connect()) as client:
            for what in ("ok", "boom", "slow"):
                with tracer.start_as_current_span(f"request {what}") as root:
                    roots[what] = f"{root.get_span_context().trace_id:032x}"
                    if what == "ok":
                        assert await client.call(what, timeout=20) == "ok (back) (middle)"
                    elif what == "boom":
                        with pytest.raises(RemoteError, match="boom at the back") as info:
                            await client.call(what, timeout=20)
                        assert info.value.type_name == "ValueError"
                    else:
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(lambda: client.call("slow", timeout=20))
                            while not slow_started.is_set():
                                await anyio.sleep(0.01)
                            tg.cancel_scope.cancel()

    with (
        spawned(back, back_end, queue, slow_started) as pb,
        spawned(middle, middle_end, middle_to_back, queue) as pm,
    ):
        anyio.run(front)  # leaving closes the front's client: the middle, then the back end
        got = [queue.get(timeout=30), queue.get(timeout=30)]
        pm.join(10)
        pb.join(10)
    assert pm.exitcode == 0 and pb.exitcode == 0
    queue.close()
    queue.join_thread()
    # the queue's and the event's semaphores go with them (the closures and the
    # RemoteError's traceback make cycles: collect them now, not after the leak check)
    del queue, front
    gc.collect()
    spans = [s for batch in got for s in batch]
    spans += [as_json(s, "front") for s in exporter.get_finished_spans()]

    for what, trace_id in roots.items():
        mine = [s for s in spans if s["trace"] == trace_id]
        by_id = {s["id"]: s for s in mine}
        chain = [(s["where"], s["name"]) for s in mine]
        assert sorted(chain) == sorted(
            [
                ("front", f"request {what}"),
                ("front", "ringwire.call"),
                ("middle", "ringwire.serve str"),
                ("middle", "ringwire.call"),
                ("back", "ringwire.serve str"),
            ]
        ), chain
        # each span's parent is the one before it in the chain
        leaf = next(s for s in mine if s["where"] == "back")
        walked = []
        node: dict[str, Any] | None = leaf
        while node is not None:
            walked.append((node["where"], node["name"]))
            node = by_id.get(node["parent"]) if node["parent"] else None
        assert walked == [
            ("back", "ringwire.serve str"),
            ("middle", "ringwire.call"),
            ("middle", "ringwire.serve str"),
            ("front", "ringwire.call"),
            ("front", f"request {what}"),
        ], walked
        hops = [s for s in mine if s["name"].startswith("ringwire.")]
        if what == "ok":
            assert all(s["status"] == "UNSET" for s in hops)
            for call in (s for s in hops if s["name"] == "ringwire.call"):
                a = call["attributes"]
                assert min(a[f"ringwire.call.{p}_s"] for p in ("queued", "wire", "handled")) >= 0
        elif what == "boom":
            assert all(s["status"] == "ERROR" for s in hops), hops
            served_back = next(s for s in hops if s["where"] == "back")
            assert served_back["exceptions"] == ["ValueError"]
            assert all(
                s["exceptions"][0].endswith("RemoteError") for s in hops if s is not served_back
            )
        else:
            for s in hops:
                assert s["attributes"].get("ringwire.call.cancelled") is True, s
                assert s["status"] == "UNSET", s
