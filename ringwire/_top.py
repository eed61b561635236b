"""``python -m ringwire top``: a live view of every connection and broadcast on the host.

Everything comes from the segments' headers, found the way ``inspect`` finds them
(:func:`ringwire._inspect.scan`, which leaves the readers of ring and broadcast
segments open for us): no process cooperates, nothing is written, nothing is mapped.
A *sample* is one scan, then :data:`TICK_S`-spaced reads of every ring's header for
``interval`` seconds, then a second scan (slot pools, TCP tables, the processes):

* **bytes/s** each way are exact: a lane's tail counts the bytes ever published (a
  broadcast reader's head the bytes it consumed), so two reads of it ``dt`` apart give
  the rate.  A TCP connection's rates come from its status table's ``sent`` and
  ``consumed`` counters in the two scans.
* **records/s**: the header counts bytes, not records, so each tick walks the frames
  published since the last one (``[u32 length][payload]`` padded to 8, and wrap
  markers: :mod:`ringwire._wire.ring`).  Those bytes can be overwritten by the time
  they are read only once the reader has consumed them: the writer never writes past
  the reader's head plus the capacity.  So the count of a window ``[t0, t1)`` is
  *exact* when the reader's head (a broadcast: its horizon, the slowest live reader's
  head), read *after* the frames, is still at or below ``t0``; otherwise the walk is
  kept only if it lands exactly on ``t1`` with every length valid, and the rate is
  marked estimated (``records_exact: false``).  Windows larger than
  :data:`MAX_WALK` bytes or past the sample's budget (:data:`WALK_PER_S`, which bounds
  the CPU ``top`` takes), or whose walk fails, are counted in bytes and converted at
  the mean frame size of the windows that were walked.
* **unread depth**: bytes are ``tail - head``; records are the frames between them,
  walked from the head read *after* the data (the writer cannot overwrite what that
  head has not consumed), so the count is exact for that moment.
* **stalled**: a reader (a lane's, or a broadcast rank's) that has unread records and
  whose head has not moved for ``stall`` seconds of observation -- across the refreshes
  of the live view, within the sample with ``--once``.
* **slots in use** of a connection: the slot pools whose owner and peers are exactly
  the connection's two processes (both directions); of a broadcast, the pool its
  writer owns whose peers are its readers.  Two connections between the same two
  processes share their pools' figures.

:func:`sample` returns the report as plain data (``--json``); :func:`render` draws it
80 columns wide with rich; :func:`run` is the command.  Module invariant: every reader
:func:`ringwire._inspect.scan` leaves open is closed before :func:`sample` returns or
raises.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from ._inspect import PROC, Held, Reader, scan
from ._pool.segment import SHM_DIR
from ._wire.broadcast_ring import BROADCAST_WORDS, ENTRY_SIZE, ENTRY_WORDS
from ._wire.ring import HEADER_SIZE, HEADER_WORDS
from ._wire.ring_walk import count_frames

__all__ = [
    "MAX_WALK",
    "TICK_S",
    "WALK_PER_S",
    "add_command",
    "count_frames",
    "render",
    "run",
    "sample",
]

TICK_S = 0.01
"""Seconds between two reads of every ring's header within a sample."""
MAX_WALK = 256 * 1024
"""The most bytes of frames one tick reads from one ring to count records."""
WALK_PER_S = 2 << 20
"""The most bytes of frames a sample walks per second, all rings together: what bounds
``top``'s own CPU however fast the records flow (about a tenth of a core with 8-byte
frames; past it, windows are converted at the mean frame size)."""

_U64 = struct.Struct("=Q")
_TAIL = 8 * HEADER_WORDS["tail"]
_HEAD = 8 * HEADER_WORDS["head"]  # a broadcast ring's horizon
_ENTRY_HEAD = 8 * ENTRY_WORDS["head"]


def _read_span(read: Reader, data_off: int, capacity: int, start: int, end: int) -> bytes:
    """The data-area bytes between counters ``start`` and ``end`` (at most a ring)."""
    off = start & (capacity - 1)
    first = min(end - start, capacity - off)
    out = read(data_off + off, first)
    if end - start > first:
        out += read(data_off, end - start - first)
    if len(out) != end - start:
        raise OSError(f"short read of a ring's data at offset {data_off + off}")
    return out


