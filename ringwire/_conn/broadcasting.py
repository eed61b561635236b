"""The broadcast writer's drivers: :class:`Broadcaster` (async) and :class:`SyncBroadcaster`.

Like the channels' drivers they add only waiting to the core
(:class:`~ringwire._conn.broadcast.BroadcastCore`): fast paths call it directly, and
a loop of :mod:`ringwire._conn.broadcast` runs through ``_run``, whose waits the
channels' own wakers perform on the hub's one descriptor.

Watching: a writer must notice a reader's death, and admit a late joiner, even while
it is not sending.  On asyncio the hub's descriptor is registered with the loop for
the life of the broadcast (``add_reader``: nothing runs until something happens); on
trio, ``async with broadcaster:`` runs one watcher task; a :class:`SyncBroadcaster`
has one watcher thread, asleep in ``poll()`` on that descriptor, which does what is
pending under the writer's lock whenever no operation holds it.  (An async writer used
without ``async with`` on trio looks at its hub every few records and while it waits.)
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, cast

import anyio
import anyio.abc
import anyio.lowlevel

from .._errors import NeedSlot
from .._pool.slotconfig import DEFAULT_SLOTS, SlotConfig, check_policy, loan_spec, resolve_config
from .._shm.broadcast import BroadcastHub
from . import broadcast as B
from .async_channel import AsyncWaker
from .connect import DEFAULT_CAPACITY
from .listener import DEFAULT_HANDSHAKE_TIMEOUT
from .sync_channel import SyncWaker
from .waits import Loop

__all__ = [
    "BroadcastReceipt",
    "Broadcaster",
    "SyncBroadcastReceipt",
    "SyncBroadcaster",
    "broadcast",
    "broadcast_sync",
]

_YIELD_EVERY = 32


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


class _ReceiptBase:
    __slots__ = ("_core", "_pairs", "_run")

    def __init__(self, core: B.BroadcastCore, pairs: Sequence[tuple[int, int]], run: Any) -> None:
        self._core = core
        self._pairs = tuple(pairs)
        self._run = run

    def __repr__(self) -> str:
        state = "consumed" if self.consumed else "in flight"
        return f"<{type(self).__name__} {len(self._pairs)} slot(s) {state}>"

    @property
    def slots(self) -> int:
        """How many slots the record used."""
        return len(self._pairs)

    @property
    def consumed(self) -> bool:
        """Has every reader released every slot of the record?  (Readers that went
        count as done.)"""
        return not self._pairs or self._core.consumed(self._pairs)


class BroadcastReceipt(_ReceiptBase):
    """What :meth:`Broadcaster.send_tracked` returns: ``await receipt.wait()`` until
    every reader has released the record's slots."""

    __slots__ = ()

    async def wait(self) -> None:
        if self._pairs:
            await self._run(B.consumed(self._core, self._pairs))


class SyncBroadcastReceipt(_ReceiptBase):
    """What :meth:`SyncBroadcaster.send_tracked` returns: ``receipt.wait(timeout)``."""

    __slots__ = ()

    def wait(self, timeout: float | None = None) -> None:
        if self._pairs:
            self._run(B.consumed(self._core, self._pairs, _deadline(timeout)))


class _Common:
    """What both writers answer without waiting."""

    _core: B.BroadcastCore

    def __repr__(self) -> str:
        hub = self._core.hub
        return f"<{type(self).__name__} {hub.path} {len(hub.conns)}/{hub.readers} readers {self._core.state()}>"

    @property
    def path(self) -> str:
        """The Unix socket path readers subscribe at."""
        return self._core.hub.path

    @property
    def closed(self) -> bool:
        return self._core.closed

    @property
    def max_readers(self) -> int:
        """Reader ranks this broadcast has (0 .. max_readers - 1)."""
        return self._core.hub.readers

    def fileno(self) -> int:
        """The hub's descriptor (readable when a join, doorbell or hang-up is pending)."""
        return self._core.hub.fileno()


