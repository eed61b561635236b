"""``python -m ringwire top``: the pieces, in this process -- counting frames in a ring
from outside, the rates of a followed ring, the 80-column view (the command against
live processes is in tests/process/test_top.py)."""

from __future__ import annotations

import io
import json
import time
import types
from typing import Any

import pytest

from ringwire import _inspect, _top
from ringwire._wire.ring import HEADER_SIZE, RingReader, RingWriter, init_ring, ring_size

CAP = 1024


def ring() -> tuple[bytearray, RingWriter, RingReader]:
    buf = bytearray(ring_size(CAP))
    init_ring(buf, 0, CAP)
    return buf, RingWriter(buf), RingReader(buf)


def reader_of(buf: bytearray) -> _top.Reader:
    return lambda off, n: bytes(buf[off : off + n])


def tail_of(w: RingWriter) -> int:
    return int(w.header[8])  # (ring.py's TAIL word)


def span(buf: bytearray, start: int, end: int) -> bytes:
    return _top._read_span(reader_of(buf), HEADER_SIZE, CAP, start, end)


def test_a_followed_ring_counts_records_exactly_while_the_reader_lags() -> None:
    buf, w, r = ring()
    s = _top._Stream("s", reader_of(buf), 0, CAP, 0, 0, time.monotonic())
    for i in range(7):
        assert w.try_write(b"z" * (i + 1))
        if i % 3 == 0:
            s.tick()
    s.tick()
    assert (s.records, s.walked, s.unwalked, s.exact) == (7, tail_of(w), 0, True)
    # the reader consumes past the window before it is counted: still counted, estimated
    for _ in range(3):
        assert w.try_write(b"q" * 16)
    while r.next_frame() is not None:
        pass
    r.commit()
    s.tick()
    rates = s.rates(s.started + 2.0)
    assert s.records == 10 and not rates["records_exact"]
    assert rates["records_per_s"] == 5.0 and rates["bytes_per_s"] == tail_of(w) / 2.0


def test_a_window_too_large_to_walk_is_converted_at_the_mean_frame_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    buf, w, _ = ring()
    s = _top._Stream("s", reader_of(buf), 0, CAP, 0, 0, time.monotonic())
    for _ in range(2):
        assert w.try_write(b"a" * 12)  # 16-byte frames
    s.tick()
    monkeypatch.setattr(_top, "MAX_WALK", 32)
    for _ in range(4):
        assert w.try_write(b"a" * 12)
    s.tick()  # 64 bytes: not walked
    assert (s.records, s.walked, s.unwalked) == (2, 32, 64)
    rates = s.rates(s.started + 1.0)
    assert rates["records_per_s"] == 6.0 and not rates["records_exact"]
    monkeypatch.setattr(_top, "MAX_WALK", 1 << 20)
    assert w.try_write(b"a" * 12)
    assert s.tick(budget=8) == 0 and s.unwalked == 80  # past the sample's budget
    assert w.try_write(b"a" * 12)
    assert s.tick(budget=16) == 16 and s.records == 3
    fresh = _top._Stream("s", reader_of(buf), 0, CAP, 0, 0, s.started)
    fresh.unwalked = 64  # nothing walked at all: no records/s to give
    assert fresh.rates(s.started + 1.0)["records_per_s"] is None


def test_unread_records_are_the_frames_from_the_head() -> None:
    buf, w, r = ring()
    for n in (3, 30, 300):
        assert w.try_write(b"u" * n)
    assert r.next_frame() is not None
    r.commit()  # one consumed, two unread
    head = lambda: int(r.header[16])  # noqa: E731  (ring.py's HEAD word)
    records, nbytes = _top._unread_records(reader_of(buf), 0, CAP, head)
    assert (records, nbytes) == (2, tail_of(w) - head())


