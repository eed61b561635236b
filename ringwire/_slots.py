"""Zero-copy tensors: SHM slot pools, Ext 4 references, loans, finalizers, receipts.

Every side of a connection that sends large arrays owns one *slot pool* segment (its
*send pool*); the peer attaches it read-mostly.  Only the owner (the *producer*)
allocates.  One pool segment is::

    offset              size                         written by   meaning
    ------              ----                         ----------   -------------------------
    0                   pool_size(classes)           producer     slot pool (:mod:`._slotlayout`)
    pool_size(...)      ring_size(RELEASE_CAPACITY)  consumer     release lane (:mod:`._ringlayout`)

The pool comes first so that the offsets in its slot table, and in every
:class:`~ringwire.SlotRef`, are offsets into the segment itself.  The release lane is
an ordinary SPSC ring whose frames are packed ``(slot u64, generation u64)`` pairs,
written by the consumer and read by the producer.

Sending
-------
The channel's :class:`~ringwire.Encoder` calls :meth:`SendPool.place` for every numpy
array and torch tensor.  An array whose memory lies in a live *loan* of this pool is
sent by reference without a copy (and the loan is used up); any other array at or
above ``SlotConfig.threshold`` bytes is copied once into the smallest free slot.  The
slot is marked ``SENT`` in the shared table *before* the record is published in the
ring (the ring's publish fence orders the two), so a consumer that reads the reference
also sees the state that makes it valid.  If the record is then not published (the
ring is full and the send is cancelled, the peer is gone, an encoding error later in
the record), every slot the record took is given back: copies are freed (generation
+ 1), loans are loaned again.  When no slot is free, the policy decides: ``"inline"``
sends that array inline (Ext 2/3), ``"error"`` raises :class:`SlotsExhausted`,
``"wait"`` gives back what the record took so far, waits for a release, and encodes
the record again.

Receiving
---------
The channel's :class:`~ringwire.Decoder` calls :meth:`RecvPool.resolve` for every
Ext 4.  The reference is checked against the peer's pool as it was read at attach
time (:func:`~ringwire._slotlayout.check_ref`: this connection's pool id, slot in
range, byte range inside that slot, generation current and ``SENT``); anything else
is a :class:`~ringwire.DecodeError` and nothing outside the connection's own pools is
ever attached or read.  The resolver makes one *base* array over the slot bytes
(``np.frombuffer`` on the segment's mmap), attaches ``weakref.finalize(base, ...)``
to it and hands out ``base.view(dtype).reshape(shape)`` (read-only) or
``torch.from_numpy(base).view(dtype).reshape(shape)``.  Every view derived from what
is handed out -- numpy slices and views, ``torch.from_numpy``, torch views,
``tensor.numpy()`` -- keeps ``base`` alive (numpy points a view's ``.base`` at the first
array that is not itself a view of an *array*, and ``base``'s own base is a
memoryview; torch keeps the numpy array alive from its storage), so the finalizer runs
exactly when the last of them dies.  It releases the slot: ``(slot, generation)`` goes
to a :class:`~ringwire._release.ReleaseQueue` whose sink writes the release lane and
rings the producer's doorbell if the producer is parked on that lane.

torch has no read-only tensors: a received tensor is writable, and a write changes
only the slot the consumer was lent (the producer never reads it back).  numpy arrays
are read-only; set ``copy_out=True`` (or call :func:`copy_out`) for private,
writable copies.

Finalizer safety (the argument)
-------------------------------
A finalizer can run in any thread, and inside garbage collection at (almost) any
bytecode of any code -- including ringwire's own, in the middle of a send, a receive,
a flush, or a ring write, and including while that code holds locks.  So:

1. **It never blocks and takes no lock the interrupted code may hold.**  The callback
   (:meth:`RecvPool._finalized`) does two ``dict.pop`` calls and
   :meth:`ReleaseQueue.push`: a ``deque.append`` (atomic under the GIL) and a flush
   that only *tries* the queue's own lock.  The sink it may call writes the release
   lane, which nothing but the sink writes (and the sink runs only under that lock),
   fences with a lock private to the sink (never the module-wide ring fence, which
   ordinary code holds for a few instructions and a collection could interrupt), and
   sends the doorbell byte with a non-blocking ``send`` on the control socket.  The
   channel's own locks (send, receive, the pool lock) are never touched.
2. **It never loses a release.**  If the flush lock is taken -- by another thread, or
   by the very flush this finalizer interrupted -- the holder re-checks the deque after
   releasing the lock (:mod:`ringwire._release`).  If the release lane is full the
   batch stays queued, the sink sets the lane's writer-parked flag, and the producer
   rings back when it has drained the lane; the batch goes out at the next *safe
   point*: every send, receive and loan on the channel, and every doorbell wake-up.
   If a record fails to decode, the references in it that were never resolved are
   released at once (:meth:`RecvPool.salvage`), so a bad record leaks nothing either.
3. **It never touches memory that is unmapped.**  Close first closes the queue (which
   waits for a flush in progress; ``__del__`` uses the non-blocking form), then drops
   the lane's memoryviews, then closes the segment -- which does *not* unmap while
   base arrays (numpy buffer exports) are alive: the mapping goes with the last of
   them.  Everything the sink touches goes through memoryviews, so a sink that
   somehow ran after they were released would get a ``ValueError`` (caught), never
   a fault.  Finalizers are registered with ``atexit = False``: at interpreter exit
   they do not run at all (the producer reclaims every slot when our control socket
   closes), so exit never races an unmap and never raises ``BufferError``.

Peer death
----------
The producer learns of the consumer's death from end-of-file on the control socket
(at once on asyncio, whose reader callback is registered while the endpoint waits;
otherwise at the next operation or wake-up) and reclaims every ``SENT`` slot
(:meth:`SendPool.reclaim`).  If the producer dies, the consumer's views stay valid:
the segment's name was unlinked at handshake time, and its memory lives as long as
the consumer's mapping, which lives as long as the last view.
"""

from __future__ import annotations

import collections
import contextlib
import math
import operator
import struct
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import numpy as np

