"""SPSC ring arithmetic over any writable buffer: no OS, no processes.

One *ring lane* carries variable-length frames from exactly one writer to exactly one
reader.  It lives in a region of ``ring_size(capacity)`` bytes of any writable buffer
(an ``mmap`` of a shared-memory segment in production, a plain ``bytearray`` in the
unit tests)::

    offset  size  written by  meaning
    ------  ----  ----------  ---------------------------------------------------
         0     8  creator     magic ``b"RWRING"`` + u16 layout version
         8     8  creator     capacity of the data area (a power of two)
        64     8  writer      tail: bytes ever published (u64, never wraps)
       128     8  reader      head: bytes ever consumed (u64, never wraps)
       192     8  reader      reader-parked: 0, or the reader's park sequence number
       256     8  writer      writer-parked: 0, or the writer's park sequence number
       320     8  writer      writer-closed: 1 once the writer will publish no more
       384     8  reader      reader-closed: 1 once the reader will consume no more
       512   cap  writer      data area

Every counter and flag sits on its own 64-byte cache line, so the writer's and the
reader's stores never share a line.  All integers are native-endian (both ends are on
one host); every store is an 8-byte aligned store, which is single-copy atomic on
x86-64 and aarch64 (CPython's memoryview item assignment of format ``'Q'`` compiles to
one 8-byte move).

Frames
------
A frame is ``[u32 payload length][payload]`` padded to a multiple of 8 bytes, at
position ``counter % capacity``.  A frame never straddles the end of the data area:
when it does not fit before the end, the writer stores the wrap marker ``0xFFFFFFFF``
as the length and the frame starts again at offset 0 (the skipped tail counts as
used).  Because every frame is 8-aligned and the capacity is a multiple of 8, there are
always at least 8 bytes before the end, so the marker itself always fits.

The largest payload is ``capacity // 2 - 4`` bytes: a frame of at most half the ring
fits an *empty* ring whatever the current position (either the space before the end or
the space before the current position is at least half), so a writer facing a full
ring is always unblocked by the reader draining it.  Larger records must travel in
tensor slots.

The reader trusts nothing: a tail that runs backwards or past ``head + capacity``, a
length beyond the largest payload, a frame that crosses the end of the data area or
runs past the tail, or a misplaced wrap marker raises :class:`RingCorrupted`.

Memory ordering
---------------
Python has no atomics, so the ordering is built from two things:

* ``fence()`` acquires and releases a :class:`threading.Lock`.  CPython's lock is a
  POSIX semaphore or a pthread mutex; taking it is an atomic read-modify-write
  (``lock cmpxchg`` on x86-64, a full barrier; acquire + release atomics on aarch64),
  and CPython's own calls into it are opaque to the C compiler.  vLLM's
  ``shm_broadcast`` relies on the same.
* Program order of the interpreter: every ringwire load or store is a separate C call
  (memoryview item access, ``memoryview`` slice assignment), which the C compiler
  cannot merge or reorder across.

Publishing (writer): copy the payload and length into the data area, fence, store
the new tail.  Consuming (reader): load the tail, fence, read the frames below it,
fence, store the new head.  The first pair orders "payload visible" before "tail
visible" (release) and "tail seen" before "payload read" (acquire); the second orders
"payload read" before "space handed back", so the writer never overwrites bytes the
reader is still decoding.  The writer's reuse of freed space is ordered after its load
of the head by a control dependency (it branches on the value before storing), which
both architectures respect.

On x86-64 these three fences are compiled out (``_WEAK_ORDER`` is false): x86 is TSO,
so stores become visible in program order (payload before tail), loads are not
reordered with older loads (tail before payload) nor with younger stores (payload
reads before the head store).  The only reordering x86 allows is a younger load
passing an older store, which is exactly the eventcount's case below: that fence is
always executed.  On aarch64 and everything else, every fence is executed.

Eventcount (doorbell)
---------------------
A reader that finds the ring empty spins for a bounded time, then *parks*:

    reader: store reader_parked = seq;  fence();  load tail
            if tail moved: unpark, read.  else: wait on the control socket
    writer: store tail;                 fence();  load reader_parked
            if parked and seq not already rung: send one doorbell byte

This is Dekker's pattern.  Each side stores, then fences, then loads what the other
side stored; with a full barrier between each store and the following load, the two
loads cannot both miss the two stores.  So either the reader sees the new tail (and
does not sleep) or the writer sees the parked flag (and rings).  The doorbell byte
is queued in the kernel socket buffer, so it is never lost even if it is sent before
the reader actually blocks in ``poll``/``epoll``: the socket is simply already
readable.  A spurious doorbell (the reader already woke on its own) costs one wasted
wakeup and is harmless: every wakeup re-checks the ring.  The writer remembers the
last ``seq`` it rang, so it sends one byte per park, not one per record.

A writer facing a full ring does the mirror image with ``writer_parked`` and the head,
and the reader rings after publishing a new head.

Everything here is pure arithmetic over a buffer; the sockets, segments and the
actual waiting are in :mod:`ringwire._shm.transport` and :mod:`ringwire._conn`.

This module is also the pure-Python implementation.  ``_cring.c`` implements the same
lanes in C with C11 atomics (release store / acquire load of the counters, seq_cst
fences for the eventcount: its header pairs them up), and :mod:`ringwire._wire.lanes`
picks one (``RINGWIRE_PURE=1`` forces this one).  The layout above is the contract:
a C end and a Python end share one ring.
"""