def report(stalled: bool = True) -> dict[str, Any]:
    long = "a-process-with-a-very-long-name"
    lane = {
        "writer_pid": 4194301, "reader_pid": 4194302, "capacity": 1 << 20,
        "bytes_per_s": 123456789.0, "records_per_s": 1234567.0, "records_exact": False,
        "unread_records": 123456, "unread_bytes": 999999, "fill": 0.95,
        "reader_parked": True, "writer_parked": True, "writer_closed": True,
        "reader_closed": True, "stalled": stalled, "still_s": 3.0,
    }  # fmt: skip
    reader = {
        "rank": 255, "pid": 4194303, "consumed_bytes_per_s": 1e9, "unread_records": None,
        "unread_bytes": 1 << 30, "fill": 1.0, "parked": True, "closed": True,
        "stalled": stalled, "still_s": 9.0,
    }  # fmt: skip
    return {
        "version": 1, "host": "a-very-long-host-name.example.org", "time": time.time(),
        "interval_s": 1.0, "stall_s": 1.0,
        "connections": [
            {"segment": "memfd:rw.1.000000000000", "creator_pid": 4194301,
             "pids": [4194301, 4194302], "lanes": [lane, lane],
             "slots": {"in_use": 256, "slots": 256}},
        ],
        "broadcasts": [
            {"segment": "memfd:rw.1.000000000001", "writer_pid": 4194301, "pids": [4194301],
             "capacity": 1 << 30, "bytes_per_s": 1e9, "records_per_s": 1e7,
             "records_exact": True, "writer_parked": True, "writer_closed": True,
             "reader_entries": 256, "readers": [reader] * 3, "slots": None},
        ],
        "tcp_connections": [
            {"pid": 4194301, "side": "server", "address": "tcp://[::1]:5555",
             "local": "[2001:db8::1]:65535", "peer": "[2001:db8::2]:65535",
             "peer_pid": None, "state": "peer gone", "in_flight_bytes": 1 << 20,
             "send_capacity": 1 << 20, "inbox_records": 123456, "inbox_bytes": 1 << 30,
             "heard_s_ago": 1.0, "out_bytes_per_s": None, "in_bytes_per_s": 0.0},
        ],
        "listening": [
            {"pid": 4194301, "path": "/tmp/" + "a-deep-directory/" * 8 + "listener.sock",
             "accepted": 1234},
            {"pid": 4194303, "path": "/tmp/b.sock", "accepted": 0},
        ],
        "pools": [],
        "processes": [
            {"pid": p, "comm": long, "alive": p != 4194302} for p in (4194301, 4194302, 4194303)
        ],
        "unreadable": [{"pid": 1, "comm": "init", "uid": 0, "error": "Permission denied"}],
    }  # fmt: skip


def rendered(rep: dict[str, Any]) -> str:
    out = io.StringIO()
    _top._console(out).print(_top.render(rep))
    return out.getvalue()


def test_the_view_fits_80_columns_whatever_it_shows() -> None:
    text = rendered(report())
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= _top.WIDTH == 80, text
    assert text.count("STALLED") >= 6  # two lanes, three ranks, the headline
    assert "~1.2M" in text  # an estimated rate says so
    assert "rank 255" in text and "peer gone" in text
    assert "…ory/a-deep-directory/" in text and "/listener.sock  " in text and "/tmp/b.sock" in text
    who = _top._names(report())
    assert (who(4194301), who(4194302), who(None)) == ("4194301 a-proces", "4194302 (dead)", "?")
    assert "1 process not readable" in text
    assert "\x1b[" not in text  # no terminal: no escape codes
    calm = rendered(report(stalled=False))
    assert "STALLED" not in calm


def test_sample_refuses_bad_numbers() -> None:
    with pytest.raises(ValueError, match="interval"):
        _top.sample(-1.0)
    with pytest.raises(ValueError, match="stall"):
        _top.sample(0.0, stall=float("nan"))


def test_sample_without_proc_says_so(tmp_path: Any) -> None:
    with pytest.raises(OSError, match="/proc"):
        _top.sample(0.0, proc=str(tmp_path))


def two_lanes() -> tuple[bytearray, list[RingWriter], list[RingReader]]:
    """A connection's segment as ``scan`` finds it: two lanes, one after the other."""
    buf = bytearray(2 * ring_size(CAP))
    init_ring(buf, 0, CAP)
    init_ring(buf, ring_size(CAP), CAP)
    offs = (0, ring_size(CAP))
    return buf, [RingWriter(buf, o) for o in offs], [RingReader(buf, o) for o in offs]


def fake_scan(entries: list[tuple[dict[str, Any], _top.Reader]]) -> Any:
    """A ``scan`` over segments in this process's memory (``proc`` unused)."""

    def scan(proc: str, shm_dir: str, pid: Any, hold: Any = None) -> dict[str, Any]:
        for entry, read in entries:
            if hold is not None:
                hold.append(_inspect.Held(dict(entry, lanes=[dict(x) for x in entry["lanes"]]),
                                          read, lambda: None))  # fmt: skip
        return {
            "tcp_connections": [],
            "processes": [],
            "pools": [],
            "unreadable": [],
            "listening": [],
        }

    return scan


def lanes_entry(name: str, writers: list[RingWriter], readers: list[RingReader]) -> dict[str, Any]:
    flags = dict.fromkeys(
        ("reader_parked", "writer_parked", "writer_closed", "reader_closed"), False
    )
    return {
        "segment": name, "kind": "rings", "creator_pid": 1, "pids": [1, 2],
        "lanes": [
            {"capacity": CAP, "tail": tail_of(w), "head": int(r.header[16]),
             "writer_pid": pid, "reader_pid": 3 - pid, **flags}
            for w, r, pid in zip(writers, readers, (1, 2))
        ],
    }  # fmt: skip


