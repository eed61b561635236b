"""Arrays larger than every slot class: the send pool's *arena*.

A slot pool has fixed classes (by default at most 16 MiB); video frames and
``pixel_values`` of hundreds of MB do not fit.  Beside its pool segment every send pool
therefore owns an *arena*: one sparse file (a memory file, or a named segment with
``RINGWIRE_SEGMENTS=named``) of :data:`ARENA_SIZE` bytes of *address*, of which
nothing is reserved until an array needs it.  It travels once, at the handshake, like
the pool (role ``"arena"``); both sides keep its descriptor for the connection's life.

Producer (:class:`ArenaAllocator`)
    An array of more bytes than the largest slot takes a *range* of the arena:
    page-aligned (2 MiB-aligned when it is at least that large, so that transparent
    huge pages can back it), found first-fit in a free list kept in the producer's
    private memory.  The range is reserved before it is touched (``posix_fallocate``;
    or, where transparent huge pages on shared memory are allowed, ``MADV_HUGEPAGE``
    then ``MADV_POPULATE_WRITE``) so that a shortage is a :class:`SharedMemoryFull`
    naming the memory limit, never a SIGBUS; the array is copied in through a mapping of
    just that range.  A range is one *entry* of a small table (index, generation,
    status), so the release lane, receipts and the placement bookkeeping treat it like
    a slot, under the tag :func:`big_tag` (``0x3FFFFFFF << 32 | index``).
    When the consumer releases it (or dies) the range's memory goes back to the kernel
    at once (``MADV_REMOVE``: a hole punched in the file) and the range to the free list.

    *Bounded*: at most ``SlotConfig.large_limit`` bytes of ranges are outstanding;
    beyond that a send waits like a full pool (policy ``"wait"``), except that one
    array larger than the limit goes when nothing else is outstanding, so no size is
    refused.

Consumer (:class:`ArenaMapper`)
    A reference (an ordinary :class:`~ringwire.wire.SlotRef` whose ``pool`` is
    :func:`arena_pool_id` of the producer's pool id, ``slot`` the entry index,
    ``offset`` the range's start in the file) is checked -- page-aligned, inside the
    arena -- and mapped on its own (``mmap`` of that range); the view's finalizer drops
    the mapping and releases ``(big_tag(index), generation)`` on the release lane, as
    for a slot.  The file is sealed against shrinking: the producer cannot truncate it
    under the consumer's mapping.  A hostile producer can name any range of its own
    arena -- that is memory it lent, and nothing else is ever mapped.

When the producer closes while the consumer still holds views, it punches nothing: the
consumer's mappings keep their pages until they die.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from typing import Any

import posix_ipc

from .._errors import SegmentError, SharedMemoryFull, SlotRefused
from .._wire.descriptors import SlotRef
from .._wire.names import new_segment_name
from .segment import (
    ENV_KIND,
    SEALS,
    SHORT_OF_MEMORY,
    huge_pages_on_shmem,
    memory_limit,
    populate_huge,
    segment_kind,
    unlink_segment,
)
from .segment import (
    HUGE_PAGE as _HUGE,
)

__all__ = [
    "ARENA_SIZE",
    "BIG_HI",
    "DEFAULT_LARGE_LIMIT",
    "ArenaAllocator",
    "ArenaFile",
    "ArenaMapper",
    "arena_pool_id",
    "big_tag",
]

ARENA_SIZE = 1 << 40
"""Bytes of address in an arena (sparse: nothing is reserved until used)."""
DEFAULT_LARGE_LIMIT = 2 << 30
BIG_HI = 0x3FFF_FFFF
_PAGE = mmap.PAGESIZE
_MAX_ENTRIES = 1 << 16
FREE, LOANED, SENT = 0, 1, 2
_MASK64 = (1 << 64) - 1


def big_tag(index: int) -> int:
    """The slot number an arena range has on the release lane."""
    return BIG_HI << 32 | index


def arena_pool_id(pool_id: int) -> int:
    """The pool id arena references carry, derived from the send pool's id."""
    return (pool_id ^ 0xA5E4A5E4A5E4A5E4) & _MASK64


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class ArenaFile:
    """The arena's file on the producer's side: created sparse, sealed (a memory
    file), announced at the handshake (``name``, ``size``, ``kind``, ``fd``)."""

    def __init__(self, size: int = ARENA_SIZE, kind: str | None = None) -> None:
        self.size = size
        self.kind = segment_kind() if kind is None else kind
        if self.kind == "memfd":
            label = new_segment_name()[1:]
            self.name = "memfd:" + label
            try:
                fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            except OSError as exc:
                raise SegmentError(f"cannot create the arena's memory file: {exc}") from exc
            try:
                os.fchmod(fd, 0o600)
                os.ftruncate(fd, size)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            except BaseException:
                os.close(fd)
                raise
            self.unlinked = True
        else:
            self.name = new_segment_name()
            try:
                shm = posix_ipc.SharedMemory(self.name, posix_ipc.O_CREX, mode=0o600)
            except posix_ipc.Error as exc:
                raise SegmentError(f"cannot create the arena {self.name}: {exc}") from exc
            try:
                os.ftruncate(shm.fd, size)
                fd = os.dup(shm.fd)
            except OSError as exc:
                unlink_segment(self.name)
                raise SegmentError(f"cannot size the arena {self.name}: {exc}") from exc
            finally:
                shm.close_fd()
            self.unlinked = False
        self.fd = fd

    def unlink(self) -> None:
        if not self.unlinked:
            self.unlinked = True
            unlink_segment(self.name)

    def close(self) -> None:
        self.unlink()
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class _Entry:
    __slots__ = ("offset", "length", "status", "map", "loan_addr")

    def __init__(self, offset: int, length: int, mm: mmap.mmap) -> None:
        self.offset = offset
        self.length = length
        self.status = LOANED
        self.map: mmap.mmap | None = mm
        self.loan_addr = 0  # a loan's first byte in this process (see loaned_at)


