"""The blocking listener: :class:`SyncListener` and :func:`listen_sync`.

The twin of :class:`~ringwire.Listener`, for threads: :meth:`~SyncListener.accept`
returns :class:`~ringwire.SyncChannel` s, and its fan-in (:meth:`~SyncListener.receive`,
iteration) waits with ``poll()`` over every connection's descriptor, the listening
socket and a wake-up descriptor of its own.  It accepts while it waits (the handshake
in the waiting thread, bounded by ``handshake_timeout``), and a connection whose peer
died wakes it like a record does (the hang-up is readable on the descriptor it polls),
so a dead peer is dropped, never waited on.  ``close()`` from another thread rings
the wake-up descriptor.  What does not wait -- reading one connection, dropping a dead
one, the counters, spinning and parking -- is :class:`~.listener.ListenerBase`'s,
shared with the async listener; this module adds the receive turns and the poll.

Threads: the fan-in reads a connection only while it holds that connection's receive
turn (the lock a ``SyncChannel``'s receivers take, :func:`.sync_channel.receive_turn`),
so a connection is read by the fan-in or directly, one at a time; the list of
connections and the counters are guarded by one lock; one thread accepts (and runs a
handshake) at a time.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import select
import socket
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

from anyio import ClosedResourceError, WouldBlock

from .._errors import RingwireError
from .._net.keys import ServerKeys
from .._pool.segment import pid_alive, sweep
from .._pool.slotconfig import DEFAULT_SLOTS, SlotConfig
from .._shm.handshake import drive_sync
from .._shm.sockets import bind_unix_socket, check_peer
from .._wire.ring import MAX_CAPACITY
from .endpoint import DEFAULT_SPIN_US, EMPTY, Endpoint
from .listener import ListenerBase
from .netconn import DEFAULT_HEARTBEAT
from .options import DEFAULT_HANDSHAKE_TIMEOUT
from .sync_channel import (
    SyncChannel,
    close_fds,
    eventfd_clear,
    eventfd_new,
    eventfd_ring,
    receive_turn,
)

__all__ = ["SyncListener", "listen_sync"]

logger = logging.getLogger("ringwire")


class _Held(NamedTuple):
    """One connection of a :class:`SyncListener`: what users get, the endpoint the
    fan-in reads, and the channel's receive turn (its one reader at a time)."""

    chan: SyncChannel
    core: Endpoint
    turn: threading.Lock


def _sweep_when_dead_sync(pid: int, patience: float = 0.1) -> None:
    """Blocking ``listener._sweep_when_dead``, with a short patience: a client whose socket
    closed because it died is gone within milliseconds (one still alive can unlink its
    own names)."""
    deadline = time.monotonic() + patience
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return
        time.sleep(0.002)
    sweep()


