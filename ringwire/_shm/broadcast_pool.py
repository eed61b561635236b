"""A broadcast writer's slot pool: one copy, N readers, N acknowledgements.

The pool segment of a broadcast is a slot pool (:mod:`ringwire._wire.slotlayout`)
followed by release lanes, one per reader rank::

    offset                                   size                 written by
    ------                                   ----                 ----------
    0                                        pool_size(classes)   writer: the slot pool
    pool_size                                lane                 nobody (see below)
    pool_size + (1 + r) * lane               lane                 reader r: its release lane

(``lane = ring_size(RELEASE_CAPACITY)``.)  Placing arrays, loans, policies and the
shared slot table are the 1:1 channel's :class:`~ringwire._shm.sendpool.ShmSendPool`,
unchanged: a record's array is copied once into a slot (or a loan is used up), the
table says ``SENT`` before the record is published, and every reader's
:class:`~ringwire._shm.recvpool.ShmRecvPool` resolves the same reference into its own
read-only view, with its own finalizer, releasing on its own lane.  The lane a
``ShmSendPool`` reads itself (right after the pool) is written by nobody here: it stays
empty, so the ``ShmSendPool`` never frees a slot on its own.  What is different is *when*
a slot comes back, and that is all this module does:

Counting
--------
When a record is published, every slot it took gets the set of readers that must
release it -- the readers admitted at that moment, as a bit mask in the writer's
private memory (:meth:`BroadcastPool.published`).  A release ``(slot, generation)`` on
reader r's lane clears bit r; the slot is freed (generation + 1) when the mask is
empty.  A release for a slot r does not hold -- another generation, a bit already
clear, a slot never sent -- is refused and marks r *faulty* (the caller drops it).  A
reader that goes (death, leave, drop) gives up its share of every slot at once
(:meth:`BroadcastPool.drop`), after the releases it had published are counted.  A
record published with no reader at all frees its slots right away.

To the writer's :class:`~ringwire._conn.endpoint.Endpoint` this is its send pool:
it places, loans, aborts, answers ``can_allocate`` / ``futile`` / ``consumed`` as the
``SendPool`` inside it does, and its :meth:`~BroadcastPool.poll` (run at the
endpoint's safe points while :meth:`~BroadcastPool.has_work`) counts the readers'
releases instead of reading one lane.  What it cannot do alone it hands to the hub:
the ranks to ring for room in their lanes (:attr:`~BroadcastPool.ring_back`, rung by
the hub's ``ring(DOORBELL_SPACE)``) and the readers whose releases were refused
(``on_fault``: the hub retires them).

Only the writer's thread touches this (the writer's lock serialises a blocking
writer with its watcher thread); finalizers of dropped loans only append to the
``ShmSendPool``'s deque, taken back at the next :meth:`BroadcastPool.poll`.

Trust: every reader maps the whole pool segment writable (it writes its own lane), as
a channel's consumer maps its producer's pool.  A reader's bad release is refused and
drops that reader, but nothing stops a hostile process of the same uid from writing
into *another* reader's lane; readers of one broadcast are one application's ranks.
(One lane segment per reader, passed as its own descriptor, would close that.)
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

import posix_ipc

from .._errors import RingCorrupted, SlotRefused
from .._pool.arena import BIG_HI, ArenaFile, big_tag
from .._pool.cuda import split_tag
from .._pool.protocols import Placed, Placement
from .._pool.segment import Segment
from .._pool.slotconfig import RELEASE_CAPACITY, SlotConfig
from .._wire.ring import RingReader, init_ring, ring_size
from .._wire.slotlayout import PoolLayout
from .sendpool import ShmSendPool

__all__ = ["LANE_SIZE", "BroadcastPool", "lane_offset", "passable_segment"]

logger = logging.getLogger("ringwire")
LANE_SIZE = ring_size(RELEASE_CAPACITY)


def lane_offset(layout: PoolLayout, rank: int) -> int:
    """Where reader ``rank``'s release lane starts in the pool segment."""
    return layout.total_size + (1 + rank) * LANE_SIZE


