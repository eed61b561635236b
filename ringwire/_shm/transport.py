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

from .._pool.arena import ArenaFile, ArenaMapper
from .._pool.segment import Segment
from .._pool.slotconfig import SlotConfig
from .._wire.codec import Encoder
from .._wire.control import ControlReader
from .._wire.lanes import RingReader, RingWriter
from .._wire.slotlayout import PoolLayout
from .recvpool import ShmRecvPool
from .sendpool import ShmSendPool
from .sockets import ControlSocketEnd

__all__ = ["OwnPool", "PeerPool", "ShmTransport"]

OwnPool = tuple[Segment, PoolLayout, SlotConfig, "ArenaFile | None"]
"""The send pool one side lends: its segment, layout, configuration, arena."""
PeerPool = tuple[Segment, PoolLayout, "ArenaMapper | None"]
"""The peer's send pool as this side maps it: segment, layout, arena."""

_MAX_RECORD_SLACK = 1024  # bytes of a record's frame left for what is not array data


class ShmTransport(ControlSocketEnd):
    """One end of a shared-memory connection (see the module docstring)."""

    def __init__(
        self,
        sock: socket.socket,
        segments: list[Segment],
        tx: tuple[int, int],
        rx: tuple[int, int],
        peer_pid: int,
        version: int,
        own_pool: OwnPool | None = None,
        peer_pool: PeerPool | None = None,
    ) -> None:
        """``tx`` / ``rx``: (segment index, offset) of the lane this end writes / reads;
        ``own_pool``: the pool (and arena) this end lends the peer; ``peer_pool``: the
        peer's."""
        self._sock = sock
        self._fd = sock.fileno()
        self._segments = segments
        self.tx = RingWriter(segments[tx[0]].buf, tx[1])
        self.rx = RingReader(segments[rx[0]].buf, rx[1])
        self.peer_pid = peer_pid
        self.version = version
        self.doorbells_sent = self.doorbells_received = 0
        self._control = ControlReader()
        self.encoder = Encoder()
        self.tensor_path, self.nixl_off = "slots", ""
        self.send_pool: ShmSendPool | None = None
        self.recv_pool: ShmRecvPool | None = None
        if own_pool is not None:
            seg, layout, config, arena = own_pool
            max_inline = self.tx.max_payload - _MAX_RECORD_SLACK
            self.send_pool = ShmSendPool(seg, layout, config, max_inline, arena)
        if peer_pool is not None:
            seg, layout, mapper = peer_pool
            # (copy_out is the receiving endpoint's option: whoever makes the endpoint
            # sets recv_pool.copy_out before the first record, see _conn/connect.py)
            self.recv_pool = ShmRecvPool(seg, layout, self._release_bell, False, arena=mapper)

    def close(self) -> None:
        self.shutdown()
        self._sock.close()
        self.tx.release()
        self.rx.release()
        for seg in self._segments:
            seg.unlink()
            seg.close()
