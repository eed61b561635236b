"""A broadcast's readers on other hosts: the writer's side of their TCP connections.

A broadcast writer given ``tcp=`` binds a :class:`~.handshake.NetAcceptor` there
(CURVE with keys, as a TCP listener).  Each remote reader is one TCP connection -- a
:class:`~.transport.NetTransport`, exactly a channel's -- that the hub
(:class:`~ringwire._shm.broadcast.BroadcastHub`) drives through :class:`Fanout`.

Theory of operation
-------------------
A connection moves through this table, one row at a time, whenever
:meth:`Fanout.poll` runs (the hub's poll: the fanout's epoll descriptor sits in the
hub's selector, so a join, a credit, a release or a hang-up wakes the writer)::

    state      event                              next       what the writer does
    ---------  ---------------------------------  ---------  ----------------------------
    attaching  the acceptor finished the attach   joining    (CURVE, the channel handshake)
    joining    first record: a valid Join         admitted   answer RemoteJoined; its bit
                                                             joins the slots' holder mask
    joining    bad Join, rank taken, failed       --         abort with the reason
    joining    handshake timeout, hang-up         --         abort / forget
    admitted   credit (C), releases (R)           admitted   count them (a release of a
                                                             slot it does not hold: lost)
    admitted   any record, garbage                --         lost: "broke the protocol"
    admitted   X then hang-up                     --         left (it closed cleanly)
    admitted   hang-up, heartbeat, abort          --         lost (died, partition, gave up)

"Lost" and "left" are reported to the hub (``retire``), which applies the writer's
``on_reader_loss`` exactly as for a local reader; a lost connection is closed at once,
and the slots' shares it held are given up.

Forwarding
----------
The writer's sending lane is :class:`FanoutWriter`: the ring's, plus one step.  Before
the ring publishes a record, :meth:`Fanout.prepare` readies it for the network -- a
record without slot references as it is (the same bytes); one that references the
writer's slot pool (Ext 4) rewritten once for all remote readers (:func:`to_frames`):
each Ext 4 becomes an Ext 20 (:class:`~ringwire.wire.NetRef`) naming a frame, and the
frame is the slot's own memory, which ZeroMQ sends without a copy -- and checks that
every admitted connection has credit for it.  Then the ring publishes (and rings its
parked readers), then every connection gets the record (:meth:`Fanout.send`, which
only now wraps the frames as tracked ZeroMQ frames: ~10 µs each, kept off the local
readers' path).  The slot stays held for a remote reader (its bit in the holder mask)
until its release comes back over the connection, so after ZeroMQ sent it.

Frames in flight: ZeroMQ reads a frame's slot until it has written it to the kernel.
A reader that releases a slot received it whole, so that is over; but a reader that
is dropped or lost may leave frames queued on its closed socket (ZeroMQ flushes a
closed socket for a while, :mod:`.zmqlife`).  So every frame is sent with a ZeroMQ
tracker, and the shares of a reader that went are given up
(:meth:`Fanout.when_sent`) only once every frame sent before it went is done with:
until then its rank is not handed out again, and its slots are not reused.

Bounded memory: a connection's credit window -- the broadcast's ``capacity``: the
reader asks for more, the acceptor gives it that, and :class:`RemoteJoined` tells the
reader its window -- is the writer's queue for that reader, in record bytes; arrays are
bounded by the slot pool, whose shares a slow reader keeps.  A full window makes the
send wait as a full ring does, and after ``stall_timeout``
:class:`~ringwire.ReaderStalled` names the reader's rank and host
(:meth:`Fanout.stalled`).  A remote reader slows the local ones only by that.

Records with CUDA IPC references (Ext 5) cannot reach another host:
:func:`to_frames` refuses them (``ValueError``) before anything is published.
"""

from __future__ import annotations

import contextlib
import logging
import re
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from .._errors import HandshakeError, ProtocolError, ReaderStalled, SlotRefused
from .._wire import ext as X
from .._wire.broadcast_control import RemoteJoined, decode_remote_join, encode_remote
from .._wire.descriptors import NetRef, SlotRef, decode_descriptor
from .pools import Framed
from .zmqlife import GRACE, LINGER_MS, reap

__all__ = ["Fanout", "FanoutWriter", "RemoteReader", "to_frames"]

logger = logging.getLogger("ringwire")