class Broadcaster(_Common):
    """The async writer of a broadcast (asyncio, trio, uvloop; via anyio).

    Made by :func:`ringwire.broadcast`; readers join with :func:`ringwire.subscribe`.
    Every record sent is received by every reader, in order; large arrays travel once
    through the shared slot pool.  Use it as ``async with`` (it closes on exit, and on
    trio watches for joins and deaths in the background).  Not thread-safe: use it from
    one event loop."""

    def __init__(self, core: B.BroadcastCore) -> None:
        self._core = core
        self._waker = AsyncWaker(cast(Any, core))
        self._fast_ops = 0
        self._cm: Any = None

    async def __aenter__(self) -> Broadcaster:
        self._cm = self._watching()
        await self._cm.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        cm, self._cm = self._cm, None
        try:
            if cm is not None:
                return cast(bool | None, await cm.__aexit__(*exc))
            return None
        finally:
            self.close()

    @contextlib.asynccontextmanager
    async def _watching(self) -> AsyncIterator[None]:
        if self._waker.attach() is not None:  # asyncio: the loop watches the hub
            yield
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()

    async def _watch(self) -> None:
        core = self._core
        with contextlib.suppress(anyio.ClosedResourceError):
            while not core.done:
                await self._waker.wait(core.wake_gen)

    async def _run(self, loop: Loop[Any]) -> Any:
        waker = self._waker
        try:
            w = next(loop)
            while True:
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

    # -- sending ------------------------------------------------------------------------

    async def send(self, item: Any, *, slot_policy: str | None = None) -> None:
        """Send one record to every reader; waits (parked) while the slowest live
        reader holds the ring full, at most ``stall_timeout``.

        Raises ``ClosedResourceError`` (we closed it), ``BrokenResourceError`` (the
        broadcast failed: a reader died under ``on_reader_loss="fail"``),
        :class:`ReaderStalled` (readers alive but not reading: nothing was sent),
        :class:`EncodeError` / :class:`FrameTooLarge` / :class:`SlotsExhausted` as a
        channel's :meth:`Channel.send` does."""
        core = self._core
        if core.pool is not None:
            core.safe_point()
            try:
                payload, placed = core.encode_placed(item, slot_policy)
            except NeedSlot:
                await self._run(B.send_placed(core, item, slot_policy))
                await self._maybe_yield()
                return
            if placed:
                await self._run(B.room(core, payload, placed))
                await self._maybe_yield()
                return
        else:
            payload, placed = core.encode_placed(item, None)
        if not core.try_send(payload, placed):
            await self._run(B.room(core, payload, placed))
        await self._maybe_yield()

    def send_nowait(self, item: Any, *, slot_policy: str | None = None) -> None:
        """Send one record or raise :class:`anyio.WouldBlock` (the ring is full, or,
        policy "wait", no slot is free); nothing is held then."""
        core = self._core
        core.safe_point()
        try:
            payload, placed = core.encode_placed(item, slot_policy)
        except NeedSlot:
            raise anyio.WouldBlock from None
        ok = False
        try:
            ok = core.try_send(payload, placed)
        finally:
            if not ok:
                core.abort_all([placed])
        if not ok:
            raise anyio.WouldBlock

    async def send_many(self, items: Iterable[Any], *, slot_policy: str | None = None) -> None:
        """Send several records, publishing as many as fit at once (one doorbell per
        parked reader per batch).  Raises what :meth:`send` raises; if it fails or is
        cancelled while waiting, a prefix of the records was sent."""
        await self._run(B.send_many_placed(self._core, list(items), slot_policy))
        await self._maybe_yield()

    async def send_tracked(self, item: Any, *, slot_policy: str | None = None) -> BroadcastReceipt:
        """:meth:`send`, returning a :class:`BroadcastReceipt` that completes once every
        reader has released every slot the record used (at once if it used none)."""
        placed = await self._run(B.send_placed(self._core, item, slot_policy))
        return BroadcastReceipt(self._core, [(s, g) for s, g, _ in placed], self._run)

    async def loan(
        self,
        shape: Sequence[int],
        dtype: Any,
        *,
        device: Any = None,
        slot_policy: str | None = None,
    ) -> Any:
        """A writable array / tensor inside a free slot of the shared pool: fill it in
        place and send it -- every reader gets a zero-copy view of the same bytes.  As
        :meth:`Channel.loan`."""
        core = self._core
        pool = core.require_pool()
        spec = loan_spec(shape, dtype, device)
        policy = check_policy(slot_policy) or pool.config.policy
        arr = core.loan_now(spec, policy)
        if arr is not None:
            return arr
        return await self._run(B.loan(core, spec, policy))

    # -- readers ------------------------------------------------------------------------

    async def wait_ready(self, n: int) -> int:
        """Wait until at least ``n`` readers have joined and attached; return how many
        have.  (Bound it with ``anyio.fail_after``.)  Raises ``ValueError`` if ``n``
        exceeds :attr:`max_readers`, and what :meth:`send` raises for a closed or failed
        broadcast."""
        if not 0 <= n <= self.max_readers:
            raise ValueError(f"this broadcast has {self.max_readers} reader ranks, not {n}")
        result: int = await self._run(B.ready(self._core, n))
        return result

    def readers(self) -> list[B.ReaderInfo]:
        """The readers admitted now, by rank."""
        self._core.safe_point()
        return self._core.readers()

    def drop_reader(self, rank: int, reason: str = "dropped by the writer") -> bool:
        """Stop waiting for reader ``rank`` (a stalled one, say): it is told ``reason``
        (its next receive raises ``BrokenResourceError``), its ring space and slot
        shares are released, and its rank is not handed out again while its process
        lives.  Not a loss: the broadcast goes on.  ``False`` if there is no such reader."""
        return self._core.drop(rank, reason)

    def poll_readers(self) -> int:
        """Do what is pending now (joins, departures, deaths) without waiting; return
        how many readers are ready."""
        self._core.drain()
        return self._core.hub.ready_count

    def statistics(self) -> B.BroadcastStatistics:
        return self._core.statistics()

    # -- closing ------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close: every reader receives what was sent, then ``EndOfStream``."""
        self.close()
        await anyio.lowlevel.checkpoint()

    def close(self) -> None:
        """Close without awaiting (from the event loop's thread)."""
        core = self._core
        if core.closed:
            return
        core.closing = True
        self._waker.close()  # wakes every waiter (before the descriptor goes)
        core.close()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None and not core.closed:
            warnings.warn(f"unclosed {self!r}", ResourceWarning, source=self, stacklevel=1)
            with contextlib.suppress(Exception):
                core.close()


