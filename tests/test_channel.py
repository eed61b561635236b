"""Connections: async and sync endpoints, listeners, pairs, faults, across processes."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import random
import signal
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest

from ringwire._conn.async_channel import Channel
from ringwire._conn.connect import connect, connect_sync
from ringwire._conn.listener import SyncListener, listen
from ringwire._conn.pair import PairEnd, pair
from ringwire._conn.statistics import ChannelStatistics
from ringwire._conn.sync_channel import SyncChannel
from ringwire._errors import (
    DecodeError,
    FrameTooLarge,
    HandshakeError,
    PeerCredentialsError,
    ProtocolError,
    RingCorrupted,
    SharedMemoryFull,
)
from ringwire._shm.segment import SHM_DIR, Segment
from ringwire._shm.slotconfig import SlotConfig
from ringwire._wire.control import Hello, RingSpec, SegmentSpec, encode_message
from ringwire._wire.record import Record
from ringwire._wire.ring import init_ring, ring_size
from ringwire._wire.slotlayout import SlotClass

from anyio import (  # isort: skip
    BrokenResourceError,
    ClosedResourceError,
    EndOfStream,
    WouldBlock,
)

SPAWN = mp.get_context("spawn")
SMALL = 4096  # a small ring, to exercise wraparound and backpressure


@pytest.fixture(autouse=True)
def small_slot_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections made here get a small tensor-slot pool by default: the 81 MiB
    default pool costs ~30 ms of fallocate + unmap per side per connection, and these
    tests make hundreds of connections (tests/test_slots.py covers slots, and the
    default pool).  Spawned children keep the real default."""
    monkeypatch.setattr(
        "ringwire._shm.slotconfig.default_slots", SlotConfig(classes=(SlotClass(64 * 1024, 4),))
    )


def _uvloop_param() -> Any:
    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover
        return pytest.param(
            ("asyncio", {"use_uvloop": True}),
            id="uvloop",
            marks=pytest.mark.skip(reason="uvloop not installed"),
        )
    return pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")


@pytest.fixture(
    params=[pytest.param("asyncio", id="asyncio"), _uvloop_param(), pytest.param("trio", id="trio")]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


@contextlib.contextmanager
def spawned(target: Any, *args: Any, ctx: Any = SPAWN) -> Iterator[Any]:
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    try:
        yield p
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


class Point(Record):
    x: int
    y: float
    tag: str = ""


class Other(msgspec.Struct):
    a: int


async def connected_pair(**kw: Any) -> tuple[Channel, Channel]:
    a, b = pair(**{k: v for k, v in kw.items() if k == "capacity"})
    opts = {k: v for k, v in kw.items() if k != "capacity"}
    ca = cb = None
    async with anyio.create_task_group() as tg:

        async def conn_b() -> None:
            nonlocal cb
            cb = await b.connect(**opts)

        tg.start_soon(conn_b)
        ca = await a.connect(**opts)
    assert ca is not None and cb is not None
    return ca, cb


def sync_pair(**kw: Any) -> tuple[SyncChannel, SyncChannel]:
    a, b = pair(**{k: v for k, v in kw.items() if k == "capacity"})
    opts = {k: v for k, v in kw.items() if k != "capacity"}
    out: list[SyncChannel] = []
    t = threading.Thread(target=lambda: out.append(b.connect_sync(**opts)))
    t.start()
    ca = a.connect_sync(**opts)
    t.join()
    return ca, out[0]


def shm_names(*pids: int) -> set[str]:
    """ringwire names in /dev/shm created by ``pids`` (default: this process).

    Other processes on the machine (a concurrent test run, a benchmark) may come and
    go in /dev/shm meanwhile: only look at our own."""
    prefixes = tuple(f"rw.{pid}." for pid in (pids or (os.getpid(),)))
    return {n for n in os.listdir(SHM_DIR) if n.startswith(prefixes)}


# ======================================================================================
# in-process tests (every backend)
# ======================================================================================


@pytest.mark.anyio
async def test_pair_duplex_and_names_gone():
    before = shm_names()
    a, b = await connected_pair()
    async with a, b:
        assert shm_names() == before  # unlinked as soon as both attached
        await a.send({"q": 1})
        assert await b.receive() == {"q": 1}
        await b.send([1, "two", b"three", None])
        assert await a.receive() == [1, "two", b"three", None]
        arr = np.arange(12, dtype=np.float32).reshape(3, 4)
        await a.send(arr)
        got = await b.receive()
        np.testing.assert_array_equal(got, arr)
        assert got.flags.writeable  # a copy, not a view of the ring
        assert a.peer_pid == b.peer_pid == os.getpid()
        assert "open" in repr(a)


@pytest.mark.anyio
async def test_request_response_concurrent_tasks():
    a, b = await connected_pair(capacity=SMALL, spin_us=0)
    async with a, b:

        async def server() -> None:
            async for req in b:
                await b.send(req * 2)
            await b.send_eof()  # echo the half-close

        async with anyio.create_task_group() as tg:
            tg.start_soon(server)
            for i in range(300):
                await a.send(i)
                assert await a.receive() == 2 * i
            await a.send_eof()
            with pytest.raises(EndOfStream):
                await a.receive()
            with pytest.raises(ClosedResourceError):
                await a.send(1)  # after send_eof


@pytest.mark.anyio
async def test_ordering_wraparound_and_backpressure():
    a, b = await connected_pair(capacity=SMALL, spin_us=0)
    n = 2000
    async with a, b:

        async def producer() -> None:
            for i in range(n):
                await a.send({"i": i, "pad": "x" * (i % 97)})

        async with anyio.create_task_group() as tg:
            tg.start_soon(producer)
            for i in range(n):
                rec = await b.receive()
                assert rec["i"] == i
                if i % 250 == 0:
                    await anyio.sleep(0.01)  # let the ring fill up
        assert a.statistics().send_parks > 0


@pytest.mark.anyio
async def test_many_tasks_on_one_channel_lose_no_wakeup():
    a, b = await connected_pair(capacity=SMALL, spin_us=0)
    rng = random.Random(5)
    n = 600
    got: list[int] = []
    async with a, b:

        async def receiver() -> None:
            while True:
                try:
                    got.append(await b.receive())
                except EndOfStream:
                    return
                if rng.random() < 0.1:
                    await anyio.sleep(0.0005)

        async def sender(k: int) -> None:
            for i in range(k, n, 3):
                await a.send(i)
                if rng.random() < 0.1:
                    await anyio.sleep(0.0005)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(receiver)
                async with anyio.create_task_group() as senders:
                    for k in range(3):
                        senders.start_soon(sender, k)
                await a.send_eof()
    assert sorted(got) == list(range(n))


@pytest.mark.anyio
async def test_batches():
    a, b = await connected_pair(capacity=SMALL)
    async with a, b:
        items = [{"n": i} for i in range(1000)]  # far more than the ring holds

        async def consume() -> list[Any]:
            got: list[Any] = []
            while len(got) < len(items):
                got += await b.receive_many(64)
            return got

        result: list[Any] = []

        async def run_consumer() -> None:
            result.extend(await consume())

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_consumer)
            await a.send_many(items)
        assert result == items
        with pytest.raises(WouldBlock):
            b.receive_many_nowait()
        await a.send_many([])
        await a.send_many([1, 2, 3])
        await anyio.sleep(0)
        assert b.receive_many_nowait(2) == [1, 2]
        assert await b.receive_many() == [3]
        with pytest.raises(ValueError):
            await b.receive_many(0)


