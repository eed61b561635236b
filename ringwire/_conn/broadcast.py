"""A broadcast writer's core (every operation that does not wait) and its waiting loops.

Broadcast 1 -> N on one host: one writer, up to ``readers`` readers, each with its own
cursor in one shared ring (:mod:`ringwire._wire.broadcast_ring`); the writer reuses
ring space once the slowest *live* reader has read it.  A reader is an ordinary
receiving :class:`~ringwire._conn.endpoint.Endpoint` over
:class:`~ringwire._shm.broadcast_reader.SubscriberTransport`, so records, codecs,
slot views, finalizers and errors are exactly a channel's.  This module is the writer:

* :class:`BroadcastCore` holds its state and does what needs no waiting -- encode
  (placing large arrays in the shared slot pool, :mod:`ringwire._shm.broadcast_pool`),
  publish once for everyone, ring the readers that parked, count releases, apply the
  loss policy;
* the loops (:func:`room`, :func:`slot`, :func:`send_placed`, :func:`send_many_placed`,
  :func:`loan`, :func:`consumed`, :func:`ready`) are written once in the style of
  :mod:`ringwire._conn.waits`: try, park, re-check, and yield a
  :class:`~ringwire._conn.waits.Wait` when only waiting is left; the async and
  blocking drivers (:mod:`ringwire._conn.broadcasting`) perform the waits.

Readers that go
---------------
The hub (:class:`~ringwire._shm.broadcast.BroadcastHub`) learns of a reader's death
from its control socket's end of file, at once (asyncio watches the hub's descriptor
all the time, a blocking writer has a watcher thread), and has already taken back its
ring space and its share of every slot when the core hears of it.  Then
``on_reader_loss`` decides: ``"fail"`` (the default: a tensor-parallel step with a
rank missing is wrong) marks the broadcast broken -- every operation raises
``BrokenResourceError`` naming the rank, every other reader is told why (an abort) and
gets ``BrokenResourceError`` after what was published -- while ``"drop"`` logs it and
goes on with the others.  A reader that *left* (closed its subscription) is never a
loss.  A reader whose head or release is impossible (a broken or hostile process) is
a loss too.

Readers that stall
------------------
A writer facing a full ring waits for the readers that hold the space (the slowest
live ones), at most ``stall_timeout`` seconds (and the blocking API's ``timeout``);
then :class:`~ringwire.ReaderStalled` names them -- rank, pid, how far behind -- and
nothing was published.  Waiting for a slot is bounded the same way and names the
readers holding slots.  :meth:`BroadcastCore.drop` takes a reader out (it is told
why and gets ``BrokenResourceError``); a dropped reader that goes on reading finds
out at once (the horizon check of :class:`~ringwire._wire.broadcast_ring.BroadcastReader`),
never reads overwritten bytes as records.

The seam for remote readers: the core talks to its hub through what
:class:`~ringwire._shm.broadcast.BroadcastHub` offers -- ``writer`` (publish, heads,
doorbell lists), ``pool``, ``poll()`` with ``events``, ``ring()``, ``drop()``,
``lose()``, ``fail()``, ``live_mask`` -- so a hub that also forwards to TCP readers
(once TCP channels exist, issue "Beyond one host") needs no change here.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from anyio import BrokenResourceError, ClosedResourceError

from .._errors import NeedSlot, ReaderStalled, SlotsExhausted
from .._pool.cuda import CudaNeed
from .._pool.protocols import Placed
from .._shm.broadcast import BroadcastHub, ReaderEvent
from .._wire.codec import Encoder
from .._wire.control import DOORBELL_DATA, DOORBELL_SPACE
from .waits import LOAN_TICK, Loop, Wait

__all__ = [
    "LOSS_POLICIES",
    "BroadcastCore",
    "BroadcastStatistics",
    "ReaderInfo",
    "consumed",
    "loan",
    "ready",
    "send_many_placed",
    "send_placed",
]

logger = logging.getLogger("ringwire")
LOSS_POLICIES = ("fail", "drop")
ALIVE_EVERY = 8  # a writer nobody watches polls its hub every this many records


@dataclass(frozen=True)
class ReaderInfo:
    """One reader of a broadcast, as :meth:`Broadcaster.readers` lists it."""

    rank: int
    pid: int
    ready: bool  # it attached everything (joined: space is kept for it either way)
    behind: int  # bytes published that it has not consumed
    slots_held: int  # slots it has not released yet


@dataclass(frozen=True)
class BroadcastStatistics:
    """A snapshot of a broadcast writer's counters."""

    records_sent: int
    bytes_sent: int
    capacity: int
    fill: int  # bytes the slowest live reader has not consumed
    readers: int  # admitted now
    ready_readers: int
    joined: int  # admissions so far
    left: int  # readers that closed (or went before they were ready)
    lost: int  # readers that died, aborted, or broke the protocol
    dropped: int  # readers the writer dropped (drop_reader)
    refused: int  # joins refused
    stalls: int  # ReaderStalled raised
    send_parks: int
    slot_waits: int
    doorbells_sent: int
    doorbells_received: int
    slots_in_use: int = 0
    slots_free: dict[int, int] | None = None
    slot_bytes_in_use: int = 0
    releases_received: int = 0
    loans_outstanding: int = 0
    inline_fallbacks: int = 0
    slots_reclaimed: int = 0  # slot shares given up for readers that went