def _watch_thread(core: B.BroadcastCore, lock: threading.Lock, stop: list[bool]) -> None:
    """A blocking writer's watcher: do what the hub has pending whenever no operation
    holds the lock (an operation that waits does it itself).  Holds no reference to the
    writer object, so an unclosed one can still be collected."""
    p = select.poll()
    p.register(core.hub.fileno(), select.POLLIN)
    while not stop[0]:
        p.poll()
        with lock:
            if stop[0] or core.closed:
                return
            core.drain()


class SyncBroadcaster(_Common):
    """The blocking writer of a broadcast (threads, plain scripts): as
    :class:`Broadcaster`, with ``timeout`` arguments (seconds; ``None`` = forever) that
    raise ``TimeoutError`` (:class:`ReaderStalled` when readers are what it waited for).
    Thread-safe: one operation runs at a time, others wait their turn."""

    def __init__(self, core: B.BroadcastCore) -> None:
        self._core = core
        self._lock = threading.Lock()
        self._waker = SyncWaker(cast(Any, core))
        self._stop = [False]
        core.watched = True
        self._thread = threading.Thread(
            target=_watch_thread,
            args=(core, self._lock, self._stop),
            name=f"ringwire-broadcast-{os.path.basename(core.hub.path)}",
            daemon=True,
        )
        self._thread.start()

    def __enter__(self) -> SyncBroadcaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _acquire(self, deadline: float | None) -> None:
        if deadline is None:
            self._lock.acquire()
        elif not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError("timed out waiting for another thread using this broadcast")

    def _run(self, loop: Loop[Any]) -> Any:
        wait = self._waker.wait
        try:
            w = next(loop)
            while True:
                wait(w.gen, w.until)
                w = loop.send(None)
        except StopIteration as stop:
            return stop.value
        finally:
            loop.close()

    def _locked(self, loop: Loop[Any], deadline: float | None) -> Any:
        self._acquire(deadline)
        try:
            return self._run(loop)
        finally:
            self._lock.release()

    # -- sending ------------------------------------------------------------------------

    def send(
        self, item: Any, timeout: float | None = None, *, slot_policy: str | None = None
    ) -> None:
        """As :meth:`Broadcaster.send`, waiting at most ``timeout`` seconds."""
        core = self._core
        lock = self._lock
        deadline = None
        if not lock.acquire(False):
            deadline = _deadline(timeout)
            self._acquire(deadline)
        try:
            core.safe_point()
            try:
                payload, placed = core.encode_placed(item, slot_policy)
            except NeedSlot:
                self._run(B.send_placed(core, item, slot_policy, deadline or _deadline(timeout)))
                return
            if placed or not core.try_send(payload, placed):
                self._run(B.room(core, payload, placed, deadline or _deadline(timeout)))
        finally:
            lock.release()

    def send_nowait(self, item: Any, *, slot_policy: str | None = None) -> None:
        """As :meth:`Broadcaster.send_nowait`."""
        with self._lock:
            core = self._core
            core.safe_point()
            try:
                payload, placed = core.encode_placed(item, slot_policy)
            except NeedSlot:
                raise anyio.WouldBlock from None
            ok = False
            try:
                ok = core.try_send(payload, placed)
            finally:
                if not ok:
                    core.abort_all([placed])
            if not ok:
                raise anyio.WouldBlock

    def send_many(
        self, items: Iterable[Any], timeout: float | None = None, *, slot_policy: str | None = None
    ) -> None:
        """As :meth:`Broadcaster.send_many`."""
        deadline = _deadline(timeout)
        self._locked(B.send_many_placed(self._core, list(items), slot_policy, deadline), deadline)

    def send_tracked(
        self, item: Any, timeout: float | None = None, *, slot_policy: str | None = None
    ) -> SyncBroadcastReceipt:
        """As :meth:`Broadcaster.send_tracked`."""
        deadline = _deadline(timeout)
        placed = self._locked(B.send_placed(self._core, item, slot_policy, deadline), deadline)
        return SyncBroadcastReceipt(self._core, [(s, g) for s, g, _ in placed], self._run_locked)

    def _run_locked(self, loop: Loop[Any]) -> Any:
        return self._locked(loop, None)

    def loan(
        self,
        shape: Sequence[int],
        dtype: Any,
        timeout: float | None = None,
        *,
        device: Any = None,
        slot_policy: str | None = None,
    ) -> Any:
        """As :meth:`Broadcaster.loan`."""
        core = self._core
        pool = core.require_pool()
        spec = loan_spec(shape, dtype, device)
        policy = check_policy(slot_policy) or pool.config.policy
        deadline = _deadline(timeout)
        return self._locked(B.loan(core, spec, policy, deadline), deadline)

    # -- readers ------------------------------------------------------------------------

    def wait_ready(self, n: int, timeout: float | None = None) -> int:
        """As :meth:`Broadcaster.wait_ready`; ``TimeoutError`` after ``timeout``."""
        if not 0 <= n <= self.max_readers:
            raise ValueError(f"this broadcast has {self.max_readers} reader ranks, not {n}")
        deadline = _deadline(timeout)
        result: int = self._locked(B.ready(self._core, n, deadline), deadline)
        return result

    def readers(self) -> list[B.ReaderInfo]:
        """As :meth:`Broadcaster.readers`."""
        with self._lock:
            self._core.safe_point()
            return self._core.readers()

    def drop_reader(self, rank: int, reason: str = "dropped by the writer") -> bool:
        """As :meth:`Broadcaster.drop_reader`."""
        with self._lock:
            return self._core.drop(rank, reason)

    def poll_readers(self) -> int:
        """As :meth:`Broadcaster.poll_readers`."""
        with self._lock:
            self._core.drain()
            return self._core.hub.ready_count

    def statistics(self) -> B.BroadcastStatistics:
        with self._lock:
            return self._core.statistics()

    # -- closing ------------------------------------------------------------------------

    def close(self) -> None:
        """Close: every reader receives what was sent, then ``EndOfStream``; threads
        waiting on this writer get ``ClosedResourceError``."""
        core = self._core
        self._stop[0] = True
        core.closing = True  # an operation waiting under the lock gives up...
        core.hub.wake()  # ...when this wakes it; the watcher leaves its poll too
        with self._lock:
            if core.closed:
                return
            if threading.current_thread() is not self._thread:
                self._lock.release()
                try:
                    self._thread.join(5.0)
                finally:
                    self._lock.acquire()
            core.close()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is None or core.closed:
            return
        warnings.warn(f"unclosed {self!r}", ResourceWarning, source=self, stacklevel=1)
        self._stop[0] = True
        with contextlib.suppress(Exception):
            core.hub.wake()
            if self._lock.acquire(False):
                try:
                    core.close()
                finally:
                    self._lock.release()