def _word(read: Reader, off: int) -> int:
    data = read(off, 8)
    if len(data) != 8:
        raise OSError(f"short read of a ring's header at offset {off}")
    value: int = _U64.unpack(data)[0]
    return value


@dataclass
class _Stream:
    """One ring's publishing side: its tail, and the records counted since the start."""

    segment: str
    read: Reader
    header: int  # offset of the ring header in the segment
    capacity: int
    tail0: int
    tail: int
    started: float
    records: int = 0  # frames counted in walked windows
    walked: int = 0  # bytes of those windows
    unwalked: int = 0  # bytes published in windows not walked
    exact: bool = True

    def tick(self, budget: int = MAX_WALK) -> int:
        """Read the tail again; walk the frames published since, when they are at most
        ``budget`` bytes (and :data:`MAX_WALK`).  Returns the bytes walked."""
        tail = _word(self.read, self.header + _TAIL)
        if tail == self.tail:
            return 0
        span = tail - self.tail
        if not 0 < span <= min(self.capacity, MAX_WALK, budget):
            self.unwalked += max(0, span)
            self.tail = max(self.tail, tail)
            return 0
        data = _read_span(self.read, self.header + HEADER_SIZE, self.capacity, self.tail, tail)
        guard = _word(self.read, self.header + _HEAD)  # a head, or a broadcast's horizon
        n = count_frames(data, self.tail, self.capacity)
        if n is None:
            self.unwalked += span
        else:
            self.records += n
            self.walked += span
            self.exact = self.exact and guard <= self.tail
        self.tail = tail
        return span

    def rates(self, now: float) -> dict[str, Any]:
        dt = max(now - self.started, 1e-9)
        published = self.tail - self.tail0
        if self.walked:
            records: float | None = self.records + self.unwalked * self.records / self.walked
        else:
            records = None if self.unwalked else 0
        return {
            "bytes_per_s": published / dt,
            "records_per_s": None if records is None else records / dt,
            "records_exact": self.exact and not self.unwalked,
        }


@dataclass
class _Cursor:
    """One reader's head: its progress and whether it stalls."""

    key: tuple[str, int]  # (segment, lane index or broadcast rank)
    stream: _Stream  # what it reads
    head0: int
    head: int
    still_since: float  # when the head last moved, or the reader last had nothing unread


@dataclass
class _Memory:
    """What the live view remembers between refreshes: when each reader last moved."""

    still_since: dict[tuple[str, int], tuple[int, float]] = field(default_factory=dict)


def _unread_records(
    read: Reader, header: int, capacity: int, head_now: Callable[[], int]
) -> tuple[int | None, int]:
    """``(records, bytes)`` published and not consumed by the reader whose head
    ``head_now`` reads, in the ring at ``header``: the frames from that head, read again
    after the data (the writer overwrites nothing that head has not consumed)."""
    head = head_now()
    tail = _word(read, header + _TAIL)
    data_off = header + HEADER_SIZE
    if not head <= tail <= head + capacity:
        return None, max(0, tail - head)
    if tail - head > MAX_WALK * 4:
        return None, tail - head
    data = _read_span(read, data_off, capacity, head, tail)
    after = head_now()
    if after > tail:
        return 0, 0
    return count_frames(data[after - head :], after, capacity), tail - after


def _ticker(held: list[Held], now: float) -> tuple[list[_Stream], dict[tuple[str, int], _Cursor]]:
    streams: list[_Stream] = []
    cursors: dict[tuple[str, int], _Cursor] = {}
    for h in held:
        e = h.entry
        if e["kind"] == "rings":
            off = 0
            for i, lane in enumerate(e["lanes"]):
                streams.append(
                    _Stream(
                        e["segment"], h.read, off, lane["capacity"], lane["tail"], lane["tail"], now
                    )
                )
                cursors[(e["segment"], i)] = _Cursor(
                    (e["segment"], i), streams[-1], lane["head"], lane["head"], now
                )
                lane["_stream"] = streams[-1]
                off += HEADER_SIZE + lane["capacity"]
        else:
            streams.append(
                _Stream(e["segment"], h.read, 0, e["capacity"], e["tail"], e["tail"], now)
            )
            e["_stream"] = streams[-1]
            for r in e["readers"]:
                key = (e["segment"], r["rank"])
                cursors[key] = _Cursor(key, streams[-1], r["head"], r["head"], now)
    return streams, cursors