def _who(hub: BroadcastHub, ranks: Sequence[int]) -> str:
    return ", ".join(f"rank {r} (pid {hub.pid_of(r)})" for r in ranks)


class BroadcastCore:
    """The writer's state and its non-waiting operations (see the module docstring).

    Not thread-safe: the blocking driver serialises everything with one lock, the
    async one runs on one event loop.  The drivers wait with the channels' wakers
    (:class:`~ringwire._conn.async_channel.AsyncWaker`,
    :class:`~ringwire._conn.sync_channel.SyncWaker`), which read ``transport.fileno()``,
    ``wake_gen``, ``eof``, ``closed``, ``broken`` and ``watched`` and call ``drain()``:
    the same names as an :class:`~ringwire._conn.endpoint.Endpoint`'s."""

    def __init__(
        self,
        hub: BroadcastHub,
        *,
        on_reader_loss: str = "fail",
        stall_timeout: float | None = 60.0,
    ) -> None:
        if on_reader_loss not in LOSS_POLICIES:
            raise ValueError(
                f"on_reader_loss must be one of {LOSS_POLICIES}, not {on_reader_loss!r}"
            )
        if stall_timeout is not None and not stall_timeout > 0:
            raise ValueError("stall_timeout must be None or > 0")
        self.hub = hub
        self.transport = hub  # what the drivers' wakers wait on: ``transport.fileno()``
        self.eof = False  # (the wakers' "peer gone": a broadcast outlives its readers)
        self.ring = hub.writer
        self.bpool = hub.pool
        self.pool = hub.pool.send if hub.pool is not None else None
        self.policy = on_reader_loss
        self.stall_timeout = stall_timeout
        self.enc = Encoder()
        self.closed = False
        self.closing = False  # close() was called (another thread may still hold the lock)
        self.broken: BaseException | None = None
        self.watched = False  # a driver watches the hub all the time
        self.wake_gen = 0
        self.tx_parked = 0
        self.n_sent = self.b_sent = 0
        self.send_parks = self.slot_waits = self.stalls = self.dropped = 0
        self.losses: list[ReaderEvent] = []  # every reader lost, in order

    def __repr__(self) -> str:
        return f"<BroadcastCore {self.hub.path} {self.state()}>"

    def state(self) -> str:
        return "closed" if self.closed else "broken" if self.broken is not None else "open"

    # -- state ------------------------------------------------------------------------

    def check_send(self) -> None:
        if self.closed or self.closing:
            raise ClosedResourceError
        if self.broken is not None:
            raise BrokenResourceError(str(self.broken)) from self.broken

    @property
    def done(self) -> bool:
        """Closed or broken: a waiter stops waiting."""
        return self.closed or self.closing or self.broken is not None

    # -- readers coming and going -------------------------------------------------------

    def drain(self) -> None:
        """Do what the hub has pending (joins, doorbells, hang-ups) without waiting,
        apply the loss policy, bump the wake generation, count releases."""
        if self.closed:
            return
        self.hub.poll()
        self.wake_gen += 1
        self.safe_point()

    def safe_point(self) -> None:
        """Count releases, take back dropped loans, retire faulty readers, apply the
        loss policy to what happened.  Never waits."""
        bpool = self.bpool
        if bpool is not None and (bpool.holders or bpool.send.loan_returns):
            back = bpool.poll()
            if back:
                self.hub.ring(back, DOORBELL_SPACE)
            if bpool.faulty:
                for r in bpool.faulty:
                    self.hub.lose(r, "released a slot it did not hold")
                bpool.faulty.clear()
        if self.ring.faulty:
            for r in self.ring.faulty:
                self.hub.lose(r, "moved its head out of the ring")
            self.ring.faulty.clear()
        if self.hub.events:
            self._apply_events()

    def _apply_events(self) -> None:
        events = self.hub.events
        for ev in events:
            if ev.kind == "lost":
                self.losses.append(ev)
                self._lost(ev)
        events.clear()

    def _lost(self, ev: ReaderEvent) -> None:
        what = f"broadcast reader rank {ev.rank} (pid {ev.pid}) {ev.detail}"
        if self.closed or self.broken is not None:
            return
        if self.policy == "drop":
            logger.warning("ringwire broadcast %s: %s; going on without it", self.hub.path, what)
            return
        logger.warning("ringwire broadcast %s failed: %s", self.hub.path, what)
        self.broken = BrokenResourceError(f"the broadcast failed: {what}")
        self.hub.fail(f"the broadcast failed: {what}")

    def drop(self, rank: int, reason: str) -> bool:
        if self.hub.drop(rank, reason):
            self.dropped += 1
            self.safe_point()
            return True
        return False

    def maybe_poll(self) -> None:
        """A writer nobody watches looks at its hub every :data:`ALIVE_EVERY` records."""
        if not self.watched and not self.n_sent % ALIVE_EVERY:
            self.hub.poll()
            self.safe_point()

    # -- sending without waiting ----------------------------------------------------------

    def encode_placed(self, item: Any, policy: str | None) -> tuple[bytes, Placed]:
        """Encode one record, placing its large arrays in slots (raises
        :class:`NeedSlot` under policy "wait" when none is free; nothing is held then)."""
        pool = self.pool
        if pool is None:
            payload = self.enc.encode(item)
            placed: Placed = []
        else:
            if self.closed or self.closing or self.broken is not None:
                self.check_send()  # nothing to place
            placed = pool.placement(policy)
            try:
                payload = self.enc.encode_with(item, placed)
            except BaseException:
                pool.abort(placed)
                raise
        if len(payload) > self.ring.max_payload:
            try:
                self.ring.check_size(len(payload))
            finally:
                if pool is not None:
                    pool.abort(placed)
        return payload, placed

    def encode_batch(
        self, items: Sequence[Any], start: int, policy: str | None
    ) -> tuple[list[bytes], list[Placed], int | CudaNeed | None]:
        payloads: list[bytes] = []
        placed: list[Placed] = []
        try:
            for k in range(start, len(items)):
                try:
                    payload, p = self.encode_placed(items[k], policy)
                except NeedSlot as need:
                    return payloads, placed, need.nbytes
                payloads.append(payload)
                placed.append(p)
        except BaseException:
            self.abort_all(placed)
            raise
        return payloads, placed, None

    def abort_all(self, placed: Sequence[Placed]) -> None:
        if self.pool is not None:
            for p in placed:
                self.pool.abort(p)

    def try_send(self, payload: bytes, placed: Placed) -> bool:
        """Publish one record for every reader; ``False`` if the ring has no room."""
        if self.closed or self.closing or self.broken is not None:
            self.check_send()
        ring = self.ring
        if not ring.try_write(payload):
            if ring.faulty:
                self.safe_point()
            return False
        if placed:
            assert self.bpool is not None
            self.bpool.published(placed, self.hub.live_mask)
        self.n_sent += 1
        self.b_sent += len(payload)
        if ring.reader_needs_doorbell():
            self.hub.ring(ring.to_ring, DOORBELL_DATA)
        if ring.faulty:
            self.safe_point()
        self.maybe_poll()
        return True

    def try_send_many(self, payloads: Sequence[bytes], placed: Sequence[Placed], start: int) -> int:
        self.check_send()
        ring = self.ring
        n, nbytes = ring.write_many(payloads, start)
        if n:
            if self.bpool is not None and placed:
                mask = self.hub.live_mask
                for k in range(start, start + n):
                    if placed[k]:
                        self.bpool.published(placed[k], mask)
            self.n_sent += n
            self.b_sent += nbytes
            if ring.reader_needs_doorbell():
                self.hub.ring(ring.to_ring, DOORBELL_DATA)
        if not self.watched:
            self.hub.poll()  # a batch is a good moment to look (a writer nobody watches)
        if ring.faulty or self.hub.events:
            self.safe_point()
        return n

    def send_ready(self, size: int) -> bool:
        """Should a writer waiting for room stop waiting?"""
        return self.done or self.ring.fits_now(size)

    def stall_deadline(self) -> float | None:
        return None if self.stall_timeout is None else time.monotonic() + self.stall_timeout

    def stalled(self, size: int, waited: float) -> ReaderStalled:
        self.stalls += 1
        slow = self.ring.laggards(size)
        if not slow:
            slow = sorted(self.ring.live, key=self.ring.head_of)[:1]
        pids = tuple(self.hub.pid_of(r) for r in slow)
        behind = ", ".join(
            f"rank {r} (pid {self.hub.pid_of(r)}, {self.ring.behind(r)} bytes behind"
            + ("" if self.hub.is_ready(r) else ", not ready yet")
            + ")"
            for r in slow
        )
        return ReaderStalled(
            f"broadcast {self.hub.path}: no room for a {size}-byte record after {waited:.3g} s: "
            f"waiting for {behind or 'no reader'} (ring of {self.ring.capacity} bytes); "
            "drop_reader() them, or give them more time",
            tuple(slow),
            pids,
        )

    def park_tx(self) -> None:
        self.tx_parked += 1
        self.ring.park()

    def unpark_tx(self) -> None:
        self.tx_parked -= 1
        if not self.tx_parked and not self.closed:
            self.ring.unpark()

    # -- slots ----------------------------------------------------------------------------

    def require_pool(self) -> Any:
        if self.pool is None:
            raise SlotsExhausted("this broadcast has no slot pool (it was made with slots=None)")
        return self.pool

    def slot_ready(self, nbytes: int | CudaNeed) -> bool:
        assert self.pool is not None
        self.safe_point()
        return self.done or self.pool.can_allocate(nbytes)

    def slot_stalled(self, nbytes: Any, waited: float, stall: bool) -> Exception:
        assert self.pool is not None and self.bpool is not None
        held = sorted(self.bpool.holders_summary().items(), key=lambda kv: -kv[1])
        who = ", ".join(f"rank {r} (pid {self.hub.pid_of(r)}) holds {n}" for r, n in held)
        text = (
            f"broadcast {self.hub.path}: no slot for {nbytes} bytes was released within "
            f"{waited:.3g} s ({self.pool.config.describe()}; {who or 'no reader holds any'}): "
            "readers keep received arrays alive -- release them, or keep copy_out() copies"
        )
        if stall:
            self.stalls += 1
            return ReaderStalled(
                text, tuple(r for r, _ in held), tuple(self.hub.pid_of(r) for r, _ in held)
            )
        return SlotsExhausted(text)

    def loan_now(self, spec: Any, policy: str) -> Any:
        pool = self.require_pool()
        self.check_send()
        self.safe_point()
        arr = pool.loan(*spec)
        if arr is not None:
            return arr
        if policy == "inline":
            return pool.loan_fallback(*spec)
        if policy == "error" or pool.futile(spec[-1]):
            raise SlotsExhausted(
                f"no free slot for a loan of {spec[-1]} bytes (pool: {pool.config.describe()})"
            )
        return None

    def consumed(self, pairs: Sequence[tuple[int, int]]) -> bool:
        """Has every reader released every slot in ``pairs``?  (Readers that went count
        as done.)"""
        if self.bpool is None:
            return True
        if not self.closed:
            self.safe_point()
        return self.bpool.consumed(pairs)

    # -- queries ----------------------------------------------------------------------

    def readers(self) -> list[ReaderInfo]:
        hub, ring, bpool = self.hub, self.ring, self.bpool
        return [
            ReaderInfo(
                rank=r,
                pid=c.pid,
                ready=c.ready,
                behind=ring.behind(r),
                slots_held=bpool.held_by(r) if bpool is not None else 0,
            )
            for r, c in sorted(hub.conns.items())
        ]

    def statistics(self) -> BroadcastStatistics:
        hub = self.hub
        slots: dict[str, Any] = {}
        fill = 0
        if not self.closed:
            self.safe_point()
            fill = self.ring.used()
            if self.bpool is not None:
                slots = self.bpool.statistics()
                slots.pop("cuda_pools", None)
                slots = {k: v for k, v in slots.items() if k in _SLOT_FIELDS}
        return BroadcastStatistics(
            records_sent=self.n_sent,
            bytes_sent=self.b_sent,
            capacity=self.ring.capacity,
            fill=fill,
            readers=len(hub.conns),
            ready_readers=hub.ready_count,
            joined=hub.joined,
            left=hub.left,
            lost=hub.lost,
            dropped=self.dropped,
            refused=hub.refused,
            stalls=self.stalls,
            send_parks=self.send_parks,
            slot_waits=self.slot_waits,
            doorbells_sent=hub.doorbells_sent,
            doorbells_received=hub.doorbells_received,
            **slots,
        )

    # -- closing ----------------------------------------------------------------------

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.hub.close()


