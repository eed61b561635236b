"""Slot-pool layout and bookkeeping over any buffer: no OS, no processes.

A *slot pool* is one producer-owned region holding tensors that travel by reference
(Ext 4).  Its layout::

    offset        size            meaning
    ------        ----            ---------------------------------------------
    0             8               magic b"RWPOOL" + u16 layout version
    8             8               pool id (random u64, names the pool in SlotRefs)
    16            8               number of slots
    24            8               offset of the data area
    32            8               size of the data area
    64            32 * nslots     slot table: [offset u64][capacity u64][state u64][0]
    data_offset   data_size       the slots, each aligned (64 bytes, 4096 for >= 4 KiB)

``state`` packs ``generation << 2 | status`` with status ``FREE`` (0), ``LOANED`` (1:
the producer is filling it) or ``SENT`` (2: a reference is in flight or held by the
consumer).

Theory of operation
-------------------
*Only the producer writes the table.*  It allocates (FREE -> LOANED), publishes
(LOANED -> SENT) before the record holding the reference is written to the ring, and
frees (SENT -> FREE, generation + 1) when a release for exactly that (slot, generation)
arrives on the consumer->producer release lane, or when the consumer dies.  Because
the ring's publish fence orders the table store before the record, a consumer that
reads the record also sees the state that makes the reference valid.

The consumer never writes the table; it *validates* each reference against it before
making a view: the pool id must be this connection's pool, the slot index in range,
the generation current and the status ``SENT``, and ``[offset, offset + nbytes)`` must
lie inside that slot.  A hostile producer therefore cannot make the consumer read
outside memory it was given.  A hostile consumer's release for a slot it was never
given, a stale generation, or a double release is refused by
:meth:`SlotAllocator.release` without touching the table.
"""

from __future__ import annotations

import bisect
import secrets
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import DecodeError, RingwireError, SlotRefused
from .descriptors import SlotRef

__all__ = [
    "FREE",
    "LOANED",
    "SENT",
    "PoolLayout",
    "SlotAllocator",
    "SlotClass",
    "SlotRefused",
    "check_ref",
    "init_pool",
    "plan_pool",
    "pool_size",
    "read_pool",
    "slot_state",
]

FREE, LOANED, SENT = 0, 1, 2
_STATUS_MASK = 3
_MAGIC = b"RWPOOL" + struct.pack("<H", 1)
_HEADER = struct.Struct("=8sQQQQ")
_TABLE_OFFSET = 64
_ENTRY = struct.Struct("=QQQQ")
_MAX_SLOTS = 1 << 20

# The pool layout as tables, for tools that read a pool from outside (python -m
# ringwire inspect): the header struct, where the slot table starts, one entry's
# struct, the most slots a pool has, the magic's first six bytes.
POOL_HEADER = _HEADER
POOL_TABLE_OFFSET = _TABLE_OFFSET
POOL_ENTRY = _ENTRY
MAX_SLOTS = _MAX_SLOTS
POOL_MAGIC = _MAGIC[:6]


@dataclass(frozen=True)
class SlotClass:
    """``count`` slots of ``size`` bytes each."""

    size: int
    count: int

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size <= 0:
            raise ValueError(f"slot size must be a positive int, not {self.size!r}")
        if not isinstance(self.count, int) or self.count <= 0:
            raise ValueError(f"slot count must be a positive int, not {self.count!r}")


@dataclass(frozen=True)
class PoolLayout:
    pool_id: int
    offsets: tuple[int, ...]
    capacities: tuple[int, ...]
    data_offset: int
    data_size: int

    @property
    def nslots(self) -> int:
        return len(self.offsets)

    @property
    def total_size(self) -> int:
        return self.data_offset + self.data_size


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _plan(classes: Sequence[SlotClass]) -> tuple[list[int], list[int], int, int]:
    if not classes:
        raise ValueError("a slot pool needs at least one slot class")
    nslots = sum(c.count for c in classes)
    if nslots > _MAX_SLOTS:
        raise ValueError(f"at most {_MAX_SLOTS} slots per pool, not {nslots}")
    data_offset = _align(_TABLE_OFFSET + _ENTRY.size * nslots, 4096)
    offsets, capacities = [], []
    pos = 0
    for cls in sorted(classes, key=lambda c: c.size):
        align = 4096 if cls.size >= 4096 else 64
        for _ in range(cls.count):
            pos = _align(pos, align)
            offsets.append(data_offset + pos)
            capacities.append(cls.size)
            pos += cls.size
    return offsets, capacities, data_offset, _align(pos, 4096)


plan_pool = _plan
"""``(offsets, capacities, data_offset, data_size)`` of a pool of these classes."""


