"""Broadcast ring arithmetic over any writable buffer: one writer, N readers; no OS.

A *broadcast ring* carries variable-length frames from one writer to up to ``n``
readers, each with its own cursor.  It is a ring lane of :mod:`ringwire._wire.ring`
-- the same header, the same data area, the same frames, the same fences -- followed
by a *reader table*: one entry per reader, holding that reader's head, parked and
closed flags.  It lives in ``broadcast_ring_size(capacity, n)`` bytes of any writable
buffer (an ``mmap`` in production, a ``bytearray`` in the unit tests)::

    offset          size  written by  meaning
    ------          ----  ----------  -----------------------------------------------
         0             8  creator     magic b"RWRING" + u16 version   (ring.py's lane header)
         8             8  creator     capacity of the data area (a power of two)
        16             8  creator     broadcast magic b"RWBCST" + u16 layout version
        24             8  creator     n: entries in the reader table
        32             8  creator     offset of the reader table (512 + capacity)
        64             8  writer      tail: bytes ever published (u64, never wraps)
       128             8  writer      horizon: the slowest live reader's head, as the
                                      writer last computed it (see "Space" below)
       192             8  -           (a lane's reader-parked flag: unused, 0)
       256             8  writer      writer-parked: 0, or the writer's park sequence number
       320             8  writer      writer-closed: 1 once the writer will publish no more
       384             8  -           (a lane's reader-closed flag: unused, 0)
       512           cap  writer      data area: ring.py's frames, unchanged
    512 + cap    256 * n              reader table; entry r at 512 + cap + 256 * r:
      +0               8  writer        state: 0 (free) or the pid of the reader admitted
      +8               8  writer        start: the tail when that reader was admitted
      +16              8  writer        admissions of this entry so far (an epoch)
      +64              8  reader r      head: bytes reader r has consumed
      +128             8  reader r      parked: 0, or reader r's park sequence number
      +192             8  reader r      closed: 1 once reader r will consume no more

As in ring.py every word another process stores to sits on a cache line of its own
(each entry is four lines: the writer's, then one per reader-written word), all
integers are native u64s, and every store is one aligned 8-byte store.

Frames and sizes are ring.py's: ``[u32 length][payload]`` padded to 8 bytes, the wrap
marker, at most ``capacity // 2 - 4`` bytes per frame.  There is no chunk size: any
record up to half the ring travels inline, larger arrays go in tensor slots.

Space
-----
Which readers are *live* is the writer's private knowledge (it holds one control
socket per reader and learns of a death from its end of file, see
:mod:`ringwire._shm.broadcast`); it writes each live reader's pid into its entry for
tools only.  The writer may reuse the bytes every live reader has consumed::

    free = capacity - (tail - min(head[r] for r in live))     (all of it if none is live)

It trusts a reader's head only between the head it saw last and the tail; a head out
of that range marks the reader *faulty* (:attr:`BroadcastWriter.faulty`): it stops
counting at once and the caller drops it.  A reader admitted later starts at the
current tail (:meth:`BroadcastWriter.admit`): it holds back no space it will not read.

The *horizon* word is the minimum the writer last computed.  It is stored -- and, on
weak-order machines, fenced -- *before* the writer writes into the space it freed,
so a reader that is no longer live (the writer dropped it) can tell whether what it
just read may have been overwritten: data loads, fence, load the horizon; a horizon
above the reader's committed head means "lapped" (:meth:`BroadcastReader.commit`
raises :class:`RingCorrupted` instead of handing the space back).  This is the
message-passing pattern: the writer stores horizon then data, the reader loads data
then horizon, with a barrier on each side; a reader that saw overwritten data sees
the new horizon too.  A live reader's head is never below the horizon, so it never
trips the check.

Memory ordering
---------------
Pairwise, exactly ring.py's argument: between the writer and each reader, publishing
is "payload, fence, tail" and consuming "tail, fence, payload, fence, head"; the
writer's reuse of space is ordered after its loads of the heads by the control
dependency (it branches on the minimum before storing).  On x86-64 the same fences
are compiled out (:data:`~ringwire._wire.ring.WEAK_ORDER`), the horizon's and the
eventcount's store-then-load fences are always executed.

Eventcount
----------
Ring.py's Dekker pattern, once per reader:

    reader r: store parked[r] = seq;  fence;  load tail        (then wait, or read)
    writer:   store tail;             fence;  load parked[r] for every live r

so the writer's one fence after a publish covers every reader, and it rings each
reader whose park it has not rung yet (:meth:`BroadcastWriter.reader_needs_doorbell`
lists them in :attr:`~BroadcastWriter.to_ring`).  A writer facing a full ring parks
on its own flag; every reader, after it moves its head, fences, loads the
writer-parked word and rings if that park was not rung by it yet (each reader keeps
its own memory of the park it rang for; a spurious doorbell is harmless).

Everything here is arithmetic over a buffer; the sockets and segments are in
:mod:`ringwire._shm.broadcast`, the writer's endpoint in :mod:`ringwire._conn.broadcast`,
and the waiting in the channels' loops (:mod:`ringwire._conn.waits`): to them
:class:`BroadcastWriter` is a lane writer like any other, plus ``live``,
:meth:`~BroadcastWriter.laggards` (who a stalled writer waits for) and ``faulty``.
"""