class SyncListener(ListenerBase[SyncChannel, _Held]):
    """The blocking :class:`Listener`, for threads and plain scripts::

        with ringwire.listen_sync(path) as listener:
            for conn, record in listener:           # fair fan-in over all connections
                conn.send(reply)

    :meth:`accept` returns each new connection (a :class:`SyncChannel`) as well, for
    per-connection threads.  Every accepted connection also takes part in the fan-in
    (:meth:`receive`, :meth:`receive_many`, :meth:`receive_nowait`, iteration), which
    accepts new connections while it waits: the handshakes run in the thread that
    accepts or waits in the fan-in, each bounded by ``handshake_timeout``.  A
    connection is read by the fan-in or directly (``conn.receive()``), one at a time:
    the fan-in holds a connection's receive turn while it waits on it.  A connection
    that breaks (crash, bad frame, undecodable record) is closed, logged, counted and
    dropped from the fan-in; one that ends cleanly is dropped silently.  Closing the
    listener closes every connection it accepted and removes the socket file.  The
    keywords are :class:`Listener`'s; the address is bound at once.
    """

    def _open(self) -> None:
        """The locks, the wake-up descriptors; the address bound (``OSError`` if it
        cannot be)."""
        self._lock = threading.Lock()  # the lists and counters below
        self._guard = self._lock  # (the base's fan-in bookkeeping takes it too)
        self._arrived = threading.Condition(self._lock)  # accept() waits on it
        self._new: deque[SyncChannel] = deque()  # accepted, not yet taken by accept()
        self._accepting = threading.Lock()  # one thread accepts (and handshakes) at a time
        self._reading = threading.Lock()  # one thread reads the fan-in at a time
        self._sock: socket.socket | None = None
        # _kick: rung when a connection joins (from any thread), read by the fan-in
        # alone (one reader at a time); _closing: rung once by close() and never read,
        # so every poll after it returns at once.  Both live as long as the listener
        # (a thread may still be polling them when close() returns).
        self._kick = eventfd_new()
        self._closing = eventfd_new()
        self._fin = weakref.finalize(self, close_fds, self._kick, self._closing)
        try:
            if self.tcp:
                self._open_acceptor()
            else:
                self._sock = bind_unix_socket(self.path, self._backlog)
                sweep()  # names left by dead processes (as Listener)
        except BaseException:
            self._closed = True  # (nothing to close, nothing to warn about)
            self._fin()
            raise

    def _prune(self) -> list[_Held]:
        # (under _lock) those closed leave the queue of those accept() has not handed
        # out yet too (a server that only reads the fan-in would otherwise keep them)
        closed = super()._prune()
        if self._new and (closed or len(self._new) > len(self._conns)):
            self._new = deque(c for c in self._new if not c.closed)
        return closed

    # -- accepting ------------------------------------------------------------------------

    def _adopt(self, transport: Any) -> SyncChannel:
        core = self._endpoint(transport)
        chan = SyncChannel(core)
        with self._lock:
            closed = self._closed
            if not closed:
                self._accepted += 1
                self._prune()
                self._conns.append(_Held(chan, core, receive_turn(chan)))
                self._new.append(chan)
                self._arrived.notify_all()
        if closed:
            chan.close()
            raise ClosedResourceError
        eventfd_ring(self._kick)  # a fan-in that polls reads the newcomer too
        return chan

    def _accept_ready(self, *, for_accept: bool = False) -> bool:
        """Accept what is waiting at the socket now, without waiting for a client:
        ``True`` if a connection was added.  A Unix client's handshake runs here (at
        most ``handshake_timeout``); a refused one is logged and counted.  A fan-in
        that polls meanwhile leaves the listening socket to us, so ``for_accept``
        rings it when we are done (it takes what is still waiting there)."""
        if not self._accepting.acquire(False):
            return False  # another thread accepts
        try:
            if self._closed:
                return False
            acceptor = self._acceptor
            if acceptor is not None:
                done, refused = acceptor.step()
                for exc in refused:
                    self._refused_one(exc)
                for t in done:
                    self._adopt(t)
                return bool(done)
            sock = self._sock
            if sock is None:
                return False
            try:
                conn_sock, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:  # EMFILE and friends: keep listening
                if exc.errno not in (errno.EBADF, errno.EINVAL):
                    logger.warning("ringwire listener %s: accept failed: %s", self.path, str(exc))
                return False
            conn_sock.setblocking(False)
            pid: int | None = None
            try:
                pid = check_peer(conn_sock)
                hs_deadline = time.monotonic() + self._handshake_timeout
                transport = drive_sync(self._handshake_for(pid), conn_sock, hs_deadline)
            except (RingwireError, OSError) as exc:  # (TimeoutError is an OSError)
                conn_sock.close()
                self._refused_one(exc)
                if getattr(exc, "before_hello", False) and pid is not None:
                    _sweep_when_dead_sync(pid)  # as Listener does: its names are unknown
                return False
            except BaseException:
                conn_sock.close()
                raise
            self._adopt(transport)
            return True
        finally:
            self._accepting.release()
            if for_accept:
                eventfd_ring(self._kick)

    def _listen_fd(self) -> int:
        acceptor = self._acceptor
        if acceptor is not None:
            return -1 if acceptor.closed else int(acceptor.fileno())
        sock = self._sock
        return sock.fileno() if sock is not None else -1

    def _poll_until(self, fds: list[int], until: float | None, *, fan_in: bool) -> None:
        """Wait until one of ``fds``, the listening socket, the closing descriptor or
        (``fan_in``) the kick descriptor is readable, or ``until`` (or the TCP
        acceptor's next handshake deadline)."""
        poller = select.poll()
        # (while another thread accepts, the fan-in leaves the socket to it: polling a
        # connection that thread is about to take would return at once, again and
        # again; that thread rings the kick when it is done)
        listen = -1 if fan_in and self._accepting.locked() else self._listen_fd()
        for fd in (*fds, listen, self._closing):
            if fd >= 0:
                poller.register(fd, select.POLLIN)
        if fan_in:
            poller.register(self._kick, select.POLLIN)
        acceptor = self._acceptor
        hs_until = (
            acceptor.next_deadline() if acceptor is not None and not acceptor.closed else None
        )
        limits = [x for x in (until, hs_until) if x is not None]
        ms = -1 if not limits else max(0, math.ceil((min(limits) - time.monotonic()) * 1000))
        for fd, _ in poller.poll(ms):
            if fd == self._kick:
                eventfd_clear(self._kick)

    def accept(self, timeout: float | None = None) -> SyncChannel:
        """The next new connection (it also takes part in the fan-in :meth:`receive`),
        waiting up to ``timeout`` seconds (``None``: forever).

        Raises ``TimeoutError`` when none arrived in time, ``ClosedResourceError``
        once the listener is closed.  Failed handshakes are logged and counted
        (``statistics().refused``), never raised here."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self._closed:
                    raise ClosedResourceError
                while self._new:
                    chan = self._new.popleft()
                    if not chan.closed:  # (one the fan-in dropped meanwhile is gone)
                        return chan
            if self._accept_ready(for_accept=True):
                continue
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no connection at {self.path} within {timeout:g} s")
            if self._accepting.locked():
                # another thread accepts (or reads the fan-in): wait for what it adds
                with self._arrived:
                    if not self._new and not self._closed:
                        left = None if deadline is None else deadline - time.monotonic()
                        self._arrived.wait(0.05 if left is None else min(left, 0.05))
                continue
            self._poll_until([], deadline, fan_in=False)

    # -- the fan-in -----------------------------------------------------------------------

    def _take_turns(self) -> list[_Held]:
        """The connections whose receive turn is free, taken (in fan-in order, from
        the round-robin position); the caller gives them back with :meth:`_give_back`
        (the base's :meth:`_read` reads one only while we hold its turn, and one it
        drops is closed there)."""
        with self._lock:
            self._prune()
            conns = self._conns
            n = len(conns)
            order = [conns[(self._rr + i) % n] for i in range(n)]
        return [h for h in order if h.turn.acquire(False)]

    def _give_back(self, turns: list[_Held]) -> None:
        """Release the receive turns taken; close the connections the fan-in dropped
        (a close takes the turn itself)."""
        for held in turns:
            held.turn.release()
        with self._lock:
            dropped = [h for h in turns if h not in self._conns]
        for held in dropped:
            held.chan.close()

    def _scan(self, max_n: int) -> list[tuple[SyncChannel, Any]]:
        """One round-robin pass: one record of the first connection that has one
        (``max_n == 0``), or up to ``max_n`` records, each connection its share."""
        turns = self._take_turns()
        out: list[tuple[SyncChannel, Any]] = []
        try:
            share = max(1, max_n // max(len(turns), 1))
            for held in turns:
                got = self._read(held, min(share, max_n - len(out)) if max_n else 0)
                if got is EMPTY:
                    continue
                chan = held.chan
                if not max_n:
                    self._advance(held)
                    return [(chan, got)]
                out.extend([(chan, rec) for rec in got])
                if len(out) >= max_n:
                    self._advance(held)
                    break
            else:
                if out:
                    self._advance(turns[-1])
            return out
        finally:
            self._give_back(turns)

    def _advance(self, held: _Held) -> None:
        with self._lock:
            if held in self._conns:
                self._rr = self._conns.index(held) + 1

    def _wait(self, until: float | None) -> None:
        """Spin, then park every connection whose receive turn is free and poll their
        descriptors, the listening socket and the kick descriptor, until one may have
        a record (or a connection arrives or goes, or ``until``); callers re-check."""
        if self._accept_ready():
            return
        turns = self._take_turns()
        try:
            cores = [h.core for h in turns if not h.core.closed]
            if self._spin(cores):
                return
            try:
                if self._park(cores):
                    return
                fds = [core.transport.fileno() for core in cores]
                self._poll_until(fds, until, fan_in=True)
                for held in turns:
                    if not held.core.closed:
                        held.chan.poll_peer()  # consume its doorbells, notice its hang-up
            finally:
                self._unpark(cores)
        finally:
            self._give_back(turns)

    def _fan_in(self, max_n: int, timeout: float | None) -> list[tuple[SyncChannel, Any]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._reading.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise TimeoutError("timed out waiting for another thread reading this listener")
        try:
            while True:
                if self._closed:
                    raise ClosedResourceError
                got = self._scan(max_n)
                if got:
                    return got
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no record at {self.path} within {timeout:g} s")
                self._wait(deadline)
        finally:
            self._reading.release()

    def receive(self, timeout: float | None = None) -> tuple[SyncChannel, Any]:
        """The next record from any connection, as ``(connection, record)``, waiting
        up to ``timeout`` seconds (``None``: forever).

        Fair: connections with data are served round-robin, one record each; records
        of one connection arrive in order.  Raises ``TimeoutError`` when none arrived
        in time, ``ClosedResourceError`` once the listener is closed.
        """
        return self._fan_in(0, timeout)[0]

    def receive_many(
        self, max_n: int = 1024, timeout: float | None = None
    ) -> list[tuple[SyncChannel, Any]]:
        """Wait (up to ``timeout`` seconds) for at least one record, then return up to
        ``max_n`` as ``(connection, record)`` pairs: the batched :meth:`receive`.

        Fair: each connection with data contributes at most its share of ``max_n``;
        records of one connection keep their order.  Raises ``ValueError`` for
        ``max_n < 1``, ``TimeoutError``, and ``ClosedResourceError`` once closed.
        """
        if max_n < 1:
            raise ValueError("max_n must be at least 1")
        return self._fan_in(max_n, timeout)

    def receive_nowait(self) -> tuple[SyncChannel, Any]:
        """A record that is already there, as ``(connection, record)``; raises
        :class:`anyio.WouldBlock` if there is none, ``ClosedResourceError`` once the
        listener is closed."""
        if self._closed:
            raise ClosedResourceError
        got = self._scan(0)
        if not got:
            raise WouldBlock
        return got[0]

    def __iter__(self) -> Iterator[tuple[SyncChannel, Any]]:
        """``(connection, record)`` pairs from :meth:`receive` until the listener is
        closed."""
        while True:
            try:
                yield self.receive()
            except ClosedResourceError:
                return

    # -- closing --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting, close every connection, remove the socket file.  Threads
        waiting in :meth:`accept` or the fan-in get ``ClosedResourceError``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, self._conns = self._conns, []
            self._new.clear()
            self._arrived.notify_all()
        eventfd_ring(self._closing)  # every thread that polls wakes up and sees the end
        for held in conns:
            held.chan.close()
        if self._sock is not None:
            # (a handshake in progress in another thread finishes, then is closed)
            sock, self._sock = self._sock, None
            self._remove_socket(sock)
        if self._acceptor is not None:
            with self._accepting:  # (the acceptor is stepped under this lock)
                self._acceptor.close()

    def __enter__(self) -> SyncListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        warnings.warn(
            f"unclosed ringwire SyncListener at {self.path}", ResourceWarning, stacklevel=1
        )
        self.close()


def listen_sync(
    path: str | os.PathLike[str],
    *,
    type: Any = Any,
    spin_us: float = DEFAULT_SPIN_US,
    max_capacity: int = MAX_CAPACITY,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    backlog: int = 128,
    slots: SlotConfig | None = DEFAULT_SLOTS,
    copy_out: bool = False,
    heartbeat: float = DEFAULT_HEARTBEAT,
    insecure: bool = False,
    keys: ServerKeys | None = None,
) -> SyncListener:
    """A :class:`SyncListener` at ``path`` (a Unix socket path, or
    ``tcp://host:port``), bound at once; use it as ``with listen_sync(path) as l:``.
    The keywords, and what they raise, are :class:`Listener`'s; the async twin is
    :func:`listen`."""
    return SyncListener(
        path,
        type=type,
        spin_us=spin_us,
        max_capacity=max_capacity,
        handshake_timeout=handshake_timeout,
        backlog=backlog,
        slots=slots,
        copy_out=copy_out,
        heartbeat=heartbeat,
        insecure=insecure,
        keys=keys,
    )
