"""The broadcast writer's drivers: :class:`Broadcaster` (async) and :class:`SyncBroadcaster`.

A broadcast writer is a send-only endpoint
(:class:`~ringwire._conn.broadcast.BroadcastEndpoint`), and these are the channels'
drivers around it: :class:`Broadcaster` is an
:class:`~ringwire._conn.async_channel.AsyncSending` (the sends of
:class:`~ringwire.Channel`, its :class:`AsyncWaker` on the hub's one descriptor),
:class:`SyncBroadcaster` a :class:`~ringwire._conn.sync_channel.SyncSending` (the
sends of :class:`~ringwire.SyncChannel`, its :class:`SyncWaker`); their receipts are
the channels' receipts.  What they add: the readers' queries, ``wait_ready``, and
watching the hub while nothing is sent.

Watching: a writer must notice a reader's death, and admit a late joiner, even while
it is not sending.  On asyncio the hub's descriptor is registered with the loop for
the life of the broadcast (``add_reader``: nothing runs until something happens); on
trio, ``async with broadcaster:`` runs one watcher task; a :class:`SyncBroadcaster`
has one watcher thread, asleep in ``poll()`` on that descriptor, which does what is
pending under the writer's send lock whenever no operation holds it.  (An async
writer used without ``async with`` on trio looks at its hub every few records and
while it waits.)
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from .._net.keys import ServerKeys
from .._pool.slotconfig import DEFAULT_SLOTS, SlotConfig, resolve_config
from .._shm.broadcast import BroadcastHub
from .._wire.control import DOORBELL_DATA
from .async_channel import AsyncSending, AsyncWaker, Receipt
from .broadcast import LOSS_POLICIES, BroadcastEndpoint, BroadcastStatistics, ReaderInfo, ready
from .connect import DEFAULT_CAPACITY
from .endpoint import DEFAULT_SPIN_US
from .listener import DEFAULT_HANDSHAKE_TIMEOUT
from .netconn import DEFAULT_HEARTBEAT, check_bind, check_heartbeat, open_acceptor
from .observed import track
from .sync_channel import SyncReceipt, SyncSending, SyncWaker
from .waits import Loop

__all__ = [
    "BroadcastReceipt",
    "Broadcaster",
    "SyncBroadcastReceipt",
    "SyncBroadcaster",
    "broadcast",
    "broadcast_sync",
]

_YIELD_EVERY = 32  # (as a channel's) and an unwatched writer looks at its hub this often


class BroadcastReceipt(Receipt):
    """What :meth:`Broadcaster.send_tracked` returns: a channel's :class:`Receipt`
    whose record every reader must release -- ``await receipt.wait()`` until all have
    (readers that went count as done)."""

    __slots__ = ()


class SyncBroadcastReceipt(SyncReceipt):
    """What :meth:`SyncBroadcaster.send_tracked` returns: a :class:`SyncReceipt`
    whose record every reader must release -- ``receipt.wait(timeout)``."""

    __slots__ = ()


class _Common:
    """What both writers answer without waiting."""

    _core: BroadcastEndpoint

    def __repr__(self) -> str:
        hub = self._core.hub
        return (
            f"<{type(self).__name__} {hub.path} {len(hub.conns)}/{hub.readers} readers "
            f"{self._core.state()}>"
        )

    @property
    def path(self) -> str:
        """The Unix socket path readers subscribe at."""
        return self._core.hub.path

    @property
    def tcp_address(self) -> str | None:
        """The ``tcp://host:port`` remote readers subscribe at (the port bound when
        ``tcp=`` named port 0), or ``None`` without ``tcp=``."""
        remote = self._core.hub.remote
        return None if remote is None else str(remote.address)

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

    def _check_n(self, n: int) -> None:
        if not 0 <= n <= self.max_readers:
            raise ValueError(f"this broadcast has {self.max_readers} reader ranks, not {n}")


class Broadcaster(_Common, AsyncSending):
    """The async writer of a broadcast (asyncio, trio, uvloop; via anyio).

    Made by :func:`ringwire.broadcast`; readers join with :func:`ringwire.subscribe`.
    Every record sent is received by every reader, in order; large arrays travel once
    through the shared slot pool.  Its sends are :class:`~ringwire.Channel`'s
    (``send``, ``send_nowait``, ``send_many``, ``send_tracked``, ``loan``), to every
    reader.  A step's tensor is best written where the readers read it: ``loan`` a slot,
    produce the array into it, send it -- nothing is copied (a private array that is
    sent is copied once into a slot).  Use it as ``async with`` (it closes on exit, and on trio watches for joins
    and deaths in the background).  Not thread-safe: use it from one event loop."""

    _core: BroadcastEndpoint
    _receipt = BroadcastReceipt

    def __init__(self, core: BroadcastEndpoint) -> None:
        self._core = core
        self._waker = AsyncWaker(core)
        self._fast_ops = 0
        self._cm: Any = None
        track(self, core, "broadcast")  # weakly: ringwire.metrics reads it when scraped

    async def __aenter__(self) -> Broadcaster:
        self._cm = self._watching()
        await self._cm.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        cm, self._cm = self._cm, None
        try:
            if cm is not None:
                out: bool | None = await cm.__aexit__(*exc)
                return out
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
            while not (core.closed or core.broken is not None):
                await self._waker.wait(core.wake_gen)

    async def _maybe_yield(self) -> None:
        # a channel's, and a writer nobody watches (trio without ``async with``) looks
        # at its hub now and then (after a publish: never between it and on_published)
        self._fast_ops += 1
        if self._fast_ops >= _YIELD_EVERY:
            self._fast_ops = 0
            core = self._core
            if not core.watched and not core.closed:
                core.drain()
            await anyio.lowlevel.cancel_shielded_checkpoint()

    # -- readers ------------------------------------------------------------------------

    async def wait_ready(self, n: int) -> int:
        """Wait until at least ``n`` readers have joined and attached; return how many
        have.  (Bound it with ``anyio.fail_after``.)  Raises ``ValueError`` if ``n``
        exceeds :attr:`max_readers`, and what :meth:`send` raises for a closed or failed
        broadcast."""
        self._check_n(n)
        result: int = await self._run(ready(self._core, n))
        return result

    def readers(self) -> list[ReaderInfo]:
        """The readers admitted now, by rank."""
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
        if not self._core.closed:
            self._core.drain()
        return self._core.hub.ready_count

    def statistics(self) -> BroadcastStatistics:
        """A snapshot of the writer's counters."""
        return self._core.statistics()

    # -- closing ------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close: every reader receives what was sent, then ``EndOfStream``."""
        self.close()
        await anyio.lowlevel.checkpoint()

    def close(self) -> None:
        """Close without awaiting (from the event loop's thread); tasks waiting on
        this writer get ``ClosedResourceError``."""
        core = self._core
        if not core.mark_closed():
            return
        self._waker.close()  # wakes every waiter (before the descriptor goes)
        core.release()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
            core.abandon(self)