_SLOT_FIELDS = {
    "slots_in_use",
    "slots_free",
    "slot_bytes_in_use",
    "releases_received",
    "loans_outstanding",
    "inline_fallbacks",
    "slots_reclaimed",
}


# ======================================================================================
# the waiting loops
# ======================================================================================

_TX, _SLOTS = 0, 1


def _park(
    core: BroadcastCore,
    lane: int,
    ready: Callable[..., bool],
    args: tuple[Any, ...],
    until: float | None,
) -> Loop[None]:
    """Park, re-check ``ready(*args)``, and wait unless it became true (the eventcount
    of :mod:`ringwire._wire.broadcast_ring`: a reader that frees space after the park
    sees the flag and rings)."""
    gen = core.wake_gen
    bpool = core.bpool
    if lane == _TX:
        core.park_tx()
    else:
        assert bpool is not None
        bpool.park()
    try:
        if ready(*args):
            return
        if lane == _TX:
            core.send_parks += 1
        else:
            core.slot_waits += 1
        yield Wait(gen, until)
    finally:
        if lane == _TX:
            core.unpark_tx()
        elif bpool is not None:
            bpool.unpark()


def _earliest(*limits: float | None) -> float | None:
    out = math.inf
    for t in limits:
        if t is not None:
            out = min(out, t)
    return None if out == math.inf else out


