"""CUDA tensors by reference (Ext 5): a GPU slot pool per (producer, device).

A CUDA tensor at or above ``SlotConfig.cuda_threshold`` bytes travels as a
:class:`~ringwire.wire.CudaRef` naming a byte range in the producer's *GPU pool* for that
device: one block of device memory of its own, allocated the first time a tensor of
that device is sent on the connection (or taken from the blocks earlier connections of
this process gave back) and exported (``cudaIpcGetMemHandle``, through torch) once per
connection.  The consumer opens the handle the first time it sees the pool and keeps
the mapping for the life of the connection -- opening a handle is slow, and a handle
can be opened only once per process.  How long a block lives, and why it is exported
again for every connection, is :mod:`ringwire._pool.cudablocks`.

The block is its own
--------------------
torch's ``_share_cuda_`` exports the whole ``cudaMalloc`` segment a tensor lies in, plus
the tensor's offset (``DeviceCachingAllocator::shareIpcHandle``): a consumer that maps
it can address everything else the caching allocator put in that segment.  So the pool
is allocated in a private ``torch.cuda.MemPool`` of its own (``use_mem_pool``): the
first allocation of a fresh private pool is a fresh segment, which nothing else of the
process is ever placed in.  The export is checked to start at the segment (offset 0).
Without ``MemPool`` and ``use_mem_pool`` (older torch) the pool is at least 10 MiB, a
multiple of 2 MiB (then the caching allocator rounds a new segment to exactly that
size), and ``torch.cuda.memory_snapshot()`` must show it as a segment alone, or the
pool is refused with a :class:`~ringwire.RingwireError`.

What is shared with SHM slots
-----------------------------
The bookkeeping is the same :class:`~ringwire._wire.slotlayout.SlotAllocator` (slot classes,
generations, FREE -> LOANED -> SENT -> FREE), kept in a private table on the producer
side (the GPU block holds only data).  Releases travel on the SHM pool's release lane
as ordinary ``(slot, generation)`` pairs whose slot number carries the device in its
high half (:func:`cuda_tag`), so acknowledgements, receipts, reclaim on peer death,
refusal of double or forged releases and the doorbell are the SHM code, unchanged.
A CUDA pool therefore needs the connection's SHM slot pool (``slots=`` not ``None``).

Devices
-------
Device numbers are per process (``CUDA_VISIBLE_DEVICES`` may differ, or order them
differently), so a reference also carries the device's UUID
(``torch.cuda.get_device_properties(d).uuid``); the consumer maps it to its own index
and refuses, with a :class:`~ringwire.DecodeError` that says so, a device it does not
see.  The producer's index stays in the reference: it names the pool (its id, the
release tags).  A reference without a UUID (an older producer) uses the index as is.

Validation on the consumer
--------------------------
The consumer cannot read the producer's table, so it checks what it can know:

* the pool id must be the one this connection's producer has for that device (it is
  derived from the SHM pool id both sides already share: :func:`cuda_pool_id`), so a
  reference to any other pool -- another producer's, another connection's -- is
  refused before anything is opened; one announcement opens one pool only;
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
only after every kernel the consumer enqueued *on that stream* before dropping it has
finished.  The release thread makes the event's device its current device first
(``cudaEventSynchronize`` needs no particular device, but the first CUDA call of a
thread without one creates a context on GPU 0).

Work on *other* streams is not covered, and ``Tensor.record_stream`` does not help:
the caching allocator ignores it for memory it did not allocate
(``NativeCachingAllocator::recordStream`` returns when the storage's deleter is not its
own), and a received tensor views the producer's pool.  Order such work into the
receiving stream before the last view dies (``torch.cuda.current_stream().wait_stream(s)``
or an event), synchronize, or keep a copy (``copy_out``).

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
test suite (device memory and torch's reference counters in memfds, events that
complete on demand and fail when used after their exporter destroyed them, device
UUIDs).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from .._errors import DecodeError, RingwireError
from .._wire.descriptors import CudaRef
from .._wire.dtypes import torch_dtype_from_wire, torch_dtype_to_wire, torch_loaded, torch_module
from .._wire.slotlayout import (
    LOANED,
    PoolLayout,
    SlotAllocator,
    SlotClass,
    init_pool,
    plan_pool,
)
from .cudablocks import (
    Block,
    Export,
    Mapping,
    drop_idle_pools,
    lingering_pools,
    local_export,
    retire,
    sweep,
    take_idle,
    take_lease,
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
    "lingering_pools",
    "local_device_of",
    "set_cuda_backend",
    "split_tag",
    "sweep",
]

_MASK64 = (1 << 64) - 1
_TAG_SHIFT = 32
_POOL_ALIGN = 2 << 20  # the caching allocator rounds large segments to 2 MiB
_MIN_OWN_SEGMENT = 10 << 20  # below this a new segment is 20 MiB, shared (kMinLargeAlloc)


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
    """CUDA through torch: pools, IPC handles and counters, interprocess events, streams."""

    name = "cuda"

    def __init__(self) -> None:
        self.torch = torch_module()
        self._uuids: list[bytes] | None = None

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

    # devices
    def device_uuid(self, device: int) -> bytes:
        uuid = self.torch.cuda.get_device_properties(device).uuid
        raw = getattr(uuid, "bytes", None)
        if raw is not None:
            return bytes(raw)
        return bytes.fromhex(str(uuid).removeprefix("GPU-").replace("-", ""))

    def local_device(self, uuid: bytes) -> int | None:
        """This process's index of the device ``uuid`` names, or ``None``."""
        if self._uuids is None:
            self._uuids = [self.device_uuid(d) for d in range(self.device_count())]
        try:
            return self._uuids.index(uuid)
        except ValueError:
            return None

    # pools
    def empty(self, shape: Any, dtype: Any, device: int) -> Any:
        return self.torch.empty(shape, dtype=dtype, device=f"cuda:{device}")

    def alloc_pool(self, device: int, nbytes: int) -> Any:
        """Device memory that is a segment of its own (see the module docstring)."""
        torch = self.torch
        cuda = torch.cuda
        mempool, use_mem_pool = getattr(cuda, "MemPool", None), getattr(cuda, "use_mem_pool", None)
        with cuda.device(device):
            if mempool is not None and use_mem_pool is not None:
                pool = mempool()
                with use_mem_pool(pool):
                    memory = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
                # the private pool's blocks stay valid without it (releasePool), but
                # it is kept with the tensor all the same
                memory.ringwire_mempool = pool
                return memory
            size = max(nbytes, _MIN_OWN_SEGMENT)
            size = -(-size // _POOL_ALIGN) * _POOL_ALIGN
            memory = torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
            ptr = memory.data_ptr()
            alone = any(
                s.get("device") == device
                and s.get("address") == ptr
                and s.get("total_size") == size
                for s in cuda.memory_snapshot()
            )
            if not alone:
                raise RingwireError(
                    f"the GPU pool for cuda:{device} could not get a segment of its own "
                    "(this torch has no torch.cuda.MemPool; a consumer could map other "
                    "memory of this process): use a torch with torch.cuda.use_mem_pool, "
                    "allocate the pool before other tensors, or send through the host "
                    "(SlotConfig(cuda='stage'))"
                )
            return memory

    def address(self, memory: Any) -> int:
        return int(memory.data_ptr())

    def export_pool(self, memory: Any) -> list[Any]:
        """A new export of ``memory``: (device, handle, size, offset in the segment,
        ref counter handle, ref counter offset, event handle, event sync required),
        plain bytes, ints and a bool.  Every call puts the storage behind a new
        reference counter, starting at 1 (``THPStorage_shareCuda``)."""
        # torch's own IPC entry point (what torch.multiprocessing's reductions call)
        exported = list(memory.untyped_storage()._share_cuda_())  # noqa: SLF001
        if exported[3] != 0:
            raise RingwireError(
                f"the GPU pool lies at offset {exported[3]} of a segment it shares: a "
                "consumer could map other memory of this process"
            )
        return exported

    def release_counter(self, exported: list[Any]) -> None:
        """Subtract 1 from the export's reference counter, as the deleter of a storage
        opened with ``_new_shared_cuda`` does (for an opener that never will)."""
        # torch's own entry point (rebuild_cuda_tensor in reductions.py calls it)
        self.torch.UntypedStorage._release_ipc_counter_cuda(exported[4], exported[5])  # noqa: SLF001

    def collect(self) -> None:
        self.torch.cuda.ipc_collect()

    def open_pool(self, device: int, exported: list[Any], nbytes: int) -> Any:
        torch = self.torch
        if len(exported) != 8 or not isinstance(exported[1], bytes):
            raise DecodeError("malformed CUDA pool handle")
        # torch's own IPC entry points (what torch.multiprocessing's reductions call)
        torch.cuda._lazy_init()  # noqa: SLF001
        args = list(exported)
        args[0] = device  # this process's index of the device (the producer's may differ)
        # the export-time event orders nothing we need (every slot has its own), and
        # _new_shared_cuda would open it and never destroy it
        args[7] = False
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
        self,
        memory: Any,
        offset: int,
        nbytes: int,
        dtype: Any,
        shape: Any,
        owner: Any = None,
    ) -> tuple[Any, Any]:
        """A tensor over ``memory[offset:offset + nbytes]`` and the object whose death
        means every view of it is gone (torch holds it in the storage's deleter); it
        keeps ``owner`` (default: ``memory``) alive."""
        span = _CudaSpan(self.address(memory) + offset, nbytes, memory if owner is None else owner)
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

    def synchronize(self, event: Any, device: int | None = None) -> None:
        """Wait for ``event`` (in the release thread).  ``device``: the event's, made
        this thread's current device first, so that the wait creates no context on
        GPU 0 (the default device of a thread that has none)."""
        cuda = self.torch.cuda
        if device is not None and cuda.current_device() != device:
            cuda.set_device(device)
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
_BACKEND_METHODS = (
    "is_device_tensor",
    "device_index",
    "device_count",
    "alloc_pool",
    "export_pool",
    "open_pool",
    "view",
    "new_event",
    "open_event",
    "release_event",
    "synchronize",
)


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


