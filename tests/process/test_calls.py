"""Calls across processes: ringwire.Client / SyncClient in the test process, serve() in a
spawned child (and the other way round); cancellation across the process boundary, and
kill -9 of either side."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest
from support.spawn import spawned

import ringwire
from ringwire import BrokenResourceError, Client, RemoteError, SyncClient, serve, serve_sync

pytestmark = pytest.mark.multiprocess


@pytest.fixture(params=[pytest.param("asyncio", id="asyncio"), pytest.param("trio", id="trio")])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


# -- the children ---------------------------------------------------------------------------


async def _handler(x: Any, state: dict[str, int]) -> Any:
    if isinstance(x, np.ndarray):
        return x * 2
    if isinstance(x, list) and x and x[0] == "sleep":
        await anyio.sleep(x[1])
        return x[2]
    if x == "slow":
        state["started"] += 1
        try:
            await anyio.sleep(60)
        except anyio.get_cancelled_exc_class():
            state["cancelled"] += 1
            raise
    if x == "state":
        return dict(state)
    if x == "pid":
        return os.getpid()
    if x == "boom":
        raise ValueError("boom in the child")
    return x


def child_server(end: ringwire.PairEnd, backend: str) -> None:
    """serve() with an async handler; returns when the client closes."""
    state = {"started": 0, "cancelled": 0}

    async def handler(x: Any) -> Any:
        return await _handler(x, state)

    async def main() -> None:
        async with await end.connect() as chan:
            await serve(chan, handler, concurrency=64)

    anyio.run(main, backend=backend)


def child_blocking_server(end: ringwire.PairEnd) -> None:
    """serve() with a blocking handler (worker threads)."""

    def handler(x: Any) -> Any:
        if isinstance(x, list):
            time.sleep(x[1])
            return x[0]
        if isinstance(x, np.ndarray):
            return float(x.sum())
        raise KeyError(x)

    async def main() -> None:
        async with await end.connect() as chan:
            await serve(chan, handler, concurrency=8)

    anyio.run(main)


def child_sync_server(end: ringwire.PairEnd) -> None:
    """serve_sync: handlers on threads, cancellation seen through call_cancelled()."""
    state = {"started": 0, "cancelled": 0}
    lock = threading.Lock()

    def handler(x: Any) -> Any:
        if isinstance(x, list):
            time.sleep(x[1])
            return x[0]
        if x == "spin":
            with lock:
                state["started"] += 1
            while not ringwire.call_cancelled():
                time.sleep(0.001)
            with lock:
                state["cancelled"] += 1
            return x
        if x == "state":
            with lock:
                return dict(state)
        raise KeyError(x)

    with end.connect_sync() as chan:
        serve_sync(chan, handler, concurrency=8)


def child_client(end: ringwire.PairEnd) -> None:
    """A client that makes slow calls and waits to be killed."""

    async def main() -> None:
        async with await end.connect() as chan, Client(chan) as client:
            async with anyio.create_task_group() as tg:
                for _ in range(10):
                    tg.start_soon(client.call, "slow")

    anyio.run(main)


async def _connect(end: ringwire.PairEnd) -> ringwire.Channel:
    with anyio.fail_after(30):
        return await end.connect()


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_concurrent_calls_tensors_and_errors_across_processes(anyio_backend: str) -> None:
    a, b = ringwire.pair()
    with spawned(child_server, b, "asyncio") as proc:
        chan = await _connect(a)
        async with Client(chan) as client:
            assert await client.call("pid") == proc.pid
            rng = random.Random(11)
            results: dict[int, Any] = {}

            async def one(i: int) -> None:
                results[i] = await client.call(["sleep", rng.random() * 0.02, i], timeout=30)

            async with anyio.create_task_group() as tg:
                for i in range(200):
                    tg.start_soon(one, i)
            assert results == {i: i for i in range(200)}

            big = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: slots both ways
            for _ in range(3):
                got = await client.call(big, timeout=30)
                np.testing.assert_array_equal(got, big * 2)
                del got
            with pytest.raises(RemoteError) as info:
                await client.call("boom")
            assert (info.value.type_name, info.value.message) == ("ValueError", "boom in the child")
            for _ in range(100):  # the server's slot views die, and ours did
                s = chan.statistics()
                if s.slots_in_use == 0 and s.slot_arrays_held == 0:
                    break
                await anyio.sleep(0.02)
            assert (s.slots_in_use, s.slot_arrays_held) == (0, 0)
        # leaving the block closed the channel: the child's serve() returns, it exits
        await anyio.to_thread.run_sync(proc.join, 10)
        assert proc.exitcode == 0


@pytest.mark.anyio
async def test_cancellation_and_timeouts_reach_the_handler_in_the_other_process(
    anyio_backend: str,
) -> None:
    a, b = ringwire.pair()
    with spawned(child_server, b, "trio") as proc:
        chan = await _connect(a)
        async with Client(chan) as client:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                await client.call("slow", timeout=0.3)
            assert time.monotonic() - t0 < 5
            with anyio.move_on_after(0.3):
                await client.call("slow")  # cancelled by the scope, no timeout of its own
            for _ in range(250):
                state = await client.call("state")
                if state["cancelled"] == 2:
                    break
                await anyio.sleep(0.02)
            assert state == {"started": 2, "cancelled": 2}
            assert client.pending == 0
    await anyio.to_thread.run_sync(proc.join, 10)


@pytest.mark.anyio
async def test_kill_9_of_the_server_fails_every_pending_call_at_once(anyio_backend: str) -> None:
    a, b = ringwire.pair()
    failures: list[tuple[float, BaseException]] = []
    with spawned(child_server, b, "asyncio") as proc:
        chan = await _connect(a)
        async with Client(chan) as client:
            assert await client.call("pid") == proc.pid

            async def one() -> None:
                try:
                    await client.call("slow")
                except BrokenResourceError as exc:
                    failures.append((time.monotonic(), exc))

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    for _ in range(40):
                        tg.start_soon(one)
                    while (await client.call("state"))["started"] < 40:
                        await anyio.sleep(0.01)
                    t_kill = time.monotonic()
                    os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises(BrokenResourceError):
                await client.call("pid")
    assert len(failures) == 40
    times = [t for t, _ in failures]
    assert max(times) - t_kill < 2.0, "the failures came late"
    assert max(times) - min(times) < 0.1, "not all at once"
    assert f"pid {proc.pid}" in str(failures[0][1])


def test_sync_client_with_a_blocking_server_in_another_process() -> None:
    a, b = ringwire.pair()
    with spawned(child_blocking_server, b) as proc:
        chan = a.connect_sync(handshake_timeout=30)
        with SyncClient(chan) as client:
            out: dict[int, Any] = {}

            def worker(t: int) -> None:
                for k in range(5):
                    out[t * 10 + k] = client.call([t * 10 + k, 0.01], timeout=30)

            threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
            t0 = time.monotonic()
            for th in threads:
                th.start()
            for th in threads:
                th.join(60)
            elapsed = time.monotonic() - t0
            assert out == {n: n for n in out} and len(out) == 40
            assert elapsed < 40 * 0.01  # eight handler threads at once, not one by one
            assert client.call(np.ones(1 << 18, np.float32)) == float(1 << 18)
            with pytest.raises(RemoteError) as info:
                client.call("missing")
            assert info.value.type_name == "KeyError"
            with pytest.raises(TimeoutError):
                client.call([0, 5.0], timeout=0.2)
        proc.join(10)
        assert proc.exitcode == 0


@pytest.mark.anyio
async def test_kill_9_of_the_client_cancels_its_handlers(anyio_backend: str) -> None:
    a, b = ringwire.pair()
    state = {"started": 0, "cancelled": 0}

    async def handler(x: Any) -> Any:
        return await _handler(x, state)

    with spawned(child_client, b) as proc:
        chan = await _connect(a)
        async with chan:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:

                    async def kill_when_busy() -> None:
                        while state["started"] < 10:
                            await anyio.sleep(0.01)
                        os.kill(proc.pid, signal.SIGKILL)

                    tg.start_soon(kill_when_busy)
                    with pytest.raises(BrokenResourceError):
                        await serve(chan, handler)
    assert state == {"started": 10, "cancelled": 10}


def test_sync_client_with_serve_sync_in_another_process() -> None:
    """Threads on both sides: handlers run at once, errors and deadlines cross the
    process, a caller's timeout stops the handler, and the server returns when the
    client closes."""
    a, b = ringwire.pair()
    with spawned(child_sync_server, b) as proc:
        chan = a.connect_sync(handshake_timeout=30)
        with SyncClient(chan) as client:
            out: dict[int, Any] = {}

            def worker(t: int) -> None:
                for k in range(4):
                    out[t * 10 + k] = client.call([t * 10 + k, 0.02], timeout=30)

            threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
            t0 = time.monotonic()
            for th in threads:
                th.start()
            for th in threads:
                th.join(60)
            assert out == {n: n for n in out} and len(out) == 32
            assert time.monotonic() - t0 < 32 * 0.02  # eight handler threads at once
            with pytest.raises(RemoteError) as info:
                client.call("missing")
            assert info.value.type_name == "KeyError"
            with pytest.raises(TimeoutError):
                client.call("spin", timeout=0.2)  # its deadline travels with it
            for _ in range(250):
                state = client.call("state", timeout=10)
                if state["cancelled"] == 1:
                    break
                time.sleep(0.02)
            assert state == {"started": 1, "cancelled": 1}
        proc.join(10)
        assert proc.exitcode == 0