def _head_reader(h: Held, index: int) -> Callable[[], int]:
    """Reads the head of lane ``index`` of a connection, or of rank ``index`` of a
    broadcast, from the segment."""
    e = h.entry
    if e["kind"] == "rings":
        off = 0 if index == 0 else HEADER_SIZE + e["lanes"][0]["capacity"]
        return lambda: _word(h.read, off + _HEAD)
    entry = HEADER_SIZE + e["capacity"] + index * ENTRY_SIZE + _ENTRY_HEAD
    return lambda: _word(h.read, entry)


def _pid_pools(pools: list[dict[str, Any]], pids: set[int]) -> dict[str, int] | None:
    """Slots in use and in all of the pools whose owner and peers are ``pids``."""
    mine = [p for p in pools if {p["owner_pid"], *p["peer_pids"]} == pids]
    if not mine:
        return None
    return {"in_use": sum(p["in_use"] for p in mine), "slots": sum(p["slots"] for p in mine)}


def sample(
    interval: float = 1.0,
    *,
    pid: int | None = None,
    stall: float = 1.0,
    memory: _Memory | None = None,
    proc: str = PROC,
    shm_dir: str = SHM_DIR,
) -> dict[str, Any]:
    """One view of the host (the ``--json`` output): scan, follow every ring for
    ``interval`` seconds, scan again.  ``pid``: only what that process maps, holds or
    created.  ``stall``: seconds a reader with unread records may keep its head still
    before it is flagged ``stalled``.  ``memory``: carried from one call to the next by
    the live view, so a stall is timed across refreshes.  Raises ``OSError`` when
    ``proc`` is not a Linux ``/proc``, ``ValueError`` for an ``interval`` or ``stall``
    that is negative or not finite."""
    for name, value in (("interval", interval), ("stall", stall)):
        if not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a finite number of seconds >= 0, not {value!r}")
    memory = memory if memory is not None else _Memory()
    held: list[Held] = []
    try:
        first = scan(proc, shm_dir, pid, hold=held)
        start = time.monotonic()
        streams, cursors = _ticker(held, start)
        heads = {
            (h.entry["segment"], i): _head_reader(h, i)
            for h in held
            for i in (
                range(2) if h.entry["kind"] == "rings" else [r["rank"] for r in h.entry["readers"]]
            )
        }
        gone: set[str] = set()  # segments that could no longer be read (their processes went)
        for s in streams:  # the counters as of ``start``, not of the scan
            try:
                s.tail0 = s.tail = _word(s.read, s.header + _TAIL)
            except OSError:
                gone.add(s.segment)
        for key, c in cursors.items():
            try:
                c.head0 = c.head = heads[key]()
            except OSError:
                gone.add(key[0])
        for c in cursors.values():  # a reader still since an earlier refresh stays so
            was = memory.still_since.get(c.key)
            if was is not None and was[0] == c.head:
                c.still_since = was[1]
        deadline = start + interval
        budget = int(WALK_PER_S * max(interval, TICK_S))
        while True:
            now = time.monotonic()
            for s in streams:
                if s.segment not in gone:
                    try:
                        budget -= s.tick(budget)
                    except OSError:
                        gone.add(s.segment)
            for key, c in cursors.items():
                if key[0] not in gone:
                    try:
                        head = heads[key]()
                    except OSError:
                        gone.add(key[0])
                        continue
                    # moved, or nothing to read (as of this tick's tail): not still
                    if head != c.head or head >= c.stream.tail:
                        c.head, c.still_since = head, now
            if now >= deadline:
                break
            time.sleep(min(TICK_S, deadline - now))
        end = time.monotonic()
        connections, broadcasts = [], []
        for h in held:
            if h.entry["segment"] in gone:
                continue
            try:
                if h.entry["kind"] == "rings":
                    connections.append(_connection(h, cursors, end, stall))
                else:
                    broadcasts.append(_broadcast(h, cursors, end, stall))
            except OSError:
                gone.add(h.entry["segment"])
    finally:
        for h in held:
            h.close()
    memory.still_since = {k: (c.head, c.still_since) for k, c in cursors.items()}
    last = scan(proc, shm_dir, pid)
    for conn in connections:
        conn["slots"] = _pid_pools(last["pools"], set(conn["pids"]))
    for b in broadcasts:
        readers = {r["pid"] for r in b["readers"]} - {b["writer_pid"]}
        mine = [
            p for p in last["pools"]
            if p["owner_pid"] == b["writer_pid"] and p["peer_pids"]
            and set(p["peer_pids"]) <= readers
        ]  # fmt: skip
        b["slots"] = (
            {"in_use": sum(p["in_use"] for p in mine), "slots": sum(p["slots"] for p in mine)}
            if mine
            else None
        )
    tcp = _tcp_rates(first["tcp_connections"], last["tcp_connections"], end - start)
    procs = {p["pid"]: p for p in (*first["processes"], *last["processes"])}
    return {
        "version": 1,
        "host": socket.gethostname(),
        "time": time.time(),
        "interval_s": end - start,
        "stall_s": stall,
        "connections": connections,
        "broadcasts": broadcasts,
        "tcp_connections": tcp,
        "listening": last["listening"],
        "pools": [
            {
                k: p[k]
                for k in ("segment", "owner_pid", "peer_pids", "slots", "in_use", "loaned", "sent")
            }
            for p in last["pools"]
        ],
        "processes": [procs[p] for p in sorted(procs)],
        "unreadable": last["unreadable"],
        "gone": sorted(gone),  # segments that could not be read again (their processes went)
    }


