"""Remote broadcast readers across processes (over tcp://127.0.0.1): local and remote
readers of one writer, kill -9 of a remote reader and of the writer, a frozen reader
dropped while its frames are still queued.  (Across two network namespaces, with
loss and partitions: test_broadcast_hosts.py.)"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from support.broadcast import (
    SLOTS,
    SMALL,
    bpath_fixture,  # noqa: F401  (the bpath fixture)
    digest,
    expect,
    reader_main,
    readers,
    remote_writer_main,
    step,
    wait_until,
)
from support.spawn import SPAWN

import ringwire
from ringwire import BrokenResourceError, HandshakeError

pytestmark = pytest.mark.multiprocess  # every test here starts a process
LOOPBACK = "tcp://127.0.0.1:0"
MiB = 1 << 20


def records(n: int) -> list[Any]:
    """Small steps, slot-sized arrays and arrays of several MiB (the arena), mixed."""
    sizes = {3: 32 * 1024, 7: 4 * MiB}
    return [step(i, sizes.get(i % 10, 0)) for i in range(n)]


@pytest.mark.parametrize("remote_backend", ["sync", "asyncio", "trio"])
def test_two_local_readers_and_one_remote_get_every_step_in_order(bpath, remote_backend):
    sent = records(60)
    with ringwire.broadcast_sync(
        bpath, readers=3, capacity=SMALL * 16, slots=SLOTS, tcp=LOOPBACK
    ) as bc:
        url = bc.tcp_address
        args = [(bpath, "sync", {"rank": 0}), (bpath, "asyncio", {"rank": 1})]
        args.append((url, remote_backend, {"rank": 2}))
        with readers(reader_main, *args) as (q, _):
            assert bc.wait_ready(3, timeout=60) == 3
            expect(q, "ready", 3)
            assert {r.rank: bool(r.host) for r in bc.readers()} == {0: False, 1: False, 2: True}
            for rec in sent:
                bc.send(rec, timeout=30)
            bc.close()
            ends = expect(q, "end", 3)
    want = [digest(r) for r in sent]
    assert sorted(e[1] for e in ends) == [0, 1, 2]
    for _, rank, kind, got, detail in ends:
        assert (kind, got) == ("eos", want), (rank, detail)


@pytest.mark.parametrize("policy", ["fail", "drop"])
def test_kill_9_of_a_remote_reader_is_a_loss(bpath, policy):
    with ringwire.broadcast_sync(
        bpath, readers=3, slots=SLOTS, tcp=LOOPBACK, on_reader_loss=policy
    ) as bc:
        # one queue each: a process killed while it holds a shared queue's write lock
        # (its feeder thread just sent "ready") would leave the other unable to report
        local = readers(reader_main, (bpath, "sync", {"rank": 0}))
        remote = readers(reader_main, (bc.tcp_address, "sync", {"rank": 2}))
        with local as (q, _), remote as (rq, procs):
            bc.wait_ready(2, timeout=60)
            expect(q, "ready", 1)
            expect(rq, "ready", 1)
            for i in range(5):
                bc.send(step(i, 32 * 1024), timeout=10)
            os.kill(procs[0].pid, signal.SIGKILL)  # the remote reader
            procs[0].join(10)
            t0 = time.monotonic()
            wait_until(lambda: bc.poll_readers() >= 0 and bc.statistics().lost == 1, 10)
            assert time.monotonic() - t0 < 3.0  # a reset, not a heartbeat
            if policy == "fail":
                with pytest.raises(BrokenResourceError, match="rank 2 .*on '.*'.*lost"):
                    bc.send(step(99), timeout=10)
                end = expect(q, "end", 1)[0]
                assert end[2] == "broken" and "rank 2" in end[4]
                assert [g[0] for g in end[3]] == list(range(5))
            else:
                for i in range(5, 10):
                    bc.send(step(i, 32 * 1024), timeout=10)
                wait_until(lambda: bc.statistics().slots_in_use == 0, 10)  # its shares
                bc.close()
                end = expect(q, "end", 1)[0]
                assert end[2] == "eos" and [g[0] for g in end[3]] == list(range(10))


def test_a_frozen_remote_reader_dropped_keeps_its_slots_until_zeromq_lets_go(bpath):
    """Frames queued to a reader that went are still read by ZeroMQ: its shares (and
    its rank) come back only once they are sent or discarded, never reused meanwhile."""
    with ringwire.broadcast_sync(bpath, readers=2, slots=SLOTS, tcp=LOOPBACK) as bc:
        with readers(reader_main, (bc.tcp_address, "sync", {"rank": 1})) as (q, procs):
            bc.wait_ready(1, timeout=60)
            expect(q, "ready", 1)
            os.kill(procs[0].pid, signal.SIGSTOP)  # frozen: its socket stops reading
            try:
                for i in range(4):
                    bc.send(step(i, 16 * MiB), timeout=30)  # more than the kernel buffers
                assert bc.statistics().large_in_use == 4
                assert bc.drop_reader(1, "frozen")
                # its frames may still be queued: nothing of theirs is reused yet
                assert bc.statistics().large_in_use > 0
                with pytest.raises(HandshakeError, match="rank 1 is taken"):
                    ringwire.subscribe_sync(bc.tcp_address, rank=1)
                # ...until ZeroMQ let go of them (the closed socket's grace and linger)
                wait_until(lambda: bc.poll_readers() == 0 and bc.statistics().large_in_use == 0, 15)
                late = ringwire.subscribe_sync(bc.tcp_address, rank=1)
                late.close()
            finally:
                os.kill(procs[0].pid, signal.SIGCONT)
            end = expect(q, "end", 1)[0]
            # it hears the reason if it reads before its socket closes, else the hang-up
            assert end[2] == "broken"
            got = [g[0] for g in end[3]]
            assert got == [0, 1, 2, 3][: len(got)]  # what it read was intact (digest)


def test_kill_9_of_the_writer_is_seen_by_a_remote_reader(bpath):
    inbox, outbox = SPAWN.Queue(), SPAWN.Queue()
    w = SPAWN.Process(target=remote_writer_main, args=(bpath, inbox, outbox, 30, 32 * 1024))
    w.start()
    try:
        kind, url = outbox.get(timeout=60)
        assert kind == "tcp"
        with readers(reader_main, (url, "sync", {"rank": 3})) as (q, _):
            expect(q, "ready", 1)
            inbox.put(1)
            assert outbox.get(timeout=60) == ("sent", 30)
            os.kill(w.pid, signal.SIGKILL)
            end = expect(q, "end", 1, timeout=20)[0]
        assert end[2] == "broken" and [g[0] for g in end[3]] == list(range(30))
    finally:
        w.kill()
        w.join(10)
        for qq in (inbox, outbox):
            qq.close()
            qq.join_thread()
