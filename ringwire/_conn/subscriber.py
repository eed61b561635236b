"""Broadcast readers: :func:`subscribe` (async) and :func:`subscribe_sync`.

A reader is an ordinary receiving endpoint over its own cursor in the broadcast ring
(:class:`~ringwire._shm.broadcast_reader.SubscriberTransport`): the async
:class:`Subscriber` wraps a :class:`~ringwire.Channel`, the blocking
:class:`SyncSubscriber` is a small receive-only driver running the same loops of
:mod:`ringwire._conn.waits` -- so waiting (a bounded adaptive spin, then parked on its
control socket: no CPU while idle), decoding, slot views and their finalizers, and the
errors are the channels' own.  What a subscriber adds: its
rank, and one translation -- a reader the writer dropped that goes on reading is told
by the ring itself (:class:`RingCorrupted` from the horizon check); it gets
``BrokenResourceError``, like every other way of losing the writer.

Remote readers: a ``tcp://`` address is refused with ``NotImplementedError`` for now;
this is where a TCP subscription will plug in once TCP channels exist (issue "Beyond
one host"), behind the same :class:`Subscriber` API.
"""

from __future__ import annotations

import math
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
from anyio import BrokenResourceError, EndOfStream

from .._errors import DecodeError, RingCorrupted
from .._shm.broadcast_reader import (
    SubscriberTransport,
    drive_join_async,
    drive_join_sync,
    join_handshake,
)
from .._shm.sockets import check_peer
from . import waits
from .async_channel import Channel
from .driving import warn_held
from .endpoint import DEFAULT_SPIN_US, EMPTY, UNSET, Endpoint
from .listener import DEFAULT_HANDSHAKE_TIMEOUT
from .statistics import ChannelStatistics

__all__ = ["Subscriber", "SyncSubscriber", "subscribe", "subscribe_sync"]


def _translate(core: Endpoint, transport: SubscriberTransport, exc: BaseException) -> BaseException:
    """What a receive raises for ``exc``: the ring's own complaint about this reader
    (the writer dropped it and went on; the reason is in its abort, read now) becomes
    ``BrokenResourceError`` with that reason; anything else stays as it is."""
    ring = exc if isinstance(exc, RingCorrupted) else exc.__cause__
    if isinstance(exc, DecodeError):
        # a slot reference gone stale: fine unless the writer dropped us (it reclaimed
        # our shares), which its abort, queued on the socket, says
        try:
            transport.drain()
        except Exception:  # pragma: no cover - garbage after the abort
            pass
        if transport.peer_reason is None:
            return exc
        ring = RingCorrupted(f"{exc}")
    elif not isinstance(ring, RingCorrupted):
        return exc
    if core.broken is None:
        core.break_(ring)
    try:
        transport.drain()  # the abort is still queued on the socket
    except Exception:  # pragma: no cover - garbage after the abort
        pass
    reason = transport.peer_reason
    if reason is not None:
        out = BrokenResourceError(f"the writer (pid {core.peer_pid}) dropped this reader: {reason}")
    else:
        out = BrokenResourceError(f"broadcast reader broken: {ring}")
    out.__cause__ = ring
    return out


class _Common:
    _core: Endpoint
    _transport: SubscriberTransport

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} rank {self.rank} of {self._core.name} "
            f"(writer pid {self.writer_pid}) {self._core.state()}>"
        )

    @property
    def rank(self) -> int:
        """This reader's rank in the broadcast (0 .. max readers - 1)."""
        return self._transport.rank

    @property
    def writer_pid(self) -> int:
        return self._core.peer_pid

    @property
    def start(self) -> int:
        """The ring position this reader started at (0 for a reader there from the
        first record; a late joiner starts at the writer's position when it joined)."""
        return self._transport.start

    @property
    def closed(self) -> bool:
        return self._core.closed

    def fileno(self) -> int:
        return self._transport.fileno()

    def statistics(self) -> ChannelStatistics:
        return self._core.statistics()


