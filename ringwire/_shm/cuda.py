"""CUDA tensors by reference (Ext 5): a GPU slot pool per (producer, device).

A CUDA tensor at or above ``SlotConfig.cuda_threshold`` bytes travels as a
:class:`~ringwire.CudaRef` naming a byte range in the producer's *GPU pool* for that
device: one ``cudaMalloc``'d block, allocated the first time a tensor of that device is
sent on the connection and exported (``cudaIpcGetMemHandle``) exactly once.  The
consumer opens the handle the first time it sees the pool and keeps the mapping for
the life of the connection -- opening a handle is slow, and a handle can be opened only
once per process.

What is shared with SHM slots
-----------------------------
The bookkeeping is the same :class:`~ringwire._wire.slotlayout.SlotAllocator` (slot classes,
generations, FREE -> LOANED -> SENT -> FREE), kept in a private table on the producer
side (the GPU block holds only data).  Releases travel on the SHM pool's release lane
as ordinary ``(slot, generation)`` pairs whose slot number carries the device in its
high half (:func:`cuda_tag`), so acknowledgements, receipts, reclaim on peer death,
refusal of double or forged releases and the doorbell are the SHM code, unchanged.
A CUDA pool therefore needs the connection's SHM slot pool (``slots=`` not ``None``).

Validation on the consumer
--------------------------
The consumer cannot read the producer's table, so it checks what it can know:

* the pool id must be the one this connection's producer has for that device (it is
  derived from the SHM pool id both sides already share: :func:`cuda_pool_id`), so a
  reference to any other pool -- another producer's, another connection's -- is
  refused before anything is opened;
* the slot index, and ``[offset, offset + nbytes)`` within that slot, against the slot
  classes the producer announced with the pool;
* the generation must be newer than any it has seen for that slot (a producer reuses a
  slot only after our release, with a higher generation), so a stale or replayed
  reference is refused, and a slot can be held only once.

Stream ordering
---------------
Producer: the copy into the slot (or the user's writes into a loan) is enqueued on the
producer's current stream; then the slot's *interprocess event* is recorded on that
stream and its handle travels in the reference.  Consumer: before the tensor is handed
out, the consumer's current stream waits on that event (``cudaStreamWaitEvent``: no
host blocking), so every kernel the consumer enqueues after ``receive`` sees the final
bytes.  One event per slot is enough: a slot is reused only after the consumer's
release, and the release happens after the consumer's stream has passed the wait.

Release: when the last view of a received tensor dies, the finalizer records an event
on the stream that was current when the tensor was received and queues it; a release
thread waits for that event (a *blocking-sync* event: the thread sleeps in the driver,
it does not spin or poll) and only then pushes the release.  So a slot is acknowledged
only after every kernel the consumer enqueued on it before dropping it has finished.
Work the consumer enqueues on *other* streams must be ordered by the consumer (as with
``Tensor.record_stream``), or the tensor released explicitly after a synchronize.

Without CUDA
------------
Nothing here imports torch or touches CUDA at import time.  A process without CUDA
never has CUDA tensors to send; if one receives an Ext 5 it is refused with a
:class:`~ringwire.DecodeError` that says so.  A producer whose consumer has no GPU sets
``SlotConfig(cuda="stage")``: CUDA tensors are then copied to the host and travel
through SHM slots like any CPU tensor.

The backend
-----------
Every CUDA call goes through a small backend object (:class:`TorchCudaBackend`), so the
protocol above is exercised on machines without a GPU by a simulated backend in the
test suite (device memory in a shared-memory segment, events that complete on demand).
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from .._errors import DecodeError
from .._wire.descriptors import CudaRef
from .._wire.dtypes import torch_dtype_from_wire, torch_dtype_to_wire, torch_loaded, torch_module
from .._wire.slotlayout import (
    LOANED,
    SENT,
    PoolLayout,
    SlotAllocator,
    SlotClass,
    init_pool,
    plan_pool,
)

__all__ = [
    "CudaNeed",
    "CudaSendPool",
    "OpenedCudaPool",
    "ReleaseThread",
    "TorchCudaBackend",
    "cuda_backend",
    "cuda_pool_id",
    "cuda_tag",
    "drop_idle_pools",
    "set_cuda_backend",
    "split_tag",
]

_MASK64 = (1 << 64) - 1
_TAG_SHIFT = 32
_POOL_ALIGN = 2 << 20  # the caching allocator's large-block granularity: the pool owns its block


def cuda_tag(device: int, slot: int) -> int:
    """The slot number a CUDA slot has on the release lane (SHM slots are < 2**32)."""
    return (device + 1) << _TAG_SHIFT | slot


def split_tag(tag: int) -> tuple[int, int] | None:
    """``(device, slot)`` of a CUDA tag, ``None`` for an SHM slot number."""
    hi = tag >> _TAG_SHIFT
    if not hi:
        return None
    return hi - 1, tag & ((1 << _TAG_SHIFT) - 1)


def cuda_pool_id(shm_pool_id: int, device: int) -> int:
    """The id of a producer's GPU pool for ``device``, derived from its SHM pool's id
    (which both ends of the connection already know)."""
    return (shm_pool_id ^ ((device + 1) * 0x9E3779B97F4A7C15)) & _MASK64


class CudaNeed(NamedTuple):
    """What a sender waiting for a CUDA slot waits for."""

    device: int
    nbytes: int

    def __str__(self) -> str:
        return f"{self.nbytes} bytes on cuda:{self.device}"


# -- the backend --------------------------------------------------------------------------


class TorchCudaBackend:
    """CUDA through torch: pools, IPC handles, interprocess events, streams."""

    name = "cuda"

    def __init__(self) -> None:
        self.torch = torch_module()

    # tensors
    def is_device_tensor(self, t: Any) -> bool:
        return bool(t.is_cuda)

    def device_index(self, t: Any) -> int:
        index = t.device.index
        return self.current_device() if index is None else int(index)

    def device_count(self) -> int:
        return int(self.torch.cuda.device_count())

    def current_device(self) -> int:
        return int(self.torch.cuda.current_device())

    # pools
    def empty(self, shape: Any, dtype: Any, device: int) -> Any:
        return self.torch.empty(shape, dtype=dtype, device=f"cuda:{device}")

    def alloc_pool(self, device: int, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device=f"cuda:{device}")

    def address(self, memory: Any) -> int:
        return int(memory.data_ptr())

    def export_pool(self, memory: Any) -> list[Any]:
        # (device, handle, size, offset, ref counter handle, ref counter offset,
        #  event handle, event sync required): plain bytes, ints and a bool
        return list(memory.untyped_storage()._share_cuda_())

    def open_pool(self, device: int, exported: list[Any], nbytes: int) -> Any:
        torch = self.torch
        if len(exported) != 8 or not isinstance(exported[1], bytes):
            raise DecodeError("malformed CUDA pool handle")
        # torch's own IPC entry points (what torch.multiprocessing's reductions call)
        torch.cuda._lazy_init()  # noqa: SLF001
        args = list(exported)
        args[0] = device
        storage = torch.UntypedStorage._new_shared_cuda(*args)  # noqa: SLF001
        if storage.nbytes() < nbytes:
            raise DecodeError(
                f"CUDA pool handle maps {storage.nbytes()} bytes, the pool needs {nbytes}"
            )
        memory = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
        memory.set_(storage, 0, (storage.nbytes(),), (1,))
        return memory

    def copy_into(self, memory: Any, offset: int, t: Any) -> None:
        nbytes = t.numel() * t.element_size()
        dst = memory.narrow(0, offset, nbytes).view(t.dtype).view(t.shape)
        dst.copy_(t.detach())

    def view(
        self, memory: Any, offset: int, nbytes: int, dtype: Any, shape: Any
    ) -> tuple[Any, Any]:
        """A tensor over ``memory[offset:offset + nbytes]`` and the object whose death
        means every view of it is gone (torch holds it in the storage's deleter)."""
        span = _CudaSpan(self.address(memory) + offset, nbytes, memory)
        with self.torch.cuda.device(memory.device):  # older torch labels it the current one
            flat = self.torch.as_tensor(span, device=memory.device)  # holds span until freed
        return flat.view(dtype).view(shape), span

    # streams and events
    def current_stream(self, device: int) -> Any:
        return self.torch.cuda.current_stream(device)

    def new_event(self, device: int) -> tuple[Any, bytes]:
        torch = self.torch
        with torch.cuda.device(device):
            event = torch.cuda.Event(interprocess=True)
            event.record(torch.cuda.current_stream(device))
            return event, bytes(event.ipc_handle())

    def record(self, event: Any, device: int) -> None:
        event.record(self.torch.cuda.current_stream(device))

    def open_event(self, device: int, handle: bytes) -> Any:
        return self.torch.cuda.Event.from_ipc_handle(device, handle)

    def wait_event(self, event: Any, stream: Any) -> None:
        stream.wait_event(event)

    def release_event(self, stream: Any) -> Any:
        event = self.torch.cuda.Event(blocking=True)  # synchronize() sleeps in the driver
        event.record(stream)
        return event

    def synchronize(self, event: Any) -> None:
        event.synchronize()


class _CudaSpan:
    """``__cuda_array_interface__`` of a byte range in a pool; keeps the pool mapped."""

    __slots__ = ("__weakref__", "_iface", "memory")

    def __init__(self, ptr: int, nbytes: int, memory: Any) -> None:
        self.memory = memory
        self._iface = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self._iface


_backend: Any = None
_backend_probed = False
_backend_lock = threading.Lock()


def cuda_backend(import_torch: bool = False) -> Any:
    """The CUDA backend of this process, or ``None`` (CPU-only torch, or no device).

    A sender never imports torch for this (a process that has not imported torch has
    no CUDA tensors to send: ``None``); a receiver of an Ext 5 passes
    ``import_torch=True``, as it needs torch to hand out a tensor anyway."""
    global _backend, _backend_probed
    if _backend_probed:
        return _backend
    if not torch_loaded():
        if not import_torch:
            return None
        try:
            torch_module()
        except DecodeError:
            return None
    with _backend_lock:
        if not _backend_probed:
            torch = torch_module()
            if torch.cuda.is_available():
                _backend = TorchCudaBackend()
            _backend_probed = True
    return _backend


def set_cuda_backend(backend: Any) -> Any:
    """Install ``backend`` (``None``: probe again); return the previous one.  For tests."""
    global _backend, _backend_probed
    with _backend_lock:
        previous = _backend
        _backend = backend
        _backend_probed = backend is not None
    return previous


# -- the producer's GPU pool ----------------------------------------------------------------

# GPU blocks of closed connections that nobody can still be reading (every slot came
# back, or the consumer died), kept for the next connection of this process instead of
# being freed: torch frees an exported block only once every importer has dropped it,
# so a block exported to a consumer that was killed would otherwise stay allocated, in
# limbo, until this process exits.  Keyed by (backend, device, bytes, slot classes).
_IDLE: dict[tuple[Any, ...], list[tuple[Any, list[Any], dict[int, tuple[Any, bytes]]]]] = {}
_IDLE_LOCK = threading.Lock()

# A CUDA IPC handle cannot be opened by the process that exported it: a consumer in the
# producer's own process (``pair()`` between threads) finds the pool and the events here.
_LOCAL_POOLS: weakref.WeakValueDictionary[bytes, Any] = weakref.WeakValueDictionary()
_LOCAL_EVENTS: weakref.WeakValueDictionary[bytes, Any] = weakref.WeakValueDictionary()


def drop_idle_pools() -> int:
    """Free the GPU blocks kept for reuse (see ``_IDLE``); return how many."""
    with _IDLE_LOCK:
        n = sum(len(v) for v in _IDLE.values())
        _IDLE.clear()
    return n


class CudaSendPool:
    """One device's GPU pool on the producer side.  The owning
    :class:`~ringwire._shm.sendpool.SendPool` serialises every call under its lock."""

    def __init__(
        self,
        backend: Any,
        device: int,
        classes: Sequence[SlotClass],
        pool_id: int,
    ) -> None:
        self.backend = backend
        self.device = device
        offsets, _, data_offset, data_size = plan_pool(classes)
        self.table = bytearray(data_offset)
        self.layout: PoolLayout = init_pool(self.table, classes, pool_id, table_only=True)
        self.alloc = SlotAllocator(self.table, self.layout)
        nbytes = -(-(data_offset + data_size) // _POOL_ALIGN) * _POOL_ALIGN
        spec = [[c.size, c.count] for c in classes]
        self._key = (id(backend), device, nbytes, tuple(map(tuple, spec)))
        with _IDLE_LOCK:
            idle = _IDLE.get(self._key)
            reused = idle.pop() if idle else None
        if reused is not None:
            self.memory, exported, self._events = reused
        else:
            self.memory = backend.alloc_pool(device, nbytes)
            exported = backend.export_pool(self.memory)  # exported once per block
            self._events = {}
        self._exported = exported
        self.lo = backend.address(self.memory)
        self.hi = self.lo + nbytes
        # every reference carries the announcement so that the consumer never depends
        # on having read one particular earlier record
        self.announcement = msgspec.msgpack.encode([exported, nbytes, spec, os.getpid()])
        _LOCAL_POOLS[self.announcement] = self.memory

    def event_for(self, slot: int) -> bytes:
        """Record the slot's interprocess event on the current stream; its handle."""
        entry = self._events.get(slot)
        if entry is None:
            entry = self._events[slot] = self.backend.new_event(self.device)
            _LOCAL_EVENTS[entry[1]] = entry[0]
        else:
            self.backend.record(entry[0], self.device)
        return entry[1]

    def ref(self, slot: int, offset: int, nbytes: int, t: Any) -> CudaRef:
        event = self.event_for(slot)
        return CudaRef(
            version=1,
            pool=self.layout.pool_id,
            device=self.device,
            slot=slot,
            generation=self.alloc.generation(slot),
            offset=offset,
            nbytes=nbytes,
            shape=tuple(t.shape),
            dtype=torch_dtype_to_wire(t.dtype),
            event=event,
            pool_handle=self.announcement,
        )

    def loan_view(
        self, slot: int, nbytes: int, dtype: Any, shape: tuple[int, ...]
    ) -> tuple[Any, Any]:
        return self.backend.view(self.memory, self.layout.offsets[slot], nbytes, dtype, shape)

    def reusable(self, consumer_gone: bool) -> bool:
        """Could another connection take the block now?  Not while a loan of ours or a
        live consumer's view may still touch it."""
        status = self.alloc.status
        states = {status(i) for i in range(self.layout.nslots)}
        return LOANED not in states and (consumer_gone or SENT not in states)

    def close(self, reusable: bool) -> None:
        """The connection is closed.  ``reusable``: nobody can still read the block
        (every slot came back, or the consumer is dead), so the next connection of
        this process may take it; otherwise it is dropped (freed once the consumer's
        views are gone)."""
        _LOCAL_POOLS.pop(self.announcement, None)
        if reusable and self.memory is not None:
            with _IDLE_LOCK:
                _IDLE.setdefault(self._key, []).append((self.memory, self._exported, self._events))
        self._events = {}
        self.memory = None


# -- the consumer's side --------------------------------------------------------------------


class OpenedCudaPool:
    """A producer's GPU pool as the consumer mapped it (once)."""

    def __init__(self, backend: Any, ref: CudaRef) -> None:
        try:
            exported, nbytes, classes, pid = msgspec.msgpack.decode(ref.pool_handle)
            layout_classes = [SlotClass(int(size), int(count)) for size, count in classes]
            offsets, capacities, data_offset, data_size = plan_pool(layout_classes)
        except (msgspec.DecodeError, TypeError, ValueError) as exc:
            raise DecodeError(f"malformed CUDA pool announcement: {exc}") from exc
        if not isinstance(nbytes, int) or nbytes < data_offset + data_size:
            raise DecodeError("CUDA pool announcement: the pool is smaller than its slots")
        self.backend = backend
        self.device = ref.device
        self.pool_id = ref.pool
        self.offsets = offsets
        self.capacities = capacities
        local = _LOCAL_POOLS.get(ref.pool_handle) if pid == os.getpid() else None
        self.local = local is not None
        self.memory = (
            local if local is not None else backend.open_pool(ref.device, exported, nbytes)
        )
        self.last_generation = [-1] * len(offsets)
        self._events: dict[bytes, Any] = {}

    def check(self, ref: CudaRef, held: dict[int, int]) -> int:
        """Raise :class:`DecodeError` unless ``ref`` is a fresh, in-bounds reference
        into this pool; return its release tag."""
        slot = ref.slot
        if slot >= len(self.offsets):
            raise DecodeError(
                f"CUDA reference names slot {slot} of a {len(self.offsets)}-slot pool"
            )
        start, cap = self.offsets[slot], self.capacities[slot]
        if ref.offset < start or ref.offset + ref.nbytes > start + cap:
            raise DecodeError(
                f"CUDA reference [{ref.offset}, {ref.offset + ref.nbytes}) lies outside "
                f"slot {slot} [{start}, {start + cap})"
            )
        tag = cuda_tag(self.device, slot)
        if ref.generation <= self.last_generation[slot] or tag in held:
            raise DecodeError(
                f"CUDA reference to slot {slot} generation {ref.generation} is stale "
                f"(generation {self.last_generation[slot]} was already seen)"
            )
        itemsize = int(torch_dtype_from_wire(ref.dtype).itemsize)
        if ref.offset % min(itemsize, 16):
            raise DecodeError(f"CUDA reference offset {ref.offset} is misaligned for {ref.dtype}")
        return tag

    def event(self, handle: bytes) -> Any:
        ev = self._events.get(handle)
        if ev is None and self.local:
            ev = _LOCAL_EVENTS.get(handle)
        if ev is None:
            if len(self._events) >= 4 * len(self.offsets):
                self._events.clear()  # a producer re-creating events: do not grow forever
            ev = self._events[handle] = self.backend.open_event(self.device, handle)
        return ev


class ReleaseThread:
    """Waits for consumers' release events, then acknowledges the slots.

    The finalizer only records an event and ``put``s on a :class:`queue.SimpleQueue`
    (reentrant: safe inside garbage collection and from any thread).  The thread
    blocks in ``event.synchronize()`` -- sleeping in the driver, not polling -- and then
    pushes ``(tag, generation)`` into the connection's release queue, whose sink writes
    the release lane and rings the producer's doorbell if it is parked.
    """

    def __init__(self, backend: Any, push: Any) -> None:
        self.backend = backend
        self._push = push
        self._queue: queue.SimpleQueue[tuple[int, int, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ringwire-cuda-release", daemon=True)
        self._thread.start()

    def put(self, tag: int, generation: int, event: Any) -> None:
        self._queue.put((tag, generation, event))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            tag, generation, event = item
            try:
                self.backend.synchronize(event)
            except Exception:  # the context is gone (exit): the producer reclaims on EOF
                continue
            self._push(tag, generation)

    def stop(self, timeout: float | None = 0.0) -> None:
        self._queue.put(None)
        if timeout:
            self._thread.join(timeout)


def cuda_nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())
