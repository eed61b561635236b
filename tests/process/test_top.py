"""``python -m ringwire top``, the command in subprocesses against live processes: a
channel, a broadcast with a reader that keeps up and one that stalls, a listener's
accepted connection; ``--once --json`` and the rendered 80-column view."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest
from support.broadcast import bpath_fixture  # noqa: F401  (the fixture)
from support.spawn import SPAWN, spawned

import ringwire
from ringwire._wire.ring import frame_size

pytestmark = pytest.mark.multiprocess  # every test here starts a process

KiB = 1 << 10
CFG = ringwire.SlotConfig(classes=(ringwire.SlotClass(64 * KiB, 4),), threshold=1024)
UNREAD = 20  # records the child sends that the parent never reads
RECORD = {"pad": "x" * 100}


def top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ringwire", "top", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def child_channel(end: ringwire.PairEnd, ready: Any) -> None:
    """Send ``UNREAD`` records (the first with an array in a slot), then read what the
    parent sends until it sends ``"stop"``."""
    with end.connect_sync(slots=CFG) as ch:
        ch.send({"x": np.arange(4096, dtype=np.float32)}, timeout=10)
        for _ in range(UNREAD - 1):
            ch.send(RECORD, timeout=10)
        ready.send(b"sent")
        while ch.receive(timeout=30) != "stop":
            pass


def child_listener_peer(path: str, stop: Any) -> None:
    with ringwire.connect_sync(path) as ch:
        for _ in range(3):
            ch.send(RECORD, timeout=10)
        stop.poll(30)


def child_reader(path: str, rank: int, ready: Any, reads: bool) -> None:
    """A broadcast reader: reads every record until ``"stop"``, or (``reads`` false)
    reads nothing and waits for the parent's word."""
    with ringwire.subscribe_sync(path, rank=rank) as sub:
        ready.send(b"joined")
        if reads:
            while sub.receive(timeout=30) != "stop":
                pass
        else:
            ready.poll(30)


class Pacer:
    """Sends a record every few milliseconds from a thread while the test looks."""

    def __init__(self, send: Any) -> None:
        self.send, self.stop, self.count = send, threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.005):
            self.send({"n": self.count})
            self.count += 1

    def __enter__(self) -> Pacer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(10)


@pytest.mark.multiprocess
def test_top_once_shows_channel_broadcast_and_listener(bpath: str) -> None:
    me = os.getpid()
    lpath = os.path.join(os.path.dirname(bpath), "l.sock")
    a, b = ringwire.pair()
    sent_r, sent_w = SPAWN.Pipe(duplex=False)
    stop_r, stop_w = SPAWN.Pipe(duplex=False)
    r0_here, r0_there = SPAWN.Pipe()
    r1_here, r1_there = SPAWN.Pipe()
    with (
        ringwire.broadcast_sync(bpath, readers=2) as bc,
        ringwire.SyncListener(lpath) as listener,
        spawned(child_channel, b, sent_w) as pc,
        spawned(child_listener_peer, lpath, stop_r) as pl,
        spawned(child_reader, bpath, 0, r0_there, True) as p0,
        spawned(child_reader, bpath, 1, r1_there, False) as p1,
        a.connect_sync(slots=CFG) as ch,
    ):
        sent_w.close()
        stop_r.close()
        try:
            assert sent_r.poll(30) and sent_r.recv() == b"sent"
            assert r0_here.poll(30) and r1_here.poll(30)
            bc.wait_ready(2, timeout=30)
            for i in range(10):
                bc.send({"step": i}, timeout=10)
            accepted = listener.accept(timeout=30)
            with Pacer(lambda r: ch.send(r, timeout=10)), Pacer(lambda r: bc.send(r, timeout=10)):
                out = top("--once", "--json", "--pid", str(me), "--interval", "1", "--stall", "0.5")
                text = top("--once", "--pid", str(me), "--interval", "0.5", "--stall", "0.2")
            assert out.returncode == 0, out.stderr
            report = json.loads(out.stdout)

            # the channel: the child created it; its lane to us holds UNREAD records
            [conn] = [c for c in report["connections"] if set(c["pids"]) == {me, pc.pid}]
            assert conn["creator_pid"] == me
            to_child, from_child = conn["lanes"]
            assert (to_child["writer_pid"], to_child["reader_pid"]) == (me, pc.pid)
            assert (from_child["writer_pid"], from_child["reader_pid"]) == (pc.pid, me)
            assert from_child["unread_records"] == UNREAD
            assert from_child["unread_bytes"] > (UNREAD - 1) * frame_size(
                len(ringwire.encode(RECORD))
            )
            assert from_child["fill"] == from_child["unread_bytes"] / from_child["capacity"] > 0
            assert from_child["stalled"] and from_child["records_per_s"] == 0
            # records flow to the child, which keeps up
            assert to_child["records_per_s"] > 10 and to_child["bytes_per_s"] > 0
            assert not to_child["stalled"]
            assert conn["slots"] == {"in_use": 1, "slots": 8}  # the child's array, unread

            # the broadcast: we write; rank 0 keeps up, rank 1 reads nothing
            [bcast] = [x for x in report["broadcasts"] if x["writer_pid"] == me]
            assert bcast["records_per_s"] > 10 and bcast["reader_entries"] == 2
            ranks = {r["rank"]: r for r in bcast["readers"]}
            assert (ranks[0]["pid"], ranks[1]["pid"]) == (p0.pid, p1.pid)
            assert ranks[1]["stalled"] and ranks[1]["unread_records"] >= 10
            assert ranks[1]["unread_bytes"] > 0 and ranks[1]["fill"] > 0
            assert not ranks[0]["stalled"] and ranks[0]["consumed_bytes_per_s"] > 0

            # the listener's accepted connection: created by the connecting child
            [lconn] = [c for c in report["connections"] if set(c["pids"]) == {me, pl.pid}]
            assert lconn["creator_pid"] == pl.pid
            [theirs] = [lane for lane in lconn["lanes"] if lane["writer_pid"] == pl.pid]
            assert theirs["unread_records"] == 3 and theirs["reader_pid"] == me

            # the listener's and the broadcast's sockets, with what they accepted
            listening = {(x["pid"], x["path"]): x["accepted"] for x in report["listening"]}
            assert listening[(me, lpath)] == 1 and listening[(me, bpath)] == 2

            procs = {p["pid"] for p in report["processes"]}
            assert {me, pc.pid, pl.pid, p0.pid, p1.pid} <= procs

            # the rendered view fits 80 columns and names the stalled readers
            assert text.returncode == 0, text.stderr
            lines = text.stdout.splitlines()
            assert lines and max(len(line) for line in lines) <= 80, text.stdout
            assert "STALLED" in text.stdout and f"{pc.pid} " in text.stdout
            assert "rank 1" in text.stdout and "TCP connections: none" in text.stdout
            del accepted
        finally:
            ch.send("stop", timeout=10)
            bc.send("stop", timeout=10)
            stop_w.send(b"stop")
            r1_here.send(b"stop")
        for p in (pc, pl, p0, p1):
            p.join(30)
            assert p.exitcode == 0
    stop_w.close()
    after = top("--once", "--json", "--pid", str(me), "--interval", "0.1")
    report = json.loads(after.stdout)
    assert report["connections"] == [] and report["broadcasts"] == [], report


