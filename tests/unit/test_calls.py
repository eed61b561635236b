"""Calls over one channel (ringwire.Client / SyncClient / serve), in one process: the two
ends of a ringwire.pair() talk between tasks of one event loop, or between threads."""

from __future__ import annotations

import inspect
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import numpy as np
import pytest

import ringwire
from ringwire import (
    BrokenResourceError,
    Channel,
    Client,
    ClosedResourceError,
    DeadlineExceeded,
    EncodeError,
    ProtocolError,
    RemoteError,
    SyncChannel,
    SyncClient,
    serve,
    serve_sync,
)

CALL, REPLY, ERROR, CANCEL = 1, 2, 3, 4


@pytest.fixture(params=[pytest.param("asyncio", id="asyncio"), pytest.param("trio", id="trio")])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


class Req(ringwire.Record):
    n: int
    x: object = None
    shape: tuple[int, ...] = ()


class Rep(ringwire.Record):
    n: int
    total: float = 0.0
    y: object = None


async def connected(**kw: Any) -> tuple[Channel, Channel]:
    a, b = ringwire.pair(**{k: v for k, v in kw.items() if k == "capacity"})
    opts = {k: v for k, v in kw.items() if k != "capacity"}
    ends: dict[str, Channel] = {}
    async with anyio.create_task_group() as tg:

        async def connect_b() -> None:
            ends["b"] = await b.connect(**opts)

        tg.start_soon(connect_b)
        ends["a"] = await a.connect(**opts)
    return ends["a"], ends["b"]


@asynccontextmanager
async def calls(
    handler: Callable[[Any], Any], *, reply: Any = Any, **serve_kw: Any
) -> AsyncIterator[tuple[Client, Channel]]:
    """A client and a server (a task) over a new pair; the server must end cleanly."""
    connect_kw = {k: serve_kw.pop(k) for k in ("capacity", "slots") if k in serve_kw}
    ca, cb = await connected(**connect_kw)
    async with cb, anyio.create_task_group() as tg:
        await tg.start(lambda task_status: serve(cb, handler, task_status=task_status, **serve_kw))
        async with Client(ca, type=reply) as client:
            yield client, cb
        # leaving the client closed its channel: the server sees the end and returns


@asynccontextmanager
async def raw_server(
    handler: Callable[[Any], Any], **serve_kw: Any
) -> AsyncIterator[tuple[Channel, list[BaseException]]]:
    """A server, and the raw channel of its client (to send hand-made envelopes)."""
    connect_kw = {k: serve_kw.pop(k) for k in ("capacity",) if k in serve_kw}
    ca, cb = await connected(**connect_kw)
    errors: list[BaseException] = []

    async def run(task_status: Any) -> None:
        try:
            await serve(cb, handler, task_status=task_status, **serve_kw)
        except Exception as exc:
            errors.append(exc)

    async with ca, cb, anyio.create_task_group() as tg:
        await tg.start(run)
        yield ca, errors
        ca.close()


async def echo(x: Any) -> Any:
    return x


# -- values ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_values_round_trip_untyped() -> None:
    big = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: through a slot
    async with calls(echo) as (client, _):
        assert await client.call(None) is None
        assert await client.call(7) == 7
        assert await client.call((1, (2, "x"), [3])) == (1, (2, "x"), [3])
        assert await client.call({"a": [1.5, b"\x00"]}) == {"a": [1.5, b"\x00"]}
        got = await client.call(big)
        np.testing.assert_array_equal(got, big)
        assert not got.flags.writeable  # a view of the server's slot
        del got
        small = np.ones((3, 4), np.int16)
        np.testing.assert_array_equal(await client.call(small), small)
        assert client.pending == 0
        assert "Client over" in repr(client)


@pytest.mark.anyio
async def test_calls_over_a_listener_connection(tmp_path: Any) -> None:
    """Any Channel will do: here one a listener accepted, not a pair's."""
    path = str(tmp_path / "calls.sock")
    async with ringwire.listen(path) as listener, anyio.create_task_group() as tg:

        async def server() -> None:
            async with await listener.accept() as chan:
                await serve(chan, echo)  # returns when the client closes

        tg.start_soon(server)
        async with Client(await ringwire.connect(path)) as client:
            assert await client.call({"via": "listener"}) == {"via": "listener"}


@pytest.mark.anyio
async def test_typed_records_and_tensors() -> None:
    torch = pytest.importorskip("torch")

    async def handler(req: Req) -> Rep:
        assert isinstance(req, Req) and isinstance(req.shape, tuple)
        return Rep(n=req.n, total=float(req.x.sum()), y=req.x * 2)

    async with calls(handler, type=Req, reply=Rep) as (client, _):
        t = torch.arange(1 << 17, dtype=torch.float32)  # 512 KiB: a slot
        rep = await client.call(Req(n=3, x=t, shape=(1, 2)))
        assert isinstance(rep, Rep) and rep.n == 3
        assert rep.total == float(t.sum())
        assert torch.equal(rep.y, t * 2)
        del rep  # a view of the server's slot: released before the channel closes


# -- many callers, out of order, fair ----------------------------------------------------


