"""Connections over shared-memory rings: async and blocking endpoints, listeners, pairs.

A connection is duplex: one SPSC ring lane per direction (see
:mod:`ringwire._ringlayout`), both in one shared-memory segment created by the
connecting side, plus one Unix control socket for the handshake, doorbells and
liveness (see :mod:`ringwire._control`).

Waiting
-------
An endpoint with nothing to read (or no room to write) first spins on the ring for a
bounded time, then *parks*: it sets its parked flag in the ring header, fences,
re-checks the ring, and only then waits for its control socket to become readable.
The peer sends one doorbell byte to a parked endpoint after publishing (the
eventcount argument is in the header of :mod:`ringwire._ringlayout`).  A parked
endpoint uses no CPU.

The spin budget starts at ``spin_us`` (default :data:`DEFAULT_SPIN_US`) and adapts: a
spin that sees data doubles it (up to ``spin_us``), one that times out halves it (down
to 2 us), so a peer that answers quickly is caught hot and a slow or descheduled one
costs almost nothing.  An async spin does not yield to the event loop (it is short);
``spin_us=0`` parks at once -- the right choice when both ends share one event loop
or the machine has fewer cores than busy processes.

Several tasks (or threads) of one endpoint may wait at once -- one receiving, one
sending, two receivers, a receiver and a listener's fan-in.  A waiter records a "wake
generation" *before* it parks and returns as soon as it changes, so a doorbell drained
on behalf of another waiter is never lost; the parked flags are counted, and each new
parker writes a fresh sequence number so the peer rings for it too.

* asyncio / uvloop: the control socket is registered with the loop once
  (``add_reader``) for the life of the connection; the callback drains doorbells and
  resolves the waiters' futures.  Parking costs no ``epoll_ctl`` and no extra task.
* other anyio backends (trio): one waiter awaits ``anyio.wait_readable`` on the socket,
  the others an ``anyio.Event`` it sets.
* blocking endpoints: one thread ``poll()`` s the socket, the others wait on a condition
  variable.

Liveness
--------
End of file on the control socket means the peer is gone.  The closed flags in the
ring headers say whether it closed cleanly: a receiver first gets every record that
was published, then :class:`anyio.EndOfStream` (clean close or ``send_eof``) or
:class:`anyio.BrokenResourceError` (a crash: the kernel closed the peer's socket).
Sending to a peer known to be gone raises ``BrokenResourceError``; any operation after
our own close raises ``ClosedResourceError``.  A waiting endpoint learns of the death at
once; so does any asyncio endpoint (its loop watches the socket from the start); a
sender that never waits, elsewhere, checks every ``_ALIVE_EVERY`` records (see
:meth:`_ChannelBase._check_alive`).  A malformed frame or garbage on the
control socket breaks only that connection (``BrokenResourceError`` whose cause is a
:class:`RingCorrupted` / :class:`ProtocolError`).

Tensor slots
------------
Each side may own a send pool (:mod:`ringwire._slots`): the client announces its
pool in ``Hello.segments`` (role ``"slots"``), the server in ``Welcome.segments``; each
side attaches the other's, and every name is unlinked once both attached.
:meth:`_ChannelBase._make_codec` is the one place where the Encoder (with the send
pool's ``placer``) and Decoders (with the peer pool's ``resolver``) are built.  *Safe
points* -- every send, receive and loan, and every doorbell wake-up -- push releases
queued by finalizers and process the peer's releases; end of file on the control
socket reclaims every slot the peer held.  A slot waiter parks on its pool's release
lane exactly as a sender parks on a full ring.
"""

from __future__ import annotations

import asyncio
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
import weakref
from collections.abc import AsyncIterator, Awaitable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream, WouldBlock

from ._codec import Decoder, Encoder
from ._control import (
    DOORBELL_BYTES,
    DOORBELL_CLOSE,
    DOORBELL_DATA,
    DOORBELL_SPACE,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Handshake,
    HandshakeError,
    Hello,
    ProtocolError,
    Ready,
    Reject,
    RingSpec,
    SegmentSpec,
    Welcome,
    bind_unix_socket,
    check_peer,
    choose_version,
    validate_hello,
)
from ._cuda import CudaNeed
from ._descriptors import CudaRef
from ._errors import DecodeError, RingwireError
from ._ringlayout import _TAIL as _LANE_TAIL
from ._ringlayout import (
    MAX_CAPACITY,
    RCLOSED,
    WCLOSED,
    RingCorrupted,
    RingReader,
    RingWriter,
    check_ring,
    fence,
    init_ring,
    ring_size,
    validate_capacity,
)
from ._segment import Segment, SegmentError, name_pid, pid_alive, sweep, unlink_segment
from ._slotlayout import PoolLayout, SlotRefused
from ._slots import (
    DEFAULT_SLOTS,
    Placed,
    RecvPool,
    SendPool,
    SlotConfig,
    SlotsExhausted,
    _NeedSlot,
    attach_pool,
    check_policy,
    create_pool,
    loan_spec,
    resolve_config,
)

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_SPIN_US",
    "Channel",
    "Receipt",
    "SyncReceipt",
    "ChannelStatistics",
    "Listener",
    "ListenerStatistics",
    "PairEnd",
    "SyncChannel",
    "SyncListener",
    "connect",
    "connect_sync",
    "listen",
    "pair",
]

logger = logging.getLogger("ringwire")

DEFAULT_CAPACITY = 1 << 20
"""Bytes of each ring lane's data area (records up to half of it travel inline)."""
DEFAULT_SPIN_US = 50.0
"""How long (at most) an endpoint spins on an empty (or full) ring before it parks."""
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
DEFAULT_PAIR_TIMEOUT = 60.0

_EMPTY: Any = object()
_UNSET: Any = object()
_YIELD_EVERY = 32  # async fast paths yield to the event loop at least this often
_MIN_SPIN_NS = 2_000  # the adaptive spin budget never drops below this
_SPIN_YIELD_NS = 20_000  # a spinning endpoint calls sched_yield() this often
_SPIN_PROBE = 16  # after this many spins in a row time out, try the full budget again
_LOAN_TICK = 0.05  # a sender waiting for a slot re-checks this often while loans are out
_ALIVE_EVERY = 8  # a sender off asyncio looks for the peer's death every this many records...
_ALIVE_NS = 2_000_000  # ...and at most this often (see _ChannelBase._check_alive)
_HANGUP = getattr(select, "POLLRDHUP", 0)  # (POLLHUP and POLLERR are always reported)


@dataclass(frozen=True)
class ChannelStatistics:
    """A snapshot of one connection's counters."""

    records_sent: int
    records_received: int
    bytes_sent: int
    bytes_received: int
    send_capacity: int
    send_fill: int
    receive_capacity: int
    receive_fill: int
    send_parks: int
    receive_parks: int
    doorbells_sent: int
    doorbells_received: int
    # the send pool (tensor slots this side lends to the peer); zeros without one
    slots_in_use: int = 0
    slots_free: dict[int, int] = field(default_factory=dict)  # slot size -> free slots
    slot_bytes_in_use: int = 0
    releases_received: int = 0
    loans_outstanding: int = 0
    inline_fallbacks: int = 0
    slots_reclaimed: int = 0
    # this side's GPU pools (CUDA tensors sent by reference, Ext 5)
    cuda_pools: list[int] = field(default_factory=list)  # devices with a pool
    cuda_slots_in_use: int = 0
    cuda_slots_free: dict[str, dict[int, int]] = field(default_factory=dict)  # device -> ...
    cuda_staged: int = 0  # CUDA tensors sent through host slots (SlotConfig(cuda="stage"))
    # the receive side (slots the peer lent us)
    slot_arrays_received: int = 0
    slot_arrays_held: int = 0
    releases_pending: int = 0
    cuda_tensors_received: int = 0
    cuda_pools_opened: int = 0  # the peer's GPU pools mapped here (once per device)


@dataclass(frozen=True)
class ListenerStatistics:
    """A snapshot of a listener's counters."""

    open_connections: int
    accepted: int
    refused: int
    broken: int
    ended: int


# -- handshakes (one generator per role, driven by a sync or an async driver) ----------------

# A handshake generator yields ("send", bytes), ("send_best_effort", bytes) or
# ("recv", None); the driver answers a "recv" with the bytes received (b"" at EOF).


@dataclass
class _Established:
    sock: socket.socket
    segments: list[Segment]
    tx: tuple[int, int]  # (segment index, offset) of the lane we write
    rx: tuple[int, int]
    peer_pid: int
    version: int
    own_pool: tuple[Segment, PoolLayout, SlotConfig] | None = None  # the pool we send from
    peer_pool: tuple[Segment, PoolLayout] | None = None  # the peer's send pool


@dataclass
class _HandshakeResult:
    segments: list[Segment]
    tx: tuple[int, int]
    rx: tuple[int, int]
    peer_pid: int
    own_pool: tuple[Segment, PoolLayout, SlotConfig] | None
    peer_pool: tuple[Segment, PoolLayout] | None


_Step = tuple[str, bytes | None]
_HandshakeGen = Generator[_Step, bytes | None, _HandshakeResult]


def _recv_message(hs: Handshake) -> Generator[_Step, bytes | None, Any]:
    while True:
        msg = hs.next_message()
        if msg is not None:
            return msg
        data = yield ("recv", None)
        hs.receive_data(data or b"")


def _attach_peer_pool(specs: Sequence[SegmentSpec]) -> tuple[Segment, PoolLayout] | None:
    """Attach and check the peer's send pool (the one segment of role "slots")."""
    pools = [spec for spec in specs if spec.role == "slots"]
    if not pools:
        return None
    if len(pools) > 1:
        raise HandshakeError("the peer announced more than one slot pool")
    spec = pools[0]
    if not 0 < spec.size <= 1 << 40:
        raise HandshakeError(f"bad slot pool size {spec.size!r}")
    try:
        seg = Segment.attach(spec.name, spec.size)
    except SegmentError as exc:
        raise HandshakeError(f"cannot attach the peer's slot pool: {exc}") from None
    try:
        layout = attach_pool(seg)
    except RingwireError as exc:
        seg.close()
        raise HandshakeError(f"the peer's slot pool is malformed: {exc}") from None
    return seg, layout


