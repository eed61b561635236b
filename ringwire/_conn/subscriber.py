"""Broadcast readers: :func:`subscribe` (async) and :func:`subscribe_sync`.

A reader is an ordinary receiving endpoint over its own cursor in the broadcast ring
(:class:`~ringwire._shm.broadcast_reader.SubscriberTransport`), driven by the
ordinary drivers: :class:`Subscriber` wraps a :class:`~ringwire.Channel`,
:class:`SyncSubscriber` a :class:`~ringwire.SyncChannel` -- so waiting (a bounded
adaptive spin, then parked on its control socket: no CPU while idle), decoding, slot
views and their finalizers, and the errors are the channels' own.  What a subscriber
adds: its rank, no way to send, and one translation -- a reader the writer dropped
that goes on reading is told by the ring itself (:class:`RingCorrupted` from the
horizon check); it gets ``BrokenResourceError``, like every other way of losing the
writer.

Readers on other hosts: at a ``tcp://`` address the reader is an ordinary receiving
endpoint over a TCP connection (:class:`~ringwire._net.transport.NetTransport`, a
channel's, CURVE with keys), whose first record is the broadcast's ``Join`` and whose
first received record the writer's :class:`~ringwire._wire.broadcast_control.RemoteJoined`
(or the writer's abort: :class:`HandshakeError` with its reason).  Behind the same
:class:`Subscriber` API: arrays arrive as read-only views of the received frames, and
their releases go back to the writer (batched) when the views die.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import anyio
from anyio import BrokenResourceError, EndOfStream

from .._errors import DecodeError, HandshakeError, RingCorrupted
from .._net.keys import ClientKeys
from .._shm.broadcast_reader import (
    SubscriberTransport,
    drive_join_async,
    drive_join_sync,
    join_handshake,
)
from .._shm.sockets import check_peer
from .._wire.broadcast_control import (
    BROADCAST_VERSIONS,
    Join,
    RemoteJoined,
    check_remote_joined,
    encode_remote,
)
from .async_channel import Channel
from .endpoint import DEFAULT_SPIN_US, UNSET, Endpoint
from .listener import DEFAULT_HANDSHAKE_TIMEOUT
from .netconn import (
    DEFAULT_HEARTBEAT,
    check_heartbeat,
    connect_transport,
    drive_async,
    drive_sync,
)
from .observed import track
from .options import check_options, receiving
from .statistics import ChannelStatistics
from .sync_channel import SyncChannel

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
    _transport: Any

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

    def __init__(self, core: Endpoint, transport: Any, chan: Channel | None = None) -> None:
        self._core = core
        self._transport = transport  # a SubscriberTransport, or RemoteReading
        self._chan = chan if chan is not None else Channel(core)
        track(self, core, "subscriber")  # (its channel's entry, as a subscriber)

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
        """The next record, without waiting.  Raises :class:`anyio.WouldBlock` if none
        is published yet, and what :meth:`receive` raises (``EndOfStream`` after the
        writer closed, ``BrokenResourceError`` if it died or dropped this reader,
        ``ClosedResourceError`` after :meth:`aclose`, :class:`DecodeError`)."""
        try:
            return self._chan.receive_nowait(type=type)
        except (RingCorrupted, BrokenResourceError, DecodeError) as exc:
            raise _translate(self._core, self._transport, exc)  # noqa: B904  (the cause is set)

    async def receive_many(self, max_n: int = 1024, *, type: Any = UNSET) -> list[Any]:
        """Wait for at least one record, then return every published one, up to
        ``max_n`` (a list, in order).  Raises ``ValueError`` for ``max_n < 1`` and what
        :meth:`receive` raises."""
        try:
            return await self._chan.receive_many(max_n, type=type)
        except (RingCorrupted, BrokenResourceError, DecodeError) as exc:
            raise _translate(self._core, self._transport, exc)  # noqa: B904  (the cause is set)

    def receive_many_nowait(self, max_n: int = 1024, *, type: Any = UNSET) -> list[Any]:
        """Every record published and not yet read (up to ``max_n``), without waiting.
        Raises ``WouldBlock`` if there is none, and what :meth:`receive` raises."""
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
        """Leave cleanly, without awaiting (as :meth:`aclose`); closing twice is a no-op."""
        self._chan.close()


class SyncSubscriber(_Common):
    """Blocking :class:`Subscriber` (threads, plain scripts): ``timeout`` arguments
    raise ``TimeoutError``.  Made by :func:`ringwire.subscribe_sync`.  Its driver is a
    :class:`~ringwire.SyncChannel` that only receives: thread-safe, receivers take
    turns; :meth:`close` from another thread wakes the one waiting
    (``ClosedResourceError``)."""

    def __init__(self, core: Endpoint, transport: Any, chan: SyncChannel | None = None) -> None:
        self._core = core
        self._transport = transport  # a SubscriberTransport, or RemoteReading
        self._chan = chan if chan is not None else SyncChannel(core)
        track(self, core, "subscriber")

    def __enter__(self) -> SyncSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def receive(self, timeout: float | None = None, *, type: Any = UNSET) -> Any:
        """As :meth:`Subscriber.receive`, waiting at most ``timeout`` seconds
        (``TimeoutError``)."""
        try:
            return self._chan.receive(timeout, type=type)
        except (RingCorrupted, BrokenResourceError, DecodeError) as exc:
            raise _translate(self._core, self._transport, exc)  # noqa: B904  (the cause is set)

    def receive_nowait(self, *, type: Any = UNSET) -> Any:
        """As :meth:`Subscriber.receive_nowait`."""
        try:
            return self._chan.receive_nowait(type=type)
        except (RingCorrupted, BrokenResourceError, DecodeError) as exc:
            raise _translate(self._core, self._transport, exc)  # noqa: B904  (the cause is set)

    def receive_many(
        self, max_n: int = 1024, timeout: float | None = None, *, type: Any = UNSET
    ) -> list[Any]:
        """As :meth:`Subscriber.receive_many`, waiting at most ``timeout`` seconds."""
        try:
            return self._chan.receive_many(max_n, timeout, type=type)
        except (RingCorrupted, BrokenResourceError, DecodeError) as exc:
            raise _translate(self._core, self._transport, exc)  # noqa: B904  (the cause is set)

    def receive_many_nowait(self, max_n: int = 1024, *, type: Any = UNSET) -> list[Any]:
        """As :meth:`Subscriber.receive_many_nowait`."""
        try:
            return self._chan.receive_many_nowait(max_n, type=type)
        except (RingCorrupted, BrokenResourceError, DecodeError) as exc:
            raise _translate(self._core, self._transport, exc)  # noqa: B904  (the cause is set)

    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                yield self.receive()
            except EndOfStream:
                return

    def poll_writer(self) -> bool:
        """As :meth:`Subscriber.poll_writer`."""
        return self._chan.poll_peer()

    def abort(self, reason: str) -> None:
        """As :meth:`Subscriber.abort`."""
        self._chan.abort(reason)

    def close(self) -> None:
        """Leave cleanly (the writer sees our closed flag, then our end of file); a
        thread blocked in a receive gets ``ClosedResourceError``."""
        self._chan.close()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
            core.abandon(self)


class RemoteReading:
    """What a remote reader knows of its place in the broadcast (a local reader's
    :class:`SubscriberTransport` answers the same questions)."""

    def __init__(self, t: Any, joined: RemoteJoined) -> None:
        self._t = t
        self.rank = joined.rank
        self.start = joined.start

    @property
    def peer_reason(self) -> str | None:
        reason: str | None = self._t.peer_reason
        return reason

    def fileno(self) -> int:
        return int(self._t.fileno())

    def drain(self) -> None:
        self._t.drain()


def _socket(path: Any) -> tuple[socket.socket, str]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock, str(os.fspath(path))


def _is_tcp(path: Any) -> bool:
    return isinstance(path, str) and path.startswith("tcp://")


def _remote_start(
    url: str,
    rank: int | None,
    spin_us: float,
    handshake_timeout: float,
    copy_out: bool,
    keys: ClientKeys | None,
    heartbeat: float,
) -> Any:
    """Check a remote subscription's arguments; its connection's handshake generator."""
    check_options(spin_us, handshake_timeout, copy_out)
    check_heartbeat(heartbeat)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ValueError(f"rank must be None or an int >= 0, not {rank!r}")
    _, gen = connect_transport(
        url,
        capacity=REMOTE_ASK,
        slots=None,
        heartbeat=heartbeat,
        timeout=handshake_timeout,
        keys=keys,
        max_message=-1,  # arrays of any size come from the writer's slots and arena
        offer_nixl=False,  # (a broadcast's arrays come as frames)
    )
    return gen


REMOTE_ASK = 1 << 30  # the lane a remote reader asks for: the writer answers its window


def _send_join(core: Endpoint, rank: int | None, url: str) -> None:
    join = Join(
        versions=list(BROADCAST_VERSIONS), pid=os.getpid(), rank=-1 if rank is None else rank
    )
    if not core.try_send(encode_remote(join)):  # pragma: no cover - a fresh window
        raise HandshakeError(f"no room for the join on the connection to {url}")


def _admitted(t: Any, joined: RemoteJoined) -> RemoteReading:
    check_remote_joined(joined, REMOTE_ASK)
    t.rx.capacity = joined.window  # (credit as the writer's window says)
    return RemoteReading(t, joined)


def _refused(url: str, core: Endpoint, exc: BaseException) -> HandshakeError:
    if isinstance(exc, DecodeError):
        return HandshakeError(f"the broadcast writer at {url} answered the join with {exc}")
    reason = core.peer_reason or str(exc) or type(exc).__name__
    return HandshakeError(f"the broadcast writer at {url} refused this reader: {reason}")


async def _subscribe_remote(
    url: str,
    rank: int | None,
    type: Any,
    spin_us: float,
    handshake_timeout: float,
    copy_out: bool,
    keys: ClientKeys | None,
    heartbeat: float,
) -> Subscriber:
    gen = _remote_start(url, rank, spin_us, handshake_timeout, copy_out, keys, heartbeat)
    deadline = time.monotonic() + handshake_timeout
    t = receiving(await drive_async(gen), copy_out)
    core = Endpoint(t, type=type, spin_us=spin_us, name=url)
    chan = Channel(core)
    try:
        with anyio.fail_after(max(0.0, deadline - time.monotonic())):
            _send_join(core, rank, url)
            try:
                joined = await chan.receive(type=RemoteJoined)
            except (BrokenResourceError, EndOfStream, DecodeError) as exc:
                raise _refused(url, core, exc) from None
        reading = _admitted(t, joined)
    except BaseException:
        chan.close()
        raise
    return Subscriber(core, reading, chan)


def _subscribe_remote_sync(
    url: str,
    rank: int | None,
    type: Any,
    spin_us: float,
    handshake_timeout: float,
    copy_out: bool,
    keys: ClientKeys | None,
    heartbeat: float,
) -> SyncSubscriber:
    gen = _remote_start(url, rank, spin_us, handshake_timeout, copy_out, keys, heartbeat)
    deadline = time.monotonic() + handshake_timeout
    t = receiving(drive_sync(gen), copy_out)
    core = Endpoint(t, type=type, spin_us=spin_us, name=url)
    chan = SyncChannel(core)
    try:
        _send_join(core, rank, url)
        try:
            joined = chan.receive(max(0.0, deadline - time.monotonic()), type=RemoteJoined)
        except (BrokenResourceError, EndOfStream, DecodeError) as exc:
            raise _refused(url, core, exc) from None
        reading = _admitted(t, joined)
    except BaseException:
        chan.close()
        raise
    return SyncSubscriber(core, reading, chan)


async def subscribe(
    path: str | os.PathLike[str],
    *,
    rank: int | None = None,
    type: Any = Any,
    spin_us: float = DEFAULT_SPIN_US,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    copy_out: bool = False,
    keys: ClientKeys | None = None,
    heartbeat: float = DEFAULT_HEARTBEAT,
) -> Subscriber:
    """Join the broadcast at ``path`` as reader ``rank`` (``None``: any free rank);
    return the async reader.  It receives what the writer sends from now on.

    ``type`` decodes records; ``spin_us`` bounds the spin before parking (``0``: park
    at once); ``copy_out`` copies every received slot array into private memory and
    releases its slot at once.

    ``path`` may be the writer's ``tcp://host:port`` (its ``tcp=``): a reader on
    another host, with the same API and promises; ``keys`` (:class:`ClientKeys`) when
    the writer has keys, ``heartbeat`` seconds of silence that count as a lost
    writer (records in flight to it are bounded by the writer's ``capacity``).
    ``keys`` and ``heartbeat`` are ignored for a Unix path.

    Raises :class:`HandshakeError` if the writer refuses (rank taken, every rank
    taken, a failed broadcast), ``TimeoutError`` after ``handshake_timeout``,
    ``FileNotFoundError`` / ``ConnectionRefusedError`` when no writer is at ``path``,
    :class:`PeerCredentialsError` when CURVE refuses the keys, ``ValueError`` for a bad
    address or argument."""
    if _is_tcp(path):
        return await _subscribe_remote(
            str(path), rank, type, spin_us, handshake_timeout, copy_out, keys, heartbeat
        )
    sock, where = _socket(path)
    try:
        with anyio.fail_after(handshake_timeout):
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
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    copy_out: bool = False,
    keys: ClientKeys | None = None,
    heartbeat: float = DEFAULT_HEARTBEAT,
) -> SyncSubscriber:
    """Blocking :func:`subscribe`: returns a :class:`SyncSubscriber`."""
    if _is_tcp(path):
        return _subscribe_remote_sync(
            str(path), rank, type, spin_us, handshake_timeout, copy_out, keys, heartbeat
        )
    sock, where = _socket(path)
    deadline = time.monotonic() + handshake_timeout
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