def pool_size(classes: Sequence[SlotClass]) -> int:
    """Bytes a pool of these slot classes occupies."""
    _, _, data_offset, data_size = _plan(classes)
    return data_offset + data_size


def init_pool(
    buf: Any, classes: Sequence[SlotClass], pool_id: int | None = None, *, table_only: bool = False
) -> PoolLayout:
    """Write an empty pool (every slot FREE, generation 0) at the start of ``buf``.

    ``table_only``: ``buf`` holds only the header and slot table (the data area is
    elsewhere, e.g. on a GPU, at the same offsets)."""
    offsets, capacities, data_offset, data_size = _plan(classes)
    if len(buf) < (data_offset if table_only else data_offset + data_size):
        raise ValueError(
            f"buffer of {len(buf)} bytes is smaller than the pool's {data_offset + data_size}"
        )
    if pool_id is None:
        pool_id = secrets.randbits(64)
    for i, (off, cap) in enumerate(zip(offsets, capacities, strict=True)):
        _ENTRY.pack_into(buf, _TABLE_OFFSET + i * _ENTRY.size, off, cap, FREE, 0)
    _HEADER.pack_into(buf, 0, _MAGIC, pool_id, len(offsets), data_offset, data_size)
    return PoolLayout(pool_id, tuple(offsets), tuple(capacities), data_offset, data_size)


def read_pool(buf: Any) -> PoolLayout:
    """Read and check a pool's header and slot table (the consumer does this once, at
    attach time, and keeps the result: later table rewrites cannot move slots)."""
    if len(buf) < _TABLE_OFFSET:
        raise RingwireError("slot pool segment is too small for its header")
    magic, pool_id, nslots, data_offset, data_size = _HEADER.unpack_from(buf, 0)
    if magic != _MAGIC:
        raise RingwireError("slot pool segment has a bad magic or layout version")
    if not 0 < nslots <= _MAX_SLOTS:
        raise RingwireError(f"slot pool claims {nslots} slots")
    if data_offset < _TABLE_OFFSET + nslots * _ENTRY.size or data_offset + data_size > len(buf):
        raise RingwireError("slot pool data area lies outside the segment")
    offsets, capacities = [], []
    for i in range(nslots):
        off, cap, _, _ = _ENTRY.unpack_from(buf, _TABLE_OFFSET + i * _ENTRY.size)
        if off < data_offset or off + cap > data_offset + data_size or off % 64:
            raise RingwireError(f"slot {i} lies outside the pool's data area")
        offsets.append(off)
        capacities.append(cap)
    return PoolLayout(pool_id, tuple(offsets), tuple(capacities), data_offset, data_size)


def slot_state(buf: Any, slot: int) -> tuple[int, int]:
    """(generation, status) of ``slot`` as the table says now."""
    (state,) = struct.unpack_from("=Q", buf, _TABLE_OFFSET + slot * _ENTRY.size + 16)
    return state >> 2, state & _STATUS_MASK


def _store_state(buf: Any, slot: int, generation: int, status: int) -> None:
    struct.pack_into("=Q", buf, _TABLE_OFFSET + slot * _ENTRY.size + 16, generation << 2 | status)


def check_ref(buf: Any, layout: PoolLayout, ref: SlotRef) -> None:
    """Consumer side: raise :class:`DecodeError` unless ``ref`` names memory this pool
    handed out and still lends (see the module docstring)."""
    if ref.pool != layout.pool_id:
        raise DecodeError(
            f"slot reference names pool {ref.pool:#x}, which is not this connection's"
        )
    if ref.slot >= layout.nslots:
        raise DecodeError(f"slot reference names slot {ref.slot} of a {layout.nslots}-slot pool")
    start, cap = layout.offsets[ref.slot], layout.capacities[ref.slot]
    if ref.offset < start or ref.offset + ref.nbytes > start + cap:
        raise DecodeError(
            f"slot reference [{ref.offset}, {ref.offset + ref.nbytes}) lies outside slot "
            f"{ref.slot} [{start}, {start + cap})"
        )
    generation, status = slot_state(buf, ref.slot)
    if generation != ref.generation or status != SENT:
        raise DecodeError(
            f"slot reference to slot {ref.slot} generation {ref.generation} is stale "
            f"(the pool says generation {generation}, status {status})"
        )