def _client_handshake(capacity: int, slots: SlotConfig | None = None) -> _HandshakeGen:
    lane = ring_size(capacity)
    seg = Segment.create(2 * lane)
    own: tuple[Segment, PoolLayout, SlotConfig] | None = None
    peer: tuple[Segment, PoolLayout] | None = None
    try:
        init_ring(seg.buf, 0, capacity)
        init_ring(seg.buf, lane, capacity)
        specs = [SegmentSpec(seg.name, seg.size, "rings")]
        if slots is not None:
            pseg, layout = create_pool(slots)
            own = (pseg, layout, slots)
            specs.append(SegmentSpec(pseg.name, pseg.size, "slots"))
        hs = Handshake("client")
        hello = Hello(
            versions=list(SUPPORTED_VERSIONS),
            pid=os.getpid(),
            segments=specs,
            c2s=RingSpec(0, 0, capacity),
            s2c=RingSpec(0, lane, capacity),
        )
        yield ("send", hs.send(hello))
        welcome = yield from _recv_message(hs)
        assert isinstance(welcome, Welcome)
        if welcome.version not in SUPPORTED_VERSIONS:
            raise HandshakeError(f"the listener chose unsupported version {welcome.version}")
        seg.unlink()  # the server has attached: the names can go
        if own is not None:
            own[0].unlink()
        peer = _attach_peer_pool(welcome.segments)  # other roles: not ours to use
        if peer is not None:  # attached: its name can go now (the server may die before Ready)
            unlink_segment(peer[0].name)
        yield ("send", hs.send(Ready()))
        return _HandshakeResult([seg], (0, 0), (0, lane), welcome.pid, own, peer)
    except BaseException:
        seg.unlink()
        seg.close()
        if own is not None:
            own[0].unlink()
            own[0].close()
        if peer is not None:
            peer[0].close()  # the server unlinks its own names
        raise


def _server_handshake(
    cred_pid: int, max_capacity: int, slots: SlotConfig | None = None, *, own_names: bool = False
) -> _HandshakeGen:
    """The accepting side.  ``cred_pid`` is the peer's pid from SO_PEERCRED (for a
    socketpair, the pid of the process that made the pair).  ``own_names`` (a
    listener): every segment the client announces must carry the client's own pid, so
    a client cannot point the server at another process's segments (whose names are
    visible in ``/dev/shm`` while that process's handshake is in flight)."""
    hs = Handshake("server")
    try:
        hello = yield from _recv_message(hs)
    except HandshakeError as exc:
        # a client that died before its Hello may leave a segment nobody can name;
        # the listener sweeps once that pid is gone
        exc.before_hello = True  # type: ignore[attr-defined]
        raise
    assert isinstance(hello, Hello)
    attached: list[Segment] = []
    own: tuple[Segment, PoolLayout, SlotConfig] | None = None
    peer: tuple[Segment, PoolLayout] | None = None
    ok = False
    try:
        try:
            version = choose_version(hello.versions)
            validate_hello(hello, max_capacity=max_capacity)
            if own_names:
                for spec in hello.segments:
                    if name_pid(spec.name) != cred_pid:
                        raise HandshakeError(
                            f"segment {spec.name} was not made by the connecting process "
                            f"(pid {cred_pid})"
                        )
            pools = [i for i, spec in enumerate(hello.segments) if spec.role == "slots"]
            if len(pools) > 1:
                raise HandshakeError("the client announced more than one slot pool")
            if pools and pools[0] in (hello.c2s.segment, hello.s2c.segment):
                raise HandshakeError("a ring lies in the slot pool segment")
            for spec in hello.segments:
                attached.append(Segment.attach(spec.name, spec.size))
            for ring in (hello.c2s, hello.s2c):
                check_ring(attached[ring.segment].buf, ring.offset, ring.capacity)
            if pools:
                try:
                    peer = (attached[pools[0]], attach_pool(attached[pools[0]]))
                except RingwireError as exc:
                    raise HandshakeError(f"malformed slot pool: {exc}") from None
            if slots is not None:
                pseg, layout = create_pool(slots)
                own = (pseg, layout, slots)
        except (HandshakeError, SegmentError, RingCorrupted) as exc:
            yield ("send_best_effort", hs.send(Reject(str(exc))))
            raise HandshakeError(f"client pid {hello.pid}: {exc}") from None
        specs = [] if own is None else [SegmentSpec(own[0].name, own[0].size, "slots")]
        yield ("send", hs.send(Welcome(version=version, pid=os.getpid(), segments=specs)))
        yield from _recv_message(hs)  # Ready: the client attached our pool
        if own is not None:
            own[0].unlink()
        ok = True
        rings = [seg for i, seg in enumerate(attached) if not (peer and seg is peer[0])]
        index = {id(seg): i for i, seg in enumerate(rings)}
        return _HandshakeResult(
            rings,
            (index[id(attached[hello.s2c.segment])], hello.s2c.offset),
            (index[id(attached[hello.c2s.segment])], hello.c2s.offset),
            hello.pid,
            own,
            peer,
        )
    finally:
        if not ok:
            for seg in attached:
                seg.close()
            if own is not None:
                own[0].unlink()
                own[0].close()
            # a client that died mid-handshake cannot unlink its names any more
            for spec in hello.segments:
                try:
                    if name_pid(spec.name) in (hello.pid, cred_pid):
                        unlink_segment(spec.name)
                except ValueError:
                    pass


def _finish(gen: _HandshakeGen, stop: StopIteration, sock: socket.socket) -> _Established:
    r: _HandshakeResult = stop.value
    return _Established(
        sock, r.segments, r.tx, r.rx, r.peer_pid, PROTOCOL_VERSION, r.own_pool, r.peer_pool
    )