from __future__ import annotations

import os
import platform
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import FrameTooLarge, RingCorrupted

__all__ = [
    "HEADER_SIZE",
    "LAYOUT_VERSION",
    "MAX_CAPACITY",
    "MIN_CAPACITY",
    "RCLOSED",
    "WCLOSED",
    "WRAP_MARKER",
    "WEAK_ORDER",
    "FrameTooLarge",
    "RingCorrupted",
    "RingReader",
    "RingWriter",
    "check_ring",
    "fence",
    "frame_size",
    "header_view",
    "init_ring",
    "max_payload",
    "ring_size",
    "validate_capacity",
]

HEADER_SIZE = 512
LAYOUT_VERSION = 1
MIN_CAPACITY = 1024
MAX_CAPACITY = 1 << 30
WRAP_MARKER = 0xFFFFFFFF

# u64 word indices into the header (byte offset // 8)
_MAGIC = 0
_CAPACITY = 1
_TAIL = 8
_HEAD = 16
_RPARKED = 24
_WPARKED = 32
_WCLOSED = 40
_RCLOSED = 48
RCLOSED = _RCLOSED  # index of the reader-closed flag in ``_Lane.header``
TAIL = _TAIL  # index of the tail (bytes ever published) in ``_Lane.header``
WCLOSED = _WCLOSED  # index of the writer-closed flag in ``_Lane.header``
RING_MAGIC = b"RWRING"  # the first six bytes of every ring header

HEADER_WORDS = {
    "magic": _MAGIC,
    "capacity": _CAPACITY,
    "tail": _TAIL,
    "head": _HEAD,
    "reader_parked": _RPARKED,
    "writer_parked": _WPARKED,
    "writer_closed": _WCLOSED,
    "reader_closed": _RCLOSED,
}
"""The ring header as a table (the drawing above): field -> index of its native u64
word.  For tools that read a header from outside, like ``python -m ringwire inspect``."""

_MAGIC_BYTES = RING_MAGIC + struct.pack("<H", LAYOUT_VERSION)
_MAGIC_WORD = struct.unpack("=Q", _MAGIC_BYTES)[0]


# -- the fence --------------------------------------------------------------------------

# x86-64 is TSO: stores are seen in program order and loads are not reordered with
# older loads or with younger stores, so the publish / consume orderings need no
# barrier there (only the store->load of the eventcount does).  Everywhere else
# (aarch64, ...) every ordering point gets a full fence.
_WEAK_ORDER = platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86")
WEAK_ORDER = _WEAK_ORDER  # public, read-only: for lanes built on these (broadcast_ring.py)