@pytest.mark.anyio
async def test_many_concurrent_callers_get_their_own_replies_out_of_order() -> None:
    finished: list[int] = []

    async def handler(req: list[Any]) -> list[Any]:
        n, delay = req
        await anyio.sleep(delay)
        finished.append(n)
        return [n, n * n]

    rng = random.Random(5)
    n_calls = 300
    delays = [rng.random() * 0.05 for _ in range(n_calls)]
    results: dict[int, Any] = {}
    async with calls(handler, concurrency=n_calls) as (client, _):

        async def one(i: int) -> None:
            results[i] = await client.call([i, delays[i]], timeout=30)

        async with anyio.create_task_group() as tg:
            for i in range(n_calls):
                tg.start_soon(one, i)
    assert results == {i: [i, i * i] for i in range(n_calls)}
    assert finished != sorted(finished)  # the replies really came back out of order


@pytest.mark.anyio
async def test_callers_are_served_fairly_under_load() -> None:
    """With a busy server and a full ring, no caller overtakes or starves another:
    in the first half of all completions every caller already has its share."""

    async def handler(x: Any) -> Any:
        await anyio.sleep(0)
        return x

    callers, each = 20, 12
    done: list[int] = []
    async with calls(handler, concurrency=2, max_queued=0, capacity=4096) as (client, _):

        async def caller(c: int) -> None:
            for _ in range(each):
                await client.call([c, "x" * 100])
                done.append(c)

        async with anyio.create_task_group() as tg:
            for c in range(callers):
                tg.start_soon(caller, c)
    first_half = done[: len(done) // 2]
    counts = [first_half.count(c) for c in range(callers)]
    assert min(counts) >= each // 4, counts


# -- errors -----------------------------------------------------------------------------------


class ModelError(Exception):
    def __init__(self, message: str, details: Any) -> None:
        super().__init__(message)
        self.details = details


@pytest.mark.anyio
async def test_handler_errors_come_back_as_remote_errors() -> None:
    async def handler(what: str) -> Any:
        if what == "value":
            raise ValueError("bad value")
        if what == "model":
            raise ModelError("out of memory", {"needed": 3, "shape": [1, 2]})
        if what == "remote":
            raise RemoteError("upstream.Failure", "the tokenizer failed", {"code": 7})
        if what == "unencodable":
            return object()
        if what == "bad details":
            raise ModelError("with an object", {"o": object()})
        return what

    async with calls(handler) as (client, _):
        with pytest.raises(RemoteError) as info:
            await client.call("value")
        err = info.value
        assert type(err) is RemoteError
        assert (err.type_name, err.message, err.details) == ("ValueError", "bad value", None)
        assert str(err) == "ValueError: bad value"
        assert err.__traceback__ is not None and err.__cause__ is None

        with pytest.raises(RemoteError) as info:
            await client.call("model")
        assert info.value.type_name.endswith("test_calls.ModelError")
        assert info.value.details == {"needed": 3, "shape": [1, 2]}

        with pytest.raises(RemoteError) as info:
            await client.call("remote")
        assert info.value.type_name == "upstream.Failure"
        assert info.value.details == {"code": 7}

        with pytest.raises(RemoteError) as info:
            await client.call("unencodable")
        assert info.value.type_name == "ringwire.EncodeError"
        assert "the reply could not be sent" in info.value.message

        with pytest.raises(RemoteError) as info:
            await client.call("bad details")
        assert info.value.details is None
        assert "its details could not be sent" in info.value.message

        # the connection is fine after all that
        assert await client.call("ok") == "ok"


@pytest.mark.anyio
async def test_a_request_that_cannot_be_sent_raises_here_and_nothing_breaks() -> None:
    async with calls(echo) as (client, _):
        with pytest.raises(EncodeError):
            await client.call(object())
        assert client.pending == 0
        assert await client.call(1) == 1


# -- cancellation and deadlines ------------------------------------------------------------


@pytest.mark.anyio
async def test_cancelling_the_caller_cancels_the_handler() -> None:
    started, cancelled = anyio.Event(), anyio.Event()

    async def handler(x: Any) -> Any:
        if x == "slow":
            started.set()
            try:
                await anyio.sleep(60)
            except anyio.get_cancelled_exc_class():
                cancelled.set()
                raise
        return x

    async with calls(handler) as (client, _):
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.call, "slow")
            await started.wait()
            tg.cancel_scope.cancel()
        with anyio.fail_after(5):
            await cancelled.wait()
        assert client.pending == 0
        assert await client.call("fast") == "fast"


