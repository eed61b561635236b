"""Tests of ringwire._conn.record_tracing (and the wire format, ringwire._wire.traced):
records on channels and broadcasts that carry their sender's trace context, in one
process (the OpenTelemetry SDK with an in-memory exporter; tests/process/
test_record_tracing.py crosses processes), and a process without OpenTelemetry."""

from __future__ import annotations

import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from support.absent import blocker, run_json
from support.broadcast import SLOTS, bpath_fixture, digest, step  # noqa: F401
from support.otel import memory_exporter

import ringwire
from ringwire import Channel, DecodeError, Decoder, Encoder
from ringwire._conn.record_tracing import TracingDecoder, TracingEncoder
from ringwire._net.fanout import to_frames
from ringwire._wire import traced
from ringwire._wire.descriptors import NetRef, SlotRef

_EXPORTER = memory_exporter()  # (on this process's SDK provider)
LOOPBACK = "tcp://127.0.0.1:0"


tracer = trace.get_tracer("tests")
TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(params=[pytest.param("asyncio", id="asyncio"), pytest.param("trio", id="trio")])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


@pytest.fixture
def spans() -> Iterator[None]:
    _EXPORTER.clear()
    yield
    _EXPORTER.clear()


class Job(ringwire.Record):
    n: int
    data: Any = None


def header_of(span: Any) -> str:
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{c.trace_flags:02x}"


def continued(sender: Any) -> ReadableSpan:
    """A span started in ``continue_trace()`` here: it must be the sender's child."""
    with ringwire.continue_trace(), tracer.start_as_current_span("handle"):
        pass
    (got,) = [s for s in _EXPORTER.get_finished_spans() if s.name == "handle"]
    _EXPORTER.clear()
    sc = sender.get_span_context()
    assert got.context.trace_id == sc.trace_id
    assert got.parent is not None and got.parent.span_id == sc.span_id
    return got


async def connected(**kw: Any) -> tuple[Channel, Channel]:
    a, b = ringwire.pair()
    ends: dict[str, Channel] = {}
    async with anyio.create_task_group() as tg:

        async def connect_b() -> None:
            ends["b"] = await b.connect(**kw)

        tg.start_soon(connect_b)
        ends["a"] = await a.connect(**kw)
    return ends["a"], ends["b"]


# -- the wire format ------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 40, 300, 70_000])
@pytest.mark.parametrize("state", ["", "k=v", "k=" + "v" * 200, "k=" + "v" * 8000])
def test_wrap_and_split_round_trip_in_every_ext_size(size: int, state: str) -> None:
    payload = Encoder().encode({"x": "y" * size})
    wire = traced.wrap(payload, TP, state)
    tp, ts, rec, _ = traced.split(wire)  # type: ignore[misc]
    assert (tp, ts, bytes(rec)) == (TP, state, payload)
    assert TracingDecoder().decode(wire) == {"x": "y" * size}
    want = {"traceparent": TP, "tracestate": state} if state else {"traceparent": TP}
    assert ringwire.received_trace() == want
    assert Decoder().decode(wire) == {"x": "y" * size}  # unwrapped, context dropped
    assert traced.split(payload) is None


def test_a_typed_decoder_reads_a_traced_record_and_clears_the_context_after() -> None:
    dec = TracingDecoder(Job)
    wire = traced.wrap(Encoder().encode(Job(n=3)), TP, "")
    assert dec.decode(wire) == Job(n=3)
    assert ringwire.received_trace() == {"traceparent": TP}
    assert dec.decode(Encoder().encode(Job(n=4))) == Job(n=4)
    assert ringwire.received_trace() is None


@pytest.mark.parametrize("state", ["", "k=v"])
def test_a_stamped_record_carries_its_publish_time(state: str) -> None:
    payload = Encoder().encode({"x": 1})
    wire = traced.wrap(payload, TP, state, published_ns=123_456_789_012)
    got = traced.split(wire)
    assert got is not None and got.published_ns == 123_456_789_012
    assert (got.traceparent, got.tracestate, bytes(got.record)) == (TP, state, payload)
    assert traced.split(traced.wrap(payload, TP, state)).published_ns is None  # type: ignore[union-attr]
    assert Decoder().decode(wire) == {"x": 1}
    untraced = traced.wrap(payload, "", "", published_ns=1)  # no span: an empty traceparent
    assert TracingDecoder().decode(untraced) == {"x": 1}
    assert ringwire.received_trace() is None


