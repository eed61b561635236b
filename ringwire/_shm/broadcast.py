"""The writer's side of a broadcast on one host: segments, one socket per reader, joins.

A :class:`BroadcastHub` owns everything a broadcast writer shares with its readers:

* a listening Unix socket at the broadcast's path (mode 0600; every peer's uid is
  checked with ``SO_PEERCRED``, as a :class:`~ringwire.Listener` does);
* the broadcast ring segment (:mod:`ringwire._wire.broadcast_ring`) and, with tensor
  slots, the pool segment (:mod:`ringwire._shm.broadcast_pool`).  Both names are
  unlinked the moment they are made: the hub keeps one descriptor of each and hands
  it to every reader that joins, over its socket (``SCM_RIGHTS``).  So a reader may
  join at any time, and however anybody dies, nothing is left in ``/dev/shm``;
* one control socket per reader, after the join handshake of
  :mod:`ringwire._wire.broadcast_control`: doorbells both ways, and liveness -- a
  reader that dies closes its socket, so its end of file reaches the hub at once.

Every descriptor the hub waits on sits in one selector (epoll / kqueue), whose own
descriptor (:meth:`BroadcastHub.fileno`) is readable whenever a join, a doorbell or a
hang-up is pending: the writer's drivers wait on that single descriptor, asyncio
watches it for the life of the broadcast, a blocking writer's watcher thread polls
it.  :meth:`BroadcastHub.poll` does what is pending without ever waiting -- accepts,
steps handshakes, drains doorbells, retires readers that went -- and reports what
happened to readers as :class:`ReaderEvent` s; what to *do* about a lost reader (go
on, or fail the broadcast) is the writer's policy (``on_lost``, installed by
:class:`~ringwire._conn.broadcast.BroadcastEndpoint`).

The writer's transport
----------------------
The hub is also the :class:`~ringwire._conn.transport.Transport` of the writer's
endpoint, a send-only one: its sending lane (``tx``) is the broadcast ring's
:class:`~ringwire._wire.broadcast_ring.BroadcastWriter`, its receiving lane (``rx``)
a :class:`~ringwire._shm.broadcast_reader.NullReader`, its send pool the
:class:`~ringwire._shm.broadcast_pool.BroadcastPool` (a record's slots are
:meth:`published <BroadcastHub.published>` to the readers admitted then), and it has
no receive pool.  :meth:`~BroadcastHub.ring` rings the readers the lane or the pool
listed; :meth:`~BroadcastHub.drain` is :meth:`~BroadcastHub.poll`; the writer's peer
never hangs up (:meth:`~BroadcastHub.hung_up` is ``False``: readers come and go, a
failed broadcast is the endpoint's ``broken`` state), so a send never drains the hub
between publishing a record and recording who holds its slots.  A waiting writer
that gives up names who it waited for: :meth:`~BroadcastHub.stalled_on_room` (the
ring's laggards) and :meth:`~BroadcastHub.stalled_on_slot` (the readers that hold
slots).

Admission happens when ``Joined`` is sent, between two publishes (the hub is only
driven from the writer's thread, or under its lock): the reader starts at the current
tail, its ring space and its share of every later slot count from then on.  A reader
that goes -- end of file with its closed flag set (it *left*), without it (it *died*),
after an abort, or dropped by the writer -- stops holding ring space and gives up its
share of every slot before :meth:`BroadcastHub.poll` returns.  A rank whose reader the
writer dropped while its process still runs is not handed out again until that
process is gone (it may still write to its entry and its lane).

Readers on other hosts
----------------------
With ``tcp=`` the writer also has a :class:`~ringwire._net.fanout.Fanout` (attached by
:meth:`attach_remote`; this module never imports the TCP transport): its descriptor
sits in the selector beside the readers' sockets, and the hub stays the one place that
hands out ranks (one rank space), counts readers and applies the policy.  A remote
reader is admitted by :meth:`admit_remote` -- its bit joins :attr:`live_mask`, so
every later slot waits for its release too, but it never holds ring space (the ring
only keeps space for local readers) -- and retired by :meth:`retire_remote`, which
reports it as a local reader's departure is reported.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from .._errors import (
    HandshakeError,
    ProtocolError,
    ReaderStalled,
    RingwireError,
    SharedMemoryFull,
    SlotWaitTimeout,
)
from .._pool.arena import ArenaFile
from .._pool.protocols import Placed
from .._pool.segment import Segment, pid_alive, sweep
from .._pool.slotconfig import RELEASE_CAPACITY, SlotConfig
from .._wire.broadcast_control import (
    BROADCAST_VERSIONS,
    Join,
    Joined,
    MessageReader,
    Refused,
    Started,
    encode_broadcast_message,
    validate_join,
)
from .._wire.broadcast_ring import BroadcastWriter, broadcast_ring_size, init_broadcast_ring
from .._wire.codec import Encoder
from .._wire.control import (
    DOORBELL_SPACE,
    ControlReader,
    SegmentSpec,
    choose_version,
    encode_abort,
)
from .._wire.ring import init_ring, validate_capacity
from .._wire.slotlayout import init_pool, pool_size
from .broadcast_pool import LANE_SIZE, BroadcastPool, passable_segment
from .broadcast_reader import NullReader
from .sockets import bind_unix_socket, check_peer, ring_at

__all__ = ["BroadcastHub", "ReaderEvent"]

logger = logging.getLogger("ringwire")
_MAX_RECORD_SLACK = 1024  # bytes of a record's frame left for what is not array data
_WAKE = object()
_REMOTE = object()


def _ignore(event: ReaderEvent) -> None:
    pass


class ReaderEvent(NamedTuple):
    """Something that happened to a reader, as :meth:`BroadcastHub.poll` reports it.

    ``kind``: ``"joined"`` (admitted: space and slots count it from now on), ``"ready"``
    (it attached everything), ``"left"`` (it closed cleanly, or went before it was
    ready), ``"lost"`` (it died, aborted, or broke the protocol: ``detail`` says which).
    """

    kind: str
    rank: int
    pid: int
    detail: str = ""


class _Conn:
    """One reader's control socket, from accept to retirement."""

    __slots__ = ("sock", "fd", "pid", "rank", "ready", "msgs", "control", "deadline")

    def __init__(self, sock: socket.socket, pid: int, deadline: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.pid = pid
        self.rank = -1  # until admitted
        self.ready = False  # Started arrived
        self.msgs: MessageReader | None = MessageReader()
        self.control = ControlReader()
        self.deadline = deadline  # for the join handshake


class BroadcastHub:
    """See the module docstring.  Not thread-safe: drive it from one thread at a time."""

    def __init__(
        self,
        path: str,
        *,
        capacity: int,
        readers: int,
        slots: SlotConfig | None,
        handshake_timeout: float,
    ) -> None:
        validate_capacity(capacity)
        size = broadcast_ring_size(capacity, readers)  # checks ``readers``
        self.path = path
        self.readers = readers
        self.capacity = capacity
        self.handshake_timeout = handshake_timeout
        self.conns: dict[int, _Conn] = {}  # rank -> admitted reader
        self._pending: set[_Conn] = set()  # accepted, not admitted yet
        self.evicted: dict[int, int] = {}  # rank -> pid of a reader dropped while alive
        self.events: list[ReaderEvent] = []
        self.live_mask = 0  # readers admitted (the slot holders of a new record)
        self.remote: Any = None  # the Fanout of readers on other hosts (attach_remote)
        self._alarm: float | None = None  # the handshake deadline a thread will wake us at
        self._closing = threading.Event()  # (stops that thread)
        self.pid = os.getpid()
        self.failed: str | None = None
        self.closed = False
        self.doorbells_sent = self.doorbells_received = 0
        self.joined = self.left = self.lost = self.refused = 0
        # the writer's policy for a lost reader (see settle); by default: just forget it
        self.on_lost: Callable[[ReaderEvent], None] = _ignore
        # the Transport face (see the module docstring)
        self.rx = NullReader()
        self.peer_pid = 0  # many peers: ReaderInfo.pid names each
        self.version = max(BROADCAST_VERSIONS)
        self.recv_pool = None
        self.encoder = Encoder()  # places arrays in the shared pool (Encoder.encode_with)
        self.tensor_path, self.nixl_off = "slots", ""
        self.peer_reason: str | None = None
        self._fds: list[int] = []
        self._segs: list[Segment] = []
        self.pool: BroadcastPool | None = None
        self._sock = bind_unix_socket(path)
        try:
            sweep()  # names of dead processes (a writer killed between create and unlink)
            seg, fd = passable_segment(size)
            self._segs.append(seg)
            self._fds.append(fd)
            init_broadcast_ring(seg.buf, 0, capacity, readers)
            self.writer = BroadcastWriter(seg.buf)
            self.tx: Any = self.writer  # (with remote readers: a FanoutWriter over it)
            self.writer.on_faulty = self.wake  # a bad head: retire it at the next drain
            if slots is not None:
                self.pool = self._make_pool(slots)
                self.pool.on_fault = self.settle
            self.send_pool = self.pool
            self._sel = selectors.DefaultSelector()
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._sel.register(self._sock, selectors.EVENT_READ, None)
            self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        except BaseException:
            self._sock.close()
            os.unlink(path)
            for seg in self._segs:
                seg.close()
            for fd in self._fds:
                os.close(fd)
            raise

    def _make_pool(self, config: SlotConfig) -> BroadcastPool:
        psize = pool_size(config.classes)
        try:
            seg, fd = passable_segment(psize + (1 + self.readers) * LANE_SIZE)
        except SharedMemoryFull as exc:
            raise SharedMemoryFull(
                f"{exc}; this is a broadcast's tensor-slot pool ({config.describe()}): "
                "configure smaller slot classes, or slots=None to send every array inline"
            ) from None
        self._segs.append(seg)
        self._fds.append(fd)
        layout = init_pool(seg.buf, config.classes)
        for k in range(1 + self.readers):
            init_ring(seg.buf, psize + k * LANE_SIZE, RELEASE_CAPACITY)
        arena = None
        if config.large_limit is not None:
            arena = ArenaFile()
            arena.unlink()  # (named: readers get the descriptor, as for the ring and pool)
            self._fds.append(os.dup(arena.fd))  # (the pool closes the arena's own)
        return BroadcastPool(
            seg, layout, config, self.writer.max_payload - _MAX_RECORD_SLACK, self.readers, arena
        )

    def __repr__(self) -> str:
        return f"<BroadcastHub {self.path} {len(self.conns)}/{self.readers} readers>"

    def fileno(self) -> int:
        """Readable while a join, doorbell or hang-up is pending (see the docstring)."""
        return self._sel.fileno()

    @property
    def ready_count(self) -> int:
        n = sum(1 for c in self.conns.values() if c.ready)
        return n + len(self.remote.conns) if self.remote is not None else n

    def pid_of(self, rank: int) -> int:
        c = self.conns.get(rank)
        if c is None and self.remote is not None:
            c = self.remote.conns.get(rank)
        return c.pid if c is not None else 0

    def is_ready(self, rank: int) -> bool:
        c = self.conns.get(rank)
        if c is None and self.remote is not None:
            return rank in self.remote.conns
        return c is not None and c.ready

    def taken(self, rank: int) -> bool:
        """Is ``rank`` held by a reader, here or on another host?"""
        return rank in self.conns or (self.remote is not None and self.remote.held(rank))

    # -- readers on other hosts (see the module docstring) ------------------------------

    def attach_remote(self, fanout: Any) -> None:
        """Serve readers on other hosts through ``fanout`` from now on."""
        self.remote = fanout
        self._sel.register(fanout.fileno(), selectors.EVENT_READ, _REMOTE)

    def admit_remote(self, pid: int, host: str, join: Join) -> tuple[int, int, int]:
        """Admit a remote reader (process ``pid`` on ``host``) that sent ``join``: its
        version, rank and start.  :class:`HandshakeError` to refuse it."""
        if self.failed is not None:
            raise HandshakeError(f"this broadcast failed: {self.failed}")
        version = choose_version(join.versions, BROADCAST_VERSIONS, "broadcast protocol")
        rank = self._pick_rank(join.rank)
        self.live_mask |= 1 << rank
        if self.pool is not None:
            self.pool.admit_remote(rank)
        self.joined += 1
        self.events.append(ReaderEvent("joined", rank, pid, f"on {host!r}"))
        self.events.append(ReaderEvent("ready", rank, pid, f"on {host!r}"))
        return version, rank, self.writer.position

    def retire_remote(self, reader: Any, why: str, lost: bool) -> None:
        """Remote ``reader`` went (``lost``: died, partitioned, broke the protocol): give
        up its slot shares, report it (the policy hears of a loss at :meth:`settle`)."""
        rank = reader.rank
        self.live_mask &= ~(1 << rank)
        pool = self.pool
        if pool is not None:  # (once ZeroMQ no longer reads its frames: fanout.py)
            self.remote.when_sent(rank, lambda: pool.drop(rank))
        detail = f"on {reader.host!r} {why}"
        if lost:
            self.lost += 1
            self.events.append(ReaderEvent("lost", rank, reader.pid, detail))
        else:
            self.left += 1
            self.events.append(ReaderEvent("left", rank, reader.pid, detail))

    def wake(self) -> None:
        """Make :meth:`fileno` readable once (to stop a watcher)."""
        try:
            self._wake_w.send(b"w")
        except OSError:
            pass

    # -- doing what is pending --------------------------------------------------------

    def poll(self) -> bool:
        """Accept, step joins, drain doorbells, retire readers that went: whatever is
        pending now, without waiting.  Appends to :attr:`events`; ``True`` if anything
        arrived (a waiter should re-check)."""
        if self.closed:
            return False
        woke = False
        for key, _ in self._sel.select(0):
            c = key.data
            woke = True
            if c is None:
                self._accept()
            elif c is _WAKE:
                try:
                    self._wake_r.recv(512)
                except OSError:
                    pass
            elif c is _REMOTE:
                self.remote.poll()
            elif c.ready:
                self._drain(c)
            else:
                self._step_join(c)
        remote = self.remote
        if remote is not None and remote.overdue():  # (an attach or a join timed out)
            remote.poll()
        if self._pending or any(not c.ready for c in self.conns.values()):
            self._expire()
        self._arm()
        self.settle()
        return woke

    def _arm(self) -> None:
        """Make sure a poll happens at the next handshake deadline, even in a writer
        nothing else wakes: a thread rings :meth:`wake` then (one at a time)."""
        dl = [c.deadline for c in self._pending]
        dl += [c.deadline for c in self.conns.values() if not c.ready]
        if self.remote is not None:
            until = self.remote.next_deadline()
            if until is not None:
                dl.append(until)
        if not dl:
            return
        when = min(dl)
        alarm = self._alarm
        if alarm is not None and when >= alarm > time.monotonic():
            return  # (a thread will ring at or before then)
        self._alarm = when
        threading.Thread(
            target=ring_at,
            args=(self._wake_w, when, self._closing),  # (not the hub: it may be collected)
            name="ringwire-broadcast-deadline",
            daemon=True,
        ).start()

    def settle(self) -> None:
        """Retire the readers found faulty (a head out of the ring, a release of a slot
        they did not hold), then hand every reader lost since the last call to
        ``on_lost`` (the writer's policy).  Never waits."""
        writer, pool = self.writer, self.pool
        if writer.faulty:
            for r in writer.faulty:
                self.lose(r, "moved its head out of the ring")
            writer.faulty.clear()
        if pool is not None and pool.faulty:
            for r in pool.faulty:
                self.lose(r, "released a slot it did not hold")
            pool.faulty.clear()
        events = self.events
        if events:
            lost = [ev for ev in events if ev.kind == "lost"]
            events.clear()
            for ev in lost:
                self.on_lost(ev)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: the next poll tries again
                logger.warning("ringwire broadcast %s: accept failed: %s", self.path, str(exc))
                return
            sock.setblocking(False)
            try:
                pid = check_peer(sock)
            except (RingwireError, OSError) as exc:
                self.refused += 1
                logger.warning("ringwire broadcast %s refused a reader: %s", self.path, str(exc))
                sock.close()
                continue
            c = _Conn(sock, pid, time.monotonic() + self.handshake_timeout)
            self._pending.add(c)
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _recv(self, c: _Conn) -> bytes | None:
        """What the socket holds now: bytes, ``b""`` at end of file, ``None`` if nothing."""
        try:
            return c.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return b""

    def _step_join(self, c: _Conn) -> None:
        data = self._recv(c)
        if data is None:
            return
        if not data:
            self._retire(c, "went before it was ready")
            return
        try:
            assert c.msgs is not None
            c.msgs.feed(data)
            while c.msgs is not None and not c.ready:
                msg = c.msgs.next()
                if msg is None:
                    break
                if c.rank < 0 and isinstance(msg, Join):
                    if not self._admit(c, msg):
                        return
                elif c.rank >= 0 and isinstance(msg, Started):
                    c.ready = True
                    self.events.append(ReaderEvent("ready", c.rank, c.pid))
                    rest, c.msgs = c.msgs.rest, None
                    if rest:
                        self.doorbells_received += c.control.feed(rest)
                else:
                    raise HandshakeError(f"unexpected {type(msg).__name__} while joining")
        except (HandshakeError, ProtocolError) as exc:
            self._refuse(c, str(exc))

    def _pick_rank(self, want: int) -> int:
        def usable(r: int) -> bool:
            if self.taken(r):
                return False
            pid = self.evicted.get(r)
            if pid is not None:
                if pid_alive(pid):
                    return False
                del self.evicted[r]
            return True

        if want >= 0:
            if usable(want):
                return want
            if self.taken(want):
                raise HandshakeError(f"rank {want} is taken (by pid {self.pid_of(want)})")
            raise HandshakeError(
                f"rank {want} was dropped by the writer and its process (pid "
                f"{self.evicted[want]}) still runs"
            )
        for r in range(self.readers):
            if usable(r):
                return r
        raise HandshakeError(f"all {self.readers} reader ranks of this broadcast are taken")

    def _admit(self, c: _Conn, join: Join) -> bool:
        if self.failed is not None:
            raise HandshakeError(f"this broadcast failed: {self.failed}")
        version = choose_version(join.versions, BROADCAST_VERSIONS, "broadcast protocol")
        validate_join(join, self.readers)
        rank = self._pick_rank(join.rank)
        start = self.writer.admit(rank, c.pid)
        c.rank = rank
        self.conns[rank] = c
        self._pending.discard(c)
        self.live_mask |= 1 << rank
        pool = self.pool
        lane = pool.admit(rank) if pool is not None else 0
        ring_seg = self._segs[0]
        msg = Joined(
            version=version,
            pid=os.getpid(),
            rank=rank,
            start=start,
            capacity=self.capacity,
            readers=self.readers,
            ring=SegmentSpec(ring_seg.name, ring_seg.size, "broadcast"),
            pool=None if pool is None else SegmentSpec(pool.seg.name, pool.seg.size, "slots"),
            arena=None
            if pool is None or pool.arena is None
            else SegmentSpec(pool.arena.name, pool.arena.size, "arena"),
            lane_offset=lane,
            fds=len(self._fds),
        )
        data = encode_broadcast_message(msg)
        try:
            n = socket.send_fds(c.sock, [data], self._fds)
            if n < len(data):  # a fresh socket's buffer takes a few hundred bytes at once
                c.sock.sendall(data[n:])
        except OSError as exc:
            self._retire(c, f"could not be told where to read: {exc}")
            return False
        self.joined += 1
        self.events.append(ReaderEvent("joined", rank, c.pid))
        return True

    def _refuse(self, c: _Conn, reason: str) -> None:
        self.refused += 1
        logger.warning("ringwire broadcast %s refused pid %s: %s", self.path, c.pid, reason)
        try:
            c.sock.send(encode_broadcast_message(Refused(reason[:1000])))
        except OSError:
            pass
        self._retire(c, f"refused: {reason}")

    def _expire(self) -> None:
        now = time.monotonic()
        for c in [*self._pending, *(c for c in self.conns.values() if not c.ready)]:
            if now > c.deadline:
                self._refuse(c, f"did not finish joining within {self.handshake_timeout} s")

    def _drain(self, c: _Conn) -> None:
        while True:
            data = self._recv(c)
            if data is None:
                return
            if not data:
                self._retire(c, "")
                return
            try:
                self.doorbells_received += c.control.feed(data)
            except ProtocolError as exc:
                self._retire(c, f"broke the protocol: {exc}", lost=True)
                return
            if c.control.reason is not None:
                self._retire(c, f"dropped the broadcast: {c.control.reason}", lost=True)
                return
            if len(data) < 4096:
                return

    # -- retiring readers -------------------------------------------------------------

    def _retire(self, c: _Conn, why: str, *, lost: bool = False) -> None:
        """Forget ``c``: its ring space, its slot shares, its socket.  ``why`` empty: an
        end of file, a leave or a death as its closed flag says."""
        self._pending.discard(c)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()
        rank = c.rank
        if rank < 0 or self.conns.get(rank) is not c:
            return
        clean = self.writer.reader_closed_flag(rank)
        del self.conns[rank]
        self.live_mask &= ~(1 << rank)
        self.writer.remove(rank)
        if self.pool is not None:
            self.pool.drop(rank)
        if lost or (c.ready and not clean and not why):
            if pid_alive(c.pid):  # (it may still write to its entry: keep its rank for now)
                self.evicted[rank] = c.pid
            self.lost += 1
            detail = why or "died (its control socket closed without a leave)"
            self.events.append(ReaderEvent("lost", rank, c.pid, detail))
        else:
            self.left += 1
            self.events.append(ReaderEvent("left", rank, c.pid, why or "left"))

    def lose(self, rank: int, why: str) -> None:
        """Retire ``rank`` as lost (a bad head or release): tell it why, shut it out."""
        c = self.conns.get(rank)
        if c is None:
            return
        self._abort(c, why)
        self.evicted[rank] = c.pid
        self._retire(c, why, lost=True)

    def drop(self, rank: int, why: str) -> bool:
        """The writer drops ``rank`` (it stalled, say): tell it why and stop keeping
        anything for it.  Not a loss.  ``False`` if there is no such reader."""
        c = self.conns.get(rank)
        if c is None:
            rr = self.remote.drop(rank, why) if self.remote is not None else None
            if rr is not None:
                self.retire_remote(rr, f"dropped by the writer: {why}", False)
            return rr is not None
        self._abort(c, why)
        if pid_alive(c.pid):
            self.evicted[rank] = c.pid
        self._retire(c, f"dropped by the writer: {why}")
        return True

    def fail(self, reason: str) -> None:
        """The broadcast failed: every reader is told ``reason`` and shut out; joins are
        refused from now on.  Nothing more is published, so the readers keep their ring
        space and slot shares: each still reads what was published before (its slot
        references stay valid), then gets the reason."""
        if self.failed is None:
            self.failed = reason
        if self.remote is not None:
            self.remote.fail(reason)
        for c in [*self.conns.values(), *self._pending]:
            self._abort(c, reason)
            self._pending.discard(c)
            try:
                self._sel.unregister(c.sock)
            except (KeyError, ValueError):
                pass
            c.sock.close()
            if c.rank >= 0:
                self.evicted[c.rank] = c.pid
        self.conns.clear()

    def _abort(self, c: _Conn, why: str) -> None:
        try:
            c.sock.send(encode_abort(why))
            c.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- doorbells ----------------------------------------------------------------------

    def ring(self, byte: bytes) -> bool:
        """(Transport) Ring the readers that need ``byte``: those the lane listed after a
        publish or a close, or (``DOORBELL_SPACE``) those the pool listed after a poll.
        Always ``True``: a reader that is gone is retired by its end of file."""
        if byte == DOORBELL_SPACE:
            if self.pool is not None:
                self.ring_ranks(self.pool.ring_back, byte)
        else:
            self.ring_ranks(self.writer.to_ring, byte)
        return True

    def ring_ranks(self, ranks: Any, byte: bytes) -> None:
        """One doorbell to each reader in ``ranks`` (a gone one is retired at the next
        :meth:`poll`, by its end of file)."""
        conns = self.conns
        for r in ranks:
            c = conns.get(r)
            if c is None:
                continue
            try:
                c.sock.send(byte)
                self.doorbells_sent += 1
            except OSError:
                pass  # full: it wakes anyway; gone: its end of file is pending

    # -- the rest of the Transport face ---------------------------------------------------

    def drain(self) -> bool:
        """(Transport) :meth:`poll`; never a hang-up (see the module docstring)."""
        self.poll()
        return False

    def hung_up(self) -> bool:
        """(Transport) ``False``: the writer's readers come and go, none is *the* peer."""
        return False

    def abort(self, reason: str) -> None:
        """(Transport) Fail the broadcast, telling every reader ``reason``."""
        if not self.closed:
            self.fail(reason)

    def shutdown(self) -> None:
        """(Transport) Wake whatever waits on :meth:`fileno`."""
        self.wake()

    def published(self, placed: Placed) -> None:
        """A record that took ``placed`` was just published: the readers admitted now
        each hold each of its slots."""
        if self.pool is not None:
            self.pool.published(placed, self.live_mask)

    # -- naming who a writer waits for ------------------------------------------------

    def who(self, ranks: Any) -> str:
        return ", ".join(f"rank {r} (pid {self.pid_of(r)})" for r in ranks)

    def stalled_on_room(self, size: int, waited: float) -> ReaderStalled:
        """What a writer that waited ``waited`` s for room for a ``size``-byte record
        raises: the live readers that hold the space, slowest first."""
        if self.remote is not None:
            err = self.remote.stalled(size, waited)
            if err is not None:
                return err  # (the ring itself had room)
        ring = self.writer
        slow = ring.laggards(size)
        if not slow:
            slow = sorted(ring.live, key=ring.head_of)[:1]
        behind = ", ".join(
            f"rank {r} (pid {self.pid_of(r)}, {ring.behind(r)} bytes behind"
            + ("" if self.is_ready(r) else ", not ready yet")
            + ")"
            for r in slow
        )
        return ReaderStalled(
            f"broadcast {self.path}: no room for a {size}-byte record after {waited:.3g} s: "
            f"waiting for {behind or 'no reader'} (ring of {ring.capacity} bytes); "
            "drop_reader() them, or give them more time",
            tuple(slow),
            tuple(self.pid_of(r) for r in slow),
        )

    def stalled_on_slot(self, nbytes: Any, waited: float, *, stall: bool) -> RingwireError:
        """What a writer that waited ``waited`` s for a free slot raises: the readers
        holding slots, most first -- :class:`ReaderStalled` (``stall``: the stall or
        the caller's timeout ran out) or :class:`SlotWaitTimeout` (the pool's
        ``wait_timeout``)."""
        pool = self.pool
        assert pool is not None
        held = sorted(pool.holders_summary().items(), key=lambda kv: -kv[1])
        who = ", ".join(f"rank {r} (pid {self.pid_of(r)}) holds {n}" for r, n in held)
        text = (
            f"broadcast {self.path}: no slot for {nbytes} bytes was released within "
            f"{waited:.3g} s ({pool.config.describe()}; {who or 'no reader holds any'}): "
            "readers keep received arrays alive -- release them, or keep copy_out() copies"
        )
        if stall:
            ranks = tuple(r for r, _ in held)
            return ReaderStalled(text, ranks, tuple(self.pid_of(r) for r in ranks))
        return SlotWaitTimeout(text)

    # -- closing ----------------------------------------------------------------------

    def close(self) -> None:
        """Mark the ring closed (readers get what was published, then end of stream),
        close every socket, remove the path, free the segments."""
        if self.closed:
            return
        self.closed = True
        self._closing.set()
        if self.failed is None:
            self.writer.close()
        for c in [*self.conns.values(), *self._pending]:
            c.sock.close()
        self.conns.clear()
        self._pending.clear()
        if self.remote is not None:
            self.remote.close()  # (before the segments: frames in flight keep views)
        self._sel.close()
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._wake_r.close()
        self._wake_w.close()
        if self.pool is not None:
            self.pool.close()
        self.writer.release()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self._segs[0].close()