def set_cuda_backend(backend: Any, *, probe: bool = True) -> Any:
    """Install ``backend``; return the previous one.  For tests.

    ``set_cuda_backend(None)`` forgets the backend: the next use probes torch again
    (on a machine with CUDA that installs the real one).  ``set_cuda_backend(None,
    probe=False)`` says "probed: no backend" -- this process behaves as one without
    CUDA whatever the machine has."""
    global _backend, _backend_probed
    if not isinstance(probe, bool):
        raise TypeError(f"probe must be a bool, not {probe!r}")
    if backend is not None:
        if not probe:
            raise ValueError("probe=False goes with backend None ('probed: no backend')")
        missing = [m for m in _BACKEND_METHODS if not callable(getattr(backend, m, None))]
        if missing:
            raise TypeError(f"{backend!r} is not a CUDA backend: it lacks {', '.join(missing)}")
    with _backend_lock:
        previous = _backend
        _backend = backend
        _backend_probed = backend is not None or not probe
    return previous


def _uuid_of(backend: Any, device: int) -> bytes:
    get = getattr(backend, "device_uuid", None)
    return bytes(get(device)) if get is not None else b""


# -- the producer's GPU pool ----------------------------------------------------------------


class CudaSendPool:
    """One device's GPU pool on the producer side.  The owning
    :class:`~ringwire._shm.sendpool.ShmSendPool` serialises every call under its lock."""

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
        key = (id(backend), device, nbytes, tuple(map(tuple, spec)))
        self.uuid = _uuid_of(backend, device)
        block = take_idle(key)  # settles what it can first
        if block is None:
            block = Block(backend, device, nbytes, key)
        try:
            export = Export(block, spec)
        except RingwireError:
            raise
        except Exception as exc:
            raise RingwireError(f"cannot export the GPU pool for cuda:{device}: {exc}") from exc
        self.block: Block | None = block
        self.export: Export | None = export
        self.memory: Any = block.memory
        self.lo = backend.address(self.memory)
        self.hi = self.lo + nbytes
        self.announcement = export.announcement
        self._lease = export.lease.descriptor

    def event_for(self, slot: int) -> bytes:
        """Record the slot's interprocess event on the current stream; its handle."""
        assert self.export is not None, "the pool is closed"
        return self.export.event_for(slot)

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
            device_uuid=self.uuid,
            lease=self._lease,
        )

    def loan_view(
        self, slot: int, nbytes: int, dtype: Any, shape: tuple[int, ...]
    ) -> tuple[Any, Any]:
        return self.backend.view(self.memory, self.layout.offsets[slot], nbytes, dtype, shape)

    def has_loans(self) -> bool:
        status = self.alloc.status
        return any(status(i) == LOANED for i in range(self.layout.nslots))

    def close(self, consumer_gone: bool, lane: Any) -> bool:
        """The connection is closed: retire its export (:func:`~ringwire._pool.cudablocks.retire`).
        ``consumer_gone``: the consumer can open nothing any more (end of file, or its
        closed flag); otherwise ``lane`` (a reader of the release lane) tells later.
        The block goes to the next connection of this process once nobody maps it,
        and stays intact (memory, events) for a consumer still reading until then.
        ``True``: settled now."""
        export, self.export = self.export, None
        self.memory = None
        self.block = None
        if export is None:
            return True
        return retire(export, loaned=self.has_loans(), consumer_gone=consumer_gone, lane=lane)


