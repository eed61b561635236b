"""The async driver: :class:`Channel` (asyncio, trio, uvloop; via anyio) and its receipts.

The driver adds only waiting to the :class:`~ringwire._conn.endpoint.Endpoint`: the
fast path of each operation calls the endpoint directly, and anything that must wait
runs a loop of :mod:`ringwire._conn.waits` through :meth:`AsyncSending._run`, which
performs each :class:`~ringwire._conn.waits.Wait` with an :class:`AsyncWaker`.  The
sending half (:class:`AsyncSending`) is shared with the broadcast writer
(:class:`~ringwire.Broadcaster`, a send-only endpoint).  Waking:

* asyncio / uvloop: the transport's descriptor is registered with the loop once
  (``add_reader``) for the life of the connection; the callback drains doorbells and
  resolves the waiters' futures.  Parking costs no ``epoll_ctl`` and no extra task,
  and the loop notices the peer's death at once, even on an endpoint that only sends.
* other anyio backends (trio): one waiter awaits ``anyio.wait_readable`` on the
  descriptor, the others an ``anyio.Event`` it sets.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
from anyio import ClosedResourceError, EndOfStream, WouldBlock

from .._errors import NeedSlot
from .._pool.slotconfig import check_policy, loan_spec
from . import waits
from .driving import EndpointFacade, ReceiptBase, warn_held
from .endpoint import EMPTY, UNSET, Endpoint

__all__ = ["AsyncSending", "AsyncWaker", "Channel", "Receipt"]

_YIELD_EVERY = 32  # async fast paths yield to the event loop at least this often


class AsyncWaker:
    """How the tasks of one endpoint wait for its wake generation to move."""

    def __init__(self, core: Endpoint) -> None:
        self.core = core
        self.loop: asyncio.AbstractEventLoop | None = None
        self._aio_ok = True
        self._waiters: list[asyncio.Future[None]] = []
        self._polling = False
        self._poll_scope: anyio.CancelScope | None = None
        self._event: anyio.Event | None = None
        self._thread = threading.get_ident()
        core.on_drain = self._drained
        # on asyncio the loop watches the transport from now on, so the peer's death
        # is noticed at once -- slots reclaimed, next send refused -- even by an
        # endpoint that only sends and never waits
        self.attach()

    def attach(self) -> asyncio.AbstractEventLoop | None:
        """Register with the running asyncio loop; ``None`` if not on asyncio.
        (A channel belongs to one event loop; a closed loop is replaced by the next.)"""
        if not self._aio_ok:
            return None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None  # trio, or another anyio backend
        self.unregister()
        try:
            loop.add_reader(self.core.transport.fileno(), self._on_readable)
        except NotImplementedError:  # pragma: no cover - proactor loops
            self._aio_ok = False
            return None
        self.loop = loop
        self.core.watched = True
        return loop

    def _on_readable(self) -> None:
        core = self.core
        if not core.closed:
            core.drain()
        if core.closed or core.eof or core.broken is not None:
            self.unregister()
        self.wake_all()

    def _drained(self) -> None:
        # a drain by anyone: wake the waiters, and the task polling the descriptor (its
        # readiness may be what that drain consumed) -- from the channel's own thread
        # only (a drain from another thread, statistics() say, leaves them be)
        if threading.get_ident() != self._thread:
            return
        self.wake_all()
        scope = self._poll_scope
        if scope is not None:
            scope.cancel()

    def wake_all(self) -> None:
        waiters = self._waiters
        if waiters:
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
            waiters.clear()

    def unregister(self) -> None:
        loop = self.loop
        if loop is not None:
            self.loop = None
            self.core.watched = False
            if not loop.is_closed():
                loop.remove_reader(self.core.transport.fileno())

    def waitable(self, gen: int) -> Awaitable[Any] | None:
        """Something to await until a wake-up after generation ``gen``, or ``None`` if
        there is no need to wait.  On asyncio a bare future (the hot path: no extra
        coroutine frame); elsewhere a coroutine over ``anyio.wait_readable``."""
        core = self.core
        if core.wake_gen != gen or core.eof or core.closed or core.broken is not None:
            return None
        loop = self.loop
        if loop is None or loop.is_closed():
            loop = self.attach()
            if loop is None:
                return self._wait_generic(gen)
        waiters = self._waiters
        if len(waiters) > 16:  # futures of cancelled waits
            waiters[:] = [f for f in waiters if not f.done()]
        fut: asyncio.Future[None] = loop.create_future()
        waiters.append(fut)
        return fut

    async def wait(self, gen: int, until: float | None = None) -> None:
        """Wait until a wake-up after ``gen`` (or ``until``); may return early."""
        w = self.waitable(gen)
        if w is None:
            return
        if until is None:
            await w
            return
        with anyio.move_on_after(until - time.monotonic()):
            await w

    async def _wait_generic(self, gen: int) -> None:
        # any anyio backend: one waiter polls the descriptor, the others wait for it
        core = self.core
        while core.wake_gen == gen and not core.eof and not core.closed and core.broken is None:
            if self._polling:
                ev = self._event
                if ev is None:
                    ev = self._event = anyio.Event()
                await ev.wait()
                continue
            self._polling = True
            try:
                with anyio.CancelScope() as self._poll_scope:
                    await anyio.wait_readable(core.transport.fileno())
            except ClosedResourceError:
                if not core.closed:
                    raise
            finally:
                self._poll_scope = None
                self._polling = False
                ev = self._event
                if ev is not None:
                    self._event = None
                    ev.set()
            if not core.closed:
                core.drain()

    def close(self) -> None:
        """Wake every waiter (the endpoint was closed)."""
        self.unregister()
        self.wake_all()
        if self._polling:
            try:
                anyio.notify_closing(self.core.transport.fileno())
            except Exception:  # pragma: no cover - no running loop any more
                pass
        ev = self._event
        if ev is not None:
            self._event = None
            ev.set()


class Receipt(ReceiptBase):
    """What :meth:`Channel.send_tracked` returns: ``await receipt.wait()`` until the
    peer has consumed (released every slot of) the record."""

    __slots__ = ()

    async def wait(self) -> None:
        """Return once the peer has released every slot the record's arrays used (its
        last views died, or it ``copy_out``-ed them); at once for a record that used
        none.  Returns too when the peer is gone: its slots were reclaimed, so nothing
        is held any more (whether it read the record is not known).  Cancellable (the
        record stays sent).  Raises nothing of its own."""
        if self._pairs:
            await self._run(waits.consumed(self._core, self._pairs))


class AsyncSending:
    """The sending half of the async driver: what :class:`Channel` and the broadcast
    writer (:class:`~ringwire.Broadcaster`) share -- the loop runner and every send.
    A subclass sets ``_core``, ``_waker`` and ``_fast_ops``, and ``_receipt`` (what
    :meth:`send_tracked` returns)."""

    _core: Endpoint
    _waker: AsyncWaker
    _fast_ops: int
    _receipt: type[Receipt] = Receipt

    # -- the driver -------------------------------------------------------------------

    async def _run(self, loop: waits.Loop[Any]) -> Any:
        """Run a waiting loop: perform each wait it asks for; its result is ours."""
        waker = self._waker
        try:
            w = next(loop)
            while True:
                if w.until is None:  # the latency path: the bare future, no extra frame
                    aw = waker.waitable(w.gen)
                    if aw is not None:
                        await aw
                else:
                    await waker.wait(w.gen, w.until)
                w = loop.send(None)
        except StopIteration as stop:
            return stop.value
        finally:
            loop.close()

    async def _maybe_yield(self) -> None:
        # shielded: the operation is done (a record taken, or sent), and a cancellation
        # raised here would lose the record or make the caller send it twice
        self._fast_ops += 1
        if self._fast_ops >= _YIELD_EVERY:
            self._fast_ops = 0
            await anyio.lowlevel.cancel_shielded_checkpoint()

    # -- send -------------------------------------------------------------------------

    async def send(self, item: Any, *, slot_policy: str | None = None) -> None:
        """Send one record (a broadcast: to every reader); waits (spin, then park)
        while the ring is full (a broadcast: for its slowest live reader).

        Large arrays and tensors travel in tensor slots (see :class:`SlotConfig`);
        ``slot_policy`` overrides the channel's policy for this record.  Raises
        ``ClosedResourceError`` (we closed it, or called :meth:`send_eof`),
        ``BrokenResourceError`` (the peer is gone or the connection broke; a broadcast
        that failed: a reader was lost under ``on_reader_loss="fail"``),
        :class:`ReaderStalled` (a broadcast whose readers are alive but made no room
        within ``stall_timeout``: nothing was sent), :class:`EncodeError` /
        :class:`FrameTooLarge` for a record that cannot be sent,
        :class:`SlotsExhausted` (policy "error", the slot wait timed out, or no slot
        can ever be free)."""
        core = self._core
        pool = core.pool
        if pool is not None:
            # fast path: a record in which nothing was placed in a slot is sent like one
            # on a channel without a pool (no abort bookkeeping)
            core.slot_safe_point()
            try:
                payload, placed = core.encode_placed(item, slot_policy)
            except NeedSlot:
                await self._run(waits.send_placed(core, item, slot_policy))
            else:
                if placed:
                    await self._run(waits.publish_placed(core, payload, placed))
                elif not core.try_send(payload):
                    await self._run(waits.room(core, payload))
            await self._maybe_yield()
            return
        payload = core.enc.encode(item)
        if len(payload) > core.tx.max_payload:
            core.tx.check_size(len(payload))
        if not core.try_send(payload):
            await self._run(waits.room(core, payload))
            return
        await self._maybe_yield()

    async def send_tracked(self, item: Any, *, slot_policy: str | None = None) -> Receipt:
        """Send one record; return a :class:`Receipt` that completes once the peer (a
        broadcast: every reader) has released every slot the record used (at once if
        it used none).  Raises what :meth:`send` raises."""
        core = self._core
        if core.pool is None:
            await self.send(item)
            return self._receipt(core, (), self._run)
        placed = await self._run(waits.send_placed(core, item, slot_policy))
        await self._maybe_yield()
        return self._receipt(core, [(slot, gen) for slot, gen, _ in placed], self._run)

    async def loan(
        self,
        shape: Sequence[int],
        dtype: Any,
        *,
        device: Any = None,
        slot_policy: str | None = None,
    ) -> Any:
        """A writable numpy array (``dtype`` a numpy dtype) or torch tensor (``dtype`` a
        ``torch.dtype``) of ``shape`` that lives inside a free slot: fill it in place
        and send it -- nothing is copied.  Send it once; do not touch it after.  A loan
        dropped without being sent returns its slot.

        ``device`` (a CUDA device, torch dtypes only): the tensor lives in this side's
        GPU pool for that device; write it on the current stream (or synchronise)
        before sending -- the send records the slot's event on the current stream.

        When no slot is free the policy applies (``"inline"`` returns an ordinary
        private array instead).

        Raises :class:`SlotsExhausted` (policy ``"error"``, or a pool that can never
        free a slot), :class:`SlotWaitTimeout` (a wait past the pool's
        ``wait_timeout``), ``ValueError``/``TypeError`` for a bad shape or device,
        :class:`EncodeError` for a dtype the wire cannot carry (an object dtype),
        :class:`RingwireError` on a channel without a slot pool, and what :meth:`send`
        raises for a closed or broken connection."""
        core = self._core
        pool = core.require_pool()
        spec = loan_spec(shape, dtype, device)
        policy = check_policy(slot_policy) or pool.config.policy
        arr = core.loan_now(pool, spec, policy)
        if arr is not None:
            return arr
        return await self._run(waits.loan(core, spec, policy))

    def send_nowait(self, item: Any, *, slot_policy: str | None = None) -> None:
        """Send one record or raise :class:`anyio.WouldBlock` if the ring is full (or,
        policy "wait", no slot is free).  Otherwise raises what :meth:`send` raises."""
        if not self._core.send_nowait(item, slot_policy):
            raise WouldBlock

    async def send_many(self, items: Iterable[Any], *, slot_policy: str | None = None) -> None:
        """Send several records, publishing as many as fit at once.

        Every record is encoded (and size-checked) before the first is sent -- except
        that a record waiting for a slot (policy "wait") first lets the records before
        it go.  If cancelled while waiting for room, a prefix of the records has been
        sent.  Raises what :meth:`send` raises.
        """
        core = self._core
        if core.pool is not None:
            await self._run(waits.send_many_placed(core, list(items), slot_policy))
        else:
            await self._run(waits.room_many(core, core.encode_many(items), None))
        await self._maybe_yield()


class Channel(EndpointFacade, AsyncSending, anyio.abc.ObjectStream[Any]):
    """The async endpoint of a connection (asyncio, trio, uvloop; via anyio).

    Object-stream semantics as in anyio: :meth:`send` / :meth:`receive` (and their
    ``_nowait`` forms), ``async for``, :meth:`aclose`, :meth:`send_eof`, async context
    manager.  Not thread-safe: use it from one event loop.  Made by
    :func:`ringwire.connect`, :meth:`ringwire.PairEnd.connect` and
    :meth:`ringwire.Listener.accept`.
    """

    def __init__(self, core: Endpoint, waker: AsyncWaker | None = None) -> None:
        super().__init__(core)
        self._waker = waker if waker is not None else AsyncWaker(core)
        self._fast_ops = 0

    def poll_peer(self) -> bool:
        """Read what the transport holds now, without waiting: a peer that just died is
        noticed at once (its slots come back to the pool, the next send raises).
        Returns whether the peer is still there."""
        core = self._core
        if not core.closed:
            core.drain()
        return not (core.eof or core.broken is not None)

    async def send_eof(self) -> None:
        """Tell the peer that nothing more will be sent (it gets ``EndOfStream`` once it
        has received everything); receiving still works.  ``ClosedResourceError``
        after :meth:`aclose`."""
        self._core.send_eof()
        await anyio.lowlevel.checkpoint()

    # -- receive ----------------------------------------------------------------------

    async def receive(self, *, type: Any = UNSET) -> Any:
        """Receive one record (decoded as ``type`` if given, else the channel's type).

        Raises ``EndOfStream`` once the peer closed and everything was received,
        ``BrokenResourceError`` if it died (after everything it published) or the
        connection broke, ``ClosedResourceError`` after our close, and
        :class:`DecodeError` for a record that cannot be decoded (the next record is
        still received)."""
        core = self._core
        dec = core.dec if type is UNSET else core.decoder_for(type)
        obj = core.try_receive(dec)
        if obj is EMPTY:
            obj = await self._run(waits.receive(core, dec))
            return obj
        self._fast_ops += 1
        if self._fast_ops >= _YIELD_EVERY:
            self._fast_ops = 0
            await anyio.lowlevel.cancel_shielded_checkpoint()
        return obj

    def receive_nowait(self, *, type: Any = UNSET) -> Any:
        """The next record, without waiting (``type`` as :meth:`receive`).  Raises
        :class:`anyio.WouldBlock` if none is published yet, and otherwise what
        :meth:`receive` raises (``EndOfStream``, ``BrokenResourceError``,
        ``ClosedResourceError``, :class:`DecodeError`)."""
        core = self._core
        return core.receive_nowait(core.decoder_for(type))

    async def receive_many(self, max_n: int = 1024, *, type: Any = UNSET) -> list[Any]:
        """Wait for at least one record, then return every published one (up to
        ``max_n``), handing their ring space back at once.  Raises ``ValueError`` for
        ``max_n < 1``, otherwise what :meth:`receive` raises."""
        if max_n < 1:
            raise ValueError("max_n must be at least 1")
        core = self._core
        dec = core.decoder_for(type)
        out = core.try_receive_many(dec, max_n)
        if out:
            await self._maybe_yield()
            return out
        result: list[Any] = await self._run(waits.receive_many(core, dec, max_n))
        return result

    def receive_many_nowait(self, max_n: int = 1024, *, type: Any = UNSET) -> list[Any]:
        """Every record published and not yet read, up to ``max_n`` (a list, in order),
        without waiting.  Raises ``WouldBlock`` if there is none, ``ValueError`` for
        ``max_n < 1``, and otherwise what :meth:`receive` raises."""
        core = self._core
        return core.receive_many_nowait(core.decoder_for(type), max_n)

    def __aiter__(self) -> Channel:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except EndOfStream:
            raise StopAsyncIteration from None

    # -- closing ----------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Close, telling the peer why: its sends, and its receives once it has read
        what we published, raise ``BrokenResourceError`` carrying ``reason`` (a
        listener does this when it drops a connection over an undecodable record).
        Raises ``TypeError`` if ``reason`` is not a string."""
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, not {type(reason).__name__}")
        self._core.abort(reason)
        self.close()

    async def aclose(self) -> None:
        """Close: the peer receives what was sent, then ``EndOfStream``.  Tasks waiting
        on this endpoint get ``ClosedResourceError``."""
        self.close()
        await anyio.lowlevel.checkpoint()

    def close(self) -> None:
        """Close without awaiting (call it from the event loop's thread)."""
        core = self._core
        if not core.mark_closed():
            return
        self._waker.close()
        held = core.release()
        if held:
            warn_held(self, held)

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
            core.abandon(self)