def _stalled(c: _Cursor, unread: int, now: float, stall: float) -> tuple[bool, float]:
    still = now - c.still_since if unread else 0.0
    return bool(unread) and still >= stall, still


def _connection(
    h: Held, cursors: dict[tuple[str, int], _Cursor], now: float, stall: float
) -> dict[str, Any]:
    e = h.entry
    lanes = []
    off = 0
    for i, lane in enumerate(e["lanes"]):
        s: _Stream = lane.pop("_stream")
        cap = lane["capacity"]
        records, unread = _unread_records(h.read, off, cap, _head_reader(h, i))
        words = struct.unpack("=64Q", h.read(off, HEADER_SIZE))  # the flags, fresh
        c = cursors[(e["segment"], i)]
        stalled, still = _stalled(c, unread, now, stall)
        flags = ("reader_parked", "writer_parked", "writer_closed", "reader_closed")
        lanes.append(
            {
                "writer_pid": lane["writer_pid"],
                "reader_pid": lane["reader_pid"],
                "capacity": cap,
                **s.rates(now),
                "unread_records": records,
                "unread_bytes": unread,
                "fill": unread / cap,
                **{f: words[HEADER_WORDS[f]] != 0 for f in flags},
                "stalled": stalled,
                "still_s": still,
            }
        )
        off += HEADER_SIZE + cap
    return {
        "segment": e["segment"],
        "creator_pid": e["creator_pid"],
        "pids": e["pids"],
        "lanes": lanes,
    }


def _broadcast(
    h: Held, cursors: dict[tuple[str, int], _Cursor], now: float, stall: float
) -> dict[str, Any]:
    e = h.entry
    s: _Stream = e.pop("_stream")
    cap = e["capacity"]
    readers = []
    table = HEADER_SIZE + cap
    for r in e["readers"]:
        fresh = struct.unpack(
            f"={ENTRY_SIZE // 8}Q", h.read(table + r["rank"] * ENTRY_SIZE, ENTRY_SIZE)
        )
        r["parked"] = fresh[ENTRY_WORDS["parked"]] != 0
        r["closed"] = fresh[ENTRY_WORDS["closed"]] != 0
        c = cursors[(e["segment"], r["rank"])]
        records, unread = _unread_records(h.read, 0, cap, _head_reader(h, r["rank"]))
        stalled, still = _stalled(c, unread, now, stall)
        readers.append(
            {
                "rank": r["rank"],
                "pid": r["pid"],
                "consumed_bytes_per_s": (c.head - c.head0) / max(now - s.started, 1e-9),
                "unread_records": records,
                "unread_bytes": unread,
                "fill": unread / cap,
                "parked": r["parked"],
                "closed": r["closed"],
                "stalled": stalled,
                "still_s": still,
            }
        )
    return {
        "segment": e["segment"],
        "writer_pid": e["writer_pid"],
        "pids": e["pids"],
        "capacity": cap,
        **s.rates(now),
        "writer_parked": _word(h.read, 8 * BROADCAST_WORDS["writer_parked"]) != 0,
        "writer_closed": e["writer_closed"],
        "reader_entries": e["reader_entries"],
        "readers": readers,
    }


