"""The TCP transport: one ZeroMQ ``PAIR`` socket per connection.

Messages
--------
Every ZeroMQ message on the socket is either a **record** -- ``[payload, *arrays]``:
the msgpack record (never empty) and, after it, one frame per array it carries beside
itself (referenced from the record by Ext 20, see :mod:`.pools`) -- or a **control**
message ``[b"", body]`` whose first byte says what it is:

=====  ====================  ===========================================================
byte   body                  meaning
=====  ====================  ===========================================================
``M``  n x (u32, payload)     a batch: n >= 2 records without arrays, each a u32
                             big-endian length and the msgpack record (``send_many``;
                             each counts as one record of its own)
``C``  u64 big-endian        the reader has consumed this many record bytes in all
                             (credit: the writer may have ``capacity`` bytes in flight;
                             a record counts its payload + 4, as a ring frame)
``R``  n x (u64, u64)        releases: the receiver's views of these arrays died
``E``                        the writer closed (``EndOfStream`` after the records)
``X``                        the reader closed (the writer's sends fail)
``A``  UTF-8 reason          the peer drops the connection, and says why
``B``                        bye: the peer closes the socket now
``H``  token, session id     the client's attach (handshake only, :mod:`.handshake`)
``K``                        the server's answer to the attach
``N``  msgpack ``Note``      NIXL: the peer's agent metadata and regions (only on a
                             connection that negotiated NIXL, :mod:`.nixl`)
``Y``                        NIXL: the client loaded the listener's note (handshake
                             only, the listener's last step: :mod:`.nixlpools`)
``O``  UTF-8 reason          NIXL: the client could not: NIXL off, frames (handshake)
=====  ====================  ===========================================================

On a connection that negotiated NIXL a record whose last frame is empty carries a
transfer list before it (:mod:`.nixlpools`); the ``holder`` keeps such a record, and
every record after it, until its arrays have arrived.

Anything else -- an unknown control byte, a credit that goes backwards or past what
was sent, records past the credit, a record after ``E``, a batch whose lengths do not
add up or that holds fewer than two records or an empty one -- is a
:class:`~ringwire.ProtocolError`: that connection breaks, nothing else.

Waiting
-------
The drivers wait on :meth:`NetTransport.fileno`, an ``epoll`` descriptor (level
triggered) over three others: the ZeroMQ socket's ``FD``, its monitor socket's ``FD``
and an ``eventfd`` of our own.  ZeroMQ's ``FD`` only says "look at ``EVENTS``": an
operation on the socket (a send, say) may consume its signal while a message waits.
So every operation checks ``EVENTS`` afterwards and, if a message waits, writes the
eventfd (a socket pair); :meth:`NetTransport.drain` reads it and pulls every waiting
message into the reader's inbox.  Finalizers that cannot send a release now (the
socket lock is busy) write it too.

Every read and every send ends having seen the socket empty (``EVENTS`` without
``POLLIN``, or ``zmq.Again``); from then on it holds nothing new until its ``FD`` is
readable, so a reader that finds the ``FD`` quiet (one ``epoll_wait(0)`` on the set)
makes no ZeroMQ call, and :meth:`NetTransport.drain` reads only the descriptors the
set says are readable.  ``EVENTS`` is asked instead of a read that would fail
(``zmq.Again`` costs more); a burst is read to the end.

Liveness
--------
ZeroMQ reconnects silently; this transport never does (``RECONNECT_IVL = -1``): the
monitor's ``DISCONNECTED`` for this connection's descriptor, a ``B`` or an ``A`` is the
hang-up.  A killed peer on a live network is seen at once (the kernel resets the
connection); a silent one (a partition, a frozen host) after ``heartbeat`` seconds of
ZeroMQ heartbeats (``ZMQ_HEARTBEAT_IVL`` / ``_TIMEOUT`` / ``_TTL``).  One socket lock
serialises every ZeroMQ call (ZeroMQ sockets are not thread-safe; a blocking channel
sends and receives from two threads).
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from .._errors import FrameTooLarge, ProtocolError
from .._wire.control import PROTOCOL_VERSION
from .._wire.net_control import MAX_REASON, check_credit, parse_control
from .status import open_slot
from .zmqlife import GONE_EVENTS, HANDSHAKE_FAILED, close_monitored, retire

__all__ = ["DEFAULT_HEARTBEAT", "NetReader", "NetTransport", "NetWriter"]

DEFAULT_HEARTBEAT = 3.0
"""Seconds without a sign of life after which a silent peer is declared gone."""
_Q = struct.Struct(">Q")
_HEADER = 4  # bytes a record counts beyond its payload (as a ring frame's header)
# plain ints: arithmetic on pyzmq's enum flags costs a microsecond a time
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_L = struct.Struct(">I")
_BATCH = 4096  # records at most in one ``M`` message


class NetWriter:
    """The sending lane: credit-bounded (see :class:`~ringwire._conn.transport.FrameWriter`)."""

    def __init__(self, t: NetTransport, capacity: int) -> None:
        self._t = t
        self.capacity = capacity
        self.max_payload = capacity // 2 - 4
        self.sent = 0  # record bytes sent
        self.acked = 0  # record bytes the reader consumed (its last credit)
        self.reader_closed_flag = False
        self._closed = False
        self.status: Any = None  # the inspect table's row (.status); tx.sent is stored there

    def check_size(self, n: int) -> None:
        if n > self.max_payload:
            raise FrameTooLarge(
                f"a {n}-byte record does not fit a TCP lane of {self.capacity} bytes (at "
                f"most {self.max_payload} bytes per record; arrays of at least the slot "
                "threshold travel beside the record): raise capacity="
            )

    def fits_now(self, n: int) -> bool:
        return self.sent - self.acked + n + _HEADER <= self.capacity

    def try_write(self, payload: Any) -> bool | None:
        if self.reader_closed_flag:
            return None
        n = len(payload)
        if n > self.max_payload:
            self.check_size(n)
        if self.sent - self.acked + n + _HEADER > self.capacity:
            return False
        # (a plain bytes payload has no frames: no getattr on the per-record path)
        self._t.send_record(
            payload, None if type(payload) is bytes else getattr(payload, "frames", None)
        )
        self.sent = sent = self.sent + n + _HEADER
        status = self.status
        status.cells[status.sent_at] = sent
        return True

    def write_many(self, payloads: Sequence[Any], start: int = 0) -> tuple[int, int]:
        if self.reader_closed_flag:
            return 0, 0
        room = self.capacity - (self.sent - self.acked)
        end = start
        nbytes = 0
        for i in range(start, len(payloads)):
            n = len(payloads[i])
            if n > self.max_payload:
                if end == start:
                    self.check_size(n)
                break  # (the prefix goes first, as one by one)
            if n + _HEADER > room:
                break
            room -= n + _HEADER
            nbytes += n
            end = i + 1
        if end > start:
            self._t.send_records(payloads, start, end)  # one socket-lock round for all
            self.sent += nbytes + _HEADER * (end - start)
        return end - start, nbytes

    def used(self) -> int:
        return self.sent - self.acked

    @property
    def reader_closed(self) -> bool:
        return self.reader_closed_flag

    def reader_needs_doorbell(self) -> bool:
        return False  # the record itself wakes the reader

    def reader_wants_doorbell_for_close(self) -> bool:
        return False  # close() sends the E message itself

    def park(self) -> None:
        pass

    def unpark(self) -> None:
        pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._t.send_control(b"E")

    def release(self) -> None:
        pass


class NetReader:
    """The receiving lane: an inbox of received records (see
    :class:`~ringwire._conn.transport.FrameReader`).  ``current`` holds the array
    frames of the record handed out last, for the pool's resolver."""

    read_many_on_error = False

    def __init__(self, t: NetTransport, capacity: int) -> None:
        self._t = t
        self.capacity = capacity
        self.inbox: deque[tuple[bytes, list[Any]]] = deque()
        self.inbox_bytes = 0
        self.current: list[Any] = []
        self._taken = 0
        self.consumed = 0
        self._credited = 0
        self.writer_closed_flag = False
        self._closed = False

    @property
    def pending(self) -> bool:
        return self._taken > 0

    def next_frame(self) -> memoryview | None:
        if self._taken >= len(self.inbox):
            self._t.pump()
            if self._taken >= len(self.inbox):
                return None
        first, parts = self.inbox[self._taken]
        self._taken += 1
        self.current = parts
        self._t.on_frame(parts)
        return memoryview(first)

    def read_many(self, fn: Callable[[memoryview], Any], max_n: int, out: list[Any]) -> int:
        nbytes = k = 0
        while k < max_n:
            view = self.next_frame()
            if view is None:
                break
            n = len(view)
            try:
                obj = fn(view)
            except Exception:
                if k:
                    self._taken -= 1  # the batch ends before it: unread
                    break
                raise
            finally:
                view.release()
            out.append(obj)
            nbytes += n
            k += 1
        return nbytes

    def commit(self) -> None:
        inbox = self.inbox
        n = 0
        for _ in range(self._taken):
            n += len(inbox.popleft()[0]) + _HEADER
        self._taken = 0
        self.current = []
        self.inbox_bytes -= n
        self.consumed += n
        if self.consumed - self._credited >= self.capacity // 4 and not self._closed:
            self._credited = self.consumed
            self._t.send_control(b"C" + _Q.pack(self.consumed))

    def available(self) -> bool:
        if self._taken < len(self.inbox):
            return True
        self._t.pump()
        return self._taken < len(self.inbox)

    def fill(self) -> int:
        return self.inbox_bytes

    @property
    def writer_closed(self) -> bool:
        return self.writer_closed_flag

    def writer_needs_doorbell(self) -> bool:
        return False  # commit() sends the credit itself

    def park(self) -> None:
        pass

    def unpark(self) -> None:
        pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._t.send_control(b"X")

    def release(self) -> None:
        self.inbox.clear()
        self.current = []