_fence_lock = threading.Lock()
_acquire = _fence_lock.acquire
_release = _fence_lock.release


def fence() -> None:
    """A full memory barrier: acquire and release a lock (see the module docstring)."""
    _acquire()
    _release()


def _reinit_fence_after_fork() -> None:  # pragma: no cover - runs in forked children
    # a thread of the parent may have held the lock at the instant of fork
    global _fence_lock, _acquire, _release
    _fence_lock = threading.Lock()
    _acquire = _fence_lock.acquire
    _release = _fence_lock.release


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_fence_after_fork)


# -- sizes --------------------------------------------------------------------------------


def validate_capacity(capacity: int) -> int:
    """Return ``capacity`` if it is a power of two in [MIN_CAPACITY, MAX_CAPACITY]."""
    if (
        not isinstance(capacity, int)
        or capacity < MIN_CAPACITY
        or capacity > MAX_CAPACITY
        or capacity & (capacity - 1)
    ):
        raise ValueError(
            f"ring capacity must be a power of two between {MIN_CAPACITY} and "
            f"{MAX_CAPACITY} bytes, not {capacity!r}"
        )
    return capacity


def ring_size(capacity: int) -> int:
    """Bytes a ring lane of ``capacity`` occupies (header + data area)."""
    return HEADER_SIZE + validate_capacity(capacity)


def max_payload(capacity: int) -> int:
    """The largest payload a ring of ``capacity`` accepts."""
    return capacity // 2 - 4


def frame_size(payload_len: int) -> int:
    """Bytes one frame of ``payload_len`` takes in the data area (without wrap waste)."""
    return (payload_len + 11) & ~7


def _header(buf: Any, offset: int) -> memoryview:
    mv = memoryview(buf)
    if mv.readonly:
        raise TypeError("a ring needs a writable buffer")
    region = mv[offset : offset + HEADER_SIZE]
    if region.nbytes != HEADER_SIZE:
        raise ValueError("buffer too small for a ring header")
    return region.cast("B").cast("Q")


def header_view(buf: Any, offset: int) -> memoryview:
    """The ring header at ``offset`` of ``buf`` as a memoryview of native u64 words
    (index with :data:`HEADER_WORDS`).  Raises ``TypeError`` for a read-only buffer,
    ``ValueError`` if the header does not fit."""
    return _header(buf, offset)


def init_ring(buf: Any, offset: int, capacity: int) -> None:
    """Format a fresh ring lane of ``capacity`` at ``offset`` of ``buf`` (zeroes the header)."""
    validate_capacity(capacity)
    mv = memoryview(buf)
    if offset < 0 or offset % 8 or offset + HEADER_SIZE + capacity > mv.nbytes:
        raise ValueError("ring does not fit the buffer at this offset")
    mv[offset : offset + HEADER_SIZE] = bytes(HEADER_SIZE)
    q = _header(buf, offset)
    try:
        q[_CAPACITY] = capacity
        q[_MAGIC] = _MAGIC_WORD
    finally:
        q.release()
        mv.release()


def check_ring(buf: Any, offset: int, capacity: int) -> None:
    """Check that a fresh ring of ``capacity`` is at ``offset`` (attach-time validation)."""
    validate_capacity(capacity)
    mv = memoryview(buf)
    try:
        if offset < 0 or offset % 8 or offset + HEADER_SIZE + capacity > mv.nbytes:
            raise RingCorrupted("ring does not fit the segment at the announced offset")
        q = _header(buf, offset)
        try:
            if q[_MAGIC] != _MAGIC_WORD:
                raise RingCorrupted("no ring header at the announced offset (bad magic)")
            if q[_CAPACITY] != capacity:
                raise RingCorrupted(
                    f"ring header says capacity {q[_CAPACITY]}, handshake said {capacity}"
                )
            if q[_TAIL] != 0 or q[_HEAD] != 0:
                raise RingCorrupted("a new ring must start empty")
        finally:
            q.release()
    finally:
        mv.release()