@pytest.mark.anyio
@pytest.mark.parametrize("blocking", [False, True], ids=["async", "blocking"])
async def test_cancellations_reach_only_their_own_calls(blocking: bool) -> None:
    """Callers giving up at random moments among calls that do not: every cancelled
    handler belongs to a caller that gave up, every other call is answered right, and
    the workers go on serving after each cancellation."""
    cancelled: set[int] = set()

    started: set[int] = set()

    async def handler(req: list[Any]) -> int:
        i, delay = req
        started.add(i)
        try:
            await anyio.sleep(delay)
        except anyio.get_cancelled_exc_class():
            cancelled.add(i)
            raise
        return i

    def blocking_handler(req: list[Any]) -> int:
        i, delay = req
        started.add(i)
        end = time.monotonic() + delay
        while time.monotonic() < end:
            try:
                anyio.from_thread.check_cancelled()
            except BaseException:
                cancelled.add(i)
                raise
            time.sleep(0.001)
        return i

    rng = random.Random(9)
    plan = [(i, rng.random() * 0.03, i % 3 == 0) for i in range(150)]
    results: dict[int, int] = {}
    gave_up: set[int] = set()
    served = blocking_handler if blocking else handler
    async with calls(served, concurrency=6) as (client, _):

        async def one(i: int, delay: float, give_up: bool) -> None:
            if give_up:
                with anyio.move_on_after(delay / 2):
                    results[i] = await client.call([i, delay])
                if i not in results:
                    gave_up.add(i)
            else:
                results[i] = await client.call([i, delay], timeout=30)

        async with anyio.create_task_group() as tg:
            for args in plan:
                tg.start_soon(one, *args)
        assert await client.call([-1, 0.0]) == -1
        # Under load every random give-up may land while its call is still queued (it is
        # dropped, no handler runs) or after its handler ended: one call given up while
        # its handler surely runs shows that the cancel reaches the handler.
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 1000, 30.0, False)
            with anyio.fail_after(10):
                while 1000 not in started:
                    await anyio.sleep(0.002)
            tg.cancel_scope.cancel()
        with anyio.fail_after(10):
            while 1000 not in cancelled:
                await anyio.sleep(0.002)
        gave_up.add(1000)
        assert await client.call([-2, 0.0]) == -2
    assert all(results[i] == i for i in results)
    assert {i for i, _, give_up in plan if not give_up} <= set(results)
    assert 1000 in cancelled and cancelled <= gave_up and len(gave_up) > 20


@pytest.mark.anyio
async def test_timeout_raises_timeout_error_and_cancels_the_handler() -> None:
    cancelled = anyio.Event()

    async def handler(x: Any) -> Any:
        try:
            await anyio.sleep(x)
        except anyio.get_cancelled_exc_class():
            cancelled.set()
            raise
        return x

    async with calls(handler) as (client, _):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no reply within 0.2 s"):
            await client.call(30.0, timeout=0.2)
        assert 0.15 < time.monotonic() - t0 < 5
        with anyio.fail_after(5):
            await cancelled.wait()
        assert await client.call(0.0, timeout=5) == 0.0
        with pytest.raises(TimeoutError):
            await client.call(0.0, timeout=0)


@pytest.mark.anyio
async def test_a_handler_sees_its_deadline() -> None:
    async def handler(x: Any) -> float:
        return anyio.current_effective_deadline() - anyio.current_time()

    async with calls(handler) as (client, _):
        left = await client.call(None, timeout=5)
        assert 4 < left <= 5
        assert await client.call(None) == float("inf")


@pytest.mark.anyio
async def test_a_call_past_its_deadline_is_refused_or_cancelled_by_the_server() -> None:
    """Hand-made envelopes (no client to cancel): the server's own deadline."""
    gate = anyio.Event()
    seen: list[str] = []

    async def handler(x: str) -> str:
        seen.append(x)
        if x == "hold":
            await gate.wait()
        elif x == "sleep":
            try:
                await anyio.sleep(30)
            except anyio.get_cancelled_exc_class():
                seen.append("sleep cancelled")
                raise
        return x

    async with raw_server(handler, concurrency=1) as (chan, errors):
        await chan.send([CALL, 1, None, "hold"])
        await chan.send([CALL, 2, 0.05, "late"])  # waits behind call 1, past its deadline
        await anyio.sleep(0.3)
        gate.set()
        assert await chan.receive() == [REPLY, 1, None, "hold", None]
        kind, cid, _, _, (tname, message, _) = await chan.receive()
        assert (kind, cid, tname) == (ERROR, 2, "DeadlineExceeded")
        assert "refused" in message and "deadline passed" in message
        assert "late" not in seen

        await chan.send([CALL, 3, 0.1, "sleep"])
        with anyio.fail_after(5):
            kind, cid, _, _, (tname, message, _) = await chan.receive()
        assert (kind, cid, tname) == (ERROR, 3, "DeadlineExceeded")
        assert "still running at its deadline" in message
        assert "sleep cancelled" in seen
    assert errors == []


@pytest.mark.anyio
async def test_a_cancel_drops_a_queued_call_before_it_starts() -> None:
    gate = anyio.Event()
    seen: list[str] = []

    async def handler(x: str) -> str:
        seen.append(x)
        if x == "hold":
            await gate.wait()
        return x

    async with raw_server(handler, concurrency=1, max_queued=4) as (chan, errors):
        await chan.send([CALL, 1, None, "hold"])
        await chan.send([CALL, 2, None, "dropped"])
        await chan.send([CANCEL, 2])
        await chan.send([CANCEL, 99])  # unknown: ignored
        await chan.send([CALL, 3, None, "after"])
        await anyio.sleep(0.1)
        gate.set()
        assert [(await chan.receive())[1] for _ in range(2)] == [1, 3]
        assert seen == ["hold", "after"]
    assert errors == []