def test_top_is_listed_and_refuses_bad_numbers() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "ringwire", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    assert "top" in help_text and "live view" in help_text
    out = top("--once", "--interval", "0")
    assert out.returncode == 2 and "--interval must be" in out.stderr
    out = top("--once", "--stall", "-1")
    assert out.returncode == 2 and "--stall must be" in out.stderr


def child_tcp(url: str, ready: Any) -> None:
    """Connect over TCP, say so, read until ``"stop"``."""
    with ringwire.connect_sync(url, heartbeat=2.0) as ch:
        ch.send({"hello": 1}, timeout=10)
        ready.send(b"connected")
        while ch.receive(timeout=30) != "stop":
            pass


@pytest.mark.multiprocess
def test_top_shows_tcp_connections_with_their_rates() -> None:
    pytest.importorskip("zmq")
    me = os.getpid()
    ready_r, ready_w = SPAWN.Pipe(duplex=False)
    with ringwire.SyncListener("tcp://127.0.0.1:0") as listener:
        with spawned(child_tcp, listener.path, ready_w) as p:
            ready_w.close()
            ch = listener.accept(timeout=30)
            try:
                assert ch.receive(timeout=10) == {"hello": 1}
                assert ready_r.poll(30)
                with Pacer(lambda r: ch.send(r, timeout=10)):
                    out = top("--once", "--json", "--interval", "1")  # both processes' tables
                assert out.returncode == 0, out.stderr
                rows = json.loads(out.stdout)["tcp_connections"]
                [theirs] = [t for t in rows if t["pid"] == p.pid]
                assert theirs["side"] == "client" and theirs["peer_pid"] == me
                assert theirs["state"] == "live" and theirs["in_bytes_per_s"] > 0
                assert theirs["out_bytes_per_s"] == 0  # it sent its hello before
                [ours] = [t for t in rows if t["pid"] == me]
                assert ours["side"] == "server" and ours["peer_pid"] == p.pid
                assert ours["out_bytes_per_s"] > 0 and ours["peer"] == theirs["local"]
                ch.send("stop", timeout=10)
                p.join(30)
                assert p.exitcode == 0
            finally:
                ch.close()


def test_top_streams_json_lines_until_interrupted() -> None:
    import signal

    p = subprocess.Popen(
        [sys.executable, "-m", "ringwire", "top", "--json", "--interval", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert p.stdout is not None
        first, second = p.stdout.readline(), p.stdout.readline()
        assert json.loads(first)["version"] == json.loads(second)["version"] == 1
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 0
        assert "Traceback" not in (p.stderr.read() if p.stderr else "")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()