from __future__ import annotations

import struct
from typing import Any

from .._errors import RingCorrupted
from .ring import (
    HEADER_SIZE,
    HEADER_WORDS,
    TAIL,
    WEAK_ORDER,
    RingReader,
    RingWriter,
    fence,
    init_ring,
    validate_capacity,
)

__all__ = [
    "BROADCAST_WORDS",
    "ENTRY_SIZE",
    "ENTRY_WORDS",
    "MAX_READERS",
    "BroadcastReader",
    "BroadcastWriter",
    "broadcast_ring_size",
    "init_broadcast_ring",
    "read_broadcast_header",
    "table_offset",
]

LAYOUT_VERSION = 1
MAX_READERS = 256
ENTRY_SIZE = 256

_HEAD = HEADER_WORDS["head"]  # the horizon, in a broadcast ring
_BMAGIC, _NREADERS, _TABLE = 2, 3, 4  # words of the creator's line after ring.py's two
_BMAGIC_WORD = struct.unpack("=Q", b"RWBCST" + struct.pack("<H", LAYOUT_VERSION))[0]

# u64 word indices inside one reader entry
E_STATE, E_START, E_JOINS, E_HEAD, E_PARKED, E_CLOSED = 0, 1, 2, 8, 16, 24
ENTRY_WORDS = {
    "state": E_STATE,
    "start": E_START,
    "admissions": E_JOINS,
    "head": E_HEAD,
    "parked": E_PARKED,
    "closed": E_CLOSED,
}
"""One reader entry as a table: field -> index of its u64 word in the entry."""

BROADCAST_WORDS = {
    **HEADER_WORDS,
    "horizon": _HEAD,
    "broadcast_magic": _BMAGIC,
    "readers": _NREADERS,
    "table_offset": _TABLE,
}
"""The broadcast ring's header as a table (the drawing above): field -> u64 word."""

_STRIDE = ENTRY_SIZE // 8


def table_offset(capacity: int) -> int:
    """Where the reader table starts, from the start of the ring."""
    return HEADER_SIZE + validate_capacity(capacity)


def broadcast_ring_size(capacity: int, readers: int) -> int:
    """Bytes a broadcast ring of ``capacity`` with ``readers`` entries occupies."""
    _check_readers(readers)
    return table_offset(capacity) + ENTRY_SIZE * readers


def _check_readers(readers: int) -> int:
    if not isinstance(readers, int) or not 1 <= readers <= MAX_READERS:
        raise ValueError(f"a broadcast has 1 to {MAX_READERS} readers, not {readers!r}")
    return readers


def init_broadcast_ring(buf: Any, offset: int, capacity: int, readers: int) -> None:
    """Format a fresh broadcast ring at ``offset`` of ``buf`` (every entry free)."""
    size = broadcast_ring_size(capacity, readers)
    mv = memoryview(buf)
    try:
        if offset < 0 or offset % 8 or offset + size > mv.nbytes:
            raise ValueError("broadcast ring does not fit the buffer at this offset")
        init_ring(buf, offset, capacity)
        start = offset + table_offset(capacity)
        mv[start : offset + size] = bytes(size - (start - offset))
        q = mv[offset : offset + HEADER_SIZE].cast("B").cast("Q")
        try:
            q[_NREADERS] = readers
            q[_TABLE] = table_offset(capacity)
            q[_BMAGIC] = _BMAGIC_WORD
        finally:
            q.release()
    finally:
        mv.release()


def read_broadcast_header(buf: Any, offset: int = 0) -> tuple[int, int]:
    """``(capacity, readers)`` of the broadcast ring at ``offset``; raises
    :class:`RingCorrupted` if there is none, or it does not fit the buffer."""
    mv = memoryview(buf)
    try:
        if offset < 0 or offset % 8 or offset + HEADER_SIZE > mv.nbytes:
            raise RingCorrupted("buffer too small for a broadcast ring header")
        q = mv[offset : offset + HEADER_SIZE].cast("B").cast("Q")
        try:
            cap, magic, n, table = q[HEADER_WORDS["capacity"]], q[_BMAGIC], q[_NREADERS], q[_TABLE]
        finally:
            q.release()
        if magic != _BMAGIC_WORD:
            raise RingCorrupted("no broadcast ring here (bad magic or layout version)")
        try:
            validate_capacity(cap)
            _check_readers(n)
        except ValueError as exc:
            raise RingCorrupted(str(exc)) from None
        if table != table_offset(cap) or offset + broadcast_ring_size(cap, n) > mv.nbytes:
            raise RingCorrupted("the broadcast ring's reader table lies outside the buffer")
        return cap, n
    finally:
        mv.release()