def test_deadline_exceeded_is_a_timeout_and_a_remote_error() -> None:
    err = DeadlineExceeded("DeadlineExceeded", "late")
    assert isinstance(err, TimeoutError) and isinstance(err, RemoteError)
    assert isinstance(err, ringwire.RingwireError)
    assert str(err) == "DeadlineExceeded: late"


@pytest.mark.anyio
async def test_a_server_deadline_error_raises_deadline_exceeded_in_the_caller() -> None:
    async def handler(x: Any) -> Any:
        raise RemoteError("DeadlineExceeded", "the model server gave up")

    async with calls(handler) as (client, _):
        with pytest.raises(DeadlineExceeded, match="gave up"):
            await client.call(1)


# -- blocking handlers, bounded concurrency, backpressure ------------------------------


@pytest.mark.anyio
async def test_blocking_handlers_run_in_threads_within_the_concurrency_bound() -> None:
    lock = threading.Lock()
    active = [0, 0]  # now, most
    loop_thread = threading.get_ident()
    threads: set[int] = set()

    def handler(x: float) -> float:
        with lock:
            active[0] += 1
            active[1] = max(active[1], active[0])
            threads.add(threading.get_ident())
        time.sleep(x)
        with lock:
            active[0] -= 1
        return x * 2

    async with calls(handler, concurrency=3) as (client, _):
        results: list[float] = []

        async def one() -> None:
            results.append(await client.call(0.02))

        async with anyio.create_task_group() as tg:
            for _ in range(12):
                tg.start_soon(one)
    assert results == [0.04] * 12
    assert active[1] == 3
    assert loop_thread not in threads


@pytest.mark.anyio
async def test_a_blocking_handler_sees_the_cancellation_through_check_cancelled() -> None:
    seen = threading.Event()

    def handler(x: Any) -> Any:
        for _ in range(1000):
            try:
                anyio.from_thread.check_cancelled()
            except BaseException:
                seen.set()
                raise
            time.sleep(0.005)
        return x

    async with calls(handler) as (client, _):
        with pytest.raises(TimeoutError):
            await client.call(1, timeout=0.1)
        assert await anyio.to_thread.run_sync(seen.wait, 5)


@pytest.mark.anyio
async def test_a_full_server_pushes_back_on_the_callers() -> None:
    """concurrency 1, no backlog: the server stops reading, the ring fills, the
    callers' sends wait; once the handler goes on, every call is answered."""
    gate = anyio.Event()
    started: list[int] = []

    async def handler(req: list[Any]) -> int:
        started.append(req[0])
        await gate.wait()
        return req[0]

    n_calls = 200
    async with calls(handler, concurrency=1, max_queued=0, capacity=4096) as (client, _):
        results: list[int] = []

        async def one(i: int) -> None:
            results.append(await client.call([i, "x" * 100]))  # ~120 bytes a call

        async with anyio.create_task_group() as tg:
            for i in range(n_calls):
                tg.start_soon(one, i)
            await anyio.sleep(0.3)
            sent = client.channel.statistics().records_sent
            assert len(started) == 1  # one handler at a time
            assert client.pending == n_calls
            assert sent < n_calls // 2  # the rest wait for room in the ring
            gate.set()
    assert sorted(results) == list(range(n_calls))


@pytest.mark.anyio
async def test_a_caller_cancelled_while_waiting_for_room_is_not_sent() -> None:
    gate = anyio.Event()
    started: list[int] = []

    async def handler(req: list[Any]) -> int:
        started.append(req[0])
        await gate.wait()
        return req[0]

    async with calls(handler, concurrency=1, max_queued=0, capacity=2048) as (client, _):
        async with anyio.create_task_group() as tg:
            for i in range(60):
                tg.start_soon(client.call, [i, "x" * 100])
            await anyio.sleep(0.2)
            tg.cancel_scope.cancel()  # every caller: most were never sent
        assert client.pending == 0
        gate.set()
        assert await client.call([1000, ""], timeout=10) == 1000
    assert 1000 in started
    assert len(started) < 20  # the cancelled ones that did reach it were dropped


# -- the end of a connection -------------------------------------------------------------


@pytest.mark.anyio
async def test_a_server_gone_fails_every_pending_call_at_once() -> None:
    async def handler(x: Any) -> Any:
        await anyio.sleep(60)

    ca, cb = await connected()
    failed: list[tuple[float, BaseException]] = []
    server_errors: list[BaseException] = []

    async def run_server() -> None:
        try:
            await serve(cb, handler)
        except ClosedResourceError as exc:  # its channel was closed under it
            server_errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_server)
        async with Client(ca) as client:

            async def one() -> None:
                try:
                    await client.call(1)
                except BrokenResourceError as exc:
                    failed.append((time.monotonic(), exc))

            async with anyio.create_task_group() as callers:
                for _ in range(50):
                    callers.start_soon(one)
                await anyio.sleep(0.1)
                t_close = time.monotonic()
                cb.close()  # the server's end goes away (in a process: kill -9)
            with pytest.raises(BrokenResourceError):
                await client.call(2)
        tg.cancel_scope.cancel()
    assert len(failed) == 50
    times = [t for t, _ in failed]
    assert max(times) - min(times) < 0.5 and max(times) - t_close < 2
    assert "closed the connection" in str(failed[0][1])
    assert len(server_errors) == 1