def room(
    core: BroadcastCore, payload: bytes, placed: Placed, deadline: float | None = None
) -> Loop[None]:
    """Until ``payload`` is published; its slots are given back if it is not (a stall,
    a timeout, a cancellation, the broadcast failing)."""
    size = len(payload)
    t0 = time.monotonic()
    limit = _earliest(deadline, core.stall_deadline())
    published = False
    try:
        while not core.try_send(payload, placed):
            if limit is not None and time.monotonic() >= limit:
                raise core.stalled(size, time.monotonic() - t0)
            yield from _park(core, _TX, core.send_ready, (size,), limit)
        published = True
    finally:
        if not published and placed and core.pool is not None:
            core.pool.abort(placed)


def room_many(
    core: BroadcastCore,
    payloads: Sequence[bytes],
    placed: Sequence[Placed],
    deadline: float | None = None,
) -> Loop[None]:
    """Until every payload is published (slots of those that were not go back)."""
    t0 = time.monotonic()
    limit = _earliest(deadline, core.stall_deadline())
    i = 0
    try:
        i = core.try_send_many(payloads, placed, 0)
        while i < len(payloads):
            size = len(payloads[i])
            if limit is not None and time.monotonic() >= limit:
                raise core.stalled(size, time.monotonic() - t0)
            yield from _park(core, _TX, core.send_ready, (size,), limit)
            i += core.try_send_many(payloads, placed, i)
    finally:
        core.abort_all(placed[i:])


