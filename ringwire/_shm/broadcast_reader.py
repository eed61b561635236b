"""A broadcast reader's transport: joining, and the seam an endpoint reads through.

:func:`join_handshake` is the reader's side of the join of
:mod:`ringwire._wire.broadcast_control` as a generator (it yields ``("send", bytes)``
or ``("recv", None)``, answered with ``(bytes, descriptors)``; ``b""`` at end of
file), and :func:`drive_join_sync` / :func:`drive_join_async` perform it on a
non-blocking socket.  The segments arrive as descriptors (``SCM_RIGHTS``): each is
checked like :meth:`Segment.attach <ringwire._pool.segment.Segment.attach>` checks a
name (our uid, nobody else's access, the announced size), mapped, and closed; their
names were unlinked by the writer when it made them.

:class:`SubscriberTransport` is what a reader's
:class:`~ringwire._conn.endpoint.Endpoint` runs over
(:class:`ringwire._conn.transport.Transport`): its receiving lane is this reader's
cursor in the broadcast ring (:class:`~ringwire._wire.broadcast_ring.BroadcastReader`),
its sending lane is :class:`NullWriter` (a reader publishes nothing; the writer's
transport has the mirror image, :class:`NullReader`), its peer's pool
is the writer's slot pool with this reader's own release lane; doorbells, aborts and
liveness travel on its control socket exactly as on a connection's.  So receiving,
decoding, slot views and their finalizers, ``EndOfStream`` after a clean close and
``BrokenResourceError`` after the writer's death are the endpoint's own code.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import HandshakeError, RingCorrupted, RingwireError, SegmentError
from .._pool.arena import ArenaMapper
from .._pool.segment import Segment, check_descriptor
from .._pool.slotconfig import RELEASE_CAPACITY
from .._wire.broadcast_control import (
    BROADCAST_VERSIONS,
    Join,
    Joined,
    MessageReader,
    Refused,
    Started,
    encode_broadcast_message,
    validate_joined,
)
from .._wire.broadcast_ring import BroadcastReader, read_broadcast_header
from .._wire.codec import Encoder
from .._wire.control import ControlReader, SegmentSpec
from .._wire.names import is_memfd_label
from .._wire.ring import check_ring
from .._wire.slotlayout import PoolLayout, read_pool
from .recvpool import ShmRecvPool
from .sockets import (
    ControlSocketEnd,
    Step,
    drive_handshake_async,
    drive_handshake_sync,
    recv_with_fds,
)

__all__ = [
    "JoinResult",
    "NullReader",
    "NullWriter",
    "SubscriberTransport",
    "drive_join_async",
    "drive_join_sync",
    "join_handshake",
]


class _NullLane:
    """What both null lanes have: nothing to park on, close or release."""

    def park(self) -> None:
        pass

    def unpark(self) -> None:
        pass

    def close(self) -> None:
        pass

    def release(self) -> None:
        pass


class NullWriter(_NullLane):
    """A reader's sending lane: it carries nothing (every send is refused as if the
    peer had closed its end)."""

    capacity = 0
    max_payload = 0

    def check_size(self, n: int) -> None:
        raise RingwireError("a broadcast reader cannot send")

    def try_write(self, payload: Any) -> bool | None:
        return None

    def write_many(self, payloads: Sequence[Any], start: int = 0) -> tuple[int, int]:
        return 0, 0

    def fits_now(self, n: int) -> bool:
        return False

    def used(self) -> int:
        return 0

    @property
    def reader_closed(self) -> bool:
        return True

    def reader_needs_doorbell(self) -> bool:
        return False

    def reader_wants_doorbell_for_close(self) -> bool:
        return False


class NullReader(_NullLane):
    """The broadcast writer's receiving lane: it carries nothing (the writer's
    transport is send-only; its receives would find no record, ever)."""

    capacity = 0
    pending = False
    writer_closed = False
    read_many_on_error = False

    def next_frame(self) -> memoryview | None:
        return None

    def read_many(self, fn: Any, max_n: int, out: list[Any]) -> int:
        return 0

    def commit(self) -> None:
        pass

    def available(self) -> bool:
        return False

    def fill(self) -> int:
        return 0

    def writer_needs_doorbell(self) -> bool:
        return False


@dataclass
class JoinResult:
    joined: Joined
    ring: Segment
    pool: tuple[Segment, PoolLayout, ArenaMapper | None] | None
    rest: bytes  # what followed Joined on the socket (an early abort, say)


def _kind(spec: SegmentSpec) -> str:
    """A passed segment's kind: its label says (a named one's name is gone)."""
    return "memfd" if is_memfd_label(spec.name) else "named"


def _attach_fd(fd: int, spec: SegmentSpec) -> Segment:
    return Segment.from_fd(fd, spec.name, spec.size, _kind(spec))


JoinGen = Generator[Step, tuple[bytes, list[int]], JoinResult]


def join_handshake(rank: int | None) -> JoinGen:
    """The reader's side of the join (see the module docstring)."""
    want = -1 if rank is None else rank
    yield (
        "send",
        encode_broadcast_message(
            Join(versions=list(BROADCAST_VERSIONS), pid=os.getpid(), rank=want)
        ),
    )
    msgs = MessageReader()
    fds: list[int] = []
    segs: list[Segment] = []
    try:
        while True:
            msg = msgs.next()
            if msg is not None:
                break
            data, got = yield ("recv", None)
            fds.extend(got)
            if not data:
                raise HandshakeError("the writer closed the connection during the join")
            msgs.feed(data)
        if isinstance(msg, Refused):
            raise HandshakeError(f"the broadcast refused this reader: {msg.reason}")
        if not isinstance(msg, Joined):
            raise HandshakeError(f"unexpected {type(msg).__name__} from the writer")
        validate_joined(msg, len(fds))
        try:
            ring = _attach_fd(fds[0], msg.ring)
            segs.append(ring)
            if read_broadcast_header(ring.buf) != (msg.capacity, msg.readers):
                raise HandshakeError("the broadcast ring does not match what the writer announced")
            pool = None
            if msg.pool is not None:
                pseg = _attach_fd(fds[1], msg.pool)
                segs.append(pseg)
                layout = read_pool(pseg.buf)
                if msg.lane_offset < layout.total_size:
                    raise HandshakeError("the release lane overlaps the slot pool")
                check_ring(pseg.buf, msg.lane_offset, RELEASE_CAPACITY)
                mapper = None
                if msg.arena is not None:
                    check_descriptor(fds[2], msg.arena.name, msg.arena.size, _kind(msg.arena))
                    mapper = ArenaMapper(os.dup(fds[2]), msg.arena.size, layout.pool_id)
                pool = (pseg, layout, mapper)
        except (SegmentError, RingCorrupted, RingwireError, ValueError) as exc:
            if isinstance(exc, HandshakeError):
                raise
            raise HandshakeError(f"cannot attach the broadcast: {exc}") from None
        try:
            yield ("send", encode_broadcast_message(Started()))
        except BaseException:
            if pool is not None and pool[2] is not None:
                pool[2].close()
            raise
        result = JoinResult(msg, ring, pool, msgs.rest)
        segs.clear()
        return result
    finally:
        for fd in fds:
            os.close(fd)
        for seg in segs:
            seg.close()


