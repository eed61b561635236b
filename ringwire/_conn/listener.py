"""Listeners: many connections accepted at one address, and a fair fan-in.

:class:`Listener` (async) runs handshakes in the background and merges every accepted
connection into one stream of ``(connection, record)``; its blocking twin,
:class:`~ringwire.SyncListener`, is in :mod:`.sync_listener`.  What both are
configured with, how they make the endpoint of an accepted connection, and the part
of the fan-in that never waits (reading one connection, dropping a dead one, the
counters, spinning and parking before a wait) is :class:`ListenerBase`: each driver
adds only how it waits and which connections it may read.

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
import socket
import time
from collections.abc import AsyncIterator
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream, WouldBlock

from .._errors import DecodeError
from .._net.keys import ServerKeys
from .._pool.segment import pid_alive, sweep
from .._pool.slotconfig import DEFAULT_SLOTS, SlotConfig, resolve_config
from .._shm.handshake import HandshakeGen, drive_async, server_handshake
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
from .observed import track
from .options import DEFAULT_HANDSHAKE_TIMEOUT, check_options, receiving
from .record_tracing import enable as enable_tracing
from .statistics import ListenerStatistics

__all__ = ["DEFAULT_HANDSHAKE_TIMEOUT", "Listener", "ListenerBase", "listen", "listener_counters"]

logger = logging.getLogger("ringwire")

_YIELD_EVERY = 32  # the fan-in yields to the event loop at least this often


class _Accepted(NamedTuple):
    """One accepted connection: what users get, and the endpoint the fan-in reads."""

    chan: Channel
    core: Endpoint
    waker: AsyncWaker


async def _sweep_when_dead(pid: int, patience: float = 2.0) -> None:
    """Wait (a little) for ``pid`` to be gone, then remove dead creators' segments."""
    deadline = time.monotonic() + patience
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return  # alive after all: it can unlink its own names
        await anyio.sleep(0.01)
    sweep()


_Ch = TypeVar("_Ch")
_Ch_co = TypeVar("_Ch_co", covariant=True)


class _FanInConn(Protocol[_Ch_co]):
    """A connection in a fan-in: what users get (``chan``), and its endpoint."""

    @property
    def chan(self) -> _Ch_co: ...
    @property
    def core(self) -> Endpoint: ...


_C = TypeVar("_C", bound=_FanInConn[Any])