class Subscriber(_Common):
    """One reader of a broadcast (async; asyncio, trio, uvloop).  Receives every record
    the writer sends after it joined, in order: :meth:`receive`, ``async for``, then
    ``EndOfStream`` once the writer closed, or ``BrokenResourceError`` if it died, the
    broadcast failed (the reason says which reader's death failed it), or the writer
    dropped this reader.  Made by :func:`ringwire.subscribe`."""

    def __init__(self, core: Endpoint, transport: SubscriberTransport) -> None:
        self._core = core
        self._transport = transport
        self._chan = Channel(core)

    async def __aenter__(self) -> Subscriber:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def receive(self, *, type: Any = UNSET) -> Any:
        """The next record (decoded as ``type`` if given); raises as the module
        docstring says, and :class:`DecodeError` for one that cannot be decoded."""
        try:
            return await self._chan.receive(type=type)
        except (RingCorrupted, BrokenResourceError, DecodeError) as exc:
            raise _translate(self._core, self._transport, exc)  # noqa: B904  (the cause is set)

    def receive_nowait(self, *, type: Any = UNSET) -> Any:
        """The next record, or :class:`anyio.WouldBlock` if none is published yet."""
        try:
            return self._chan.receive_nowait(type=type)
        except (RingCorrupted, BrokenResourceError, DecodeError) as exc:
            raise _translate(self._core, self._transport, exc)  # noqa: B904  (the cause is set)

    async def receive_many(self, max_n: int = 1024, *, type: Any = UNSET) -> list[Any]:
        """At least one record, then every published one up to ``max_n``."""
        try:
            return await self._chan.receive_many(max_n, type=type)
        except (RingCorrupted, BrokenResourceError, DecodeError) as exc:
            raise _translate(self._core, self._transport, exc)  # noqa: B904  (the cause is set)

    def receive_many_nowait(self, max_n: int = 1024, *, type: Any = UNSET) -> list[Any]:
        try:
            return self._chan.receive_many_nowait(max_n, type=type)
        except (RingCorrupted, BrokenResourceError, DecodeError) as exc:
            raise _translate(self._core, self._transport, exc)  # noqa: B904  (the cause is set)

    def __aiter__(self) -> Subscriber:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except EndOfStream:
            raise StopAsyncIteration from None

    def poll_writer(self) -> bool:
        """Notice now, without waiting, a writer that died or dropped us; returns
        whether it is still there."""
        return self._chan.poll_peer()

    def abort(self, reason: str) -> None:
        """Leave, telling the writer why: it counts this reader as *lost* (under
        ``on_reader_loss="fail"`` that fails the broadcast, naming this rank)."""
        self._chan.abort(reason)

    async def aclose(self) -> None:
        """Leave cleanly: the writer stops keeping anything for this reader (not a loss)."""
        await self._chan.aclose()

    def close(self) -> None:
        self._chan.close()


