"""Listeners: many connections accepted at one address, and a fair fan-in.

:class:`Listener` (async) runs handshakes in the background and merges every accepted
connection into one stream of ``(connection, record)``.  :class:`SyncListener` is its
blocking twin, for threads: :meth:`~SyncListener.accept` returns
:class:`~ringwire.SyncChannel` s, and its fan-in (:meth:`~SyncListener.receive`,
iteration) waits with ``poll()`` over every connection's descriptor, the listening
socket and a wake-up descriptor of its own: it accepts while it waits (the handshake
in the waiting thread, bounded by ``handshake_timeout``), and a connection whose peer
died wakes it like a record does, so a dead peer is dropped, never waited on.

Both: a failed handshake never disturbs a listener (it is logged and counted as
refused); a connection that breaks is logged, counted and dropped from the fan-in
alone; one that ends cleanly is dropped silently.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import select
import socket
import threading
import time
import warnings
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import Any, NamedTuple

import anyio
import anyio.abc
import anyio.lowlevel
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream, WouldBlock

from .._errors import DecodeError, RingwireError
from .._net.keys import ServerKeys
from .._shm.handshake import HandshakeGen, drive_async, drive_sync, server_handshake
from .._shm.segment import pid_alive, sweep
from .._shm.slotconfig import DEFAULT_SLOTS, SlotConfig, resolve_config
from .._shm.sockets import bind_unix_socket, check_peer
from .._wire.ring import MAX_CAPACITY, validate_capacity
from .async_channel import AsyncWaker, Channel
from .endpoint import DEFAULT_SPIN_US, EMPTY, Endpoint
from .netconn import (
    DEFAULT_HEARTBEAT,
    accept_loop,
    check_bind,
    check_heartbeat,
    open_acceptor,
)
from .options import DEFAULT_HANDSHAKE_TIMEOUT, check_options, receiving
from .statistics import ListenerStatistics
from .sync_channel import SyncChannel, receive_turn

__all__ = ["DEFAULT_HANDSHAKE_TIMEOUT", "Listener", "SyncListener", "listen", "listen_sync"]

logger = logging.getLogger("ringwire")

_YIELD_EVERY = 32  # the fan-in yields to the event loop at least this often


class _Accepted(NamedTuple):
    """One accepted connection: what users get, and the endpoint the fan-in reads."""

    chan: Channel
    core: Endpoint
    waker: AsyncWaker


class _Held(NamedTuple):
    """One connection of a :class:`SyncListener`: what users get, the endpoint the
    fan-in reads, and the channel's receive turn (its one reader at a time)."""

    chan: SyncChannel
    core: Endpoint
    turn: threading.Lock


async def _sweep_when_dead(pid: int, patience: float = 2.0) -> None:
    """Wait (a little) for ``pid`` to be gone, then remove dead creators' segments."""
    deadline = time.monotonic() + patience
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return  # alive after all: it can unlink its own names
        await anyio.sleep(0.01)
    sweep()


def _sweep_when_dead_sync(pid: int, patience: float = 0.1) -> None:
    """Blocking :func:`_sweep_when_dead`, with a short patience: a client whose socket
    closed because it died is gone within milliseconds (one still alive can unlink its
    own names)."""
    deadline = time.monotonic() + patience
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return
        time.sleep(0.002)
    sweep()