# an Ext 4 or Ext 5 header: fixext 1..16, ext 8/16/32 (a false match only costs a
# rewrite; an Ext 5, a CUDA IPC reference, is refused by the rewrite)
_EXT4 = re.compile(
    rb"[\xd4-\xd8][\x04\x05]|\xc7.[\x04\x05]|\xc8..[\x04\x05]|\xc9....[\x04\x05]", re.S
)
_NESTED = (X.TUPLE, X.SET, X.FROZENSET, X.TRACED)  # codes whose body is msgpack again
_enc = msgspec.msgpack.Encoder()
_SENT_PATIENCE = GRACE + LINGER_MS / 1000 + 5.0  # seconds a closed socket may hold frames
_UNPREPARED: tuple[Any, Any] = (None, None)


def _wake_when_sent(trackers: list[Any], wake: socket.socket, closing: threading.Event) -> None:
    """(A thread) Wait until ZeroMQ has let go of ``trackers``' frames -- closing the
    retired sockets whose grace is over meanwhile -- then ring ``wake``, the fanout's
    (it holds no reference to the fanout: a writer dropped meanwhile is collected)."""
    deadline = time.monotonic() + _SENT_PATIENCE
    while not all(t.done for t in trackers) and time.monotonic() < deadline:
        reap()
        if closing.wait(0.05):
            return
    with contextlib.suppress(OSError):
        wake.send(b"w")


def to_frames(payload: bytes, memory_of: Callable[[SlotRef], tuple[Any, int]]) -> bytes:
    """``payload`` as a remote reader receives it: every Ext 4 slot reference an Ext 20
    naming a frame, the frames (``memory_of(ref)``: the slot's bytes and the tag its
    release carries) on a :class:`Framed`; ``payload`` itself if it has no reference.
    Raises ``ValueError`` for a CUDA IPC reference (Ext 5)."""
    if _EXT4.search(payload) is None:
        return payload
    frames: list[Any] = []

    def hook(code: int, data: memoryview) -> Any:
        if code == X.SHM_REF:
            ref = decode_descriptor(SlotRef, data)
            buf, tag = memory_of(ref)
            net = NetRef(
                version=1,
                tag=tag,
                generation=ref.generation,
                index=len(frames),
                nbytes=ref.nbytes,
                shape=ref.shape,
                dtype=ref.dtype,
                kind=ref.kind,
            )
            frames.append(buf)
            return msgspec.msgpack.Ext(X.NET_REF, _enc.encode(net))
        if code in _NESTED:
            return msgspec.msgpack.Ext(code, _enc.encode(dec.decode(data)))
        if code == X.CUDA_REF:
            raise ValueError(
                "a CUDA IPC tensor cannot reach a broadcast reader on another host: send "
                "it as a CPU tensor (.cpu()), or broadcast it to local readers only"
            )
        return msgspec.msgpack.Ext(code, bytes(data))

    dec = msgspec.msgpack.Decoder(ext_hook=hook)
    out = _enc.encode(dec.decode(payload))
    if not frames:
        return out
    framed = Framed(out)
    framed.frames = frames
    return framed


class RemoteReader:
    """One remote reader's connection, on the writer's side."""

    __slots__ = ("t", "rank", "pid", "host", "deadline")

    def __init__(self, t: Any, deadline: float) -> None:
        self.t = t  # a NetTransport
        self.rank = -1  # until admitted
        self.pid = t.peer_pid
        self.host = t.peer_host or "?"
        self.deadline = deadline  # for its Join

    def __repr__(self) -> str:
        return f"<RemoteReader rank {self.rank} pid {self.pid} on {self.host!r}>"

    @property
    def behind(self) -> int:
        """Record bytes sent that it has not consumed (its queue)."""
        return int(self.t.tx.used())


