"""The seams between an endpoint and a transport's tensor pools: what it may ask of them.

A transport that carries large arrays beside its records lends its endpoint two pools
(:attr:`ringwire._conn.transport.Transport.send_pool` / ``recv_pool``): a
:class:`SendPool` that places this side's arrays (and loans memory to fill in place)
and a :class:`RecvPool` that turns the peer's references into views.  The endpoint
knows them only through these protocols -- shared-memory slots
(:mod:`ringwire._shm.sendpool`, :mod:`ringwire._shm.recvpool`), ZeroMQ frames and NIXL
reads (:mod:`ringwire._net.pools`, :mod:`ringwire._net.nixlpools`) implement them --
and what differs between transports that the endpoint must know is declared here as
an attribute computed once, never found out with ``isinstance``:

* :attr:`SendPool.releases_ready` -- a cheap callable the endpoint calls at every safe
  point (``pool.loan_returns or pool.releases_ready()`` is ``has_work()`` without a
  Python frame): has the peer released anything not yet taken back?
* :attr:`SendPool.reuses_placements` -- may an empty :class:`Placement` (one that
  placed nothing) serve the next record?  (So a record without arrays costs no new
  placement.)  Only where a placement holds nothing beside its list.

A record's trip: the endpoint asks :meth:`SendPool.placement` for a :class:`Placement`
and encodes with it; the placement calls :meth:`SendPool.place` for every array, which
returns the reference to write (or ``None``: inline) and appends what it took; the
endpoint gives it all back with :meth:`SendPool.abort` if the record is not published,
or keeps it (:data:`Placed`) for a receipt, which asks :meth:`SendPool.consumed`.

What every :class:`RecvPool` does alike -- its counters and statistics, a decode that
salvages a record that fails, flushing releases -- is :class:`RecvPoolBase`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from .._errors import DecodeError
from .._wire.codec import Decoder
from .._wire.release import ReleaseQueue
from .cuda import CudaNeed
from .slotconfig import SlotConfig

__all__ = ["Placed", "Placement", "RecvPool", "RecvPoolBase", "SendPool"]

Placed = list[tuple[int, int, bool]]
"""What one record took from a send pool: ``(slot or tag, generation, was a loan)`` of
each slot or buffer -- what :meth:`SendPool.abort` gives back, what a receipt waits for."""


class Placement(list[tuple[int, int, bool]]):
    """The placer of one record, and what it placed.

    ``Encoder.encode_with(item, placement)`` calls it for every array and tensor of
    the record; the placement itself is then the list of everything the record took
    (:data:`Placed`).  Made by :meth:`SendPool.placement` (a list with two attributes:
    one is made per record on the send path, so it must be cheap); a transport whose
    placements carry more (the TCP frames) subclasses it."""

    __slots__ = ("pool", "policy")
    pool: SendPool
    policy: str  # "wait", "inline" or "error": what to do when no slot is free

    def __call__(self, obj: Any) -> Any:
        return self.pool.place(obj, self)


class SendPool(Protocol):
    """The producer's side: places this end's arrays, loans, takes back releases.

    Not thread-safe by itself: the endpoint calls it under its driver's send lock (or
    from one event loop); finalizers only append to :attr:`loan_returns`."""

    # (read-only for the endpoint: properties here, so a pool may declare them as it
    # likes -- attributes, class attributes, properties)
    @property
    def config(self) -> SlotConfig: ...
    @property
    def gone(self) -> bool:
        """The consumer is gone: everything was reclaimed."""

    @property
    def reclaimed(self) -> int:
        """Slots taken back because the consumer went away."""

    @property
    def loan_returns(self) -> deque[tuple[int, int]]:
        """Loans dropped unsent (appended by their finalizers), not yet taken back."""

    @property
    def releases_ready(self) -> Callable[[], Any]:
        """Cheap: did the peer release anything?  (See the module docstring.)"""

    @property
    def reuses_placements(self) -> bool:
        """An empty placement may serve the next record (see the module docstring)."""

    @property
    def loans(self) -> Collection[int]:
        """The loans out now."""

    def statistics(self) -> dict[str, Any]:
        """The pool's fields of :class:`~ringwire.ChannelStatistics`."""

    def has_work(self) -> bool:
        """Releases or dropped loans wait for :meth:`poll`."""

    def can_allocate(self, nbytes: int | CudaNeed) -> bool:
        """Could an array of ``nbytes`` be placed now?"""

    def futile(self, need: int | CudaNeed = 0) -> bool:
        """Nothing is in use: waiting for a release cannot help."""

    def consumed(self, pairs: Sequence[tuple[int, int]]) -> bool:
        """Has the consumer released every slot in ``pairs`` (``True`` once it is gone)?"""

    def placement(self, policy: str | None) -> Placement:
        """The placer of one record (``policy``: the send's, or ``None``: the config's)."""

    def place(self, obj: Any, placement: Any) -> Any:
        """The reference to write for array ``obj`` (what it took is appended to
        ``placement``, one this pool made), or
        ``None`` to send it inline.  Raises :class:`~ringwire._errors.NeedSlot`
        (policy "wait": nothing free now), :class:`~ringwire.SlotsExhausted` (policy
        "error"), :class:`~ringwire.SlotMisuse` (a loan sent twice)."""

    def abort(self, placed: Sequence[tuple[int, int, bool]]) -> None:
        """Give back what a record that was not published took."""

    def loan(
        self, kind: str, np_dtype: Any, t_dtype: Any, shape: tuple[int, ...], nbytes: Any
    ) -> Any:
        """A writable array inside the pool (see
        :func:`~ringwire._pool.slotconfig.loan_spec`), or ``None`` if none is free now."""

    def loan_fallback(
        self, kind: str, np_dtype: Any, t_dtype: Any, shape: tuple[int, ...], nbytes: Any
    ) -> Any:
        """Policy "inline": a private array of that shape and dtype."""

    def poll(self) -> bool:
        """Take back the peer's releases and dropped loans; ``True`` if the peer waits
        for room to release (ring it).  Raises :class:`~ringwire._errors.SlotRefused`
        or :class:`~ringwire.RingCorrupted` for a forged release."""

    def reclaim(self, *, publish: bool = True) -> int:
        """The consumer is gone: take back everything it held; how many."""

    def park(self) -> None:
        """A sender is about to wait for a release (the peer rings when it releases)."""

    def unpark(self) -> None: ...

    def close(self, consumer_gone: bool | None = None) -> None:
        """Free the pool (what the consumer still maps stays valid for it)."""