class ArenaAllocator:
    """The producer's ranges (see the module docstring).  Not thread-safe: the send
    pool calls it under its lock."""

    def __init__(self, arena: ArenaFile, limit: int, pool_id: int) -> None:
        self.arena = arena
        self.limit = limit
        self.pool_id = arena_pool_id(pool_id)
        self._free: list[tuple[int, int]] = [(0, arena.size)]  # (start, length), sorted
        self._entries: dict[int, _Entry] = {}
        self._generation: dict[int, int] = {}
        self._spare: list[int] = []
        self._next = 0
        self.outstanding = 0  # bytes of ranges taken
        self.loaned_at: dict[int, int] = {}  # address of a loan's first byte -> entry
        self.huge = huge_pages_on_shmem()
        self.largest = arena.size

    # -- the slot-allocator face the send pool uses -------------------------------------

    def in_use(self) -> int:
        return len(self._entries)

    def status(self, index: int) -> int:
        entry = self._entries.get(index)
        return FREE if entry is None else entry.status

    def generation(self, index: int) -> int:
        return self._generation.get(index, 0)

    def can_allocate(self, nbytes: int) -> bool:
        length = self._length(nbytes)
        if self.outstanding and self.outstanding + length > self.limit:
            return False
        return self._find(length) is not None

    def allocate(self, nbytes: int) -> int | None:
        """A new entry of at least ``nbytes``, reserved and mapped, status LOANED; or
        ``None`` when the limit (or the arena's address) is used up.  Raises
        :class:`SharedMemoryFull` when the memory cannot be had."""
        length = self._length(nbytes)
        if self.outstanding and self.outstanding + length > self.limit:
            return None
        if len(self._entries) >= _MAX_ENTRIES:
            return None
        found = self._find(length)
        if found is None:
            return None
        pos, start = found
        mm = self._reserve(start, length)
        s, n = self._free[pos]
        rest = [(a, b) for a, b in ((s, start - s), (start + length, s + n - start - length)) if b]
        self._free[pos : pos + 1] = rest
        index = self._spare.pop() if self._spare else self._take_index()
        self._entries[index] = _Entry(start, length, mm)
        self.outstanding += length
        return index

    def lend(self, index: int, addr: int) -> None:
        """Entry ``index`` is loaned as an array starting at ``addr`` (a send of an
        array starting there sends the range, see ``loaned_at``)."""
        self._entries[index].loan_addr = addr
        self.loaned_at[addr] = index

    def ref(self, index: int, nbytes: int, shape: Any, wire: Any, kind: Any) -> SlotRef:
        """The reference to the first ``nbytes`` of entry ``index`` (an array of
        ``shape`` and wire dtype ``wire``)."""
        return SlotRef(
            version=1,
            pool=self.pool_id,
            slot=index,
            generation=self.generation(index),
            offset=self._entries[index].offset,
            nbytes=nbytes,
            shape=tuple(shape),
            dtype=wire,
            kind=kind,
        )

    def offset_of(self, index: int) -> int:
        return self._entries[index].offset

    def length_of(self, index: int) -> int:
        return self._entries[index].length

    def mark_sent(self, index: int) -> None:
        self._entries[index].status = SENT

    def unsend(self, index: int) -> None:
        self._entries[index].status = LOANED

    def cancel(self, index: int) -> None:
        self._free_entry(index, punch=True)

    def release(self, index: int, generation: int) -> None:
        """The consumer is done with ``(index, generation)``.  Raises
        :class:`SlotRefused` (nothing is touched) for an entry that is not out, another
        generation, or a second release."""
        entry = self._entries.get(index)
        if entry is None or entry.status != SENT or self.generation(index) != generation:
            raise SlotRefused(
                f"release of arena range {index} generation {generation}: not one this "
                "side lent (a stale, forged or double release)"
            )
        self._free_entry(index, punch=True)

    def reclaim_sent(self, publish: bool = True) -> int:
        """The consumer is gone (``publish``: its memory can go now) or we close (the
        consumer's live views keep their pages): free every range out."""
        sent = [i for i, e in self._entries.items() if e.status == SENT]
        for index in sent:
            self._free_entry(index, punch=publish)
        return len(sent)

    def view(self, index: int, nbytes: int) -> memoryview:
        entry = self._entries[index]
        assert entry.map is not None
        return memoryview(entry.map)[:nbytes]

    def close(self) -> None:
        """Drop every mapping (without punching: the consumer may still map ranges)
        and the file's descriptor."""
        for entry in self._entries.values():
            if entry.map is not None:
                try:
                    entry.map.close()
                except BufferError:
                    pass  # a loan still exports it: it unmaps with the loan
                entry.map = None
        self.arena.close()

    # -- internals ----------------------------------------------------------------------

    def _take_index(self) -> int:
        index = self._next
        self._next += 1
        return index

    @staticmethod
    def _length(nbytes: int) -> int:
        return _round(max(nbytes, 1), _HUGE if nbytes >= _HUGE else _PAGE)

    def _find(self, length: int) -> tuple[int, int] | None:
        align = _HUGE if length >= _HUGE else _PAGE
        for pos, (s, n) in enumerate(self._free):
            start = _round(s, align)
            if start + length <= s + n:
                return pos, start
        return None

    def _reserve(self, start: int, length: int) -> mmap.mmap:
        fd = self.arena.fd
        try:
            mm = mmap.mmap(fd, length, offset=start)
        except OSError as exc:
            raise SegmentError(f"cannot map {length} bytes of the arena: {exc}") from exc
        try:
            if self.huge and length >= _HUGE:
                try:
                    populate_huge(mm, length)
                    return mm
                except OSError as exc:
                    if exc.errno in SHORT_OF_MEMORY:
                        mm.madvise(mmap.MADV_REMOVE)
                        raise self._full(length, exc) from None
                    # no MADV_POPULATE_WRITE (older kernel): reserve the plain way
            try:
                os.posix_fallocate(fd, start, length)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    mm.madvise(mmap.MADV_REMOVE)
                    raise self._full(length, exc) from None
                raise SegmentError(f"cannot reserve {length} bytes of the arena: {exc}") from exc
        except BaseException:
            mm.close()
            raise
        return mm

    def _full(self, length: int, exc: OSError) -> SharedMemoryFull:
        if self.arena.kind == "memfd":
            where = f"memory files are limited by {memory_limit()}"
        else:
            where = f"/dev/shm is full or too small ({ENV_KIND}=named)"
        return SharedMemoryFull(
            f"cannot reserve {length} bytes of shared memory for a large array "
            f"({os.strerror(exc.errno or 0)}): {where}; free memory, send smaller arrays, "
            "or lower SlotConfig.large_limit so that fewer are outstanding at once"
        )

    def _free_entry(self, index: int, punch: bool) -> None:
        entry = self._entries.pop(index)
        if entry.loan_addr:
            del self.loaned_at[entry.loan_addr]
        self._generation[index] = self.generation(index) + 1
        self._spare.append(index)
        self.outstanding -= entry.length
        mm, entry.map = entry.map, None
        if mm is not None:
            if punch:
                try:
                    mm.madvise(mmap.MADV_REMOVE)  # the memory goes back to the kernel now
                except (OSError, ValueError):
                    pass
            try:
                mm.close()
            except BufferError:
                pass  # exported (a loan's array still alive): unmaps with it
        self._give_back(entry.offset, entry.length)

    def _give_back(self, start: int, length: int) -> None:
        free = self._free
        lo, hi = 0, len(free)
        while lo < hi:
            mid = (lo + hi) // 2
            if free[mid][0] < start:
                lo = mid + 1
            else:
                hi = mid
        free.insert(lo, (start, length))
        # merge with the neighbours
        if lo + 1 < len(free) and start + length == free[lo + 1][0]:
            free[lo] = (start, length + free[lo + 1][1])
            del free[lo + 1]
        if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == free[lo][0]:
            free[lo - 1] = (free[lo - 1][0], free[lo - 1][1] + free[lo][1])
            del free[lo]


class ArenaMapper:
    """The consumer's side of the producer's arena: checks and maps references."""

    def __init__(self, fd: int, size: int, pool_id: int) -> None:
        self.fd = fd  # ours: closed by close()
        self.size = size
        self.pool_id = arena_pool_id(pool_id)

    def map(self, offset: int, nbytes: int) -> Any:
        """A mapping of ``[offset, offset + nbytes)`` (page-aligned start, inside the
        arena).  Raises ``ValueError`` naming what is wrong."""
        if offset % _PAGE or offset < 0 or nbytes <= 0 or offset + nbytes > self.size:
            raise ValueError(
                f"arena reference [{offset}, {offset + nbytes}) is not a page-aligned "
                f"range inside the {self.size}-byte arena"
            )
        if self.fd < 0:
            raise ValueError("the arena is closed")
        return mmap.mmap(self.fd, _round(nbytes, _PAGE), offset=offset)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