class BroadcastPool:
    """The writer's slot pool, shared by every reader (see the module docstring): a
    :class:`~ringwire._pool.protocols.SendPool` whose records are published to a
    mask of readers."""

    reuses_placements = True  # as the ShmSendPool it wraps: a Placement holds nothing else

    def __init__(
        self,
        seg: Segment,
        layout: PoolLayout,
        config: SlotConfig,
        max_inline: int,
        readers: int,
        arena: ArenaFile | None = None,
    ) -> None:
        self.seg = seg
        self.layout = layout
        self.config = config
        self.send = ShmSendPool(seg, layout, config, max_inline, arena)
        self.arena = arena
        self.readers = readers
        self.lanes: dict[int, RingReader] = {}
        self.remote: set[int] = set()  # ranks on other hosts (no lane: see release)
        self.holders: dict[int, list[int]] = {}  # tag -> [generation, mask of readers]
        self.faulty: list[int] = []  # ranks whose releases were refused
        self.shares_dropped = 0  # releases owed by readers that went
        self.releases = 0
        self.ring_back: list[int] = []  # after poll(): ranks waiting for room in their lane
        self.on_fault: Callable[[], None] | None = None  # after poll() found ``faulty`` ones
        self.gone = False  # (a SendPool's "the consumer is gone": a broadcast outlives readers)
        self._parked = 0
        self._closed = False

        # the send pool's own, on the send path of every record (no frame of ours)
        self.placement: Callable[[str | None], Placement] = self.send.placement
        self.place: Callable[[Any, Any], Any] = self.send.place
        self.abort: Callable[[Sequence[tuple[int, int, bool]]], None] = self.send.abort
        self.loans = self.send.loans  # (the set and the deque themselves: never replaced)
        self.loan_returns = self.send.loan_returns
        # the endpoint's cheap check at every safe point: is a slot held by a reader?
        # (then it polls the release lanes; a C call on the send path, no frame of ours;
        # releases_published() is the exact answer)
        self.releases_ready: Callable[[], Any] = self.holders.__len__

    # -- the send pool's face (what the endpoint calls, as on a SendPool) ---------------

    def can_allocate(self, nbytes: Any) -> bool:
        return self.send.can_allocate(nbytes)

    def futile(self, need: Any = 0) -> bool:
        return self.send.futile(need)

    def loan(self, *spec: Any) -> Any:
        return self.send.loan(*spec)

    def loan_fallback(self, *spec: Any) -> Any:
        return self.send.loan_fallback(*spec)

    def reclaim(self, *, publish: bool = True) -> int:
        """(Nothing to reclaim at once: every reader gives up its shares as it goes.)"""
        return 0

    @property
    def reclaimed(self) -> int:
        """Shares of slots given up for readers that went (the broadcast's reclaim)."""
        return self.shares_dropped

    # -- readers ----------------------------------------------------------------------

    def admit(self, rank: int) -> int:
        """Give reader ``rank`` a fresh release lane; return its offset."""
        old = self.lanes.pop(rank, None)
        if old is not None:
            old.release()
        off = lane_offset(self.layout, rank)
        init_ring(self.seg.buf, off, RELEASE_CAPACITY)
        lane = self.lanes[rank] = RingReader(self.seg.buf, off)
        if self._parked:
            lane.park()
        return off

    def admit_remote(self, rank: int) -> None:
        """Count reader ``rank`` on another host among the slots' holders from now on:
        it has no lane, its releases come over its connection (:meth:`release`)."""
        self.remote.add(rank)

    def drop(self, rank: int) -> int:
        """Reader ``rank`` is gone: count the releases it published, then give up its
        share of every slot; return how many shares were given up."""
        lane = self.lanes.get(rank)
        if lane is not None:
            try:
                self._poll_lane(rank, lane)
            except (SlotRefused, RingCorrupted):
                pass  # it is going anyway
            del self.lanes[rank]
            lane.release()
        elif rank in self.remote:
            self.remote.discard(rank)
        else:
            return 0
        bit = 1 << rank
        n = 0
        for tag, h in list(self.holders.items()):
            if h[1] & bit:
                n += 1
                self._clear(tag, h, bit)
        self.shares_dropped += n
        return n

    # -- publishing ---------------------------------------------------------------------

    def published(self, placed: Placed, mask: int) -> None:
        """A record that took ``placed`` was published while the readers in ``mask``
        were admitted: each must release each slot."""
        for tag, gen, _ in placed:
            if mask:
                self.holders[tag] = [gen, mask]
            else:
                self._free(tag, gen)

    # -- releases -----------------------------------------------------------------------

    def has_work(self) -> bool:
        """Releases or dropped loans are waiting to be processed."""
        return bool(self.loan_returns) or self.releases_published()

    def releases_published(self) -> bool:
        """Has a reader published releases?  (Only while some slot is held: a lane with
        frames then is a faulty reader's, found at the next poll that has work.)"""
        if not self.holders:
            return False
        return any(lane.available() for lane in self.lanes.values())

    def poll(self) -> bool:
        """Count every release the readers published (and take back dropped loans);
        ``True`` if some readers wait for room in their lane (listed in
        :attr:`ring_back`: the caller rings them).  A reader whose release is refused
        lands in :attr:`faulty`, and ``on_fault`` is called."""
        ring_back = self.ring_back
        ring_back.clear()
        for rank, lane in list(self.lanes.items()):
            try:
                if self._poll_lane(rank, lane):
                    ring_back.append(rank)
            except (SlotRefused, RingCorrupted) as exc:
                logger.warning("ringwire broadcast: reader rank %s: %s", rank, str(exc))
                self.faulty.append(rank)
        if self.send.loan_returns:
            self.send.poll()  # only loans: nobody writes the ShmSendPool's own lane
        if self.faulty and self.on_fault is not None:
            self.on_fault()
        return bool(ring_back)

    def _poll_lane(self, rank: int, lane: RingReader) -> bool:
        bit = 1 << rank
        try:
            while True:
                view = lane.next_frame()
                if view is None:
                    break
                try:
                    n = len(view)
                    if n % 16:
                        raise RingCorrupted(f"release frame of {n} bytes")
                    vals = struct.unpack(f"={n // 8}Q", view)
                finally:
                    view.release()
                for i in range(0, len(vals), 2):
                    self._release(vals[i], vals[i + 1], bit)
        finally:
            if lane.pending:
                lane.commit()
        return lane.writer_needs_doorbell()

    def _release(self, tag: int, gen: int, bit: int) -> None:
        h = self.holders.get(tag)
        if h is None or h[0] != gen or not h[1] & bit:
            raise SlotRefused(
                f"release of slot {tag:#x} generation {gen}, which this reader "
                "does not hold (double release, stale, or never sent)"
            )
        self.releases += 1
        self._clear(tag, h, bit)

    def release(self, rank: int, pairs: Sequence[tuple[int, int]]) -> None:
        """Releases ``(tag, generation)`` from remote reader ``rank``, received over its
        connection.  Raises :class:`SlotRefused` (the caller drops it) for a slot it does
        not hold; the ones before it count."""
        bit = 1 << rank
        for tag, gen in pairs:
            self._release(tag, gen, bit)

    def memory_of(self, ref: Any) -> tuple[Any, int]:
        """The bytes of the slot or arena range the writer's own ``SlotRef`` names, and
        the tag a release of it carries (what a remote reader's frame is sent from)."""
        big = self.send.big
        if big is not None and ref.pool == big.pool_id:
            return big.view(ref.slot, ref.nbytes), big_tag(ref.slot)
        return memoryview(self.seg.buf)[ref.offset : ref.offset + ref.nbytes], ref.slot  # (a view)

    def _clear(self, tag: int, h: list[int], bit: int) -> None:
        h[1] &= ~bit
        if not h[1]:
            del self.holders[tag]
            self._free(tag, h[0])

    def _alloc_of(self, tag: int) -> tuple[Any, int]:
        if tag >> 32 == BIG_HI and self.send.big is not None:
            return self.send.big, tag & 0xFFFFFFFF
        split = split_tag(tag)
        if split is None:
            return self.send.alloc, tag
        device, slot = split
        return self.send.cuda_pools[device].alloc, slot

    def _free(self, tag: int, gen: int) -> None:
        alloc, slot = self._alloc_of(tag)
        with self.send.lock:
            try:
                alloc.release(slot, gen)
            except SlotRefused:  # pragma: no cover - our own bookkeeping disagrees
                logger.exception("ringwire broadcast: slot %#x generation %s", tag, gen)

    # -- queries ------------------------------------------------------------------------

    def held_by(self, rank: int) -> int:
        """How many slots reader ``rank`` still has to release."""
        bit = 1 << rank
        return sum(1 for h in self.holders.values() if h[1] & bit)

    def holders_summary(self) -> dict[int, int]:
        """rank -> slots it holds, for the readers that hold any."""
        out: dict[int, int] = {}
        for h in self.holders.values():
            m, r = h[1], 0
            while m:
                if m & 1:
                    out[r] = out.get(r, 0) + 1
                m >>= 1
                r += 1
        return out

    def consumed(self, pairs: Sequence[tuple[int, int]]) -> bool:
        return self.send.consumed(pairs)

    def statistics(self) -> dict[str, Any]:
        out = self.send.statistics()
        out["releases_received"] = self.releases
        out["slots_reclaimed"] = self.shares_dropped
        return out

    # -- waiting for a release (counted: several waiters may park) ----------------------

    def park(self) -> None:
        self._parked += 1
        for lane in self.lanes.values():
            lane.park()

    def unpark(self) -> None:
        self._parked -= 1
        if not self._parked:
            for lane in self.lanes.values():
                lane.unpark()

    def close(self, consumer_gone: bool | None = None) -> None:
        """The writer closed: drop the lanes, close the pool (records already published
        stay resolvable for readers that have not read them, see ``ShmSendPool.close``)."""
        if self._closed:
            return
        self._closed = True
        for lane in self.lanes.values():
            lane.release()
        self.lanes.clear()
        self.holders.clear()
        self.send.close()


def passable_segment(size: int) -> tuple[Segment, int]:
    """A new segment of ``size`` bytes without a name (a memory file, or a named
    segment whose name is already gone), and a descriptor of it to hand to readers
    (the mapping and the descriptor keep the memory)."""
    seg = Segment.create(size)
    if seg.kind == "memfd":
        fd = seg.fd
        seg.fd = -1  # the hub's now
        return seg, fd
    try:
        shm = posix_ipc.SharedMemory(seg.name)
        try:
            fd = os.dup(shm.fd)
        finally:
            shm.close_fd()
    except BaseException:
        seg.unlink()
        seg.close()
        raise
    seg.unlink()
    return seg, fd