class _ListenerBase:
    """What both listeners are configured with, and how they run and refuse handshakes.

    ``type`` decodes records of accepted connections; ``spin_us`` is their spin budget;
    ``max_capacity`` bounds the rings a client may announce; ``handshake_timeout``
    bounds one handshake; ``backlog`` is the socket's listen backlog; ``slots`` is the
    send pool of every accepted connection, ``copy_out`` their choice as receivers
    (see :func:`connect`).
    """

    def __init__(
        self,
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
    ) -> None:
        self.path = os.fspath(path)
        self.tcp = self.path.startswith("tcp://")
        check_heartbeat(heartbeat)
        if not isinstance(insecure, bool):
            raise TypeError(f"insecure must be a bool, not {insecure!r}")
        self._heartbeat = heartbeat
        self._insecure = insecure
        self._keys = keys
        self._acceptor: Any = None
        if self.tcp:
            check_bind(self.path, insecure, keys)
        elif keys is not None:
            raise ValueError(
                f"keys= is for tcp:// addresses; {self.path!r} is a Unix socket, which "
                "admits processes of this uid only"
            )
        check_options(spin_us, handshake_timeout, copy_out)
        if isinstance(backlog, bool) or not isinstance(backlog, int) or backlog < 1:
            raise ValueError(f"backlog must be an int >= 1, not {backlog!r}")
        validate_capacity(max_capacity)
        self._type = type
        self._slots = resolve_config(slots)
        self._spin_us = spin_us
        self._max_capacity = max_capacity
        self._handshake_timeout = handshake_timeout
        self._backlog = backlog
        self._copy_out = copy_out

    def _open_acceptor(self) -> None:
        """``tcp://``: bind the rendezvous (``self.path`` becomes the bound address,
        the port filled in when it was 0)."""
        self._acceptor = open_acceptor(
            self.path,
            max_capacity=self._max_capacity,
            slots=self._slots,
            heartbeat=self._heartbeat,
            handshake_timeout=self._handshake_timeout,
            insecure=self._insecure,
            keys=self._keys,
            backlog=self._backlog,
        )
        self.path = self._acceptor.address.url

    def _handshake_for(self, pid: int) -> HandshakeGen:
        # a client may announce only segments it made itself (see server_handshake)
        return server_handshake(pid, self._max_capacity, self._slots, own_names=True)

    def _endpoint(self, transport: Any) -> Endpoint:
        receiving(transport, self._copy_out)
        return Endpoint(transport, type=self._type, spin_us=self._spin_us, name=self.path)

    def _log_refusal(self, exc: BaseException) -> None:
        logger.warning("ringwire listener %s refused a connection: %s", self.path, str(exc))

    def _remove_socket(self, sock: socket.socket) -> None:
        sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class Listener(_ListenerBase):
    """Accepts connections at a Unix socket path; many producers, one consumer.

    Use it as an async context manager (it accepts and runs handshakes in the
    background while open)::

        async with ringwire.listen(path) as listener:
            async for conn, record in listener:     # fair fan-in over all connections
                await conn.send(reply)

    :meth:`accept` returns each new connection as well, for per-connection handling.
    A connection that breaks (crash, bad frame, undecodable record) is closed, logged
    and dropped from the fan-in; one that ends cleanly is dropped silently.  A failed
    handshake never disturbs the listener.  Closing the listener closes every
    connection it accepted and removes the socket file.
    """

    def __init__(
        self,
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
    ) -> None:
        """``type`` decodes the records of every accepted connection; ``spin_us`` is
        their spin budget; ``max_capacity`` bounds the rings a client may announce;
        ``handshake_timeout`` bounds one handshake; ``backlog`` is the socket's listen
        backlog; ``slots`` is this side's send pool on every accepted connection, and
        ``copy_out`` whether they copy the arrays they receive in the peer's slots
        (see :func:`connect`).  ``path`` may be ``"tcp://host:port"`` (port 0: any free
        one; :attr:`path` then names the bound address): ``heartbeat`` is the TCP
        connections' liveness bound, and a non-loopback host needs ``keys`` (a
        :class:`~ringwire.ServerKeys`: CURVE, only the listed clients admitted; each
        refusal logged and counted in ``statistics().refused``) or ``insecure=True``.
        Raises ``ValueError`` / ``TypeError`` for bad values (before anything is
        made); entering it raises ``OSError`` if the address cannot be bound."""
        super().__init__(
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
        self._spin_ns = int(max(0.0, float(self._spin_us)) * 1000)
        self._sock: socket.socket | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._conns: list[_Accepted] = []  # in fan-in order
        self._closed = False
        self._rr = 0
        self._event: anyio.Event | None = None
        self._accept_send, self._accept_recv = anyio.create_memory_object_stream[Channel](math.inf)
        self._accepted = self._refused = self._broken = self._ended = 0
        self._fast_ops = 0

    def __repr__(self) -> str:
        return f"<Listener {self.path} {len(self._conns)} connections>"

    @property
    def connections(self) -> list[Channel]:
        """The open connections in the fan-in."""
        self._prune()
        return [a.chan for a in self._conns]

    def _prune(self) -> None:
        # connections their user closed (taken with accept(), say) leave the fan-in here
        # too, not only when a fan-in read finds them: a listener used through accept()
        # alone would otherwise keep every connection it ever had
        for conn in [c for c in self._conns if c.core.closed]:
            self._drop(conn, None)

    def statistics(self) -> ListenerStatistics:
        """A snapshot of the listener's counters (open, accepted, refused, broken, ended)."""
        self._prune()
        return ListenerStatistics(
            open_connections=len(self._conns),
            accepted=self._accepted,
            refused=self._refused,
            broken=self._broken,
            ended=self._ended,
        )

    async def __aenter__(self) -> Listener:
        if self._sock is not None or self._acceptor is not None or self._closed:
            raise RuntimeError("a Listener can be entered once")
        if self.tcp:
            self._open_acceptor()
        else:
            self._sock = bind_unix_socket(self.path, self._backlog)
            sweep()  # names left by dead processes (a listener killed mid-handshake, say)
        self._cm = self._running()
        try:
            await self._cm.__aenter__()
        except BaseException:
            self.close()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self._cm.__aexit__(*exc)

    @contextlib.asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        # The background task group lives in a generator-based context manager, so it
        # is entered and exited by the task that entered the listener, in order,
        # whatever is being cancelled (trio and anyio require exactly that).
        async with anyio.create_task_group() as tg:
            self._tg = tg
            if self._acceptor is not None:
                tg.start_soon(accept_loop, self._acceptor, self._adopt_soon, self._refused_one)
            else:
                tg.start_soon(self._accept_loop)
            try:
                yield
            finally:
                self.close()

    async def aclose(self) -> None:
        """Stop accepting, close every connection, remove the socket file.

        May be called from any task; cleanup never waits, so a cancelled server still
        leaves no socket file and no open connection behind.
        """
        self.close()
        await anyio.lowlevel.checkpoint()

    def close(self) -> None:
        """:meth:`aclose` without awaiting (call it from the event loop's thread, as
        :meth:`Channel.close`): stop accepting, close every connection, remove the
        socket file.  Tasks waiting in :meth:`receive` / :meth:`accept` get
        ``ClosedResourceError``."""
        if self._closed:
            return
        self._closed = True
        self._notify()
        for a in list(self._conns):
            a.chan.close()
        self._conns.clear()
        if self._sock is not None:
            anyio.notify_closing(self._sock)
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        if self._sock is not None:
            self._remove_socket(self._sock)
        if self._acceptor is not None:
            self._acceptor.close()
        self._accept_send.close()
        # connections accepted but never taken with accept() are closed above
        self._accept_recv.close()

    # -- background tasks ---------------------------------------------------------------

    async def _accept_loop(self) -> None:
        sock = self._sock
        assert sock is not None and self._tg is not None
        tg = self._tg
        while True:
            try:
                conn_sock, _ = sock.accept()
            except BlockingIOError:
                try:
                    await anyio.wait_readable(sock)
                except ClosedResourceError:
                    return
                continue
            except OSError as exc:  # EMFILE and friends: back off, keep listening
                if exc.errno in (errno.EBADF, errno.EINVAL):
                    return
                logger.warning("ringwire listener %s: accept failed: %s", self.path, str(exc))
                await anyio.sleep(0.1)
                continue
            conn_sock.setblocking(False)
            tg.start_soon(self._handshake, conn_sock)

    async def _handshake(self, sock: socket.socket) -> None:
        pid: int | None = None
        try:
            with anyio.fail_after(self._handshake_timeout):
                pid = check_peer(sock)
                transport = await drive_async(self._handshake_for(pid), sock)
        except Exception as exc:
            sock.close()
            self._refused += 1
            self._log_refusal(exc)
            if getattr(exc, "before_hello", False) and pid is not None:
                await _sweep_when_dead(pid)
            return
        except BaseException:
            sock.close()
            raise
        await self._adopt(transport)

    def _refused_one(self, exc: BaseException) -> None:
        self._refused += getattr(exc, "count", 1)  # (one standing for a flood of them)
        self._log_refusal(exc)

    def _adopt_soon(self, transport: Any) -> None:
        assert self._tg is not None
        self._tg.start_soon(self._adopt, transport)

    async def _adopt(self, transport: Any) -> None:
        """A connection whose handshake succeeded: into the fan-in, until it ends."""
        core = self._endpoint(transport)
        waker = AsyncWaker(core)
        conn = _Accepted(Channel(core, waker), core, waker)
        if self._closed:
            await conn.chan.aclose()
            return
        self._accepted += 1
        self._prune()
        self._conns.append(conn)
        self._accept_send.send_nowait(conn.chan)
        self._notify()
        await self._watch(conn)

    async def _watch(self, conn: _Accepted) -> None:
        """Turn this connection's doorbells into fan-in wakeups, until it ends."""
        core = conn.core
        try:
            while not (core.closed or core.eof or core.broken is not None):
                await conn.waker.wait(core.wake_gen)
                self._notify()
        except ClosedResourceError:
            pass
        self._notify()

    def _notify(self) -> None:
        ev = self._event
        if ev is not None:
            self._event = None
            ev.set()

    # -- accept -----------------------------------------------------------------------------

    async def accept(self) -> Channel:
        """The next new connection (it also takes part in the fan-in :meth:`receive`).

        Raises ``RuntimeError`` before the listener is entered, ``ClosedResourceError``
        once it is closed; failed handshakes are logged and counted
        (``statistics().refused``), never raised here."""
        if self._sock is None and self._acceptor is None:
            raise RuntimeError("use the Listener as 'async with' before accepting")
        try:
            return await self._accept_recv.receive()
        except (EndOfStream, ClosedResourceError):
            raise ClosedResourceError from None

    # -- fan-in -----------------------------------------------------------------------------

    def _drop(self, conn: _Accepted, exc: BaseException | None) -> None:
        if conn in self._conns:
            self._conns.remove(conn)
        if exc is None:
            self._ended += 1
        else:
            self._broken += 1
            # (the text, not the exception: a handler that keeps records would keep its
            # traceback's frames, and the records and arrays in them, alive)
            logger.warning(
                "ringwire listener %s dropped the connection from pid %s: %s",
                self.path,
                conn.core.peer_pid,
                str(exc),
            )
            conn.core.abort(f"{type(exc).__name__}: {exc}")  # the sender learns why
        conn.chan.close()

    def _read(self, conn: _Accepted, max_n: int) -> Any:
        """One record of ``conn`` (``max_n == 0``) or a list of at most ``max_n``;
        ``EMPTY`` when it has none -- and when it is closed, ended or broken, which
        drops it from the fan-in."""
        core = conn.core
        try:
            if core.closed:
                self._drop(conn, None)
                return EMPTY
            if max_n:
                got = core.try_receive_many(core.dec, max_n) or EMPTY
            else:
                got = core.try_receive(core.dec)
            if got is EMPTY:
                core.check_finished()
            return got
        except EndOfStream:
            self._drop(conn, None)
        except (BrokenResourceError, DecodeError) as exc:
            self._drop(conn, exc)
        return EMPTY

    def _try_fan_in(self) -> tuple[Channel, Any] | None:
        conns = self._conns
        n = len(conns)
        i = 0
        while i < n:
            k = (self._rr + i) % n
            conn = conns[k]
            obj = self._read(conn, 0)
            if obj is EMPTY:
                if n != len(conns):  # a connection went away: rescan
                    n = len(conns)
                    continue
                i += 1
                continue
            self._rr = k + 1
            return conn.chan, obj
        return None

    def _try_fan_in_many(self, max_n: int) -> list[tuple[Channel, Any]]:
        """Up to ``max_n`` records, round-robin over the connections in batches (each
        connection's share of ``max_n``, one ring commit and doorbell check each)."""
        out: list[tuple[Channel, Any]] = []
        conns = self._conns
        n = len(conns)
        share = max(1, max_n // max(n, 1))
        i = 0
        while i < n and len(out) < max_n:
            conn = conns[(self._rr + i) % n]
            got = self._read(conn, min(share, max_n - len(out)))
            if n != len(conns):  # a connection went away: rescan
                n = len(conns)
                continue
            if got is not EMPTY:
                chan = conn.chan
                out.extend([(chan, rec) for rec in got])
            i += 1
        if n:
            self._rr = (self._rr + i) % n
        return out

    def _any_ready(self) -> bool:
        return any(c.core.receive_ready() for c in self._conns)

    async def receive(self) -> tuple[Channel, Any]:
        """The next record from any connection, as ``(connection, record)``.

        Fair: connections with data are served round-robin, one record each; records
        of one connection arrive in order.  Raises ``ClosedResourceError`` once the
        listener is closed.
        """
        while True:
            if self._closed:
                raise ClosedResourceError
            got = self._try_fan_in()
            if got is not None:
                await self._maybe_yield()
                return got
            await self._wait_any()

    async def receive_many(self, max_n: int = 1024) -> list[tuple[Channel, Any]]:
        """Wait for at least one record, then return up to ``max_n`` as
        ``(connection, record)`` pairs: the batched form of :meth:`receive`, for
        throughput (one ring commit and doorbell check per connection per batch).

        Fair: each connection with data contributes at most its share of ``max_n`` per
        call, round-robin; records of one connection keep their order.  Raises
        ``ValueError`` for ``max_n < 1`` and ``ClosedResourceError`` once the listener
        is closed.
        """
        if max_n < 1:
            raise ValueError("max_n must be at least 1")
        while True:
            if self._closed:
                raise ClosedResourceError
            got = self._try_fan_in_many(max_n)
            if got:
                await self._maybe_yield()
                return got
            await self._wait_any()

    async def _wait_any(self) -> None:
        """Spin, then park every connection, until one may have a record (or a
        connection arrives or goes); returns early, callers re-check."""
        if self._spin_ns and self._conns:
            clock = time.perf_counter_ns
            deadline = clock() + self._spin_ns
            while clock() < deadline:
                if self._any_ready():
                    return
        ev = self._event
        if ev is None:
            ev = self._event = anyio.Event()
        parked = [c.core for c in self._conns if not c.core.closed]
        for core in parked:
            core.park_rx()
        try:
            if self._any_ready():
                return
            for core in parked:
                core.recv_parks += 1
            await ev.wait()
        finally:
            for core in parked:
                core.unpark_rx()

    async def _maybe_yield(self) -> None:
        # shielded: the operation is done (a record taken, or sent), and a cancellation
        # raised here would lose the record or make the caller send it twice
        self._fast_ops += 1
        if self._fast_ops >= _YIELD_EVERY:
            self._fast_ops = 0
            await anyio.lowlevel.cancel_shielded_checkpoint()

    def receive_nowait(self) -> tuple[Channel, Any]:
        """A record that is already there, as ``(connection, record)``; raises
        :class:`anyio.WouldBlock` if there is none, ``ClosedResourceError`` once the
        listener is closed."""
        if self._closed:
            raise ClosedResourceError
        got = self._try_fan_in()
        if got is None:
            raise WouldBlock
        return got

    def __aiter__(self) -> AsyncIterator[tuple[Channel, Any]]:
        return self

    async def __anext__(self) -> tuple[Channel, Any]:
        try:
            return await self.receive()
        except ClosedResourceError:
            raise StopAsyncIteration from None


def listen(
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
) -> Listener:
    """A :class:`Listener` at ``path`` (a Unix socket path, or ``tcp://host:port``);
    use it as ``async with listen(path) as l:``.  The keywords, and what they raise,
    are :class:`Listener`'s; the blocking twin is :func:`listen_sync`."""
    return Listener(
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


class SyncListener(_ListenerBase):
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
    listener closes every connection it accepted and removes the socket file.
    """

    def __init__(
        self,
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
    ) -> None:
        """The keywords are :class:`Listener`'s.  The address is bound at once:
        ``OSError`` if it cannot be; ``ValueError`` / ``TypeError`` for bad values."""
        super().__init__(
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
        self._spin_ns = int(max(0.0, float(self._spin_us)) * 1000)
        self._lock = threading.Lock()  # the lists and counters below
        self._arrived = threading.Condition(self._lock)  # accept() waits on it
        self._conns: list[_Held] = []  # in fan-in order
        self._new: deque[SyncChannel] = deque()  # accepted, not yet taken by accept()
        self._accepting = threading.Lock()  # one thread accepts (and handshakes) at a time
        self._reading = threading.Lock()  # one thread reads the fan-in at a time
        self._rr = 0
        self._closed = False
        self._accepted = self._refused = self._broken = self._ended = 0
        self._sock: socket.socket | None = None
        # rung by close(), and by a connection accepted in another thread, to wake a
        # fan-in that polls
        self._kick = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            if self.tcp:
                self._open_acceptor()
            else:
                self._sock = bind_unix_socket(self.path, self._backlog)
                sweep()  # names left by dead processes (as Listener)
        except BaseException:
            self._closed = True  # (nothing to close, nothing to warn about)
            os.close(self._kick)
            self._kick = -1
            raise

    def __repr__(self) -> str:
        return f"<SyncListener {self.path} {len(self._conns)} connections>"

    @property
    def connections(self) -> list[SyncChannel]:
        """The open connections in the fan-in."""
        with self._lock:
            self._prune()
            return [h.chan for h in self._conns]

    def statistics(self) -> ListenerStatistics:
        """A snapshot of the listener's counters (as :meth:`Listener.statistics`)."""
        with self._lock:
            self._prune()
            return ListenerStatistics(
                open_connections=len(self._conns),
                accepted=self._accepted,
                refused=self._refused,
                broken=self._broken,
                ended=self._ended,
            )

    def _prune(self) -> None:
        # (under _lock) connections their user closed leave the fan-in here too
        for held in [h for h in self._conns if h.core.closed]:
            self._conns.remove(held)
            self._ended += 1

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
        self._ring()
        return chan

    def _ring(self) -> None:
        with contextlib.suppress(OSError):
            if self._kick >= 0:
                os.eventfd_write(self._kick, 1)

    def _refused_one(self, exc: BaseException) -> None:
        with self._lock:
            self._refused += getattr(exc, "count", 1)  # (one standing for a flood of them)
        self._log_refusal(exc)

    def _accept_ready(self) -> bool:
        """Accept what is waiting at the socket now, without waiting for a client:
        ``True`` if a connection was added.  A Unix client's handshake runs here (at
        most ``handshake_timeout``); a refused one is logged and counted."""
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

    def _listen_fd(self) -> int:
        if self._acceptor is not None:
            return int(self._acceptor.fileno())
        return self._sock.fileno() if self._sock is not None else -1

    def _poll_until(self, fds: list[int], until: float | None) -> None:
        """Wait until one of ``fds``, the listening socket or the kick descriptor is
        readable, or ``until`` (or the TCP acceptor's next handshake deadline)."""
        poller = select.poll()
        for fd in (*fds, self._listen_fd(), self._kick):
            if fd >= 0:
                poller.register(fd, select.POLLIN)
        limits = [x for x in (until, self._acceptor and self._acceptor.next_deadline()) if x]
        ms = -1 if not limits else max(0, math.ceil((min(limits) - time.monotonic()) * 1000))
        for fd, _ in poller.poll(ms):
            if fd == self._kick:
                with contextlib.suppress(OSError):
                    os.eventfd_read(self._kick)

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
                if self._new:
                    return self._new.popleft()
            if self._accept_ready():
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
            self._poll_until([], deadline)

    # -- the fan-in -----------------------------------------------------------------------

    def _drop(self, held: _Held, exc: BaseException | None) -> None:
        """Out of the fan-in (the caller closes it once it gave its turn back)."""
        with self._lock:
            if held in self._conns:
                self._conns.remove(held)
            if exc is None:
                self._ended += 1
            else:
                self._broken += 1
        if exc is not None:
            logger.warning(
                "ringwire listener %s dropped the connection from pid %s: %s",
                self.path,
                held.core.peer_pid,
                str(exc),
            )
            held.core.abort(f"{type(exc).__name__}: {exc}")  # the sender learns why

    def _read(self, held: _Held, max_n: int) -> Any:
        """As :meth:`Listener._read`, for a connection whose receive turn we hold (one
        it drops is closed by :meth:`_give_back`)."""
        core = held.core
        try:
            if core.closed:
                self._drop(held, None)
                return EMPTY
            if max_n:
                got = core.try_receive_many(core.dec, max_n) or EMPTY
            else:
                got = core.try_receive(core.dec)
            if got is EMPTY:
                core.check_finished()
            return got
        except EndOfStream:
            self._drop(held, None)
        except (BrokenResourceError, DecodeError) as exc:
            self._drop(held, exc)
        return EMPTY

    def _take_turns(self) -> list[_Held]:
        """The connections whose receive turn is free, taken (in fan-in order, from
        the round-robin position); the caller gives them back with :meth:`_give_back`."""
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
            if self._spin_ns and cores:
                clock = time.perf_counter_ns
                deadline = clock() + self._spin_ns
                while clock() < deadline:
                    if any(core.receive_ready() for core in cores):
                        return
            for core in cores:
                core.park_rx()
            try:
                if any(core.receive_ready() for core in cores):
                    return
                for core in cores:
                    core.recv_parks += 1
                fds = [core.transport.fileno() for core in cores]
                self._poll_until(fds, until)
                for held in turns:
                    if not held.core.closed:
                        held.chan.poll_peer()  # consume its doorbells, notice its hang-up
            finally:
                for core in cores:
                    if not core.closed:
                        core.unpark_rx()
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
        self._accept_ready()
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
        self._ring()  # a fan-in that polls wakes up and sees the end
        for held in conns:
            held.chan.close()
        with self._accepting:  # (a handshake in progress finishes, then is refused)
            if self._acceptor is not None:
                self._acceptor.close()
            if self._sock is not None:
                sock, self._sock = self._sock, None
                self._remove_socket(sock)
        with self._reading:
            if self._kick >= 0:
                os.close(self._kick)
                self._kick = -1

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