@pytest.mark.anyio
async def test_closing_the_client_fails_its_pending_calls_and_ends_the_server() -> None:
    async def handler(x: Any) -> Any:
        await anyio.sleep(x)
        return x

    ca, cb = await connected()
    errors: list[BaseException] = []
    async with anyio.create_task_group() as tg:
        await tg.start(lambda task_status: serve(cb, handler, task_status=task_status))
        async with Client(ca) as client:

            async def one() -> None:
                try:
                    await client.call(30.0)
                except ClosedResourceError as exc:
                    errors.append(exc)

            async with anyio.create_task_group() as callers:
                callers.start_soon(one)
                await anyio.sleep(0.05)
                await client.aclose()
            with pytest.raises(ClosedResourceError):
                await client.call(0.0)
        # serve() returns by itself: end of stream, its handler cancelled when its
        # reply found the client gone
    cb.close()
    assert len(errors) == 1


@pytest.mark.anyio
async def test_an_exception_in_the_client_block_propagates_unwrapped() -> None:
    ca, cb = await connected()
    async with cb:
        with pytest.raises(KeyError):  # not an ExceptionGroup around it
            async with Client(ca):
                raise KeyError("mine")
    assert ca.closed


@pytest.mark.anyio
async def test_a_call_outside_the_block_is_refused() -> None:
    ca, cb = await connected()
    async with ca, cb:
        client = Client(ca)
        with pytest.raises(RuntimeError, match="async with"):
            await client.call(1)


# -- hostile peers ---------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("envelope", "why"),
    [
        ([9, 1, None, "x"], "undecodable"),
        ([CALL, 0, None, "x"], "undecodable"),
        ([CALL, 1, float("nan"), "x"], "undecodable"),
        ("not an envelope", "undecodable"),
        ([REPLY, 1, None, "x"], "a reply envelope to the server"),
    ],
    ids=["kind", "id", "nan", "str", "reply"],
)
async def test_a_malformed_envelope_breaks_the_server_connection_cleanly(
    envelope: Any, why: str
) -> None:
    async with raw_server(echo) as (chan, errors):
        await chan.send([CALL, 5, None, "fine"])
        assert (await chan.receive())[:4] == [REPLY, 5, None, "fine"]
        await chan.send(envelope)
        with pytest.raises(BrokenResourceError, match=why):
            with anyio.fail_after(5):
                await chan.receive()
    assert len(errors) == 1 and isinstance(errors[0], ProtocolError)
    assert why in str(errors[0])


@pytest.mark.anyio
async def test_an_id_reused_while_in_flight_breaks_the_server_connection() -> None:
    gate = anyio.Event()

    async def handler(x: Any) -> Any:
        await gate.wait()

    async with raw_server(handler) as (chan, errors):
        await chan.send([CALL, 5, None, 1])
        await chan.send([CALL, 5, None, 2])
        with pytest.raises(BrokenResourceError, match="call id 5 again"):
            with anyio.fail_after(5):
                await chan.receive()
    assert len(errors) == 1 and isinstance(errors[0], ProtocolError)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("reply", "why"),
    [
        ([REPLY, 77, None, "x"], "never made"),
        ([CALL, 1, None, "x"], "a call envelope to the client"),
        ([ERROR, 1, None, None, None], "without an error"),
        ([ERROR, 1, None, None, [1, 2]], "undecodable"),
    ],
    ids=["unknown-id", "call", "empty-error", "bad-error"],
)
async def test_a_malformed_reply_fails_the_pending_calls_cleanly(reply: Any, why: str) -> None:
    ca, cb = await connected()
    async with ca, cb, Client(ca) as client:
        failures: list[BaseException] = []

        async def one() -> None:
            try:
                await client.call("q")
            except BrokenResourceError as exc:
                failures.append(exc)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(one)
                for _ in range(3):
                    assert (await cb.receive())[0] == CALL
                await cb.send(reply)
        assert len(failures) == 3
        assert isinstance(failures[0].__cause__, ProtocolError)
        assert why in str(failures[0])
        with pytest.raises(BrokenResourceError):
            await cb.receive()  # the client aborted the connection, with the reason


# -- the blocking client -------------------------------------------------------------------


def _sync_setup(handler: Callable[[Any], Any], **serve_kw: Any) -> tuple[Any, Any, Any]:
    """A SyncClient's channel in this thread; serve() on an event loop in another."""
    a, b = ringwire.pair()
    box: dict[str, Any] = {}
    ready = threading.Event()

    def server() -> None:
        async def main() -> None:
            async with await b.connect() as chan:
                ready.set()
                try:
                    await serve(chan, handler, **serve_kw)
                except Exception as exc:
                    box["error"] = exc

        anyio.run(main)

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    chan = a.connect_sync()
    assert ready.wait(10)
    return chan, thread, box


async def slow_echo(x: Any) -> Any:
    if isinstance(x, list):
        await anyio.sleep(x[1])
        return x[0]
    if isinstance(x, str) and x == "boom":
        raise ValueError("boom")
    return x