class SyncSubscriber(_Common):
    """Blocking :class:`Subscriber` (threads, plain scripts): ``timeout`` arguments
    raise ``TimeoutError``.  Made by :func:`ringwire.subscribe_sync`.

    Its own small driver, not a :class:`SyncChannel`: a reader only receives, so one
    lock serialises receivers and the one holding it waits by ``poll()`` on the
    control socket itself -- the loops are still :mod:`ringwire._conn.waits`' own,
    without the condition variable a channel needs for a sender and a receiver
    waiting at once (about half the CPU of a wake-up, which a tensor-parallel rank
    pays every step).  Thread-safe: receivers take turns; :meth:`close` from another
    thread wakes the one waiting (``ClosedResourceError``)."""

    def __init__(self, core: Endpoint, transport: SubscriberTransport) -> None:
        self._core = core
        self._transport = transport
        self._lock = threading.Lock()
        self._poll = select.poll()
        self._poll.register(transport.fileno(), select.POLLIN)

    def __enter__(self) -> SyncSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the driver ---------------------------------------------------------------------

    def _wait(self, gen: int, until: float | None) -> None:
        """Perform one :class:`~ringwire._conn.waits.Wait`: until the control socket is
        readable (a doorbell, an abort, end of file, our own close) or ``until``."""
        core = self._core
        if core.wake_gen != gen or core.eof or core.closed or core.broken is not None:
            return
        if until is None:
            ms = -1
        else:
            left = until - time.monotonic()
            if left <= 0:
                return
            ms = max(1, math.ceil(left * 1000))
        if self._poll.poll(ms) and not core.closed:
            core.drain()

    def _run(self, loop: waits.Loop[Any]) -> Any:
        try:
            w = next(loop)
            while True:
                self._wait(w.gen, w.until)
                w = loop.send(None)
        except StopIteration as stop:
            return stop.value
        finally:
            loop.close()

    def _take(self, timeout: float | None) -> float | None:
        """Take the receive lock; the deadline of ``timeout`` (``None``: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(False):
            if deadline is None:
                self._lock.acquire()
            elif not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError("timed out waiting for another thread receiving here")
        return deadline

    # -- receiving ----------------------------------------------------------------------

    def receive(self, timeout: float | None = None, *, type: Any = UNSET) -> Any:
        """As :meth:`Subscriber.receive`, waiting at most ``timeout`` seconds."""
        core = self._core
        dec = core.dec if type is UNSET else core.decoder_for(type)
        deadline = self._take(timeout)
        try:
            obj = core.try_receive(dec)
            if obj is EMPTY:
                if core.spin(core.receive_ready):
                    obj = core.try_receive(dec)
                if obj is EMPTY:
                    obj = self._run(waits.receive(core, dec, deadline))
            return obj
        except (RingCorrupted, BrokenResourceError, DecodeError) as exc:
            raise _translate(core, self._transport, exc)  # noqa: B904  (the cause is set)
        finally:
            self._lock.release()

    def receive_nowait(self, *, type: Any = UNSET) -> Any:
        core = self._core
        with self._lock:
            try:
                return core.receive_nowait(core.decoder_for(type))
            except (RingCorrupted, BrokenResourceError, DecodeError) as exc:
                raise _translate(core, self._transport, exc)  # noqa: B904  (the cause is set)

    def receive_many(
        self, max_n: int = 1024, timeout: float | None = None, *, type: Any = UNSET
    ) -> list[Any]:
        if max_n < 1:
            raise ValueError("max_n must be at least 1")
        core = self._core
        dec = core.decoder_for(type)
        deadline = self._take(timeout)
        try:
            out = core.try_receive_many(dec, max_n)
            if not out:
                out = self._run(waits.receive_many(core, dec, max_n, deadline))
            return out
        except (RingCorrupted, BrokenResourceError, DecodeError) as exc:
            raise _translate(core, self._transport, exc)  # noqa: B904  (the cause is set)
        finally:
            self._lock.release()

    def receive_many_nowait(self, max_n: int = 1024, *, type: Any = UNSET) -> list[Any]:
        core = self._core
        with self._lock:
            try:
                return core.receive_many_nowait(core.decoder_for(type), max_n)
            except (RingCorrupted, BrokenResourceError, DecodeError) as exc:
                raise _translate(core, self._transport, exc)  # noqa: B904  (the cause is set)

    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                yield self.receive()
            except EndOfStream:
                return

    # -- the writer, closing --------------------------------------------------------------

    def poll_writer(self) -> bool:
        """As :meth:`Subscriber.poll_writer` (a receiver waiting right now is already
        watching: then this only reports what it knows)."""
        core = self._core
        if self._lock.acquire(False):
            try:
                if not core.closed:
                    core.drain()
            finally:
                self._lock.release()
        return not (core.eof or core.broken is not None)

    def abort(self, reason: str) -> None:
        """As :meth:`Subscriber.abort`."""
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, not {type(reason).__name__}")
        self._core.abort(reason)
        self.close()

    def close(self) -> None:
        """Leave cleanly (the writer sees our closed flag, then our end of file); a
        thread blocked in a receive gets ``ClosedResourceError``."""
        core = self._core
        if not core.mark_closed():
            return
        core.transport.shutdown()  # wakes a receiver blocked in poll
        with self._lock:
            held = core.release()
        if held:
            warn_held(self, held)

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
            core.abandon(self)


def _socket(path: Any) -> tuple[socket.socket, str]:
    where = os.fspath(path)
    if isinstance(where, str) and where.startswith("tcp://"):
        raise NotImplementedError(
            "remote broadcast readers need TCP channels (issue 'Beyond one host'), which "
            "ringwire does not have yet: subscribe at the broadcast's Unix socket path"
        )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock, str(where)


async def subscribe(
    path: str | os.PathLike[str],
    *,
    rank: int | None = None,
    type: Any = Any,
    spin_us: float = DEFAULT_SPIN_US,
    timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    copy_out: bool = False,
) -> Subscriber:
    """Join the broadcast at ``path`` as reader ``rank`` (``None``: any free rank);
    return the async reader.  It receives what the writer sends from now on.

    ``type`` decodes records; ``spin_us`` bounds the spin before parking (``0``: park
    at once); ``copy_out`` copies every received slot array into private memory and
    releases its slot at once.  Raises :class:`HandshakeError` if the writer refuses
    (rank taken, every rank taken, a failed broadcast), ``TimeoutError`` after
    ``timeout``, ``FileNotFoundError`` / ``ConnectionRefusedError`` when no writer is
    at ``path``."""
    sock, where = _socket(path)
    try:
        with anyio.fail_after(timeout):
            while True:
                try:
                    sock.connect(where)
                    break
                except (BlockingIOError, InterruptedError):
                    await anyio.sleep(0.001)  # backlog full: retry
            pid = check_peer(sock)
            result = await drive_join_async(join_handshake(rank), sock)
        transport = SubscriberTransport(sock, result, pid, copy_out)
    except BaseException:
        sock.close()
        raise
    core = Endpoint(transport, type=type, spin_us=spin_us, name=where)
    return Subscriber(core, transport)


def subscribe_sync(
    path: str | os.PathLike[str],
    *,
    rank: int | None = None,
    type: Any = Any,
    spin_us: float = DEFAULT_SPIN_US,
    timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    copy_out: bool = False,
) -> SyncSubscriber:
    """Blocking :func:`subscribe`: returns a :class:`SyncSubscriber`."""
    sock, where = _socket(path)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                sock.connect(where)
                break
            except (BlockingIOError, InterruptedError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cannot connect to {where}: writer busy") from None
                time.sleep(0.001)
        pid = check_peer(sock)
        result = drive_join_sync(join_handshake(rank), sock, deadline)
        transport = SubscriberTransport(sock, result, pid, copy_out)
    except BaseException:
        sock.close()
        raise
    core = Endpoint(transport, type=type, spin_us=spin_us, name=where)
    return SyncSubscriber(core, transport)