class ListenerBase(Generic[_Ch, _C]):
    """What both listeners are configured with, how they run and refuse handshakes,
    and the fan-in's bookkeeping that never waits: the connections in fan-in order
    (``_conns``, of the driver's type ``_C``, each with a ``_Ch`` for users), the round-robin position, the counters,
    and reading, dropping and parking connections.  A driver sets ``_guard`` (the
    blocking one: its lock; the async one has none) and its own state in
    :meth:`_open`."""

    traces_records = False  # ringwire.trace_records(listener) sets it
    stamps_records = False  # (and its hop_times)

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
        made); the address is bound when an async listener is entered, at once by a
        blocking one: ``OSError`` if it cannot be."""
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
        self._spin_ns = int(max(0.0, float(spin_us)) * 1000)
        self._max_capacity = max_capacity
        self._handshake_timeout = handshake_timeout
        self._backlog = backlog
        self._copy_out = copy_out
        self._guard: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        self._conns: list[_C] = []  # in fan-in order
        self._rr = 0  # the round-robin position in _conns
        self._closed = False
        self._accepted = self._refused = self._broken = self._ended = 0
        self._open()
        track(self, None, "listener", listener_counters)

    def _open(self) -> None:
        """The driver's own state (a blocking listener binds its address here)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.path} {len(self._conns)} connections>"

    @property
    def connections(self) -> list[_Ch]:
        """The open connections in the fan-in."""
        with self._guard:
            self._prune()
            return [c.chan for c in self._conns]

    def statistics(self) -> ListenerStatistics:
        """A snapshot of the listener's counters (open, accepted, refused, broken, ended)."""
        with self._guard:
            self._prune()
            return ListenerStatistics(
                open_connections=len(self._conns),
                accepted=self._accepted,
                refused=self._refused,
                broken=self._broken,
                ended=self._ended,
            )

    def _counters(self) -> ListenerStatistics | None:
        """(See :func:`listener_counters`.)"""
        if self._closed:
            return None
        conns = list(self._conns)
        ended = sum(1 for c in conns if c.core.closed)
        return ListenerStatistics(
            open_connections=len(conns) - ended,
            accepted=self._accepted,
            refused=self._refused,
            broken=self._broken,
            ended=self._ended + ended,
        )

    def _prune(self) -> list[_C]:
        """(Under ``_guard``.)  Connections their user closed (taken with accept(), say)
        leave the fan-in here too, counted as ended, not only when a fan-in read finds
        them: a listener used through accept() alone would otherwise keep every
        connection it ever had.  Returns them."""
        closed = [c for c in self._conns if c.core.closed]
        for conn in closed:
            self._conns.remove(conn)
            self._ended += 1
        return closed

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
        core = Endpoint(transport, type=self._type, spin_us=self._spin_us, name=self.path)
        if self.traces_records:
            enable_tracing(core, True, self.stamps_records)
        return core

    def _log_refusal(self, exc: BaseException) -> None:
        logger.warning("ringwire listener %s refused a connection: %s", self.path, str(exc))

    def _remove_socket(self, sock: socket.socket) -> None:
        sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _refused_one(self, exc: BaseException) -> None:
        with self._guard:
            self._refused += getattr(exc, "count", 1)  # (one standing for a flood of them)
        self._log_refusal(exc)

    # -- the fan-in's part that never waits -----------------------------------------------

    def _drop(self, conn: _C, exc: BaseException | None) -> None:
        """Out of the fan-in, counted as ended (``exc is None``) or broken: then
        logged, and the sender learns why.  The driver closes it."""
        with self._guard:
            if conn in self._conns:
                self._conns.remove(conn)
            if exc is None:
                self._ended += 1
            else:
                self._broken += 1
        if exc is not None:
            # (the text, not the exception: a handler that keeps records would keep its
            # traceback's frames, and the records and arrays in them, alive)
            logger.warning(
                "ringwire listener %s dropped the connection from pid %s: %s",
                self.path,
                conn.core.peer_pid,
                str(exc),
            )
            conn.core.abort(f"{type(exc).__name__}: {exc}")  # the sender learns why

    def _read(self, conn: _C, max_n: int) -> Any:
        """One record of ``conn`` (``max_n == 0``) or a list of at most ``max_n``;
        ``EMPTY`` when it has none -- and when it is closed, ended or broken, which
        drops it from the fan-in.  (The blocking driver holds its receive turn.)"""
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

    def _spin(self, cores: list[Endpoint]) -> bool:
        """Spin up to ``spin_us`` for one of ``cores`` to be ready: ``True`` if one is."""
        if self._spin_ns and cores:
            clock = time.perf_counter_ns
            deadline = clock() + self._spin_ns
            while clock() < deadline:
                if any(core.receive_ready() for core in cores):
                    return True
        return False

    @staticmethod
    def _park(cores: list[Endpoint]) -> bool:
        """Park every one of ``cores`` (the caller unparks them with :meth:`_unpark`
        whatever happens next): ``True`` if one became ready meanwhile (do not wait);
        else each counts a park."""
        for core in cores:
            core.park_rx()
        if any(core.receive_ready() for core in cores):
            return True
        for core in cores:
            core.recv_parks += 1
        return False

    @staticmethod
    def _unpark(cores: list[Endpoint]) -> None:
        for core in cores:
            core.unpark_rx()


def listener_counters(listener: ListenerBase[Any, Any]) -> ListenerStatistics | None:
    """``listener.statistics()`` without pruning its fan-in (``None`` once it is
    closed): it changes nothing, so any thread may call it (the metrics collector,
    :mod:`ringwire._conn.observed`, does); a connection closed and not pruned yet
    counts as ended."""
    return listener._counters()  # noqa: SLF001 (this module's own class)


class Listener(ListenerBase[Channel, _Accepted]):
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

    def _open(self) -> None:
        self._sock: socket.socket | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._event: anyio.Event | None = None
        self._accept_send, self._accept_recv = anyio.create_memory_object_stream[Channel](math.inf)
        self._fast_ops = 0

    def _prune(self) -> list[_Accepted]:
        closed = super()._prune()
        for conn in closed:
            conn.chan.close()
        return closed

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
            self._refused_one(exc)
            if getattr(exc, "before_hello", False) and pid is not None:
                await _sweep_when_dead(pid)
            return
        except BaseException:
            sock.close()
            raise
        await self._adopt(transport)

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
        super()._drop(conn, exc)
        conn.chan.close()

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
        if self._spin([c.core for c in self._conns]):
            return
        ev = self._event
        if ev is None:
            ev = self._event = anyio.Event()
        parked = [c.core for c in self._conns if not c.core.closed]
        try:
            if self._park(parked):
                return
            await ev.wait()
        finally:
            self._unpark(parked)

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