def slot(core: BroadcastCore, nbytes: Any, deadline: float | None = None) -> Loop[None]:
    """Until a slot for ``nbytes`` is free: at most the pool's ``wait_timeout``
    (:class:`SlotsExhausted`) and the ``stall_timeout`` (:class:`ReaderStalled`),
    both naming the readers that hold slots."""
    pool = core.require_pool()
    t0 = time.monotonic()
    wait_t = pool.config.wait_timeout
    slot_limit = None if wait_t is None else t0 + wait_t
    stall_limit = core.stall_deadline()
    while True:
        core.check_send()
        if core.slot_ready(nbytes):
            core.check_send()
            return
        if pool.futile(nbytes):
            raise SlotsExhausted(f"no slot can hold {nbytes} bytes ({pool.config.describe()})")
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise core.slot_stalled(nbytes, now - t0, stall=True)
        if slot_limit is not None and now >= slot_limit:
            raise core.slot_stalled(nbytes, now - t0, stall=False)
        if stall_limit is not None and now >= stall_limit:
            raise core.slot_stalled(nbytes, now - t0, stall=True)
        until = _earliest(deadline, slot_limit, stall_limit)
        if pool.loans:
            until = _earliest(until, now + LOAN_TICK)  # a dropped loan rings no doorbell
        yield from _park(core, _SLOTS, core.slot_ready, (nbytes,), until)