@pytest.mark.anyio
async def test_typed_receive():
    a, b = await connected_pair(type=Point)
    async with a, b:
        await a.send(Point(x=1, y=2.5, tag="p"))
        got = await b.receive()
        assert got == Point(x=1, y=2.5, tag="p")
        await a.send(Other(a=3))
        assert await b.receive(type=Other) == Other(a=3)
        await a.send([Point(x=1, y=1.0)])
        assert await b.receive(type=list[Point]) == [Point(x=1, y=1.0)]
    a, b = await connected_pair()
    async with a, b:
        await a.send_many([Point(x=i, y=0.0) for i in range(3)])
        await anyio.sleep(0)
        assert b.receive_many_nowait(type=Point) == [Point(x=i, y=0.0) for i in range(3)]
        await a.send("not a point")
        await anyio.sleep(0)
        with pytest.raises(DecodeError):
            b.receive_nowait(type=Point)
        # the bad record was consumed; the connection goes on
        await a.send(Point(x=9, y=9.0))
        assert await b.receive(type=Point) == Point(x=9, y=9.0)


@pytest.mark.anyio
async def test_receive_many_stops_before_bad_record():
    a, b = await connected_pair()
    async with a, b:
        await a.send_many([1, 2, "three", 4])
        await anyio.sleep(0)
        assert b.receive_many_nowait(type=int) == [1, 2]
        with pytest.raises(DecodeError):
            b.receive_many_nowait(type=int)
        assert b.receive_many_nowait(type=int) == [4]


@pytest.mark.anyio
async def test_nowait():
    a, b = await connected_pair(capacity=SMALL)
    async with a, b:
        with pytest.raises(WouldBlock):
            b.receive_nowait()
        n = 0
        with pytest.raises(WouldBlock):
            while True:
                a.send_nowait(b"x" * 100)
                n += 1
        assert 0 < n <= SMALL // 104
        assert a.statistics().send_fill > SMALL - 200
        for _ in range(n):
            assert b.receive_nowait() == b"x" * 100
        a.send_nowait(1)


