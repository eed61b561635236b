"""Large tensors through NIXL between two processes on this machine (UCX on loopback):
checksummed content, receipts, the budget, a peer killed mid-stream.  Skipped where
nixl-cu12 is not installed; the CUDA test also where there is no GPU."""

from __future__ import annotations

import gc
import hashlib
import subprocess
import sys
import time
from typing import Any

import anyio
import numpy as np
import pytest

import ringwire
from ringwire._conn.async_channel import Channel

zmq = pytest.importorskip("zmq")
torch = pytest.importorskip("torch")
pytest.importorskip("nixl_cu12", reason="nixl-cu12 is not installed: no NIXL path to test")

from ringwire._net import nixl  # noqa: E402

if nixl.process() is None:  # pragma: no cover - installed but unusable (no UCX plugin)
    pytest.skip(f"NIXL is not usable here: {nixl.why_not()}", allow_module_level=True)

pytestmark = [pytest.mark.anyio, pytest.mark.multiprocess]
SLOTS = ringwire.SlotConfig(classes=(ringwire.SlotClass(1 << 20, 32),))  # a 32 MiB budget


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _sha(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        x = x.contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()


_SENDER = """
import hashlib, sys, numpy as np, torch, ringwire
mib, count, budget = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
slots = ringwire.SlotConfig(classes=(ringwire.SlotClass(1 << 20, budget),))
ch = ringwire.connect_sync(sys.argv[1], slots=slots)
rng = np.random.default_rng(7)
receipts = []
for i in range(count):
    x = rng.integers(0, 256, (mib << 20) // 4, np.uint32)
    item = x if i % 2 else torch.from_numpy(x).view(torch.float32)
    sha = hashlib.sha256(x.tobytes()).hexdigest()
    receipts.append(ch.send_tracked({"i": i, "x": item, "sha": sha}, timeout=30))
ch.send("sent", timeout=30)
if ch.receive(timeout=30) == "dropped":
    for r in receipts:
        r.wait(timeout=30)
    pool = ch._core.pool
    ch.send({"nixl_sent": pool.nixl_sent, "in_use": pool.in_use}, timeout=30)
    assert ch.receive(timeout=30) == "bye"
ch.close()
"""


async def _accept(lst: Any, proc: subprocess.Popen[bytes]) -> Channel:
    with anyio.fail_after(60):
        while True:
            with anyio.move_on_after(0.5):
                return await lst.accept()  # type: ignore[no-any-return]
            assert proc.poll() is None, "the child died before connecting"


def _spawn(code: str, *args: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)])


async def test_cpu_tensors_cross_checksummed_with_receipts() -> None:
    async with ringwire.listen("tcp://127.0.0.1:0", slots=SLOTS) as lst:
        proc = _spawn(_SENDER, lst.path, 4, 6, 32)
        try:
            conn = await _accept(lst, proc)
            assert conn._core.transport.holder is not None  # both offered NIXL
            got = []
            with anyio.fail_after(60):
                for i in range(6):
                    rec = await conn.receive()
                    assert rec["i"] == i and _sha(rec["x"]) == rec["sha"]
                    assert isinstance(rec["x"], np.ndarray if i % 2 else torch.Tensor)
                    got.append(rec)
                assert await conn.receive() == "sent"
                assert conn._core.peer.nixl_received == 6
                mirror = conn._core.transport.holder.mirrors[0]
                x = got[0]["x"].numpy()
                assert mirror.base <= x.__array_interface__["data"][0] < mirror.end
                del got, rec, x
                gc.collect()
                await conn.send("dropped")
                stats = await conn.receive()  # the sender's receipts all completed
            assert stats == {"nixl_sent": 6, "in_use": 0}
            await conn.send("bye")
            with anyio.fail_after(30):
                while proc.poll() is None:
                    await anyio.sleep(0.05)
            assert proc.returncode == 0
        finally:
            proc.kill()
            proc.wait()


_HOLDER = """
import sys, time, ringwire
ch = ringwire.connect_sync(sys.argv[1])
held = [ch.receive(timeout=30) for _ in range(int(sys.argv[2]))]
ch.send("holding", timeout=30)
time.sleep(60)
"""


