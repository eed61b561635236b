"""The shared-memory transport: two ring lanes in a segment, and a control socket.

A connection is duplex: one SPSC ring lane per direction (:mod:`ringwire._wire.ring`),
both in one shared-memory segment created by the connecting side, plus one Unix
stream socket (the *control socket*, see :mod:`ringwire._wire.control`) that carried
the handshake and now carries doorbell bytes and liveness: when a process dies the
kernel closes its socket, so the peer learns at once.  Each side may lend the other a
tensor-slot pool (:mod:`ringwire._shm.sendpool`, :mod:`ringwire._shm.recvpool`).

:class:`ShmTransport` is what :func:`ringwire._shm.handshake.finish` builds once the
handshake succeeded; it implements :class:`ringwire._conn.transport.Transport`.
"""

from __future__ import annotations

import socket

from .._wire.control import DOORBELL_SPACE, ControlReader, encode_abort
from .._wire.lanes import RingReader, RingWriter
from .._wire.slotlayout import PoolLayout
from .recvpool import RecvPool
from .segment import Segment
from .sendpool import SendPool
from .slotconfig import SlotConfig
from .sockets import hung_up

__all__ = ["ShmTransport"]

_MAX_RECORD_SLACK = 1024  # bytes of a record's frame left for what is not array data


class ShmTransport:
    """One end of a shared-memory connection (see the module docstring)."""

    def __init__(
        self,
        sock: socket.socket,
        segments: list[Segment],
        tx: tuple[int, int],
        rx: tuple[int, int],
        peer_pid: int,
        version: int,
        own_pool: tuple[Segment, PoolLayout, SlotConfig] | None = None,
        peer_pool: tuple[Segment, PoolLayout] | None = None,
    ) -> None:
        """``tx`` / ``rx``: (segment index, offset) of the lane this end writes / reads;
        ``own_pool``: the pool this end lends the peer; ``peer_pool``: the peer's."""
        self._sock = sock
        self._fd = sock.fileno()
        self._segments = segments
        self.tx = RingWriter(segments[tx[0]].buf, tx[1])
        self.rx = RingReader(segments[rx[0]].buf, rx[1])
        self.peer_pid = peer_pid
        self.version = version
        self.doorbells_sent = self.doorbells_received = 0
        self._control = ControlReader()
        self.send_pool: SendPool | None = None
        self.recv_pool: RecvPool | None = None
        if own_pool is not None:
            seg, layout, config = own_pool
            self.send_pool = SendPool(seg, layout, config, self.tx.max_payload - _MAX_RECORD_SLACK)
        if peer_pool is not None:
            seg, layout = peer_pool
            copy = own_pool[2].copy_out if own_pool is not None else False
            self.recv_pool = RecvPool(seg, layout, self._release_bell, copy)

    def _release_bell(self) -> None:
        # the release sink's doorbell: a finalizer may run it, so it never blocks
        self._sock.send(DOORBELL_SPACE)

    def fileno(self) -> int:
        return self._fd

    def ring(self, byte: bytes) -> bool:
        try:
            self._sock.send(byte)
            self.doorbells_sent += 1
        except BlockingIOError:
            pass  # the buffer holds unread doorbells: the peer will wake anyway
        except OSError:
            return False
        return True

    def drain(self) -> bool:
        sock = self._sock
        while True:
            try:
                data = sock.recv(512)
            except BlockingIOError:
                return False
            except InterruptedError:
                continue
            except OSError:
                return True
            if not data:
                return True
            self.doorbells_received += self._control.feed(data)
            if self._control.reason is not None:
                return True  # the peer dropped the connection (it closes right after)
            if len(data) < 512:
                return False

    @property
    def peer_reason(self) -> str | None:
        return self._control.reason

    def abort(self, reason: str) -> None:
        try:
            self._sock.send(encode_abort(reason))
        except OSError:
            pass  # a full socket (the peer stopped reading) or a gone peer

    def hung_up(self) -> bool:
        # POLLRDHUP is seen even behind unread doorbell bytes (they stay for the
        # waiters they belong to)
        return hung_up(self._sock)

    def shutdown(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.shutdown()
        self._sock.close()
        self.tx.release()
        self.rx.release()
        for seg in self._segments:
            seg.unlink()
            seg.close()