class NetTransport:
    """One end of a TCP connection (see the module docstring).

    ``sock`` is the connected ``PAIR`` socket and ``monitor`` its monitor socket;
    ``peer_fd`` the descriptor of the peer's connection on a bound socket (its
    monitor events name it; ``None``: the socket has only ever had one connection).
    ``pools`` makes ``(send_pool, recv_pool, encoder)`` for this transport."""

    same_host = False  # the peer's clock is not ours (a record's publish time: ignored)
    spin_yields = False  # a spin never yields (its records come from ZeroMQ's I/O thread)

    def __init__(
        self,
        sock: zmq.Socket[Any],
        monitor: zmq.Socket[Any],
        *,
        capacity: int,
        peer_capacity: int,
        peer_pid: int,
        peer_fd: int | None,
        address: str,
        pools: Callable[[NetTransport], tuple[Any, Any, Any]],
    ) -> None:
        self._sock = sock
        self._mon = monitor
        self._peer_fd = peer_fd
        self.address = address
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._efd = self._wake_r.fileno()
        self._fd = int(sock.getsockopt(zmq.FD))
        self._mon_fd = int(monitor.getsockopt(zmq.FD))
        self._ep = select.epoll()
        for fd in (self._fd, self._mon_fd, self._efd):
            self._ep.register(fd, select.EPOLLIN)
        # the socket was seen empty after the last operation on it: until its FD says
        # otherwise, nothing waits (see "Waiting" in the module docstring)
        self._seen_empty = False
        self.tx = NetWriter(self, peer_capacity)
        self.rx = NetReader(self, capacity)
        self.peer_pid = peer_pid
        self.peer_host = ""  # the peer's host name, as its hello said (accepted connections)
        self.version = PROTOCOL_VERSION
        self.doorbells_sent = self.doorbells_received = 0
        self.gone = False  # the peer hung up (or we shut down)
        self._reason: str | None = None
        self._error: ProtocolError | None = None
        self._closed = False
        self._peer_left = False  # the monitor saw this connection's hang-up
        self.releases: deque[tuple[int, int]] = deque()  # from the peer, for the send pool
        self._news = False  # a pump outside drain() changed state: ring the eventfd
        self.on_frame: Callable[[list[Any]], None] = _ignore
        self.holder: Any = None  # NIXL (ringwire._net.nixlpools.Link): hold, settle, note
        self.nixl_off = ""  # why this connection's tensors do not go through NIXL
        self.send_pool, self.recv_pool, self.encoder = pools(self)
        self.status = self.tx.status = open_slot(self, sock, peer_fd)  # what inspect shows
        # read the monitor (and the socket) once now: libzmq signals a socket's FD for
        # a new message only after a read found its pipe empty
        with self._lock:
            self._pump_locked()
            self._pump_monitor()
        if self.rx.inbox or self._news:
            self._ring_self()

    def __repr__(self) -> str:
        return f"<NetTransport {self.address}{' gone' if self.gone else ''}>"

    @property
    def tensor_path(self) -> str:
        """``"nixl"`` (arrays may go through NIXL) or ``"frames"`` (ZeroMQ frames;
        :attr:`nixl_off` says why)."""
        return "nixl" if self.holder is not None else "frames"

    # -- sending ----------------------------------------------------------------------

    def send_record(self, payload: Any, frames: Sequence[Any] | None) -> None:
        with self._lock:
            if self.gone or self._closed:
                return  # into the void, as a ring write to a dead peer: drain() tells
            self._send_locked(payload, frames)
            self._after_op()

    def send_records(self, payloads: Sequence[Any], start: int, end: int) -> None:
        """Send ``payloads[start:end]`` in one round of the socket lock (as ``M``)."""
        with self._lock:
            if self.gone or self._closed:
                return
            i = start
            while i < end and not self.gone:
                p = payloads[i]
                frames = getattr(p, "frames", None)
                j = i + 1
                if not frames:  # records without arrays go as one M message
                    limit = min(end, i + _BATCH)
                    while j < limit and not getattr(payloads[j], "frames", None):
                        j += 1
                if j - i < 2:
                    self._send_locked(p, frames)
                else:
                    pieces = [b"M"]
                    for q in payloads[i:j]:
                        pieces += (_L.pack(len(q)), q)
                    self._send_control_locked(b"".join(pieces))
                i = j
            self._after_op()

    def _send_locked(self, payload: Any, frames: Sequence[Any] | None) -> None:
        sock = self._sock
        try:
            if frames:
                sock.send(payload, _MORE)
                last = len(frames) - 1
                for i, f in enumerate(frames):
                    sock.send(f, _NOBLOCK if i == last else _MORE, copy=False)
            else:
                sock.send(payload, _NOBLOCK)
        except zmq.ZMQError:
            self.gone = True  # no peer any more (PAIR without a pipe)

    def send_control(self, body: bytes, *, wait: bool = True) -> bool:
        """Send one control message; ``wait=False`` (a finalizer): only if the socket
        lock is free now (``False`` otherwise, and the eventfd is rung so that a
        driver's drain retries soon)."""
        if not self._lock.acquire(wait):
            self._ring_self()
            return False
        try:
            if self.gone or self._closed:
                return True
            self._send_control_locked(body)
            self.doorbells_sent += 1
            self._after_op()
            return True
        finally:
            self._lock.release()

    def _send_control_locked(self, body: bytes) -> None:
        try:
            self._sock.send(b"", _MORE)
            self._sock.send(body, _NOBLOCK)
        except zmq.ZMQError:
            self.gone = True

    def wake(self) -> None:
        """Make :meth:`fileno` readable (any thread): something changed for the drivers."""
        self._ring_self()

    def _after_op(self) -> None:
        # an operation may have consumed the FD's signal while a message waits: ask
        # EVENTS (which leaves the socket seen empty, or rings the eventfd)
        try:
            if int(self._sock.getsockopt(_EVENTS)) & _POLLIN:
                self._seen_empty = False
                self._ring_self()
            else:
                self._seen_empty = True
        except zmq.ZMQError:
            self._seen_empty = False
            self.gone = True

    def _ring_self(self) -> None:
        efd = self._efd
        if efd < 0:
            return  # closed (its number may be another descriptor's by now)
        try:
            self._wake_w.send(b"w")
        except OSError:
            pass  # the counter is full: readable anyway

    # -- receiving --------------------------------------------------------------------

    def pump(self) -> None:
        """Pull every waiting message (records into the inbox, control messages
        handled); never waits.  A control message or a hang-up found here (not in
        :meth:`drain`) rings the eventfd: another waiter of this endpoint -- a sender
        waiting for credit, a receiver waiting for the end -- must wake for it."""
        with self._lock:
            self._pump_locked()
            if self._news:
                self._news = False
                self._ring_self()

    def _ready_fds(self) -> list[int]:
        """The descriptors of the epoll set that are readable now (no wait)."""
        if self._efd < 0:
            return []  # closed
        return [fd for fd, _ in self._ep.poll(0)]

    def _pump_locked(self, signalled: bool | None = None) -> None:
        # ``signalled``: whether the socket's FD is readable (None: look).  Read at once
        # when signalled, else ask EVENTS first; EVENTS after a first message, then read
        # a burst until the socket is empty
        if self._closed:
            return
        rx = self.rx
        holder = self.holder
        if holder is not None and holder.pending:  # NIXL reads done: deliver, in order
            try:
                holder.settle(rx)
            except ProtocolError as exc:
                self._fail(str(exc))
        if self._seen_empty:
            if signalled is None:
                signalled = self._fd in self._ready_fds()
            if not signalled:
                return
        probe = not signalled
        self._seen_empty = False
        heard = [False]
        try:
            self._read_burst(probe, holder, heard)
        finally:
            if heard[0]:
                self.status.heard(self)

    def _read_burst(self, probe: bool, holder: Any, heard: list[bool]) -> None:
        sock = self._sock
        rx = self.rx
        burst = False
        while True:
            try:
                if probe and not int(sock.getsockopt(_EVENTS)) & _POLLIN:
                    self._seen_empty = True
                    return
                frame = sock.recv(_NOBLOCK, copy=False)
                first = frame.bytes
                parts = []
                while frame.more:  # (cheaper than asking RCVMORE)
                    frame = sock.recv(_NOBLOCK, copy=False)
                    parts.append(frame)
            except zmq.Again:
                self._seen_empty = True
                return
            except zmq.ZMQError:
                self.gone = True
                return
            heard[0] = True
            if burst:
                probe = False
            else:
                probe = burst = True  # one EVENTS after the first message, then reads
            if self._error is not None:
                continue  # broken: the endpoint is told at its drain()
            if first:
                if rx.writer_closed_flag:
                    self._fail("a record arrived after the peer's end of stream")
                    continue
                try:
                    if holder is None or not holder.hold(first, parts):
                        rx.inbox.append((first, parts))
                except ProtocolError as exc:
                    self._fail(str(exc))
                    continue
                rx.inbox_bytes += len(first) + _HEADER
                if rx.inbox_bytes > rx.capacity:
                    self._fail(
                        f"the peer sent {rx.inbox_bytes} record bytes, more than the lane's "
                        f"credit of {rx.capacity}"
                    )
            elif len(parts) != 1:
                self._fail(f"a control message of {len(parts) + 1} frames")
            else:
                body = parts[0].bytes
                if body[:1] == b"M":
                    self._batch(body)
                else:
                    self._control(body)

    def _batch(self, body: bytes) -> None:
        rx = self.rx
        if rx.writer_closed_flag:
            return self._fail("a record arrived after the peer's end of stream")
        got: list[tuple[bytes, list[Any]]] = []
        i, end, room = 1, len(body), rx.capacity - rx.inbox_bytes
        unpack = _L.unpack_from
        while i < end:
            if i + 4 > end:
                return self._fail("a batch cut short in a record's length")
            (k,) = unpack(body, i)
            i += 4
            if k == 0 or i + k > end:
                return self._fail(f"a batch record of {k} bytes ({end - i} left)")
            room -= k + _HEADER
            if room < 0:
                return self._fail("the peer sent a batch past its credit")
            got.append((body[i : i + k], []))
            i += k
        if len(got) < 2:
            return self._fail(f"a batch of {len(got)} record(s)")
        holder = self.holder
        if holder is not None and holder.pending:  # behind a record whose NIXL reads run
            for first, parts in got:
                holder.hold(first, parts)
        else:
            rx.inbox.extend(got)
        rx.inbox_bytes = rx.capacity - room
        return None

    def _fail(self, what: str) -> None:
        if self._error is None:
            self._error = ProtocolError(f"garbage from {self.address}: {what}")
            self._ring_self()

    def _control(self, body: bytes) -> None:
        self.doorbells_received += 1
        self._news = True
        if body[:1] == b"N" and self.holder is not None:  # NIXL: a region announced
            try:
                self.holder.note(body[1:])
            except ProtocolError as exc:
                self._fail(str(exc))
            return
        try:
            kind, value = parse_control(body)
            if kind == b"C":
                tx = self.tx
                check_credit(value, tx.sent, tx.acked)
                tx.acked = value
            elif kind == b"R":
                self.releases.extend(value)
            elif kind == b"E":
                self.rx.writer_closed_flag = True
            elif kind == b"X":
                self.tx.reader_closed_flag = True
            elif kind == b"A":
                self._reason = value
            elif kind == b"B":
                self.gone = True
            else:
                raise ProtocolError(f"a handshake message {body[:1]!r} after the attach")
        except ProtocolError as exc:
            self._fail(str(exc))

    def _pump_monitor(self) -> None:
        mon = self._mon
        while True:
            try:
                msg = mon.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                self.gone = True
                return
            try:
                ev = parse_monitor_message(msg)
            except Exception:  # pragma: no cover - libzmq speaks its own format
                continue
            if ev["event"] in GONE_EVENTS and (
                self._peer_fd is None
                or (int(ev["value"]) == self._peer_fd and ev["event"] not in HANDSHAKE_FAILED)
            ):
                # the monitor's event may overtake the last messages of the pipe (libzmq
                # throttles command processing): give the socket a moment to deliver
                if not self.gone:
                    with contextlib.suppress(zmq.ZMQError):
                        self._sock.poll(10, zmq.POLLIN)
                    self._seen_empty = False  # (the poll may have taken the FD's signal)
                    self._pump_locked()
                self.gone = self._news = True
                self._peer_left = True  # (the event is ours now: retire() cannot see it)
                self.status.gone()
            elif ev["event"] == zmq.EVENT_CONNECTED:
                self.status.endpoints(int(ev["value"]))  # the client's TCP addresses

    # -- the seam ---------------------------------------------------------------------

    def fileno(self) -> int:
        return self._ep.fileno()

    def ring(self, byte: bytes) -> bool:
        return not self.gone

    def drain(self) -> bool:
        with self._lock:
            if self._efd >= 0:
                ready = self._ready_fds()
                if self._efd in ready:
                    try:
                        while len(self._wake_r.recv(4096)) == 4096:
                            pass
                    except OSError:
                        pass  # nothing to read
                self._pump_locked(self._fd in ready)
                if self._mon_fd in ready:
                    self._pump_monitor()
                self._news = False  # the caller wakes every waiter
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self.gone or self._reason is not None

    @property
    def peer_reason(self) -> str | None:
        return self._reason

    def abort(self, reason: str) -> None:
        self.send_control(b"A" + reason.encode("utf-8", "replace")[:MAX_REASON])

    def hung_up(self) -> bool:
        if not self.gone and not self._closed:
            with self._lock:
                if self._mon_fd in self._ready_fds():
                    self._pump_monitor()
                if self._news:
                    self._news = False
                    self._ring_self()
        return self.gone or self._reason is not None

    def shutdown(self) -> None:
        if not self.gone and not self._closed:
            self.send_control(b"B")
        self.gone = True
        self._ring_self()

    def close(self, *, discard: bool = False) -> None:
        """Close; what is still queued is flushed for a while (:func:`.zmqlife.retire`),
        or with ``discard`` (a peer known dead or hostile) dropped at once."""
        if self._closed:
            return
        self.shutdown()
        with self._lock:
            self._closed = True
            self.rx.release()
            self.status.close()
            if discard:
                close_monitored(self._sock, self._mon, 0)
            else:
                retire(self._sock, self._mon, peer_left=self._peer_left)
            self._ep.close()
            self._efd = -1
            self._wake_r.close()
            self._wake_w.close()


def _ignore(parts: list[Any]) -> None:
    pass
