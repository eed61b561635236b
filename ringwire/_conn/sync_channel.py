"""The blocking driver: :class:`SyncChannel`, for threads and plain scripts.

Like the async driver it adds only waiting to the
:class:`~ringwire._conn.endpoint.Endpoint`: fast paths call the endpoint directly,
and a loop of :mod:`ringwire._conn.waits` runs through :meth:`SyncSending._run`, which
performs each wait with a :class:`SyncWaker`: one thread ``poll()`` s the transport's
descriptor, the others wait on a condition variable.  ``timeout`` arguments become the
loops' deadlines.  One sender and one receiver run at a time (a lock each); other
threads wait their turn, within their timeout.  The sending half
(:class:`SyncSending`) is shared with the blocking broadcast writer
(:class:`~ringwire.SyncBroadcaster`, a send-only endpoint); a broadcast reader
(:class:`~ringwire.SyncSubscriber`) is a :class:`SyncChannel` that only receives.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from anyio import EndOfStream, WouldBlock

from .._errors import NeedSlot
from .._pool.slotconfig import check_policy, loan_spec
from . import waits
from .driving import EndpointFacade, ReceiptBase, warn_held
from .endpoint import EMPTY, UNSET, Endpoint

__all__ = [
    "SyncChannel",
    "SyncReceipt",
    "SyncSending",
    "SyncWaker",
    "close_fds",
    "eventfd_clear",
    "eventfd_new",
    "eventfd_ring",
    "receive_turn",
]


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _acquire(lock: threading.Lock, deadline: float | None) -> None:
    if deadline is None:
        lock.acquire()
    elif not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
        raise TimeoutError("timed out waiting for another thread using this channel")


# -- wake-up descriptors: eventfds a polling thread includes, rung from any thread ----


def eventfd_new() -> int:
    """A non-blocking eventfd for :func:`eventfd_ring` / :func:`eventfd_clear`; close it
    with :func:`close_fds` from a ``weakref.finalize`` of its owner (a thread may still
    poll it when the owner is closed).  Raises ``OSError`` (out of descriptors)."""
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


def eventfd_ring(fd: int) -> None:
    """Make ``fd`` readable (never raises: one closed meanwhile has nobody to wake)."""
    with contextlib.suppress(OSError):
        os.eventfd_write(fd, 1)


def eventfd_clear(fd: int) -> None:
    """Consume what rang ``fd`` (never raises, never waits)."""
    with contextlib.suppress(OSError):
        os.eventfd_read(fd)


def close_fds(*fds: int) -> None:
    """Close every one of ``fds``, ignoring those already closed."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class SyncWaker:
    """How the threads of one endpoint wait for its wake generation to move.

    One thread polls the transport's descriptor, the others wait on ``cv``.  A drain
    done by another thread while one polls -- ``poll_peer``, a receiver reading the
    end, a sender noticing the hang-up -- may consume the very readiness the poller
    sleeps on (the doorbell byte, the TCP transport's eventfd), so the endpoint's
    ``on_drain`` kicks the poller through an eventfd of our own that it polls too."""

    def __init__(self, core: Endpoint) -> None:
        self.core = core
        self._lock = threading.Lock()
        self.cv = threading.Condition(self._lock)
        self._sleepers = 0  # threads in cv.wait(): the poller notifies only when any
        self._polling = False
        self._poller = 0  # the thread in poll() (while _polling)
        self._poll = select.poll()
        self._poll.register(core.transport.fileno(), select.POLLIN)
        self._kick = eventfd_new()
        self._poll.register(self._kick, select.POLLIN)
        self._fin = weakref.finalize(self, close_fds, self._kick)
        core.on_drain = self._drained

    def _drained(self) -> None:
        # (any thread; the poller's own drains need no kick)
        if self._polling and self._poller != threading.get_ident():
            eventfd_ring(self._kick)

    def wait(self, gen: int, until: float | None) -> None:
        """Until a wake-up after generation ``gen``, or ``until`` (then it returns
        quietly: the loop decides what a timeout means)."""
        core = self.core
        lock = self._lock  # (the condition's own: entered without its Python wrapper)
        with lock:
            while core.wake_gen == gen and not core.eof and not core.closed and core.broken is None:
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    return
                if self._polling:
                    self._sleepers += 1
                    try:
                        self.cv.wait(left)
                    finally:
                        self._sleepers -= 1
                    continue
                self._polling = True
                self._poller = threading.get_ident()
                lock.release()
                try:
                    if core.wake_gen != gen:
                        continue  # a drain elsewhere after the check (it saw no poller)
                    ms = -1 if left is None else max(1, math.ceil(left * 1000))
                    ready = self._poll.poll(ms)
                    if ready and not core.closed:
                        kick = self._kick
                        if kick >= 0 and (ready[-1][0] == kick or ready[0][0] == kick):
                            eventfd_clear(kick)
                        core.drain()
                finally:
                    lock.acquire()
                    self._polling = False
                    if self._sleepers:
                        self.cv.notify_all()

    def close(self) -> None:
        """Close the kick descriptor now if no thread polls (else when collected)."""
        with self.cv:
            if self._kick >= 0 and not self._polling:
                self._poll.unregister(self._kick)
                self._fin()
                self._kick = -1