def _tcp_rates(
    first: list[dict[str, Any]], last: list[dict[str, Any]], dt: float
) -> list[dict[str, Any]]:
    before = {(t["pid"], t["local"], t["peer"]): t for t in first}
    out = []
    for t in last:
        b = before.get((t["pid"], t["local"], t["peer"]))
        row = {
            k: t[k]
            for k in ("pid", "side", "address", "local", "peer", "peer_pid", "state",
                      "in_flight_bytes", "send_capacity", "inbox_records", "inbox_bytes",
                      "heard_s_ago")
        }  # fmt: skip
        row["out_bytes_per_s"] = None if b is None else (t["sent_bytes"] - b["sent_bytes"]) / dt
        row["in_bytes_per_s"] = (
            None if b is None else (t["consumed_bytes"] - b["consumed_bytes"]) / dt
        )
        out.append(row)
    return out


# -- rendering ------------------------------------------------------------------------------

WIDTH = 80
"""The columns the rendered view fits."""
_STATE_WIDTH = 15  # the most columns the STATE column takes (its flags are cut at that)


def _num(x: float | None) -> str:
    """A rate or a count in four characters or so: 12, 1.2k, 34k, 5.6M."""
    if x is None:
        return "?"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            v = x / size
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return f"{x:.0f}" if x >= 1 or x == 0 else f"{x:.1f}"


def _bytes(x: float | None) -> str:
    if x is None:
        return "?"
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if x >= size:
            v = x / size
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return f"{x:.0f}B"


def _names(report: dict[str, Any]) -> Callable[[int | None], str]:
    comms = {p["pid"]: (p["comm"] or "", p["alive"]) for p in report["processes"]}

    def who(pid: int | None) -> str:
        if not pid:
            return "?"
        comm, alive = comms.get(pid, ("", True))
        return f"{pid} {comm[:8]}".rstrip() if alive else f"{pid} (dead)"

    return who


def _records(rates: dict[str, Any]) -> str:
    text = _num(rates["records_per_s"])
    return text if rates["records_exact"] or text == "?" else "~" + text


def _slots(slots: dict[str, int] | None) -> str:
    return "-" if slots is None else f"{slots['in_use']}/{slots['slots']}"


def _unread(records: int | None, nbytes: int) -> str:
    return "0" if not nbytes else f"{_num(records)}/{_bytes(nbytes)}"


def _pct(fraction: float) -> str:
    pct = 100 * fraction
    return f"{pct:.1f}%" if pct < 10 else f"{pct:.0f}%"


def _state(flags: list[tuple[str, bool]]) -> str:
    return ",".join(name for name, on in flags if on)