def _make_core(
    path: Any,
    readers: int,
    capacity: int,
    slots: SlotConfig | None,
    on_reader_loss: str,
    stall_timeout: float | None,
    handshake_timeout: float,
) -> B.BroadcastCore:
    if on_reader_loss not in B.LOSS_POLICIES:
        raise ValueError(f"on_reader_loss must be one of {B.LOSS_POLICIES}, not {on_reader_loss!r}")
    if stall_timeout is not None and not (stall_timeout > 0 and math.isfinite(stall_timeout)):
        raise ValueError("stall_timeout must be None or a positive number of seconds")
    hub = BroadcastHub(
        os.fspath(path),
        capacity=capacity,
        readers=readers,
        slots=resolve_config(slots),
        handshake_timeout=handshake_timeout,
    )
    try:
        return B.BroadcastCore(hub, on_reader_loss=on_reader_loss, stall_timeout=stall_timeout)
    except BaseException:
        hub.close()
        raise


def broadcast(
    path: str | os.PathLike[str],
    *,
    readers: int = 8,
    capacity: int = DEFAULT_CAPACITY,
    slots: SlotConfig | None = DEFAULT_SLOTS,
    on_reader_loss: str = "fail",
    stall_timeout: float | None = 60.0,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
) -> Broadcaster:
    """A broadcast writer at the Unix socket ``path`` (bound now): one writer, up to
    ``readers`` readers (ranks ``0 .. readers - 1``) joining with
    :func:`ringwire.subscribe` at any time.

    ``capacity``: bytes of the ring's data area (a power of two; records up to half of
    it travel inline, larger arrays through ``slots``, the shared tensor-slot pool --
    ``None``: every array inline).  ``on_reader_loss``: what a reader's death does --
    ``"fail"`` the broadcast (``BrokenResourceError`` naming the rank, to the writer
    and every reader) or ``"drop"`` it and go on.  ``stall_timeout``: how long a send
    waits for readers that are alive but do not read before :class:`ReaderStalled`
    names them (``None``: forever).  Raises :class:`SharedMemoryFull` if ``/dev/shm``
    cannot hold the ring or the pool, ``OSError`` if another broadcast or listener is
    live at ``path``."""
    return Broadcaster(
        _make_core(path, readers, capacity, slots, on_reader_loss, stall_timeout, handshake_timeout)
    )


def broadcast_sync(
    path: str | os.PathLike[str],
    *,
    readers: int = 8,
    capacity: int = DEFAULT_CAPACITY,
    slots: SlotConfig | None = DEFAULT_SLOTS,
    on_reader_loss: str = "fail",
    stall_timeout: float | None = 60.0,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
) -> SyncBroadcaster:
    """Blocking :func:`broadcast`: returns a :class:`SyncBroadcaster`."""
    return SyncBroadcaster(
        _make_core(path, readers, capacity, slots, on_reader_loss, stall_timeout, handshake_timeout)
    )
