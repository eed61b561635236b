"""ringwire.metrics: the weak registry of live endpoints (ringwire/_conn/observed.py),
the Prometheus collector on a fresh CollectorRegistry (its text exposition parsed back
with prometheus_client's parser), the OpenTelemetry instruments on the SDK's
InMemoryMetricReader, and ringwire without either package."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest
from support.absent import blocker

import ringwire
from ringwire._conn import observed
from ringwire._pool.slotconfig import SlotConfig
from ringwire._wire.slotlayout import SlotClass

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

SLOTS = SlotConfig(classes=(SlotClass(64 * 1024, 4),), threshold=4096, policy="inline")


@pytest.fixture(name="registry")
def registry_fixture() -> Iterator[Any]:
    reg = prometheus_client.CollectorRegistry()
    collector = ringwire.metrics.register(reg)
    try:
        yield reg
    finally:
        ringwire.metrics.unregister(collector, reg)


@pytest.fixture(name="sock_dir")
def sock_dir_fixture() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="rwm", dir=tempfile.gettempdir())
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def scrape(reg: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The text exposition, parsed back: (sample name, sorted labels) -> value."""
    text = prometheus_client.generate_latest(reg).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(got: dict[Any, float], name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    hits = [
        v for (n, ls), v in got.items() if n == name and labels.items() <= dict(ls).items()
    ]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def series(got: dict[Any, float], **labels: str) -> set[Any]:
    return {k for k in got if labels.items() <= dict(k[1]).items()}


@pytest.fixture(name="sync_pair")
def sync_pair_fixture() -> Iterator[tuple[ringwire.SyncChannel, ringwire.SyncChannel]]:
    a, b = ringwire.pair()
    ends: dict[str, Any] = {}
    t = threading.Thread(target=lambda: ends.__setitem__("b", b.connect_sync(slots=SLOTS)))
    t.start()
    ends["a"] = a.connect_sync(slots=SLOTS)
    t.join(30)
    try:
        yield ends["a"], ends["b"]
    finally:
        ends["a"].close()
        ends["b"].close()


# -- channels ---------------------------------------------------------------------------


def test_counters_move_as_records_flow_and_depth_and_slots_return_to_zero(
    registry: Any, sync_pair: Any
) -> None:
    a, b = sync_pair
    pid = str(os.getpid())
    got = scrape(registry)
    assert value(got, "ringwire_records_total", endpoint="pair:client", direction="send") == 0
    assert value(got, "ringwire_open_endpoints", endpoint="pair:client", kind="channel") == 1
    assert value(got, "ringwire_open_endpoints", peer_pid=pid, endpoint="pair:server") == 1

    arr = np.ones(8192, dtype=np.float64)  # 64 KiB: in a slot
    for i in range(5):
        a.send({"i": i, "x": arr})
    for i in range(7):
        a.send({"i": i})
    got = scrape(registry)
    assert value(got, "ringwire_records_total", endpoint="pair:client", direction="send") == 12
    assert value(got, "ringwire_records_total", endpoint="pair:server", direction="receive") == 0
    sent_bytes = value(got, "ringwire_payload_bytes_total", endpoint="pair:client", direction="send")
    assert sent_bytes > 0
    unread = value(got, "ringwire_unread_bytes", endpoint="pair:server", direction="receive")
    assert unread >= sent_bytes  # each frame has its header and padding
    assert value(got, "ringwire_unread_bytes", endpoint="pair:client", direction="send") == unread
    for end, direction in (("pair:server", "receive"), ("pair:client", "send")):
        assert value(got, "ringwire_unread_records", endpoint=end, direction=direction) == 12
    cap = value(got, "ringwire_ring_capacity_bytes", endpoint="pair:server", direction="receive")
    fill = value(got, "ringwire_ring_fill_ratio", endpoint="pair:server", direction="receive")
    assert fill == pytest.approx(unread / cap)
    assert value(got, "ringwire_slots_in_use", endpoint="pair:client") == 4  # 4 slots, 5 arrays
    assert value(got, "ringwire_slots_free", endpoint="pair:client", slot_size=str(64 * 1024)) == 0
    assert value(got, "ringwire_inline_fallbacks_total", endpoint="pair:client") == 1

    received = [b.receive(timeout=10) for _ in range(12)]
    got = scrape(registry)
    assert value(got, "ringwire_records_total", endpoint="pair:server", direction="receive") == 12
    assert (
        value(got, "ringwire_payload_bytes_total", endpoint="pair:server", direction="receive")
        == sent_bytes
    )
    assert value(got, "ringwire_unread_bytes", endpoint="pair:server", direction="receive") == 0
    assert value(got, "ringwire_unread_records", endpoint="pair:server", direction="receive") == 0
    assert value(got, "ringwire_unread_records", endpoint="pair:client", direction="send") == 0
    assert value(got, "ringwire_received_arrays_held", endpoint="pair:server") == 4
    del received
    gc.collect()
    b.poll_peer()  # the receiver's safe point pushes the releases ...
    a.poll_peer()  # ... the sender's takes the slots back (scrapes never run one)
    got = scrape(registry)
    assert value(got, "ringwire_received_arrays_held", endpoint="pair:server") == 0
    assert value(got, "ringwire_slots_in_use", endpoint="pair:client") == 0
    assert value(got, "ringwire_slots_free", endpoint="pair:client", slot_size=str(64 * 1024)) == 4
    assert value(got, "ringwire_slot_releases_total", endpoint="pair:client") == 4
    assert value(got, "ringwire_errors_total", endpoint="pair:client", error="broken") == 0


def test_a_scrape_touches_no_endpoint(
    registry: Any, sync_pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scrapes run on another thread: no safe point, no drain, no hang-up check."""
    a, b = sync_pair
    a.send({"x": np.ones(8192)})

    def forbidden(*args: Any) -> None:
        raise AssertionError("a scrape ran an endpoint operation")

    for name in ("slot_safe_point", "drain", "notice_hang_up"):
        monkeypatch.setattr(ringwire._conn.endpoint.Endpoint, name, forbidden)
    got = scrape(registry)
    assert value(got, "ringwire_slots_in_use", endpoint="pair:client") == 1


def test_an_endpoint_closing_mid_read_is_skipped_not_fatal(
    registry: Any, sync_pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = sync_pair
    real = observed.channel_statistics

    def racing(core: Any, *, settle: bool = True) -> Any:
        if core.name == "pair:client":  # as if its memory were released under us
            raise ValueError("operation forbidden on a released ring lane")
        return real(core, settle=settle)

    monkeypatch.setattr(observed, "channel_statistics", racing)
    got = scrape(registry)
    assert not series(got, endpoint="pair:client")
    assert series(got, endpoint="pair:server")
    monkeypatch.setattr(observed, "channel_statistics", real)
    assert series(scrape(registry), endpoint="pair:client")  # still registered


def test_a_closed_endpoint_disappears_from_the_scrape(registry: Any, sync_pair: Any) -> None:
    a, b = sync_pair
    a.send({"n": 1})
    assert series(scrape(registry), endpoint="pair:client")
    before = observed.tracked_count()
    a.close()
    got = scrape(registry)
    assert not series(got, endpoint="pair:client")
    assert series(got, endpoint="pair:server")  # the peer is still open
    assert observed.tracked_count() == before - 1  # and the registry let go of it


def test_the_registry_is_weak(registry: Any) -> None:
    before = observed.tracked_count()

    class Owner:
        pass

    owner, core = Owner(), Owner()
    observed.track(owner, core, "channel")
    assert observed.tracked_count() == before + 1
    del owner
    gc.collect()
    assert observed.tracked_count() == before
    with pytest.raises(ValueError, match="kind must be one of"):
        observed.track(Owner(), core, "request")
    with pytest.raises(ValueError, match="read="):
        observed.track(Owner(), None, "listener")


def test_label_sets_stay_bounded_however_many_records(registry: Any, sync_pair: Any) -> None:
    a, b = sync_pair
    a.send({"n": 0})
    b.receive(timeout=10)
    first = set(scrape(registry))
    for n in range(1, 300):
        a.send({"n": n, "x": np.ones(8192) if n % 10 == 0 else None})
        b.receive(timeout=10)
    assert set(scrape(registry)) == first
    allowed = set(observed.FAMILIES["ringwire_errors_total"].labels) | {
        "slot_size", "direction", "state", "rank", "host", "role", "part", "le",
    }  # fmt: skip
    for _, labels in first:
        assert {k for k, _ in labels} <= allowed


def test_equal_labels_are_summed(registry: Any, sock_dir: str) -> None:
    """Two connections from one process to one listener: one series each side, summed."""
    path = os.path.join(sock_dir, "l.sock")
    with ringwire.listen_sync(path, slots=None) as lst:
        accepted: list[Any] = []
        t = threading.Thread(target=lambda: accepted.extend(lst.accept(10) for _ in range(2)))
        t.start()
        c1 = ringwire.connect_sync(path, slots=None)
        c2 = ringwire.connect_sync(path, slots=None)
        t.join(30)
        try:
            c1.send(1)
            c2.send(2)
            c2.send(3)
            got = scrape(registry)
            assert value(got, "ringwire_open_endpoints", endpoint=path, kind="channel",
                         peer_pid=str(os.getpid())) == 4  # fmt: skip
            assert value(got, "ringwire_records_total", endpoint=path, direction="send") == 3
            assert value(got, "ringwire_connections", endpoint=path, kind="listener") == 2
            assert value(got, "ringwire_accepted_total", endpoint=path) == 2
            assert value(got, "ringwire_errors_total", endpoint=path, kind="listener",
                         error="refused") == 0  # fmt: skip
            accepted[0].close()
            got = scrape(registry)
            assert value(got, "ringwire_connections", endpoint=path, kind="listener") == 1
            assert value(got, "ringwire_ended_total", endpoint=path) == 1
        finally:
            c1.close()
            c2.close()
            for c in accepted:
                c.close()
    got = scrape(registry)
    assert not series(got, endpoint=path)


# -- broadcast -----------------------------------------------------------------------------


def test_broadcast_and_its_readers(registry: Any, sock_dir: str) -> None:
    path = os.path.join(sock_dir, "b.sock")
    with ringwire.broadcast_sync(path, readers=4, capacity=1 << 16, slots=SLOTS) as bc:
        subs = [ringwire.subscribe_sync(path) for _ in range(2)]
        try:
            assert bc.wait_ready(2, timeout=20) == 2
            for i in range(10):
                bc.send({"i": i, "x": np.ones(8192) if i < 2 else None}, timeout=10)
            got = scrape(registry)
            assert value(got, "ringwire_records_total", endpoint=path, kind="broadcast") == 10
            assert value(got, "ringwire_broadcast_readers", endpoint=path, state="ready") == 2
            assert value(got, "ringwire_broadcast_joins_total", endpoint=path) == 2
            assert value(got, "ringwire_slots_in_use", endpoint=path, kind="broadcast") == 2
            behind = value(got, "ringwire_unread_bytes", endpoint=path, kind="broadcast")
            assert behind > 0
            for rank in ("0", "1"):
                assert value(got, "ringwire_reader_unread_bytes", endpoint=path,
                             rank=rank) == behind  # fmt: skip
            subs_series = series(got, kind="subscriber")
            assert {dict(k[1])["endpoint"] for k in subs_series} == {path}
            assert value(got, "ringwire_open_endpoints", endpoint=path, kind="subscriber") == 2
            assert value(got, "ringwire_unread_bytes", endpoint=path, kind="subscriber",
                         direction="receive") == 2 * behind  # (two readers, summed)  # fmt: skip
            assert value(got, "ringwire_unread_records", endpoint=path, kind="subscriber",
                         direction="receive") == 20  # fmt: skip
            got_records = [s.receive(timeout=10) for s in subs for _ in range(10)]
            got = scrape(registry)
            assert value(got, "ringwire_records_total", endpoint=path, kind="subscriber",
                         direction="receive") == 20  # fmt: skip
            for rank in ("0", "1"):
                assert value(got, "ringwire_reader_unread_bytes", endpoint=path, rank=rank) == 0
            assert value(got, "ringwire_unread_bytes", endpoint=path, kind="broadcast") == 0
            assert value(got, "ringwire_unread_records", endpoint=path, kind="subscriber") == 0
            del got_records
            gc.collect()
            for s in subs:
                s.poll_writer()
            bc.readers()  # the writer's safe point takes the slots back
            got = scrape(registry)
            assert value(got, "ringwire_slots_in_use", endpoint=path, kind="broadcast") == 0
            for rank in ("0", "1"):
                assert value(got, "ringwire_reader_slots_held", endpoint=path, rank=rank) == 0
        finally:
            for s in subs:
                s.close()
    assert not series(scrape(registry), endpoint=path)


# -- calls ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_calls_channels_and_the_call_timings_hook(registry: Any) -> None:
    a, b = ringwire.pair()
    ends: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:

        async def connect_b() -> None:
            ends["b"] = await b.connect(slots=None)

        tg.start_soon(connect_b)
        ends["a"] = await a.connect(slots=None)

    async def double(x: int) -> int:
        return 2 * x

    async with ends["b"], anyio.create_task_group() as tg:
        await tg.start(lambda task_status: ringwire.serve(ends["b"], double,
                                                          task_status=task_status))  # fmt: skip
        client_chan = ends["a"]
        async with ringwire.Client(client_chan) as client:
            for i in range(20):
                assert await client.call(i) == 2 * i
            got = scrape(registry)
            assert value(got, "ringwire_records_total", endpoint="pair:client", direction="send") >= 20
            assert value(got, "ringwire_records_total", endpoint="pair:server",
                         direction="send") >= 20  # fmt: skip
            # the call layer marks its channels and times every call while recording
            got = scrape(registry)
            assert value(got, "ringwire_records_total", endpoint="pair:client", kind="client",
                         direction="send") >= 20  # fmt: skip
            assert value(got, "ringwire_open_endpoints", endpoint="pair:server", kind="server") == 1
            with pytest.raises(ValueError, match="kind is one of"):
                observed.mark(client_chan, "broadcast")
            assert observed.recording
            for part in ("round_trip", "queued", "wire", "handled"):
                labels = {"endpoint": "pair:client", "role": "client", "part": part}
                assert value(got, "ringwire_call_seconds_count", **labels) == 20
                assert value(got, "ringwire_call_seconds_bucket", le="+Inf", **labels) == 20
            rt = {"endpoint": "pair:client", "role": "client", "part": "round_trip"}
            parts = sum(
                value(got, "ringwire_call_seconds_sum", endpoint="pair:client", role="client",
                      part=p)  # fmt: skip
                for p in ("queued", "wire", "handled")
            )
            assert value(got, "ringwire_call_seconds_sum", **rt) == pytest.approx(parts)
            assert 0 < value(got, "ringwire_call_seconds_sum", **rt) < 20  # real seconds
            observed.call_timed("pair:client", "client", "round_trip", 2e-5)
            got = scrape(registry)
            assert value(got, "ringwire_call_seconds_count", **rt) == 21
            with pytest.raises(ValueError, match="part must be one of"):
                observed.call_timed("pair:client", "client", "request 17", 0.1)
    got = scrape(registry)
    assert not series(got, endpoint="pair:client", kind="client")
    assert not series(got, endpoint="pair:server", kind="server")
    assert not observed.mark(client_chan, "client")  # closed: gone
    # the timings are cumulative: they stay (one histogram per endpoint name and part)
    assert value(got, "ringwire_call_seconds_count", endpoint="pair:client", part="round_trip") == 21


def test_the_hop_latency_hook(registry: Any) -> None:
    for sec in (1e-5, 4e-5, 4e-5, 2.0):
        observed.hop_timed("/run/x.sock", "subscriber", sec)
    got = scrape(registry)
    labels = {"endpoint": "/run/x.sock", "kind": "subscriber"}
    assert value(got, "ringwire_hop_latency_seconds_count", **labels) == 4
    assert value(got, "ringwire_hop_latency_seconds_bucket", le="1e-05", **labels) == 1
    assert value(got, "ringwire_hop_latency_seconds_bucket", le="5e-05", **labels) == 3
    assert value(got, "ringwire_hop_latency_seconds_bucket", le="1.0", **labels) == 3
    assert value(got, "ringwire_hop_latency_seconds_bucket", le="+Inf", **labels) == 4
    with pytest.raises(ValueError, match="kind must be"):
        observed.hop_timed("/run/x.sock", "request", 0.1)


def test_timings_are_forgotten_when_the_last_exporter_goes() -> None:
    reg = prometheus_client.CollectorRegistry()
    c = ringwire.metrics.register(reg)
    observed.hop_timed("/run/y.sock", "channel", 1e-4)
    assert any(s.family == "ringwire_hop_latency_seconds" for s in ringwire.metrics.samples())
    ringwire.metrics.unregister(c, reg)
    assert not observed.recording
    assert not observed.timings()


# -- registration ---------------------------------------------------------------------------


def test_registering_twice_on_one_registry_is_refused(registry: Any) -> None:
    with pytest.raises(ValueError):
        ringwire.metrics.register(registry)


def test_exposition_names_follow_prometheus(registry: Any, sync_pair: Any) -> None:
    text = prometheus_client.generate_latest(registry).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name, fam in observed.FAMILIES.items():
        assert name.startswith("ringwire_")
        if fam.type == "counter":
            assert name.endswith("_total")
            assert fams[name.removesuffix("_total")].type == "counter"
        else:
            assert not name.endswith("_total")
            assert fams[name].type == fam.type
        if fam.unit == "By":
            assert name.removesuffix("_total").endswith("_bytes")
        if fam.unit == "s":
            assert name.endswith("_seconds")


def test_recording_is_on_only_while_an_exporter_is(registry: Any) -> None:
    assert observed.recording
    reg2 = prometheus_client.CollectorRegistry()
    c2 = ringwire.metrics.register(reg2)
    ringwire.metrics.unregister(c2, reg2)
    assert observed.recording  # the fixture's is still registered


def test_a_scrape_while_endpoints_come_and_go(registry: Any) -> None:
    """Scrapes on one thread, connections made, used and closed on others."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def scraper() -> None:
        try:
            while not stop.is_set():
                scrape(registry)
        except BaseException as exc:  # pragma: no cover - the failure
            errors.append(exc)

    t = threading.Thread(target=scraper)
    t.start()
    try:
        for _ in range(5):
            a, b = ringwire.pair()
            ends: dict[str, Any] = {}
            tb = threading.Thread(target=lambda: ends.__setitem__("b", b.connect_sync(slots=SLOTS)))  # noqa: B023
            tb.start()
            ca = a.connect_sync(slots=SLOTS)
            tb.join(30)
            for i in range(50):
                ca.send({"i": i, "x": np.ones(8192) if i % 5 == 0 else None})
                ends["b"].receive(timeout=10)
            ca.close()
            ends["b"].close()
    finally:
        stop.set()
        t.join(30)
    assert not errors


# -- OpenTelemetry ----------------------------------------------------------------------------


def test_opentelemetry_observable_instruments(sync_pair: Any) -> None:
    sdk_metrics = pytest.importorskip("opentelemetry.sdk.metrics")
    export = pytest.importorskip("opentelemetry.sdk.metrics.export")
    reader = export.InMemoryMetricReader()
    provider = sdk_metrics.MeterProvider(metric_readers=[reader])
    a, b = sync_pair
    instruments = ringwire.metrics.otel(provider)
    try:
        for i in range(4):
            a.send({"i": i})
        observed.call_timed("pair:client", "client", "round_trip", 0.001)

        def points(data: Any) -> dict[str, list[Any]]:
            out: dict[str, list[Any]] = {}
            for rm in data.resource_metrics:
                for sm in rm.scope_metrics:
                    assert sm.scope.name == "ringwire"
                    for m in sm.metrics:
                        out[m.name] = list(m.data.data_points)
            return out

        got = points(reader.get_metrics_data())
        sent = [
            p for p in got["ringwire.records"]
            if p.attributes == {"endpoint": "pair:client", "kind": "channel",
                                "peer_pid": str(os.getpid()), "direction": "send"}
        ]  # fmt: skip
        assert [p.value for p in sent] == [4]
        unread = [
            p.value for p in got["ringwire.unread_bytes"]
            if p.attributes["endpoint"] == "pair:server" and p.attributes["direction"] == "receive"
        ]  # fmt: skip
        assert unread and unread[0] > 0
        (call,) = got["ringwire.call_seconds"]
        assert call.count == 1 and call.attributes["part"] == "round_trip"
        for _ in range(4):
            b.receive(timeout=10)
        instruments._cached = (-1e9, {})  # (a collection 0.2 s later would read afresh)
        got = points(reader.get_metrics_data())
        unread = [
            p.value for p in got["ringwire.unread_bytes"]
            if p.attributes["endpoint"] == "pair:server" and p.attributes["direction"] == "receive"
        ]  # fmt: skip
        assert unread == [0]
    finally:
        instruments.close()
        provider.shutdown()
    assert not observed.on_timed


# -- without the optional packages ------------------------------------------------------------

BLOCKER = blocker("prometheus_client", "opentelemetry")

CHILD = textwrap.dedent(
    """
    import sys, threading
    import ringwire, ringwire.metrics
    a, b = ringwire.pair()
    ends = {}
    t = threading.Thread(target=lambda: ends.__setitem__("b", b.connect_sync(slots=None)))
    t.start(); ca = a.connect_sync(slots=None); t.join()
    ca.send({"n": 1}); assert ends["b"].receive(timeout=10) == {"n": 1}
    names = {s.family for s in ringwire.metrics.samples()}
    assert "ringwire_records_total" in names, names
    for call in (ringwire.metrics.register, ringwire.metrics.otel):
        try:
            call()
        except ModuleNotFoundError as exc:
            assert "ringwire[observe]" in str(exc), exc
        else:
            raise AssertionError(f"{call.__name__} without its package")
    ca.close(); ends["b"].close()
    loaded = sorted(m for m in sys.modules
                    if m.split(".")[0] in ("prometheus_client", "opentelemetry"))
    assert not loaded, loaded
    print("ok")
    """
)


def test_without_prometheus_client_and_opentelemetry(tmp_path: Any) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tmp_path), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    probe = subprocess.run(
        [sys.executable, "-c", "import prometheus_client"], env=env, capture_output=True
    )
    assert probe.returncode != 0  # the blocker works
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_importing_ringwire_imports_neither_package() -> None:
    code = (
        "import sys, ringwire, ringwire.metrics; "
        "print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('prometheus_client', 'opentelemetry')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