class Fanout:
    """The writer's remote readers (see the module docstring).  ``hub`` is the
    broadcast's hub: :meth:`poll` asks it to ``admit_remote(pid, host, join)`` (the
    rank, version and start; :class:`HandshakeError` to refuse) and tells it
    ``retire_remote(reader, why, lost)``; releases go to ``release(rank, pairs)``
    (:class:`SlotRefused` for a slot the reader does not hold)."""

    def __init__(
        self,
        acceptor: Any,
        hub: Any,
        *,
        readers: int,
        window: int,
        handshake_timeout: float,
        memory_of: Callable[[SlotRef], tuple[Any, int]] | None,
        release: Callable[[int, list[tuple[int, int]]], None] | None,
    ) -> None:
        self.acceptor = acceptor
        self.hub = hub
        self.readers = readers
        self.window = window  # the credit of every connection: the ring's capacity
        self.handshake_timeout = handshake_timeout
        self.memory_of = memory_of
        self.release = release
        self.conns: dict[int, RemoteReader] = {}  # rank -> admitted
        self._txs: list[Any] = []  # the admitted connections' sending lanes (per record)
        self._by_fd: dict[int, RemoteReader] = {}  # every connection (rank -1: joining)
        self.refused = 0
        self.sent = 0  # records put on connections
        self._prepared: tuple[Any, Any] = _UNPREPARED  # (payload, what goes out)
        self._inflight: deque[list[Any]] = deque()  # trackers of the frames sent
        self._after: list[tuple[int, list[Any], Callable[[], None]]] = []  # when_sent
        self._ep = select.epoll()
        self._ep.register(acceptor.fileno(), select.EPOLLIN)
        self._wake_r, self._wake_w = socket.socketpair()  # (when_sent's thread rings it)
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._ep.register(self._wake_r.fileno(), select.EPOLLIN)
        self._closing = threading.Event()  # (stops when_sent's threads)
        self.closed = False

    def __repr__(self) -> str:
        return f"<Fanout {self.address} {len(self.conns)} readers>"

    @property
    def address(self) -> str:
        """The bound ``tcp://host:port``."""
        return str(self.acceptor.address.url)

    def fileno(self) -> int:
        """Readable while an attach, a record, a credit, a release or a hang-up waits."""
        return self._ep.fileno()

    # -- what happens on the connections ---------------------------------------------

    def poll(self) -> None:
        """Do what is pending on the rendezvous and every connection; never waits."""
        if self.closed:
            return
        ready = {fd for fd, _ in self._ep.poll(0)}
        if self._wake_r.fileno() in ready:
            with contextlib.suppress(OSError):
                self._wake_r.recv(4096)
        if self._after:
            self._run_after()
        if self.acceptor.fileno() in ready or self.acceptor.next_deadline() is not None:
            done, refusals = self.acceptor.step()
            for exc in refusals:
                self.refused += 1
                logger.warning(
                    "ringwire broadcast %s refused a remote reader: %s", self.address, exc
                )
            for t in done:
                self._adopt(t)
        now = time.monotonic()
        for fd, rr in list(self._by_fd.items()):
            if fd in ready or (rr.rank < 0 and now > rr.deadline):
                self._step(rr, now)

    def next_deadline(self) -> float | None:
        """When the earliest attach or join in progress times out (``None``: none)."""
        until = self.acceptor.next_deadline() if not self.closed else None
        for rr in self._by_fd.values():
            if rr.rank < 0 and (until is None or rr.deadline < until):
                until = rr.deadline
        return until

    def overdue(self) -> bool:
        """Is an attach or a join past its deadline (a :meth:`poll` would refuse it)?"""
        until = self.next_deadline()
        return until is not None and time.monotonic() > until

    def _adopt(self, t: Any) -> None:
        rr = RemoteReader(t, time.monotonic() + self.handshake_timeout)
        fd = t.fileno()
        self._by_fd[fd] = rr
        self._ep.register(fd, select.EPOLLIN)
        self._step(rr, time.monotonic())  # its Join may be there already

    def _step(self, rr: RemoteReader, now: float) -> None:
        t = rr.t
        try:
            gone = t.drain()
        except ProtocolError as exc:
            self._lose(rr, f"broke the protocol: {exc}")
            return
        if rr.rank < 0:
            self._step_join(rr, gone, now)
            return
        if t.releases and self.release is not None:
            pairs = list(t.releases)
            t.releases.clear()
            try:
                self.release(rr.rank, pairs)
            except SlotRefused as exc:
                self._lose(rr, f"released a slot it did not hold: {exc}")
                return
        if t.rx.available():
            self._lose(rr, "sent a record (a broadcast reader sends none after its join)")
            return
        if gone:
            if t.tx.reader_closed_flag and t.peer_reason is None:
                self._forget(rr)
                self.hub.retire_remote(rr, "left", False)
            elif t.peer_reason is not None:
                self._lose(rr, f"dropped the broadcast: {t.peer_reason}", gone=True)
            else:
                why = "lost its connection (the process died, or the network failed: no heartbeat)"
                self._lose(rr, why, gone=True)

    def _step_join(self, rr: RemoteReader, gone: bool, now: float) -> None:
        t = rr.t
        view = t.rx.next_frame()
        if view is None:
            if gone:
                self._forget(rr)
            elif now > rr.deadline:
                self._refuse(rr, f"did not join within {self.handshake_timeout} s")
            return
        try:
            data = bytes(view)
            view.release()
            t.rx.commit()
            join = decode_remote_join(data, self.readers)
            if t.tx.capacity < self.window:
                raise HandshakeError(
                    f"its lane of {t.tx.capacity} bytes is smaller than this broadcast's "
                    f"{self.window}: records up to half of that must fit"
                )
            version, rank, start = self.hub.admit_remote(rr.pid, rr.host, join)
        except HandshakeError as exc:
            self._refuse(rr, str(exc))
            return
        rr.rank = rank
        self.conns[rank] = rr
        self._txs = [c.t.tx for c in self.conns.values()]
        answer = RemoteJoined(
            version=version,
            pid=self.hub.pid,
            rank=rank,
            start=start,
            readers=self.readers,
            window=t.tx.capacity,
        )
        t.tx.try_write(encode_remote(answer))  # (a fresh window: it fits)

    def _refuse(self, rr: RemoteReader, reason: str) -> None:
        self.refused += 1
        logger.warning(
            "ringwire broadcast %s refused pid %s on %r: %s", self.address, rr.pid, rr.host, reason
        )
        rr.t.abort(reason[:1000])
        self._forget(rr)

    def _lose(self, rr: RemoteReader, why: str, *, gone: bool = False) -> None:
        """``rr`` is lost: told ``why`` (unless ``gone``: then what is queued for it is
        dropped at once, nobody reads it), closed, reported."""
        if rr.rank < 0:
            self._refuse(rr, why)
            return
        if not gone:
            rr.t.abort(why[:1000])
        self._forget(rr, discard=gone)
        self.hub.retire_remote(rr, why, True)

    def _forget(self, rr: RemoteReader, *, discard: bool = False) -> None:
        """Close ``rr``'s connection (``discard``: dropping what is queued) and stop
        watching it."""
        fd = rr.t.fileno()
        self._by_fd.pop(fd, None)
        if rr.rank >= 0 and self.conns.get(rr.rank) is rr:
            del self.conns[rr.rank]
            self._txs = [c.t.tx for c in self.conns.values()]
        try:
            self._ep.unregister(fd)
        except (OSError, ValueError):
            pass
        rr.t.close(discard=discard)

    def drop(self, rank: int, why: str) -> RemoteReader | None:
        """The writer drops ``rank``: tell it ``why``, close; the reader, or ``None``."""
        rr = self.conns.get(rank)
        if rr is None:
            return None
        rr.t.abort(why[:1000])
        self._forget(rr)
        return rr

    def when_sent(self, rank: int, fn: Callable[[], None]) -> None:
        """Call ``fn`` once ZeroMQ is done with every frame sent so far (at once if it
        is; else from a later :meth:`poll`, which a thread wakes); meanwhile ``rank``
        is :meth:`held`."""
        inflight = self._inflight
        while inflight and all(t.done for t in inflight[0]):
            inflight.popleft()
        pending = [t for trackers in inflight for t in trackers if not t.done]
        if not pending:
            fn()
            return
        self._after.append((rank, pending, fn))
        threading.Thread(
            target=_wake_when_sent,
            args=(pending, self._wake_w, self._closing),
            name="ringwire-fanout-sent",
            daemon=True,
        ).start()

    def _run_after(self) -> None:
        keep = []
        for rank, pending, fn in self._after:
            if all(t.done for t in pending):
                fn()
            else:
                keep.append((rank, pending, fn))
        self._after = keep

    def held(self, rank: int) -> bool:
        """Is ``rank`` admitted, or waiting for the frames sent to its last reader?"""
        return rank in self.conns or any(r == rank for r, _, _ in self._after)

    def fail(self, reason: str) -> None:
        """The broadcast failed: tell every remote reader ``reason``, close them all."""
        for rr in list(self._by_fd.values()):
            rr.t.abort(reason[:1000])
            self._forget(rr)

    # -- forwarding --------------------------------------------------------------------

    def prepare(self, payload: bytes) -> Any:
        """What goes out for ``payload`` (see :func:`to_frames`; the last one is kept,
        for a send that waits and tries again), or ``None`` if a connection has no
        credit for it now."""
        if not self._txs:
            return payload  # no remote reader now: nothing to ready, nobody to wait for
        last, out = self._prepared
        if last is not payload:
            # (wrapping the frames as tracked ZeroMQ frames, ~10 µs each, waits for
            # send(): after the ring has published and rung the local readers)
            out = payload if self.memory_of is None else to_frames(payload, self.memory_of)
            self._prepared = (payload, out)
        n = len(out)
        for tx in self._txs:
            if not tx.fits_now(n):
                return None
        return out

    def fits_now(self, n: int) -> bool:
        """Has every admitted connection credit for an ``n``-byte record?"""
        for tx in self._txs:
            if not tx.fits_now(n):
                return False
        return True

    def send(self, out: Any) -> None:
        """Put the record ``prepare`` returned on every admitted connection."""
        self._prepared = _UNPREPARED
        txs = self._txs
        frames = None  # (plain bytes carry none; with no reader, none is made)
        if txs and type(out) is not bytes and getattr(out, "frames", None):
            frames = out.frames = [zmq.Frame(f, track=True) for f in out.frames]  # tracked
        for tx in txs:
            tx.try_write(out)
        self.sent += 1
        if frames:
            inflight = self._inflight
            inflight.append([f.tracker for f in frames])
            while len(inflight) > 64 and all(t.done for t in inflight[0]):
                inflight.popleft()

    def stalled(self, size: int, waited: float) -> ReaderStalled | None:
        """The error naming the remote readers without credit for ``size`` bytes after
        ``waited`` seconds, or ``None`` if none is short of it."""
        slow = [rr for rr in self.conns.values() if not rr.t.tx.fits_now(size)]
        if not slow:
            return None
        who = ", ".join(
            f"rank {rr.rank} (pid {rr.pid} on {rr.host!r}, {rr.behind} bytes not consumed of "
            f"its {rr.t.tx.capacity}-byte window)"
            for rr in slow
        )
        return ReaderStalled(
            f"broadcast at {self.address}: no room for a {size}-byte record after "
            f"{waited:.3g} s: waiting for remote {who}; drop_reader() them, or give them "
            "more time",
            tuple(rr.rank for rr in slow),
            tuple(rr.pid for rr in slow),
        )

    # -- closing -----------------------------------------------------------------------

    def close(self) -> None:
        """End every stream (the readers receive what was sent, then ``EndOfStream``),
        close the connections and the rendezvous."""
        if self.closed:
            return
        self.closed = True
        self._closing.set()
        for rr in list(self._by_fd.values()):
            if rr.rank >= 0:
                rr.t.tx.close()  # E: after every record sent
            self._forget(rr)
        self.acceptor.close()
        self._ep.close()
        self._wake_r.close()
        self._wake_w.close()