from . import _ext as X
from ._cuda import (
    CudaNeed,
    CudaSendPool,
    OpenedCudaPool,
    ReleaseThread,
    cuda_backend,
    cuda_nbytes,
    cuda_pool_id,
    cuda_tag,
    split_tag,
)
from ._descriptors import KIND_NUMPY, KIND_TORCH, CudaRef, SlotRef, decode_descriptor
from ._dtypes import (
    numpy_dtype_from_wire,
    numpy_dtype_to_wire,
    torch_dtype_from_wire,
    torch_dtype_to_wire,
    torch_loaded,
    torch_module,
)
from ._errors import DecodeError, EncodeError, RingwireError
from ._release import ReleaseQueue
from ._ringlayout import (
    _RPARKED,
    _TAIL,
    _WPARKED,
    FrameTooLarge,
    RingCorrupted,
    RingReader,
    RingWriter,
    check_ring,
    init_ring,
    ring_size,
)
from ._segment import Segment, SharedMemoryFull
from ._slotlayout import (
    LOANED,
    SENT,
    PoolLayout,
    SlotAllocator,
    SlotClass,
    SlotRefused,
    check_ref,
    init_pool,
    pool_size,
    read_pool,
)

__all__ = [
    "DEFAULT_SLOTS",
    "RELEASE_CAPACITY",
    "RecvPool",
    "SendPool",
    "SlotConfig",
    "SlotMisuse",
    "SlotsExhausted",
    "attach_pool",
    "borrow",
    "check_policy",
    "copy_out",
    "create_pool",
    "loan_spec",
    "release",
]

RELEASE_CAPACITY = 64 * 1024
"""Data bytes of a pool's release lane (about 2000 releases per frame)."""

Policy = Literal["wait", "inline", "error"]
_POLICIES = ("wait", "inline", "error")
_KiB, _MiB = 1 << 10, 1 << 20


class SlotsExhausted(RingwireError):
    """No slot is free for an array (policy ``"error"``), or none can ever be (the
    record needs more slots than the pool has), or a wait for one timed out."""


class SlotMisuse(EncodeError):
    """An array lives in a slot of this pool that is not a live loan: a loaned buffer
    was sent twice, or used after it was sent."""