@pytest.mark.anyio
async def test_too_large_record_points_to_slots():
    a, b = await connected_pair(capacity=SMALL)
    async with a, b:
        with pytest.raises(FrameTooLarge, match="slots"):
            await a.send(b"x" * SMALL)
        with pytest.raises(FrameTooLarge):
            await a.send_many([1, b"x" * SMALL])
        await a.send("still fine")
        assert await b.receive() == "still fine"
        with pytest.raises(WouldBlock):
            b.receive_nowait()  # nothing of the refused batch was sent


@pytest.mark.anyio
async def test_clean_close_is_end_of_stream():
    a, b = await connected_pair()
    for i in range(5):
        await a.send(i)
    await a.aclose()
    await a.aclose()  # idempotent
    assert [x async for x in b] == [0, 1, 2, 3, 4]
    with pytest.raises(EndOfStream):
        await b.receive()
    with pytest.raises(EndOfStream):
        b.receive_nowait()
    with pytest.raises(BrokenResourceError):
        await b.send(1)
    with pytest.raises(ClosedResourceError):
        await a.send(1)
    with pytest.raises(ClosedResourceError):
        await a.receive()
    await b.aclose()
    assert "closed" in repr(b)


@pytest.mark.anyio
async def test_close_wakes_waiting_tasks():
    a, b = await connected_pair(spin_us=0)
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await b.receive()
        except BaseException as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        tg.start_soon(waiter)  # two waiters: one polls, one waits for it
        await anyio.sleep(0.05)
        await b.aclose()
    assert len(errors) == 2 and all(isinstance(e, ClosedResourceError) for e in errors)
    with pytest.raises(EndOfStream):
        await a.receive()
    await a.aclose()


@pytest.mark.anyio
async def test_peer_close_wakes_sender_and_receiver():
    a, b = await connected_pair(capacity=SMALL, spin_us=0)
    errors: list[BaseException] = []

    async def blocked_send() -> None:
        try:
            while True:
                await a.send(b"y" * 500)
        except BaseException as exc:
            errors.append(exc)

    async def blocked_receive() -> None:
        try:
            await a.receive()
        except BaseException as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(blocked_send)
        tg.start_soon(blocked_receive)
        await anyio.sleep(0.05)
        await b.aclose()
    assert sorted(type(e).__name__ for e in errors) == ["BrokenResourceError", "EndOfStream"]
    await a.aclose()


@pytest.mark.anyio
async def test_cancelled_send_writes_nothing():
    a, b = await connected_pair(capacity=SMALL, spin_us=0)
    async with a, b:
        n = 0
        while True:
            try:
                a.send_nowait(n)
                n += 1
            except WouldBlock:
                break
        with anyio.move_on_after(0.05) as scope:
            await a.send("late")
        assert scope.cancelled_caught
        got = []
        while True:
            try:
                got.append(b.receive_nowait())
            except WouldBlock:
                break
        assert got == list(range(n))
        with anyio.move_on_after(0.05) as scope:
            await b.receive()
        assert scope.cancelled_caught
        await a.send("after")
        assert await b.receive() == "after"


@pytest.mark.anyio
async def test_statistics():
    a, b = await connected_pair(spin_us=0)
    async with a, b:
        async with anyio.create_task_group() as tg:

            async def recv() -> None:
                await b.receive()

            tg.start_soon(recv)
            await anyio.sleep(0.02)  # b parks
            await a.send(b"abc")
        s = a.statistics()
        assert isinstance(s, ChannelStatistics)
        assert s.records_sent == 1 and s.bytes_sent == 5  # msgpack bin8: 2 + 3 bytes
        assert s.doorbells_sent == 1
        t = b.statistics()
        assert t.records_received == 1 and t.receive_parks >= 1 and t.doorbells_received >= 1
        assert t.receive_capacity == s.send_capacity
    assert a.statistics().send_fill == 0  # still works after close


@pytest.mark.anyio
async def test_parked_receiver_uses_no_cpu():
    a, b = await connected_pair()  # default spin budget
    async with a, b:
        async with anyio.create_task_group() as tg:

            async def recv() -> None:
                assert await b.receive() == "wake"

            tg.start_soon(recv)
            await anyio.sleep(0.05)
            c0, t0 = time.process_time(), time.perf_counter()
            await anyio.sleep(0.5)
            cpu, wall = time.process_time() - c0, time.perf_counter() - t0
            await a.send("wake")
        assert cpu / wall < 0.01, (cpu, wall)


@pytest.mark.anyio
async def test_corrupt_frame_breaks_only_that_connection():
    a, b = await connected_pair()
    async with a, b:
        await a.send("good")
        # scribble a bad length into the next frame and publish it
        tx = a._core.tx
        pos = tx._tail & tx._mask
        tx._d32[pos >> 2] = 0x7FFFFFF0
        tx._tail += 8
        tx._q[8] = tx._tail
        assert await b.receive() == "good"
        with pytest.raises(BrokenResourceError) as ei:
            await b.receive()
        assert isinstance(ei.value.__cause__, RingCorrupted)
        with pytest.raises(BrokenResourceError):
            await b.send(1)
        with pytest.raises(BrokenResourceError):
            await a.receive()  # the peer noticed too


