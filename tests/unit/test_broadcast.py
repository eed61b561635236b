"""Broadcast in one process: the writer and its readers as threads and tasks."""

from __future__ import annotations

import gc
import os
import socket
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest
from support.broadcast import SLOTS, SMALL, bpath_fixture, digest, step  # noqa: F401

import ringwire
from ringwire import (
    BrokenResourceError,
    ClosedResourceError,
    EndOfStream,
    HandshakeError,
    ReaderStalled,
    SlotsExhausted,
    WouldBlock,
)


def collect(
    path: str, out: dict[int, list[Any]], ready: threading.Event | None = None, **kw: Any
) -> None:
    """A blocking reader thread: every record (as digests) into ``out[rank]``, then the
    way it ended (``"eos"`` / the BrokenResourceError message)."""
    with ringwire.subscribe_sync(path, **kw) as sub:
        got = out.setdefault(sub.rank, [])
        if ready is not None:
            ready.set()
        try:
            while True:
                rec = sub.receive(timeout=30)
                got.append(digest(rec))
                del rec
        except EndOfStream:
            got.append("eos")
        except BrokenResourceError as exc:
            got.append(str(exc))


def start_readers(
    path: str, n: int, **kw: Any
) -> tuple[list[threading.Thread], dict[int, list[Any]]]:
    out: dict[int, list[Any]] = {}
    threads = [threading.Thread(target=collect, args=(path, out), kwargs=kw) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, out


def join_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(30)
        assert not t.is_alive()


# -- N readers, every record, in order ----------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_blocking_writer_and_readers(bpath, n):
    with ringwire.broadcast_sync(bpath, readers=8, capacity=SMALL, slots=SLOTS) as bc:
        threads, out = start_readers(bpath, n)
        assert bc.wait_ready(n, timeout=20) == n
        records = [step(i, 8192 if i % 7 == 0 else 0) for i in range(300)]
        for rec in records:
            bc.send(rec, timeout=20)
        stats = bc.statistics()
        assert stats.records_sent == 300 and stats.readers == n
    join_all(threads)
    want = [digest(r) for r in records] + ["eos"]
    assert sorted(out) == list(range(n))
    for rank in range(n):
        assert out[rank] == want, rank


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_writer_and_reader_tasks(bpath, backend):
    async def main() -> None:
        out: dict[int, list[Any]] = {}

        async def reader() -> None:
            async with await ringwire.subscribe(bpath, spin_us=0) as sub:
                got = out.setdefault(sub.rank, [])
                async for rec in sub:
                    got.append(digest(rec))
                    del rec

        async with ringwire.broadcast(bpath, readers=4, capacity=SMALL, slots=SLOTS) as bc:
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(reader)
                with anyio.fail_after(20):
                    await bc.wait_ready(3)
                    records = [step(i, 8192 if i % 5 == 0 else 0) for i in range(200)]
                    for rec in records[:100]:
                        await bc.send(rec)
                    await bc.send_many(records[100:])
                    await bc.aclose()
        want = [digest(r) for r in records]
        assert out == {0: want, 1: want, 2: want}

    anyio.run(main, backend=backend)


def test_a_record_too_large_for_the_ring(bpath):
    with ringwire.broadcast_sync(bpath, capacity=SMALL, slots=None) as bc:
        with pytest.raises(ringwire.FrameTooLarge):
            bc.send(b"x" * SMALL)


# -- slots: one copy, N views, N acknowledgements --------------------------------------


def test_a_slot_returns_only_after_every_reader_released_it(bpath):
    with ringwire.broadcast_sync(bpath, readers=4, capacity=SMALL, slots=SLOTS) as bc:
        subs = [ringwire.subscribe_sync(bpath) for _ in range(3)]
        bc.wait_ready(3, timeout=10)
        receipt = bc.send_tracked({"a": np.arange(8192, dtype=np.int64)}, timeout=10)
        assert receipt.slots == 1 and not receipt.consumed
        views = [sub.receive(timeout=10)["a"] for sub in subs]
        assert all(v.sum() == np.arange(8192).sum() and not v.flags.writeable for v in views)
        assert bc.statistics().slots_in_use == 1  # one copy, three views of it
        assert [r.slots_held for r in bc.readers()] == [1, 1, 1]
        del views[0]
        gc.collect()
        assert not receipt.consumed
        views.clear()
        gc.collect()
        receipt.wait(timeout=10)
        assert receipt.consumed and bc.statistics().slots_in_use == 0
        assert bc.statistics().releases_received == 3
        for sub in subs:
            sub.close()


def test_a_loan_reaches_every_reader_without_a_copy(bpath):
    with ringwire.broadcast_sync(bpath, readers=2, capacity=SMALL, slots=SLOTS) as bc:
        subs = [ringwire.subscribe_sync(bpath) for _ in range(2)]
        bc.wait_ready(2, timeout=10)
        arr = bc.loan((64, 64), np.float32, timeout=10)
        arr[:] = 1.5
        bc.send({"t": arr}, timeout=10)
        with pytest.raises(ringwire.SlotMisuse):
            bc.send({"t": arr}, timeout=10)
        del arr
        for sub in subs:
            t = sub.receive(timeout=10)["t"]
            assert t.shape == (64, 64) and float(t.sum()) == 1.5 * 64 * 64
            del t
            sub.close()
        assert bc.statistics().inline_fallbacks == 0


def test_async_loaned_steps_in_lockstep_reuse_slots_and_are_never_copied(bpath):
    """The loaned path as a step loop uses it: loan, write in place, send, wait for
    every reader; each reader sees its step's values and drops its view, so the slot
    comes back and the next loan finds one -- more steps than slots, none inline."""

    async def main() -> None:
        seen: dict[int, list[float]] = {}
        done = [anyio.Event() for _ in range(12)]
        count = [0] * 12

        async def reader() -> None:
            async with await ringwire.subscribe(bpath, spin_us=0) as sub:
                got = seen.setdefault(sub.rank, [])
                async for rec in sub:
                    got.append(
                        float(rec["t"][0, 0]) if float(rec["t"].sum()) == rec["k"] * 4096 else -1.0
                    )
                    del rec
                    k = len(got) - 1
                    count[k] += 1
                    if count[k] == 2:
                        done[k].set()

        async with ringwire.broadcast(bpath, readers=2, capacity=SMALL, slots=SLOTS) as bc:
            async with anyio.create_task_group() as tg:
                for _ in range(2):
                    tg.start_soon(reader)
                with anyio.fail_after(20):
                    await bc.wait_ready(2)
                    for k in range(12):
                        arr = await bc.loan((64, 64), np.float32)
                        arr[:] = k
                        await bc.send({"k": k, "t": arr})
                        del arr
                        await done[k].wait()
                    stats = bc.statistics()
                    await bc.aclose()
        assert seen == {0: [float(k) for k in range(12)], 1: [float(k) for k in range(12)]}
        assert stats.inline_fallbacks == 0 and stats.loans_outstanding == 0

    anyio.run(main)


def test_a_reader_that_keeps_its_arrays_stalls_slot_reuse_by_name(bpath):
    with ringwire.broadcast_sync(
        bpath, readers=2, capacity=SMALL * 4, slots=SLOTS, stall_timeout=0.3
    ) as bc:
        keeper, other = ringwire.subscribe_sync(bpath), ringwire.subscribe_sync(bpath)
        bc.wait_ready(2, timeout=10)
        kept = []
        for i in range(6):  # every slot
            bc.send(step(i, 8192), timeout=10)
            kept.append(keeper.receive(timeout=10))
            other.receive(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(ReaderStalled) as info:
            bc.send(step(6, 8192), timeout=10)
        assert 0.25 < time.monotonic() - t0 < 5
        assert info.value.ranks == (keeper.rank,) and info.value.pids == (os.getpid(),)
        assert f"rank {keeper.rank}" in str(info.value) and "holds 6" in str(info.value)
        kept.clear()
        gc.collect()
        bc.send(step(6, 8192), timeout=10)
        assert digest(keeper.receive(timeout=10))[0] == 6
        keeper.close()
        other.close()


def test_slot_policies_error_and_inline(bpath):
    with ringwire.broadcast_sync(bpath, readers=1, capacity=SMALL * 8, slots=SLOTS) as bc:
        sub = ringwire.subscribe_sync(bpath)
        bc.wait_ready(1, timeout=10)
        held = []
        for i in range(6):
            bc.send(step(i, 8192), timeout=10)
            held.append(sub.receive(timeout=10))
        with pytest.raises(SlotsExhausted):
            bc.send(step(6, 8192), slot_policy="error")
        bc.send(step(6, 8192), slot_policy="inline", timeout=10)
        assert bc.statistics().inline_fallbacks == 1
        with pytest.raises(WouldBlock):
            bc.send_nowait(step(7, 8192))
        assert digest(sub.receive(timeout=10))[0] == 6
        held.clear()
        sub.close()


def test_records_sent_with_no_reader_free_their_slots(bpath):
    with ringwire.broadcast_sync(bpath, slots=SLOTS, capacity=SMALL) as bc:
        for i in range(20):
            bc.send(step(i, 8192), timeout=10)
        assert bc.statistics().slots_in_use == 0


# -- joining late, leaving, ranks ----------------------------------------------------------


def test_a_late_joiner_starts_at_the_current_position(bpath):
    with ringwire.broadcast_sync(bpath, readers=3, capacity=SMALL, slots=None) as bc:
        early = ringwire.subscribe_sync(bpath)
        bc.wait_ready(1, timeout=10)
        for i in range(10):
            bc.send(step(i), timeout=10)
        late = ringwire.subscribe_sync(bpath)
        assert late.start > 0 and early.start == 0
        bc.wait_ready(2, timeout=10)
        bc.send(step(10), timeout=10)
        assert digest(late.receive(timeout=10))[0] == 10
        assert [digest(early.receive(timeout=10))[0] for _ in range(11)] == list(range(11))
        early.close()
        late.close()


def test_ranks_requested_taken_and_exhausted(bpath):
    with ringwire.broadcast_sync(bpath, readers=2, slots=None) as bc:
        a = ringwire.subscribe_sync(bpath, rank=1)
        assert a.rank == 1
        with pytest.raises(HandshakeError, match="rank 1 is taken"):
            ringwire.subscribe_sync(bpath, rank=1)
        with pytest.raises(HandshakeError, match="outside"):
            ringwire.subscribe_sync(bpath, rank=5)
        b = ringwire.subscribe_sync(bpath)
        assert b.rank == 0
        with pytest.raises(HandshakeError, match="all 2 reader ranks"):
            ringwire.subscribe_sync(bpath)
        a.close()
        bc.poll_readers()
        c = ringwire.subscribe_sync(bpath, rank=1)  # a leave frees the rank
        assert bc.statistics().refused == 3
        for s in (b, c):
            s.close()


def test_a_clean_leave_is_not_a_loss_even_under_fail(bpath):
    with ringwire.broadcast_sync(bpath, readers=2, slots=SLOTS, on_reader_loss="fail") as bc:
        stay, leave = ringwire.subscribe_sync(bpath), ringwire.subscribe_sync(bpath)
        bc.wait_ready(2, timeout=10)
        bc.send(step(0, 8192), timeout=10)
        rec = leave.receive(timeout=10)  # holds a slot, then leaves
        with pytest.warns(ResourceWarning, match="received slot array"):
            leave.close()
        del rec
        deadline = time.monotonic() + 5
        while bc.statistics().left == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        stats = bc.statistics()
        assert stats.left == 1 and stats.lost == 0 and stats.readers == 1
        bc.send(step(1), timeout=10)
        assert [digest(stay.receive(timeout=10))[0] for _ in range(2)] == [0, 1]
        stay.close()


def test_wait_ready_times_out_and_checks_its_argument(bpath):
    with ringwire.broadcast_sync(bpath, readers=2, slots=None) as bc:
        with pytest.raises(TimeoutError, match="0 of 1 readers"):
            bc.wait_ready(1, timeout=0.05)
        with pytest.raises(ValueError):
            bc.wait_ready(3)


# -- losses and stalls ------------------------------------------------------------------------


def test_a_stalled_reader_is_named_and_can_be_dropped(bpath):
    with ringwire.broadcast_sync(
        bpath, readers=3, capacity=SMALL, slots=None, stall_timeout=0.3
    ) as bc:
        threads, out = start_readers(bpath, 1)
        stalled = ringwire.subscribe_sync(bpath)  # joins, never reads
        bc.wait_ready(2, timeout=10)
        with pytest.raises(ReaderStalled) as info:
            for i in range(10_000):
                bc.send(step(i), timeout=10)
        sent = i
        assert info.value.ranks == (stalled.rank,)
        assert f"rank {stalled.rank} (pid {os.getpid()}" in str(info.value)
        assert isinstance(info.value, TimeoutError)
        assert bc.drop_reader(stalled.rank, "too slow")
        assert not bc.drop_reader(stalled.rank)
        for i in range(sent, sent + 500):
            bc.send(step(i), timeout=10)
        # the dropped reader learns why -- after what it can still read safely, or at once
        with pytest.raises(BrokenResourceError, match="dropped this reader: too slow"):
            while True:
                stalled.receive(timeout=5)
        stalled.close()
        assert bc.statistics().dropped == 1 and bc.statistics().stalls == 1
    join_all(threads)
    (good,) = out.values()
    assert [d[0] for d in good[:-1]] == list(range(sent + 500))


def test_a_user_timeout_while_waiting_for_a_reader_names_it(bpath):
    with ringwire.broadcast_sync(
        bpath, readers=1, capacity=SMALL, slots=None, stall_timeout=None
    ) as bc:
        sub = ringwire.subscribe_sync(bpath)
        bc.wait_ready(1, timeout=10)
        with pytest.raises(ReaderStalled, match=f"rank {sub.rank}"):
            while True:
                bc.send(step(0), timeout=0.1)
        sub.close()


@pytest.mark.parametrize("policy", ["fail", "drop"])
def test_a_reader_that_aborts_is_a_loss(bpath, policy):
    with ringwire.broadcast_sync(bpath, readers=3, slots=None, on_reader_loss=policy) as bc:
        threads, out = start_readers(bpath, 1)
        bad = ringwire.subscribe_sync(bpath)
        bc.wait_ready(2, timeout=10)
        bc.send(step(0), timeout=10)
        bad.abort("my model crashed")
        deadline = time.monotonic() + 5
        while bc.statistics().lost == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert bc.statistics().lost == 1
        if policy == "fail":
            with pytest.raises(BrokenResourceError, match=f"rank {bad.rank} .*my model crashed"):
                bc.send(step(1), timeout=10)
            with pytest.raises(BrokenResourceError):
                bc.wait_ready(1, timeout=1)
        else:
            bc.send(step(1), timeout=10)
    join_all(threads)
    (good,) = out.values()
    if policy == "fail":
        assert "the broadcast failed" in good[-1] and "my model crashed" in good[-1]
        assert [d[0] for d in good[:-1]] == [0]
    else:
        assert good[-1] == "eos" and [d[0] for d in good[:-1]] == [0, 1]


def test_a_reader_socket_that_just_closes_is_a_death(bpath):
    """No closed flag, no abort: end of file alone (what kill -9 looks like)."""
    with ringwire.broadcast_sync(bpath, readers=2, slots=SLOTS, on_reader_loss="drop") as bc:
        sub = ringwire.subscribe_sync(bpath)
        bc.wait_ready(1, timeout=10)
        bc.send(step(0, 8192), timeout=10)
        rec = sub.receive(timeout=10)
        assert bc.statistics().slots_in_use == 1
        sock = socket.socket(fileno=os.dup(sub.fileno()))
        sock.shutdown(socket.SHUT_RDWR)  # the "process" is gone; its views are not
        sock.close()
        deadline = time.monotonic() + 5
        while bc.statistics().lost == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        stats = bc.statistics()
        assert stats.lost == 1 and stats.slots_in_use == 0 and stats.slots_reclaimed == 1
        del rec
        with pytest.raises(BrokenResourceError):
            sub.receive(timeout=5)
        sub.close()


# -- closing and misuse ----------------------------------------------------------------------


def test_closing_ends_every_reader_and_refuses_more(bpath):
    bc = ringwire.broadcast_sync(bpath, readers=2, slots=None)
    threads, out = start_readers(bpath, 2)
    bc.wait_ready(2, timeout=10)
    bc.send(step(0), timeout=10)
    bc.close()
    bc.close()
    with pytest.raises(ClosedResourceError):
        bc.send(step(1))
    join_all(threads)
    assert all(v[-1] == "eos" for v in out.values())
    assert not os.path.exists(bpath)


def test_close_from_another_thread_wakes_a_blocked_send(bpath):
    bc = ringwire.broadcast_sync(bpath, readers=1, capacity=SMALL, slots=None, stall_timeout=None)
    sub = ringwire.subscribe_sync(bpath)
    bc.wait_ready(1, timeout=10)
    errors: list[BaseException] = []

    def flood() -> None:
        try:
            while True:
                bc.send(step(0))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=flood)
    t.start()
    time.sleep(0.2)
    bc.close()
    t.join(10)
    assert not t.is_alive() and isinstance(errors[0], ClosedResourceError)
    sub.close()


def test_another_broadcast_at_the_same_path_is_refused(bpath):
    with ringwire.broadcast_sync(bpath, slots=None):
        with pytest.raises(OSError, match="live"):
            ringwire.broadcast_sync(bpath, slots=None)


def test_bad_arguments(bpath):
    with pytest.raises(ValueError, match="on_reader_loss"):
        ringwire.broadcast_sync(bpath, on_reader_loss="ignore")
    with pytest.raises(ValueError, match="stall_timeout"):
        ringwire.broadcast_sync(bpath, stall_timeout=0)
    with pytest.raises(ValueError, match="readers"):
        ringwire.broadcast_sync(bpath, readers=0)
    assert not os.path.exists(bpath)
    # remote readers: the same checks as a TCP listener's, before anything is bound
    with pytest.raises(ValueError, match="refusing to listen at tcp://0.0.0.0:0"):
        ringwire.broadcast_sync(bpath, tcp="tcp://0.0.0.0:0")  # no keys off loopback
    with pytest.raises(ValueError, match="bad TCP address"):
        ringwire.broadcast_sync(bpath, tcp="tcp://127.0.0.1")
    with pytest.raises(ValueError, match="give tcp="):
        ringwire.broadcast_sync(bpath, insecure=True)
    with pytest.raises(ValueError, match="heartbeat"):
        ringwire.broadcast_sync(bpath, tcp="tcp://127.0.0.1:0", heartbeat=0)
    assert not os.path.exists(bpath)
    with pytest.raises(ConnectionRefusedError, match="tcp://127.0.0.1:5555"):
        ringwire.subscribe_sync("tcp://127.0.0.1:5555", handshake_timeout=5)
    with pytest.raises(ValueError, match="rank"):
        ringwire.subscribe_sync("tcp://127.0.0.1:5555", rank=-2)
    with pytest.raises(FileNotFoundError):
        ringwire.subscribe_sync(bpath)


def test_a_reader_cannot_be_a_writer(bpath):
    with ringwire.broadcast_sync(bpath, slots=None):
        sub = ringwire.subscribe_sync(bpath)
        assert not hasattr(sub, "send")
        assert repr(sub).startswith("<SyncSubscriber rank 0")
        sub.close()


def test_statistics_and_reader_list(bpath):
    with ringwire.broadcast_sync(bpath, readers=2, capacity=SMALL, slots=SLOTS) as bc:
        sub = ringwire.subscribe_sync(bpath, rank=1)
        bc.wait_ready(1, timeout=10)
        bc.send(step(0, 8192), timeout=10)
        bc.send(step(1), timeout=10)
        (info,) = bc.readers()
        assert info.rank == 1 and info.pid == os.getpid() and info.ready
        assert info.behind > 0 and info.slots_held == 1
        stats = bc.statistics()
        assert stats.readers == stats.ready_readers == 1 and stats.joined == 1
        assert stats.fill == info.behind and stats.capacity == SMALL
        rec = sub.receive(timeout=10)
        sub.receive(timeout=10)
        assert sub.statistics().records_received == 2
        assert sub.statistics().slot_arrays_held == 1
        del rec
        sub.close()


def test_closing_a_subscriber_from_another_thread_wakes_its_receive(bpath):
    with ringwire.broadcast_sync(bpath, readers=1, slots=None, on_reader_loss="fail") as bc:
        sub = ringwire.subscribe_sync(bpath, spin_us=0)
        bc.wait_ready(1, timeout=10)
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                sub.receive(timeout=30)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.1)
        sub.close()
        t.join(10)
        assert not t.is_alive() and isinstance(errors[0], ClosedResourceError)
        deadline = time.monotonic() + 5
        while bc.statistics().left == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert bc.statistics().left == 1 and bc.statistics().lost == 0  # a leave, not a loss
        bc.send(step(0), timeout=10)  # the broadcast did not fail