class SyncReceipt(ReceiptBase):
    """What :meth:`SyncChannel.send_tracked` returns: ``receipt.wait(timeout)``."""

    __slots__ = ()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the peer has released every slot the record's arrays used, as
        :meth:`Receipt.wait` (returns too when the peer is gone); ``timeout``: seconds,
        ``None`` to wait for ever.  Raises ``TimeoutError`` when ``timeout`` passes
        first (the record stays sent)."""
        if self._pairs:
            self._run(waits.consumed(self._core, self._pairs, _deadline(timeout)))


class SyncSending:
    """The sending half of the blocking driver: what :class:`SyncChannel` and the
    broadcast writer (:class:`~ringwire.SyncBroadcaster`) share -- the loop runner and
    every send.  A subclass sets ``_core``, ``_waker``, ``_send_lock``, and
    ``_receipt`` (what :meth:`send_tracked` returns)."""

    _core: Endpoint
    _waker: SyncWaker
    _send_lock: threading.Lock
    _receipt: type[SyncReceipt] = SyncReceipt

    def _run(self, loop: waits.Loop[Any]) -> Any:
        """Run a waiting loop: perform each wait it asks for; its result is ours."""
        wait = self._waker.wait
        try:
            w = next(loop)
            while True:
                wait(w.gen, w.until)
                w = loop.send(None)
        except StopIteration as stop:
            return stop.value
        finally:
            loop.close()

    def _locked(self, loop: waits.Loop[Any], deadline: float | None) -> Any:
        """Run a waiting loop holding the send lock (taken by ``deadline``)."""
        _acquire(self._send_lock, deadline)
        try:
            return self._run(loop)
        finally:
            self._send_lock.release()

    def _wait_receipt(self, loop: waits.Loop[Any]) -> Any:
        """Run a receipt's waiting loop (a driver whose pool needs the send lock for
        that takes it here)."""
        return self._run(loop)

    # -- send -------------------------------------------------------------------------

    def send(
        self, item: Any, timeout: float | None = None, *, slot_policy: str | None = None
    ) -> None:
        """Send one record, waiting up to ``timeout`` seconds for room in the ring (and,
        policy "wait", for a free tensor slot).  Raises ``TimeoutError``, and what
        :meth:`Channel.send` raises."""
        core = self._core
        pool = core.pool
        if pool is None:
            payload = core.encode(item)  # outside the lock; placing needs it held
        lock = self._send_lock
        deadline = None
        if not lock.acquire(False):
            deadline = _deadline(timeout)
            _acquire(lock, deadline)
        try:
            if pool is not None:
                # a record in which nothing was placed is sent like one without a pool
                core.slot_safe_point()
                try:
                    payload, placed = core.encode_placed(item, slot_policy)
                except NeedSlot:  # wait for a slot, encode again, publish
                    loop = waits.send_placed(
                        core, item, slot_policy, deadline or _deadline(timeout)
                    )
                    self._run(loop)
                    return
                if placed:
                    deadline = deadline or _deadline(timeout)
                    self._run(waits.publish_placed(core, payload, placed, deadline))
                    return
            if core.try_send(payload):
                return
            if deadline is None:
                deadline = _deadline(timeout)
            self._run(waits.room(core, payload, deadline))
        finally:
            lock.release()

    def send_tracked(
        self, item: Any, timeout: float | None = None, *, slot_policy: str | None = None
    ) -> SyncReceipt:
        """:meth:`send`, returning a :class:`SyncReceipt` that completes once the peer
        has released every slot the record used."""
        core = self._core
        if core.pool is None:
            self.send(item, timeout)
            return self._receipt(core, (), self._wait_receipt)
        deadline = _deadline(timeout)
        _acquire(self._send_lock, deadline)
        try:
            placed = self._run(waits.send_placed(core, item, slot_policy, deadline))
        finally:
            self._send_lock.release()
        return self._receipt(core, [(slot, gen) for slot, gen, _ in placed], self._wait_receipt)

    def loan(
        self,
        shape: Sequence[int],
        dtype: Any,
        *,
        timeout: float | None = None,
        device: Any = None,
        slot_policy: str | None = None,
    ) -> Any:
        """Blocking :meth:`Channel.loan` (waits up to ``timeout`` seconds for a slot)."""
        core = self._core
        pool = core.require_pool()
        spec = loan_spec(shape, dtype, device)
        policy = check_policy(slot_policy) or pool.config.policy
        arr = core.loan_now(pool, spec, policy)
        if arr is not None:
            return arr
        return self._run(waits.loan(core, spec, policy, _deadline(timeout)))

    def send_nowait(self, item: Any, *, slot_policy: str | None = None) -> None:
        """As :meth:`Channel.send_nowait` (``WouldBlock`` when it would wait)."""
        with self._send_lock:
            if not self._core.send_nowait(item, slot_policy):
                raise WouldBlock

    def send_many(
        self,
        items: Iterable[Any],
        timeout: float | None = None,
        *,
        slot_policy: str | None = None,
    ) -> None:
        """Send several records, publishing as many as fit at once.  On timeout a
        prefix of them has been sent.  (As :meth:`Channel.send_many` for slots.)"""
        core = self._core
        if core.pool is not None:
            items = list(items)
            deadline = _deadline(timeout)
            _acquire(self._send_lock, deadline)
            try:
                self._run(waits.send_many_placed(core, items, slot_policy, deadline))
            finally:
                self._send_lock.release()
            return
        payloads = core.encode_many(items)
        deadline = _deadline(timeout)
        _acquire(self._send_lock, deadline)
        try:
            self._run(waits.room_many(core, payloads, None, deadline))
        finally:
            self._send_lock.release()


class SyncChannel(EndpointFacade, SyncSending):
    """The blocking endpoint of a connection, for threads and plain scripts.

    ``send`` / ``receive`` take ``timeout`` (seconds, ``None`` = forever) and raise
    :class:`TimeoutError` when it expires.  Thread-safe: one sender and one receiver
    run at a time, others wait for their turn.  Made by :func:`ringwire.connect_sync`,
    :meth:`ringwire.PairEnd.connect_sync` and :meth:`ringwire.SyncListener.accept`.
    """

    def __init__(self, core: Endpoint) -> None:
        super().__init__(core)
        self._waker = SyncWaker(core)
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()

    def poll_peer(self) -> bool:
        """As :meth:`Channel.poll_peer`: notice a peer that just died, without waiting;
        returns whether the peer is still there."""
        core = self._core
        with self._waker.cv:
            if not core.closed:
                core.drain()
        return not (core.eof or core.broken is not None)

    def send_eof(self) -> None:
        """As :meth:`Channel.send_eof`."""
        with self._send_lock:
            self._core.send_eof()

    # -- receive ----------------------------------------------------------------------

    def receive(self, timeout: float | None = None, *, type: Any = UNSET) -> Any:
        """Receive one record, waiting up to ``timeout`` seconds.

        Raises ``EndOfStream`` after the peer closed (and everything was received),
        ``BrokenResourceError`` if it died, ``TimeoutError`` on timeout, and what
        :meth:`Channel.receive` raises."""
        core = self._core
        dec = core.dec if type is UNSET else core.decoder_for(type)
        lock = self._recv_lock
        deadline = None
        if not lock.acquire(False):
            deadline = _deadline(timeout)
            _acquire(lock, deadline)
        try:
            obj = core.try_receive(dec)
            if obj is not EMPTY:
                return obj
            # the hot path: a peer that answers within the spin budget costs no loop
            if core.spin(core.receive_ready):
                obj = core.try_receive(dec)
                if obj is not EMPTY:
                    return obj
            if deadline is None:
                deadline = _deadline(timeout)
            return self._run(waits.receive(core, dec, deadline))
        finally:
            lock.release()

    def receive_nowait(self, *, type: Any = UNSET) -> Any:
        """The next record, without waiting (``type`` as :meth:`receive`).  Raises
        :class:`anyio.WouldBlock` if none is published yet, and otherwise what
        :meth:`receive` raises (``EndOfStream``, ``BrokenResourceError``,
        ``ClosedResourceError``, :class:`DecodeError`)."""
        core = self._core
        with self._recv_lock:
            return core.receive_nowait(core.decoder_for(type))

    def receive_many(
        self, max_n: int = 1024, timeout: float | None = None, *, type: Any = UNSET
    ) -> list[Any]:
        """Wait for at least one record, then return every published one, up to
        ``max_n`` (a list, in order; one ring commit for the batch).  ``timeout``:
        seconds, ``None`` to wait for ever.  Raises ``TimeoutError`` when it passes,
        ``ValueError`` for ``max_n < 1``, and what :meth:`receive` raises."""
        if max_n < 1:
            raise ValueError("max_n must be at least 1")
        core = self._core
        dec = core.decoder_for(type)
        deadline = _deadline(timeout)
        _acquire(self._recv_lock, deadline)
        try:
            out = core.try_receive_many(dec, max_n)
            if out:
                return out
            result: list[Any] = self._run(waits.receive_many(core, dec, max_n, deadline))
            return result
        finally:
            self._recv_lock.release()

    def receive_many_nowait(self, max_n: int = 1024, *, type: Any = UNSET) -> list[Any]:
        """Every record published and not yet read, up to ``max_n`` (a list, in order),
        without waiting.  Raises ``WouldBlock`` if there is none, ``ValueError`` for
        ``max_n < 1``, and otherwise what :meth:`receive` raises."""
        core = self._core
        with self._recv_lock:
            return core.receive_many_nowait(core.decoder_for(type), max_n)

    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                yield self.receive()
            except EndOfStream:
                return

    # -- closing ----------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """As :meth:`Channel.abort`: close, telling the peer why."""
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, not {type(reason).__name__}")
        self._core.abort(reason)
        self.close()

    def close(self) -> None:
        """Close: the peer receives what was sent, then ``EndOfStream``.  Threads
        blocked on this endpoint get ``ClosedResourceError``."""
        core = self._core
        cv = self._waker.cv
        with cv:
            if not core.mark_closed():
                return
        core.transport.shutdown()  # wakes a thread blocked in poll
        with cv:
            cv.notify_all()
        with self._send_lock, self._recv_lock:
            held = core.release()
        self._waker.close()
        if held:
            warn_held(self, held)

    def __enter__(self) -> SyncChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
            core.abandon(self)


def receive_turn(chan: SyncChannel) -> threading.Lock:
    """The lock a receiver of ``chan`` holds (a :class:`~ringwire.SyncListener`'s
    fan-in takes it too, so that a connection has one reader at a time)."""
    return chan._recv_lock  # noqa: SLF001 (this module's own class)