class _Lane:
    """What both ends share: views of the header and data area."""

    __slots__ = (
        "_q",
        "header",
        "_data",
        "_d32",
        "capacity",
        "_mask",
        "max_payload",
        "_park_seq",
        "_rung",
    )

    def __init__(self, buf: Any, offset: int = 0) -> None:
        q = _header(buf, offset)
        if q[_MAGIC] != _MAGIC_WORD:
            q.release()
            raise RingCorrupted("no ring header here (bad magic)")
        cap = q[_CAPACITY]
        try:
            validate_capacity(cap)
        except ValueError as exc:
            q.release()
            raise RingCorrupted(str(exc)) from None
        mv = memoryview(buf)
        data = mv[offset + HEADER_SIZE : offset + HEADER_SIZE + cap]
        mv.release()
        if data.nbytes != cap:
            data.release()
            q.release()
            raise RingCorrupted("buffer too small for the ring's capacity")
        self._q = self.header = q
        self._data = data.cast("B")
        data.release()
        self._d32 = self._data.cast("I")
        self.capacity = cap
        self._mask = cap - 1
        self.max_payload = max_payload(cap)
        self._park_seq = 0  # this end's park count (written to its parked flag)
        self._rung = 0  # the peer's last park we rang a doorbell for

    def release(self) -> None:
        """Drop the views (so the underlying mmap can be closed)."""
        for v in (self._d32, self._data, self._q):
            v.release()

    @property
    def data(self) -> memoryview:
        """The data area, as bytes (for walks from outside: ``ring_walk``)."""
        return self._data

    # flags readable by both ends
    @property
    def writer_closed(self) -> bool:
        return self._q[_WCLOSED] != 0

    @property
    def reader_closed(self) -> bool:
        return self._q[_RCLOSED] != 0

    # The eventcount is the same on both ends, mirrored: each end has its own parked
    # and closed flags and watches the other end's parked flag.  Subclasses name them.
    _OWN_PARKED: int
    _PEER_PARKED: int
    _OWN_CLOSED: int

    def peer_needs_doorbell(self) -> bool:
        _acquire()  # fence(), inlined: this runs once per record
        _release()
        seq = self._q[self._PEER_PARKED]
        if seq and seq != self._rung:
            self._rung = seq
            return True
        return False

    def park(self) -> None:
        """Announce that this end is about to wait (the caller re-checks after)."""
        self._park_seq += 1
        self._q[self._OWN_PARKED] = self._park_seq
        fence()

    def unpark(self) -> None:
        self._q[self._OWN_PARKED] = 0

    def close(self) -> None:
        """Mark this end finished (a writer: after its last publish; a reader: it will
        consume no more, so the writer's sends fail)."""
        fence()
        self._q[self._OWN_CLOSED] = 1
        fence()

    def used(self) -> int:
        """Bytes published and not yet consumed (a snapshot)."""
        return self._q[_TAIL] - self._q[_HEAD]


