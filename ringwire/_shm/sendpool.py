"""The producer's side of a slot pool: placing arrays, loans, releases, receipts.

Sending
-------
The channel's :class:`~ringwire.Encoder` calls :meth:`ShmSendPool.place` for every numpy
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

Peer death
----------
The producer learns of the consumer's death from end-of-file on the control socket
(at once on asyncio, whose reader callback is registered while the endpoint waits;
otherwise at the next operation or wake-up) and reclaims every ``SENT`` slot
(:meth:`ShmSendPool.reclaim`).  If the producer dies, the consumer's views stay valid:
the segment's name was unlinked at handshake time, and its memory lives as long as
the consumer's mapping, which lives as long as the last view.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._errors import (
    FrameTooLarge,
    NeedSlot,
    RingCorrupted,
    RingwireError,
    SlotMisuse,
    SlotRefused,
    SlotsExhausted,
)
from .._pool.arena import BIG_HI, ArenaAllocator, ArenaFile, big_tag
from .._pool.cuda import (
    CudaNeed,
    CudaSendPool,
    cuda_backend,
    cuda_nbytes,
    cuda_pool_id,
    cuda_tag,
    split_tag,
    sweep,
)
from .._pool.protocols import Placement
from .._pool.segment import Segment
from .._pool.slotconfig import POLICIES, SlotConfig, check_policy, describe_classes
from .._wire.descriptors import KIND_NUMPY, KIND_TORCH, CudaRef, SlotRef
from .._wire.dtypes import (
    numpy_dtype_to_wire,
    torch_dtype_to_wire,
    torch_module,
)
from .._wire.lanes import RingReader
from .._wire.slotlayout import (
    LOANED,
    SENT,
    PoolLayout,
    SlotAllocator,
)

__all__ = ["ShmSendPool"]


def _address(buf: Any) -> int:
    probe = np.frombuffer(buf, np.uint8, count=1)
    try:
        return int(probe.__array_interface__["data"][0])
    finally:
        del probe


# -- the producer's side -----------------------------------------------------------------


class ShmSendPool:
    """The producer's view of its own pool: allocation, loans, releases, receipts
    (a :class:`~ringwire._pool.protocols.SendPool`).

    Not thread-safe by itself except where noted: the channel calls :meth:`place`
    under its send lock (or from its one event loop).  The pool's state changes under
    ``self.lock``, which finalizers never take (a dropped loan only appends to a
    deque).
    """

    reuses_placements = True  # a Placement holds nothing beside its list

    def __init__(
        self,
        seg: Segment,
        layout: PoolLayout,
        config: SlotConfig,
        max_inline: int,
        arena: ArenaFile | None = None,
    ) -> None:
        """``arena``: the file of this side's arena (arrays larger than every slot,
        :mod:`ringwire._pool.arena`), or ``None``."""
        self.seg = seg
        self.config = config
        self.layout = layout
        self.alloc = SlotAllocator(seg.buf, layout)
        self.reader = RingReader(seg.buf, layout.total_size)
        # has the release lane a frame?  (on the C ring one C call, no ints made)
        self.releases_ready: Callable[[], Any] = self.reader.available
        self.lock = threading.Lock()
        self._buf: Any = seg.buf
        base = _address(seg.buf)
        self._base = base
        self._lo = base + layout.data_offset
        self._hi = base + layout.total_size
        self._max_inline = max_inline
        self.loans: set[int] = set()
        self.loan_returns: collections.deque[tuple[int, int]] = collections.deque()
        self._parked = 0
        self.gone = False  # the consumer is gone: every slot was reclaimed
        self.closed = False
        self.releases_received = 0
        self.inline_fallbacks = 0
        self.reclaimed = 0
        self.cuda_pools: dict[int, CudaSendPool] = {}  # device -> GPU pool (made on first use)
        self.cuda_staged = 0
        self.big: ArenaAllocator | None = None
        if arena is not None:
            self.big = ArenaAllocator(arena, config.large_limit or 0, layout.pool_id)
        self.large_sent = 0

    # -- queries ----------------------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        alloc = self.alloc
        in_use = [i for i in range(self.layout.nslots) if alloc.status(i) != 0]
        return {
            "slots_in_use": len(in_use),
            "slots_free": alloc.free_by_size(),
            "slot_bytes_in_use": sum(self.layout.capacities[i] for i in in_use),
            "releases_received": self.releases_received,
            "loans_outstanding": len(self.loans),
            "inline_fallbacks": self.inline_fallbacks,
            **self._large_statistics(),
            **self._cuda_statistics(),
        }

    def _large_statistics(self) -> dict[str, Any]:
        big = self.big
        if big is None:
            return {}
        return {
            "large_in_use": big.in_use(),
            "large_bytes_in_use": big.outstanding,
            "large_sent": self.large_sent,
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

    def _alloc_of(self, tag: int) -> tuple[Any, int]:
        """The allocator and slot index a release-lane slot number names."""
        if tag >> 32 == BIG_HI:
            if self.big is None:
                raise SlotRefused(f"release of arena range {tag & 0xFFFFFFFF}: no arena")
            return self.big, tag & 0xFFFFFFFF
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
        return bool(self.loan_returns) or self.reader.available()

    def can_allocate(self, nbytes: int | CudaNeed) -> bool:
        if isinstance(nbytes, CudaNeed):
            pool = self.cuda_pools.get(nbytes.device)
            return pool is None or pool.alloc.can_allocate(nbytes.nbytes)
        if self.big is not None and nbytes > self.alloc.largest:
            return self.big.can_allocate(nbytes)
        return self.alloc.can_allocate(nbytes)

    def consumed(self, pairs: Sequence[tuple[int, int]]) -> bool:
        for tag, g in pairs:
            alloc, slot = self._alloc_of(tag)
            if alloc.generation(slot) == g:
                return False
        return True

    # -- placing (what the Encoder calls for one record) --------------------------------

    def placement(self, policy: str | None) -> Placement:
        """The placer of one record: pass it to ``Encoder.encode_with(item, placement)``;
        its ``placed`` lists the slots the record took (give them back with
        :meth:`abort` if the record is not published)."""
        placement = Placement()
        placement.pool = self
        if policy is None:
            placement.policy = self.config.policy
        elif policy in POLICIES:
            placement.policy = policy
        else:
            placement.policy = check_policy(policy) or self.config.policy
        return placement

    def abort(self, placed: Sequence[tuple[int, int, bool]]) -> None:
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
                    self.loans.add(tag)
                else:
                    alloc.release(slot, gen)

    def place(self, obj: Any, placement: Placement) -> SlotRef | CudaRef | None:
        """A :class:`SlotRef` (or :class:`CudaRef`) for ``obj``, recorded in
        ``placement``, or ``None``: send it inline."""
        if isinstance(obj, np.ndarray):
            nbytes = obj.nbytes
            if obj.base is not None:
                addr = obj.__array_interface__["data"][0]
                if self._lo <= addr < self._hi:
                    ref = self._place_loaned(obj, addr, nbytes, obj.flags.c_contiguous, placement)
                    if ref is not None:
                        return ref
                elif self.big is not None and addr in self.big.loaned_at:
                    ref = self._place_big_loan(obj, addr, nbytes, obj.flags.c_contiguous, placement)
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
                return self._place_cuda(obj, backend, placement)
            if obj.device.type != "cpu" or obj.layout != torch.strided:
                return None  # other devices inline; sparse tensors get the inline error
            nbytes = obj.numel() * obj.element_size()
            addr = obj.data_ptr()
            if self._lo <= addr < self._hi:
                ref = self._place_loaned(obj, addr, nbytes, obj.is_contiguous(), placement)
                if ref is not None:
                    return ref
            elif self.big is not None and addr in self.big.loaned_at:
                ref = self._place_big_loan(obj, addr, nbytes, obj.is_contiguous(), placement)
                if ref is not None:
                    return ref
            if nbytes < self.config.threshold:
                return None
            wire = torch_dtype_to_wire(obj.dtype)
            kind = KIND_TORCH
        if nbytes > self.alloc.largest:
            if self.big is not None:
                return self._place_big(obj, nbytes, wire, kind, placement)
            if nbytes > self._max_inline:
                raise FrameTooLarge(
                    f"a {nbytes}-byte array fits neither a slot of this channel's pool "
                    f"({self.config.describe()}) nor the ring (at most {self._max_inline} "
                    "bytes per record): configure a larger slot class, or a "
                    "SlotConfig.large_limit (slots=SlotConfig(...))"
                )
            self.inline_fallbacks += 1
            return None
        record = placement
        with self.lock:
            slot = self.alloc.allocate(nbytes)
            if slot is None:
                others = self.alloc.in_use() - sum(1 for t, _, _ in record if t >> 32 == 0)
        if slot is None:
            self._exhausted(others, nbytes, "", self.config.describe(), placement.policy)
            return None  # policy "inline"
        try:
            self._copy_in(obj, self._slot_array(slot, nbytes), nbytes)
        except BaseException:
            with self.lock:
                self.alloc.cancel(slot)
            raise
        with self.lock:
            self.alloc.mark_sent(slot)
            gen = self.alloc.generation(slot)
        record.append((slot, gen, False))
        return self.alloc.ref(slot, nbytes, obj.shape, wire, kind)

    def _place_big(
        self, obj: Any, nbytes: int, wire: Any, kind: Any, placement: Placement
    ) -> SlotRef | None:
        """An array larger than every slot: a range of the arena (see
        :mod:`ringwire._pool.arena`)."""
        big = self.big
        assert big is not None
        record = placement
        with self.lock:
            index = big.allocate(nbytes)  # may raise SharedMemoryFull
            if index is None:
                others = big.in_use() - sum(1 for t, _, _ in record if t >> 32 == BIG_HI)
        if index is None:
            what = f"large-array memory ({big.limit} bytes outstanding at most: large_limit)"
            if placement.policy == "inline" and nbytes > self._max_inline:
                raise SlotsExhausted(f"no {what} for {nbytes} bytes, which the ring cannot carry")
            self._exhausted(others, nbytes, "", what, placement.policy)
            return None  # policy "inline"
        tag = big_tag(index)
        try:
            view = big.view(index, nbytes)
            dst = np.frombuffer(view, np.uint8)
            try:
                self._copy_in(obj, dst, nbytes)
            finally:
                del dst
                view.release()
            with self.lock:
                big.mark_sent(index)
                ref = big.ref(index, nbytes, obj.shape, wire, kind)
        except BaseException:
            with self.lock:
                big.cancel(index)
            raise
        self.large_sent += 1
        record.append((tag, ref.generation, False))
        return ref

    def _place_big_loan(
        self, obj: Any, addr: int, nbytes: int, contiguous: bool, placement: Placement
    ) -> SlotRef | None:
        """``obj`` starts at a loan from the arena: send that range, no copy."""
        big = self.big
        assert big is not None
        with self.lock:
            index = big.loaned_at.get(addr)
            tag = -1 if index is None else big_tag(index)
            if index is None or tag not in self.loans or big.status(index) != LOANED:
                raise SlotMisuse(
                    "this array lives in memory of the channel's arena that is no longer "
                    "loaned: a loaned buffer can be sent once, and must not be used after "
                    "it was sent (loan a new one)"
                )
            if not contiguous or nbytes > big.length_of(index):
                return None  # an ordinary (strided) array that happens to live in a loan
            if isinstance(obj, np.ndarray):
                wire, kind = numpy_dtype_to_wire(obj.dtype), KIND_NUMPY
            else:
                wire, kind = torch_dtype_to_wire(obj.dtype), KIND_TORCH
            big.mark_sent(index)
            self.loans.discard(tag)
            ref = big.ref(index, nbytes, obj.shape, wire, kind)
        self.large_sent += 1
        placement.append((tag, ref.generation, True))
        return ref

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

    def _place_cuda(self, obj: Any, backend: Any, placement: Placement) -> SlotRef | CudaRef | None:
        config = self.config
        nbytes = cuda_nbytes(obj)
        if config.cuda == "stage":
            if nbytes < config.cuda_threshold:
                return None  # inline through the host, restored on the device
            self.cuda_staged += 1
            return self.place(obj.detach().cpu(), placement)
        device = backend.device_index(obj)
        pool = self.cuda_pools.get(device)
        addr = obj.data_ptr()
        record = placement
        if pool is not None and pool.lo <= addr < pool.hi:
            with self.lock:
                slot = pool.alloc.slot_at(addr - pool.lo, nbytes)
                tag = cuda_tag(device, slot) if slot is not None else -1
                if tag not in self.loans or pool.alloc.status(slot) != LOANED:  # type: ignore[arg-type]
                    raise SlotMisuse(
                        "this tensor lives in a slot of the channel's GPU pool that is no "
                        "longer loaned: a loaned buffer can be sent once, and must not be "
                        "used after it was sent (loan a new one)"
                    )
                if obj.is_contiguous():
                    assert slot is not None
                    pool.alloc.mark_sent(slot)
                    self.loans.discard(tag)
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
                    f"pool ({describe_classes(config.cuda_classes)}) nor the ring (at most "
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
                others,
                CudaNeed(device, nbytes),
                "CUDA ",
                describe_classes(config.cuda_classes),
                placement.policy,
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
            raise RingwireError(
                "CUDA loans need CUDA in this process (torch.cuda is not available)"
            )
        with self.lock:
            pool = self._cuda_pool(device, backend)
            if nbytes > pool.alloc.largest:
                raise ValueError(
                    f"a loan of {nbytes} bytes does not fit the GPU pool's largest slot "
                    f"({describe_classes(self.config.cuda_classes)})"
                )
            slot = pool.alloc.allocate(nbytes)
            if slot is None:
                return None
            tag = cuda_tag(device, slot)
            self.loans.add(tag)
            gen = pool.alloc.generation(slot)
        tensor, keep = pool.loan_view(slot, nbytes, dtype, shape)
        fin = weakref.finalize(keep, self.loan_returns.append, (tag, gen))
        fin.atexit = False
        return tensor

    def _exhausted(
        self, others: int, need: int | CudaNeed, what: str, pool: str, policy: str
    ) -> None:
        """No slot is free for ``need``: apply ``policy`` -- return (``"inline"``: the
        caller sends it inline) or raise -- given ``others`` slots held by earlier
        records (none: waiting cannot help)."""
        if policy == "inline":
            self.inline_fallbacks += 1
            return
        if others <= 0:
            raise SlotsExhausted(f"this record needs more {what}slots than the pool has ({pool})")
        if policy == "error":
            text = f"{need} bytes" if isinstance(need, int) else str(need)
            raise SlotsExhausted(f"no free {what}slot for {text} ({pool}; policy 'error')")
        raise NeedSlot(need)

    def _slot_array(self, slot: int, nbytes: int) -> Any:
        return np.frombuffer(self._buf, np.uint8, count=nbytes, offset=self.layout.offsets[slot])

    @staticmethod
    def _copy_in(obj: Any, dst: Any, nbytes: int) -> None:
        """Copy array or tensor ``obj`` into ``dst`` (a uint8 array of ``nbytes``)."""
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

    def _place_loaned(
        self, obj: Any, addr: int, nbytes: int, contiguous: bool, placement: Placement
    ) -> SlotRef | None:
        off = addr - self._base
        with self.lock:
            slot = self.alloc.slot_at(off, nbytes)
            if slot is None or slot not in self.loans or self.alloc.status(slot) != LOANED:
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
            self.loans.discard(slot)
            gen = self.alloc.generation(slot)
        placement.append((slot, gen, True))
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
            if self.big is None:
                raise ValueError(
                    f"a loan of {nbytes} bytes does not fit the pool's largest slot "
                    f"({self.config.describe()}) and this pool has no arena (large_limit=None)"
                )
            return self._loan_big(kind, np_dtype, t_dtype, shape, nbytes)
        with self.lock:
            slot = self.alloc.allocate(nbytes)
            if slot is None:
                return None
            self.loans.add(slot)
            gen = self.alloc.generation(slot)
        base = np.frombuffer(self._buf, np.uint8, count=nbytes, offset=self.layout.offsets[slot])
        fin = weakref.finalize(base, self.loan_returns.append, (slot, gen))
        fin.atexit = False
        if kind == KIND_NUMPY:
            return base.view(np_dtype).reshape(shape)
        return torch_module().from_numpy(base).view(t_dtype).reshape(shape)

    def _loan_big(
        self, kind: str, np_dtype: Any, t_dtype: Any, shape: tuple[int, ...], nbytes: int
    ) -> Any:
        """A loan larger than every slot: a range of the arena (``None`` while the
        limit is used up)."""
        big = self.big
        assert big is not None
        with self.lock:
            index = big.allocate(nbytes)  # may raise SharedMemoryFull
            if index is None:
                return None
            tag = big_tag(index)
            self.loans.add(tag)
            gen = big.generation(index)
            base = np.frombuffer(big.view(index, nbytes), np.uint8)
            big.lend(index, base.__array_interface__["data"][0])
        fin = weakref.finalize(base, self.loan_returns.append, (tag, gen))
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
        if self.big is not None and need > self.alloc.largest:
            return self.big.in_use() == 0
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
                vals = reader.next_pairs()
                if vals is None:
                    break
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
        returns = self.loan_returns
        while returns:
            tag, gen = returns.popleft()
            alloc, slot = self._alloc_of(tag)
            if tag in self.loans and alloc.generation(slot) == gen:
                self.loans.discard(tag)
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
            if self.big is not None:
                n += self.big.reclaim_sent(publish)
            self.reclaimed += n
        if self.cuda_pools and not self.closed:
            sweep()  # a consumer that went may free blocks of earlier connections
        return n

    # eventcount on the release lane (counted: several waiters may park at once)
    def park(self) -> None:
        self._parked += 1
        self.reader.park()

    def unpark(self) -> None:
        self._parked -= 1
        if not self._parked and not self.closed:
            self.reader.unpark()

    def close(self, consumer_gone: bool | None = None) -> None:
        """Our side closed: the pool is reclaimed (receipts complete), the lane views
        dropped, the segment closed -- or, while loans are alive, left to them: we drop
        every reference to the mapping, so the last loan to die unmaps it.  The shared
        slot table is left as it is: records we published before closing stay readable
        (their references resolve) until the consumer has read them.

        GPU pools are retired (:func:`ringwire._pool.cudablocks.retire`): their memory
        and events stay until the consumer can no longer read them -- it is gone (end of
        file, or the closed flag it sets on the release lane) and maps nothing -- so
        CUDA records published before closing resolve too; then each block goes to the
        next connection of this process.  ``consumer_gone``: the caller knows whether
        the consumers can still open anything (a broadcast, whose readers write lanes
        of their own, says so); by default, end of file or the lane's closed flag."""
        if self.closed:
            return
        if consumer_gone is not None and not isinstance(consumer_gone, bool):
            raise TypeError(f"consumer_gone must be a bool or None, not {consumer_gone!r}")
        with self.lock:
            gone = self.gone
            if self.cuda_pools and not (self.gone or self.closed):
                with contextlib.suppress(RingwireError):
                    self._poll_locked()  # the releases already on the lane count
                with contextlib.suppress(ValueError):
                    gone = self.reader.writer_closed
            if consumer_gone is None:
                consumer_gone = gone
        self.reclaim(publish=False)
        with self.lock:
            self.closed = True
            self.reader.release()
            seg = self.seg
            for pool in self.cuda_pools.values():
                # a reader of the release lane of its own, for the consumer's closed flag
                # (it keeps the segment mapped until the export is settled)
                lane = None
                if not consumer_gone:
                    with contextlib.suppress(RingCorrupted, ValueError, TypeError):
                        lane = RingReader(seg.buf, self.layout.total_size)
                pool.close(consumer_gone or lane is None, lane)
            self._buf = None
            self.alloc.detach()
            if self.big is not None:
                self.big.close()
        if self.cuda_pools:
            sweep()
        seg.unlink()
        seg.close()
        self.seg = None  # type: ignore[assignment]