def test_sync_client_many_threads_timeouts_and_errors() -> None:
    chan, thread, box = _sync_setup(slow_echo)
    try:
        with SyncClient(chan) as client:
            assert client.call(5) == 5
            big = np.arange(1 << 18, dtype=np.float64)
            np.testing.assert_array_equal(client.call(big), big)
            with pytest.raises(RemoteError, match="ValueError: boom"):
                client.call("boom")
            with pytest.raises(TimeoutError):
                client.call([1, 30.0], timeout=0.1)
            with pytest.raises(TimeoutError):
                client.call(1, timeout=0)

            results: dict[int, Any] = {}
            rng = random.Random(3)

            def worker(t: int) -> None:
                for k in range(10):
                    n = t * 100 + k
                    results[n] = client.call([n, rng.random() * 0.01], timeout=30)

            workers = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(60)
            assert results == {n: n for n in results} and len(results) == 80
            assert client.pending == 0
            assert "SyncClient over" in repr(client)
        with pytest.raises(ClosedResourceError):
            client.call(1)
    finally:
        chan.close()
        thread.join(10)
    assert not thread.is_alive() and "error" not in box


def test_sync_client_server_gone_fails_every_waiting_thread() -> None:
    stop = threading.Event()

    def handler(x: Any) -> Any:
        stop.wait(30)
        raise RuntimeError("stopped")

    a, b = ringwire.pair()
    server_chan: dict[str, Any] = {}
    loop_ready = threading.Event()
    done = threading.Event()

    def server() -> None:
        async def main() -> None:
            chan = await b.connect()
            server_chan["chan"] = chan
            server_chan["token"] = anyio.lowlevel.current_token()
            loop_ready.set()
            with pytest.raises(ClosedResourceError):  # its channel was closed under it
                await serve(chan, handler)

        anyio.run(main)
        done.set()

    thread = threading.Thread(target=server, daemon=True)
    thread.start()
    chan = a.connect_sync()
    assert loop_ready.wait(10)
    failures: list[BaseException] = []
    try:
        with SyncClient(chan) as client:

            def worker() -> None:
                try:
                    client.call(1)
                except BrokenResourceError as exc:
                    failures.append(exc)

            workers = [threading.Thread(target=worker) for _ in range(6)]
            for w in workers:
                w.start()
            time.sleep(0.2)
            anyio.from_thread.run_sync(server_chan["chan"].close, token=server_chan["token"])
            for w in workers:
                w.join(10)
            assert len(failures) == 6
            with pytest.raises(BrokenResourceError):
                client.call(1)
    finally:
        stop.set()
        chan.close()
        thread.join(10)
    assert done.is_set()


def test_sync_client_a_malformed_reply_fails_every_waiting_thread() -> None:
    a, b = ringwire.pair()
    box: dict[str, Any] = {}

    def rogue() -> None:  # answers the first call it sees with an id never issued
        with b.connect_sync() as chan:
            box["first"] = chan.receive(timeout=10)
            chan.receive(timeout=10)
            chan.send([REPLY, 999, None, "x"])
            try:
                chan.receive(timeout=10)
            except BrokenResourceError as exc:  # the client aborted, with the reason
                box["seen"] = exc

    thread = threading.Thread(target=rogue, daemon=True)
    thread.start()
    failures: list[BaseException] = []
    with a.connect_sync() as chan, SyncClient(chan) as client:

        def worker() -> None:
            try:
                client.call("q", timeout=10)
            except BrokenResourceError as exc:
                failures.append(exc)

        workers = [threading.Thread(target=worker) for _ in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(20)
    thread.join(20)
    assert len(failures) == 2
    assert isinstance(failures[0].__cause__, ProtocolError)
    assert "never made" in str(failures[0]) and "never made" in str(box["seen"])
    assert box["first"][0] == CALL


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        ([REPLY, 77, None, "x"], "sent a reply for call 77, never made"),
        ([CALL, 1, None, "x"], "sent a call envelope to the client"),
        ([ERROR, 1, None, None, None], "sent an error envelope for call 1 without an error"),
        ([ERROR, 1, None, None, [1, 2]], "sent an undecodable reply envelope: "),
    ],
    ids=["unknown-id", "call", "empty-error", "bad-error"],
)
def test_sync_client_malformed_replies_read_as_the_async_clients_do(reply: Any, why: str) -> None:
    """The same hostile replies as for Client, the same texts (one core)."""
    a, b = ringwire.pair()
    box: dict[str, Any] = {}

    def rogue() -> None:
        with b.connect_sync() as chan:
            box["first"] = chan.receive(timeout=10)
            chan.send(reply)
            try:
                chan.receive(timeout=10)
            except BrokenResourceError as exc:  # the client aborted, with the reason
                box["seen"] = exc

    thread = threading.Thread(target=rogue, daemon=True)
    thread.start()
    with a.connect_sync() as chan, SyncClient(chan) as client:
        with pytest.raises(BrokenResourceError) as info:
            client.call("q", timeout=10)
        with pytest.raises(BrokenResourceError):
            client.call("later", timeout=10)  # the client stays failed
    thread.join(20)
    err = info.value
    assert isinstance(err.__cause__, ProtocolError)
    assert str(err).startswith(f"connection broken: calls: pid {os.getpid()} {why}")
    assert why in str(box["seen"])
    assert box["first"][0] == CALL


