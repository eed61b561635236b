"""Tests of ringwire._conn.tracing: calls in OpenTelemetry traces, in one process (the
SDK with an in-memory exporter; tests/process/test_tracing.py crosses processes), the
timings hook, and a process where OpenTelemetry cannot be imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Callable

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode
from support.absent import blocker, run_json
from support.otel import memory_exporter

import ringwire
from ringwire import Channel, Client, RemoteError, SyncClient, serve, serve_sync
from ringwire._conn import tracing

_EXPORTER = memory_exporter()  # (on this process's SDK provider)


@pytest.fixture(params=[pytest.param("asyncio", id="asyncio"), pytest.param("trio", id="trio")])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


tracer = trace.get_tracer("tests")


@pytest.fixture
def spans() -> Iterator[Callable[[], dict[str, ReadableSpan]]]:
    """The spans finished since the test began, by name (one of each expected)."""
    _EXPORTER.clear()

    def finished() -> dict[str, ReadableSpan]:
        got = _EXPORTER.get_finished_spans()
        by_name = {s.name: s for s in got}
        assert len(by_name) == len(got), [s.name for s in got]
        return by_name

    yield finished
    _EXPORTER.clear()


async def connected() -> tuple[Channel, Channel]:
    a, b = ringwire.pair()
    ends: dict[str, Channel] = {}
    async with anyio.create_task_group() as tg:

        async def connect_b() -> None:
            ends["b"] = await b.connect()

        tg.start_soon(connect_b)
        ends["a"] = await a.connect()
    return ends["a"], ends["b"]


@asynccontextmanager
async def calls(handler: Callable[[Any], Any]) -> AsyncIterator[Client]:
    ca, cb = await connected()
    async with cb, anyio.create_task_group() as tg:
        await tg.start(lambda task_status: serve(cb, handler, task_status=task_status))
        async with Client(ca) as client:
            yield client


@contextmanager
def sync_calls(handler: Callable[[Any], Any]) -> Iterator[SyncClient]:
    a, b = ringwire.pair()
    ready = threading.Event()
    box: dict[str, Any] = {}

    def server() -> None:
        with b.connect_sync() as chan:
            ready.set()
            try:
                serve_sync(chan, handler)
            except Exception as exc:  # pragma: no cover - reported below
                box["error"] = exc

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    with a.connect_sync() as chan:
        assert ready.wait(10)
        with SyncClient(chan) as client:
            yield client
    thread.join(10)
    assert not thread.is_alive() and "error" not in box


def child_of(child: ReadableSpan, parent: ReadableSpan) -> bool:
    assert child.parent is not None and child.context is not None and parent.context is not None
    return (
        child.context.trace_id == parent.context.trace_id
        and child.parent.span_id == parent.context.span_id
    )


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


# -- one hop ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_call_with_a_span_current_is_a_child_span_continued_by_serve(spans: Any) -> None:
    seen: dict[str, Any] = {}

    async def handler(x: str) -> str:
        seen["span"] = trace.get_current_span().get_span_context()
        return x.upper()

    async with calls(handler) as client:
        with tracer.start_as_current_span("request"):
            assert await client.call("hi", timeout=10) == "HI"
    got = spans()
    call, served, request = got["ringwire.call"], got["ringwire.serve str"], got["request"]
    assert child_of(call, request) and child_of(served, call)
    assert call.kind == SpanKind.CLIENT and served.kind == SpanKind.SERVER
    assert served.context is not None and seen["span"].span_id == served.context.span_id
    a = attrs(call)
    assert a["rpc.system"] == "ringwire" and a["ringwire.call.id"] == 1
    for part in ("queued_s", "wire_s", "handled_s", "round_trip_s"):
        assert a[f"ringwire.call.{part}"] >= 0.0
    assert a["ringwire.call.round_trip_s"] >= a["ringwire.call.handled_s"]
    assert call.status.status_code == StatusCode.UNSET


@pytest.mark.anyio
async def test_without_a_current_span_a_call_is_untraced(spans: Any) -> None:
    seen: list[bool] = []

    async def handler(x: Any) -> Any:
        seen.append(trace.get_current_span().get_span_context().is_valid)
        return x

    assert tracing.call_trace(True, None, 1) is None
    async with calls(handler) as client:
        assert await client.call(1) == 1
    assert seen == [False] and spans() == {}


@pytest.mark.anyio
async def test_a_remote_error_is_recorded_on_both_spans(spans: Any) -> None:
    async def handler(x: Any) -> Any:
        raise ValueError(f"no {x}")

    async with calls(handler) as client:
        with tracer.start_as_current_span("request"):
            with pytest.raises(RemoteError, match="no 3"):
                await client.call(3)
    got = spans()
    call, served = got["ringwire.call"], got["ringwire.serve int"]
    assert child_of(served, call)
    for span, name in ((call, "RemoteError"), (served, "ValueError")):
        assert span.status.status_code == StatusCode.ERROR
        (event,) = [e for e in span.events if e.name == "exception"]
        assert str(dict(event.attributes or {})["exception.type"]).endswith(name)
    assert "ringwire.call.handled_s" in attrs(call)  # an ERROR carries the timings too


@pytest.mark.anyio
async def test_a_cancelled_call_ends_both_spans_marked_cancelled(spans: Any) -> None:
    started = anyio.Event()
    ended = anyio.Event()

    async def handler(x: Any) -> Any:
        started.set()
        try:
            await anyio.sleep(30)
        finally:
            ended.set()

    async with calls(handler) as client:
        with tracer.start_as_current_span("request"):
            async with anyio.create_task_group() as tg:

                async def caller() -> None:
                    await client.call("slow")

                tg.start_soon(caller)
                await started.wait()
                tg.cancel_scope.cancel()
        with anyio.fail_after(10):
            await ended.wait()
            while "ringwire.serve str" not in spans():
                await anyio.sleep(0.01)
    got = spans()
    for name in ("ringwire.call", "ringwire.serve str"):
        assert attrs(got[name])["ringwire.call.cancelled"] is True
        assert got[name].status.status_code == StatusCode.UNSET
    assert child_of(got["ringwire.serve str"], got["ringwire.call"])


@pytest.mark.anyio
async def test_a_call_from_a_handler_continues_the_trace_to_the_next_hop(spans: Any) -> None:
    async def back(x: int) -> int:
        return x + 1

    async with calls(back) as inner:

        async def middle(x: int) -> int:
            return int(await inner.call(x * 10))

        async with calls(middle) as outer:
            with tracer.start_as_current_span("request"):
                assert await outer.call(4) == 41
    got = _EXPORTER.get_finished_spans()
    names = sorted(s.name for s in got)
    assert names == ["request", "ringwire.call", "ringwire.call", "ringwire.serve int"] + [
        "ringwire.serve int"
    ]
    assert len({s.context.trace_id for s in got if s.context is not None}) == 1
    request = next(s for s in got if s.name == "request")
    first = next(s for s in got if s.name == "ringwire.call" and child_of(s, request))
    serve1 = next(s for s in got if s.name == "ringwire.serve int" and child_of(s, first))
    second = next(s for s in got if s.name == "ringwire.call" and child_of(s, serve1))
    assert any(s.name == "ringwire.serve int" and child_of(s, second) for s in got)


@pytest.mark.anyio
async def test_a_blocking_handler_under_serve_runs_in_the_span(spans: Any) -> None:
    def handler(x: Any) -> int:
        return trace.get_current_span().get_span_context().span_id

    async with calls(handler) as client:
        with tracer.start_as_current_span("request"):
            span_id = await client.call(None)
    served = spans()["ringwire.serve NoneType"]
    assert served.context is not None and span_id == served.context.span_id


def test_sync_client_and_serve_sync_trace_too(spans: Any) -> None:
    def handler(x: Any) -> Any:
        if x == "boom":
            raise KeyError(x)
        return trace.get_current_span().get_span_context().span_id

    with sync_calls(handler) as client:
        with tracer.start_as_current_span("request"):
            span_id = client.call("ok", timeout=10)
        got = spans()
        assert got["ringwire.serve str"].context.span_id == span_id  # type: ignore[union-attr]
        assert child_of(got["ringwire.serve str"], got["ringwire.call"])
        assert child_of(got["ringwire.call"], got["request"])
        assert attrs(got["ringwire.call"])["ringwire.call.handled_s"] >= 0
        _EXPORTER.clear()
        with tracer.start_as_current_span("request"):
            with pytest.raises(RemoteError):
                client.call("boom", timeout=10)
        got = spans()
        assert got["ringwire.call"].status.status_code == StatusCode.ERROR
        assert got["ringwire.serve str"].status.status_code == StatusCode.ERROR


@pytest.mark.anyio
async def test_the_tracestate_travels_with_the_traceparent(spans: Any) -> None:
    upstream = trace.SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C,
        0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=trace.TraceFlags(1),
        trace_state=trace.TraceState([("vendor", "v1"), ("other", "x")]),
    )

    async def handler(x: Any) -> str:
        return trace.get_current_span().get_span_context().trace_state.to_header()

    async with calls(handler) as client:
        with trace.use_span(trace.NonRecordingSpan(upstream)):
            assert await client.call(0) == "vendor=v1,other=x"
    got = spans()
    served = got["ringwire.serve int"]
    assert served.context is not None and served.context.trace_id == upstream.trace_id


TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    "header",
    [
        "",
        "garbage",
        TP.upper(),
        "ff" + TP[2:],
        TP + "-extra",  # version 00 has exactly four fields
        "00-" + "0" * 32 + "-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-" + "0" * 16 + "-01",
        "00-0af7651916cd43dd8448eb211c80319-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
    ],
)
def test_a_traceparent_that_does_not_parse_starts_a_new_trace(header: str) -> None:
    assert tracing._parent(tracing._api(), [header]) is None


def test_a_traceparent_parses_by_the_w3c_rules() -> None:
    for header in (TP, "01" + TP[2:] + "-later"):
        parent = tracing._parent(tracing._api(), [header, "a=b"])
        context = trace.get_current_span(parent).get_span_context()
        assert (context.trace_id, context.span_id) == (
            0x0AF7651916CD43DD8448EB211C80319C,
            0xB7AD6B7169203331,
        )
        assert context.is_remote and context.trace_flags.sampled
        assert context.trace_state.to_header() == "a=b"
    assert tracing._traceparent(context) == [TP, "a=b"]


@pytest.mark.anyio
async def test_a_call_whose_traceparent_is_garbage_is_served_in_a_new_trace(spans: Any) -> None:
    ca, cb = await connected()
    async with ca, cb, anyio.create_task_group() as tg:
        tg.start_soon(serve, cb, echo_int)
        await ca.send([1, 1, None, 5, None, ["not a traceparent"]])
        reply = await ca.receive()
        tg.cancel_scope.cancel()
    assert reply[:4] == [2, 1, None, 5] and len(reply[6]) == 2
    served = spans()["ringwire.serve int"]
    assert served.parent is None  # a root


@pytest.mark.anyio
async def test_a_handler_stopped_at_its_deadline_records_deadline_exceeded(spans: Any) -> None:
    async def slow(x: int) -> int:
        await anyio.sleep(30)
        return x

    ca, cb = await connected()
    async with ca, cb, anyio.create_task_group() as tg:
        tg.start_soon(serve, cb, slow)
        await ca.send([1, 1, 0.2, 5, None, [TP]])  # hand-made: no client to cancel first
        with anyio.fail_after(10):
            reply = await ca.receive()
        tg.cancel_scope.cancel()
    assert reply[0] == 3 and reply[4][0] == "DeadlineExceeded" and len(reply[6]) == 2
    served = spans()["ringwire.serve int"]
    assert served.status.status_code == StatusCode.ERROR
    (event,) = [e for e in served.events if e.name == "exception"]
    assert str(dict(event.attributes or {})["exception.type"]).endswith("DeadlineExceeded")


def test_a_serve_sync_handler_past_its_deadline_records_deadline_exceeded(spans: Any) -> None:
    def slow(x: int) -> int:
        while not ringwire.call_cancelled():
            time.sleep(0.01)
        return x

    a, b = ringwire.pair()
    box: dict[str, Any] = {}

    def server() -> None:
        with b.connect_sync() as chan:
            try:
                serve_sync(chan, slow)
            except Exception as exc:  # pragma: no cover - reported below
                box["error"] = exc

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    with a.connect_sync() as chan:
        chan.send([1, 1, 0.2, 5, None, [TP]])
        reply = chan.receive(timeout=10)
    thread.join(10)
    assert not thread.is_alive() and "error" not in box
    assert reply[0] == 3 and reply[4][0] == "DeadlineExceeded" and len(reply[6]) == 2
    served = spans()["ringwire.serve int"]
    assert served.status.status_code == StatusCode.ERROR


async def echo_int(x: int) -> int:
    return x


# -- the timings hook ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_timing_hook_gets_every_answered_calls_parts_without_a_span(
    spans: Any,
) -> None:
    async def handler(x: Any) -> Any:
        await anyio.sleep(0.05)
        return x

    timings: list[tuple[float, float, float]] = []
    async with calls(handler) as client:
        client._core.on_timing = lambda q, w, h: timings.append((q, w, h))
        assert await client.call(1) == 1
        with tracer.start_as_current_span("request"):
            assert await client.call(2) == 2
    assert len(timings) == 2
    for queued, wire, handled in timings:
        assert queued >= 0 and wire >= 0 and handled >= 0.04
    assert set(spans()) == {"request", "ringwire.call", "ringwire.serve int"}


def test_a_raising_timing_hook_is_logged_and_the_call_still_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def bad(q: float, w: float, h: float) -> None:
        raise RuntimeError("hook broke")

    with sync_calls(lambda x: x) as client:
        client._core.on_timing = bad
        assert client.call(5, timeout=10) == 5
    assert "the call timing hook" in caplog.text


# the untyped ``connected`` of the subprocess scripts below (and their trace parent)
CONNECTED = textwrap.dedent(
    """
    TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

    async def connected():
        a, b = ringwire.pair()
        ends = {}
        async with anyio.create_task_group() as tg:
            async def connect_b():
                ends["b"] = await b.connect()
            tg.start_soon(connect_b)
            ends["a"] = await a.connect()
        return ends["a"], ends["b"]
    """
)


# -- without OpenTelemetry --------------------------------------------------------------------

NO_OTEL = (
    blocker("opentelemetry")
    + "import json, anyio, ringwire\nfrom ringwire._conn import tracing\n"
    + CONNECTED
    + textwrap.dedent(
    """

    async def main():
        out = {}
        ca, cb = await connected()
        async with cb:
            async with ringwire.Client(ca) as client:
                async def call():
                    out["reply"] = await client.call("x")
                async with anyio.create_task_group() as tg:
                    tg.start_soon(call)
                    out["call"] = list(await cb.receive())  # the CALL as it came
                    await cb.send([2, 1, None, "X", None])
        # a traced CALL (an upstream process's context) is served, untraced, with timing
        ca, cb = await connected()
        async with ca, cb, anyio.create_task_group() as tg:
            tg.start_soon(ringwire.serve, cb, lambda s: s.upper())
            await ca.send([1, 1, None, "y", None, [TP]])
            out["served"] = list(await ca.receive())
            tg.cancel_scope.cancel()
        out["installed"] = tracing.installed()
        out["otel"] = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
        print(json.dumps(out))

    anyio.run(main)
    """
    )
)


def test_without_opentelemetry_calls_work_and_nothing_is_added_or_imported() -> None:
    out = run_json(NO_OTEL)
    assert out["call"] == [1, 1, None, "x", None]  # the five-position form, as ever
    assert out["reply"] == "X"
    assert out["served"][:6] == [2, 1, None, "Y", None, None]
    assert len(out["served"]) == 7 and all(t >= 0 for t in out["served"][6])
    assert out["installed"] is False and out["otel"] == []


def test_installed_but_unused_opentelemetry_is_not_imported() -> None:
    """An untraced process (it never imports OpenTelemetry) whose calls run: ringwire
    imports none of it, though it is installed."""
    script = textwrap.dedent(
        """
        import sys, anyio, ringwire

        async def main():
            a, b = ringwire.pair()
            async with anyio.create_task_group() as tg:
                async def server():
                    async with await b.connect() as cb:
                        await ringwire.serve(cb, lambda x: x)
                tg.start_soon(server)
                async with ringwire.Client(await a.connect()) as client:
                    assert await client.call(3, timeout=5) == 3
        anyio.run(main)
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_server_without_the_sdk_passes_the_trace_on_unchanged() -> None:
    """A middle process with opentelemetry-api but no SDK (spans do not record): a
    traced CALL's handler calls onwards, and that CALL carries the same trace id."""
    script = "import json, anyio, ringwire\n" + CONNECTED + textwrap.dedent(
        """

        async def main():
            front, middle = await connected()
            onward, back = await connected()
            async with front, middle, back, ringwire.Client(onward) as client:
                async def handler(x):
                    return await client.call(x + 1)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(ringwire.serve, middle, handler)
                    await front.send([1, 1, None, 1, None, [TP, "k=v"]])
                    onward_call = list(await back.receive())
                    await back.send([2, onward_call[1], None, 20, None])
                    reply = list(await front.receive())
                    tg.cancel_scope.cancel()
            print(json.dumps({"onward": onward_call, "reply": reply}))

        anyio.run(main)
        """
    )
    out = run_json(script)
    assert out["onward"][:4] == [1, 1, None, 2]
    # the same trace and parent (no SDK: the API's non-recording span keeps the
    # caller's context), the tracestate too
    assert out["onward"][5] == [TP, "k=v"]
    assert out["reply"][:4] == [2, 1, None, 20] and len(out["reply"][6]) == 2