class RecvPool(Protocol):
    """The consumer's side: the peer's references become views that release
    themselves when they die (their finalizers push onto :attr:`queue`)."""

    @property
    def queue(self) -> ReleaseQueue:
        """Releases waiting for the next safe point."""

    def resolve(self, ref: Any) -> Any:
        """The view a reference names.  Raises :class:`~ringwire.DecodeError` for a
        reference that names nothing valid."""

    def decode(self, dec: Decoder, view: Any) -> Any:
        """Decode one record that may reference the pool; if it fails, release what it
        referenced (:meth:`salvage`) and raise the :class:`~ringwire.DecodeError`."""

    def salvage(self, payload: Any) -> int:
        """An undecodable record: release the references the decode did not resolve;
        how many."""

    def statistics(self) -> dict[str, Any]:
        """The pool's fields of :class:`~ringwire.ChannelStatistics`."""

    def close(self, blocking: bool = True) -> int:
        """Stop releasing; how many received arrays are still alive."""

    def unmap(self) -> None:
        """After :meth:`close`: drop the pool's memory (live views keep theirs)."""


class RecvPoolBase:
    """What every receive pool does the same way (a subclass sets the fields and
    implements :meth:`salvage`): :meth:`statistics` over its counters, :meth:`decode`
    that salvages a record that fails, :meth:`flush`."""

    queue: ReleaseQueue
    held: dict[int, int]  # tag -> generation of every live view
    received: int  # slot arrays received
    cuda_received: int
    cuda_opens: int

    def salvage(self, payload: Any) -> int:
        raise NotImplementedError

    def statistics(self) -> dict[str, Any]:
        return {
            "slot_arrays_received": self.received,
            "slot_arrays_held": len(self.held),
            "releases_pending": len(self.queue),
            "cuda_tensors_received": self.cuda_received,
            "cuda_pools_opened": self.cuda_opens,
        }

    def decode(self, dec: Decoder, view: Any) -> Any:
        """Decode one record that may reference this pool (``dec`` resolves with the
        pool's ``resolve``).  If it fails to decode, every reference in it that was not
        resolved is released (:meth:`salvage`) before the :class:`DecodeError` goes on:
        a bad record leaks no slot."""
        try:
            return dec.decode(view)
        except DecodeError:
            self.salvage(view)
            raise

    def flush(self) -> None:
        if self.queue.pending:
            self.queue.flush()
