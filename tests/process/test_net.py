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
