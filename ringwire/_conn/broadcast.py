"""A broadcast writer: a send-only :class:`~ringwire._conn.endpoint.Endpoint` over its hub.

Broadcast 1 -> N on one host: one writer, up to ``readers`` readers, each with its own
cursor in one shared ring (:mod:`ringwire._wire.broadcast_ring`); the writer reuses
ring space once the slowest *live* reader has read it.  A reader is an ordinary
receiving :class:`~ringwire._conn.endpoint.Endpoint` over
:class:`~ringwire._shm.broadcast_reader.SubscriberTransport`; the writer is an
ordinary *sending* one, :class:`BroadcastEndpoint`, over the
:class:`~ringwire._shm.broadcast.BroadcastHub` as its transport: its sending lane is
the broadcast ring's writer, its send pool the shared slot pool
(:mod:`ringwire._shm.broadcast_pool`), its receiving lane carries nothing.  So
encoding, placing, publishing, parking, spinning, safe points, receipts and every
waiting loop (:mod:`ringwire._conn.waits`) are the channels' own code, and the
drivers (:mod:`ringwire._conn.broadcasting`) are the channels' drivers.  What this
module adds is what only a writer with many readers has:

* the loss policy (``on_reader_loss``, applied to what the hub reports);
* the stall deadline (``stall_timeout``: the endpoint's, which the waiting loops
  apply to every wait for room or a slot) and the errors that name whom the writer
  waited for (the loops' ``stalled`` hook);
* the slots of a published record are recorded against the readers admitted at that
  moment (``on_published``);
* the queries: :meth:`BroadcastEndpoint.readers`, :meth:`BroadcastEndpoint.statistics`,
  :meth:`BroadcastEndpoint.drop`, and the :func:`ready` loop behind ``wait_ready``.

Readers that go
---------------
The hub learns of a reader's death from its control socket's end of file, at once
(asyncio watches the hub's descriptor all the time, a blocking writer has a watcher
thread), and has already taken back its ring space and its share of every slot when
the policy hears of it.  Then ``on_reader_loss`` decides: ``"fail"`` (the default: a
tensor-parallel step with a rank missing is wrong) marks the endpoint broken -- every
send raises ``BrokenResourceError`` naming the rank, every other reader is told why
(an abort) and gets ``BrokenResourceError`` after what was published -- while
``"drop"`` logs it and goes on with the others.  A reader that *left* (closed its
subscription) is never a loss.  A reader whose head or release is impossible (a broken
or hostile process) is a loss too.

Readers that stall
------------------
A writer facing a full ring waits (spins, then parks) for the readers that hold the
space, at most ``stall_timeout`` seconds (and the blocking API's ``timeout``); then
:class:`~ringwire.ReaderStalled` names them -- rank, pid, how far behind -- and nothing
was published.  Waiting for a slot is bounded the same way and names the readers
holding slots.  :meth:`BroadcastEndpoint.drop` takes a reader out (it is told why and
gets ``BrokenResourceError``); a dropped reader that goes on reading finds out at once
(the horizon check of :class:`~ringwire._wire.broadcast_ring.BroadcastReader`), never
reads overwritten bytes as records.

Readers on other hosts: the hub also serves them (:mod:`ringwire._net.fanout`, one
rank space), so the policy, ``drop``, ``wait_ready`` and the stall errors cover them
unchanged; :meth:`BroadcastEndpoint.readers` names their hosts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from anyio import BrokenResourceError, ClosedResourceError

from .._errors import SlotWaitTimeout
from .._pool.cuda import CudaNeed
from .._shm.broadcast import BroadcastHub, ReaderEvent
from .endpoint import DEFAULT_SPIN_US, Endpoint
from .waits import Loop, Wait

__all__ = [
    "LOSS_POLICIES",
    "BroadcastEndpoint",
    "BroadcastStatistics",
    "ReaderInfo",
    "ready",
]

logger = logging.getLogger("ringwire")
LOSS_POLICIES = ("fail", "drop")


@dataclass(frozen=True)
class ReaderInfo:
    """One reader of a broadcast, as :meth:`Broadcaster.readers` lists it."""

    rank: int
    pid: int
    ready: bool  # it attached everything (joined: space is kept for it either way)
    behind: int  # bytes published that it has not consumed (remote: sent, not consumed)
    slots_held: int  # slots it has not released yet
    host: str = ""  # a remote reader's host ("" for a reader on this host)


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
    large_sent: int = 0  # arrays larger than every slot class sent (through the arena)
    large_in_use: int = 0  # of those, not released by every reader yet
    large_bytes_in_use: int = 0
    remote_readers: int = 0  # of ``readers``, those on other hosts
    remote_bytes_queued: int = 0  # record bytes sent to remote readers, not consumed yet


_SLOT_FIELDS = {
    "slots_in_use",
    "slots_free",
    "slot_bytes_in_use",
    "releases_received",
    "loans_outstanding",
    "inline_fallbacks",
    "slots_reclaimed",
    "large_sent",
    "large_in_use",
    "large_bytes_in_use",
}


class BroadcastEndpoint(Endpoint):
    """The writer of a broadcast: a send-only endpoint over ``hub`` (see the module
    docstring).  Not thread-safe, as every endpoint: the blocking driver serialises
    everything with its send lock (its watcher thread too), the async one runs on
    one event loop."""

    def __init__(
        self,
        hub: BroadcastHub,
        *,
        on_reader_loss: str = "fail",
        stall_timeout: float | None = 60.0,
        spin_us: float = DEFAULT_SPIN_US,
    ) -> None:
        if on_reader_loss not in LOSS_POLICIES:
            raise ValueError(
                f"on_reader_loss must be one of {LOSS_POLICIES}, not {on_reader_loss!r}"
            )
        if stall_timeout is not None and not stall_timeout > 0:
            raise ValueError("stall_timeout must be None or > 0")
        super().__init__(hub, spin_us=spin_us, name=hub.path)
        self.hub = hub
        self.policy = on_reader_loss
        self.stall_timeout = stall_timeout
        self.stalls = self.dropped = 0
        self.stalled = self._stalled
        hub.on_lost = self._lost
        if hub.pool is not None:
            self.on_published = hub.published

    def __repr__(self) -> str:
        return f"<BroadcastEndpoint {self.hub.path} {self.state()}>"

    # -- state ------------------------------------------------------------------------

    def check_send(self) -> None:
        """Raise what a send in the current state raises (nothing while open)."""
        if self.closed:
            raise ClosedResourceError
        if self.broken is not None:
            raise BrokenResourceError(str(self.broken)) from self.broken

    def _lost(self, ev: ReaderEvent) -> None:
        """The hub lost a reader: apply the policy."""
        what = f"broadcast reader rank {ev.rank} (pid {ev.pid}) {ev.detail}"
        if self.closed or self.broken is not None:
            return
        if self.policy == "drop":
            logger.warning("ringwire broadcast %s: %s; going on without it", self.hub.path, what)
            return
        logger.warning("ringwire broadcast %s failed: %s", self.hub.path, what)
        self.broken = BrokenResourceError(f"the broadcast failed: {what}")
        self.tx_blocked = True
        self.hub.fail(f"the broadcast failed: {what}")

    def drop(self, rank: int, reason: str) -> bool:
        """Stop keeping anything for reader ``rank`` (see ``Broadcaster.drop_reader``)."""
        if self.hub.drop(rank, reason):
            self.dropped += 1
            self.hub.settle()
            return True
        return False

    # -- what a writer that waited too long says ----------------------------------------

    def _stalled(self, need: Any, waited: float, slot: bool) -> TimeoutError:
        """The waiting loops' ``stalled`` hook: :class:`ReaderStalled` naming the
        readers that hold the ring's space (``slot``: the slots) it waited for."""
        self.stalls += 1
        if not slot:
            return self.hub.stalled_on_room(need, waited)
        err = self.hub.stalled_on_slot(need, waited, stall=True)
        assert isinstance(err, TimeoutError)
        return err

    def slot_timeout(self, nbytes: int | CudaNeed) -> SlotWaitTimeout:
        pool = self.hub.pool
        assert pool is not None
        waited = pool.config.wait_timeout or 0.0
        err = self.hub.stalled_on_slot(nbytes, waited, stall=False)
        assert isinstance(err, SlotWaitTimeout)
        return err

    def warn_slow_slot_wait(self, nbytes: int | CudaNeed, waited: float) -> None:
        if self.slot_wait_warned or self.hub.pool is None:
            return
        self.slot_wait_warned = True
        logger.warning(
            "ringwire: %s (still waiting)",
            self.hub.stalled_on_slot(nbytes, waited, stall=False),
        )

    # -- queries ----------------------------------------------------------------------

    def readers(self, *, settle: bool = True) -> list[ReaderInfo]:
        """The readers admitted now, by rank (``settle``: as :meth:`statistics`)."""
        if settle and not self.closed:
            self.slot_safe_point()
        hub, ring, bpool = self.hub, self.hub.writer, self.hub.pool
        out = [
            ReaderInfo(
                rank=r,
                pid=c.pid,
                ready=c.ready,
                behind=ring.behind(r),
                slots_held=bpool.held_by(r) if bpool is not None else 0,
            )
            for r, c in hub.conns.items()
        ]
        if hub.remote is not None:
            out += [
                ReaderInfo(
                    rank=r,
                    pid=rr.pid,
                    ready=True,
                    behind=rr.behind,
                    slots_held=bpool.held_by(r) if bpool is not None else 0,
                    host=rr.host,
                )
                for r, rr in hub.remote.conns.items()
            ]
        return sorted(out, key=lambda info: info.rank)

    def statistics(self, *, settle: bool = True) -> BroadcastStatistics:  # type: ignore[override]
        """A snapshot; ``settle`` first runs a slot safe point (the owner's thread only;
        ``settle=False`` touches nothing, from any thread: the metrics collector)."""
        hub = self.hub
        slots: dict[str, Any] = {}
        fill = 0
        remote = list(hub.remote.conns.values()) if hub.remote is not None else []
        if not self.closed:
            if settle:
                self.slot_safe_point()
            fill = hub.writer.used()
            if hub.pool is not None:
                slots = {k: v for k, v in hub.pool.statistics().items() if k in _SLOT_FIELDS}
        return BroadcastStatistics(
            records_sent=self.n_sent,
            bytes_sent=self.b_sent,
            capacity=hub.writer.capacity,
            fill=fill,
            readers=len(hub.conns) + len(remote),
            ready_readers=hub.ready_count,
            joined=hub.joined,
            left=hub.left,
            lost=hub.lost,
            dropped=self.dropped,
            refused=hub.refused + (hub.remote.refused if hub.remote is not None else 0),
            stalls=self.stalls,
            send_parks=self.send_parks,
            slot_waits=self.slot_waits,
            doorbells_sent=hub.doorbells_sent,
            doorbells_received=hub.doorbells_received,
            remote_readers=len(remote),
            remote_bytes_queued=sum(rr.behind for rr in remote),
            **slots,
        )


def ready(core: BroadcastEndpoint, n: int, deadline: float | None = None) -> Loop[int]:
    """Until at least ``n`` readers are ready; return how many are.  (Every join and
    every ``Started`` arrives on the hub's descriptor: a drain moves the wake
    generation.)"""
    hub = core.hub
    while True:
        if not core.closed:
            core.slot_safe_point()
        core.check_send()
        if hub.ready_count >= n:
            return hub.ready_count
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(
                f"broadcast {hub.path}: {hub.ready_count} of {n} readers ready before the timeout"
            )
        yield Wait(core.wake_gen, deadline)