def _table(buf: Any, offset: int, capacity: int, readers: int) -> memoryview:
    mv = memoryview(buf)
    start = offset + table_offset(capacity)
    t = mv[start : start + ENTRY_SIZE * readers]
    mv.release()
    out = t.cast("B").cast("Q")
    t.release()
    return out


class BroadcastWriter(RingWriter):
    """The writing end of a broadcast ring.  Not thread-safe: one writer at a time.

    Publishing is ring.py's (:meth:`try_write`, :meth:`write_many`, :meth:`fits_now`);
    what differs is where the head comes from (the slowest live reader) and whom the
    doorbells go to.  ``live`` lists the readers the space is kept for.
    """

    __slots__ = ("_e", "readers", "live", "_seen", "_rungs", "to_ring", "faulty", "on_faulty")

    def __init__(self, buf: Any, offset: int = 0) -> None:
        cap, n = read_broadcast_header(buf, offset)
        super().__init__(buf, offset)
        self.readers = n
        self._e = _table(buf, offset, cap, n)
        self.live: list[int] = []  # ranks whose heads hold the space, in admission order
        self._seen = [0] * n  # the head each reader had when last looked at
        self._rungs = [0] * n  # the park of each reader last rung for
        self.to_ring: list[int] = []  # after reader_needs_doorbell(): whom to ring
        self.faulty: list[int] = []  # readers dropped from ``live`` for a bad head
        self.on_faulty: Any = None  # called (no arguments) when a reader lands in ``faulty``

    def release(self) -> None:
        super().release()
        self._e.release()

    # -- readers -----------------------------------------------------------------------

    def admit(self, rank: int, pid: int) -> int:
        """Start keeping space for reader ``rank`` (process ``pid``) from the current
        tail on; return that start.  Call it between publishes (never inside a batch)."""
        if not 0 <= rank < self.readers:
            raise ValueError(f"rank {rank} outside the reader table (0..{self.readers - 1})")
        if rank in self.live:
            raise ValueError(f"reader rank {rank} is already admitted")
        start = self._tail
        e, b = self._e, rank * _STRIDE
        e[b + E_HEAD] = start
        e[b + E_PARKED] = 0
        e[b + E_CLOSED] = 0
        e[b + E_START] = start
        e[b + E_JOINS] += 1
        e[b + E_STATE] = pid
        self._seen[rank] = start
        self._rungs[rank] = 0
        self.live.append(rank)
        fence()  # the entry before the reader hears of it (a syscall follows anyway)
        return start

    def remove(self, rank: int) -> None:
        """Stop keeping space for ``rank`` (it died, left, or was dropped)."""
        if rank in self.live:
            self.live.remove(rank)
        self._e[rank * _STRIDE + E_STATE] = 0

    @property
    def position(self) -> int:
        """Bytes published so far (the tail): where a reader admitted now starts."""
        return int(self._tail)

    def head_of(self, rank: int) -> int:
        return int(self._e[rank * _STRIDE + E_HEAD])

    def behind(self, rank: int) -> int:
        """Bytes published that ``rank`` has not consumed (a snapshot)."""
        return max(0, self._tail - self.head_of(rank))

    def reader_closed_flag(self, rank: int) -> bool:
        """Did ``rank`` mark its end closed (a clean leave, not a death)?"""
        fence()
        return self._e[rank * _STRIDE + E_CLOSED] != 0

    def laggards(self, nbytes: int) -> list[int]:
        """The live readers whose heads keep an ``nbytes`` payload from fitting now,
        slowest first (who a writer waiting for room waits for)."""
        need = (nbytes + 11) & ~7
        tail, cap = self._tail, self.capacity
        pos = tail & self._mask
        total = need if need <= cap - pos else cap - pos + need
        slow = [r for r in self.live if cap - (tail - self.head_of(r)) < total]
        return sorted(slow, key=self.head_of)

    # -- space ---------------------------------------------------------------------------

    def _refresh_head(self, total: int) -> bool:
        """Reload the live readers' heads; is there room for ``total`` bytes now?"""
        tail = self._tail
        lo = tail
        e, seen = self._e, self._seen
        bad: list[int] = []
        for r in self.live:
            h = e[r * _STRIDE + E_HEAD]
            if h < seen[r] or h > tail:
                bad.append(r)  # it stops counting now; the caller drops it
                continue
            seen[r] = h
            if h < lo:
                lo = h
        if bad:
            for r in bad:
                self.live.remove(r)
                self.faulty.append(r)
            if self.on_faulty is not None:
                self.on_faulty()
        if lo != self._head_cache:
            self._head_cache = lo
            self._q[_HEAD] = lo  # the horizon: stored before any byte of the freed space
            fence()
        return total <= self.capacity - (tail - lo)

    @property
    def free(self) -> int:
        """Free bytes now (a fresh look at the heads)."""
        self._refresh_head(0)
        return self.capacity - (self._tail - self._head_cache)

    def used(self) -> int:
        """Bytes published that the slowest live reader has not consumed."""
        return self.capacity - self.free

    @property
    def reader_closed(self) -> bool:
        """(The lane protocol's "the reader closed": a broadcast has no one reader.)"""
        return False

    # -- eventcount: the writer's side ---------------------------------------------------

    def reader_needs_doorbell(self) -> bool:
        """After publishing: fence, then list in :attr:`to_ring` every live reader that
        is parked and was not rung for this park yet; ``True`` if there is one."""
        fence()
        e, rungs = self._e, self._rungs
        out = None
        for r in self.live:
            seq = e[r * _STRIDE + E_PARKED]
            if seq and seq != rungs[r]:
                rungs[r] = seq
                if out is None:
                    out = self.to_ring
                    out.clear()
                out.append(r)
        return out is not None

    def reader_wants_doorbell_for_close(self) -> bool:
        """After :meth:`close`: list every parked live reader in :attr:`to_ring`."""
        fence()
        self.to_ring = [r for r in self.live if self._e[r * _STRIDE + E_PARKED]]
        return bool(self.to_ring)