class FanoutWriter:
    """The writer's sending lane with remote readers: the ring's
    (:class:`~ringwire._wire.broadcast_ring.BroadcastWriter`) and, for each record it
    publishes, :meth:`Fanout.send` (see "Forwarding")."""

    def __init__(self, ring: Any, fanout: Fanout, doorbell: Callable[[], Any]) -> None:
        self.ring = ring
        self.fanout = fanout
        self._doorbell = doorbell
        self.capacity = ring.capacity
        self.max_payload = ring.max_payload
        # bound once: try_write runs once per record
        self._prepare = fanout.prepare
        self._ring_write = ring.try_write
        self._needs_doorbell = ring.reader_needs_doorbell
        self._fan_send = fanout.send

    def check_size(self, n: int) -> None:
        self.ring.check_size(n)

    def fits_now(self, n: int) -> bool:
        return bool(self.ring.fits_now(n)) and self.fanout.fits_now(n)

    def try_write(self, payload: Any) -> bool:
        out = self._prepare(payload)
        if out is None or not self._ring_write(payload):
            return False
        if self._needs_doorbell():
            self._doorbell()  # the local readers first
        self._fan_send(out)
        return True

    def write_many(self, payloads: Any, start: int = 0) -> tuple[int, int]:
        n = nbytes = 0
        for i in range(start, len(payloads)):
            if i == start and len(payloads[i]) > self.max_payload:
                self.check_size(len(payloads[i]))
            if not self.try_write(payloads[i]):
                break
            n += 1
            nbytes += len(payloads[i])
        return n, nbytes

    def used(self) -> int:
        return int(self.ring.used())

    @property
    def reader_closed(self) -> bool:
        return False

    def reader_needs_doorbell(self) -> bool:
        return False  # try_write rang them

    def reader_wants_doorbell_for_close(self) -> bool:
        return bool(self.ring.reader_wants_doorbell_for_close())

    def park(self) -> None:
        self.ring.park()

    def unpark(self) -> None:
        self.ring.unpark()

    def close(self) -> None:
        self.ring.close()

    def release(self) -> None:
        self.ring.release()