def test_a_cancelled_send_either_raises_or_reaches_every_reader(bpath):
    """An async broadcast send under a cancelled scope completes (every reader gets
    it) or raises with nothing sent -- never raises after sending (the caller would
    send it twice)."""

    async def main() -> None:
        got: list[int] = []
        async with ringwire.broadcast(bpath, readers=1, capacity=SMALL * 4, slots=None) as bc:
            async with await ringwire.subscribe(bpath, spin_us=0) as sub:
                await bc.wait_ready(1)
                sent = []
                for i in range(100):
                    with anyio.CancelScope() as scope:
                        scope.cancel()
                        await bc.send(step(i))
                        sent.append(i)
                await bc.aclose()
                async for rec in sub:
                    got.append(digest(rec)[0])
                assert sent and got == sent

    anyio.run(main)


def test_receive_many_and_the_nowait_forms(bpath):
    with ringwire.broadcast_sync(bpath, readers=1, capacity=SMALL * 4, slots=None) as bc:
        sub = ringwire.subscribe_sync(bpath)
        bc.wait_ready(1, timeout=10)
        with pytest.raises(WouldBlock):
            sub.receive_nowait()
        with pytest.raises(WouldBlock):
            sub.receive_many_nowait()
        with pytest.raises(TimeoutError):
            sub.receive_many(timeout=0.05)
        bc.send_many([step(i) for i in range(50)], timeout=10)
        got = sub.receive_many(20, timeout=10)
        got += sub.receive_many_nowait(10)
        got.append(sub.receive_nowait())
        while len(got) < 50:
            got += sub.receive_many(timeout=10)
        assert [digest(r)[0] for r in got] == list(range(50))
        assert sub.poll_writer()
        with pytest.raises(ValueError):
            sub.receive_many(0)
        sub.close()
        with pytest.raises(ClosedResourceError):
            sub.receive(timeout=1)


