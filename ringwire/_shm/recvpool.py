"""The consumer's side of a slot pool: resolving references, finalizers, releases.

Receiving
---------
The channel's :class:`~ringwire.Decoder` calls :meth:`ShmRecvPool.resolve` for every
Ext 4.  The reference is checked against the peer's pool as it was read at attach
time (:func:`~ringwire._wire.slotlayout.check_ref`: this connection's pool id, slot in
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
to a :class:`~ringwire._wire.release.ReleaseQueue` whose sink writes the release lane and
rings the producer's doorbell if the producer is parked on that lane.

torch has no read-only tensors: a received tensor is writable, and a write changes
only the slot the consumer was lent (the producer never reads it back).  numpy arrays
are read-only; connect with ``copy_out=True`` (the receiving side's keyword, which
sets :attr:`RecvPool.copy_out` before the first record) or call :func:`copy_out` for
private, writable copies.

Finalizer safety (the argument)
-------------------------------
A finalizer can run in any thread, and inside garbage collection at (almost) any
bytecode of any code -- including ringwire's own, in the middle of a send, a receive,
a flush, or a ring write, and including while that code holds locks.  So:

1. **It never blocks and takes no lock the interrupted code may hold.**  The callback
   (:meth:`ShmRecvPool._finalized`) does two ``dict.pop`` calls and
   :meth:`ReleaseQueue.push`: a ``deque.append`` (atomic under the GIL) and a flush
   that only *tries* the queue's own lock.  The sink it may call writes the release
   lane, which nothing but the sink writes (and the sink runs only under that lock),
   fences with a lock private to the sink (never the module-wide ring fence, which
   ordinary code holds for a few instructions and a collection could interrupt), and
   sends the doorbell byte with a non-blocking ``send`` on the control socket.  The
   channel's own locks (send, receive, the pool lock) are never touched.
2. **It never loses a release.**  If the flush lock is taken -- by another thread, or
   by the very flush this finalizer interrupted -- the holder re-checks the deque after
   releasing the lock (:mod:`ringwire._wire.release`).  If the release lane is full the
   batch stays queued, the sink sets the lane's writer-parked flag, and the producer
   rings back when it has drained the lane; the batch goes out at the next *safe
   point*: every send, receive and loan on the channel, and every doorbell wake-up.
   If a record fails to decode, the references in it that were never resolved are
   released at once (:meth:`ShmRecvPool.salvage`), so a bad record leaks nothing either.
3. **It never touches memory that is unmapped.**  Close first closes the queue (which
   waits for a flush in progress; ``__del__`` uses the non-blocking form), then drops
   the lane's memoryviews, then closes the segment -- which does *not* unmap while
   base arrays (numpy buffer exports) are alive: the mapping goes with the last of
   them.  Everything the sink touches goes through memoryviews, so a sink that
   somehow ran after they were released would get a ``ValueError`` (caught), never
   a fault.  Finalizers are registered with ``atexit = False``: at interpreter exit
   they do not run at all (the producer reclaims every slot when our control socket
   closes), so exit never races an unmap and never raises ``BufferError``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from .._errors import (
    DecodeError,
)
from .._pool.arena import ArenaMapper, big_tag
from .._pool.cuda import (
    OpenedCudaPool,
    ReleaseThread,
    cuda_backend,
    cuda_pool_id,
    cuda_tag,
    local_device_of,
    sweep,
)
from .._pool.protocols import RecvPoolBase
from .._pool.segment import Segment
from .._pool.views import HELD
from .._wire import ext as X
from .._wire.descriptors import KIND_NUMPY, CudaRef, SlotRef, decode_descriptor
from .._wire.dtypes import (
    numpy_dtype_from_wire,
    torch_dtype_from_wire,
    torch_module,
)
from .._wire.lanes import ReleaseLaneWriter
from .._wire.release import ReleaseQueue
from .._wire.ring import WCLOSED
from .._wire.slotlayout import (
    PoolLayout,
    check_ref,
)

__all__ = [
    "ShmRecvPool",
]

# -- the consumer's side -----------------------------------------------------------------


class ShmRecvPool(RecvPoolBase):
    """The consumer's view of the peer's pool: resolver, finalizers, release sink (a
    :class:`~ringwire._pool.protocols.RecvPool`)."""

    def __init__(
        self,
        seg: Segment,
        layout: PoolLayout,
        bell: Callable[[], object],
        copy_out: bool,
        lane_offset: int | None = None,
        arena: ArenaMapper | None = None,
    ) -> None:
        """``bell`` wakes the producer (one non-blocking doorbell; it may raise
        ``OSError``, which is ignored: a full socket wakes the producer anyway, a gone
        one reclaims everything).  ``lane_offset``: where this consumer's release lane
        lies in the segment (default: right after the pool; a broadcast gives each
        reader its own lane further on).  ``arena``: the producer's arena (arrays
        larger than every slot, :mod:`ringwire._pool.arena`), or ``None``."""
        self.seg = seg
        self.layout = layout
        self._buf: Any = seg.buf
        self._bell = bell
        self.copy_out = copy_out
        lane = layout.total_size if lane_offset is None else lane_offset
        self._writer = ReleaseLaneWriter(seg.buf, lane)
        self.queue = ReleaseQueue(self._sink, max_batch=self._writer.max_payload // 16)
        self.held: dict[int, int] = {}  # slot (or CUDA tag) -> generation of every live base
        # slot -> the newest generation a decode resolved (a record that fails to decode
        # releases, in salvage(), only the references that were not resolved)
        self.resolved_generation: dict[int, int] = {}
        self.doorbells = 0
        self.received = 0
        # CUDA (Ext 5): the producer's GPU pools as mapped here, and the release thread
        self.cuda_opened: dict[tuple[int, int], OpenedCudaPool] = {}
        self.cuda_opens = 0
        self.cuda_received = 0
        self._cuda_releaser: ReleaseThread | None = None
        self._cuda_unmapped: dict[int, int] = {}  # tag -> last generation given back unread
        self.arena = arena
        self._arena_id = -1 if arena is None else arena.pool_id
        self.large_received = 0

    # -- resolving (the Decoder's resolver) --------------------------------------------

    def resolve(self, ref: SlotRef | CudaRef) -> Any:
        if not isinstance(ref, SlotRef):
            if isinstance(ref, CudaRef):
                return self._resolve_cuda(ref)
            raise DecodeError(
                f"a {type(ref).__name__} (a reference of another transport) arrived on a "
                "shared-memory connection"
            )
        if ref.pool == self._arena_id:
            return self._resolve_large(ref)
        check_ref(self._buf, self.layout, ref)
        slot, gen = ref.slot, ref.generation
        if self.held.get(slot) == gen:
            raise DecodeError(f"slot {slot} generation {gen} is referenced twice")
        self.resolved_generation[slot] = gen
        dtype: Any
        try:
            if ref.kind == KIND_NUMPY:
                dtype = numpy_dtype_from_wire(ref.dtype)
                align = dtype.alignment
            else:
                dtype = torch_dtype_from_wire(ref.dtype)
                align = min(int(dtype.itemsize), 16)
            if ref.offset % align:
                raise DecodeError(
                    f"slot reference offset {ref.offset} is misaligned for {ref.dtype}"
                )
            base = np.frombuffer(self._buf, np.uint8, count=ref.nbytes, offset=ref.offset)
        except BaseException:
            self.queue.push(slot, gen)  # valid, but we cannot use it: give it back now
            raise
        return self._hand_out(base, slot, gen, ref, dtype)

    def _resolve_large(self, ref: SlotRef) -> Any:
        """A reference to a range of the producer's arena: checked, mapped on its own
        (see :mod:`ringwire._pool.arena`)."""
        arena = self.arena
        assert arena is not None
        tag, gen = big_tag(ref.slot), ref.generation
        if ref.slot >= 1 << 32:
            raise DecodeError(f"arena reference names range {ref.slot}")
        if self.held.get(tag) == gen:
            raise DecodeError(f"arena range {ref.slot} generation {gen} is referenced twice")
        try:
            mapping = arena.map(ref.offset, ref.nbytes)
        except (ValueError, OSError) as exc:
            raise DecodeError(f"bad arena reference: {exc}") from None
        self.resolved_generation[tag] = gen
        dtype: Any
        try:
            if ref.kind == KIND_NUMPY:
                dtype = numpy_dtype_from_wire(ref.dtype)
            else:
                dtype = torch_dtype_from_wire(ref.dtype)
            base = np.frombuffer(mapping, np.uint8, count=ref.nbytes)
        except BaseException:
            self.queue.push(tag, gen)  # valid, but we cannot use it: give it back now
            raise
        del mapping  # the base array keeps it (it unmaps when the last view dies)
        self.large_received += 1
        return self._hand_out(base, tag, gen, ref, dtype)

    def _hand_out(self, base: Any, slot: int, gen: int, ref: SlotRef, dtype: Any) -> Any:
        """The view of ``base`` that ``ref`` describes, with the finalizer that releases
        ``(slot, gen)`` when the last view dies (or a private copy, released now)."""
        self.received += 1
        if self.copy_out:
            base = base.copy()
            self.queue.push(slot, gen)
        else:
            addr = base.__array_interface__["data"][0]
            self.held[slot] = gen
            fin = weakref.finalize(base, self._finalized, slot, gen, addr)
            fin.atexit = False
            HELD[addr] = fin
        if ref.kind == KIND_NUMPY:
            out = base.view(dtype).reshape(ref.shape)
            if not self.copy_out:
                out.flags.writeable = False
            return out
        return torch_module().from_numpy(base).view(dtype).reshape(ref.shape)

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
        local_device = local_device_of(backend, ref)  # by UUID: our numbers may differ
        if not ref.pool_handle:
            raise DecodeError("CUDA reference to a pool that was never announced")
        if any(o.announcement == ref.pool_handle for o in self.cuda_opened.values()):
            raise DecodeError(
                f"CUDA reference to pool {ref.pool:#x} carries the announcement of another "
                "pool of this connection"
            )
        try:
            opened = OpenedCudaPool(backend, ref, local_device)
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
        device = opened.local_device
        try:
            stream = backend.current_stream(device)
            if ref.event:
                backend.wait_event(opened.event(ref.event), stream)
            mapping = opened.mapping  # every view keeps the mapping (and its lease)
            tensor, keep = backend.view(
                mapping.memory,
                ref.offset,
                ref.nbytes,
                torch_dtype_from_wire(ref.dtype),
                ref.shape,
                mapping,
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
        if self.copy_out:
            out = tensor.clone()
            del tensor, keep
            releaser.put(tag, ref.generation, backend.release_event(stream), device)
            return out
        addr = int(tensor.untyped_storage().data_ptr())
        self.held[tag] = ref.generation
        fin = weakref.finalize(
            keep, self._cuda_finalized, tag, ref.generation, addr, stream, device
        )
        fin.atexit = False
        HELD[addr] = fin
        return tensor

    def _cuda_finalized(self, tag: int, gen: int, addr: int, stream: Any, device: int) -> None:
        # runs in any thread, inside GC: dict pops, one event record, a SimpleQueue put
        HELD.pop(addr, None)
        if self.held.get(tag) == gen:
            self.held.pop(tag, None)
        releaser = self._cuda_releaser
        if releaser is None or self.queue.closed:
            return
        try:
            event = releaser.backend.release_event(stream)
        except Exception:
            return  # the CUDA context is gone (exit): the producer reclaims on EOF
        releaser.put(tag, gen, event, device)

    def _finalized(self, slot: int, gen: int, addr: int) -> None:
        # runs in any thread, inside GC: dict pops and a non-blocking push only
        HELD.pop(addr, None)
        if self.held.get(slot) == gen:
            self.held.pop(slot, None)
        self.queue.push(slot, gen)

    def salvage(self, payload: Any) -> int:
        """A record failed to decode: release the valid references in it that the
        decode did not resolve (those that were resolved release themselves: their
        views died with the failed decode).  A CUDA reference that was resolved is
        recognised by its pool's last generation, an SHM one by
        :attr:`resolved_generation`."""
        done: set[tuple[int, int]] = set()
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
                    if ref.pool == self._arena_id:
                        assert self.arena is not None
                        self.arena.map(ref.offset, ref.nbytes).close()  # a range it lent?
                        key = (big_tag(ref.slot), ref.generation)
                    else:
                        check_ref(self._buf, self.layout, ref)
                        key = (ref.slot, ref.generation)
                except Exception:
                    return None
                if (
                    key not in done
                    and self.held.get(key[0]) != key[1]
                    and self.resolved_generation.get(key[0]) != key[1]
                ):
                    done.add(key)
                    found.append(key)
            elif code == X.TRACED:  # a traced record: the references are in its body
                with contextlib.suppress(Exception):
                    reader.decode(data)
            return None

        reader = msgspec.msgpack.Decoder(ext_hook=hook)
        with contextlib.suppress(Exception):
            reader.decode(payload)
        for slot, gen in found:
            self.queue.push(slot, gen)
        return len(found)

    # -- the release sink -------------------------------------------------------------

    def _sink(self, batch: Sequence[tuple[int, int]]) -> bool:
        try:
            w = self._writer
            if not w.put_pairs(batch):
                w.park_writer()  # the producer rings back when it has drained the lane
                if not w.put_pairs(batch):
                    return False
            w.unpark_writer()
            if w.ring_wanted():
                self.doorbells += 1
                try:
                    self._bell()
                except OSError:
                    pass  # full (the producer wakes anyway) or gone (it reclaims)
            return True
        except Exception:
            # a corrupt lane (a broken or hostile producer) or a closed one: these
            # releases cannot be delivered; the producer reclaims when we disconnect
            return True

    def close(self, blocking: bool = True) -> int:
        """Stop releasing (the producer reclaims everything when we disconnect); return
        how many received slot arrays are still alive.

        The release lane's writer-closed flag is set: a producer that closed first (it
        no longer reads our socket) learns from it that we open nothing any more, so it
        may hand its GPU blocks to other connections once our mappings are gone
        (:mod:`ringwire._pool.cudablocks`).  A single store, no lock: safe in ``__del__``."""
        self.queue.close(blocking)
        if self._cuda_releaser is not None:
            self._cuda_releaser.stop()
        with contextlib.suppress(ValueError, IndexError, TypeError):  # views released
            self._writer.header[WCLOSED] = 1
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
            if self.arena is not None:
                self.arena.close()  # live views keep their own mappings
            # a producer of this process that closed first may settle its GPU blocks now
            # (non-blocking: this may run in garbage collection, see ``abandon``)
            sweep(blocking=False)