def _tables(report: dict[str, Any]) -> list[tuple[str, list[str], list[tuple[list[str], str]]]]:
    """The view's sections: title, headers, rows (cells and a rich style)."""
    who = _names(report)
    out = []
    rows: list[tuple[list[str], str]] = []
    for c in report["connections"]:
        slots = _slots(c["slots"])
        for lane in c["lanes"]:
            state = _state(
                [("STALLED", lane["stalled"]), ("wfull", lane["writer_parked"]),
                 ("rpark", lane["reader_parked"]), ("wclosed", lane["writer_closed"]),
                 ("rclosed", lane["reader_closed"])]
            )  # fmt: skip
            style = "bold red" if lane["stalled"] else "yellow" if lane["writer_parked"] else ""
            cells = [
                f"{who(lane['writer_pid'])} > {who(lane['reader_pid'])}",
                _records(lane), _bytes(lane["bytes_per_s"]),
                _unread(lane["unread_records"], lane["unread_bytes"]),
                _pct(lane["fill"]), slots, state,
            ]  # fmt: skip
            rows.append((cells, style))
    heads = ["WRITER > READER", "REC/S", "B/S", "UNREAD", "FILL", "SLOTS", "STATE"]
    out.append(("Connections (one row per direction)", heads, rows))
    rows = []
    for b in report["broadcasts"]:
        state = _state([("wfull", b["writer_parked"]), ("wclosed", b["writer_closed"])])
        behind = max((r["unread_bytes"] for r in b["readers"]), default=0)
        cells = [
            f"{who(b['writer_pid'])} > {len(b['readers'])}/{b['reader_entries']} readers",
            _records(b), _bytes(b["bytes_per_s"]), f"max {_bytes(behind)}" if behind else "0",
            _pct(behind / b["capacity"]), _slots(b["slots"]), state,
        ]  # fmt: skip
        rows.append((cells, "yellow" if b["writer_parked"] else "bold"))
        for r in b["readers"]:
            state = _state(
                [("STALLED", r["stalled"]), ("parked", r["parked"]), ("closed", r["closed"])]
            )
            cells = [
                f"  rank {r['rank']}: {who(r['pid'])}", "", _bytes(r["consumed_bytes_per_s"]),
                _unread(r["unread_records"], r["unread_bytes"]), _pct(r["fill"]), "",
                state,
            ]  # fmt: skip
            rows.append((cells, "bold red" if r["stalled"] else ""))
    heads = ["WRITER / READER", "REC/S", "B/S", "UNREAD", "FILL", "SLOTS", "STATE"]
    out.append(("Broadcasts (B/S of a reader: consumed)", heads, rows))
    rows = []
    for t in report["tcp_connections"]:
        cells = [
            f"{who(t['pid'])} {t['side']} > {t['peer'] or '?'}",
            _bytes(t["out_bytes_per_s"]), _bytes(t["in_bytes_per_s"]),
            _unread(t["inbox_records"], t["inbox_bytes"]),
            f"{_bytes(t['in_flight_bytes'])}/{_bytes(t['send_capacity'])}",
            t["state"],
        ]  # fmt: skip
        rows.append((cells, "bold red" if t["state"] != "live" else ""))
    heads = ["PROCESS SIDE > PEER", "OUT B/S", "IN B/S", "UNREAD", "IN FLIGHT", "STATE"]
    out.append(("TCP connections", heads, rows))
    rows = []
    listening = report.get("listening", [])
    whos = [who(x["pid"]) for x in listening]
    room = WIDTH - 2 * 2 - max([7, *map(len, whos)]) - len("ACCEPTED")  # what a path may take
    for x, name in zip(listening, whos):
        path = x["path"] if len(x["path"]) <= room else "…" + x["path"][-(room - 1) :]
        rows.append(([path, name, str(x["accepted"])], ""))
    heads = ["PATH", "PROCESS", "ACCEPTED"]
    out.append(("Listening (Unix sockets of these processes)", heads, rows))
    return out


def _headline(report: dict[str, Any]) -> str:
    stalled = sum(lane["stalled"] for c in report["connections"] for lane in c["lanes"])
    stalled += sum(r["stalled"] for b in report["broadcasts"] for r in b["readers"])
    when = time.strftime("%H:%M:%S", time.localtime(report["time"]))
    text = (
        f"ringwire top  {report['host'][:16]}  {when}  {report['interval_s']:.1f} s  "
        f"{len(report['connections'])} conn, "
        f"{len(report['broadcasts'])} bcast, {len(report['tcp_connections'])} tcp"
    )
    if stalled:
        text += f", {stalled} STALLED"
    unreadable = len(report["unreadable"])
    if unreadable:  # (a segment only they map is missing: inspect names them)
        text += f"\n{unreadable} process{'' if unreadable == 1 else 'es'} not readable"
    return text


_RIGHT = {n: [0 < i < n - 1 for i in range(n)] for n in (6, 7)}  # figures to the right
_RIGHT[3] = [False, False, True]  # the listening sockets' table: path, process, count


def _widths(heads: list[str], rows: list[tuple[list[str], str]]) -> list[int]:
    """Column widths that add up to at most :data:`WIDTH` (two columns between two
    columns): the figures whole, the state cut at ``_STATE_WIDTH``, the first column
    (processes) what is left."""
    need = [max(len(h), *(len(cells[i]) for cells, _ in rows)) for i, h in enumerate(heads)]
    need[-1] = min(need[-1], _STATE_WIDTH)
    left = WIDTH - 2 * (len(heads) - 1) - sum(need[1:])
    need[0] = max(8, min(need[0], left))
    while sum(need) + 2 * (len(heads) - 1) > WIDTH and need[-1] > 5:
        need[-1] -= 1  # figures too wide for the rest (huge numbers): the state gives way
    return need