# -- one core: the writer is an endpoint, the drivers are the channels' -----------------


def test_the_writer_and_the_readers_run_on_the_channels_drivers(bpath):
    """No driver of its own: the writer's sends and receipts are a channel's, over a
    send-only endpoint; a blocking reader is a SyncChannel that only receives."""
    from ringwire._conn.endpoint import Endpoint
    from ringwire._conn.sync_channel import SyncSending

    with ringwire.broadcast_sync(bpath, readers=1, capacity=SMALL, slots=SLOTS) as bc:
        assert isinstance(bc, SyncSending) and isinstance(bc._core, Endpoint)
        assert ringwire.SyncBroadcaster.send is ringwire.SyncChannel.send
        assert ringwire.Broadcaster.send is ringwire.Channel.send
        assert issubclass(ringwire.SyncBroadcastReceipt, ringwire.SyncReceipt)
        assert issubclass(ringwire.BroadcastReceipt, ringwire.Receipt)
        with ringwire.subscribe_sync(bpath) as sub:
            assert type(sub._chan) is ringwire.SyncChannel
            bc.wait_ready(1, timeout=10)
            receipt = bc.send_tracked(step(0, 8192), timeout=10)
            assert isinstance(receipt, ringwire.SyncBroadcastReceipt)
            rec = sub.receive(timeout=10)
            assert digest(rec)[0] == 0 and not receipt.consumed
            del rec
            gc.collect()
            receipt.wait(timeout=10)