@pytest.mark.anyio
async def test_garbage_on_control_socket_breaks_connection():
    a, b = await connected_pair(spin_us=0)
    async with a, b:
        a._core.transport._sock.send(b"garbage")
        with pytest.raises(BrokenResourceError) as ei:
            await b.receive()
        assert isinstance(ei.value.__cause__, ProtocolError)


@pytest.mark.anyio
async def test_listener_request_response_and_cleanup(tmp_path):
    path = tmp_path / "l.sock"
    async with listen(path, spin_us=0) as lst:
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        async with await connect(path) as c:
            conn = await lst.accept()
            await c.send("ping")
            got_conn, rec = await lst.receive()
            assert got_conn is conn and rec == "ping"
            await conn.send("pong")
            assert await c.receive() == "pong"
            assert lst.statistics().open_connections == 1
        # the client closed: the fan-in drops it
        with anyio.move_on_after(0.1):
            await lst.receive()
        assert lst.statistics().ended == 1
        assert "Listener" in repr(lst)
    assert not path.exists()
    with pytest.raises(ClosedResourceError):
        await lst.receive()
    with pytest.raises(ClosedResourceError):
        await lst.accept()


@pytest.mark.anyio
async def test_cancelled_server_task_cleans_up(tmp_path):
    """A server whose task is cancelled mid-receive (the usual way a server stops)
    exits its listener cleanly: no cancel-scope error, no socket file, no segment."""
    path = tmp_path / "c.sock"

    async def server() -> None:
        async with listen(path) as lst:
            async for conn, rec in lst:
                await conn.send({"echo": rec})

    async with anyio.create_task_group() as tg:
        tg.start_soon(server)
        with anyio.fail_after(5):
            while not path.exists():
                await anyio.sleep(0.01)
        async with await connect(path) as c:
            await c.send(1)
            assert await c.receive() == {"echo": 1}
            tg.cancel_scope.cancel()
    assert not path.exists()


@pytest.mark.anyio
async def test_fan_in_is_fair_and_fifo(tmp_path):
    path = tmp_path / "f.sock"
    async with listen(path) as lst:
        clients = [await connect(path) for _ in range(3)]
        try:
            for _ in range(3):
                await lst.accept()
            for k, c in enumerate(clients):
                await c.send_many([(k, i) for i in range(20)])
            order = [await lst.receive() for _ in range(60)]
            recs = [r for _, r in order]
            for k in range(3):  # FIFO per producer
                assert [i for kk, i in recs if kk == k] == list(range(20))
            for j in range(0, 60, 3):  # round-robin: one from each per round
                assert {kk for kk, _ in recs[j : j + 3]} == {0, 1, 2}
            with pytest.raises(WouldBlock):
                lst.receive_nowait()
            await clients[1].send("x")
            await anyio.sleep(0)
            conn, rec = lst.receive_nowait()
            assert rec == "x" and conn in lst.connections
        finally:
            for c in clients:
                await c.aclose()


@pytest.mark.anyio
async def test_listener_receive_many_batches_fairly_and_in_order(tmp_path):
    path = tmp_path / "m.sock"
    async with listen(path) as lst:
        clients = [await connect(path) for _ in range(3)]
        try:
            for _ in range(3):
                await lst.accept()
            with pytest.raises(ValueError):
                await lst.receive_many(0)
            for k, c in enumerate(clients):
                await c.send_many([(k, i) for i in range(100)])
            first = await lst.receive_many(30)  # a share of 10 from each
            assert len(first) == 30
            assert sorted(Counter(r[0] for _, r in first).values()) == [10, 10, 10]
            got = list(first)
            while len(got) < 300:
                got += await lst.receive_many(64)
            for k in range(3):  # FIFO per producer, nothing lost or repeated
                assert [r[1] for conn, r in got if r[0] == k] == list(range(100))
                assert {conn for conn, r in got if r[0] == k} == {lst.connections[k]}

            async def late() -> None:
                await anyio.sleep(0.05)
                await clients[2].send("late")

            async with anyio.create_task_group() as tg:
                tg.start_soon(late)
                with anyio.fail_after(5):
                    (conn, rec), = await lst.receive_many()  # parks, then wakes
            assert rec == "late" and conn is lst.connections[2]
            await clients[0].aclose()
            await clients[1].send("still here")
            with anyio.fail_after(5):
                batch = await lst.receive_many()
            assert [rec for _, rec in batch] == ["still here"]
            assert len(lst.connections) == 2
        finally:
            for c in clients:
                await c.aclose()


