"""This process's TCP status table (layout: :mod:`ringwire._wire.netstatus`).

The first TCP connection of a process creates a small shared-memory segment and
unlinks its name at once -- a mapping only, like a live connection's rings: nothing
can be left in ``/dev/shm``, whatever kills the process -- and every connection takes
a slot of it for its lifetime (another segment when one is full).  The transport
keeps its slot current with plain stores into a ``memoryview`` of the mapping: the
bytes sent at every send, the rest (credit, inbox, arrays out, when the peer was last
heard) each time it receives; no system call, no lock.  ``python -m ringwire
inspect`` reads the table through ``/proc/<pid>/mem``.

Where shared memory cannot be had (no ``/dev/shm``, out of space) connections get a
:class:`Slot` that writes nowhere: inspect does not see them, nothing else changes.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from .._errors import RingwireError
from .._pool.segment import Segment
from .._wire import netstatus as N

__all__ = ["Slot", "open_slot"]

_W = {name: N.word(name) for name in N.WORDS}
_STRINGS = N.string_offsets()
_HEARD, _SENT, _ACKED = _W["heard_ns"], _W["sent"], _W["acked"]
_CONSUMED, _INBOX_BYTES, _INBOX_RECORDS = _W["consumed"], _W["inbox_bytes"], _W["inbox_records"]
_ARRAYS_OUT = _W["array_bytes_out"]


class _Table:
    """One status segment of this process."""

    def __init__(self) -> None:
        seg = Segment.create(N.SEGMENT_SIZE)
        seg.unlink()  # a mapping only from now on (a memory file: no name to unlink)
        seg.close_fd()
        self.seg = seg
        self.pid = os.getpid()
        self.cells = memoryview(seg.buf).cast("Q")
        N.HEADER.pack_into(seg.buf, 0, N.MAGIC + b"\0\0", N.VERSION, N.NSLOTS, os.getpid())
        self.free = list(range(N.NSLOTS - 1, -1, -1))


_lock = threading.Lock()
_tables: list[_Table] = []
_pid = 0
_broken = False  # no shared memory here: slots write nowhere


def _take() -> tuple[_Table, int] | None:
    global _pid, _broken
    with _lock:
        if _pid != os.getpid():  # a forked child: the parent's tables are the parent's
            _tables.clear()
            _pid, _broken = os.getpid(), False
        if _broken:
            return None
        for table in _tables:
            if table.free:
                return table, table.free.pop()
        try:
            table = _Table()
        except (OSError, RingwireError):
            _broken = True
            return None
        _tables.append(table)
        return table, table.free.pop()


class Slot:
    """One connection's row of the table (see the module docstring)."""

    __slots__ = ("cells", "base", "sent_at", "_table", "_index")

    def __init__(self, taken: tuple[_Table, int] | None) -> None:
        if taken is None:
            self.cells: Any = [0] * len(N.WORDS)  # writes go nowhere
            self.base = 0
            self._table: _Table | None = None
            self._index = 0
        else:
            table, index = taken
            self._table, self._index = table, index
            self.cells = table.cells
            self.base = (N.HEADER_SIZE + index * N.SLOT_SIZE) // 8
        self.sent_at = self.base + _W["sent"]  # the transport stores tx.sent here per send

    def set(self, **words: int) -> None:
        cells, base = self.cells, self.base
        for name, value in words.items():
            cells[base + _W[name]] = value

    def string(self, name: str, text: str) -> None:
        if self._table is None:
            return
        off, n = _STRINGS[name]
        raw = text.encode("utf-8", "replace")[: n - 1].ljust(n, b"\0")
        start = N.HEADER_SIZE + self._index * N.SLOT_SIZE + off
        self._table.seg.buf[start : start + n] = raw

    def heard(self, t: Any) -> None:
        """Messages arrived from the peer: the time, the credit, the inbox, arrays out."""
        cells, base, rx, tx = self.cells, self.base, t.rx, t.tx
        cells[base + _HEARD] = time.monotonic_ns()
        cells[base + _SENT] = tx.sent
        cells[base + _ACKED] = tx.acked
        cells[base + _CONSUMED] = rx.consumed
        cells[base + _INBOX_BYTES] = rx.inbox_bytes
        cells[base + _INBOX_RECORDS] = len(rx.inbox)
        pool = t.send_pool
        cells[base + _ARRAYS_OUT] = pool.in_use if pool is not None else 0
        if t.gone:
            cells[base] = N.GONE

    def gone(self) -> None:
        """The peer hung up (the connection is not closed yet)."""
        self.cells[self.base] = N.GONE

    def endpoints(self, fd: int) -> None:
        """The TCP connection's two addresses, from its descriptor (libzmq's; a dup of
        it is asked, never the descriptor itself)."""
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            return
        try:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                return  # (libzmq closed it, and the number now names another socket)
            peer, local = s.getpeername(), s.getsockname()
        except OSError:
            return
        finally:
            s.close()
        self.string("peer", _hostport(peer))
        self.string("local", _hostport(local))

    def close(self) -> None:
        """The connection is closed: the slot is free again."""
        table, self._table = self._table, None
        if table is None or table.pid != os.getpid():
            return  # (a forked child closing its copy: the row is the parent's)
        self.cells[self.base] = N.FREE
        self.cells = [0] * len(N.WORDS)  # a late store goes nowhere
        self.base = 0
        self.sent_at = _W["sent"]
        with _lock:
            if table in _tables:
                table.free.append(self._index)


def _hostport(addr: Any) -> str:
    if not isinstance(addr, tuple) or len(addr) < 2:
        return ""
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def open_slot(t: Any, sock: Any, peer_fd: int | None) -> Slot:
    """A slot for transport ``t`` (a :class:`~ringwire._net.transport.NetTransport`
    being made, on ZeroMQ socket ``sock``; ``peer_fd``: the accepting side's TCP
    descriptor), filled with what is known now."""
    import zmq

    slot = Slot(_take())
    now = time.monotonic_ns()
    cells, base = slot.cells, slot.base
    cells[base + _W["generation"]] += 1
    pool = t.send_pool
    try:
        heartbeat_ms = int(sock.getsockopt(zmq.HEARTBEAT_TIMEOUT))
    except zmq.ZMQError:
        heartbeat_ms = 0
    slot.set(
        opened_ns=now,
        heard_ns=now,
        heartbeat_ms=max(0, heartbeat_ms),
        send_capacity=t.tx.capacity,
        sent=0,
        acked=0,
        receive_capacity=t.rx.capacity,
        consumed=0,
        inbox_bytes=0,
        inbox_records=0,
        array_budget=pool.budget if pool is not None else 0,
        array_bytes_out=0,
        peer_pid=max(0, int(t.peer_pid or 0)),
        server=int(peer_fd is not None),
    )
    slot.string("address", t.address)
    slot.string("peer", "")
    slot.string("local", "")
    if peer_fd is not None:
        slot.endpoints(peer_fd)
    cells[base] = N.OPEN  # last: the slot is whole
    return slot