HOSTILE = [
    pytest.param(b"\xc7\x05\x16\x94\xa0\xa0\xcf\x01", id="stamp-short"),
    pytest.param(b"\xc7\x05\x16\x94\xa0\xa0\x05\x01", id="stamp-not-u64"),
    pytest.param(b"\xc7\x0c\x16\x94\xa0\xa0\xcf" + bytes(8), id="stamped-no-record"),
    pytest.param(b"\xc7\x05\x16\x93\xa1a\xa0", id="no-record"),
    pytest.param(b"\xc7\x03\x16\x92\xa0\xa0", id="array-of-two"),
    pytest.param(b"\xc7\x04\x16\x93\x01\xa0\x01", id="traceparent-not-str"),
    pytest.param(b"\xc7\x05\x16\x93\xa5ab\xa0\x01", id="traceparent-past-end"),
    pytest.param(b"\xc7\x06\x16\x93\xa2\xff\xfe\xa0\x01", id="not-utf8"),
    pytest.param(b"\xc7\x09\x16\x93\xa0\xa0\x01", id="length-lies"),
    pytest.param(b"\xd4\x16\x93", id="fixext1"),
    pytest.param(b"\xc8\x01\x04\x16" + b"\x93\xda\x01\x01" + b"a" * 257 + b"\xa0\x01", id="long"),
    pytest.param(b"\xc7\x04\x16\x93\xa0\xa0\xc1", id="record-malformed"),
    pytest.param(
        b"\xc8\x01\x05\x16" + b"\x93\xa0\xda\x01\x00" + b"a" * 255 + b"\x01", id="state-past-end"
    ),
    pytest.param(
        b"\xc8\x20\x05\x16\x93\xa0\xda\x20\x01" + b"a" * 8193 + b"\x01", id="state-too-long"
    ),
]


@pytest.mark.parametrize("wire", HOSTILE)
def test_a_malformed_traced_record_is_a_decode_error(wire: bytes) -> None:
    for dec in (TracingDecoder(), Decoder(), TracingDecoder(Job)):
        with pytest.raises(DecodeError):
            dec.decode(wire)
    if wire[0] == 0xC7 and wire[1] == len(wire) - 3:  # a bad body: nested in a record too
        with pytest.raises(DecodeError):
            Decoder().decode(Encoder().encode([msgspec.msgpack.Ext(22, wire[3:])]))


def test_a_remote_reader_gets_the_slot_references_inside_a_traced_record_as_frames() -> None:
    ref = SlotRef(
        version=1,
        pool=1,
        slot=2,
        generation=3,
        offset=0,
        nbytes=8,
        shape=(2,),
        dtype="<f4",
        kind="numpy",
    )
    inner = Encoder().encode({"a": ref})
    out = to_frames(traced.wrap(inner, TP, ""), lambda r: (b"12345678", 7))
    assert len(out.frames) == 1  # type: ignore[attr-defined]
    tp, _, rec, _ = traced.split(out)  # type: ignore[misc]
    assert tp == TP
    got = Decoder().decode(rec)["a"]
    assert isinstance(got, NetRef) and got.tag == 7 and got.index == 0


# -- channels ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_record_sent_under_a_span_carries_it_on_a_pair(spans: None) -> None:
    ca, cb = await connected(slots=SLOTS)
    async with ca, cb:
        ringwire.trace_records(ca)
        ringwire.trace_records(cb)
        with tracer.start_as_current_span("send") as span:
            await ca.send(Job(n=1, data=np.arange(8192, dtype=np.int64)))  # through a slot
        got = await cb.receive(type=Job)
        assert got.n == 1 and (got.data == np.arange(8192)).all()
        assert ringwire.received_trace() == {"traceparent": header_of(span)}
        continued(span)
        del got
        await ca.send({"n": 2})  # no span current: nothing carried
        assert await cb.receive() == {"n": 2}
        assert ringwire.received_trace() is None
        with tracer.start_as_current_span("batch") as span:
            await ca.send_many([{"i": i} for i in range(5)])
        assert await cb.receive_many(10) == [{"i": i} for i in range(5)]
        continued(span)
        assert ca.statistics().slots_in_use >= 0


