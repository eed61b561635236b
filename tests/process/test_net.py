"""The TCP transport across processes: a killed peer is reported at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import anyio
import pytest

import ringwire
from ringwire._conn.async_channel import Channel

zmq = pytest.importorskip("zmq")
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


_PEER = """
import sys, time, ringwire
ch = ringwire.connect_sync(sys.argv[1])
ch.send("ready")
time.sleep(60)
"""


@pytest.mark.multiprocess
async def test_kill_9_of_the_peer_is_seen_at_once() -> None:
    async with ringwire.listen("tcp://127.0.0.1:0") as lst:
        proc = subprocess.Popen([sys.executable, "-c", _PEER, lst.path])
        try:
            with anyio.fail_after(30):
                conn: Channel = await lst.accept()
                assert await conn.receive() == "ready"
            proc.kill()
            t0 = time.monotonic()
            with pytest.raises(anyio.BrokenResourceError):
                with anyio.fail_after(5):
                    await conn.receive()
            assert time.monotonic() - t0 < 1.0  # the kernel resets the connection
        finally:
            proc.kill()
            proc.wait()
    assert os.getpid()


_FEEDER = """
import json, sys, time
import numpy as np
import ringwire

def rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

slots = ringwire.SlotConfig(classes=(ringwire.SlotClass(1 << 20, 4),), threshold=4096)
ch = ringwire.connect_sync(sys.argv[1], capacity=1 << 20, slots=slots)
ch.send("ready")
record = {"body": b"x" * 60_000}
array = np.ones(1 << 20, np.uint8)
before = rss_mib()
records = arrays = timeouts = 0
t_end = time.monotonic() + 3.0
while time.monotonic() < t_end:  # ~3 s of trying to send 60 KB records and 1 MiB arrays
    try:
        ch.send(record, timeout=0.05)
        records += 1
        ch.send({"a": array}, timeout=0.05)
        arrays += 1
    except TimeoutError:
        timeouts += 1
after = rss_mib()
print(json.dumps(dict(before=before, after=after, records=records, arrays=arrays,
                      timeouts=timeouts)), flush=True)
time.sleep(60)
"""


@pytest.mark.multiprocess
async def test_a_sender_feeding_a_stalled_receiver_stays_bounded() -> None:
    # the receiver accepts and never reads: the sender's sends time out once its credit
    # window (1 MiB of records) and its array budget (4 MiB) are spent, and its memory
    # does not grow past them, however long it keeps trying (ZeroMQ's own queues have
    # no high-water mark: the bound is ringwire's credit)
    async with ringwire.listen("tcp://127.0.0.1:0") as lst:
        proc = subprocess.Popen(
            [sys.executable, "-c", _FEEDER, lst.path], stdout=subprocess.PIPE, text=True
        )
        try:
            with anyio.fail_after(30):
                conn: Channel = await lst.accept()
                assert await conn.receive() == "ready"
            assert proc.stdout is not None
            line = await anyio.to_thread.run_sync(proc.stdout.readline)
            import json

            got = json.loads(line)
            print("stalled receiver:", got)
            assert got["timeouts"] > 10, got  # it was held back ...
            assert got["records"] * 60_000 <= 2 << 20, got  # ... by the credit window
            assert got["arrays"] <= 4, got  # ... and by the array budget
            assert got["after"] - got["before"] < 16, got  # MiB: no unbounded growth
        finally:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