async def _send_all_async(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = sock.send(view)
        except BlockingIOError:
            await anyio.wait_writable(sock)
            continue
        view = view[n:]


async def _drive_async(gen: _HandshakeGen, sock: socket.socket) -> _Established:
    try:
        step = next(gen)
        while True:
            kind, data = step
            answer: bytes | None = None
            if kind == "recv":
                while True:
                    try:
                        answer = sock.recv(65536)
                        break
                    except BlockingIOError:
                        await anyio.wait_readable(sock)
                    except (ConnectionResetError, BrokenPipeError):
                        answer = b""
                        break
            else:
                assert data is not None
                try:
                    await _send_all_async(sock, data)
                except OSError:
                    if kind == "send":
                        raise HandshakeError(
                            "the peer closed the connection during the handshake"
                        ) from None
            step = gen.send(answer)
    except StopIteration as stop:
        return _finish(gen, stop, sock)
    finally:
        gen.close()


def _poll_fd(fd: int, events: int, timeout: float | None) -> bool:
    p = select.poll()
    p.register(fd, events)
    ms = -1 if timeout is None else max(0, math.ceil(timeout * 1000))
    return bool(p.poll(ms))


def _drive_sync(gen: _HandshakeGen, sock: socket.socket, deadline: float) -> _Established:
    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the ringwire handshake timed out")
        return left

    try:
        step = next(gen)
        while True:
            kind, data = step
            answer: bytes | None = None
            if kind == "recv":
                while True:
                    try:
                        answer = sock.recv(65536)
                        break
                    except BlockingIOError:
                        _poll_fd(sock.fileno(), select.POLLIN, remaining())
                    except (ConnectionResetError, BrokenPipeError):
                        answer = b""
                        break
            else:
                assert data is not None
                view = memoryview(data)
                try:
                    while view:
                        try:
                            view = view[sock.send(view) :]
                        except BlockingIOError:
                            _poll_fd(sock.fileno(), select.POLLOUT, remaining())
                except OSError:
                    if kind == "send":
                        raise HandshakeError(
                            "the peer closed the connection during the handshake"
                        ) from None
            step = gen.send(answer)
    except StopIteration as stop:
        return _finish(gen, stop, sock)
    finally:
        gen.close()


# -- the endpoint core ---------------------------------------------------------------------


class _ChannelBase:
    """State and non-blocking operations shared by :class:`Channel` and :class:`SyncChannel`."""

    def __init__(
        self,
        est: _Established,
        *,
        type: Any = Any,
        spin_us: float = DEFAULT_SPIN_US,
        name: str = "",
    ) -> None:
        self._closed = False
        self._sock = est.sock
        self._fd = est.sock.fileno()
        self._segments = est.segments
        self._tx = RingWriter(est.segments[est.tx[0]].buf, est.tx[1])
        self._rx = RingReader(est.segments[est.rx[0]].buf, est.rx[1])
        self.peer_pid = est.peer_pid
        self.protocol_version = est.version
        self.name = name
        self._spin_ns = self._spin_cur = int(max(0.0, float(spin_us)) * 1000)
        self._spin_misses = 0
        self._eof = False  # EOF (or reset) seen on the control socket
        self._tx_blocked = False  # closed, broken, EOF, or send_eof: sends go the slow way
        self._broken: BaseException | None = None
        self._eof_sent = False
        self._wake_gen = 0
        self._polling = False
        self._rx_parked = self._tx_parked = 0
        self._aio_waiters: list[asyncio.Future[None]] = []
        self._type = type
        self._pool: SendPool | None = None
        self._peer: RecvPool | None = None
        if est.own_pool is not None:
            seg, layout, config = est.own_pool
            self._pool = SendPool(seg, layout, config, self._tx.max_payload - 1024)
        if est.peer_pool is not None:
            seg, layout = est.peer_pool
            copy = self._pool.config.copy_out if self._pool is not None else False
            self._peer = RecvPool(seg, layout, est.sock, copy)
        self._slots_on = self._pool is not None or self._peer is not None
        self._slot_waits = 0
        self._undecodable: tuple[bytes, list[tuple[int, int]], str] | None = None
        self._make_codec()
        # counters
        self._n_sent = self._n_recv = self._b_sent = self._b_recv = 0
        self._send_parks = self._recv_parks = 0
        self._bells_sent = self._bells_recv = 0
        self._fast_ops = 0
        self._alive_checked = 0

    # -- the one place where codecs are made: the send pool's placer, the peer pool's resolver

    def _make_codec(self) -> None:
        self._enc = Encoder(placer=self._pool.place if self._pool is not None else None)
        self._resolver = self._peer.resolve if self._peer is not None else _no_pool
        self._dec = Decoder(self._type, resolver=self._resolver)
        self._decoders: dict[Any, Decoder] = {self._type: self._dec}

    def _decoder_for(self, tp: Any) -> Decoder:
        if tp is _UNSET:
            return self._dec
        dec = self._decoders.get(tp)
        if dec is None:
            dec = self._decoders[tp] = Decoder(tp, resolver=self._resolver)
        return dec

    # -- slots: safe points, encoding with placement -----------------------------------------

    def _loan_now(self, pool: SendPool, spec: Any, policy: str) -> Any:
        """One loan attempt shared by the async and blocking :meth:`loan`: the loaned
        array, the inline fallback, or ``None`` (wait for a slot); raises when waiting
        is pointless."""
        self._check_send()
        self._slot_safe_point()
        arr = pool.loan(*spec)
        if arr is not None:
            return arr
        if policy == "inline":
            return pool.loan_fallback(*spec)
        if policy == "error" or pool.futile(spec[-1]):
            raise SlotsExhausted(
                f"no free slot for a loan of {spec[-1]} bytes (pool: {pool.config.describe()})"
            )
        return None

    def _slot_safe_point(self) -> None:
        """Push releases queued by finalizers; process the peer's releases (and our
        dropped loans); reclaim the pool if the peer is gone.  Never blocks."""
        peer = self._peer
        if peer is not None and peer.queue._pending:
            peer.queue.flush()
        pool = self._pool
        if pool is not None:
            if pool.gone:
                if pool._loan_returns:
                    pool.reclaim()  # only takes back loans dropped since
            elif self._eof:
                pool.reclaim()
            else:  # pool.has_work(), inlined: this runs on every send and receive
                lane = pool.reader
                if (
                    pool._loan_returns
                    or lane._head != lane._tail_cache
                    or lane._q[_LANE_TAIL] != lane._head
                ):
                    self._poll_pool(pool)

    def _poll_pool(self, pool: SendPool) -> None:
        try:
            ring_back = pool.poll()
        except (SlotRefused, RingCorrupted) as exc:
            self._break(exc)
            return
        if ring_back:
            self._ring(DOORBELL_SPACE)

    def _encode_placed(self, item: Any, policy: str | None) -> tuple[bytes, Placed]:
        """Encode one record, placing its large arrays in slots.  Raises
        :class:`_NeedSlot` (policy "wait", nothing held) when the pool is exhausted."""
        pool = self._pool
        assert pool is not None
        if self._tx_blocked:
            self._check_send()  # closed, broken or gone: nothing to place
        pool.begin(policy)
        try:
            payload = self._enc.encode(item)
            if len(payload) > self._tx.max_payload:
                self._tx.check_size(len(payload))
        except BaseException:
            pool.abort(pool.end())
            raise
        return payload, pool.end()

    def _slot_wait_ready(self, nbytes: int | CudaNeed) -> bool:
        """Should a sender waiting for a slot stop waiting?"""
        pool = self._pool
        assert pool is not None
        if pool.has_work():
            self._slot_safe_point()
        return (
            self._closed
            or self._eof
            or self._broken is not None
            or self._tx.reader_closed
            or pool.can_allocate(nbytes)
        )

    def _check_slot_wait(self, nbytes: int | CudaNeed) -> bool:
        """Before waiting for a slot: ``True`` if one is free now; raises if waiting
        is pointless (the connection is gone, or no slot is in use at all)."""
        self._check_send()
        self._slot_safe_point()
        pool = self._pool
        assert pool is not None
        if pool.can_allocate(nbytes):
            return True
        if pool.futile(nbytes):
            raise SlotsExhausted(f"no slot can hold {nbytes} bytes ({pool.config.describe()})")
        return False

    def _require_pool(self) -> SendPool:
        if self._pool is None:
            raise RingwireError("this endpoint has no slot pool (it was opened with slots=None)")
        return self._pool

    def _encode_batch(
        self, items: Sequence[Any], start: int, policy: str | None
    ) -> tuple[list[bytes], list[Placed], int | CudaNeed | None]:
        """Encode ``items[start:]`` until one needs a slot that is not free (policy
        "wait"): the payloads so far, their slots, and the bytes that one needs."""
        pool = self._pool
        assert pool is not None
        payloads: list[bytes] = []
        placed: list[Placed] = []
        try:
            for k in range(start, len(items)):
                try:
                    payload, p = self._encode_placed(items[k], policy)
                except _NeedSlot as need:
                    return payloads, placed, need.nbytes
                payloads.append(payload)
                placed.append(p)
        except BaseException:
            for p in placed:
                pool.abort(p)
            raise
        return payloads, placed, None

    def _slot_deadline(self) -> float | None:
        pool = self._pool
        t = pool.config.wait_timeout if pool is not None else None
        return None if t is None else time.monotonic() + t

    def _slot_timeout(self, nbytes: int | CudaNeed) -> SlotsExhausted:
        assert self._pool is not None
        return SlotsExhausted(
            f"no slot for {nbytes} bytes was released within {self._pool.config.wait_timeout} s "
            f"(pool: {self._pool.config.describe()})"
        )

    # -- small helpers ----------------------------------------------------------------------

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken or self._eof else "open"
        label = f" {self.name}" if self.name else ""
        return f"<{type(self).__name__}{label} peer pid {self.peer_pid} {state}>"

    @property
    def closed(self) -> bool:
        """Did *we* close this endpoint?"""
        return self._closed

    def fileno(self) -> int:
        """The control socket (readable when a doorbell or EOF is pending)."""
        return self._fd

    def statistics(self) -> ChannelStatistics:
        if self._closed:
            tx_fill = rx_fill = 0
        else:
            tx_fill = self._tx.used()
            rx_fill = self._rx.fill()
        return ChannelStatistics(
            records_sent=self._n_sent,
            records_received=self._n_recv,
            bytes_sent=self._b_sent,
            bytes_received=self._b_recv,
            send_capacity=self._tx.capacity,
            send_fill=tx_fill,
            receive_capacity=self._rx.capacity,
            receive_fill=rx_fill,
            send_parks=self._send_parks,
            receive_parks=self._recv_parks,
            doorbells_sent=self._bells_sent,
            doorbells_received=self._bells_recv,
            **self._slot_statistics(),
        )

    def _slot_statistics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        pool = self._pool
        if pool is not None:
            if not self._closed:
                self._slot_safe_point()
            out.update(pool.statistics())
            out["slots_reclaimed"] = pool.reclaimed
        peer = self._peer
        if peer is not None:
            out["slot_arrays_received"] = peer.received
            out["slot_arrays_held"] = len(peer.held)
            out["releases_pending"] = len(peer.queue)
            out["cuda_tensors_received"] = peer.cuda_received
            out["cuda_pools_opened"] = peer.cuda_opens
        return out

    def _ring(self, byte: bytes) -> None:
        try:
            self._sock.send(byte)
            self._bells_sent += 1
        except BlockingIOError:
            pass  # the buffer holds unread doorbells: the peer will wake anyway
        except OSError:
            self._eof = True
            self._tx_blocked = True

    def _drain(self) -> None:
        """Read every pending doorbell byte (and notice EOF); bump the wake generation."""
        sock = self._sock
        while True:
            try:
                data = sock.recv(512)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except OSError:
                self._eof = True
                self._tx_blocked = True
                break
            if not data:
                self._eof = True
                self._tx_blocked = True
                break
            self._bells_recv += len(data)
            if data.strip(DOORBELL_BYTES):
                self._break(ProtocolError(f"unexpected bytes on the control socket: {data[:16]!r}"))
                break
            if len(data) < 512:
                break
        self._wake_gen += 1
        if self._slots_on:
            self._slot_safe_point()

    def _break(self, exc: BaseException) -> None:
        """A protocol violation: this connection is unusable; tell the peer (EOF)."""
        if self._broken is None:
            self._broken = exc
            self._tx_blocked = True
            logger.warning("ringwire connection to pid %s broken: %s", self.peer_pid, exc)
            if self._pool is not None:
                self._pool.reclaim()  # nothing is sent on this connection any more
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _raise_state(self) -> None:
        if self._closed:
            raise ClosedResourceError
        if self._broken is not None:
            raise BrokenResourceError(f"connection broken: {self._broken}") from self._broken

    def _check_send(self) -> None:
        if self._closed or self._broken is not None:
            self._raise_state()
        if self._eof_sent:
            raise ClosedResourceError("send_eof() was called on this endpoint")
        if self._eof or self._tx.reader_closed:
            why = "closed its end" if self._tx.reader_closed else "is gone"
            raise BrokenResourceError(f"the peer (pid {self.peer_pid}) {why}")

    def _encode(self, item: Any) -> bytes:
        payload = self._enc.encode(item)
        if len(payload) > self._tx.max_payload:
            self._tx.check_size(len(payload))
        return payload

    def _encode_many(self, items: Iterable[Any]) -> list[bytes]:
        encode = self._enc.encode
        payloads = [encode(item) for item in items]
        if payloads:
            longest = max(map(len, payloads))
            if longest > self._tx.max_payload:
                self._tx.check_size(longest)
        return payloads

    # -- non-blocking send -------------------------------------------------------------

    def _try_send(self, payload: bytes) -> bool:
        tx = self._tx
        if self._tx_blocked or tx.header[RCLOSED]:
            self._check_send()
        if not tx.try_write(payload):
            return False
        self._n_sent += 1
        self._b_sent += len(payload)
        if tx.reader_needs_doorbell():
            self._ring(DOORBELL_DATA)
        elif not self._n_sent % _ALIVE_EVERY:
            self._check_alive()
        return True

    def _try_send_many(self, payloads: Sequence[bytes], start: int) -> int:
        self._check_send()
        tx = self._tx
        n, nbytes = tx.write_many(payloads, start)
        if n:
            self._n_sent += n
            self._b_sent += nbytes
            if tx.reader_needs_doorbell():
                self._ring(DOORBELL_DATA)
            elif (self._n_sent - n) // _ALIVE_EVERY != self._n_sent // _ALIVE_EVERY:
                self._check_alive()
        return n

    # A sender that never waits learns of the peer's death from a failed doorbell (the
    # peer died parked) or when the ring is full and it parks -- which, for a slow
    # sender and a large ring, can be minutes of records sent into the void.  So every
    # _ALIVE_EVERY records (at most every _ALIVE_NS) it asks poll() whether the peer has
    # hung up (POLLRDHUP: seen even behind unread doorbell bytes, which stay for the
    # waiters they belong to).  An asyncio endpoint needs none of this: its loop
    # watches the socket all the time.

    _aio_loop: Any = None
    _alive_poll: Any = None

    def _check_alive(self) -> None:
        if self._aio_loop is not None:
            return
        now = time.monotonic_ns()
        if now - self._alive_checked < _ALIVE_NS:
            return
        self._alive_checked = now
        p = self._alive_poll
        if p is None:
            p = self._alive_poll = select.poll()
            p.register(self._fd, _HANGUP)
        if p.poll(0) and not self._closed:
            self._eof = True
            self._tx_blocked = True

    def _send_ready(self, size: int) -> bool:
        """Should a parked sender stop waiting?"""
        return (
            self._closed
            or self._eof
            or self._broken is not None
            or self._tx.reader_closed
            or self._tx.fits_now(size)
        )

    # -- non-blocking receive ------------------------------------------------------------

    def _try_receive(self, dec: Decoder) -> Any:
        """One record, or ``_EMPTY``.  Raises on our close / a broken connection."""
        if self._closed or self._broken is not None:
            self._raise_state()
        if self._slots_on:
            self._slot_safe_point()
        rx = self._rx
        try:
            view = rx.next_frame()
        except RingCorrupted as exc:
            self._break(exc)
            raise BrokenResourceError(f"connection broken: {exc}") from exc
        if view is None:
            return _EMPTY
        try:
            if self._peer is None:
                obj = dec.decode(view)
            else:
                obj = self._decode_slots(dec, view)
            self._n_recv += 1
            self._b_recv += view.nbytes
        finally:
            view.release()
            rx.commit()
            if rx.writer_needs_doorbell():
                self._ring(DOORBELL_SPACE)
        return obj

    # A record that fails to decode has already released the slots it resolved (their
    # arrays died with the failed decode), so it must never be decoded again: when
    # receive_many stops a batch before it (leaving it unread), the failure is kept and
    # the next read of that frame raises it without decoding.  The references the
    # decode did not reach are released when the frame is consumed (RecvPool.salvage).

    def _decode_slots(self, dec: Decoder, view: memoryview) -> Any:
        peer = self._peer
        assert peer is not None
        failed = self._undecodable
        if failed is not None:
            self._undecodable = None
            peer.salvage(failed[0], failed[1])
            raise DecodeError(failed[2])
        resolved: list[tuple[int, int]] = []
        peer.resolved = resolved
        try:
            return dec.decode(view)
        except DecodeError:
            peer.salvage(view, resolved)
            raise
        finally:
            peer.resolved = None

    def _try_receive_many(self, dec: Decoder, max_n: int) -> list[Any]:
        if self._closed or self._broken is not None:
            self._raise_state()
        if self._slots_on:
            self._slot_safe_point()
        rx = self._rx
        out: list[Any] = []
        # (payload, resolved refs, error message) of an undecodable frame; no exception
        # objects here: their tracebacks' frames would hold this batch's records
        failures: list[tuple[bytes, list[tuple[int, int]], str]] = []
        decode: Any = dec.decode
        peer = self._peer
        if peer is not None:

            def decode_slots(view: memoryview) -> Any:
                failed = self._undecodable
                if failed is not None:  # the first frame of this batch (see above)
                    self._undecodable = None
                    failures.append(failed)
                    raise DecodeError(failed[2])
                resolved: list[tuple[int, int]] = []
                peer.resolved = resolved
                try:
                    return dec.decode(view)
                except DecodeError as exc:
                    failures.append((bytes(view), resolved, str(exc)))
                    raise
                finally:
                    peer.resolved = None

            decode = decode_slots
        try:
            nbytes = rx.read_many(decode, max_n, out)
        except DecodeError:
            if peer is not None and failures:  # the frame was consumed
                peer.salvage(failures[-1][0], failures[-1][1])
            raise
        except RingCorrupted as exc:
            self._break(exc)
            raise BrokenResourceError(f"connection broken: {exc}") from exc
        finally:
            if rx.pending:
                rx.commit()
                if rx.writer_needs_doorbell():
                    self._ring(DOORBELL_SPACE)
        if failures:  # the batch ended before an undecodable frame, left unread
            self._undecodable = failures[-1]
        self._n_recv += len(out)
        self._b_recv += nbytes
        return out

    def _receive_ready(self) -> bool:
        """Should a parked receiver stop waiting?"""
        rx = self._rx
        return (
            self._closed
            or self._eof
            or self._broken is not None
            or rx.available()
            or rx.writer_closed
        )

    def _check_finished(self) -> None:
        """The ring is empty: raise if the peer will never publish again."""
        rx = self._rx
        if rx.writer_closed:
            fence()
            if not rx.available():
                raise EndOfStream
        elif self._eof:
            fence()
            if not rx.available():
                if rx.writer_closed:
                    raise EndOfStream
                raise BrokenResourceError(
                    f"the peer (pid {self.peer_pid}) died or dropped the connection"
                )

    # Parking is counted: several tasks may wait on one lane at once (two receivers,
    # or a receiver and the listener's fan-in).  Every park writes a fresh sequence
    # number, so the peer rings again for a newcomer even if it already rang for an
    # earlier parker; only the last one out clears the flag.

    def _park_rx(self) -> None:
        self._rx_parked += 1
        self._rx.park()

    def _unpark_rx(self) -> None:
        self._rx_parked -= 1
        if not self._rx_parked and not self._closed:
            self._rx.unpark()

    def _park_tx(self) -> None:
        self._tx_parked += 1
        self._tx.park()

    def _unpark_tx(self) -> None:
        self._tx_parked -= 1
        if not self._tx_parked and not self._closed:
            self._tx.unpark()

    def _spin(self, ready: Any, *args: Any) -> bool:
        """Busy-check ``ready(*args)`` for the current spin budget.

        The budget adapts (as adaptive mutexes do): a spin that succeeds doubles it, up
        to ``spin_us``; one that times out halves it, down to :data:`_MIN_SPIN_NS`.  So
        an endpoint whose peer answers within the budget stays hot, and one whose peer
        is slow -- or descheduled, on an oversubscribed machine -- soon parks at once
        instead of burning a core.  Every :data:`_SPIN_PROBE` timed-out spins in a row,
        the next one gets the full budget again: a collapsed budget could otherwise never
        grow back, because a 2 us spin almost never succeeds even against a peer that
        answers in 20 us.  A long spin yields the CPU now and then, in case the peer is
        waiting for this very core.
        """
        spin = self._spin_cur
        if not spin:
            return False
        clock = time.perf_counter_ns
        now = clock()
        deadline = now + spin
        next_yield = now + _SPIN_YIELD_NS
        while True:
            if ready(*args):
                self._spin_misses = 0
                if spin < self._spin_ns:
                    self._spin_cur = min(self._spin_ns, 2 * spin)
                return True
            now = clock()
            if now >= deadline:
                break
            if now >= next_yield:
                os.sched_yield()
                next_yield = now + _SPIN_YIELD_NS
        self._spin_misses += 1
        if self._spin_misses % _SPIN_PROBE == 0:
            self._spin_cur = self._spin_ns
        else:
            self._spin_cur = max(min(_MIN_SPIN_NS, self._spin_ns), spin // 2)
        return False

    # -- closing ----------------------------------------------------------------------------

    def _mark_closed(self) -> bool:
        """Flag our close in both ring headers.  ``False`` if already closed."""
        if self._closed:
            return False
        self._closed = True
        self._tx_blocked = True
        try:
            self._tx.close()
            self._rx.close()
        except ValueError:  # views already released
            pass
        return True

    def _release(self, blocking: bool = True) -> None:
        # the release queue first: no finalizer touches the lane after this (``__del__``
        # may run inside a flush of this very thread: it does not wait, see _release.py)
        held = self._peer.close(blocking) if self._peer is not None else 0
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._tx.release()
        self._rx.release()
        for seg in self._segments:
            seg.unlink()
            seg.close()
        if self._pool is not None:
            self._pool.close()
        if self._peer is not None:
            self._peer.unmap()  # stays mapped while received arrays are alive
        if held and blocking:
            warnings.warn(
                f"{self!r} closed while {held} received slot array(s) are alive: their "
                "memory stays mapped until they die, but the peer will reuse the slots; "
                "release them first, or keep ringwire.copy_out() copies",
                ResourceWarning,
                stacklevel=3,
            )

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._tx_blocked = True
        warnings.warn(
            f"unclosed ringwire endpoint {self!r}", ResourceWarning, source=self, stacklevel=1
        )
        try:
            self._release(blocking=False)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class _ReceiptBase:
    __slots__ = ("_chan", "_pairs")

    def __init__(self, chan: _ChannelBase, pairs: Sequence[tuple[int, int]]) -> None:
        self._chan = chan
        self._pairs = tuple(pairs)

    def __repr__(self) -> str:
        state = "consumed" if self.consumed else "in flight"
        return f"<{type(self).__name__} {len(self._pairs)} slot(s) {state}>"

    @property
    def slots(self) -> int:
        """How many slots the record used."""
        return len(self._pairs)

    @property
    def consumed(self) -> bool:
        """Has the peer released every slot of the record?  (Also ``True`` once the
        connection is gone: its slots came back to the pool then.)"""
        if not self._pairs:
            return True
        chan = self._chan
        pool = chan._pool
        assert pool is not None
        if not chan._closed:
            chan._slot_safe_point()
        return pool.consumed(self._pairs)


class Receipt(_ReceiptBase):
    """What :meth:`Channel.send_tracked` returns: ``await receipt.wait()`` until the
    peer has consumed (released every slot of) the record."""

    __slots__ = ()

    async def wait(self) -> None:
        if self._pairs:
            chan = self._chan
            assert isinstance(chan, Channel)
            await chan._wait_consumed(self._pairs)


class SyncReceipt(_ReceiptBase):
    """What :meth:`SyncChannel.send_tracked` returns: ``receipt.wait(timeout)``."""

    __slots__ = ()

    def wait(self, timeout: float | None = None) -> None:
        """Block until consumed; ``TimeoutError`` after ``timeout`` seconds."""
        if self._pairs:
            chan = self._chan
            assert isinstance(chan, SyncChannel)
            chan._wait_consumed(self._pairs, SyncChannel._deadline(timeout))


def _no_pool(ref: Any) -> Any:
    what = "a CUDA tensor reference (Ext 5)" if isinstance(ref, CudaRef) else "a slot reference"
    raise DecodeError(
        f"{what} to pool {getattr(ref, 'pool', 0):#x}, but the peer lends this connection "
        "no slot pool (it connected with slots=None)"
    )


class Channel(_ChannelBase, anyio.abc.ObjectStream[Any]):
    """The async endpoint of a connection (asyncio, trio, uvloop; via anyio).

    Object-stream semantics as in anyio: :meth:`send` / :meth:`receive` (and their
    ``_nowait`` forms), ``async for``, :meth:`aclose`, :meth:`send_eof`, async context
    manager.  Not thread-safe: use it from one event loop.
    """

    def __init__(self, est: _Established, **kw: Any) -> None:
        super().__init__(est, **kw)
        # on asyncio the loop watches the control socket from now on, so the peer's
        # death is noticed at once -- slots reclaimed, next send refused -- even by an
        # endpoint that only sends and never waits
        self._aio_attach()

    # -- waiting ------------------------------------------------------------------------

    async def _wait_wake(self, gen: int) -> None:
        """Wait until the wake generation moves past ``gen`` (a doorbell, EOF, close);
        may return early (every caller re-checks)."""
        w = self._wake_waitable(gen)
        if w is not None:
            await w

    def _wake_waitable(self, gen: int) -> Awaitable[Any] | None:
        """Something to await until a wakeup after generation ``gen``, or ``None`` if
        there is no need to wait.  On asyncio it is a bare future (the hot path: no
        extra coroutine frame); elsewhere a coroutine over ``anyio.wait_readable``."""
        if self._wake_gen != gen or self._eof or self._closed or self._broken is not None:
            return None
        loop = self._aio_loop
        if loop is None or loop.is_closed():
            loop = self._aio_attach()
            if loop is None:
                return self._wait_wake_generic(gen)
        waiters = self._aio_waiters
        if len(waiters) > 16:  # futures of cancelled waits
            waiters[:] = [f for f in waiters if not f.done()]
        fut: asyncio.Future[None] = loop.create_future()
        waiters.append(fut)
        return fut

    async def _wait_wake_generic(self, gen: int) -> None:
        # any anyio backend: one waiter polls the socket, the others wait for it
        while self._wake_gen == gen and not self._eof and not self._closed and self._broken is None:
            if self._polling:
                ev = self._wake_event
                if ev is None:
                    ev = self._wake_event = anyio.Event()
                await ev.wait()
                continue
            self._polling = True
            try:
                await anyio.wait_readable(self._sock)
            except ClosedResourceError:
                if not self._closed:
                    raise
            finally:
                self._polling = False
                ev = self._wake_event
                if ev is not None:
                    self._wake_event = None
                    ev.set()
            if not self._closed:
                self._drain()

    # asyncio (and uvloop) fast path: the control socket stays registered with the loop
    # for the life of the connection, so parking costs no epoll_ctl and no extra task
    # switch; the reader callback drains doorbells and resolves every waiter's future.
    # (A channel belongs to one event loop; a closed loop is replaced by the next one.)

    _aio_ok = True
    _aio_loop: asyncio.AbstractEventLoop | None = None

    def _aio_attach(self) -> asyncio.AbstractEventLoop | None:
        """Register with the running asyncio loop; ``None`` if not on asyncio."""
        if not self._aio_ok:
            return None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None  # trio, or another anyio backend
        self._aio_unregister()
        try:
            loop.add_reader(self._fd, self._aio_on_readable)
        except NotImplementedError:  # pragma: no cover - proactor loops
            self._aio_ok = False
            return None
        self._aio_loop = loop
        return loop

    def _aio_on_readable(self) -> None:
        if not self._closed:
            self._drain()
        if self._closed or self._eof or self._broken is not None:
            self._aio_unregister()
        self._aio_wake_all()

    def _aio_wake_all(self) -> None:
        waiters = self._aio_waiters
        if waiters:
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
            waiters.clear()

    def _aio_unregister(self) -> None:
        loop = self._aio_loop
        if loop is not None:
            self._aio_loop = None
            if not loop.is_closed():
                loop.remove_reader(self._fd)

    _wake_event: anyio.Event | None = None

    async def _maybe_yield(self) -> None:
        self._fast_ops += 1
        if self._fast_ops >= _YIELD_EVERY:
            self._fast_ops = 0
            await anyio.lowlevel.checkpoint()

    # -- send -------------------------------------------------------------------------------

    async def send(self, item: Any, *, slot_policy: str | None = None) -> None:
        """Send one record; waits (spin, then park) while the ring is full.

        Large arrays and tensors travel in tensor slots (see :class:`SlotConfig`);
        ``slot_policy`` overrides the channel's policy for this record.
        """
        pool = self._pool
        if pool is not None:
            # fast path: a record in which nothing was placed in a slot is sent like one
            # on a channel without a pool (no abort bookkeeping, no extra frame)
            self._slot_safe_point()
            try:
                payload, placed = self._encode_placed(item, slot_policy)
            except _NeedSlot:
                await self._send_placed(item, slot_policy)
                return
            if placed:
                await self._publish_placed(payload, placed)
            elif not self._try_send(payload):
                await self._send_slow(payload)
            await self._maybe_yield()
            return
        payload = self._enc.encode(item)
        if len(payload) > self._tx.max_payload:
            self._tx.check_size(len(payload))
        if self._try_send(payload):
            await self._maybe_yield()
            return
        await self._send_slow(payload)

    async def _send_slow(self, payload: bytes) -> None:
        size = len(payload)
        while True:
            if self._try_send(payload):
                return
            if self._spin(self._send_ready, size):
                continue
            gen = self._wake_gen
            self._park_tx()
            try:
                if self._send_ready(size):
                    continue
                self._send_parks += 1
                await self._wait_wake(gen)
            finally:
                self._unpark_tx()

    async def send_tracked(self, item: Any, *, slot_policy: str | None = None) -> Receipt:
        """Send one record; return a :class:`Receipt` that completes once the peer has
        released every slot the record used (at once if it used none)."""
        if self._pool is None:
            await self.send(item)
            return Receipt(self, ())
        placed = await self._send_placed(item, slot_policy)
        return Receipt(self, [(slot, gen) for slot, gen, _ in placed])

    async def _send_placed(self, item: Any, policy: str | None) -> Placed:
        pool = self._pool
        assert pool is not None
        self._slot_safe_point()
        deadline: float | None = _UNSET
        while True:
            try:
                payload, placed = self._encode_placed(item, policy)
                break
            except _NeedSlot as need:
                if deadline is _UNSET:
                    deadline = self._slot_deadline()
                await self._wait_slot(need.nbytes, deadline)
        await self._publish_placed(payload, placed)
        await self._maybe_yield()
        return placed

    async def _publish_placed(self, payload: bytes, placed: Placed) -> None:
        """Publish a record that took slots; give them back if it is not published."""
        published = False
        try:
            if not self._try_send(payload):
                await self._send_slow(payload)
            published = True
        finally:
            if not published:
                assert self._pool is not None
                self._pool.abort(placed)

    async def _wait_slot(self, nbytes: int | CudaNeed, deadline: float | None) -> None:
        """Wait until a slot for ``nbytes`` is free (policy "wait")."""
        pool = self._pool
        assert pool is not None
        while not self._check_slot_wait(nbytes):
            if self._spin(self._slot_wait_ready, nbytes):
                continue
            limit = math.inf
            if deadline is not None:
                limit = deadline - time.monotonic()
                if limit <= 0:
                    raise self._slot_timeout(nbytes)
            if pool._loans:
                limit = min(limit, _LOAN_TICK)  # a dropped loan rings no doorbell
            gen = self._wake_gen
            pool.park()
            try:
                if self._slot_wait_ready(nbytes):
                    continue
                self._slot_waits += 1
                if limit == math.inf:
                    await self._wait_wake(gen)
                else:
                    with anyio.move_on_after(limit):
                        await self._wait_wake(gen)
            finally:
                pool.unpark()

    async def _wait_consumed(self, pairs: Sequence[tuple[int, int]]) -> None:
        pool = self._pool
        assert pool is not None
        while True:
            if not self._closed:
                self._slot_safe_point()
            if pool.consumed(pairs):
                return
            gen = self._wake_gen
            pool.park()
            try:
                if pool.has_work():
                    continue
                await self._wait_wake(gen)
            finally:
                pool.unpark()

    async def loan(
        self,
        shape: Sequence[int],
        dtype: Any,
        *,
        device: Any = None,
        slot_policy: str | None = None,
    ) -> Any:
        """A writable numpy array (``dtype`` a numpy dtype) or torch tensor (``dtype`` a
        ``torch.dtype``) of ``shape`` that lives inside a free slot: fill it in place
        and send it -- nothing is copied.  Send it once; do not touch it after.  A loan
        dropped without being sent returns its slot.

        ``device`` (a CUDA device, torch dtypes only): the tensor lives in this side's
        GPU pool for that device; write it on the current stream (or synchronise)
        before sending -- the send records the slot's event on the current stream.

        When no slot is free the policy applies (``"inline"`` returns an ordinary
        private array instead).

        Raises :class:`SlotsExhausted` (policy ``"error"``, a timeout, or a pool that
        can never free a slot), ``ValueError``/``TypeError`` for a bad shape, dtype or
        device, and what :meth:`send` raises for a closed or broken connection."""
        pool = self._require_pool()
        spec = loan_spec(shape, dtype, device)
        policy = check_policy(slot_policy) or pool.config.policy
        deadline: float | None = _UNSET
        while True:
            arr = self._loan_now(pool, spec, policy)
            if arr is not None:
                return arr
            if deadline is _UNSET:
                deadline = self._slot_deadline()
            await self._wait_slot(spec[-1], deadline)

    def send_nowait(self, item: Any, *, slot_policy: str | None = None) -> None:
        """Send one record or raise :class:`anyio.WouldBlock` if the ring is full (or,
        policy "wait", no slot is free)."""
        if self._pool is None:
            if not self._try_send(self._encode(item)):
                raise WouldBlock
            return
        self._slot_safe_point()
        try:
            payload, placed = self._encode_placed(item, slot_policy)
        except _NeedSlot:
            raise WouldBlock from None
        ok = False
        try:
            ok = self._try_send(payload)
        finally:
            if not ok:
                self._pool.abort(placed)
        if not ok:
            raise WouldBlock

    async def send_many(self, items: Iterable[Any], *, slot_policy: str | None = None) -> None:
        """Send several records, publishing as many as fit at once.

        Every record is encoded (and size-checked) before the first is sent -- except
        that a record waiting for a slot (policy "wait") first lets the records before
        it go.  If cancelled while waiting for room, a prefix of the records has been
        sent.
        """
        if self._pool is not None:
            await self._send_many_placed(list(items), slot_policy)
            return
        payloads = self._encode_many(items)
        await self._publish_many(payloads, None)
        await self._maybe_yield()

    async def _publish_many(self, payloads: list[bytes], placed: list[Placed] | None) -> None:
        i = 0
        try:
            i = self._try_send_many(payloads, 0)
            while i < len(payloads):
                size = len(payloads[i])
                if not self._spin(self._send_ready, size):
                    gen = self._wake_gen
                    self._park_tx()
                    try:
                        if not self._send_ready(size):
                            self._send_parks += 1
                            await self._wait_wake(gen)
                    finally:
                        self._unpark_tx()
                i += self._try_send_many(payloads, i)
        finally:
            if placed is not None and self._pool is not None:
                for p in placed[i:]:
                    self._pool.abort(p)

    async def _send_many_placed(self, items: list[Any], policy: str | None) -> None:
        self._slot_safe_point()
        deadline: float | None = _UNSET
        i = 0
        while i < len(items):
            payloads, placed, need = self._encode_batch(items, i, policy)
            if payloads:
                await self._publish_many(payloads, placed)
                i += len(payloads)
            if need is not None:
                if deadline is _UNSET:
                    deadline = self._slot_deadline()
                await self._wait_slot(need, deadline)
        await self._maybe_yield()

    async def send_eof(self) -> None:
        """Tell the peer that nothing more will be sent (it gets ``EndOfStream`` once it
        has received everything); receiving still works."""
        if self._closed:
            raise ClosedResourceError
        if not self._eof_sent:
            self._eof_sent = True
            self._tx_blocked = True
            self._tx.close()
            if self._tx.reader_wants_doorbell_for_close():
                self._ring(DOORBELL_CLOSE)
        await anyio.lowlevel.checkpoint()

    # -- receive ----------------------------------------------------------------------------

    async def receive(self, *, type: Any = _UNSET) -> Any:
        """Receive one record (decoded as ``type`` if given, else the channel's type)."""
        dec = self._dec if type is _UNSET else self._decoder_for(type)
        # one coroutine frame down to the awaited future: this is the latency path
        while True:
            obj = self._try_receive(dec)
            if obj is not _EMPTY:
                self._fast_ops += 1
                if self._fast_ops >= _YIELD_EVERY:
                    self._fast_ops = 0
                    await anyio.lowlevel.checkpoint()
                return obj
            # the rest is _check_finished / _park_rx / _receive_ready / _unpark_rx, inlined
            rx = self._rx
            if self._eof or rx.header[WCLOSED]:
                self._check_finished()
            if self._spin_cur and self._spin(self._receive_ready):
                continue
            gen = self._wake_gen
            self._rx_parked += 1
            rx.park()
            try:
                if not (
                    self._eof
                    or self._closed
                    or self._broken is not None
                    or rx.available()
                    or rx.header[WCLOSED]
                ):
                    self._recv_parks += 1
                    w = self._wake_waitable(gen)
                    if w is not None:
                        await w
            finally:
                self._rx_parked -= 1
                if not self._rx_parked and not self._closed:
                    rx.unpark()

    async def _receive_slow(self, dec: Decoder) -> Any:
        while True:
            obj = self._try_receive(dec)
            if obj is not _EMPTY:
                return obj
            self._check_finished()
            if self._spin(self._receive_ready):
                continue
            gen = self._wake_gen
            self._park_rx()
            try:
                if self._receive_ready():
                    continue
                self._recv_parks += 1
                await self._wait_wake(gen)
            finally:
                self._unpark_rx()

    def receive_nowait(self, *, type: Any = _UNSET) -> Any:
        """One record, or :class:`anyio.WouldBlock` if none is published yet."""
        obj = self._try_receive(self._decoder_for(type))
        if obj is _EMPTY:
            self._check_finished()
            raise WouldBlock
        return obj

    async def receive_many(self, max_n: int = 1024, *, type: Any = _UNSET) -> list[Any]:
        """Wait for at least one record, then return every published one (up to
        ``max_n``), handing their ring space back at once."""
        if max_n < 1:
            raise ValueError("max_n must be at least 1")
        dec = self._decoder_for(type)
        out = self._try_receive_many(dec, max_n)
        if out:
            await self._maybe_yield()
            return out
        out = [await self._receive_slow(dec)]
        if max_n > 1:
            out += self._try_receive_many(dec, max_n - 1)
        return out

    def receive_many_nowait(self, max_n: int = 1024, *, type: Any = _UNSET) -> list[Any]:
        """Every published record (up to ``max_n``); ``WouldBlock`` if there is none."""
        out = self._try_receive_many(self._decoder_for(type), max_n)
        if not out:
            self._check_finished()
            raise WouldBlock
        return out

    def __aiter__(self) -> Channel:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except EndOfStream:
            raise StopAsyncIteration from None

    # -- closing ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close: the peer receives what was sent, then ``EndOfStream``.  Tasks waiting
        on this endpoint get ``ClosedResourceError``."""
        self.close()
        await anyio.lowlevel.checkpoint()

    def close(self) -> None:
        """Close without awaiting (call it from the event loop's thread)."""
        if not self._mark_closed():
            return
        self._aio_unregister()
        self._aio_wake_all()
        if self._polling:
            try:
                anyio.notify_closing(self._sock)
            except Exception:  # pragma: no cover - no running loop any more
                pass
        ev = self._wake_event
        if ev is not None:
            self._wake_event = None
            ev.set()
        self._release()


class SyncChannel(_ChannelBase):
    """The blocking endpoint of a connection, for threads and plain scripts.

    ``send`` / ``receive`` take ``timeout`` (seconds, ``None`` = forever) and raise
    :class:`TimeoutError` when it expires.  Thread-safe: one sender and one receiver
    run at a time, others wait for their turn.
    """

    def __init__(self, est: _Established, **kw: Any) -> None:
        super().__init__(est, **kw)
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._cv = threading.Condition(threading.Lock())
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)

    @staticmethod
    def _deadline(timeout: float | None) -> float | None:
        return None if timeout is None else time.monotonic() + timeout

    @staticmethod
    def _acquire(lock: threading.Lock, deadline: float | None) -> None:
        if deadline is None:
            lock.acquire()
        elif not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError("timed out waiting for another thread using this channel")

    def _wait_wake(self, gen: int, deadline: float | None) -> None:
        cv = self._cv
        with cv:
            while (
                self._wake_gen == gen
                and not self._eof
                and not self._closed
                and self._broken is None
            ):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("ringwire channel operation timed out")
                if self._polling:
                    cv.wait(left)
                    continue
                self._polling = True
                cv.release()
                try:
                    ms = -1 if left is None else max(1, math.ceil(left * 1000))
                    ready = self._poll.poll(ms)
                    if ready and not self._closed:
                        self._drain()
                finally:
                    cv.acquire()
                    self._polling = False
                    cv.notify_all()

    def _park_and_wait(
        self,
        lane: RingWriter | RingReader,
        ready: Any,
        args: tuple[Any, ...],
        deadline: float | None,
    ) -> None:
        gen = self._wake_gen
        rx = lane is self._rx
        if rx:
            self._park_rx()
        else:
            self._park_tx()
        try:
            if ready(*args):
                return
            if rx:
                self._recv_parks += 1
            else:
                self._send_parks += 1
            self._wait_wake(gen, deadline)
        finally:
            if rx:
                self._unpark_rx()
            else:
                self._unpark_tx()

    # -- send -------------------------------------------------------------------------------

    def send(
        self, item: Any, timeout: float | None = None, *, slot_policy: str | None = None
    ) -> None:
        """Send one record, waiting up to ``timeout`` seconds for room in the ring (and,
        policy "wait", for a free tensor slot)."""
        pool = self._pool
        if pool is None:
            payload = self._encode(item)  # outside the lock; placing needs it held
        lock = self._send_lock
        deadline = None
        if not lock.acquire(False):
            deadline = self._deadline(timeout)
            self._acquire(lock, deadline)
        try:
            if pool is not None:
                # a record in which nothing was placed is sent like one without a pool
                self._slot_safe_point()
                try:
                    payload, placed = self._encode_placed(item, slot_policy)
                except _NeedSlot:  # wait for a slot, encode again, publish
                    self._send_placed(item, slot_policy, deadline or self._deadline(timeout))
                    return
                if placed:
                    self._publish_placed(payload, placed, deadline or self._deadline(timeout))
                    return
            if self._try_send(payload):
                return
            if deadline is None:
                deadline = self._deadline(timeout)
            size = len(payload)
            while not self._try_send(payload):
                if not self._spin(self._send_ready, size):
                    self._park_and_wait(self._tx, self._send_ready, (size,), deadline)
        finally:
            lock.release()

    def send_tracked(
        self, item: Any, timeout: float | None = None, *, slot_policy: str | None = None
    ) -> SyncReceipt:
        """:meth:`send`, returning a :class:`SyncReceipt` that completes once the peer
        has released every slot the record used."""
        if self._pool is None:
            self.send(item, timeout)
            return SyncReceipt(self, ())
        deadline = self._deadline(timeout)
        self._acquire(self._send_lock, deadline)
        try:
            placed = self._send_placed(item, slot_policy, deadline)
        finally:
            self._send_lock.release()
        return SyncReceipt(self, [(slot, gen) for slot, gen, _ in placed])

    def _send_placed(self, item: Any, policy: str | None, deadline: float | None) -> Placed:
        pool = self._pool
        assert pool is not None
        self._slot_safe_point()
        slot_deadline: float | None = _UNSET
        while True:
            try:
                payload, placed = self._encode_placed(item, policy)
                break
            except _NeedSlot as need:
                if slot_deadline is _UNSET:
                    slot_deadline = self._slot_deadline()
                self._wait_slot(need.nbytes, deadline, slot_deadline)
        self._publish_placed(payload, placed, deadline)
        return placed

    def _publish_placed(self, payload: bytes, placed: Placed, deadline: float | None) -> None:
        """Publish a record that took slots; give them back if it is not published."""
        published = False
        try:
            size = len(payload)
            while not self._try_send(payload):
                if not self._spin(self._send_ready, size):
                    self._park_and_wait(self._tx, self._send_ready, (size,), deadline)
            published = True
        finally:
            if not published:
                assert self._pool is not None
                self._pool.abort(placed)

    def _wait_slot(
        self, nbytes: int | CudaNeed, deadline: float | None, slot_deadline: float | None
    ) -> None:
        pool = self._pool
        assert pool is not None
        while not self._check_slot_wait(nbytes):
            if self._spin(self._slot_wait_ready, nbytes):
                continue
            now = time.monotonic()
            if slot_deadline is not None and now >= slot_deadline:
                raise self._slot_timeout(nbytes)
            until = [d for d in (deadline, slot_deadline) if d is not None]
            if pool._loans:
                until.append(now + _LOAN_TICK)  # a dropped loan rings no doorbell
            gen = self._wake_gen
            pool.park()
            try:
                if self._slot_wait_ready(nbytes):
                    continue
                self._slot_waits += 1
                try:
                    self._wait_wake(gen, min(until) if until else None)
                except TimeoutError:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise
            finally:
                pool.unpark()

    def _wait_consumed(self, pairs: Sequence[tuple[int, int]], deadline: float | None) -> None:
        pool = self._pool
        assert pool is not None
        while True:
            if not self._closed:
                self._slot_safe_point()
            if pool.consumed(pairs):
                return
            gen = self._wake_gen
            pool.park()
            try:
                if pool.has_work():
                    continue
                self._wait_wake(gen, deadline)
            finally:
                pool.unpark()

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
        pool = self._require_pool()
        spec = loan_spec(shape, dtype, device)
        policy = check_policy(slot_policy) or pool.config.policy
        deadline = self._deadline(timeout)
        slot_deadline: float | None = _UNSET
        while True:
            arr = self._loan_now(pool, spec, policy)
            if arr is not None:
                return arr
            if slot_deadline is _UNSET:
                slot_deadline = self._slot_deadline()
            self._wait_slot(spec[-1], deadline, slot_deadline)

    def send_nowait(self, item: Any, *, slot_policy: str | None = None) -> None:
        if self._pool is None:
            payload = self._encode(item)
            with self._send_lock:
                if not self._try_send(payload):
                    raise WouldBlock
            return
        with self._send_lock:
            self._slot_safe_point()
            try:
                payload, placed = self._encode_placed(item, slot_policy)
            except _NeedSlot:
                raise WouldBlock from None
            ok = False
            try:
                ok = self._try_send(payload)
            finally:
                if not ok:
                    self._pool.abort(placed)
            if not ok:
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
        if self._pool is not None:
            items = list(items)
            deadline = self._deadline(timeout)
            self._acquire(self._send_lock, deadline)
            try:
                self._slot_safe_point()
                slot_deadline: float | None = _UNSET
                i = 0
                while i < len(items):
                    payloads, placed, need = self._encode_batch(items, i, slot_policy)
                    if payloads:
                        self._publish_many(payloads, placed, deadline)
                        i += len(payloads)
                    if need is not None:
                        if slot_deadline is _UNSET:
                            slot_deadline = self._slot_deadline()
                        self._wait_slot(need, deadline, slot_deadline)
            finally:
                self._send_lock.release()
            return
        payloads = self._encode_many(items)
        deadline = self._deadline(timeout)
        self._acquire(self._send_lock, deadline)
        try:
            self._publish_many(payloads, None, deadline)
        finally:
            self._send_lock.release()

    def _publish_many(
        self, payloads: list[bytes], placed: list[Placed] | None, deadline: float | None
    ) -> None:
        i = 0
        try:
            i = self._try_send_many(payloads, 0)
            while i < len(payloads):
                size = len(payloads[i])
                if not self._spin(self._send_ready, size):
                    self._park_and_wait(self._tx, self._send_ready, (size,), deadline)
                i += self._try_send_many(payloads, i)
        finally:
            if placed is not None and self._pool is not None:
                for p in placed[i:]:
                    self._pool.abort(p)

    def send_eof(self) -> None:
        with self._send_lock:
            if self._closed:
                raise ClosedResourceError
            if not self._eof_sent:
                self._eof_sent = True
                self._tx_blocked = True
                self._tx.close()
                if self._tx.reader_wants_doorbell_for_close():
                    self._ring(DOORBELL_CLOSE)

    # -- receive ----------------------------------------------------------------------------

    def receive(self, timeout: float | None = None, *, type: Any = _UNSET) -> Any:
        """Receive one record, waiting up to ``timeout`` seconds.

        Raises ``EndOfStream`` after the peer closed (and everything was received),
        ``BrokenResourceError`` if it died, ``TimeoutError`` on timeout."""
        dec = self._dec if type is _UNSET else self._decoder_for(type)
        lock = self._recv_lock
        deadline = None
        if not lock.acquire(False):
            deadline = self._deadline(timeout)
            self._acquire(lock, deadline)
        try:
            obj = self._try_receive(dec)
            if obj is not _EMPTY:
                return obj
            if deadline is None:
                deadline = self._deadline(timeout)
            while True:
                self._check_finished()
                if not self._spin(self._receive_ready):
                    self._park_and_wait(self._rx, self._receive_ready, (), deadline)
                obj = self._try_receive(dec)
                if obj is not _EMPTY:
                    return obj
        finally:
            lock.release()

    def receive_nowait(self, *, type: Any = _UNSET) -> Any:
        with self._recv_lock:
            obj = self._try_receive(self._decoder_for(type))
            if obj is _EMPTY:
                self._check_finished()
                raise WouldBlock
            return obj

    def receive_many(
        self, max_n: int = 1024, timeout: float | None = None, *, type: Any = _UNSET
    ) -> list[Any]:
        """Wait for at least one record, then return every published one (up to ``max_n``)."""
        if max_n < 1:
            raise ValueError("max_n must be at least 1")
        dec = self._decoder_for(type)
        deadline = self._deadline(timeout)
        self._acquire(self._recv_lock, deadline)
        try:
            while True:
                out = self._try_receive_many(dec, max_n)
                if out:
                    return out
                self._check_finished()
                if not self._spin(self._receive_ready):
                    self._park_and_wait(self._rx, self._receive_ready, (), deadline)
        finally:
            self._recv_lock.release()

    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                yield self.receive()
            except EndOfStream:
                return

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close: the peer receives what was sent, then ``EndOfStream``.  Threads
        blocked on this endpoint get ``ClosedResourceError``."""
        with self._cv:
            if not self._mark_closed():
                return
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in poll
        except OSError:
            pass
        with self._cv:
            self._cv.notify_all()
        with self._send_lock, self._recv_lock:
            self._release()

    def __enter__(self) -> SyncChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- connecting ---------------------------------------------------------------------------


def _client_socket(path: str | os.PathLike[str]) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock


async def connect(
    path: str | os.PathLike[str],
    *,
    capacity: int = DEFAULT_CAPACITY,
    type: Any = Any,
    spin_us: float = DEFAULT_SPIN_US,
    timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    slots: SlotConfig | None = DEFAULT_SLOTS,
) -> Channel:
    """Connect to the :class:`Listener` at ``path``; return the async endpoint.

    ``capacity`` is the data capacity of each ring lane (a power of two).  ``slots``
    configures this side's tensor-slot send pool (``None``: no pool, every array
    travels inline).  Raises :class:`SharedMemoryFull` if ``/dev/shm`` cannot hold the
    rings or the pool, :class:`HandshakeError` if the listener refuses,
    ``TimeoutError`` after ``timeout``.
    """
    validate_capacity(capacity)
    slots = resolve_config(slots)
    sock = _client_socket(path)
    try:
        with anyio.fail_after(timeout):
            while True:
                try:
                    sock.connect(os.fspath(path))
                    break
                except (BlockingIOError, InterruptedError):
                    await anyio.sleep(0.001)  # listener backlog full: retry
            check_peer(sock)
            est = await _drive_async(_client_handshake(capacity, slots), sock)
    except BaseException:
        sock.close()
        raise
    return Channel(est, type=type, spin_us=spin_us, name=os.fspath(path))


def connect_sync(
    path: str | os.PathLike[str],
    *,
    capacity: int = DEFAULT_CAPACITY,
    type: Any = Any,
    spin_us: float = DEFAULT_SPIN_US,
    timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    slots: SlotConfig | None = DEFAULT_SLOTS,
) -> SyncChannel:
    """Blocking :func:`connect`: returns a :class:`SyncChannel`."""
    validate_capacity(capacity)
    slots = resolve_config(slots)
    deadline = time.monotonic() + timeout
    sock = _client_socket(path)
    try:
        while True:
            try:
                sock.connect(os.fspath(path))
                break
            except (BlockingIOError, InterruptedError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cannot connect to {path}: listener busy") from None
                time.sleep(0.001)
        check_peer(sock)
        est = _drive_sync(_client_handshake(capacity, slots), sock, deadline)
    except BaseException:
        sock.close()
        raise
    return SyncChannel(est, type=type, spin_us=spin_us, name=os.fspath(path))


# -- listening ----------------------------------------------------------------------------


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
    send pool of every accepted connection (see :func:`connect`).
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
    ) -> None:
        self.path = os.fspath(path)
        self._type = type
        self._slots = resolve_config(slots)
        self._spin_us = spin_us
        self._max_capacity = max_capacity
        self._handshake_timeout = handshake_timeout
        self._backlog = backlog

    def _handshake_for(self, pid: int) -> _HandshakeGen:
        # a client may announce only segments it made itself (see _server_handshake)
        return _server_handshake(pid, self._max_capacity, self._slots, own_names=True)

    def _log_refusal(self, exc: BaseException) -> None:
        logger.warning("ringwire listener %s refused a connection: %s", self.path, exc)

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

    def __init__(self, path: str | os.PathLike[str], **config: Any) -> None:
        """``config``: see :class:`_ListenerBase` (``type``, ``spin_us``,
        ``max_capacity``, ``handshake_timeout``, ``backlog``, ``slots``)."""
        super().__init__(path, **config)
        self._spin_ns = int(max(0.0, float(self._spin_us)) * 1000)
        self._sock: socket.socket | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._conns: list[Channel] = []
        self._closed = False
        self._rr = 0
        self._event: anyio.Event | None = None
        self._accept_send, self._accept_recv = anyio.create_memory_object_stream[Channel](math.inf)
        self._accepted = self._refused = self._broken = self._ended = 0

    def __repr__(self) -> str:
        return f"<Listener {self.path} {len(self._conns)} connections>"

    @property
    def connections(self) -> list[Channel]:
        """The open connections in the fan-in."""
        return list(self._conns)

    def statistics(self) -> ListenerStatistics:
        return ListenerStatistics(
            open_connections=len(self._conns),
            accepted=self._accepted,
            refused=self._refused,
            broken=self._broken,
            ended=self._ended,
        )

    async def __aenter__(self) -> Listener:
        if self._sock is not None or self._closed:
            raise RuntimeError("a Listener can be entered once")
        self._sock = bind_unix_socket(self.path, self._backlog)
        sweep()  # names left by dead processes (a listener killed mid-handshake, say)
        self._cm = self._running()
        try:
            await self._cm.__aenter__()
        except BaseException:
            await self.aclose()
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
            tg.start_soon(self._accept_loop)
            try:
                yield
            finally:
                await self.aclose()

    async def aclose(self) -> None:
        """Stop accepting, close every connection, remove the socket file.

        May be called from any task; cleanup is shielded from cancellation, so a
        cancelled server still leaves no socket file and no open connection behind.
        """
        if self._closed:
            return
        self._closed = True
        self._notify()
        with anyio.CancelScope(shield=True):
            for conn in list(self._conns):
                await conn.aclose()
        self._conns.clear()
        if self._sock is not None:
            anyio.notify_closing(self._sock)
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        if self._sock is not None:
            self._remove_socket(self._sock)
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
                logger.warning("ringwire listener %s: accept failed: %s", self.path, exc)
                await anyio.sleep(0.1)
                continue
            conn_sock.setblocking(False)
            tg.start_soon(self._handshake, conn_sock)

    async def _handshake(self, sock: socket.socket) -> None:
        pid: int | None = None
        try:
            with anyio.fail_after(self._handshake_timeout):
                pid = check_peer(sock)
                est = await _drive_async(self._handshake_for(pid), sock)
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
        conn = Channel(est, type=self._type, spin_us=self._spin_us, name=self.path)
        if self._closed:
            await conn.aclose()
            return
        self._accepted += 1
        self._conns.append(conn)
        self._accept_send.send_nowait(conn)
        self._notify()
        await self._watch(conn)

    async def _watch(self, conn: Channel) -> None:
        """Turn this connection's doorbells into fan-in wakeups, until it ends."""
        try:
            while not (conn._closed or conn._eof or conn._broken is not None):
                await conn._wait_wake(conn._wake_gen)
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
        """The next new connection (it also takes part in the fan-in :meth:`receive`)."""
        if self._sock is None:
            raise RuntimeError("use the Listener as 'async with' before accepting")
        try:
            return await self._accept_recv.receive()
        except (EndOfStream, ClosedResourceError):
            raise ClosedResourceError from None

    # -- fan-in -----------------------------------------------------------------------------

    def _drop(self, conn: Channel, exc: BaseException | None) -> None:
        if conn in self._conns:
            self._conns.remove(conn)
        if exc is None:
            self._ended += 1
        else:
            self._broken += 1
            logger.warning(
                "ringwire listener %s dropped the connection from pid %s: %s",
                self.path,
                conn.peer_pid,
                exc,
            )
        conn.close()

    def _read(self, conn: Channel, max_n: int) -> Any:
        """One record of ``conn`` (``max_n == 0``) or a list of at most ``max_n``;
        ``_EMPTY`` when it has none -- and when it is closed, ended or broken, which
        drops it from the fan-in."""
        try:
            if conn._closed:
                self._drop(conn, None)
                return _EMPTY
            if max_n:
                got = conn._try_receive_many(conn._dec, max_n) or _EMPTY
            else:
                got = conn._try_receive(conn._dec)
            if got is _EMPTY:
                conn._check_finished()
            return got
        except EndOfStream:
            self._drop(conn, None)
        except (BrokenResourceError, DecodeError) as exc:
            self._drop(conn, exc)
        return _EMPTY

    def _try_fan_in(self) -> tuple[Channel, Any] | None:
        conns = self._conns
        n = len(conns)
        i = 0
        while i < n:
            k = (self._rr + i) % n
            conn = conns[k]
            obj = self._read(conn, 0)
            if obj is _EMPTY:
                if n != len(conns):  # a connection went away: rescan
                    n = len(conns)
                    continue
                i += 1
                continue
            self._rr = k + 1
            return conn, obj
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
            if got is not _EMPTY:
                out.extend([(conn, rec) for rec in got])
            i += 1
        if n:
            self._rr = (self._rr + i) % n
        return out

    def _any_ready(self) -> bool:
        return any(c._receive_ready() for c in self._conns)

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
                conn = got[0]
                await conn._maybe_yield()
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
                await got[-1][0]._maybe_yield()
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
        parked = [c for c in self._conns if not c._closed]
        for c in parked:
            c._park_rx()
        try:
            if self._any_ready():
                return
            for c in parked:
                c._recv_parks += 1
            await ev.wait()
        finally:
            for c in parked:
                c._unpark_rx()

    def receive_nowait(self) -> tuple[Channel, Any]:
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


def listen(path: str | os.PathLike[str], **kwargs: Any) -> Listener:
    """A :class:`Listener` at ``path``; use it as ``async with listen(path) as l:``."""
    return Listener(path, **kwargs)


class SyncListener(_ListenerBase):
    """A blocking listener: :meth:`accept` returns :class:`SyncChannel` s."""

    def __init__(self, path: str | os.PathLike[str], **config: Any) -> None:
        """``config``: as :class:`Listener`."""
        super().__init__(path, **config)
        self._sock: socket.socket | None = bind_unix_socket(self.path, self._backlog)
        sweep()  # names left by dead processes (as Listener)
        self.refused = 0

    def accept(self, timeout: float | None = None) -> SyncChannel:
        """Wait for the next connection whose handshake succeeds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._sock is None:
                raise ClosedResourceError
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("no connection before the timeout")
            try:
                conn_sock, _ = self._sock.accept()
            except BlockingIOError:
                _poll_fd(self._sock.fileno(), select.POLLIN, left)
                continue
            conn_sock.setblocking(False)
            pid: int | None = None
            try:
                pid = check_peer(conn_sock)
                hs_deadline = time.monotonic() + self._handshake_timeout
                est = _drive_sync(self._handshake_for(pid), conn_sock, hs_deadline)
            except (RingwireError, OSError) as exc:
                conn_sock.close()
                self.refused += 1
                self._log_refusal(exc)
                if getattr(exc, "before_hello", False) and pid is not None:
                    _sweep_when_dead_sync(pid)  # as Listener does: its names are unknown
                continue
            except BaseException:
                conn_sock.close()
                raise
            return SyncChannel(est, type=self._type, spin_us=self._spin_us, name=self.path)

    def close(self) -> None:
        if self._sock is not None:
            sock, self._sock = self._sock, None
            self._remove_socket(sock)

    def __enter__(self) -> SyncListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_sock", None) is not None:
            warnings.warn(
                f"unclosed ringwire SyncListener at {self.path}", ResourceWarning, stacklevel=1
            )
            self.close()


# -- pairs --------------------------------------------------------------------------------

_fork_epoch = 0


def _after_fork() -> None:  # pragma: no cover - runs around fork
    global _fork_epoch
    _fork_epoch += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_parent=_after_fork, after_in_child=_after_fork)


class PairEnd:
    """One end of :func:`pair`, not yet connected.

    Pass it to a child process (as a ``multiprocessing.Process`` argument, with the
    ``spawn``, ``forkserver`` or ``fork`` start method) and call :meth:`connect` /
    :meth:`connect_sync` there; connect the other end in the parent.  Once the child
    is started, connecting the other end closes the parent's copy of this one, so the
    parent notices when the child dies.
    """

    def __init__(
        self,
        sock: socket.socket,
        role: str,
        capacity: int,
        sibling: PairEnd | None = None,
    ) -> None:
        self._sock: socket.socket | None = sock
        self._role = role
        self._capacity = capacity
        self._sibling: weakref.ref[PairEnd] | None = weakref.ref(sibling) if sibling else None
        self._epoch = _fork_epoch
        self._sent = False

    def __repr__(self) -> str:
        state = "open" if self._sock is not None else "used"
        return f"<PairEnd {self._role} {state}>"

    def __reduce__(self) -> Any:
        from multiprocessing import context, reduction

        if self._sock is None:
            raise ValueError("this PairEnd was already connected or closed")
        if context.get_spawning_popen() is None:
            raise TypeError(
                "a PairEnd can only be pickled as an argument of a starting multiprocessing.Process"
            )
        self._sent = True
        return (
            _rebuild_pair_end,
            (reduction.DupFd(self._sock.fileno()), self._role, self._capacity),
        )

    def close(self) -> None:
        """Drop this end without connecting (the other end's connect then fails)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _take(self) -> socket.socket:
        if self._sock is None:
            raise ClosedResourceError("this PairEnd was already connected or closed")
        sibling = self._sibling() if self._sibling is not None else None
        if sibling is not None and (sibling._sent or sibling._epoch != _fork_epoch):
            sibling.close()  # it lives in another process now
        sock, self._sock = self._sock, None
        return sock

    async def connect(
        self,
        *,
        type: Any = Any,
        spin_us: float = DEFAULT_SPIN_US,
        timeout: float = DEFAULT_PAIR_TIMEOUT,
        slots: SlotConfig | None = DEFAULT_SLOTS,
    ) -> Channel:
        """Finish the connection (the other end must connect too); the async endpoint.
        ``slots`` configures this end's tensor-slot send pool (see :func:`connect`)."""
        slots = resolve_config(slots)
        sock = self._take()
        try:
            with anyio.fail_after(timeout):
                pid = check_peer(sock)
                if self._role == "client":
                    est = await _drive_async(_client_handshake(self._capacity, slots), sock)
                else:
                    est = await _drive_async(_server_handshake(pid, MAX_CAPACITY, slots), sock)
        except BaseException:
            sock.close()
            raise
        return Channel(est, type=type, spin_us=spin_us, name=f"pair:{self._role}")

    def connect_sync(
        self,
        *,
        type: Any = Any,
        spin_us: float = DEFAULT_SPIN_US,
        timeout: float = DEFAULT_PAIR_TIMEOUT,
        slots: SlotConfig | None = DEFAULT_SLOTS,
    ) -> SyncChannel:
        """Blocking :meth:`connect`."""
        slots = resolve_config(slots)
        sock = self._take()
        try:
            deadline = time.monotonic() + timeout
            pid = check_peer(sock)
            if self._role == "client":
                est = _drive_sync(_client_handshake(self._capacity, slots), sock, deadline)
            else:
                est = _drive_sync(_server_handshake(pid, MAX_CAPACITY, slots), sock, deadline)
        except BaseException:
            sock.close()
            raise
        return SyncChannel(est, type=type, spin_us=spin_us, name=f"pair:{self._role}")

    def __del__(self) -> None:
        if getattr(self, "_sock", None) is not None:
            if not self._sent and self._epoch == _fork_epoch:
                warnings.warn(f"unused ringwire {self!r}", ResourceWarning, stacklevel=1)
            self.close()


def _rebuild_pair_end(dupfd: Any, role: str, capacity: int) -> PairEnd:
    fd = dupfd.detach()
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    return PairEnd(sock, role, capacity)


def pair(*, capacity: int = DEFAULT_CAPACITY) -> tuple[PairEnd, PairEnd]:
    """Two connectable ends of a new connection, for a parent and a child process.

    ::

        a, b = ringwire.pair()
        proc = ctx.Process(target=child_main, args=(b,)); proc.start()
        async with await a.connect() as chan: ...      # child: await b.connect()

    The first end creates the rings (its process must be able to reserve ``2 x
    capacity`` bytes of ``/dev/shm``); both ends must connect for either to finish.
    """
    validate_capacity(capacity)
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    s1.setblocking(False)
    s2.setblocking(False)
    a = PairEnd(s1, "client", capacity)
    b = PairEnd(s2, "server", capacity, sibling=a)
    a._sibling = weakref.ref(b)
    return a, b