class SlotAllocator:
    """Producer side: hands out slots and takes them back.

    Not thread-safe by itself: the transport calls it under the connection's lock.
    """

    def __init__(self, buf: Any, layout: PoolLayout) -> None:
        self._buf = buf
        self.layout = layout
        # free slot indices per capacity, smallest capacity first
        self._free: dict[int, list[int]] = {}
        for i, cap in enumerate(layout.capacities):
            self._free.setdefault(cap, []).append(i)
        for slots in self._free.values():
            slots.reverse()  # pop() hands out the lowest index first
        self._caps = sorted(self._free)
        self._generation = [slot_state(buf, i)[0] for i in range(layout.nslots)]
        self._status = [FREE] * layout.nslots

    # -- queries --------------------------------------------------------------------------

    def detach(self) -> None:
        """Drop the reference to the buffer (its segment is being closed)."""
        self._buf = None

    @property
    def largest(self) -> int:
        return self._caps[-1]

    def in_use(self) -> int:
        return sum(1 for s in self._status if s != FREE)

    def free_by_size(self) -> dict[int, int]:
        return {cap: len(self._free[cap]) for cap in self._caps}

    def status(self, slot: int) -> int:
        return self._status[slot]

    def can_allocate(self, nbytes: int) -> bool:
        """Would :meth:`allocate` find a free slot for ``nbytes`` now?"""
        return any(self._free[cap] for cap in self._caps if cap >= nbytes)

    def slot_at(self, offset: int, nbytes: int) -> int | None:
        """The slot whose memory holds ``[offset, offset + nbytes)``, or ``None``."""
        offsets = self.layout.offsets
        i = bisect.bisect_right(offsets, offset) - 1
        if i < 0 or offset + nbytes > offsets[i] + self.layout.capacities[i]:
            return None
        return i

    def generation(self, slot: int) -> int:
        return self._generation[slot]

    # -- transitions ------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> int | None:
        """Loan the smallest free slot that holds ``nbytes``; ``None`` if none is free.

        Raises ``ValueError`` when no slot of the pool could ever hold ``nbytes``.
        """
        if nbytes > self._caps[-1]:
            raise ValueError(
                f"{nbytes} bytes do not fit the pool's largest slot ({self._caps[-1]} bytes)"
            )
        for cap in self._caps:
            if cap >= nbytes and self._free[cap]:
                slot = self._free[cap].pop()
                self._set(slot, LOANED)
                return slot
        return None

    def ref(self, slot: int, nbytes: int, shape: Iterable[int], dtype: str, kind: str) -> SlotRef:
        return SlotRef(
            version=1,
            pool=self.layout.pool_id,
            slot=slot,
            generation=self._generation[slot],
            offset=self.layout.offsets[slot],
            nbytes=nbytes,
            shape=tuple(shape),
            dtype=dtype,
            kind=kind,  # type: ignore[arg-type]
        )

    def mark_sent(self, slot: int) -> None:
        if self._status[slot] != LOANED:
            raise RingwireError(f"slot {slot} is not loaned (status {self._status[slot]})")
        self._set(slot, SENT)

    def unsend(self, slot: int) -> None:
        """Undo :meth:`mark_sent` for a reference that was never published (SENT ->
        LOANED, same generation)."""
        if self._status[slot] != SENT:
            raise RingwireError(f"slot {slot} is not sent (status {self._status[slot]})")
        self._set(slot, LOANED)

    def cancel(self, slot: int) -> None:
        """Give back a loaned slot that was never sent."""
        if self._status[slot] == LOANED:
            self._free_slot(slot)

    def release(self, slot: int, generation: int) -> None:
        """The consumer is done with (slot, generation).  Raises :class:`SlotRefused`
        for a slot out of range, not sent, or of another generation."""
        if not 0 <= slot < self.layout.nslots:
            raise SlotRefused(f"release of slot {slot}: the pool has {self.layout.nslots}")
        if self._status[slot] != SENT or self._generation[slot] != generation:
            raise SlotRefused(
                f"release of slot {slot} generation {generation}: the slot is at generation "
                f"{self._generation[slot]} with status {self._status[slot]} "
                "(double release, stale, or never sent)"
            )
        self._free_slot(slot)

    def reclaim_sent(self, *, publish: bool = True) -> int:
        """The consumer is gone: every SENT slot returns to the pool.  Returns how many.

        ``publish=False`` (the producer is closing its end) changes only this side's
        bookkeeping: the shared table keeps saying SENT at the same generation, so a
        consumer still resolves the references in records it has not read yet."""
        n = 0
        for slot, status in enumerate(self._status):
            if status == SENT:
                if publish:
                    self._free_slot(slot)
                else:
                    self._generation[slot] += 1
                    self._status[slot] = FREE
                    self._free[self.layout.capacities[slot]].append(slot)  # statistics
                n += 1
        return n

    def _free_slot(self, slot: int) -> None:
        self._generation[slot] += 1
        self._set(slot, FREE)
        self._free[self.layout.capacities[slot]].append(slot)

    def _set(self, slot: int, status: int) -> None:
        self._status[slot] = status
        _store_state(self._buf, slot, self._generation[slot], status)