def test_client_and_sync_client_are_twins() -> None:
    def public(cls: type) -> set[str]:
        return {n for n in dir(cls) if not n.startswith("_")}

    assert public(Client) - {"aclose"} == public(SyncClient)
    for name in ("call",):
        pa = inspect.signature(getattr(Client, name)).parameters
        ps = inspect.signature(getattr(SyncClient, name)).parameters
        assert list(pa) == list(ps)
        assert all(pa[n].default == ps[n].default for n in pa)


def test_public_names() -> None:
    for name in ("Client", "SyncClient", "serve", "RemoteError", "DeadlineExceeded"):
        assert name in ringwire.__all__
    assert issubclass(RemoteError, ringwire.RingwireError)


# -- the blocking server -------------------------------------------------------------------


@contextmanager
def sync_server(
    handler: Callable[[Any], Any], capacity: int | None = None, **serve_kw: Any
) -> Iterator[tuple[SyncChannel, dict[str, Any]]]:
    """serve_sync on a thread of its own over a new pair; the client's end.  ``box``
    says how serve_sync ended ("returned", or "error"); leaving closes the client's end
    and waits for the server's thread."""
    a, b = ringwire.pair(**({} if capacity is None else {"capacity": capacity}))
    box: dict[str, Any] = {}
    ready = threading.Event()

    def server() -> None:
        with b.connect_sync() as chan:
            box["chan"] = chan
            ready.set()
            try:
                serve_sync(chan, handler, **serve_kw)
                box["returned"] = True
            except Exception as exc:
                box["error"] = exc

    thread = threading.Thread(target=server, name="serve_sync test server", daemon=True)
    thread.start()
    chan = a.connect_sync()
    assert ready.wait(10)
    try:
        yield chan, box
    finally:
        chan.close()
        thread.join(10)
    assert not thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("ringwire.serve_sync")]


def test_serve_sync_answers_threads_within_its_concurrency_bound() -> None:
    lock = threading.Lock()
    active = [0, 0]  # now, most
    threads: set[str] = set()

    def handler(x: Any) -> Any:
        if isinstance(x, str):
            raise ModelError(x, {"k": 1})
        with lock:
            active[0] += 1
            active[1] = max(active[1], active[0])
            threads.add(threading.current_thread().name)
        time.sleep(0.02 if isinstance(x, int) else 0)
        with lock:
            active[0] -= 1
        return x

    with sync_server(handler, concurrency=3) as (chan, box), SyncClient(chan) as client:
        big = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: slots both ways
        np.testing.assert_array_equal(client.call(big), big)
        with pytest.raises(RemoteError) as info:
            client.call("boom")
        assert info.value.type_name.endswith("ModelError") and info.value.details == {"k": 1}
        results: dict[int, Any] = {}

        def worker(t: int) -> None:
            for k in range(3):
                results[t * 10 + k] = client.call(t * 10 + k, timeout=30)

        workers = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert results == {n: n for n in results} and len(results) == 24
    assert active[1] == 3
    assert threads and all(n.startswith("ringwire.serve_sync worker") for n in threads)
    assert box == {"chan": box["chan"], "returned": True}  # the client closed: a clean end


def test_serve_sync_answers_an_async_client() -> None:
    """Any client with any server; a request not of serve_sync's ``type`` is an
    undecodable envelope, which breaks the connection as under async serve."""
    a, b = ringwire.pair()
    box: dict[str, Any] = {}

    def server() -> None:
        with b.connect_sync() as sc:
            try:
                serve_sync(sc, lambda x: x * 2, type=int)
            except Exception as exc:
                box["error"] = exc

    thread = threading.Thread(target=server, daemon=True)
    thread.start()

    async def main() -> None:
        async with Client(await a.connect(), type=int) as client:
            assert await client.call(21, timeout=10) == 42
            with pytest.raises(BrokenResourceError, match="undecodable call envelope"):
                await client.call("not an int", timeout=10)

    try:
        anyio.run(main)
    finally:
        thread.join(10)
    assert not thread.is_alive()
    assert isinstance(box["error"], ProtocolError) and "Expected `int" in str(box["error"])