def send_placed(
    core: BroadcastCore, item: Any, policy: str | None, deadline: float | None = None
) -> Loop[Placed]:
    """Encode ``item`` (waiting for slots under policy "wait") and publish it; return
    the slots it took."""
    core.safe_point()
    while True:
        try:
            payload, placed = core.encode_placed(item, policy)
            break
        except NeedSlot as need:
            yield from slot(core, need.nbytes, deadline)
    if not core.try_send(payload, placed):
        yield from room(core, payload, placed, deadline)
    return placed


def send_many_placed(
    core: BroadcastCore, items: Sequence[Any], policy: str | None, deadline: float | None = None
) -> Loop[None]:
    """Send ``items`` in batches; a batch ends before a record that waits for a slot."""
    core.safe_point()
    i = 0
    while i < len(items):
        payloads, placed, need = core.encode_batch(items, i, policy)
        if payloads:
            yield from room_many(core, payloads, placed, deadline)
            i += len(payloads)
        if need is not None:
            yield from slot(core, need, deadline)


def loan(core: BroadcastCore, spec: Any, policy: str, deadline: float | None = None) -> Loop[Any]:
    """A loaned array, waiting for a slot under policy "wait"."""
    while True:
        arr = core.loan_now(spec, policy)
        if arr is not None:
            return arr
        yield from slot(core, spec[-1], deadline)


def consumed(
    core: BroadcastCore, pairs: Sequence[tuple[int, int]], deadline: float | None = None
) -> Loop[None]:
    """Until every reader has released every slot in ``pairs`` (or gone)."""
    while not core.consumed(pairs):
        if core.closed:
            raise ClosedResourceError
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError("timed out waiting for every reader to release the record's slots")
        yield from _park(core, _SLOTS, _has_work, (core,), deadline)


def _has_work(core: BroadcastCore) -> bool:
    return core.closed or (core.bpool is not None and core.bpool.has_work())


def ready(core: BroadcastCore, n: int, deadline: float | None = None) -> Loop[int]:
    """Until at least ``n`` readers are ready; return how many are."""
    hub = core.hub
    while True:
        core.safe_point()
        core.check_send()
        if hub.ready_count >= n:
            return hub.ready_count
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(
                f"broadcast {hub.path}: {hub.ready_count} of {n} readers ready before the timeout"
            )
        yield Wait(core.wake_gen, deadline)
