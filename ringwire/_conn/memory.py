"""An in-memory transport: both ends of a connection in one process, no I/O at all.

:func:`memory_pair` returns two :class:`MemoryTransport` s joined back to back.  A
lane is a list of frames (bytes objects) with the same flags as a ring lane -- closed,
parked, a park sequence number -- and a doorbell is a byte appended to the peer's
inbox.  Nothing here has a file descriptor, so no driver can wait on it: a test drives
the :class:`~ringwire._conn.endpoint.Endpoint` and the loops of
:mod:`ringwire._conn.waits` by hand, bytes in and events out (the h11 way), and sees
exactly what each step would wait for.  It is also the smallest complete
implementation of :class:`~ringwire._conn.transport.Transport`: a new transport
starts by passing the same tests.  It lends no slot pools; arrays travel inline.
"""

from __future__ import annotations

import io
import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import FrameTooLarge
from .._wire.codec import Encoder
from .._wire.control import PROTOCOL_VERSION, ControlReader, encode_abort

__all__ = ["MemoryReader", "MemoryTransport", "MemoryWriter", "memory_pair"]


class _Lane:
    """One direction of a connection: what a ring lane's header and data area hold."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.frames: deque[bytes] = deque()
        self.used = 0  # bytes of the frames published and not committed
        self.writer_closed = False
        self.reader_closed = False
        self.reader_parked = 0  # 0, or the reader's park sequence number
        self.writer_parked = 0


class MemoryWriter:
    """The sending end of a memory lane (see :class:`~ringwire._conn.transport.FrameWriter`)."""

    def __init__(self, lane: _Lane) -> None:
        self._lane = lane
        self.capacity = lane.capacity
        self.max_payload = lane.capacity // 2 - 4  # as a ring lane of that capacity
        self._seq = 0
        self._rung = 0

    def check_size(self, n: int) -> None:
        if n > self.max_payload:
            raise FrameTooLarge(
                f"a {n}-byte record does not fit a lane of {self.capacity} bytes (at most "
                f"{self.max_payload} bytes per record)"
            )

    def fits_now(self, n: int) -> bool:
        return self._lane.used + n <= self.capacity

    def try_write(self, payload: Any) -> bool | None:
        if self._lane.reader_closed:
            return None
        n = len(payload)
        if n > self.max_payload:
            self.check_size(n)
        if not self.fits_now(n):
            return False
        self._lane.frames.append(bytes(payload))
        self._lane.used += n
        return True

    def write_many(self, payloads: Sequence[Any], start: int = 0) -> tuple[int, int]:
        count = nbytes = 0
        for i in range(start, len(payloads)):
            n = len(payloads[i])
            if n > self.max_payload and count:
                break
            if not self.try_write(payloads[i]):
                break
            count += 1
            nbytes += n
        return count, nbytes

    def used(self) -> int:
        return self._lane.used

    @property
    def reader_closed(self) -> bool:
        return self._lane.reader_closed

    def reader_needs_doorbell(self) -> bool:
        seq = self._lane.reader_parked
        if seq and seq != self._rung:
            self._rung = seq
            return True
        return False

    def reader_wants_doorbell_for_close(self) -> bool:
        return self._lane.reader_parked != 0

    def park(self) -> None:
        self._seq += 1
        self._lane.writer_parked = self._seq

    def unpark(self) -> None:
        self._lane.writer_parked = 0

    def close(self) -> None:
        self._lane.writer_closed = True

    def release(self) -> None:
        pass


class MemoryReader:
    """The receiving end of a memory lane (see :class:`~ringwire._conn.transport.FrameReader`)."""

    read_many_on_error = False

    def __init__(self, lane: _Lane) -> None:
        self._lane = lane
        self.capacity = lane.capacity
        self._taken = 0  # frames handed out and not committed
        self._seq = 0
        self._rung = 0

    @property
    def pending(self) -> bool:
        return self._taken > 0

    def next_frame(self) -> memoryview | None:
        frames = self._lane.frames
        if self._taken >= len(frames):
            return None
        view = memoryview(frames[self._taken])
        self._taken += 1
        return view

    def read_many(self, fn: Callable[[memoryview], Any], max_n: int, out: list[Any]) -> int:
        nbytes = k = 0
        while k < max_n:
            view = self.next_frame()
            if view is None:
                break
            try:
                obj = fn(view)
            except Exception:
                if k:
                    self._taken -= 1  # the batch ends before it: unread
                    break
                raise  # the first frame: it counts as read
            finally:
                view.release()
            out.append(obj)
            nbytes += len(self._lane.frames[self._taken - 1])
            k += 1
        return nbytes

    def commit(self) -> None:
        lane = self._lane
        for _ in range(self._taken):
            lane.used -= len(lane.frames.popleft())
        self._taken = 0

    def available(self) -> bool:
        return self._taken < len(self._lane.frames)

    def fill(self) -> int:
        return self._lane.used

    @property
    def writer_closed(self) -> bool:
        return self._lane.writer_closed

    def writer_needs_doorbell(self) -> bool:
        seq = self._lane.writer_parked
        if seq and seq != self._rung:
            self._rung = seq
            return True
        return False

    def park(self) -> None:
        self._seq += 1
        self._lane.reader_parked = self._seq

    def unpark(self) -> None:
        self._lane.reader_parked = 0

    def close(self) -> None:
        self._lane.reader_closed = True

    def release(self) -> None:
        pass


class MemoryTransport:
    """One end of an in-memory connection (see the module docstring)."""

    send_pool = None
    recv_pool = None

    def __init__(self, tx: _Lane, rx: _Lane) -> None:
        self.tx = MemoryWriter(tx)
        self.rx = MemoryReader(rx)
        self.encoder = Encoder()
        self.tensor_path, self.nixl_off = "inline", ""  # no pools: every array inline
        self.peer_pid = os.getpid()
        self.version = PROTOCOL_VERSION
        self.doorbells_sent = self.doorbells_received = 0
        self.inbox = bytearray()  # doorbell bytes the peer rang, not yet drained
        self.peer: MemoryTransport | None = None
        self.gone = False  # this end shut down (the peer sees the hang-up)
        self._control = ControlReader()

    def fileno(self) -> int:
        raise io.UnsupportedOperation(
            "a MemoryTransport has no descriptor: drive its Endpoint directly"
        )

    def ring(self, byte: bytes) -> bool:
        peer = self.peer
        if self.gone or peer is None or peer.gone:
            return False
        peer.inbox += byte
        self.doorbells_sent += 1
        return True

    def drain(self) -> bool:
        data, self.inbox[:] = bytes(self.inbox), b""
        self.doorbells_received += self._control.feed(data)
        return self._control.reason is not None or self.hung_up()

    @property
    def peer_reason(self) -> str | None:
        return self._control.reason

    def abort(self, reason: str) -> None:
        peer = self.peer
        if not self.gone and peer is not None and not peer.gone:
            peer.inbox += encode_abort(reason)

    def hung_up(self) -> bool:
        return self.peer is None or self.peer.gone

    def shutdown(self) -> None:
        self.gone = True

    def close(self) -> None:
        self.gone = True


def memory_pair(capacity: int = 1 << 16) -> tuple[MemoryTransport, MemoryTransport]:
    """Two transports joined back to back, lanes of ``capacity`` bytes each way."""
    a_to_b, b_to_a = _Lane(capacity), _Lane(capacity)
    a = MemoryTransport(a_to_b, b_to_a)
    b = MemoryTransport(b_to_a, a_to_b)
    a.peer, b.peer = b, a
    return a, b
