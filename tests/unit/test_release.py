"""Tests of ringwire._wire.release: releases from finalizers are never lost or blocked."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Sequence

from ringwire._wire.release import ReleaseQueue


class Sink:
    def __init__(self, accept: bool = True) -> None:
        self.got: list[tuple[int, int]] = []
        self.accept = accept
        self.calls = 0
        self.busy = threading.Lock()

    def __call__(self, batch: Sequence[tuple[int, int]]) -> bool:
        assert self.busy.acquire(blocking=False), "sink entered by two threads at once"
        try:
            self.calls += 1
            if not self.accept:
                return False
            self.got.extend(batch)
            return True
        finally:
            self.busy.release()


def test_push_reaches_sink() -> None:
    sink = Sink()
    q = ReleaseQueue(sink)
    q.push(1, 0)
    q.push(2, 5)
    assert sink.got == [(1, 0), (2, 5)] and len(q) == 0


def test_refused_batch_is_kept_in_order_and_retried() -> None:
    sink = Sink(accept=False)
    q = ReleaseQueue(sink)
    for i in range(5):
        q.push(i, 0)
    assert sink.got == [] and len(q) == 5
    sink.accept = True
    assert q.flush()
    assert sink.got == [(i, 0) for i in range(5)]


def test_push_from_inside_the_sink_is_not_lost_and_does_not_deadlock() -> None:
    """A finalizer that fires while this very thread is flushing."""
    q: ReleaseQueue
    got: list[tuple[int, int]] = []

    def sink(batch: Sequence[tuple[int, int]]) -> bool:
        got.extend(batch)
        if batch[0][0] < 3:
            q.push(batch[0][0] + 1, 0)  # re-entrant push: try-lock fails, item stays queued
        return True

    q = ReleaseQueue(sink)
    q.push(0, 0)
    assert got == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert len(q) == 0


def test_many_threads_push_concurrently_nothing_lost_or_duplicated() -> None:
    sink = Sink()
    slow = threading.Event()

    def slow_sink(batch: Sequence[tuple[int, int]]) -> bool:
        if not slow.is_set():
            time.sleep(0.0005)
        return sink(batch)

    q = ReleaseQueue(slow_sink)
    n_threads, per = 8, 2000

    def work(t: int) -> None:
        for i in range(per):
            q.push(t * per + i, t)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    slow.set()
    q.flush()
    assert sorted(sink.got) == sorted(
        (t * per + i, t) for t in range(n_threads) for i in range(per)
    )
    assert q.pushed == q.flushed == n_threads * per


class Holder:
    """A cyclic object: only the cycle collector frees it, at an arbitrary moment."""

    def __init__(self, q: ReleaseQueue, slot: int) -> None:
        self.me = self
        weakref.finalize(self, q.push, slot, 0)


def test_gc_triggered_releases_during_a_flush_loop() -> None:
    sink = Sink()
    q = ReleaseQueue(sink)
    gc.collect()
    for slot in range(3000):
        Holder(q, slot)  # garbage immediately; collected whenever the GC decides
        if slot % 7 == 0:
            q.flush()
        if slot % 500 == 0:
            gc.collect()
    gc.collect()
    q.flush()
    assert sorted(sink.got) == [(s, 0) for s in range(3000)]


def test_gc_in_other_threads_while_main_flushes() -> None:
    sink = Sink()
    q = ReleaseQueue(sink)
    stop = threading.Event()

    def collector() -> None:
        while not stop.is_set():
            for i in range(50):
                Holder(q, 10_000 + i)
            gc.collect()

    t = threading.Thread(target=collector)
    t.start()
    try:
        for slot in range(2000):
            q.push(slot, 1)
    finally:
        stop.set()
        t.join()
    gc.collect()
    q.flush()
    mine = [x for x in sink.got if x[1] == 1]
    assert sorted(mine) == [(s, 1) for s in range(2000)]
    assert q.pushed == q.flushed


def test_close_drops_later_pushes_and_never_calls_the_sink_again() -> None:
    sink = Sink(accept=False)
    q = ReleaseQueue(sink)
    q.push(1, 1)
    assert q.close() == [(1, 1)]
    calls = sink.calls
    sink.accept = True
    q.push(2, 2)
    assert q.flush() and sink.calls == calls and sink.got == [] and q.closed


def test_max_batch_splits_a_flush_into_several_sink_calls() -> None:
    batches: list[int] = []

    def sink(batch: Sequence[tuple[int, int]]) -> bool:
        batches.append(len(batch))
        return True

    q = ReleaseQueue(sink, max_batch=3)
    accept = q._lock.acquire()  # hold the flush lock: pushes just queue
    assert accept
    for i in range(8):
        q.push(i, 0)
    q._lock.release()
    assert q.flush() and batches == [3, 3, 2] and q.flushed == 8


def test_non_blocking_close_while_a_flush_is_in_progress() -> None:
    """``__del__`` may close the queue from inside a flush of this very thread."""
    q: ReleaseQueue
    seen: list[list[tuple[int, int]]] = []

    def sink(batch: Sequence[tuple[int, int]]) -> bool:
        seen.append(list(batch))
        left = q.close(blocking=False)  # the lock is ours: must not wait
        assert left == []
        return True

    q = ReleaseQueue(sink)
    q.push(1, 1)
    assert q.closed and seen == [[(1, 1)]]
    q.push(2, 2)  # dropped: closed
    assert seen == [[(1, 1)]]