async def ten_undecodable_then_one(sender: Channel, receiver: Channel) -> Any:
    """Ten traced records with an array each that ``receiver`` cannot decode (each a
    DecodeError), then one it can (checked); the span the last was sent under."""
    with anyio.fail_after(20):
        for i in range(10):
            with tracer.start_as_current_span("send"):
                await sender.send({"a": np.full(8192, i, dtype=np.int64)})
            with pytest.raises(DecodeError):
                await receiver.receive(type=int)
        with tracer.start_as_current_span("send") as span:
            await sender.send({"a": np.full(8192, 10, dtype=np.int64)})
        got = await receiver.receive()
        assert (got["a"] == 10).all()
        del got  # (its slot view, before the channels close)
    return span


@pytest.mark.anyio
@pytest.mark.parametrize("receiver_traces", [True, False])
async def test_an_undecodable_traced_record_releases_its_slots(
    spans: None, receiver_traces: bool
) -> None:
    """Ten traced records in slots (the pool has six) that the receiver cannot decode:
    each is a DecodeError, its slot comes back (the salvage looks inside Ext 22), and
    the channel goes on."""
    ca, cb = await connected(slots=SLOTS)
    async with ca, cb:
        ringwire.trace_records(ca)
        ringwire.trace_records(cb, enabled=receiver_traces)
        span = await ten_undecodable_then_one(ca, cb)
        assert ringwire.received_trace() == (
            {"traceparent": header_of(span)} if receiver_traces else None
        )


