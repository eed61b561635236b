"""Finalizer-safe release queue: how a garbage-collected view gives its slot back.

A received tensor's ``weakref.finalize`` callback can run in *any* thread and at *any*
bytecode -- including inside the transport's own code, when a collection is triggered
there, and including while that code holds the transport's locks.  So the callback must
not block, must not take a lock the interrupted code may hold, and must still never
lose a release.

Theory of operation
-------------------
``push`` appends ``(slot, generation)`` to a :class:`collections.deque` (``append`` and
``popleft`` are atomic in CPython: no lock), then tries to flush.  ``flush`` takes the
flush lock *without blocking*; if it gets it, it drains the deque into the sink (the
consumer->producer release lane) and releases the lock, then looks at the deque again
and repeats while it is non-empty.  If it does not get the lock, someone else is
flushing -- possibly the very code this finalizer interrupted, in this same thread --
and that flusher re-checks the deque after releasing the lock, so it will carry the
new item too.  Nothing is lost in the window between "drained" and "released": the
re-check happens after the release.

When the sink cannot take a batch right now (the lane is full), the batch goes back to
the front of the deque, order kept, and is pushed at the next *safe point*: every send
and receive on the channel calls :meth:`flush`, and so does the producer's doorbell
wake-up on this side.  Once the queue is closed (the connection is gone: the producer
reclaims every slot on its own), pushes are dropped, and the sink -- which may touch
memory that is about to be unmapped -- is never called again: :meth:`close` takes the
flush lock (blocking: it runs in ordinary code, never in a finalizer), so it waits for
a flush in progress to finish.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

__all__ = ["ReleaseQueue"]

Sink = Callable[[Sequence[tuple[int, int]]], bool]


class ReleaseQueue:
    """Collects slot releases from finalizers and hands them to ``sink`` in batches.

    ``sink(batch)`` writes the batch and returns ``True``, or returns ``False`` when it
    cannot take it now (the batch is kept and retried at the next flush).  It is only
    ever called by one thread at a time.
    """

    def __init__(self, sink: Sink, max_batch: int | None = None) -> None:
        if max_batch is not None and max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._sink = sink
        self._max_batch = max_batch
        self.pending: deque[tuple[int, int]] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self.pushed = 0
        self.flushed = 0

    def __len__(self) -> int:
        return len(self.pending)

    @property
    def closed(self) -> bool:
        return self._closed

    def push(self, slot: int, generation: int) -> None:
        """Queue one release and try to flush.  Never blocks; safe in finalizers."""
        if self._closed:
            return
        self.pending.append((slot, generation))
        self.pushed += 1
        self.flush()

    def flush(self) -> bool:
        """Hand everything pending to the sink.  Never blocks.

        Returns ``True`` when nothing is left pending (or the queue is closed),
        ``False`` when another thread is flushing or the sink refused a batch.
        """
        while self.pending and not self._closed:
            if not self._lock.acquire(blocking=False):
                return False  # the holder re-checks after releasing: see the module docstring
            try:
                if self._closed:
                    return True
                batch: list[tuple[int, int]] = []
                limit = self._max_batch or -1
                while len(batch) != limit:
                    try:
                        batch.append(self.pending.popleft())
                    except IndexError:
                        break
                if batch:
                    if not self._sink(batch):
                        self.pending.extendleft(reversed(batch))
                        return False
                    self.flushed += len(batch)
            finally:
                self._lock.release()
        return True

    def close(self, blocking: bool = True) -> list[tuple[int, int]]:
        """Stop for good; return what was still pending (for statistics or warnings).

        Blocks until a flush in progress has finished; never call it from a finalizer.
        With ``blocking=False`` (for ``__del__`` methods, which may run inside garbage
        collection in the middle of a flush in this very thread) it does not wait: a
        flush in progress finishes its current batch and stops, so the caller must not
        unmap anything the sink touches -- only drop its references to it.
        """
        got = self._lock.acquire(blocking)
        try:
            self._closed = True
            left = list(self.pending)
            self.pending.clear()
        finally:
            if got:
                self._lock.release()
        return left