def test_sample_follows_rings_flags_a_stall_across_refreshes_and_drops_what_went(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    buf, writers, readers = two_lanes()
    for _ in range(5):
        assert writers[1].try_write(b"r" * 20)  # nobody reads lane 1: 5 unread
    broken = {"after": 10**9}

    def read(off: int, n: int) -> bytes:
        return bytes(buf[off : off + n])

    def dying(off: int, n: int) -> bytes:
        broken["after"] -= 1
        if broken["after"] < 0:
            raise OSError("the process went")
        return bytes(buf[off : off + n])

    entries = [(lanes_entry("seg", writers, readers), read)]
    other = two_lanes()
    entries.append((lanes_entry("dies", other[1], other[2]), dying))
    monkeypatch.setattr(_top, "scan", fake_scan(entries))
    memory = _top._Memory()
    rep = _top.sample(0.05, stall=0.2, memory=memory)
    [conn, dead] = rep["connections"]
    assert conn["segment"] == "seg" and dead["segment"] == "dies" and rep["gone"] == []
    lane0, lane1 = conn["lanes"]
    assert (lane1["unread_records"], lane1["unread_bytes"]) == (5, 5 * 24)
    assert lane1["fill"] == 5 * 24 / CAP and not lane1["stalled"]  # still for 0.05 s only
    assert lane0["unread_records"] == 0 and not lane0["stalled"]
    # the next refresh remembers since when lane 1's reader has not moved
    broken["after"] = 3
    rep = _top.sample(0.2, stall=0.2, memory=memory)
    [conn] = rep["connections"]
    assert conn["lanes"][1]["stalled"] and conn["lanes"][1]["still_s"] >= 0.25
    assert rep["gone"] == ["dies"]
    # the reader catches up: no longer stalled
    while readers[1].next_frame() is not None:
        pass
    readers[1].commit()
    rep = _top.sample(0.02, stall=0.2, memory=memory)
    assert not rep["connections"][0]["lanes"][1]["stalled"]


def test_a_reader_that_just_got_a_record_is_not_stalled(monkeypatch: pytest.MonkeyPatch) -> None:
    # idle (nothing unread) for the whole sample, then a record in the last tick: its
    # head has not moved for 0.3 s, but it had nothing to read until just now
    buf, writers, readers = two_lanes()
    monkeypatch.setattr(
        _top, "scan", fake_scan([(lanes_entry("seg", writers, readers), reader_of(buf))])
    )
    # a clock that moves only when the sampler sleeps: the record lands in the sleep that
    # reaches the sample's end, however slow the machine is
    clock = [1000.0]  # the sampler's ``start``: scan is faked, nothing reads the clock earlier
    end = clock[0] + 0.3
    written: list[bool] = []

    def sleep(seconds: float) -> None:
        clock[0] += seconds
        if clock[0] >= end - _top.TICK_S / 2 and not written:
            written.append(writers[0].try_write(b"late") is True)

    fake_time = types.SimpleNamespace(monotonic=lambda: clock[0], sleep=sleep, time=time.time)
    monkeypatch.setattr(_top, "time", fake_time)
    rep = _top.sample(0.3, stall=0.2)
    lane0 = rep["connections"][0]["lanes"][0]
    assert written == [True]
    assert lane0["unread_records"] == 1 and not lane0["stalled"] and lane0["still_s"] < 0.2


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def args(**kw: Any) -> Any:
    import argparse

    base = {"once": False, "json": False, "interval": 0.01, "stall": 1.0, "pid": None}
    return argparse.Namespace(**{**base, **kw})


def samples_then_interrupt(monkeypatch: pytest.MonkeyPatch, n: int) -> list[Any]:
    """``sample`` gives ``report()`` ``n`` times, then Ctrl-C; returns the memories passed."""
    seen: list[Any] = []

    def fake(interval: float, **kw: Any) -> dict[str, Any]:
        seen.append(kw["memory"])
        if len(seen) > n:
            raise KeyboardInterrupt
        return report(stalled=False)

    monkeypatch.setattr(_top, "sample", fake)
    return seen


def test_the_live_view_refreshes_in_place_until_interrupted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = samples_then_interrupt(monkeypatch, 2)
    out = Terminal()
    assert _top.run(args(), out) == 0
    assert len(seen) == 3 and seen[0] is seen[1] is seen[2]  # one memory across refreshes
    text = out.getvalue()
    assert "\x1b[" in text and text.count("Connections (one row per direction)") >= 2


def test_json_lines_without_once_and_plain_views_when_not_a_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    samples_then_interrupt(monkeypatch, 2)
    out = io.StringIO()
    assert _top.run(args(json=True), out) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(json.loads(x)["version"] == 1 for x in lines)
    samples_then_interrupt(monkeypatch, 2)
    out = io.StringIO()
    assert _top.run(args(), out) == 0
    assert out.getvalue().count("ringwire top") == 2 and "\x1b[" not in out.getvalue()


def test_run_refuses_bad_numbers_and_reports_a_missing_proc(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _top.run(args(interval=0.0), io.StringIO()) == 2
    assert _top.run(args(stall=float("inf")), io.StringIO()) == 2

    def no_proc(interval: float, **kw: Any) -> dict[str, Any]:
        raise OSError("/proc is not available: inspect needs Linux /proc")

    monkeypatch.setattr(_top, "sample", no_proc)
    assert _top.run(args(once=True), io.StringIO()) == 1
    assert "ringwire top: /proc is not available" in capsys.readouterr().err