@dataclass(frozen=True)
class SlotConfig:
    """How one side of a connection sends large arrays and tensors.

    ``classes``
        the slot size classes of this side's send pool (``count`` slots of ``size``
        bytes each); the pool occupies about their total in ``/dev/shm`` for the life
        of the connection.  The default holds 16 x 64 KiB, 16 x 1 MiB and 4 x 16 MiB
        (81 MiB).
    ``threshold``
        arrays of at least this many bytes travel through a slot; smaller ones inline.
    ``policy``
        when no slot is free: ``"wait"`` for a release (``wait_timeout`` seconds at
        most, ``None`` = forever; async waits are also cancellable), ``"inline"`` send
        it inline instead, ``"error"`` raise :class:`SlotsExhausted`.  A send can
        override it (``send(item, slot_policy=...)``).
    ``copy_out``
        the *receiving* side's choice: copy every received slot array into private
        memory and release the slot at once (no finalizers; arrays are writable).
    ``cuda``
        what to do with CUDA tensors of at least ``cuda_threshold`` bytes: ``"ipc"``
        sends them by reference into this side's GPU pool for their device (Ext 5; the
        consumer gets a view on the same device, no host copy); ``"stage"`` copies them
        to the host and sends them like CPU tensors (for a consumer without a GPU).
        Smaller CUDA tensors travel inline (through the host) and are restored on
        their device.
    ``cuda_classes``
        the slot classes of each GPU pool (allocated on the device the first time a
        tensor of that device is sent; default 16 x 1 MiB, 8 x 16 MiB, 2 x 128 MiB).
    """

    classes: tuple[SlotClass, ...] = (
        SlotClass(64 * _KiB, 16),
        SlotClass(1 * _MiB, 16),
        SlotClass(16 * _MiB, 4),
    )
    threshold: int = 64 * _KiB
    policy: Policy = "wait"
    copy_out: bool = False
    wait_timeout: float | None = None
    cuda: Literal["ipc", "stage"] = "ipc"
    cuda_threshold: int = 64 * _KiB
    cuda_classes: tuple[SlotClass, ...] = (
        SlotClass(1 * _MiB, 16),
        SlotClass(16 * _MiB, 8),
        SlotClass(128 * _MiB, 2),
    )

    def __post_init__(self) -> None:
        for field_name in ("classes", "cuda_classes"):
            classes = tuple(getattr(self, field_name))
            if not classes or not all(isinstance(c, SlotClass) for c in classes):
                raise ValueError(
                    f"SlotConfig.{field_name} must be a non-empty sequence of SlotClass"
                )
            pool_size(classes)  # checks the slot count
            object.__setattr__(self, field_name, classes)
        for field_name in ("threshold", "cuda_threshold"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{field_name} must be a non-negative int, not {value!r}")
        if self.policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, not {self.policy!r}")
        if self.wait_timeout is not None and not self.wait_timeout >= 0:
            raise ValueError("wait_timeout must be None or >= 0")
        if self.cuda not in ("ipc", "stage"):
            raise ValueError(f"cuda must be 'ipc' or 'stage', not {self.cuda!r}")

    @property
    def pool_bytes(self) -> int:
        """Bytes of ``/dev/shm`` one send pool of this configuration takes."""
        return pool_size(self.classes) + ring_size(RELEASE_CAPACITY)

    def describe(self) -> str:
        return _describe(self.classes)


DEFAULT_SLOTS = SlotConfig()
"""The default send-pool configuration (``slots=`` of connect, listen and pair)."""

# What ``slots=DEFAULT_SLOTS`` means when a connection is made (a test suite may swap
# in a smaller pool here to keep thousands of connections cheap).
default_slots: SlotConfig | None = DEFAULT_SLOTS


def resolve_config(slots: SlotConfig | None) -> SlotConfig | None:
    if slots is DEFAULT_SLOTS:
        return default_slots
    if slots is not None and not isinstance(slots, SlotConfig):
        raise TypeError(f"slots must be a SlotConfig or None, not {type(slots).__name__}")
    return slots


def _describe(classes: Sequence[SlotClass]) -> str:
    return ", ".join(f"{c.count} x {_human(c.size)}" for c in classes)


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", _MiB), ("KiB", _KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


# -- segments ---------------------------------------------------------------------------


def create_pool(config: SlotConfig) -> tuple[Segment, PoolLayout]:
    """Create, reserve and initialise a send-pool segment."""
    psize = pool_size(config.classes)
    try:
        seg = Segment.create(psize + ring_size(RELEASE_CAPACITY))
    except SharedMemoryFull as exc:
        raise SharedMemoryFull(
            f"{exc}; this is a tensor-slot pool ({config.describe()}): configure smaller "
            "slot classes (slots=SlotConfig(...)), or slots=None to send every array inline"
        ) from None
    try:
        layout = init_pool(seg.buf, config.classes)
        init_ring(seg.buf, psize, RELEASE_CAPACITY)
    except BaseException:
        seg.unlink()
        seg.close()
        raise
    return seg, layout


def attach_pool(seg: Segment) -> PoolLayout:
    """Check the peer's pool segment once, at attach time; keep the returned layout
    (later rewrites of the table by the peer cannot move slots)."""
    layout = read_pool(seg.buf)
    if layout.total_size + ring_size(RELEASE_CAPACITY) > seg.size:
        raise RingwireError("slot pool segment has no room for its release lane")
    check_ring(seg.buf, layout.total_size, RELEASE_CAPACITY)
    return layout


def _address(buf: Any) -> int:
    probe = np.frombuffer(buf, np.uint8, count=1)
    try:
        return int(probe.__array_interface__["data"][0])
    finally:
        del probe


class _NeedSlot(Exception):
    """Internal: policy "wait" found no free slot; the send path waits and retries."""

    def __init__(self, nbytes: int | CudaNeed) -> None:
        super().__init__(nbytes)
        self.nbytes = nbytes


# -- the producer's side -----------------------------------------------------------------

# (slot, generation, was a loan)
Placed = list[tuple[int, int, bool]]


class SendPool:
    """The producer's view of its own pool: allocation, loans, releases, receipts.

    Not thread-safe by itself except where noted: the channel calls :meth:`place`
    under its send lock (or from its one event loop).  The pool's state changes under
    ``self.lock``, which finalizers never take (a dropped loan only appends to a
    deque).
    """

    def __init__(
        self, seg: Segment, layout: PoolLayout, config: SlotConfig, max_inline: int
    ) -> None:
        self.seg = seg
        self.config = config
        self.layout = layout
        self.alloc = SlotAllocator(seg.buf, layout)
        self.reader = RingReader(seg.buf, layout.total_size)
        self.lock = threading.Lock()
        self._buf: Any = seg.buf
        base = _address(seg.buf)
        self._base = base
        self._lo = base + layout.data_offset
        self._hi = base + layout.total_size
        self._max_inline = max_inline
        self._loans: set[int] = set()
        self._loan_returns: collections.deque[tuple[int, int]] = collections.deque()
        self._record: Placed | None = None
        self._policy: str = config.policy
        self._parked = 0
        self.gone = False  # the consumer is gone: every slot was reclaimed
        self.closed = False
        self.releases_received = 0
        self.inline_fallbacks = 0
        self.reclaimed = 0
        self.cuda_pools: dict[int, CudaSendPool] = {}  # device -> GPU pool (made on first use)
        self.cuda_staged = 0

    # -- queries ----------------------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        alloc = self.alloc
        in_use = [i for i in range(self.layout.nslots) if alloc.status(i) != 0]
        return {
            "slots_in_use": len(in_use),
            "slots_free": alloc.free_by_size(),
            "slot_bytes_in_use": sum(self.layout.capacities[i] for i in in_use),
            "releases_received": self.releases_received,
            "loans_outstanding": len(self._loans),
            "inline_fallbacks": self.inline_fallbacks,
            **self._cuda_statistics(),
        }

    def _cuda_statistics(self) -> dict[str, Any]:
        if not self.cuda_pools and not self.cuda_staged:
            return {}
        pools = self.cuda_pools.values()
        return {
            "cuda_pools": sorted(self.cuda_pools),
            "cuda_slots_in_use": sum(p.alloc.in_use() for p in pools),
            "cuda_slots_free": {
                f"cuda:{d}": p.alloc.free_by_size() for d, p in self.cuda_pools.items()
            },
            "cuda_staged": self.cuda_staged,
        }

    def _alloc_of(self, tag: int) -> tuple[SlotAllocator, int]:
        """The allocator and slot index a release-lane slot number names."""
        split = split_tag(tag)
        if split is None:
            return self.alloc, tag
        device, slot = split
        pool = self.cuda_pools.get(device)
        if pool is None or slot >= pool.layout.nslots:
            raise SlotRefused(f"release of CUDA slot {slot} on cuda:{device}: no such slot")
        return pool.alloc, slot

    def has_work(self) -> bool:
        """Releases or dropped loans are waiting to be processed."""
        if self.gone:
            return False
        return bool(self._loan_returns) or self.reader.available()

    def can_allocate(self, nbytes: int | CudaNeed) -> bool:
        if isinstance(nbytes, CudaNeed):
            pool = self.cuda_pools.get(nbytes.device)
            return pool is None or pool.alloc.can_allocate(nbytes.nbytes)
        return self.alloc.can_allocate(nbytes)

    def consumed(self, pairs: Sequence[tuple[int, int]]) -> bool:
        for tag, g in pairs:
            alloc, slot = self._alloc_of(tag)
            if alloc.generation(slot) == g:
                return False
        return True

    # -- placing (the Encoder's placer) -----------------------------------------------

    def begin(self, policy: str | None) -> None:
        self._record = []
        self._policy = check_policy(policy) or self.config.policy

    def end(self) -> Placed:
        placed, self._record = self._record or [], None
        return placed

    def abort(self, placed: Placed) -> None:
        """Give back the slots of a record that was not published."""
        if not placed or self.closed:
            return
        with self.lock:
            for tag, gen, loan in placed:
                alloc, slot = self._alloc_of(tag)
                if alloc.status(slot) != SENT or alloc.generation(slot) != gen:
                    continue  # reclaimed meanwhile (the consumer is gone)
                if loan:
                    alloc.unsend(slot)
                    self._loans.add(tag)
                else:
                    alloc.release(slot, gen)

    def place(self, obj: Any) -> SlotRef | CudaRef | None:
        """The Encoder's placer: a :class:`SlotRef` for ``obj`` or ``None`` (inline)."""
        if isinstance(obj, np.ndarray):
            nbytes = obj.nbytes
            if obj.base is not None:
                addr = obj.__array_interface__["data"][0]
                if self._lo <= addr < self._hi:
                    ref = self._place_loaned(obj, addr, nbytes, obj.flags.c_contiguous)
                    if ref is not None:
                        return ref
            if nbytes < self.config.threshold:
                return None
            wire = numpy_dtype_to_wire(obj.dtype)
            kind = KIND_NUMPY
        else:
            torch = torch_module()
            if not isinstance(obj, torch.Tensor):
                return None
            backend = cuda_backend()
            if backend is not None and backend.is_device_tensor(obj):
                return self._place_cuda(obj, backend)
            if obj.device.type != "cpu" or obj.layout != torch.strided:
                return None  # other devices inline; sparse tensors get the inline error
            nbytes = obj.numel() * obj.element_size()
            addr = obj.data_ptr()
            if self._lo <= addr < self._hi:
                ref = self._place_loaned(obj, addr, nbytes, obj.is_contiguous())
                if ref is not None:
                    return ref
            if nbytes < self.config.threshold:
                return None
            wire = torch_dtype_to_wire(obj.dtype)
            kind = KIND_TORCH
        if nbytes > self.alloc.largest:
            if nbytes > self._max_inline:
                raise FrameTooLarge(
                    f"a {nbytes}-byte array fits neither a slot of this channel's pool "
                    f"({self.config.describe()}) nor the ring (at most {self._max_inline} "
                    "bytes per record): configure a larger slot class (slots=SlotConfig(...))"
                )
            self.inline_fallbacks += 1
            return None
        record = self._record
        assert record is not None, "place() outside begin()/end()"
        with self.lock:
            slot = self.alloc.allocate(nbytes)
            if slot is None:
                others = self.alloc.in_use() - sum(1 for t, _, _ in record if t >> 32 == 0)
        if slot is None:
            self._exhausted(others, nbytes, "", self.config.describe())
            return None  # policy "inline"
        try:
            self._copy_in(obj, slot, nbytes)
        except BaseException:
            with self.lock:
                self.alloc.cancel(slot)
            raise
        with self.lock:
            self.alloc.mark_sent(slot)
            gen = self.alloc.generation(slot)
        record.append((slot, gen, False))
        return self.alloc.ref(slot, nbytes, obj.shape, wire, kind)

    # -- CUDA tensors (Ext 5) ---------------------------------------------------------

    def _cuda_pool(self, device: int, backend: Any) -> CudaSendPool:
        pool = self.cuda_pools.get(device)
        if pool is None:
            pool = CudaSendPool(
                backend,
                device,
                self.config.cuda_classes,
                cuda_pool_id(self.layout.pool_id, device),
            )
            self.cuda_pools[device] = pool
        return pool

    def _place_cuda(self, obj: Any, backend: Any) -> SlotRef | CudaRef | None:
        config = self.config
        nbytes = cuda_nbytes(obj)
        if config.cuda == "stage":
            if nbytes < config.cuda_threshold:
                return None  # inline through the host, restored on the device
            self.cuda_staged += 1
            return self.place(obj.detach().cpu())
        device = backend.device_index(obj)
        pool = self.cuda_pools.get(device)
        addr = obj.data_ptr()
        record = self._record
        assert record is not None, "place() outside begin()/end()"
        if pool is not None and pool.lo <= addr < pool.hi:
            with self.lock:
                slot = pool.alloc.slot_at(addr - pool.lo, nbytes)
                tag = cuda_tag(device, slot) if slot is not None else -1
                if tag not in self._loans or pool.alloc.status(slot) != LOANED:  # type: ignore[arg-type]
                    raise SlotMisuse(
                        "this tensor lives in a slot of the channel's GPU pool that is no "
                        "longer loaned: a loaned buffer can be sent once, and must not be "
                        "used after it was sent (loan a new one)"
                    )
                if obj.is_contiguous():
                    assert slot is not None
                    pool.alloc.mark_sent(slot)
                    self._loans.discard(tag)
                    record.append((tag, pool.alloc.generation(slot), True))
                    return pool.ref(slot, addr - pool.lo, nbytes, obj)
        if nbytes < config.cuda_threshold:
            return None
        if pool is None:
            with self.lock:
                pool = self._cuda_pool(device, backend)
        if nbytes > pool.alloc.largest:
            if nbytes > self._max_inline:
                raise FrameTooLarge(
                    f"a {nbytes}-byte CUDA tensor fits neither a slot of this channel's GPU "
                    f"pool ({_describe(config.cuda_classes)}) nor the ring (at most "
                    f"{self._max_inline} bytes per record): configure larger "
                    "SlotConfig.cuda_classes"
                )
            self.inline_fallbacks += 1
            return None
        with self.lock:
            slot = pool.alloc.allocate(nbytes)
            if slot is None:
                others = pool.alloc.in_use() - sum(
                    1 for t, _, _ in record if (split_tag(t) or (-1,))[0] == device
                )
        if slot is None:
            self._exhausted(
                others, CudaNeed(device, nbytes), "CUDA ", _describe(config.cuda_classes)
            )
            return None  # policy "inline"
        offset = pool.layout.offsets[slot]
        try:
            pool.backend.copy_into(pool.memory, offset, obj)
            with self.lock:
                pool.alloc.mark_sent(slot)
                ref = pool.ref(slot, offset, nbytes, obj)
        except BaseException:
            with self.lock:
                pool.alloc.cancel(slot)
            raise
        record.append((cuda_tag(device, slot), ref.generation, False))
        return ref

    def loan_cuda(self, device: int, dtype: Any, shape: tuple[int, ...], nbytes: int) -> Any:
        """A writable CUDA tensor inside a free slot of the GPU pool for ``device``, or
        ``None`` if none is free."""
        backend = cuda_backend()
        if backend is None:
            raise RingwireError("CUDA loans need CUDA in this process (torch.cuda is not available)")
        with self.lock:
            pool = self._cuda_pool(device, backend)
            if nbytes > pool.alloc.largest:
                raise ValueError(
                    f"a loan of {nbytes} bytes does not fit the GPU pool's largest slot "
                    f"({_describe(self.config.cuda_classes)})"
                )
            slot = pool.alloc.allocate(nbytes)
            if slot is None:
                return None
            tag = cuda_tag(device, slot)
            self._loans.add(tag)
            gen = pool.alloc.generation(slot)
        tensor, keep = pool.loan_view(slot, nbytes, dtype, shape)
        fin = weakref.finalize(keep, self._loan_returns.append, (tag, gen))
        fin.atexit = False
        return tensor

    def _exhausted(self, others: int, need: int | CudaNeed, what: str, pool: str) -> None:
        """No slot is free for ``need``: apply the policy -- return (policy "inline":
        the caller sends it inline) or raise -- given ``others`` slots held by earlier
        records (none: waiting cannot help)."""
        if self._policy == "inline":
            self.inline_fallbacks += 1
            return
        if others <= 0:
            raise SlotsExhausted(f"this record needs more {what}slots than the pool has ({pool})")
        if self._policy == "error":
            text = f"{need} bytes" if isinstance(need, int) else str(need)
            raise SlotsExhausted(f"no free {what}slot for {text} ({pool}; policy 'error')")
        raise _NeedSlot(need)

    def _copy_in(self, obj: Any, slot: int, nbytes: int) -> None:
        dst = np.frombuffer(self._buf, np.uint8, count=nbytes, offset=self.layout.offsets[slot])
        if isinstance(obj, np.ndarray):
            if nbytes:
                np.copyto(dst.view(obj.dtype).reshape(obj.shape), obj, casting="no")
        else:
            torch = torch_module()
            t = obj.detach()
            if not nbytes:
                return
            if t.is_contiguous() and not t.is_conj() and not t.is_neg():
                # one memcpy on this thread: torch's copy_ fans out to its thread pool
                # (about twice the CPU for the same wall time on a small machine)
                src = t.reshape(-1).view(torch.uint8).numpy()
                np.copyto(dst, src, casting="no")
            else:
                torch.from_numpy(dst).view(t.dtype).reshape(t.shape).copy_(t)

    def _place_loaned(self, obj: Any, addr: int, nbytes: int, contiguous: bool) -> SlotRef | None:
        off = addr - self._base
        with self.lock:
            slot = self.alloc.slot_at(off, nbytes)
            if slot is None or slot not in self._loans or self.alloc.status(slot) != LOANED:
                raise SlotMisuse(
                    "this array lives in a slot of the channel's pool that is no longer "
                    "loaned: a loaned buffer can be sent once, and must not be used after "
                    "it was sent (loan a new one)"
                )
            if not contiguous:
                return None  # an ordinary (strided) array that happens to live in a loan
            if isinstance(obj, np.ndarray):
                wire, kind = numpy_dtype_to_wire(obj.dtype), KIND_NUMPY
            else:
                wire, kind = torch_dtype_to_wire(obj.dtype), KIND_TORCH
            self.alloc.mark_sent(slot)
            self._loans.discard(slot)
            gen = self.alloc.generation(slot)
        assert self._record is not None, "place() outside begin()/end()"
        self._record.append((slot, gen, True))
        return SlotRef(
            version=1,
            pool=self.layout.pool_id,
            slot=slot,
            generation=gen,
            offset=off,
            nbytes=nbytes,
            shape=tuple(obj.shape),
            dtype=wire,
            kind=kind,  # type: ignore[arg-type]
        )

    # -- loans ------------------------------------------------------------------------

    def loan(
        self, kind: str, np_dtype: Any, t_dtype: Any, shape: tuple[int, ...], nbytes: Any
    ) -> Any:
        """A writable array / tensor (see :func:`loan_spec`) inside a free slot, or
        ``None`` if none is free."""
        if isinstance(nbytes, CudaNeed):
            return self.loan_cuda(nbytes.device, t_dtype, shape, nbytes.nbytes)
        if nbytes > self.alloc.largest:
            raise ValueError(
                f"a loan of {nbytes} bytes does not fit the pool's largest slot "
                f"({self.config.describe()})"
            )
        with self.lock:
            slot = self.alloc.allocate(nbytes)
            if slot is None:
                return None
            self._loans.add(slot)
            gen = self.alloc.generation(slot)
        base = np.frombuffer(self._buf, np.uint8, count=nbytes, offset=self.layout.offsets[slot])
        fin = weakref.finalize(base, self._loan_returns.append, (slot, gen))
        fin.atexit = False
        if kind == KIND_NUMPY:
            return base.view(np_dtype).reshape(shape)
        return torch_module().from_numpy(base).view(t_dtype).reshape(shape)

    def loan_fallback(
        self, kind: str, np_dtype: Any, t_dtype: Any, shape: tuple[int, ...], nbytes: Any
    ) -> Any:
        """Policy "inline": a private array of that shape and dtype."""
        self.inline_fallbacks += 1
        if isinstance(nbytes, CudaNeed):
            return cuda_backend().empty(shape, t_dtype, nbytes.device)
        if kind == KIND_NUMPY:
            return np.empty(shape, np_dtype)
        return torch_module().empty(shape, dtype=t_dtype)

    def futile(self, need: int | CudaNeed = 0) -> bool:
        """No slot is in use: waiting for a release cannot help."""
        if isinstance(need, CudaNeed):
            pool = self.cuda_pools.get(need.device)
            return pool is None or pool.alloc.in_use() == 0
        return self.alloc.in_use() == 0

    # -- releases ---------------------------------------------------------------------

    def poll(self) -> bool:
        """Process the release lane and dropped loans (if no other thread is).

        Returns ``True`` when the consumer waits for room in the release lane (the
        caller rings its doorbell).  Raises :class:`SlotRefused` or
        :class:`RingCorrupted` for a bad release: the connection is then broken.
        """
        if self.gone or self.closed or not self.lock.acquire(False):
            return False
        try:
            return self._poll_locked()
        finally:
            self.lock.release()

    def _poll_locked(self) -> bool:
        ring_back = False
        reader = self.reader
        release = self.alloc.release
        try:
            while True:
                view = reader.next_frame()
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
                    tag = vals[i]
                    if tag >> 32:
                        alloc, slot = self._alloc_of(tag)
                        alloc.release(slot, vals[i + 1])
                    else:
                        release(tag, vals[i + 1])
                    self.releases_received += 1
        finally:
            if reader.pending:
                reader.commit()
                ring_back = reader.writer_needs_doorbell()
        self._take_back_loans()
        return ring_back

    def _take_back_loans(self) -> None:
        """Loans dropped unsent return to the free lists (under ``self.lock``)."""
        returns = self._loan_returns
        while returns:
            tag, gen = returns.popleft()
            alloc, slot = self._alloc_of(tag)
            if tag in self._loans and alloc.generation(slot) == gen:
                self._loans.discard(tag)
                alloc.cancel(slot)

    def reclaim(self, *, publish: bool = True) -> int:
        """The consumer is gone: take back every slot it held (after processing the
        releases it published before it went).  ``publish=False``: we are closing, and
        only our own bookkeeping changes (see ``SlotAllocator.reclaim_sent``)."""
        with self.lock:
            if self.gone:
                if not self.closed:
                    self._take_back_loans()  # loans dropped after the consumer went
                return 0
            try:
                if not self.closed:
                    self._poll_locked()
            except RingwireError:
                pass
            self.gone = True
            n = self.alloc.reclaim_sent(publish=publish)
            for pool in self.cuda_pools.values():
                n += pool.alloc.reclaim_sent()
            self.reclaimed += n
            return n

    # eventcount on the release lane (counted: several waiters may park at once)
    def park(self) -> None:
        self._parked += 1
        self.reader.park()

    def unpark(self) -> None:
        self._parked -= 1
        if not self._parked and not self.closed:
            self.reader.unpark()

    def close(self) -> None:
        """Our side closed: the pool is reclaimed (receipts complete), the lane views
        dropped, the segment closed -- or, while loans are alive, left to them: we drop
        every reference to the mapping, so the last loan to die unmaps it.  The shared
        slot table is left as it is: records we published before closing stay readable
        (their references resolve) until the consumer has read them."""
        with self.lock:
            if self.cuda_pools and not (self.gone or self.closed):
                with contextlib.suppress(RingwireError):
                    self._poll_locked()  # the releases already on the lane count
            reusable = {d: p.reusable(self.gone) for d, p in self.cuda_pools.items()}
        self.reclaim(publish=False)
        with self.lock:
            self.closed = True
            self.reader.release()
            seg = self.seg
            self._buf = self.alloc._buf = None
            for device, pool in self.cuda_pools.items():
                pool.close(reusable[device])
        seg.unlink()
        seg.close()
        self.seg = None  # type: ignore[assignment]


def loan_spec(
    shape: Any, dtype: Any, device: Any = None
) -> tuple[str, Any, Any, tuple[int, ...], int | CudaNeed]:
    """``(kind, numpy dtype, torch dtype, shape, nbytes)`` of a loan request; for a
    CUDA ``device``, ``("cuda", device index, torch dtype, shape, CudaNeed)``."""
    if isinstance(shape, int):
        shape = (shape,)
    dims = tuple(operator.index(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimension in shape {dims}")
    if device is not None:
        if not torch_loaded():
            raise ValueError("a loan on a device needs a torch dtype")
        torch = torch_module()
        dev = torch.device(device)
        if dev.type == "cpu":
            return loan_spec(dims, dtype)
        if dev.type != "cuda":
            raise ValueError(f"loans live in host memory or on a CUDA device, not {dev}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"a CUDA loan needs a torch dtype, not {dtype!r}")
        torch_dtype_to_wire(dtype)
        backend = cuda_backend()
        if backend is None:
            raise ValueError(f"{dev} is not available in this process")
        index = dev.index if dev.index is not None else backend.current_device()
        need = CudaNeed(int(index), math.prod(dims) * int(dtype.itemsize))
        return "cuda", need.device, dtype, dims, need
    if torch_loaded():
        torch = torch_module()
        if isinstance(dtype, torch.dtype):
            torch_dtype_to_wire(dtype)  # refuses dtypes that cannot be sent
            return KIND_TORCH, None, dtype, dims, math.prod(dims) * int(dtype.itemsize)
    np_dtype = np.dtype(dtype)
    numpy_dtype_to_wire(np_dtype)
    return KIND_NUMPY, np_dtype, None, dims, math.prod(dims) * np_dtype.itemsize


def check_policy(policy: str | None) -> str | None:
    if policy is not None and policy not in _POLICIES:
        raise ValueError(f"slot_policy must be one of {_POLICIES}, not {policy!r}")
    return policy


# -- the consumer's side -----------------------------------------------------------------

# Every received slot array alive in this process: base address -> its finalizer
# (so release() / copy_out() can find the slot of any view of it).
_HELD: dict[int, weakref.finalize[Any, Any]] = {}


class _ReleaseWriter(RingWriter):
    """The release lane's writer, used only by the release sink (under the queue's
    flush lock).  It fences with a private lock: the sink runs in finalizers, which
    may interrupt code holding the module-wide ring fence lock."""

    __slots__ = ("_own",)

    def __init__(self, buf: Any, offset: int) -> None:
        super().__init__(buf, offset)
        self._own = threading.Lock()

    def _fence(self) -> None:
        self._own.acquire()
        self._own.release()

    def put(self, payload: bytes) -> bool:
        n = len(payload)
        need = (n + 11) & ~7
        if self._space_for(need) < 0:
            return False
        self._put(payload, n, need)
        self._fence()  # payload before tail
        self._q[_TAIL] = self._tail
        return True

    def ring_wanted(self) -> bool:
        """After :meth:`put`: is the producer parked on the lane (and not rung yet)?"""
        self._fence()
        seq = self._q[_RPARKED]
        if seq and seq != self._rung:
            self._rung = seq
            return True
        return False

    def park_writer(self) -> None:
        self._park_seq += 1
        self._q[_WPARKED] = self._park_seq
        self._fence()

    def unpark_writer(self) -> None:
        if self._q[_WPARKED]:
            self._q[_WPARKED] = 0


class RecvPool:
    """The consumer's view of the peer's pool: resolver, finalizers, release sink."""

    def __init__(self, seg: Segment, layout: PoolLayout, sock: Any, copy_out: bool) -> None:
        self.seg = seg
        self.layout = layout
        self._buf: Any = seg.buf
        self._sock = sock
        self._copy_out = copy_out
        self._writer = _ReleaseWriter(seg.buf, layout.total_size)
        self.queue = ReleaseQueue(self._sink, max_batch=self._writer.max_payload // 16)
        self.held: dict[int, int] = {}  # slot (or CUDA tag) -> generation of every live base
        self.resolved: list[tuple[int, int]] | None = None  # refs resolved by the current decode
        self.doorbells = 0
        self.received = 0
        # CUDA (Ext 5): the producer's GPU pools as mapped here, and the release thread
        self.cuda_opened: dict[tuple[int, int], OpenedCudaPool] = {}
        self.cuda_opens = 0
        self.cuda_received = 0
        self._cuda_releaser: ReleaseThread | None = None
        self._cuda_unmapped: dict[int, int] = {}  # tag -> last generation given back unread

    # -- resolving (the Decoder's resolver) --------------------------------------------

    def resolve(self, ref: SlotRef | CudaRef) -> Any:
        if not isinstance(ref, SlotRef):
            return self._resolve_cuda(ref)
        check_ref(self._buf, self.layout, ref)
        slot, gen = ref.slot, ref.generation
        if self.held.get(slot) == gen:
            raise DecodeError(f"slot {slot} generation {gen} is referenced twice")
        resolved = self.resolved
        if resolved is not None:
            resolved.append((slot, gen))
        try:
            if ref.kind == KIND_NUMPY:
                dtype = numpy_dtype_from_wire(ref.dtype)
                align = dtype.alignment
            else:
                torch = torch_module()
                tdtype = torch_dtype_from_wire(ref.dtype)
                align = min(int(tdtype.itemsize), 16)
            if ref.offset % align:
                raise DecodeError(
                    f"slot reference offset {ref.offset} is misaligned for {ref.dtype}"
                )
            base = np.frombuffer(self._buf, np.uint8, count=ref.nbytes, offset=ref.offset)
        except BaseException:
            self.queue.push(slot, gen)  # valid, but we cannot use it: give it back now
            raise
        self.received += 1
        if self._copy_out:
            base = base.copy()
            self.queue.push(slot, gen)
        else:
            addr = base.__array_interface__["data"][0]
            self.held[slot] = gen
            fin = weakref.finalize(base, self._finalized, slot, gen, addr)
            fin.atexit = False
            _HELD[addr] = fin
        if ref.kind == KIND_NUMPY:
            out = base.view(dtype).reshape(ref.shape)
            if not self._copy_out:
                out.flags.writeable = False
            return out
        return torch.from_numpy(base).view(tdtype).reshape(ref.shape)

    def _open_cuda(self, ref: CudaRef, backend: Any) -> OpenedCudaPool:
        """The producer's GPU pool ``ref`` names, mapped on first use (once per
        producer and device)."""
        key = (ref.pool, ref.device)
        opened = self.cuda_opened.get(key)
        if opened is not None:
            return opened
        if ref.pool != cuda_pool_id(self.layout.pool_id, ref.device):
            raise DecodeError(
                f"CUDA reference names pool {ref.pool:#x}, which is not this connection's "
                f"GPU pool for cuda:{ref.device}"
            )
        if ref.device >= backend.device_count():
            raise DecodeError(
                f"CUDA reference names cuda:{ref.device}; this process sees "
                f"{backend.device_count()} device(s)"
            )
        if not ref.pool_handle:
            raise DecodeError("CUDA reference to a pool that was never announced")
        try:
            opened = OpenedCudaPool(backend, ref)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(f"cannot open the producer's GPU pool: {exc}") from exc
        self.cuda_opened[key] = opened
        self.cuda_opens += 1
        if self._cuda_releaser is None:
            self._cuda_releaser = ReleaseThread(backend, self.queue.push)
        return opened

    def _resolve_cuda(self, ref: CudaRef) -> Any:
        backend = cuda_backend(import_torch=True)
        if backend is None:
            raise DecodeError(
                "a CUDA tensor reference (Ext 5) arrived, but this process has no CUDA "
                "(torch missing or CPU-only, or no device); the producer can "
                "send CUDA tensors through the host with SlotConfig(cuda='stage')"
            )
        opened = self._open_cuda(ref, backend)
        tag = opened.check(ref, self.held)
        opened.last_generation[ref.slot] = ref.generation
        resolved = self.resolved
        if resolved is not None:
            resolved.append((tag, ref.generation))
        device = ref.device
        try:
            stream = backend.current_stream(device)
            if ref.event:
                backend.wait_event(opened.event(ref.event), stream)
            tensor, keep = backend.view(
                opened.memory, ref.offset, ref.nbytes, torch_dtype_from_wire(ref.dtype), ref.shape
            )
        except BaseException as exc:
            self.queue.push(tag, ref.generation)  # valid, but unusable: give it back now
            if isinstance(exc, Exception) and not isinstance(exc, DecodeError):
                raise DecodeError(f"cannot map CUDA reference: {exc}") from exc
            raise
        self.received += 1
        self.cuda_received += 1
        releaser = self._cuda_releaser
        assert releaser is not None
        if self._copy_out:
            out = tensor.clone()
            del tensor, keep
            releaser.put(tag, ref.generation, backend.release_event(stream))
            return out
        addr = int(tensor.untyped_storage().data_ptr())
        self.held[tag] = ref.generation
        fin = weakref.finalize(keep, self._cuda_finalized, tag, ref.generation, addr, stream)
        fin.atexit = False
        _HELD[addr] = fin
        return tensor

    def _cuda_finalized(self, tag: int, gen: int, addr: int, stream: Any) -> None:
        # runs in any thread, inside GC: dict pops, one event record, a SimpleQueue put
        _HELD.pop(addr, None)
        if self.held.get(tag) == gen:
            self.held.pop(tag, None)
        releaser = self._cuda_releaser
        if releaser is None or self.queue.closed:
            return
        try:
            event = releaser._backend.release_event(stream)
        except Exception:
            return  # the CUDA context is gone (exit): the producer reclaims on EOF
        releaser.put(tag, gen, event)

    def _finalized(self, slot: int, gen: int, addr: int) -> None:
        # runs in any thread, inside GC: dict pops and a non-blocking push only
        _HELD.pop(addr, None)
        if self.held.get(slot) == gen:
            self.held.pop(slot, None)
        self.queue.push(slot, gen)

    def salvage(self, payload: Any, resolved: Sequence[tuple[int, int]]) -> int:
        """A record failed to decode: release the valid references in it that the
        decode did not resolve (those that were resolved release themselves)."""
        done = set(resolved)
        found: list[tuple[int, int]] = []

        def hook(code: int, data: memoryview) -> None:
            if code == X.CUDA_REF:
                try:
                    cref = decode_descriptor(CudaRef, data)
                    opened = self.cuda_opened.get((cref.pool, cref.device))
                    if opened is not None:
                        tag = opened.check(cref, self.held)
                        opened.last_generation[cref.slot] = cref.generation
                    else:  # never mapped here (no CUDA, or it failed to open)
                        if cref.pool != cuda_pool_id(self.layout.pool_id, cref.device):
                            return None
                        tag = cuda_tag(cref.device, cref.slot)
                        if self._cuda_unmapped.get(tag, -1) >= cref.generation:
                            return None
                        self._cuda_unmapped[tag] = cref.generation
                except Exception:
                    return None
                if (tag, cref.generation) not in done:
                    done.add((tag, cref.generation))
                    found.append((tag, cref.generation))
                return None
            if code == X.SHM_REF:
                try:
                    ref = decode_descriptor(SlotRef, data)
                    check_ref(self._buf, self.layout, ref)
                except Exception:
                    return None
                key = (ref.slot, ref.generation)
                if key not in done and self.held.get(ref.slot) != ref.generation:
                    done.add(key)
                    found.append(key)
            return None

        with contextlib.suppress(Exception):
            msgspec.msgpack.Decoder(ext_hook=hook).decode(payload)
        for slot, gen in found:
            self.queue.push(slot, gen)
        return len(found)

    # -- the release sink -------------------------------------------------------------

    def _sink(self, batch: Sequence[tuple[int, int]]) -> bool:
        try:
            flat = [x for pair in batch for x in pair]
            payload = struct.pack(f"={len(flat)}Q", *flat)
            w = self._writer
            if not w.put(payload):
                w.park_writer()  # the producer rings back when it has drained the lane
                if not w.put(payload):
                    return False
            w.unpark_writer()
            if w.ring_wanted():
                self.doorbells += 1
                try:
                    self._sock.send(b"S")
                except OSError:
                    pass  # full (the producer wakes anyway) or gone (it reclaims)
            return True
        except Exception:
            # a corrupt lane (a broken or hostile producer) or a closed one: these
            # releases cannot be delivered; the producer reclaims when we disconnect
            return True

    def flush(self) -> None:
        if self.queue._pending:
            self.queue.flush()

    def close(self, blocking: bool = True) -> int:
        """Stop releasing (the producer reclaims everything when we disconnect); return
        how many received slot arrays are still alive."""
        self.queue.close(blocking)
        if self._cuda_releaser is not None:
            self._cuda_releaser.stop()
        if blocking:
            self._writer.release()
        return len(self.held)

    def unmap(self) -> None:
        """After :meth:`close`: unmap the peer's pool -- or, while received arrays are
        alive, drop every reference to the mapping, so the last of them unmaps it."""
        seg = self.seg
        if seg is not None:
            self.seg = None  # type: ignore[assignment]
            self._buf = None
            self.cuda_opened.clear()  # live views keep their pool mapped
            seg.close()


# -- public helpers -----------------------------------------------------------------------


def _holder(x: Any) -> weakref.finalize[Any, Any] | None:
    """The finalizer of the received slot behind array / tensor ``x``, if any."""
    for _ in range(64):
        if isinstance(x, np.ndarray):
            fin = _HELD.get(x.__array_interface__["data"][0])
            if fin is not None:
                return fin
            x = x.base
            continue
        if torch_loaded():
            torch = torch_module()
            if isinstance(x, torch.Tensor):
                try:
                    addr = x.untyped_storage().data_ptr()
                except Exception:
                    return None
                return _HELD.get(addr)
        return None
    return None


def _is_array(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return True
    return torch_loaded() and isinstance(x, torch_module().Tensor)


def _walk(
    obj: Any, leaf: Callable[[Any], Any], seen: set[int], depth: int = 0
) -> Any:  # returns the (possibly) rebuilt object
    if depth > 100:
        return obj
    t = type(obj)
    if t in (int, float, str, bytes, bool, type(None)):
        return obj
    if _is_array(obj):
        return leaf(obj)
    if id(obj) in seen:
        return obj
    seen.add(id(obj))
    if isinstance(obj, list):
        new = [_walk(v, leaf, seen, depth + 1) for v in obj]
        return obj if all(a is b for a, b in zip(new, obj)) else type(obj)(new)
    if isinstance(obj, tuple):
        new = [_walk(v, leaf, seen, depth + 1) for v in obj]
        if all(a is b for a, b in zip(new, obj)):
            return obj
        return type(obj)(*new) if hasattr(obj, "_fields") else type(obj)(new)
    if isinstance(obj, dict):
        newd = {k: _walk(v, leaf, seen, depth + 1) for k, v in obj.items()}
        if all(newd[k] is v for k, v in obj.items()):
            return obj
        return newd if t is dict else t(newd)
    if isinstance(obj, msgspec.Struct):
        changes = {}
        for name in obj.__struct_fields__:
            old = getattr(obj, name)
            new_v = _walk(old, leaf, seen, depth + 1)
            if new_v is not old:
                changes[name] = new_v
        return msgspec.structs.replace(obj, **changes) if changes else obj
    return obj


def release(obj: Any) -> int:
    """Release now every received slot array / tensor in ``obj`` (an array, or a
    record / list / tuple / dict holding them); return how many slots were released.

    Idempotent.  After it, the arrays still point at the slot memory, which the
    producer may reuse at any moment: do not read them any more (see
    :func:`copy_out` to keep the data)."""
    fins: list[weakref.finalize[Any, Any]] = []

    def leaf(x: Any) -> Any:
        fin = _holder(x)
        if fin is not None:
            fins.append(fin)
        return x

    _walk(obj, leaf, set())
    n = 0
    for fin in fins:
        if fin.alive:
            fin()
            n += 1
    return n


@contextlib.contextmanager
def borrow(obj: Any) -> Iterator[Any]:
    """``with borrow(record) as rec:`` -- releases every slot in ``record`` on exit."""
    try:
        yield obj
    finally:
        release(obj)


def copy_out(obj: Any) -> Any:
    """A copy of ``obj`` in which every received slot array / tensor is replaced by a
    private (writable) copy, and those slots released.  Containers are rebuilt only
    where something changed; other values are shared."""
    fins: list[weakref.finalize[Any, Any]] = []

    def leaf(x: Any) -> Any:
        fin = _holder(x)
        if fin is None:
            return x
        fins.append(fin)
        if isinstance(x, np.ndarray):
            return np.array(x, copy=True)
        return x.clone()

    out = _walk(obj, leaf, set())
    for fin in fins:
        if fin.alive:
            fin()
    return out