# -- the consumer's side --------------------------------------------------------------------


def local_device_of(backend: Any, ref: CudaRef) -> int:
    """This process's index of the device ``ref`` names (by UUID where it has one)."""
    if ref.device_uuid:
        find = getattr(backend, "local_device", None)
        local = find(ref.device_uuid) if find is not None else None
        if local is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise DecodeError(
                f"CUDA reference names GPU {ref.device_uuid.hex()} (the producer's "
                f"cuda:{ref.device}), which this process does not see "
                f"(CUDA_VISIBLE_DEVICES={visible!r}; {backend.device_count()} device(s) "
                "visible): make it visible here, or send through the host "
                "(SlotConfig(cuda='stage'))"
            )
        return int(local)
    if ref.device >= backend.device_count():
        raise DecodeError(
            f"CUDA reference names cuda:{ref.device}; this process sees "
            f"{backend.device_count()} device(s)"
        )
    return ref.device


class OpenedCudaPool:
    """A producer's GPU pool as the consumer mapped it (once)."""

    def __init__(self, backend: Any, ref: CudaRef, local_device: int) -> None:
        try:
            items = msgspec.msgpack.decode(ref.pool_handle)
            if not isinstance(items, list) or len(items) < 4:
                raise TypeError("not a list of four")
            exported, nbytes, classes, pid = items[:4]
            layout_classes = [SlotClass(int(size), int(count)) for size, count in classes]
            offsets, capacities, data_offset, data_size = plan_pool(layout_classes)
        except (msgspec.DecodeError, TypeError, ValueError) as exc:
            raise DecodeError(f"malformed CUDA pool announcement: {exc}") from exc
        if not isinstance(nbytes, int) or nbytes < data_offset + data_size:
            raise DecodeError("CUDA pool announcement: the pool is smaller than its slots")
        self.backend = backend
        self.device = ref.device  # the producer's index: pool id and release tags
        self.local_device = local_device  # ours: every CUDA call
        self.pool_id = ref.pool
        self.announcement = ref.pool_handle
        self.offsets = offsets
        self.capacities = capacities
        export = local_export(ref.pool_handle) if pid == os.getpid() else None
        self._export = export
        self.local = export is not None
        if export is not None:
            self.mapping = export.map_locally()
        else:
            lease = take_lease(ref.lease, int(pid)) if ref.lease else -1  # before mapping
            try:
                memory = backend.open_pool(local_device, exported, nbytes)
            except BaseException:
                if lease >= 0:
                    os.close(lease)
                raise
            self.mapping = Mapping(memory, lease)
        self.last_generation = [-1] * len(offsets)
        self._events: dict[bytes, Any] = {}

    @property
    def memory(self) -> Any:
        return self.mapping.memory

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
        if ev is None and self._export is not None:
            ev = self._export.local_event(handle)
            if ev is None:
                raise DecodeError("CUDA reference names an event its pool never recorded")
            return ev
        if ev is None:
            if len(self._events) >= 4 * len(self.offsets):
                self._events.clear()  # a producer re-creating events: do not grow forever
            ev = self._events[handle] = self.backend.open_event(self.local_device, handle)
        return ev


class ReleaseThread:
    """Waits for consumers' release events, then acknowledges the slots.

    The finalizer only records an event and ``put``s on a :class:`queue.SimpleQueue`
    (reentrant: safe inside garbage collection and from any thread).  The thread
    blocks in ``event.synchronize()`` -- sleeping in the driver, not polling, with the
    event's device as its current one -- and then pushes ``(tag, generation)`` into the
    connection's release queue, whose sink writes the release lane and rings the
    producer's doorbell if it is parked.
    """

    def __init__(self, backend: Any, push: Any) -> None:
        self.backend = backend
        self._push = push
        self._queue: queue.SimpleQueue[tuple[int, int, Any, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ringwire-cuda-release", daemon=True)
        self._thread.start()

    def put(self, tag: int, generation: int, event: Any, device: int) -> None:
        self._queue.put((tag, generation, event, device))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            tag, generation, event, device = item
            try:
                self.backend.synchronize(event, device)
            except Exception:  # the context is gone (exit): the producer reclaims on EOF
                continue
            self._push(tag, generation)

    def stop(self, timeout: float | None = 0.0) -> None:
        self._queue.put(None)
        if timeout:
            self._thread.join(timeout)


def cuda_nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())