class BroadcastReader(RingReader):
    """Reader ``rank``'s end of a broadcast ring: ring.py's two-phase reading from its
    own head.  Not thread-safe: one reader at a time."""

    __slots__ = ("_e", "rank", "lapped")

    def __init__(self, buf: Any, rank: int, offset: int = 0) -> None:
        cap, n = read_broadcast_header(buf, offset)
        if not 0 <= rank < n:
            raise RingCorrupted(f"rank {rank} outside the reader table (0..{n - 1})")
        super().__init__(buf, offset)
        t = _table(buf, offset, cap, n)
        self._e = t[rank * _STRIDE : (rank + 1) * _STRIDE]
        t.release()
        self.rank = rank
        self.lapped = False
        self.head = self._committed = self._e[E_HEAD]
        tail = self.tail_seen = self._q[TAIL]
        if tail < self.head or tail - self.head > cap:
            self.release()
            raise RingCorrupted(f"reader {rank}'s head {self.head} is not within a ring of {tail}")

    def release(self) -> None:
        super().release()
        self._e.release()

    @property
    def start(self) -> int:
        """Where the writer admitted this reader."""
        return int(self._e[E_START])

    @property
    def own_head(self) -> int:
        """This reader's committed head (the ring header's head is the horizon)."""
        return int(self._e[E_HEAD])

    @property
    def state(self) -> int:
        """The entry's state word: this reader's pid while it is admitted, 0 after
        the writer dropped it."""
        return int(self._e[E_STATE])

    def commit(self) -> None:
        """Hand the space of every frame taken so far back to the writer -- unless the
        writer reused it meanwhile (it dropped this reader): then raise
        :class:`RingCorrupted` (what was read may be overwritten)."""
        head = self.head
        if head != self._committed:
            if WEAK_ORDER:
                fence()  # payload reads before the horizon load and the head store
            if self._q[_HEAD] > self._committed:
                self.lapped = True
                raise RingCorrupted(
                    f"broadcast reader {self.rank} was overtaken by the writer: it dropped "
                    "this reader, and what was just read may have been overwritten"
                )
            self._committed = head
            self._e[E_HEAD] = head

    def available(self) -> bool:
        if self.lapped:
            raise RingCorrupted(f"broadcast reader {self.rank} was overtaken by the writer")
        return self.head != self.tail_seen or self._q[TAIL] != self.head

    # -- eventcount: the reader's side (its own parked flag, in its entry) ----------------

    def park(self) -> None:
        self._park_seq += 1
        self._e[E_PARKED] = self._park_seq
        fence()

    def unpark(self) -> None:
        self._e[E_PARKED] = 0

    def close(self) -> None:
        """This reader will consume no more (the writer's end of file is a clean leave)."""
        fence()
        self._e[E_CLOSED] = 1
        fence()

    @property
    def reader_closed(self) -> bool:
        return self._e[E_CLOSED] != 0