def _recv_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    data, fds = recv_with_fds(sock, 4)  # the ring, the pool, the arena (and one too many)
    assert fds is not None  # (strict: a cut-off raised)
    return data, fds


_JOIN_CLOSED = "the writer closed the connection during the join"
_JOIN_EOF: tuple[bytes, list[int]] = (b"", [])  # (read only: the join only extends from it)


def drive_join_sync(gen: JoinGen, sock: socket.socket, deadline: float) -> JoinResult:
    """Perform :func:`join_handshake` on a non-blocking socket, by ``deadline``."""
    return drive_handshake_sync(
        gen,
        sock,
        deadline,
        recv=_recv_fds,
        eof=_JOIN_EOF,
        closed=_JOIN_CLOSED,
        timed_out="joining the broadcast timed out",
    )


async def drive_join_async(gen: JoinGen, sock: socket.socket) -> JoinResult:
    """Perform :func:`join_handshake` on a non-blocking socket (bound by the caller's
    cancel scope)."""
    return await drive_handshake_async(
        gen, sock, recv=_recv_fds, eof=_JOIN_EOF, closed=_JOIN_CLOSED
    )


class SubscriberTransport(ControlSocketEnd):
    """One reader of a broadcast (see the module docstring)."""

    def __init__(
        self, sock: socket.socket, result: JoinResult, writer_pid: int, copy_out: bool
    ) -> None:
        joined = result.joined
        self._sock = sock
        self._fd = sock.fileno()
        self._ring_seg = result.ring
        self.rank = joined.rank
        self.start = joined.start
        self.readers = joined.readers
        self.rx = BroadcastReader(result.ring.buf, joined.rank)
        if self.rx.start != joined.start:
            self.rx.release()
            raise HandshakeError("the reader table does not say what the writer announced")
        self.tx = NullWriter()
        self.peer_pid = writer_pid
        self.version = joined.version
        self.doorbells_sent = self.doorbells_received = 0
        self._control = ControlReader()
        self.encoder = Encoder()  # (a reader sends nothing; the endpoint's seam has one)
        self.tensor_path, self.nixl_off = "slots", ""
        if result.rest:
            self.doorbells_received += self._control.feed(result.rest)
        self.send_pool = None
        self.recv_pool: ShmRecvPool | None = None
        if result.pool is not None:
            seg, layout, mapper = result.pool
            self.recv_pool = ShmRecvPool(
                seg,
                layout,
                self._release_bell,
                copy_out,
                lane_offset=joined.lane_offset,
                arena=mapper,
            )

    def drain(self) -> bool:
        if self._control.reason is not None:
            return True  # the writer dropped us, or the broadcast failed
        return super().drain()

    def close(self) -> None:
        self.shutdown()
        self._sock.close()
        self.tx.release()
        self.rx.release()
        self._ring_seg.close()