@pytest.mark.anyio
@pytest.mark.parametrize("nixl", ["0", "1"], ids=["frames", "nixl-if-installed"])
async def test_an_undecodable_traced_record_releases_its_buffers_over_tcp(
    spans: None, nixl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same over TCP: the arrays travel as frames (Ext 20) or through NIXL (Ext 21,
    where it is installed) and count against the sender's budget until the receiver
    releases them (each pool's salvage looks inside Ext 22)."""
    monkeypatch.setenv("RINGWIRE_NIXL", nixl)
    async with ringwire.listen("tcp://127.0.0.1:0", slots=SLOTS) as lst:
        async with await ringwire.connect(lst.path, slots=SLOTS) as c:
            ringwire.trace_records(c)
            conn = await lst.accept()
            ringwire.trace_records(conn)
            span = await ten_undecodable_then_one(c, conn)
            assert ringwire.received_trace() == {"traceparent": header_of(span)}
            await conn.aclose()


@pytest.mark.anyio
async def test_no_span_or_no_opt_in_adds_no_byte(spans: None) -> None:
    record = {"k": list(range(10)), "s": "text"}
    size = len(Encoder().encode(record))
    ca, cb = await connected()
    async with ca, cb:
        ringwire.trace_records(ca)
        await ca.send(record)  # opted in, no span
        with tracer.start_as_current_span("s"):
            ringwire.trace_records(ca, enabled=False)
            await ca.send(record)  # a span, opted out
        assert ca.statistics().bytes_sent == 2 * size
        ringwire.trace_records(ca)
        with tracer.start_as_current_span("s"):
            await ca.send(record)  # both: the context is added
        assert ca.statistics().bytes_sent > 3 * size
        assert [await cb.receive() for _ in range(3)] == [record] * 3  # untyped: unwrapped


@pytest.mark.anyio
async def test_a_listener_and_its_accepted_channels_over_tcp(spans: None) -> None:
    async with ringwire.listen("tcp://127.0.0.1:0") as lst:
        ringwire.trace_records(lst)
        async with await ringwire.connect(lst.path) as c:
            ringwire.trace_records(c)
            with tracer.start_as_current_span("client") as span:
                await c.send({"a": np.ones(100_000)})
            conn, rec = await lst.receive()
            assert rec["a"].sum() == 100_000
            continued(span)
            del rec
            with tracer.start_as_current_span("reply") as span:
                await conn.send("ok")
            assert await c.receive() == "ok"
            continued(span)


def test_a_sync_channel_over_tcp_continues_in_the_receiving_thread(spans: None) -> None:
    with ringwire.SyncListener("tcp://127.0.0.1:0") as sl:
        ringwire.trace_records(sl)
        out: dict[str, Any] = {}

        def server() -> None:
            with sl.accept(10) as conn:
                out["rec"] = conn.receive(timeout=10)
                out["trace"] = ringwire.received_trace()

        t = threading.Thread(target=server)
        t.start()
        with ringwire.connect_sync(sl.path) as c:
            ringwire.trace_records(c)
            with tracer.start_as_current_span("client") as span:
                c.send([1, 2], timeout=10)
            t.join(20)
        assert out == {"rec": [1, 2], "trace": {"traceparent": header_of(span)}}
        assert ringwire.received_trace() is None  # another thread received it


def hops(registry: Any) -> dict[tuple[str, ...], int]:
    """The hop histogram's counts by label values, from ``registry``'s collection."""
    out = {}
    for fam in registry.collect():
        if fam.name == "ringwire_hop_latency_seconds":
            for s in fam.samples:
                if s.name.endswith("_count"):
                    out[(s.labels["endpoint"], s.labels["kind"])] = int(s.value)
    return out


@pytest.fixture
def registry() -> Iterator[Any]:
    import prometheus_client

    reg = prometheus_client.CollectorRegistry()
    collector = ringwire.metrics.register(reg)
    yield reg
    ringwire.metrics.unregister(collector, reg)


@pytest.mark.anyio
async def test_stamped_records_feed_the_hop_latency_histogram(registry: Any) -> None:
    ca, cb = await connected(slots=SLOTS)
    async with ca, cb:
        ringwire.trace_records(ca, hop_times=True)
        await ca.send({"before": True})  # stamped, but cb does not read stamps yet
        assert await cb.receive() == {"before": True}
        assert hops(registry) == {}
        ringwire.trace_records(cb)
        for i in range(20):
            await ca.send({"i": i, "a": np.full(4096, i)})  # half in slots
            got = await cb.receive()
            assert got["i"] == i and (got["a"] == i).all()
            assert ringwire.received_trace() is None  # a stamp without a span
            del got
        await ca.send_many([{"i": i} for i in range(5)])
        assert await cb.receive_many(10) == [{"i": i} for i in range(5)]
        [((_, kind), n)] = list(hops(registry).items())
        assert (kind, n) == ("channel", 25)
        fam = {f.name: f for f in registry.collect()}["ringwire_hop_latency_seconds"]
        total = next(s.value for s in fam.samples if s.name.endswith("_sum"))
        assert 0 < total < 25 * 5.0  # seconds: a hop on one host, not a clock mix-up
        ringwire.trace_records(ca, hop_times=False)  # still traced, no stamps
        await ca.send({"after": True})
        assert await cb.receive() == {"after": True}
        assert sum(hops(registry).values()) == 25


@pytest.mark.anyio
async def test_stamped_records_over_tcp_record_no_hop(registry: Any) -> None:
    async with ringwire.listen(LOOPBACK) as lst:
        ringwire.trace_records(lst, hop_times=True)
        async with await ringwire.connect(lst.path) as client:
            ringwire.trace_records(client, hop_times=True)
            server = await lst.accept()
            async with server:
                await client.send({"x": 1})
                await server.send({"y": 2})
                assert await server.receive() == {"x": 1}
                assert await client.receive() == {"y": 2}
        assert hops(registry) == {}  # another host's clock is not ours: not measured


def test_a_local_broadcast_reader_times_its_hops_a_remote_one_does_not(
    bpath: str, registry: Any
) -> None:
    with ringwire.broadcast_sync(bpath, readers=2, slots=SLOTS, tcp=LOOPBACK) as bc:
        ringwire.trace_records(bc, hop_times=True)
        local = ringwire.trace_records(ringwire.subscribe_sync(bpath, rank=0))
        assert bc.tcp_address is not None
        remote = ringwire.trace_records(ringwire.subscribe_sync(bc.tcp_address, rank=1))
        with local, remote:
            assert bc.wait_ready(2, timeout=10) == 2
            for i in range(4):
                bc.send(step(i, 32 * 1024))
            for reader in (local, remote):
                for i in range(4):
                    assert digest(reader.receive(timeout=10)) == digest(step(i, 32 * 1024))
            assert list(hops(registry).items()) == [((bpath, "subscriber"), 4)]


# -- broadcasts -------------------------------------------------------------------------------


def test_a_broadcast_to_a_local_and_a_remote_reader(bpath: str, spans: None) -> None:
    with ringwire.broadcast_sync(bpath, readers=2, slots=SLOTS, tcp=LOOPBACK) as bc:
        ringwire.trace_records(bc)
        local = ringwire.trace_records(ringwire.subscribe_sync(bpath, rank=0))
        assert bc.tcp_address is not None
        remote = ringwire.trace_records(ringwire.subscribe_sync(bc.tcp_address, rank=1))
        with local, remote:
            assert bc.wait_ready(2, timeout=10) == 2
            sent = [step(0), step(1, 32 * 1024), step(2, 5 << 20)]  # inline, slot, arena
            heads = []
            for rec in sent:
                with tracer.start_as_current_span("publish") as span:
                    bc.send(rec)
                heads.append((span, {"traceparent": header_of(span)}))
            bc.send(step(3))  # no span
            for reader in (local, remote):
                for rec, (span, head) in zip(sent, heads):
                    assert digest(reader.receive(timeout=10)) == digest(rec)
                    assert ringwire.received_trace() == head
                    continued(span)
                assert digest(reader.receive(timeout=10)) == digest(step(3))
                assert ringwire.received_trace() is None


@pytest.mark.anyio
async def test_an_async_broadcast_and_subscriber(bpath: str, spans: None) -> None:
    async with ringwire.broadcast(bpath, readers=1) as bc:
        ringwire.trace_records(bc)
        async with await ringwire.subscribe(bpath) as sub:
            ringwire.trace_records(sub)
            await bc.wait_ready(1)
            with tracer.start_as_current_span("publish") as span:
                await bc.send(step(7))
            assert digest(await sub.receive()) == digest(step(7))
            continued(span)


def test_the_tracing_encoder_wraps_every_record_of_a_batch_under_a_span(spans: None) -> None:
    enc, plain = TracingEncoder(Encoder()), Encoder()
    items = [{"i": i} for i in range(4)]
    out: list[bytes] = [b"before"]
    assert enc.encode_many_with(items, 1, [], out) == 4
    assert out == [b"before", *(plain.encode(x) for x in items[1:])]  # no span: as is
    with tracer.start_as_current_span("batch") as span:
        out = []
        assert enc.encode_many_with(items, 0, [], out) == 4
        buf = bytearray(b"xy")
        enc.encode_into(items[0], buf, -1)
    for payload, item in zip(out, items):
        tp, ts, rec, _ = traced.split(payload)  # type: ignore[misc]
        assert (tp, ts, bytes(rec)) == (header_of(span), "", plain.encode(item))
    assert bytes(buf) == b"xy" + out[0]


def test_trace_records_refuses_what_is_not_an_end() -> None:
    with pytest.raises(TypeError, match="not int"):
        ringwire.trace_records(3)
    assert isinstance(TracingEncoder(Encoder()).encode(1), bytes)


# -- without OpenTelemetry --------------------------------------------------------------------

NO_OTEL = blocker("opentelemetry") + textwrap.dedent(
    """
    import json
    import ringwire
    from ringwire._wire import traced

    TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    a, b = ringwire.pair()
    out = {}
    import threading
    t = threading.Thread(target=lambda: out.update(b=b.connect_sync()))
    t.start()
    ca = a.connect_sync()
    t.join()
    cb = out.pop("b")
    with ca, cb:
        ringwire.trace_records(ca)
        ringwire.trace_records(cb)
        ca.send({"x": 1})
        out["got"] = cb.receive(timeout=10)
        out["trace"] = ringwire.received_trace()
        out["bytes"] = ca.statistics().bytes_sent
        with ringwire.continue_trace({"traceparent": TP}):
            pass
        out["decoded"] = cb._core.dec.decode(traced.wrap(ringwire.encode(5), TP, ""))
        out["carried"] = ringwire.received_trace()
    out["otel"] = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
    print(json.dumps(out))
    """
)


def test_without_opentelemetry_records_flow_untraced_and_nothing_is_imported() -> None:
    out = run_json(NO_OTEL)
    assert out["got"] == {"x": 1} and out["trace"] is None
    assert out["bytes"] == len(Encoder().encode({"x": 1}))
    assert out["decoded"] == 5 and out["carried"] == {"traceparent": TP}
    assert out["otel"] == []
