"""The endpoint core: one end of a connection, every operation that does not wait.

An :class:`Endpoint` holds the state of one end (see the state table in
:mod:`ringwire._conn.transport`) and does the work of every operation that can be
done without waiting: encode (placing large arrays in slots), publish, read, decode
(resolving slot references), safe points, receipts, statistics, errors.  It does no
I/O of its own -- every byte goes through its :class:`~ringwire._conn.transport.Transport`
-- and never waits: an operation that cannot finish now returns ``False`` / ``EMPTY``
or raises :class:`~ringwire._errors.NeedSlot`, and a waiting loop
(:mod:`ringwire._conn.waits`) decides what to wait for.  The drivers
(:class:`~ringwire.Channel`, :class:`~ringwire.SyncChannel`) run those loops.

Spinning
--------
Before it parks, a waiting loop spins (:meth:`Endpoint.spin`) for a budget that
starts at ``spin_us`` (default :data:`DEFAULT_SPIN_US`) and adapts: a spin that sees
data doubles it (up to ``spin_us``), one that times out halves it (down to 2 us), so a
peer that answers quickly is caught hot and a slow or descheduled one costs almost
nothing.  ``spin_us=0`` parks at once -- the right choice when both ends share one
event loop or the machine has fewer cores than busy processes.

Parking and waking
------------------
Several tasks (or threads) of one endpoint may wait at once -- one receiving, one
sending, two receivers, a receiver and a listener's fan-in.  A waiter records the
*wake generation* (:attr:`Endpoint.wake_gen`) *before* it parks and returns as soon as
it changes (:meth:`Endpoint.drain` bumps it), so a doorbell drained on behalf of
another waiter is never lost; the parked flags are counted, and each new parker
writes a fresh sequence number so the peer rings for it too.

Liveness
--------
A receiver first gets every record that was published, then
:class:`anyio.EndOfStream` (clean close or ``send_eof``) or
:class:`anyio.BrokenResourceError` (the peer's process died).  Sending to a peer
known to be gone raises ``BrokenResourceError``; any operation after our own close
raises ``ClosedResourceError``.  A waiting endpoint learns of the death at once (its
transport's descriptor becomes readable); so does one whose driver watches the
descriptor all the time (:attr:`Endpoint.watched`: asyncio); a sender that never
waits, elsewhere, asks the transport every :data:`ALIVE_EVERY` records (at most
every 2 ms: :meth:`Endpoint.check_alive`).  A malformed frame or garbage on the
control socket breaks only that connection (``BrokenResourceError`` whose cause is a
:class:`RingCorrupted` / :class:`ProtocolError`).

Tensor slots
------------
The transport may lend a send pool (this side's slots) and the peer's pool.  *Safe
points* -- every send, receive and loan, and every wake-up -- push releases queued by
finalizers and process the peer's releases (:meth:`Endpoint.slot_safe_point`); the
peer's hang-up reclaims every slot it held.  A record's trip: :meth:`encode_placed`
asks the pool for a :class:`~ringwire._pool.protocols.Placement` and encodes with it
(``Encoder.encode_with``)
(each large array is copied into a free slot, or a loan is used up, and referenced by
an Ext 4); the frame is published; the peer's :meth:`try_receive` decodes it, the
pool's resolver making a read-only view of each slot with a finalizer; when the last
view dies the finalizer queues ``(slot, generation)`` on the release lane; the next
safe point here takes the slot back and completes the record's receipts.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from anyio import BrokenResourceError, ClosedResourceError, EndOfStream, WouldBlock

from .._errors import (
    DecodeError,
    NeedSlot,
    ProtocolError,
    RingCorrupted,
    RingwireError,
    SlotRefused,
    SlotsExhausted,
    SlotWaitTimeout,
)
from .._pool.cuda import CudaNeed
from .._pool.protocols import Placed, RecvPool, SendPool
from .._wire.codec import Decoder
from .._wire.control import DOORBELL_CLOSE, DOORBELL_DATA, DOORBELL_SPACE
from .._wire.descriptors import CudaRef
from .._wire.ring import fence
from .batching import (
    decode_failed,
    encode_batch,
    keep_placement,
    read_batch,
    read_ring_batch,
)
from .statistics import ChannelStatistics, channel_statistics
from .transport import Transport

__all__ = [
    "ALIVE_EVERY",
    "DEFAULT_SPIN_US",
    "EMPTY",
    "UNSET",
    "Endpoint",
]

logger = logging.getLogger("ringwire")

DEFAULT_SPIN_US = 50.0
"""How long (at most) an endpoint spins on an empty (or full) ring before it parks."""

EMPTY: Any = object()  # "no record now" (a record may be None)
UNSET: Any = object()  # "argument not given"
ALIVE_EVERY = 8  # a sender nobody watches asks about the peer every this many records...
_ALIVE_NS = 2_000_000  # ...and at most this often (see Endpoint.check_alive)
_MIN_SPIN_NS = 2_000  # the adaptive spin budget never drops below this
_SPIN_YIELD_NS = 20_000  # a spinning endpoint calls sched_yield() this often (shared memory)
_SPIN_PROBE = 16  # after this many spins in a row time out, try the full budget again


def _no_pool(ref: Any) -> Any:
    what = "a CUDA tensor reference (Ext 5)" if isinstance(ref, CudaRef) else "a slot reference"
    raise DecodeError(
        f"{what} to pool {getattr(ref, 'pool', 0):#x}, but the peer lends this connection "
        "no slot pool (it connected with slots=None)"
    )


def _nothing() -> None:
    pass


class Endpoint:
    """One end of a connection over ``transport``: state and non-waiting operations.

    Not thread-safe: the blocking driver serialises senders and receivers with its
    locks, the async one runs on one event loop.
    """

    # a broadcast writer's hooks (a channel has none; see waits.py and broadcast.py)
    stall_timeout: float | None = None
    stalled: Callable[[Any, float, bool], TimeoutError] | None = None
    on_published: Callable[[Placed], None] | None = None

    def __init__(
        self,
        transport: Transport,
        *,
        type: Any = Any,
        spin_us: float = DEFAULT_SPIN_US,
        name: str = "",
    ) -> None:
        self.transport = transport
        self.tx = transport.tx
        self.rx = transport.rx
        self.pool: SendPool | None = transport.send_pool
        self.peer: RecvPool | None = transport.recv_pool
        self.peer_pid = transport.peer_pid
        self.version = transport.version
        self.name = name
        self.type = type
        self.spin_ns = self._spin_cur = int(max(0.0, float(spin_us)) * 1000)
        # TCP spins never yield: ZeroMQ's I/O thread delivers, and a yield on a loaded
        # host gave the core away for a time slice (loaded TCP RT 2.8x -> 1.9x zmq's)
        self._yield_ns = _SPIN_YIELD_NS if getattr(transport, "spin_yields", True) else 1 << 62
        self._spin_misses = 0
        self.closed = False  # we closed it
        self.eof = False  # the transport reported the peer's hang-up
        self.broken: BaseException | None = None  # a protocol violation
        self.peer_reason: str | None = None  # why the peer dropped the connection (abort)
        self.eof_sent = False
        self.tx_blocked = False  # closed, broken, hung up, or eof sent: sends go the slow way
        self.watched = False  # a driver watches the transport all the time (asyncio)
        self.wake_gen = 0
        # the driver's "the generation moved": a drain outside the driver's own wait (a
        # receiver reading the end, a sender asking for the hang-up) may consume the
        # readiness that the driver's waiters sleep on, so it must wake them itself
        self.on_drain: Callable[[], None] = _nothing
        self.rx_parked = self.tx_parked = 0
        self.slots_on = self.pool is not None or self.peer is not None
        # (payload, error) of a record that failed to decode and was left unread
        self._undecodable: tuple[bytes, str] | None = None
        self.rx_on_error = self.rx.read_many_on_error  # read_many takes on_error
        self.spare: Any = None  # a placement that placed nothing, to use again
        self.spare_policy: str | None = None
        # the transport's encoder places in the send pool, the peer's pool resolves
        self.enc = transport.encoder
        # what differs between pools, declared by them and read once (their protocol)
        self.reuse_placement = self.pool is not None and self.pool.reuses_placements
        self._releases_ready: Callable[[], Any] = (
            self.pool.releases_ready if self.pool is not None else _nothing
        )
        self.resolver = self.peer.resolve if self.peer is not None else _no_pool
        self.dec = Decoder(type, resolver=self.resolver)
        self.decoders: dict[Any, Decoder] = {type: self.dec}
        # counters
        self.n_sent = self.n_recv = self.b_sent = self.b_recv = 0
        self.send_parks = self.recv_parks = self.slot_waits = 0
        self.slot_wait_warned = False
        self._alive_checked = 0

    def __repr__(self) -> str:
        label = f" {self.name}" if self.name else ""
        return f"<Endpoint{label} peer pid {self.peer_pid} {self.state()}>"

    def state(self) -> str:
        return "closed" if self.closed else "broken" if self.broken or self.eof else "open"

    def decoder_for(self, tp: Any) -> Decoder:
        if tp is UNSET:
            return self.dec
        dec = self.decoders.get(tp)
        if dec is None:
            dec = self.decoders[tp] = type(self.dec)(tp, resolver=self.resolver)
        return dec

    # -- state ------------------------------------------------------------------------

    def raise_state(self) -> None:
        if self.closed:
            raise ClosedResourceError
        if self.broken is not None:
            raise BrokenResourceError(f"connection broken: {self.broken}") from self.broken

    def check_send(self) -> None:
        """Raise what a send in the current state raises (nothing while open)."""
        if self.closed or self.broken is not None:
            self.raise_state()
        if self.eof_sent:
            raise ClosedResourceError("send_eof() was called on this endpoint")
        if self.eof or self.tx.reader_closed:
            if not self.eof:
                self.drain()  # an abort comes before the closed flag: read its reason
            if self.peer_reason is not None:
                raise self._aborted()
            why = "closed its end" if self.tx.reader_closed else "is gone"
            raise BrokenResourceError(f"the peer (pid {self.peer_pid}) {why}")

    def _aborted(self) -> BrokenResourceError:
        return BrokenResourceError(
            f"the peer (pid {self.peer_pid}) dropped the connection: {self.peer_reason}"
        )

    def check_finished(self) -> None:
        """The lane is empty: raise if the peer will never publish again."""
        rx = self.rx
        if rx.writer_closed:
            fence()
            if not rx.available():
                if not self.eof:
                    self.drain()  # an abort comes before the closed flag: read its reason
                if self.peer_reason is not None:
                    raise self._aborted()
                raise EndOfStream
        elif self.eof:
            fence()
            if not rx.available():
                if self.peer_reason is not None:
                    raise self._aborted()
                if rx.writer_closed:
                    raise EndOfStream
                raise BrokenResourceError(
                    f"the peer (pid {self.peer_pid}) died or dropped the connection"
                )

    def hang_up(self) -> None:
        self.eof = True
        self.tx_blocked = True
        reason = self.transport.peer_reason
        if reason is not None:
            self.peer_reason = reason

    def abort(self, reason: str) -> None:
        """Tell the peer why we drop the connection (the caller closes right after):
        its next operation raises ``BrokenResourceError`` carrying ``reason``."""
        if not self.closed and self.broken is None:
            self.transport.abort(reason)

    def break_(self, exc: BaseException) -> None:
        """A protocol violation: this connection is unusable; tell the peer."""
        if self.broken is None:
            self.broken = exc
            self.tx_blocked = True
            logger.warning("ringwire connection to pid %s broken: %s", self.peer_pid, str(exc))
            if self.pool is not None:
                self.pool.reclaim()  # nothing is sent on this connection any more
            self.transport.abort(f"{type(exc).__name__}: {exc}")
            self.transport.shutdown()

    # -- doorbells and liveness -------------------------------------------------------

    def ring(self, byte: bytes) -> None:
        if not self.transport.ring(byte):
            self.hang_up()

    def drain(self) -> None:
        """Consume pending doorbells (and notice the hang-up) without waiting; bump the
        wake generation, run a safe point."""
        try:
            if self.transport.drain():
                self.hang_up()
        except ProtocolError as exc:
            self.break_(exc)
        self.wake_gen += 1
        try:
            if self.slots_on:
                self.slot_safe_point()
        finally:
            self.on_drain()  # the generation moved: wake the driver's waiters, always

    # A sender that never waits learns of the peer's death from a failed doorbell (the
    # peer died parked) or when the ring is full and it parks -- which, for a slow
    # sender and a large ring, can be minutes of records sent into the void.  So every
    # ALIVE_EVERY records (at most every _ALIVE_NS) it asks the transport.  An endpoint
    # whose driver watches the transport all the time (asyncio) needs none of this.

    def check_alive(self) -> None:
        if self.watched:
            return
        now = time.monotonic_ns()
        if now - self._alive_checked < _ALIVE_NS:
            return
        self._alive_checked = now
        self.notice_hang_up()

    def notice_hang_up(self) -> None:
        """Ask the transport, without waiting, whether the peer hung up, and if so read
        what it left (its abort, if any) and reclaim: so an endpoint that is not waiting
        -- a sender that never waits, ``statistics()``, a receipt -- sees a peer that
        closed or died."""
        if not self.eof and not self.closed and self.transport.hung_up():
            self.drain()

    # -- slots: safe points, encoding with placement -----------------------------------

    def require_pool(self) -> SendPool:
        """This endpoint's send pool, for an operation that needs one (a loan, a wait
        for a slot).

        Raises :class:`RingwireError` itself -- no subclass -- if it has none: opening
        with ``slots=None`` and then asking for a slot is a misuse of the endpoint, not
        a pool that is exhausted (:class:`SlotsExhausted` would say "wait or retry", and
        no wait ever helps).  The broadcast writer raises the same."""
        if self.pool is None:
            raise RingwireError(
                "this endpoint has no slot pool (it was opened with slots=None): open it "
                "with a SlotConfig to loan slots, or send arrays inline"
            )
        return self.pool

    def slot_safe_point(self) -> None:
        """Push releases queued by finalizers; process the peer's releases (and our
        dropped loans); reclaim the pool if the peer is gone.  Never blocks."""
        peer = self.peer
        if peer is not None and peer.queue.pending:
            peer.queue.flush()
        pool = self.pool
        if pool is not None:
            if pool.gone:
                if pool.loan_returns:
                    pool.reclaim()  # only takes back loans dropped since
            elif self.eof:
                pool.reclaim()
            elif pool.loan_returns or self._releases_ready():  # pool.has_work(), inlined
                self._poll_pool(pool)

    def _poll_pool(self, pool: SendPool) -> None:
        try:
            ring_back = pool.poll()
        except (SlotRefused, RingCorrupted) as exc:
            self.break_(exc)
            return
        if ring_back:
            self.ring(DOORBELL_SPACE)

    def encode(self, item: Any) -> bytes:
        payload = self.enc.encode(item)
        if len(payload) > self.tx.max_payload:
            self.tx.check_size(len(payload))
        return payload

    def encode_many(self, items: Iterable[Any]) -> list[bytes]:
        encode = self.enc.encode
        payloads = [encode(item) for item in items]
        if payloads:
            longest = max(map(len, payloads))
            if longest > self.tx.max_payload:
                self.tx.check_size(longest)
        return payloads

    def encode_placed(self, item: Any, policy: str | None) -> tuple[bytes, Placed]:
        """Encode one record, placing its large arrays in slots: the payload and the
        slots it took.  Raises :class:`NeedSlot` (policy "wait"; nothing is held then)
        when the pool is exhausted."""
        pool = self.pool
        assert pool is not None
        if self.tx_blocked:
            self.check_send()  # closed, broken or gone: nothing to place
        placement = self.spare  # take_placement(), inlined: this runs once per record
        if placement is None or self.spare_policy != policy:
            placement = pool.placement(policy)
            self.spare_policy = policy
        self.spare = None
        try:
            payload = self.enc.encode_with(item, placement)
            if len(payload) > self.tx.max_payload:
                self.tx.check_size(len(payload))
        except BaseException:
            pool.abort(placement)
            raise
        return payload, keep_placement(self, placement)

    def encode_batch(
        self, items: Sequence[Any], start: int, policy: str | None
    ) -> tuple[list[bytes], list[Placed], int | CudaNeed | None]:
        """Encode ``items[start:]`` until one needs a slot that is not free (policy
        "wait"): the payloads so far, their slots, and the bytes that one needs."""
        return encode_batch(self, items, start, policy)

    def loan_now(self, pool: SendPool, spec: Any, policy: str) -> Any:
        """One loan attempt: the loaned array, the inline fallback, or ``None`` (wait
        for a slot); raises when waiting is pointless."""
        self.check_send()
        self.slot_safe_point()
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

    def slot_wait_ready(self, nbytes: int | CudaNeed) -> bool:
        """Should a sender waiting for a slot stop waiting?"""
        pool = self.pool
        assert pool is not None
        if pool.has_work():
            self.slot_safe_point()
        return (
            self.closed
            or self.eof
            or self.broken is not None
            or self.tx.reader_closed
            or pool.can_allocate(nbytes)
        )

    def check_slot_wait(self, nbytes: int | CudaNeed) -> bool:
        """Before waiting for a slot: ``True`` if one is free now; raises if waiting
        is pointless (the connection is gone, or no slot is in use at all)."""
        self.check_send()
        self.slot_safe_point()
        pool = self.pool
        assert pool is not None
        if pool.can_allocate(nbytes):
            return True
        if pool.futile(nbytes):
            raise SlotsExhausted(f"no slot can hold {nbytes} bytes ({pool.config.describe()})")
        return False

    def slot_deadline(self) -> float | None:
        pool = self.pool
        t = pool.config.wait_timeout if pool is not None else None
        return None if t is None else time.monotonic() + t

    def warn_slow_slot_wait(self, nbytes: int | CudaNeed, waited: float) -> None:
        """A send has waited ``waited`` seconds for a slot: say so, once per connection,
        with what holds the pool."""
        pool = self.pool
        if self.slot_wait_warned or pool is None:
            return
        self.slot_wait_warned = True
        held = pool.statistics()["slots_in_use"]
        timeout = pool.config.wait_timeout
        logger.warning(
            "ringwire: a send to pid %s has waited %.1f s for a free slot of %s bytes: "
            "the pool (%s) has %d slot(s) held by the peer, %d loan(s) out here; the peer "
            "keeps received arrays alive (release them, or keep ringwire.copy_out() "
            "copies), or configure more slots; the send gives up after %s",
            self.peer_pid,
            waited,
            nbytes,
            pool.config.describe(),
            held - len(pool.loans),
            len(pool.loans),
            "ever (wait_timeout=None)" if timeout is None else f"{timeout:g} s",
        )

    def slot_timeout(self, nbytes: int | CudaNeed) -> SlotWaitTimeout:
        pool = self.pool
        assert pool is not None
        return SlotWaitTimeout(
            f"no slot for {nbytes} bytes was released within {pool.config.wait_timeout} s "
            f"(pool: {pool.config.describe()})"
        )

    def consumed(self, pairs: Sequence[tuple[int, int]]) -> bool:
        """Has the peer released every slot in ``pairs``?  (``True`` once it is gone.)"""
        pool = self.pool
        assert pool is not None
        if not self.closed:
            self.notice_hang_up()
            self.slot_safe_point()
        return pool.consumed(pairs)

    # -- sending without waiting -------------------------------------------------------

    def try_send(self, payload: bytes) -> bool:
        if self.tx_blocked:
            self.check_send()
        tx = self.tx
        written = tx.try_write(payload)
        if not written:
            if written is None:  # the peer closed its end
                self.check_send()
            return False
        self.n_sent += 1
        self.b_sent += len(payload)
        if tx.reader_needs_doorbell():
            self.ring(DOORBELL_DATA)
        elif not self.n_sent % ALIVE_EVERY:
            self.check_alive()
        return True

    def try_send_many(self, payloads: Sequence[bytes], start: int) -> int:
        self.check_send()
        tx = self.tx
        n, nbytes = tx.write_many(payloads, start)
        if n:
            self.n_sent += n
            self.b_sent += nbytes
            if tx.reader_needs_doorbell():
                self.ring(DOORBELL_DATA)
            elif (self.n_sent - n) // ALIVE_EVERY != self.n_sent // ALIVE_EVERY:
                self.check_alive()
        return n

    def send_ready(self, size: int) -> bool:
        """Should a sender waiting for room stop waiting?"""
        return (
            self.closed
            or self.eof
            or self.broken is not None
            or self.tx.reader_closed
            or self.tx.fits_now(size)
        )

    def send_eof(self) -> None:
        if self.closed:
            raise ClosedResourceError
        if not self.eof_sent:
            self.eof_sent = True
            self.tx_blocked = True
            self.tx.close()
            if self.tx.reader_wants_doorbell_for_close():
                self.ring(DOORBELL_CLOSE)

    def send_nowait(self, item: Any, policy: str | None) -> bool:
        """Encode and publish ``item`` if that needs no wait; ``False`` (nothing sent,
        no slot held) if the ring is full or, policy "wait", no slot is free."""
        pool = self.pool
        if pool is None:
            return self.try_send(self.encode(item))
        self.slot_safe_point()
        try:
            payload, placed = self.encode_placed(item, policy)
        except NeedSlot:
            return False
        ok = False
        try:
            ok = self.try_send(payload)
        finally:
            if not ok:
                pool.abort(placed)
            elif placed and self.on_published is not None:
                self.on_published(placed)
        return ok

    # -- receiving without waiting -----------------------------------------------------

    def try_receive(self, dec: Decoder) -> Any:
        """One record, or :data:`EMPTY`.  Raises on our close / a broken connection."""
        if self.closed or self.broken is not None:
            self.raise_state()
        if self.slots_on:
            self.slot_safe_point()
        rx = self.rx
        try:
            view = rx.next_frame()
        except RingCorrupted as exc:
            self.break_(exc)
            raise BrokenResourceError(f"connection broken: {exc}") from exc
        if view is None:
            return EMPTY
        try:
            if self._undecodable is None:
                try:
                    obj = dec.raw_decode(view)
                except Exception as exc:
                    decode_failed(self.peer, dec, view, exc)
            else:
                obj = self._decode_resolving(dec, view)
            self.n_recv += 1
            self.b_recv += view.nbytes
        finally:
            view.release()
            rx.commit()
            if rx.writer_needs_doorbell():
                self.ring(DOORBELL_SPACE)
        return obj

    # A record that fails to decode has already released the slots it resolved (their
    # views died with the failed decode), so it must never be decoded again: when
    # try_receive_many stops a batch before it (leaving it unread), the failure is kept
    # and the next read of that frame raises it without decoding.  The references the
    # decode did not reach are released when the frame is consumed (RecvPool.salvage).

    def _decode_resolving(self, dec: Decoder, view: memoryview) -> Any:
        peer = self.peer
        assert peer is not None  # only a pool's undecodable record is kept
        failed = self._undecodable
        if failed is not None:
            self._undecodable = None
            peer.salvage(failed[0])
            raise DecodeError(failed[1])
        return peer.decode(dec, view)

    def try_receive_many(self, dec: Decoder, max_n: int) -> list[Any]:
        """Up to ``max_n`` records (an empty list: none now)."""
        if self.closed or self.broken is not None:
            self.raise_state()
        if self.slots_on:
            self.slot_safe_point()
        out: list[Any] = []
        # (payload, error message) of an undecodable frame; no exception objects here:
        # their tracebacks' frames would hold this batch's records
        failures: list[tuple[bytes, str]] = []
        decode: Any = dec.decode
        peer = self.peer
        if self.rx_on_error and self._undecodable is None:  # a ring lane
            out, nbytes, failure = read_ring_batch(self, dec, max_n)
            if failure is not None:  # the batch ended before it, left unread
                self._undecodable = failure
            self.n_recv += len(out)
            self.b_recv += nbytes
            return out
        if peer is not None:

            def decode_resolving(view: memoryview) -> Any:
                failed = self._undecodable
                if failed is not None:  # the first frame of this batch (see above)
                    self._undecodable = None
                    failures.append(failed)
                    raise DecodeError(failed[1])
                try:
                    return dec.decode(view)
                except DecodeError as exc:
                    failures.append((bytes(view), str(exc)))
                    raise

            decode = decode_resolving
        nbytes = read_batch(self, decode, max_n, out, failures)
        if failures:  # the batch ended before an undecodable frame, left unread
            self._undecodable = failures[-1]
        self.n_recv += len(out)
        self.b_recv += nbytes
        return out

    def receive_nowait(self, dec: Decoder) -> Any:
        """One record; :class:`anyio.WouldBlock` if none is published yet."""
        obj = self.try_receive(dec)
        if obj is EMPTY:
            self.check_finished()
            raise WouldBlock
        return obj

    def receive_many_nowait(self, dec: Decoder, max_n: int) -> list[Any]:
        """Every published record up to ``max_n``; ``WouldBlock`` if there is none."""
        if max_n < 1:
            raise ValueError("max_n must be at least 1")
        out = self.try_receive_many(dec, max_n)
        if not out:
            self.check_finished()
            raise WouldBlock
        return out

    def receive_ready(self) -> bool:
        """Should a receiver waiting for a record stop waiting?"""
        rx = self.rx
        return (
            self.closed or self.eof or self.broken is not None or rx.available() or rx.writer_closed
        )

    # -- parking (counted: several waiters may park on one lane) -----------------------

    # Every park writes a fresh sequence number, so the peer rings again for a newcomer
    # even if it already rang for an earlier parker; only the last one out clears it.

    def park_rx(self) -> None:
        self.rx_parked += 1
        self.rx.park()

    def unpark_rx(self) -> None:
        self.rx_parked -= 1
        if not self.rx_parked and not self.closed:
            self.rx.unpark()

    def park_tx(self) -> None:
        self.tx_parked += 1
        self.tx.park()

    def unpark_tx(self) -> None:
        self.tx_parked -= 1
        if not self.tx_parked and not self.closed:
            self.tx.unpark()

    def spin(self, ready: Any, *args: Any) -> bool:
        """Busy-check ``ready(*args)`` for the current spin budget.

        The budget adapts (as adaptive mutexes do): a spin that succeeds doubles it, up
        to ``spin_us``; one that times out halves it, down to :data:`_MIN_SPIN_NS`.  So
        an endpoint whose peer answers within the budget stays hot, and one whose peer
        is slow -- or descheduled, on an oversubscribed machine -- soon parks at once
        instead of burning a core.  Every :data:`_SPIN_PROBE` timed-out spins in a row,
        the next one gets the full budget (a 2 us spin almost never succeeds, even
        against a peer that answers in 20 us).  A long spin on shared memory yields the
        CPU now and then, in case the peer is waiting for this very core.
        """
        spin = self._spin_cur
        if not spin:
            return False
        clock = time.perf_counter_ns
        now = clock()
        deadline = now + spin
        next_yield = now + self._yield_ns
        while True:
            if ready(*args):
                self._spin_misses = 0
                if spin < self.spin_ns:
                    self._spin_cur = min(self.spin_ns, 2 * spin)
                return True
            now = clock()
            if now >= deadline:
                break
            if now >= next_yield:
                os.sched_yield()
                next_yield = now + self._yield_ns
        self._spin_misses += 1
        if self._spin_misses % _SPIN_PROBE == 0:
            self._spin_cur = self.spin_ns
        else:
            self._spin_cur = max(min(_MIN_SPIN_NS, self.spin_ns), spin // 2)
        return False

    # -- statistics and closing -------------------------------------------------------

    def statistics(self) -> ChannelStatistics:
        return channel_statistics(self)

    def mark_closed(self) -> bool:
        """Flag our close on both lanes.  ``False`` if already closed."""
        if self.closed:
            return False
        self.closed = True
        self.tx_blocked = True
        try:
            self.tx.close()
            self.rx.close()
        except ValueError:  # views already released
            pass
        return True

    def abandon(self, owner: Any) -> None:
        """``owner`` (the driver) is being garbage-collected unclosed: warn
        (``ResourceWarning``) and free everything without blocking."""
        if self.closed:
            return
        self.closed = True
        self.tx_blocked = True
        warnings.warn(
            f"unclosed ringwire endpoint {owner!r}", ResourceWarning, source=owner, stacklevel=2
        )
        try:
            self.release(blocking=False)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def release(self, blocking: bool = True) -> int:
        """Free everything (after :meth:`mark_closed`); return how many received slot
        arrays are still alive (their memory stays mapped until they die)."""
        # the release queue first: no finalizer touches the lane after this (``__del__``
        # may run inside a flush of this very thread: it does not wait, see release.py)
        held = self.peer.close(blocking) if self.peer is not None else 0
        self.transport.close()
        if self.pool is not None:
            self.pool.close()
        if self.peer is not None:
            self.peer.unmap()  # stays mapped while received arrays are alive
        return int(held)