def test_an_async_writer_names_a_stalled_reader_after_stall_timeout(bpath):
    """The stall deadline of the shared waiting loop, through the async driver."""

    async def main() -> None:
        async with ringwire.broadcast(
            bpath, readers=2, capacity=SMALL, slots=None, stall_timeout=0.2
        ) as bc:
            async with await ringwire.subscribe(bpath) as idle:
                await bc.wait_ready(1)
                t0 = time.monotonic()
                with pytest.raises(ReaderStalled) as info:
                    with anyio.fail_after(10):
                        for i in range(10_000):
                            await bc.send(step(i))
                assert info.value.ranks == (idle.rank,) and info.value.pids == (os.getpid(),)
                assert 0.15 < time.monotonic() - t0 < 5
                assert bc.statistics().stalls == 1 and bc.statistics().send_parks >= 1

    anyio.run(main)


def test_a_loan_without_a_slot_pool_is_the_endpoints_misuse_error(bpath):
    """One voice: a broadcast made with slots=None refuses a loan as a channel opened
    with slots=None does (RingwireError itself: no wait can help, so not SlotsExhausted)."""
    with ringwire.broadcast_sync(bpath, slots=None) as bc:
        with pytest.raises(ringwire.RingwireError, match="slots=None") as info:
            bc.loan((4,), np.float32)
        assert type(info.value) is ringwire.RingwireError


def test_a_join_that_gets_no_answer_times_out_after_handshake_timeout(bpath):
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        mute.bind(bpath)
        mute.listen(8)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            ringwire.subscribe_sync(bpath, handshake_timeout=0.2)
        assert 0.15 < time.monotonic() - t0 < 5

        async def join() -> None:
            await ringwire.subscribe(bpath, handshake_timeout=0.2)

        with pytest.raises(TimeoutError):
            anyio.run(join)
    finally:
        mute.close()
        os.unlink(bpath)