class RingWriter(_Lane):
    """The writing end of one ring lane.  Not thread-safe: one writer at a time."""

    __slots__ = ("_tail", "_head_cache")
    _OWN_PARKED, _PEER_PARKED, _OWN_CLOSED = _WPARKED, _RPARKED, _WCLOSED

    def __init__(self, buf: Any, offset: int = 0) -> None:
        super().__init__(buf, offset)
        self._tail = self._q[_TAIL]
        self._head_cache = self._q[_HEAD]

    def _space_for(self, need: int) -> int:
        """Bytes a ``need``-byte frame takes at the current tail (wrap waste included),
        or -1 if it does not fit now."""
        tail = self._tail
        pos = tail & self._mask
        to_end = self.capacity - pos
        total = need if need <= to_end else to_end + need
        if total > self.capacity - (tail - self._head_cache) and not self._refresh_head(total):
            return -1
        return total

    def _refresh_head(self, total: int) -> bool:
        """Reload the reader's head; is there room for ``total`` bytes now?"""
        head = self._q[_HEAD]
        tail = self._tail
        if head < self._head_cache or head > tail:
            raise RingCorrupted(f"head {head} out of range (tail {tail})")
        self._head_cache = head
        return total <= self.capacity - (tail - head)

    def _put(self, payload: Any, n: int, need: int) -> None:
        tail = self._tail
        pos = tail & self._mask
        to_end = self.capacity - pos
        if need > to_end:
            self._d32[pos >> 2] = WRAP_MARKER
            tail += to_end
            pos = 0
        self._d32[pos >> 2] = n
        self._data[pos + 4 : pos + 4 + n] = payload
        self._tail = tail + need

    def check_size(self, n: int) -> None:
        if n > self.max_payload:
            raise FrameTooLarge(
                f"a {n}-byte record does not fit a ring of {self.capacity} bytes (at most "
                f"{self.max_payload} bytes per record); send large arrays and tensors "
                "through tensor slots, or open the channel with a larger capacity"
            )

    def try_write(self, payload: Any) -> bool | None:
        """Write and publish one frame; ``False`` (nothing written) if the ring is full,
        ``None`` (nothing written) if the reader closed its end."""
        # the hot path: _space_for and _put inlined
        if self._q[_RCLOSED]:
            return None
        n = len(payload)
        if n > self.max_payload:
            self.check_size(n)
        need = (n + 11) & ~7
        tail = self._tail
        cap = self.capacity
        pos = tail & self._mask
        to_end = cap - pos
        total = need if need <= to_end else to_end + need
        if total > cap - (tail - self._head_cache) and not self._refresh_head(total):
            return False
        d32 = self._d32
        if need > to_end:
            d32[pos >> 2] = WRAP_MARKER
            pos = 0
        d32[pos >> 2] = n
        self._data[pos + 4 : pos + 4 + n] = payload
        self._tail = tail = tail + total
        if _WEAK_ORDER:
            fence()  # payload before tail
        self._q[_TAIL] = tail
        return True

    def write_many(self, payloads: Sequence[Any], start: int = 0) -> tuple[int, int]:
        """Write frames ``payloads[start:]`` until the ring is full; publish the tail once.

        Returns ``(frames written, payload bytes written)``.  A payload too large for
        the ring raises :class:`FrameTooLarge` if it comes first, else ends the batch
        (the next call raises).
        """
        count = nbytes = 0
        tail = self._tail
        cap = self.capacity
        mask = self._mask
        limit = self.max_payload
        d32 = self._d32
        data = self._data
        free = cap - (tail - self._head_cache)
        for i in range(start, len(payloads)):
            p = payloads[i]
            n = len(p)
            if n > limit:
                if count:
                    break  # publish what is written; the caller sees the error next time
                self.check_size(n)
            need = (n + 11) & ~7
            pos = tail & mask
            to_end = cap - pos
            total = need if need <= to_end else to_end + need
            if total > free:
                self._tail = tail
                if not self._refresh_head(total):
                    break
                free = cap - (tail - self._head_cache)
            if need > to_end:
                d32[pos >> 2] = WRAP_MARKER
                pos = 0
            d32[pos >> 2] = n
            data[pos + 4 : pos + 4 + n] = p
            tail += total
            free -= total
            count += 1
            nbytes += n
        self._tail = tail
        if count:
            if _WEAK_ORDER:
                fence()  # payload before tail
            self._q[_TAIL] = tail
        return count, nbytes

    def fits_now(self, n: int) -> bool:
        """Would a payload of ``n`` bytes fit right now?"""
        return self._space_for((n + 11) & ~7) >= 0

    @property
    def free(self) -> int:
        """Free bytes (a snapshot; wrap waste may make a frame of this size not fit)."""
        return self.capacity - (self._tail - self._q[_HEAD])

    # -- eventcount: the writer's side ---------------------------------------------------

    # After publishing: fence, then True if the reader is parked and was not rung for
    # this park yet (the caller then sends one doorbell byte).  An alias, not a wrapper:
    # it runs once per record.
    reader_needs_doorbell = _Lane.peer_needs_doorbell

    def reader_wants_doorbell_for_close(self) -> bool:
        """Like :meth:`reader_needs_doorbell` but rings even if this park was rung."""
        fence()
        return self._q[_RPARKED] != 0