def render(report: dict[str, Any]) -> Any:
    """The view of one :func:`sample` as a rich renderable, :data:`WIDTH` columns wide."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(_headline(report), style="bold")]
    for title, heads, rows in _tables(report):
        parts.append(Text(""))
        if not rows:
            parts.append(Text(f"{title}: none", style="dim"))
            continue
        table = Table(
            title=title, title_justify="left", box=None, padding=(0, 1), pad_edge=False,
            header_style="bold", expand=False,
        )  # fmt: skip
        for h, width, right in zip(heads, _widths(heads, rows), _RIGHT[len(heads)]):
            table.add_column(
                h, no_wrap=True, overflow="ellipsis", justify="right" if right else "left",
                min_width=width, max_width=width,
            )  # fmt: skip
        for cells, style in rows:
            table.add_row(*(Text(c) for c in cells), style=style or None)  # names are not markup
        parts.append(table)
    return Group(*parts)


def _console(out: TextIO) -> Any:
    from rich.console import Console

    return Console(file=out, width=WIDTH, highlight=False, soft_wrap=False)


def _dump(report: dict[str, Any], out: TextIO, indent: int | None) -> None:
    json.dump(report, out, indent=indent)
    out.write("\n")
    out.flush()


def run(args: argparse.Namespace, out: TextIO) -> int:
    """The ``top`` command: one sample (``--once``), or a view refreshed in place
    (rich, on a terminal) until interrupted; ``--json`` prints the samples as JSON (one
    object with ``--once``, else one line each)."""
    if not args.interval > 0 or args.interval == float("inf"):
        print(f"ringwire top: --interval must be a number of seconds > 0, not {args.interval}",
              file=sys.stderr)  # fmt: skip
        return 2
    if not args.stall >= 0 or args.stall == float("inf"):
        print(f"ringwire top: --stall must be a number of seconds >= 0, not {args.stall}",
              file=sys.stderr)  # fmt: skip
        return 2
    memory = _Memory()

    def one() -> dict[str, Any]:
        return sample(args.interval, pid=args.pid, stall=args.stall, memory=memory)

    try:
        if args.once:
            report = one()
            if args.json:
                _dump(report, out, 2)
            else:
                _console(out).print(render(report))
            return 0
        if args.json or not out.isatty():
            while True:
                report = one()
                if args.json:
                    _dump(report, out, None)
                else:
                    _console(out).print(render(report))
        from rich.live import Live
        from rich.text import Text

        console = _console(out)
        with Live(Text("ringwire top: sampling ..."), console=console, auto_refresh=False) as live:
            while True:
                live.update(render(one()), refresh=True)
    except BrokenPipeError:  # ``top --json | head``: the reader has had enough
        if out is sys.stdout:  # (and no second error when Python flushes it at exit)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        print(f"ringwire top: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def add_command(sub: Any) -> None:
    """Add ``top`` to the command line's subcommands."""
    t = sub.add_parser(
        "top",
        help="live view: every connection and broadcast, records/s, unread depth, stalls",
        description=(
            "A live view of every ringwire connection and broadcast on this host (and the "
            "TCP connections' status tables), refreshed in place every --interval seconds: "
            "owner processes, records/s and bytes/s each way, unread depth (records/bytes), "
            "ring fill, slots in use, parked ends, stalled readers highlighted.  Read from the "
            "segments' headers like inspect: no cooperation from the processes.  Records/s "
            "marked ~ are estimated (the reader consumed the frames before they were counted: see "
            "ringwire/_top.py).  Stop it with Ctrl-C."
        ),
    )
    t.add_argument("--once", action="store_true",
                   help="print one sample (rates over --interval) and exit")  # fmt: skip
    t.add_argument("--json", action="store_true",
                   help="machine-readable output (without --once: one JSON line per sample)")  # fmt: skip
    t.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                   help="seconds between refreshes, over which rates are measured (default 1)")  # fmt: skip
    t.add_argument("--stall", type=float, default=1.0, metavar="SECONDS",
                   help="flag a reader with unread records whose head has not moved for this "
                   "long (default 1)")  # fmt: skip
    t.add_argument("--pid", type=int, help="only segments this process maps, holds or created")
    t.set_defaults(func=run)