async def test_the_budget_bounds_what_is_in_flight_and_a_dead_peer_gives_it_back() -> None:
    """The receiver keeps every array: the sender's budget runs out (policy "error"
    raises, "wait" waits); kill -9 of the receiver ends the wait with
    BrokenResourceError, the in-flight buffers are reclaimed and, once the connection
    is closed, the registrations released."""
    small = ringwire.SlotConfig(classes=(ringwire.SlotClass(1 << 20, 4),))  # 4 MiB
    with anyio.fail_after(10):
        while nixl.registrations():  # earlier connections of this process (lingering)
            await anyio.sleep(0.01)
    async with ringwire.listen("tcp://127.0.0.1:0", slots=small) as lst:
        proc = _spawn(_HOLDER, lst.path, 4)
        try:
            conn = await _accept(lst, proc)
            assert nixl.registrations() == 2  # our send arena and our mirror
            x = np.ones(1 << 20, np.uint8)
            for _ in range(4):
                await conn.send(x)
            with anyio.fail_after(30):
                assert await conn.receive() == "holding"
            assert conn._core.pool.nixl_sent == 4
            with pytest.raises(ringwire.SlotsExhausted):
                await conn.send(x, slot_policy="error")
            t0 = time.monotonic()

            async def kill_soon() -> None:
                await anyio.sleep(0.3)
                proc.kill()

            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_soon)
                with pytest.raises(anyio.BrokenResourceError):
                    with anyio.fail_after(10):
                        await conn.send(x)  # policy "wait": waits for a release
            assert time.monotonic() - t0 < 5
            assert conn.statistics().slot_bytes_in_use == 0  # reclaimed
            await conn.aclose()
            with anyio.fail_after(5):
                while nixl.registrations():
                    await anyio.sleep(0.01)
        finally:
            proc.kill()
            proc.wait()


_STREAMER = """
import sys, numpy as np, ringwire
slots = ringwire.SlotConfig(classes=(ringwire.SlotClass(1 << 20, 64),))
ch = ringwire.connect_sync(sys.argv[1], slots=slots)
x = np.ones(8 << 20, np.uint8)
while True:
    ch.send(x, timeout=30)
"""


async def test_a_sender_killed_mid_stream_breaks_the_receiver() -> None:
    async with ringwire.listen("tcp://127.0.0.1:0") as lst:
        proc = _spawn(_STREAMER, lst.path)
        try:
            conn = await _accept(lst, proc)
            with anyio.fail_after(30):
                for _ in range(3):
                    assert int((await conn.receive())[:16].sum()) == 16
            proc.kill()
            with pytest.raises(anyio.BrokenResourceError):
                with anyio.fail_after(10):
                    while True:  # what had arrived, then the break
                        await conn.receive()
            assert conn._core.peer.nixl_received >= 3
            await conn.aclose()
            with anyio.fail_after(5):
                while nixl.registrations():
                    await anyio.sleep(0.01)
        finally:
            proc.kill()
            proc.wait()


_CUDA_SENDER = """
import sys, torch, ringwire
ch = ringwire.connect_sync(sys.argv[1])
t = torch.arange(1 << 22, dtype=torch.float32, device="cuda:0")
r = ch.send_tracked({"t": t, "sum": float(t.sum())}, timeout=30)
r.wait(timeout=30)
ch.send(ch._core.pool.vram_sent, timeout=30)
ch.close()
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the VRAM path")
async def test_a_cuda_tensor_lands_in_the_receivers_gpu_pool() -> None:  # pragma: no cover
    async with ringwire.listen("tcp://127.0.0.1:0") as lst:
        proc = _spawn(_CUDA_SENDER, lst.path)
        try:
            conn = await _accept(lst, proc)
            with anyio.fail_after(60):
                rec = await conn.receive()
                assert rec["t"].device.type == "cuda"
                assert float(rec["t"].sum()) == rec["sum"]
                mirror = conn._core.transport.holder.mirrors[1]
                assert mirror.base <= rec["t"].data_ptr() < mirror.end
                del rec
                gc.collect()
                await conn.send("tick")  # a safe point: the release goes out
                assert await conn.receive() == 1
        finally:
            proc.kill()
            proc.wait()