class RingReader(_Lane):
    """The reading end of one ring lane.  Not thread-safe: one reader at a time.

    Reading is two-phase: :meth:`next_frame` hands out payload views one after the
    other (advancing a private head); :meth:`commit` publishes the private head, handing
    the space back to the writer.  Decode every view before committing.
    """

    __slots__ = ("head", "_committed", "tail_seen")
    # ``head``: this reader's private head (bytes read so far, committed or not);
    # ``tail_seen``: the tail as last loaded.  Read-only for everyone else: a hot
    # check can test ``head != tail_seen or header[TAIL] != head`` without a call
    # (that is :meth:`available`).
    _OWN_PARKED, _PEER_PARKED, _OWN_CLOSED = _RPARKED, _WPARKED, _RCLOSED
    read_many_on_error = True  # read_many takes on_error (FrameReader)

    def __init__(self, buf: Any, offset: int = 0) -> None:
        super().__init__(buf, offset)
        self.head = self._committed = self._q[_HEAD]
        self.tail_seen = self._q[_TAIL]

    def available(self) -> bool:
        """Is there an unread frame (published, and beyond the private head)?"""
        return self.head != self.tail_seen or self._q[_TAIL] != self.head

    def _load_tail(self) -> int:
        tail = self._q[_TAIL]
        if tail < self.tail_seen or tail - self._committed > self.capacity:
            raise RingCorrupted(
                f"tail {tail} out of range (head {self._committed}, capacity {self.capacity})"
            )
        if _WEAK_ORDER:
            fence()  # tail before payload
        self.tail_seen = tail
        return tail

    def next_frame(self) -> memoryview | None:
        """The payload of the next frame, or ``None`` if none is published.

        The view is valid until :meth:`commit`; release it (or let it go) before then.
        """
        head = self.head
        tail = self.tail_seen
        if head == tail:
            tail = self._q[_TAIL]
            if tail == head:
                return None
            tail = self._load_tail()
        pos = head & self._mask
        n = self._d32[pos >> 2]
        if n == WRAP_MARKER:
            if pos == 0:
                raise RingCorrupted("wrap marker at the start of the data area")
            head += self.capacity - pos
            if head >= tail:
                raise RingCorrupted("wrap marker with no frame after it")
            pos = 0
            n = self._d32[0]
        need = (n + 11) & ~7
        if n > self.max_payload or head + need > tail or pos + need > self.capacity:
            raise RingCorrupted(
                f"bad frame length {n} at ring offset {pos} ({tail - head} bytes "
                f"published, at most {self.max_payload} per frame, none across the end)"
            )
        self.head = head + need
        return self._data[pos + 4 : pos + 4 + n]

    def read_many(
        self,
        fn: Callable[[memoryview], Any],
        max_n: int,
        out: list[Any],
        on_error: Callable[[memoryview, Exception], Any] | None = None,
    ) -> int:
        """Apply ``fn`` to the payloads of up to ``max_n`` published frames, appending
        the results to ``out``; return the payload bytes read.  Nothing is committed.

        If ``fn`` raises (an undecodable record) or a frame is corrupt, the batch ends
        before that frame -- unless it is the first, in which case the error
        propagates (and an undecodable record counts as read, so the next call goes
        on after it).  ``on_error(payload, exc)``, if given, is called first when
        ``fn`` raises, the payload still valid: what it raises replaces ``exc``, what
        it returns is taken as the record (so ``fn`` can be a raw decoder, with the
        error handling off the per-record path).
        """
        head = self.head
        tail = self.tail_seen
        mask = self._mask
        cap = self.capacity
        limit = self.max_payload
        d32 = self._d32
        data = self._data
        k = nbytes = 0
        while k < max_n:
            if head == tail:
                if self._q[_TAIL] == head:
                    break
                tail = self._load_tail()
            pos = head & mask
            n = d32[pos >> 2]
            start = head
            if n == WRAP_MARKER:
                if pos == 0 or start + cap - pos >= tail:
                    if k:
                        break
                    raise RingCorrupted(f"misplaced wrap marker at ring offset {pos}")
                start += cap - pos
                pos = 0
                n = d32[0]
            need = (n + 11) & ~7
            if n > limit or start + need > tail or pos + need > cap:
                if k:
                    break
                raise RingCorrupted(
                    f"bad frame length {n} at ring offset {pos} ({tail - start} bytes "
                    f"published, at most {limit} per frame, none across the end)"
                )
            view = data[pos + 4 : pos + 4 + n]
            try:
                try:
                    obj = fn(view)
                except Exception as exc:
                    if on_error is None:
                        raise
                    obj = on_error(view, exc)
            except Exception:
                if not k:
                    self.head = start + need  # the bad record is consumed
                    raise
                break
            finally:
                view.release()
            out.append(obj)
            k += 1
            nbytes += n
            head = self.head = start + need
        return nbytes

    def next_pairs(self) -> tuple[int, ...] | None:
        """The release lane: the next frame's native u64 words (slot, generation pairs),
        or ``None``.  Raises :class:`RingCorrupted` for a corrupt frame or one that is
        not a multiple of 16 bytes (it is consumed)."""
        view = self.next_frame()
        if view is None:
            return None
        try:
            n = len(view)
            if n % 16:
                raise RingCorrupted(f"release frame of {n} bytes")
            return struct.unpack(f"={n // 8}Q", view)
        finally:
            view.release()

    def mark(self) -> int:
        """The private head, to undo a :meth:`next_frame` with :meth:`reset`."""
        return self.head

    def reset(self, mark: int) -> None:
        if not self._committed <= mark <= self.head:
            raise ValueError("mark out of range")
        self.head = mark

    @property
    def pending(self) -> bool:
        """Frames were taken with :meth:`next_frame` but not committed."""
        return self.head != self._committed

    def commit(self) -> None:
        """Hand the space of every frame taken so far back to the writer."""
        head = self.head
        if head != self._committed:
            if _WEAK_ORDER:
                fence()  # payload reads before handing the space back
            self._committed = head
            self._q[_HEAD] = head

    # -- eventcount: the reader's side ---------------------------------------------------

    # After commit(): fence, then True if the writer is parked waiting for space and was
    # not rung for this park yet.
    writer_needs_doorbell = _Lane.peer_needs_doorbell

    def fill(self) -> int:
        """Bytes published and not committed."""
        return self._q[_TAIL] - self._committed