@pytest.mark.anyio
async def test_listener_survives_bad_clients(tmp_path):
    path = str(tmp_path / "b.sock")
    before = shm_names()
    async with listen(path, handshake_timeout=0.5, max_capacity=1 << 16) as lst:

        async def raw(data: bytes, close: bool = True) -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            if data:
                s.sendall(data)
            if close:
                await anyio.sleep(0.02)
                s.close()
            return s

        await raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # garbage
        await raw(struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")  # bad msgpack
        await raw(b"")  # connect and close at once
        silent = await raw(b"", close=False)  # never speaks: times out
        bad_version = Hello(
            versions=[99],
            pid=os.getpid(),
            segments=[SegmentSpec("/rw.1.0123456789ab", 8192)],
            c2s=RingSpec(0, 0, 1024),
            s2c=RingSpec(0, 2048, 1024),
        )
        s = await raw(encode_message(bad_version), close=False)
        await anyio.sleep(0.05)
        assert b"version" in s.recv(1000)  # a Reject with a reason
        s.close()
        with pytest.raises(HandshakeError, match="limit"):
            await connect(path, capacity=1 << 17)  # over the listener's max
        # a client that dies after Hello: the listener removes its segment names
        seg = Segment.create(2 * ring_size(1024))
        init_ring(seg.buf, 0, 1024)
        init_ring(seg.buf, ring_size(1024), 1024)
        hello = Hello(
            versions=[1],
            pid=os.getpid(),
            segments=[SegmentSpec(seg.name, seg.size)],
            c2s=RingSpec(0, 0, 1024),
            s2c=RingSpec(0, ring_size(1024), 1024),
        )
        s = await raw(encode_message(hello), close=False)
        await anyio.sleep(0.05)
        s.close()  # "crash" before Ready
        with anyio.fail_after(2):
            while os.path.exists(SHM_DIR + seg.name):
                await anyio.sleep(0.01)
        seg.close()
        # the listener still works
        async with await connect(path, capacity=SMALL) as c:
            await c.send("hi")
            conn, rec = await lst.receive()
            assert rec == "hi"
        await anyio.sleep(0.6)
        silent.close()
        assert lst.statistics().refused >= 6
        assert lst.statistics().accepted == 1
    assert shm_names() == before


@pytest.mark.anyio
async def test_listener_refuses_other_uid(tmp_path, monkeypatch):
    import ringwire._conn.listener as ch

    real = ch.check_peer

    def server_side_sees_stranger(sock: socket.socket) -> int:
        if sock.getsockname():  # only the listener's accepted sockets have a name
            raise PeerCredentialsError("refusing a peer running as uid 4242")
        return real(sock)

    monkeypatch.setattr(ch, "check_peer", server_side_sees_stranger)
    path = tmp_path / "u.sock"
    async with listen(path) as lst:
        with pytest.raises(HandshakeError):
            await connect(path, timeout=2)
        assert lst.statistics().refused == 1


@pytest.mark.anyio
async def test_connect_with_full_dev_shm(tmp_path, monkeypatch):
    import errno

    path = tmp_path / "full.sock"
    async with listen(path) as lst:

        def full(fd: int, off: int, size: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        with monkeypatch.context() as m:
            m.setattr(os, "posix_fallocate", full)
            with pytest.raises(SharedMemoryFull, match="/dev/shm"):
                await connect(path)
        async with await connect(path) as c:
            await c.send(1)
            assert (await lst.receive())[1] == 1


@pytest.mark.anyio
async def test_connect_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        await connect(tmp_path / "nobody")
    with pytest.raises(ValueError):
        await connect(tmp_path / "x", capacity=1000)


# ======================================================================================
# pairs and the blocking API (no event loop)
# ======================================================================================


def test_sync_pair_roundtrip_and_timeouts():
    a, b = sync_pair(capacity=SMALL, spin_us=0)
    with a, b:
        a.send({"k": 1})
        assert b.receive(timeout=1) == {"k": 1}
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            b.receive(timeout=0.05)
        assert 0.04 < time.monotonic() - t0 < 1
        with pytest.raises(WouldBlock):
            b.receive_nowait()
        n = 0
        with pytest.raises(TimeoutError):
            while True:
                a.send(b"z" * 200, timeout=0.05)
                n += 1
        with pytest.raises(WouldBlock):
            a.send_nowait(b"z" * 200)
        assert b.receive_many(1000, timeout=1) == [b"z" * 200] * n
        a.send_many(range(5))
        assert b.receive_many(timeout=1) == [0, 1, 2, 3, 4]
        a.send_eof()
        assert list(b) == []
        with pytest.raises(EndOfStream):
            b.receive()
        b.send("back")
        assert a.receive_nowait() == "back"


def test_sync_threads_and_close_from_another_thread():
    a, b = sync_pair(spin_us=0)
    box: list[BaseException] = []

    def blocked() -> None:
        try:
            b.receive()
        except BaseException as exc:
            box.append(exc)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.05)
    b.close()
    t.join(2)
    assert not t.is_alive() and isinstance(box[0], ClosedResourceError)
    with pytest.raises(EndOfStream):
        a.receive(timeout=1)
    with pytest.raises(BrokenResourceError):
        a.send(1)
    a.close()
    with pytest.raises(ClosedResourceError):
        a.receive()


def test_sync_many_threads_one_channel():
    a, b = sync_pair(capacity=SMALL, spin_us=5)
    n, threads = 500, 4
    with a, b:

        def producer(k: int) -> None:
            for i in range(n):
                a.send((k, i))

        ts = [threading.Thread(target=producer, args=(k,)) for k in range(threads)]
        for t in ts:
            t.start()
        got = [b.receive(timeout=5) for _ in range(n * threads)]
        for t in ts:
            t.join()
        for k in range(threads):
            assert [i for kk, i in got if kk == k] == list(range(n))


def test_sync_listener(tmp_path):
    path = tmp_path / "s.sock"
    with SyncListener(path, spin_us=0) as lst:
        with pytest.raises(TimeoutError):
            lst.accept(timeout=0.05)
        box: list[SyncChannel] = []
        t = threading.Thread(target=lambda: box.append(connect_sync(path)))
        t.start()
        server = lst.accept(timeout=5)
        t.join()
        with server, box[0] as client:
            client.send("hello")
            assert server.receive(timeout=1) == "hello"
    assert not path.exists()
    with pytest.raises(ClosedResourceError):
        lst.accept()


def test_pair_end_misuse():
    a, b = pair()
    try:
        with pytest.raises(TypeError, match="Process"):
            pickle.dumps(b)
        assert "open" in repr(a)
    finally:
        a.close()
        b.close()
    with pytest.raises(ClosedResourceError):
        a.connect_sync()
    with pytest.raises(HandshakeError):
        c, d = pair()
        d.close()
        try:
            c.connect_sync(timeout=2)
        finally:
            c.close()


def test_unclosed_endpoint_warns():
    a, b = sync_pair()
    with pytest.warns(ResourceWarning, match="unclosed"):
        del a
        gc.collect()
    with pytest.raises(BrokenResourceError):
        b.receive(timeout=1)  # dropped without a clean close: the peer sees a crash
    b.close()
    c, d = pair()
    with pytest.warns(ResourceWarning, match="unused"):
        del c
        gc.collect()
    d.close()


# ======================================================================================
# across processes
# ======================================================================================


def child_echo(end: PairEnd, backend: str) -> None:
    async def main() -> None:
        async with await end.connect(spin_us=0) as ch:
            async for x in ch:
                await ch.send(x)

    anyio.run(main, backend=backend)


def child_echo_sync(end: PairEnd) -> None:
    with end.connect_sync(spin_us=5) as ch:
        for x in ch:
            ch.send(x)


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_pair_spawn_request_response(backend):
    a, b = pair()
    with spawned(child_echo, b, backend) as p:

        async def main() -> None:
            async with await a.connect() as ch:
                assert ch.peer_pid == p.pid
                for i in range(200):
                    await ch.send(Point(x=i, y=i / 2))
                    assert await ch.receive(type=Point) == Point(x=i, y=i / 2)

        anyio.run(main, backend=backend)
    assert p.exitcode == 0


@pytest.mark.multiprocess
def test_pair_fork():
    if sys.version_info >= (3, 12) and threading.active_count() > 1:  # pragma: no cover
        pytest.skip("fork of a threaded process")
    a, b = pair()
    with spawned(child_echo_sync, b, ctx=mp.get_context("fork")) as p:
        with a.connect_sync() as ch:
            assert ch.peer_pid == p.pid
            ch.send_many(list(range(100)))
            assert [ch.receive(timeout=10) for _ in range(100)] == list(range(100))
    assert p.exitcode == 0


def child_pingpong(end: PairEnd, seed: int, n: int) -> None:
    rng = random.Random(seed)
    with end.connect_sync(spin_us=rng.choice([0, 2])) as ch:
        for _ in range(n):
            x = ch.receive(timeout=10)
            if rng.random() < 0.2:
                time.sleep(rng.random() * 0.0005)
            ch.send(x + 1, timeout=10)


@pytest.mark.multiprocess
def test_no_lost_wakeup_long_pingpong():
    n = 3000
    a, b = pair(capacity=SMALL)
    with spawned(child_pingpong, b, 7, n) as p:
        rng = random.Random(11)

        async def main() -> None:
            async with await a.connect(spin_us=0) as ch:
                x = 0
                with anyio.fail_after(60):
                    for _ in range(n):
                        if rng.random() < 0.2:
                            await anyio.sleep(rng.random() * 0.0005)
                        await ch.send(x)
                        x = await ch.receive()
                assert x == n
                assert ch.statistics().receive_parks > 0

        anyio.run(main)
    assert p.exitcode == 0


def child_stream(end: PairEnd, n: int, batch: int) -> None:
    async def main() -> None:
        async with await end.connect() as ch:
            i = 0
            while i < n:
                k = min(batch, n - i)
                if k == 1:
                    await ch.send({"i": i, "pad": b"p" * (i % 200)})
                else:
                    await ch.send_many([{"i": j, "pad": b"p" * (j % 200)} for j in range(i, i + k)])
                i += k
            stats = ch.statistics()
            await ch.send({"parks": stats.send_parks})

    anyio.run(main)


@pytest.mark.multiprocess
@pytest.mark.parametrize("batch", [1, 50])
def test_ordering_and_backpressure_across_processes(batch):
    n = 20000
    a, b = pair(capacity=SMALL)
    with spawned(child_stream, b, n, batch) as p:

        async def main() -> None:
            async with await a.connect() as ch:
                i = 0
                while i < n:
                    for rec in await ch.receive_many(min(100, n - i)):
                        assert rec["i"] == i
                        i += 1
                    if i % 5000 < 100:
                        await anyio.sleep(0.01)  # a slow consumer: the producer must wait
                last = await ch.receive()
                assert last["parks"] > 0
                with pytest.raises(EndOfStream):
                    await ch.receive()

        anyio.run(main)
    assert p.exitcode == 0


def child_client(path: str, k: int, n: int, use_sync: bool) -> None:
    if use_sync:
        with connect_sync(path) as ch:
            for i in range(n):
                ch.send((k, i))
                assert ch.receive(timeout=10) == [k, i, "ok"]
        return

    async def main() -> None:
        async with await connect(path) as ch:
            for i in range(n):
                await ch.send((k, i))
                assert await ch.receive() == [k, i, "ok"]

    anyio.run(main)


@pytest.mark.multiprocess
def test_many_producers_request_response(tmp_path):
    path = str(tmp_path / "m.sock")
    n, k = 300, 3

    async def main() -> None:
        async with listen(path) as lst:
            with (
                spawned(child_client, path, 0, n, False) as p0,
                spawned(child_client, path, 1, n, True) as p1,
                spawned(child_client, path, 2, n, False) as p2,
            ):
                seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
                with anyio.fail_after(60):
                    for _ in range(n * k):
                        conn, (kk, i) = await lst.receive()
                        seen[kk].append(i)
                        await conn.send([kk, i, "ok"])
                for kk in range(k):
                    assert seen[kk] == list(range(n))
                for proc in (p0, p1, p2):
                    await anyio.to_thread.run_sync(proc.join, 10)
                    assert proc.exitcode == 0

    anyio.run(main)


def child_prefill(path: str, k: int, n: int, ready: Any, done: Any) -> None:
    with connect_sync(path) as ch:
        ch.send_many([(k, i) for i in range(n)])
        ready.set()
        done.wait(30)


@pytest.mark.multiprocess
def test_fan_in_fairness_across_processes(tmp_path):
    path = str(tmp_path / "fair.sock")
    n, k = 50, 3
    events = [SPAWN.Event() for _ in range(k)]
    done = SPAWN.Event()

    async def main() -> None:
        async with listen(path) as lst:
            with contextlib.ExitStack() as stack:
                for kk in range(k):
                    stack.enter_context(spawned(child_prefill, path, kk, n, events[kk], done))
                for ev in events:
                    assert await anyio.to_thread.run_sync(ev.wait, 30)
                recs = [(await lst.receive())[1] for _ in range(n * k)]
                done.set()
            for kk in range(k):
                assert [i for c, i in recs if c == kk] == list(range(n))
            for j in range(0, n * k, k):
                assert {c for c, _ in recs[j : j + k]} == set(range(k))

    anyio.run(main)


def child_publish_then_hang(end: PairEnd, n: int, ready: Any) -> None:
    with end.connect_sync() as ch:
        ch.send_many(list(range(n)))
        ready.set()
        time.sleep(60)


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_kill_producer_drains_then_broken_fast(backend):
    n = 500
    a, b = pair()
    ready = SPAWN.Event()
    with spawned(child_publish_then_hang, b, n, ready) as p:

        async def main() -> None:
            async with await a.connect(spin_us=0) as ch:
                assert await anyio.to_thread.run_sync(ready.wait, 30)
                got = await ch.receive_many(n // 2)  # some before, the rest after the death
                os.kill(p.pid, signal.SIGKILL)
                while len(got) < n:
                    got += await ch.receive_many()
                assert got == list(range(n))
                t0 = time.perf_counter()
                with pytest.raises(BrokenResourceError):
                    with anyio.fail_after(5):
                        await ch.receive()
                assert time.perf_counter() - t0 < 5
                with pytest.raises(BrokenResourceError):
                    await ch.send(1)

        anyio.run(main, backend=backend)


def child_hang(end: PairEnd, ready: Any) -> None:
    with end.connect_sync() as ch:
        ch.send("up")
        ready.set()
        time.sleep(60)


@pytest.mark.multiprocess
def test_parked_receiver_notices_death_within_100ms():
    a, b = pair()
    ready = SPAWN.Event()
    with spawned(child_hang, b, ready) as p:

        async def main() -> None:
            async with await a.connect(spin_us=0) as ch:
                assert await ch.receive() == "up"
                killed_at: list[float] = []

                async def killer() -> None:
                    await anyio.sleep(0.1)  # the receiver is parked by now
                    killed_at.append(time.perf_counter())
                    os.kill(p.pid, signal.SIGKILL)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(killer)
                    with pytest.raises(BrokenResourceError):
                        with anyio.fail_after(5):
                            await ch.receive()
                    latency = time.perf_counter() - killed_at[0]
                assert latency < 0.1, latency

        anyio.run(main)


def child_consume_some_then_hang(end: PairEnd, ready: Any) -> None:
    with end.connect_sync() as ch:
        ch.receive(timeout=10)
        ready.set()
        time.sleep(60)


@pytest.mark.multiprocess
def test_kill_consumer_sender_gets_broken():
    a, b = pair(capacity=SMALL)
    ready = SPAWN.Event()
    with spawned(child_consume_some_then_hang, b, ready) as p:

        async def main() -> None:
            async with await a.connect(spin_us=0) as ch:
                await ch.send("first")
                assert await anyio.to_thread.run_sync(ready.wait, 30)
                os.kill(p.pid, signal.SIGKILL)
                with anyio.fail_after(5):
                    with pytest.raises(BrokenResourceError):
                        while True:  # fills the ring, parks, notices the death
                            await ch.send(b"x" * 100)
                with pytest.raises(BrokenResourceError):
                    await ch.receive()

        anyio.run(main)


def child_send_and_close(end: PairEnd, n: int) -> None:
    with end.connect_sync() as ch:
        for i in range(n):
            ch.send(i)


@pytest.mark.multiprocess
def test_clean_close_across_processes():
    a, b = pair()
    with spawned(child_send_and_close, b, 100) as p:

        async def main() -> None:
            async with await a.connect() as ch:
                assert [x async for x in ch] == list(range(100))
                with pytest.raises(EndOfStream):
                    await ch.receive()
                with pytest.raises(BrokenResourceError):
                    await ch.send("too late")

        anyio.run(main)
    assert p.exitcode == 0


def child_client_then_die(path: str, ready: Any) -> None:
    ch = connect_sync(path)
    ch.send("hello from the doomed")
    ready.set()
    time.sleep(60)


@pytest.mark.multiprocess
def test_listener_survives_client_crash(tmp_path):
    path = str(tmp_path / "c.sock")
    ready = SPAWN.Event()

    async def main() -> None:
        async with listen(path, spin_us=0) as lst:
            with spawned(child_client_then_die, path, ready) as p:
                conn, rec = await lst.receive()
                assert rec == "hello from the doomed"
                os.kill(p.pid, signal.SIGKILL)
            async with await connect(path) as c:
                await c.send("alive")
                with anyio.fail_after(5):
                    conn2, rec2 = await lst.receive()
                assert rec2 == "alive" and conn2 is not conn
            assert lst.statistics().broken == 1
            assert conn not in lst.connections

    anyio.run(main)


def child_create_connect_die(path: str) -> None:
    seg = Segment.create(8192)  # never announced, never unlinked
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    print(seg.name, flush=True)
    os._exit(0)


@pytest.mark.multiprocess
def test_listener_sweeps_names_of_client_dead_before_hello(tmp_path):
    path = str(tmp_path / "d.sock")

    async def main() -> None:
        async with listen(path) as lst:
            with spawned(child_create_connect_die, path) as p:
                with anyio.fail_after(10):
                    while lst.statistics().refused < 1:
                        await anyio.sleep(0.01)
                    while shm_names(p.pid):
                        await anyio.sleep(0.01)
            assert p.exitcode == 0

    anyio.run(main)


def test_spin_budget_collapses_under_a_slow_peer_and_recovers():
    """A spin that times out halves the budget (a slow peer costs little CPU); after
    a run of timeouts the full budget is tried again, so a peer that became fast is
    caught hot again instead of paying a doorbell per message forever."""
    from ringwire._conn.endpoint import _MIN_SPIN_NS, _SPIN_PROBE

    a, b = sync_pair(capacity=SMALL, spin_us=40)
    with a, b:
        full = b._core.spin_ns
        assert full == 40_000
        for _ in range(6):
            assert not b._core.spin(lambda: False)
        assert b._core._spin_cur == _MIN_SPIN_NS
        for _ in range(_SPIN_PROBE - 7):
            b._core.spin(lambda: False)
        assert b._core._spin_cur == _MIN_SPIN_NS
        b._core.spin(lambda: False)  # the 16th miss in a row: the next spin probes at full
        assert b._core._spin_cur == full
        ticks = iter(range(1000))
        assert b._core.spin(lambda: next(ticks) > 3)  # the peer answers while we spin
        assert b._core._spin_cur == full and b._core._spin_misses == 0