def _watch_thread(core: BroadcastEndpoint, lock: threading.Lock, stop: list[bool]) -> None:
    """A blocking writer's watcher: do what the hub has pending whenever no operation
    holds the send lock (an operation that waits does it itself).  Holds no reference
    to the writer object, so an unclosed one can still be collected."""
    p = select.poll()
    p.register(core.hub.fileno(), select.POLLIN)
    while not stop[0]:
        p.poll()
        with lock:
            if stop[0] or core.closed:
                return
            core.drain()


class SyncBroadcaster(_Common, SyncSending):
    """The blocking writer of a broadcast (threads, plain scripts): as
    :class:`Broadcaster`, with ``timeout`` arguments (seconds; ``None`` = forever) that
    raise ``TimeoutError`` (:class:`ReaderStalled` when readers are what it waited for).
    Its sends are :class:`~ringwire.SyncChannel`'s.  Thread-safe: one operation runs at
    a time, others wait their turn."""

    _core: BroadcastEndpoint
    _receipt = SyncBroadcastReceipt

    def __init__(self, core: BroadcastEndpoint) -> None:
        self._core = core
        self._send_lock = threading.Lock()
        self._waker = SyncWaker(core)
        self._stop = [False]
        core.watched = True
        self._thread = threading.Thread(
            target=_watch_thread,
            args=(core, self._send_lock, self._stop),
            name=f"ringwire-broadcast-{os.path.basename(core.hub.path)}",
            daemon=True,
        )
        self._thread.start()
        track(self, core, "broadcast")

    def __enter__(self) -> SyncBroadcaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_receipt(self, loop: Loop[Any]) -> Any:
        # the shared pool is the writer's alone: its releases are counted under the lock
        return self._locked(loop, None)

    def loan(
        self,
        shape: Sequence[int],
        dtype: Any,
        *,
        timeout: float | None = None,
        device: Any = None,
        slot_policy: str | None = None,
    ) -> Any:
        """As :meth:`SyncChannel.loan` (under the writer's lock: ``timeout`` bounds the
        wait for it and for a slot together)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._send_lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise TimeoutError("timed out waiting for another thread using this broadcast")
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return SyncSending.loan(
                self, shape, dtype, timeout=left, device=device, slot_policy=slot_policy
            )
        finally:
            self._send_lock.release()

    # -- readers ------------------------------------------------------------------------

    def wait_ready(self, n: int, timeout: float | None = None) -> int:
        """As :meth:`Broadcaster.wait_ready`; ``TimeoutError`` after ``timeout``."""
        self._check_n(n)
        deadline = None if timeout is None else time.monotonic() + timeout
        result: int = self._locked(ready(self._core, n, deadline), deadline)
        return result

    def readers(self) -> list[ReaderInfo]:
        """As :meth:`Broadcaster.readers`."""
        with self._send_lock:
            return self._core.readers()

    def drop_reader(self, rank: int, reason: str = "dropped by the writer") -> bool:
        """As :meth:`Broadcaster.drop_reader`."""
        with self._send_lock:
            return self._core.drop(rank, reason)

    def poll_readers(self) -> int:
        """As :meth:`Broadcaster.poll_readers`."""
        with self._send_lock:
            if not self._core.closed:
                self._core.drain()
            return self._core.hub.ready_count

    def statistics(self) -> BroadcastStatistics:
        """As :meth:`Broadcaster.statistics`."""
        with self._send_lock:
            return self._core.statistics()

    # -- closing ------------------------------------------------------------------------

    def close(self) -> None:
        """Close: every reader receives what was sent, then ``EndOfStream``; threads
        waiting on this writer get ``ClosedResourceError``."""
        core = self._core
        self._stop[0] = True
        with self._waker.cv:
            if not core.mark_closed():  # an operation waiting gives up...
                return
        core.hub.wake()  # ...when this wakes it; the watcher leaves its poll too
        with self._waker.cv:
            self._waker.cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)
        with self._send_lock:
            core.release()
        self._waker.close()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is None or core.closed:
            return
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop[0] = True
        with contextlib.suppress(Exception):
            core.hub.wake()
        core.abandon(self)


def _make_core(
    path: Any,
    readers: int,
    capacity: int,
    slots: SlotConfig | None,
    on_reader_loss: str,
    stall_timeout: float | None,
    handshake_timeout: float,
    spin_us: float,
    remote: dict[str, Any],
) -> BroadcastEndpoint:
    tcp = remote["tcp"]
    if tcp is not None:
        if not isinstance(tcp, str):
            raise TypeError(f"tcp= takes a 'tcp://host:port' string, not {type(tcp).__name__}")
        check_heartbeat(remote["heartbeat"])
        check_bind(tcp, remote["insecure"], remote["keys"])  # before anything is made
    elif remote["keys"] is not None or remote["insecure"]:
        raise ValueError("keys= and insecure= are for remote readers: give tcp= too")
    if on_reader_loss not in LOSS_POLICIES:
        raise ValueError(f"on_reader_loss must be one of {LOSS_POLICIES}, not {on_reader_loss!r}")
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
        if tcp is not None:
            _serve_remote(hub, tcp, capacity, handshake_timeout, remote)
        return BroadcastEndpoint(
            hub, on_reader_loss=on_reader_loss, stall_timeout=stall_timeout, spin_us=spin_us
        )
    except BaseException:
        hub.close()
        raise


def _serve_remote(
    hub: BroadcastHub, tcp: str, capacity: int, handshake_timeout: float, remote: dict[str, Any]
) -> None:
    """Bind ``tcp`` for readers on other hosts and make the hub serve them."""
    acceptor = open_acceptor(
        tcp,
        max_capacity=capacity,
        slots=None,
        heartbeat=remote["heartbeat"],
        handshake_timeout=handshake_timeout,
        insecure=remote["insecure"],
        keys=remote["keys"],
        offer_nixl=False,
        clamp_capacity=True,
    )
    try:
        from .._net.fanout import Fanout, FanoutWriter

        pool = hub.pool
        fanout = Fanout(
            acceptor,
            hub,
            readers=hub.readers,
            window=capacity,
            handshake_timeout=handshake_timeout,
            memory_of=pool.memory_of if pool is not None else None,
            release=pool.release if pool is not None else None,
        )
    except BaseException:
        acceptor.close()
        raise
    hub.attach_remote(fanout)
    hub.tx = FanoutWriter(hub.writer, fanout, lambda: hub.ring(DOORBELL_DATA))


def broadcast(
    path: str | os.PathLike[str],
    *,
    readers: int = 8,
    capacity: int = DEFAULT_CAPACITY,
    slots: SlotConfig | None = DEFAULT_SLOTS,
    on_reader_loss: str = "fail",
    stall_timeout: float | None = 60.0,
    spin_us: float = DEFAULT_SPIN_US,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    tcp: str | None = None,
    keys: ServerKeys | None = None,
    insecure: bool = False,
    heartbeat: float = DEFAULT_HEARTBEAT,
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
    names them (``None``: forever).  ``spin_us`` bounds the spin of a send facing a
    full ring before it parks (``0``: park at once), as a channel's.
    ``handshake_timeout``: how long a reader may take to join.

    Arrays of a step: :meth:`~Broadcaster.loan` a slot, write the array into it and send
    it in the step -- no copy; every reader gets a read-only view of that slot, which
    returns to the pool once every reader has dropped its views.  A private array that
    is sent is copied once into a slot (``perf/broadcast.py --arrays`` measures both).

    ``tcp="tcp://host:port"`` also serves readers on other hosts
    (:func:`ringwire.subscribe` at that address; port 0 binds any free port, see
    :attr:`~Broadcaster.tcp_address`), in the same rank space, with the same promises:
    every step in order from the one they joined at, the same ``on_reader_loss``
    (a death or a partition -- no ZeroMQ heartbeat for ``heartbeat`` seconds -- is a
    loss), ``stall_timeout`` and receipts.  Each step travels once over each remote
    reader's connection, its arrays as ZeroMQ frames sent straight from the slot.  The
    writer's queue for each remote reader is its credit window: at most ``capacity``
    record bytes sent and not consumed (arrays: the slot pool, whose slots a remote
    reader holds until its views of them die); when it is full a send waits, as for a
    full ring.  A non-loopback address needs ``keys`` (:class:`ServerKeys`: CURVE, only
    the listed clients) or ``insecure=True``.

    Raises :class:`SharedMemoryFull` if ``/dev/shm`` cannot hold the ring or the pool,
    ``OSError`` if another broadcast or listener is live at ``path`` or ``tcp`` cannot
    be bound, ``ValueError`` for a bad ``readers``, ``capacity``, ``on_reader_loss``,
    ``stall_timeout``, ``tcp`` or ``heartbeat`` (or a non-loopback ``tcp`` without
    keys), ``TypeError`` for keys that are not :class:`ServerKeys`."""
    return Broadcaster(
        _make_core(
            path,
            readers,
            capacity,
            slots,
            on_reader_loss,
            stall_timeout,
            handshake_timeout,
            spin_us,
            {"tcp": tcp, "keys": keys, "insecure": insecure, "heartbeat": heartbeat},
        )
    )


def broadcast_sync(
    path: str | os.PathLike[str],
    *,
    readers: int = 8,
    capacity: int = DEFAULT_CAPACITY,
    slots: SlotConfig | None = DEFAULT_SLOTS,
    on_reader_loss: str = "fail",
    stall_timeout: float | None = 60.0,
    spin_us: float = DEFAULT_SPIN_US,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    tcp: str | None = None,
    keys: ServerKeys | None = None,
    insecure: bool = False,
    heartbeat: float = DEFAULT_HEARTBEAT,
) -> SyncBroadcaster:
    """Blocking :func:`broadcast`: returns a :class:`SyncBroadcaster`."""
    return SyncBroadcaster(
        _make_core(
            path,
            readers,
            capacity,
            slots,
            on_reader_loss,
            stall_timeout,
            handshake_timeout,
            spin_us,
            {"tcp": tcp, "keys": keys, "insecure": insecure, "heartbeat": heartbeat},
        )
    )