class ReleaseLaneWriter(RingWriter):
    """The release lane's writer, used only by the release sink (under the queue's
    flush lock).  It fences with a private lock: the sink runs in finalizers, which
    may interrupt code holding the module-wide ring fence lock."""

    __slots__ = ("_own",)

    def __init__(self, buf: Any, offset: int) -> None:
        super().__init__(buf, offset)
        self._own = threading.Lock()

    def _fence(self) -> None:
        self._own.acquire()
        self._own.release()

    def put(self, payload: bytes) -> bool:
        n = len(payload)
        need = (n + 11) & ~7
        if self._space_for(need) < 0:
            return False
        self._put(payload, n, need)
        self._fence()  # payload before tail
        self._q[_TAIL] = self._tail
        return True

    def put_pairs(self, batch: Sequence[tuple[int, int]]) -> bool:
        """One frame of native u64 ``(slot, generation)`` pairs; ``False`` if it does
        not fit now.  Raises ``struct.error`` (the native lane: ``OverflowError``; nothing written)
        for a value outside u64."""
        flat = [x for pair in batch for x in pair]
        return self.put(struct.pack(f"={len(flat)}Q", *flat))

    def ring_wanted(self) -> bool:
        """After :meth:`put`: is the producer parked on the lane (and not rung yet)?"""
        self._fence()
        seq = self._q[_RPARKED]
        if seq and seq != self._rung:
            self._rung = seq
            return True
        return False

    def park_writer(self) -> None:
        self._park_seq += 1
        self._q[_WPARKED] = self._park_seq
        self._fence()

    def unpark_writer(self) -> None:
        if self._q[_WPARKED]:
            self._q[_WPARKED] = 0