def test_serve_sync_deadlines_and_cancels_from_hand_made_envelopes() -> None:
    gates = {"hold": threading.Event(), "hold2": threading.Event()}
    seen: list[str] = []
    stopped: list[str] = []

    def handler(x: str) -> str:
        seen.append(x)
        if x in gates:
            gates[x].wait(10)
        elif x.startswith("spin"):
            while not ringwire.call_cancelled():
                time.sleep(0.001)
            stopped.append(x)
            return "not sent"
        return x

    with sync_server(handler, concurrency=1, max_queued=4) as (chan, box):
        chan.send([CALL, 1, None, "hold"])
        chan.send([CALL, 2, 0.05, "late"])  # waits behind call 1, past its deadline
        time.sleep(0.3)
        gates["hold"].set()
        assert chan.receive(timeout=5) == [REPLY, 1, None, "hold", None]
        kind, cid, _, _, (tname, message, _) = chan.receive(timeout=5)
        assert (kind, cid, tname) == (ERROR, 2, "DeadlineExceeded")
        assert "refused" in message and "late" not in seen

        chan.send([CALL, 3, 0.1, "spin3"])  # the handler sees its deadline pass
        kind, cid, _, _, (tname, message, _) = chan.receive(timeout=5)
        assert (kind, cid, tname) == (ERROR, 3, "DeadlineExceeded")
        assert "still running at its deadline" in message and stopped == ["spin3"]

        chan.send([CALL, 4, None, "spin4"])  # the client's cancel reaches the handler
        time.sleep(0.05)
        chan.send([CANCEL, 4])
        chan.send([CALL, 5, None, "after"])
        assert chan.receive(timeout=5)[:2] == [REPLY, 5]  # no answer for call 4
        assert stopped == ["spin3", "spin4"]

        chan.send([CALL, 6, None, "hold2"])
        chan.send([CALL, 7, None, "dropped"])  # queued, then cancelled: never runs
        chan.send([CANCEL, 7])
        chan.send([CANCEL, 99])  # unknown: ignored
        chan.send([CALL, 8, None, "after2"])
        time.sleep(0.1)
        gates["hold2"].set()
        assert [chan.receive(timeout=5)[1] for _ in range(2)] == [6, 8]
        assert "dropped" not in seen
    assert box["returned"]


def test_a_sync_client_timeout_cancels_the_serve_sync_handler() -> None:
    stopped = threading.Event()

    def handler(x: Any) -> Any:
        while not ringwire.call_cancelled():
            time.sleep(0.001)
        stopped.set()
        return x

    with sync_server(handler) as (chan, box), SyncClient(chan) as client:
        t0 = time.monotonic()
        # the caller's own timer, or (a hair later) the server's answer at the deadline
        # that travelled with the call: a TimeoutError either way
        with pytest.raises(TimeoutError, match="no reply within 0.2 s|still running at its"):
            client.call(1, timeout=0.2)
        assert 0.15 < time.monotonic() - t0 < 5
        assert stopped.wait(5)
    assert box["returned"]


def test_a_full_serve_sync_pushes_back_on_the_callers() -> None:
    gate = threading.Event()
    started: list[int] = []

    def handler(req: list[Any]) -> int:
        started.append(req[0])
        gate.wait(30)
        return int(req[0])

    n_calls = 60
    results: list[int] = []
    with sync_server(handler, capacity=4096, concurrency=1, max_queued=0) as (chan, _):
        with SyncClient(chan) as client:

            def one(i: int) -> None:
                results.append(client.call([i, "x" * 100], timeout=60))

            callers = [threading.Thread(target=one, args=(i,)) for i in range(n_calls)]
            for c in callers:
                c.start()
            time.sleep(0.5)
            assert len(started) == 1  # one handler at a time
            assert chan.statistics().records_sent < n_calls  # the rest wait for room
            gate.set()
            for c in callers:
                c.join(60)
    assert sorted(results) == list(range(n_calls))


def test_serve_sync_raises_for_a_malformed_envelope_and_aborts_with_the_reason() -> None:
    with sync_server(lambda x: x) as (chan, box):
        chan.send([CALL, 5, None, "fine"])
        assert chan.receive(timeout=5)[:4] == [REPLY, 5, None, "fine"]
        chan.send([REPLY, 1, None, "x"])
        with pytest.raises(BrokenResourceError, match="a reply envelope to the server"):
            chan.receive(timeout=5)
    assert isinstance(box["error"], ProtocolError)
    assert "a reply envelope to the server" in str(box["error"])


def test_serve_sync_raises_when_its_client_dies_or_its_channel_is_closed() -> None:
    with sync_server(lambda x: x) as (chan, box):
        chan.abort("the client process died")  # what the server sees of a kill -9
    assert isinstance(box["error"], BrokenResourceError)
    assert "the client process died" in str(box["error"])

    with sync_server(lambda x: x) as (chan, box):
        assert SyncClient(chan).call(1, timeout=5) == 1
        box["chan"].close()  # another thread stops the server: it closes its channel
        with pytest.raises(ringwire.EndOfStream):
            chan.receive(timeout=5)
    assert isinstance(box["error"], ClosedResourceError)


def test_serve_sync_refuses_what_it_cannot_serve() -> None:
    with pytest.raises(TypeError, match="serve it with ringwire.serve"):
        serve_sync(None, echo)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="handler must be callable, not int"):
        serve_sync(None, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="concurrency must be at least 1"):
        serve_sync(None, len, concurrency=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_queued must be at least 0"):
        serve_sync(None, len, max_queued=-1)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="a handler that serve_sync runs"):
        ringwire.call_cancelled()


def test_serve_and_serve_sync_are_twins() -> None:
    pa = dict(inspect.signature(serve).parameters)
    ps = dict(inspect.signature(serve_sync).parameters)
    # one-sided: how an async server reports readiness, and where a handler runs (a
    # serve_sync handler always runs on a thread of its own)
    del pa["task_status"], pa["blocking"]
    assert list(pa) == list(ps)
    assert all(pa[n].default == ps[n].default and pa[n].kind == ps[n].kind for n in pa)
    assert "serve_sync" in ringwire.__all__ and "call_cancelled" in ringwire.__all__
