"""A simulated CUDA backend, so that the Ext 5 protocol runs in CI without a GPU.

It models what ringwire relies on in torch and CUDA, closely enough that the mistakes
one can make against the real thing fail here too:

* **Device memory** is a ``memfd`` the producer keeps open; a consumer in another
  process "opens the IPC handle" by mapping ``/proc/<pid>/fd/<fd>`` (no ``/dev/shm``
  name, so a killed producer leaves nothing behind).  As with CUDA, the process that
  exported a handle cannot open it (``open_pool`` raises).  A "CUDA tensor" is a CPU
  tensor made by :meth:`tensor` (or any view into a pool).
* **The caching allocator and torch's reference counters** (``_share_cuda_`` /
  ``_new_shared_cuda`` / ``CudaIPCSentDataDelete``): every :meth:`export_pool` starts a
  fresh counter at 1 (counters live in a memfd, so every process sees them); the
  deleter of a pool opened with :meth:`open_pool` subtracts 1; :meth:`release_counter`
  subtracts 1.  When the producer's storage dies (the last tensor and view over it),
  the block is freed only if none of its counters is above 0, otherwise it waits in
  :attr:`limbo` -- looked at again only at the next storage death or :meth:`collect`
  (``torch.cuda.ipc_collect``).  A freed block is handed out again by the next
  :meth:`alloc_pool` of that size, unzeroed, like the caching allocator's cache: a
  consumer that still maps it then reads the producer's next tensors.
* **Interprocess events** live in a memfd table too: an event is *destroyed* when its
  object dies (as ``cudaEventDestroy`` in ``~CUDAEvent``), and opening, waiting on or
  recording an imported event after that raises (CUDA calls it undefined behaviour).
  Release events complete only while :attr:`gate` is set, so a test can hold
  acknowledgements back and check that the slot stays taken until the consumer's
  "kernels" are done.
* **Devices** have UUIDs (``uuids``, default ``fake-gpu-00`` ...); a process built with
  another order models another ``CUDA_VISIBLE_DEVICES``.  Received views are "on" the
  device the pool was opened on.

Everything here is test scaffolding; ringwire itself ships only the torch backend.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import weakref
from typing import Any

import numpy as np
import pytest

from ringwire._pool.cuda import set_cuda_backend
from support.extras import NO_TORCH

# ringwire's CUDA path hands out torch tensors: where torch is absent, a test module that
# imports this one (directly or through support/cuda.py) is skipped, with the reason.
torch = pytest.importorskip("torch", reason=NO_TORCH + ": the CUDA path is torch's")

_COUNTERS = 1 << 12  # counters per backend (int64 each)
_EVENTS = 1 << 16  # events per backend (one alive byte each); never reused
_EVENT = struct.Struct("<III")  # pid, table fd, index (padded to a CUDA handle's 64 bytes)


def default_uuid(device: int) -> bytes:
    return f"fake-gpu-{device:02d}".encode().ljust(16, b"\0")


class FakeEvent:
    def __init__(
        self,
        handle: bytes = b"",
        gate: threading.Event | None = None,
        alive: Any = None,
        index: int = -1,
    ) -> None:
        self.handle = handle
        self.gate = gate
        self.records = 0
        self._alive = alive  # an exported or imported event: its byte in the table
        self._index = index

    def check(self) -> None:
        if self._alive is not None and not self._alive[self._index]:
            raise RuntimeError(
                "CUDA error (simulated): interprocess event used after its exporter "
                "destroyed it (cudaIpcOpenEventHandle: undefined behavior)"
            )


class _Block:
    """A producer's "cudaMalloc'd" block: a memfd, and the counters of its exports."""

    def __init__(self, device: int, nbytes: int) -> None:
        self.device = device
        self.nbytes = nbytes
        self.fd = os.memfd_create("rw-fake-cuda")
        os.ftruncate(self.fd, nbytes)
        self.mm = mmap.mmap(self.fd, nbytes)
        self.counters: list[int] = []
        weakref.finalize(self, _close_block, self.mm, self.fd).atexit = True


def _close_block(mm: mmap.mmap, fd: int) -> None:
    try:
        mm.close()
    except BufferError:  # views remain (a consumer in this process): they unmap it
        pass
    os.close(fd)


class _Span:
    """An ``__array_interface__`` over a byte range that keeps ``owner`` alive."""

    def __init__(self, arr: Any, owner: Any) -> None:
        self.arr = arr
        self.owner = owner
        self.__array_interface__ = arr.__array_interface__


class FakeCudaBackend:
    name = "fake-cuda"

    def __init__(self, ndevices: int = 1, uuids: list[bytes] | None = None) -> None:
        self.ndevices = ndevices
        self.uuids = list(uuids) if uuids is not None else [default_uuid(d) for d in range(ndevices)]
        assert len(self.uuids) == ndevices and all(len(u) == 16 for u in self.uuids)
        self.gate = threading.Event()
        self.gate.set()
        self.pools_allocated = 0  # alloc_pool calls
        self.blocks_recycled = 0  # of which served from freed blocks
        self.blocks_freed = 0  # storages that were freed (not held in limbo)
        self.limbo: list[_Block] = []
        self.exports = 0
        self.exported: list[list[Any]] = []  # every export_pool result, in order
        self.counters_released = 0
        self.collects = 0
        self.pool_opens = 0
        self.event_opens = 0
        self.waits = 0
        self.copies = 0
        self.release_events = 0
        self.synchronized = 0
        self.sync_devices: list[int | None] = []
        self._lock = threading.RLock()
        self._free: dict[tuple[int, int], list[_Block]] = {}
        self._blocks: dict[int, _Block] = {}  # data_ptr of a producer's memory -> block
        self._arrays: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._ranges: dict[int, tuple[int, int]] = {}  # lo -> (hi, device) of live mappings
        self._counter_fd = os.memfd_create("rw-fake-cuda-counters")
        os.ftruncate(self._counter_fd, _COUNTERS * 8)
        self._counter_mm = mmap.mmap(self._counter_fd, _COUNTERS * 8)
        self._counters = memoryview(self._counter_mm).cast("q")
        self._next_counter = 0
        self._event_fd = os.memfd_create("rw-fake-cuda-events")
        os.ftruncate(self._event_fd, _EVENTS)
        self._event_mm = mmap.mmap(self._event_fd, _EVENTS)
        self._next_event = 0
        self._peer_tables: dict[tuple[int, int], mmap.mmap] = {}
        tables = (self._counters, self._counter_mm, self._counter_fd)
        weakref.finalize(self, _close_tables, *tables, self._event_mm, self._event_fd)

    # tensors
    def tensor(self, data: Any, device: int = 0) -> Any:
        t = torch.as_tensor(data).clone()
        t._rw_fake_device = device  # type: ignore[attr-defined]
        return t

    def empty(self, shape: Any, dtype: Any, device: int) -> Any:
        return self.tensor(torch.empty(shape, dtype=dtype), device)

    def _device_at(self, addr: int) -> int | None:
        for lo, (hi, device) in list(self._ranges.items()):
            if lo <= addr < hi:
                return device
        return None

    def is_device_tensor(self, t: Any) -> bool:
        return hasattr(t, "_rw_fake_device") or self._device_at(t.data_ptr()) is not None

    def device_index(self, t: Any) -> int:
        device = getattr(t, "_rw_fake_device", None)
        if device is None:
            device = self._device_at(t.data_ptr())
        return int(device or 0)

    def device_count(self) -> int:
        return self.ndevices

    def current_device(self) -> int:
        return 0

    def device_uuid(self, device: int) -> bytes:
        return self.uuids[device]

    def local_device(self, uuid: bytes) -> int | None:
        return self.uuids.index(uuid) if uuid in self.uuids else None

    # memory
    def _wrap(self, mm: mmap.mmap, device: int, on_free: Any, *args: Any) -> Any:
        """A "storage" over ``mm``: the returned tensor, and every view made from it
        by :meth:`view`, keep one array alive; when it dies, ``on_free(*args)``."""
        arr = np.frombuffer(mm, np.uint8)
        memory = torch.from_numpy(arr)
        lo = memory.data_ptr()
        self._arrays[lo] = arr
        self._ranges[lo] = (lo + arr.nbytes, device)
        weakref.finalize(arr, self._freed, lo, on_free, *args)
        return memory

    def _freed(self, lo: int, on_free: Any, *args: Any) -> None:
        self._ranges.pop(lo, None)
        on_free(*args)

    def alloc_pool(self, device: int, nbytes: int) -> Any:
        with self._lock:
            self.pools_allocated += 1
            free = self._free.get((device, nbytes))
            if free:
                block = free.pop()  # the caching allocator hands freed memory out again
                self.blocks_recycled += 1
            else:
                block = _Block(device, nbytes)
        memory = self._wrap(block.mm, device, self._storage_died, block)
        self._blocks[memory.data_ptr()] = block
        return memory

    def _storage_died(self, block: _Block) -> None:
        # CudaIPCSentDataDelete: held while a counter is above 0, then collect()
        for ptr, b in list(self._blocks.items()):
            if b is block:
                del self._blocks[ptr]
        with self._lock:
            if any(self._counters[i] > 0 for i in block.counters):
                self.limbo.append(block)
            else:
                self._free_block(block)
        self.collect(count=False)

    def _free_block(self, block: _Block) -> None:
        block.counters = []
        self.blocks_freed += 1
        self._free.setdefault((block.device, block.nbytes), []).append(block)

    def collect(self, count: bool = True) -> None:
        with self._lock:
            if count:
                self.collects += 1
            for block in list(self.limbo):
                if all(self._counters[i] <= 0 for i in block.counters):
                    self.limbo.remove(block)
                    self._free_block(block)

    def address(self, memory: Any) -> int:
        return int(memory.data_ptr())

    def export_pool(self, memory: Any) -> list[Any]:
        block = self._blocks[memory.data_ptr()]
        with self._lock:
            index = self._next_counter
            self._next_counter += 1
            assert index < _COUNTERS, "fake: out of reference counters"
            self._counters[index] = 1  # GetNewRefCountedSentData: set_counter(1)
            block.counters.append(index)
            self.exports += 1
        exported = [os.getpid(), block.fd, block.nbytes, self._counter_fd, index]
        self.exported.append(exported)
        return exported

    def release_counter(self, exported: list[Any]) -> None:
        self.counters_released += 1
        _decrement(*exported)

    def counter(self, exported: list[Any]) -> int:
        """The current value of an export's counter (this process's exports)."""
        return int(self._counters[exported[4]])

    def open_pool(self, device: int, exported: list[Any], nbytes: int) -> Any:
        pid, fd, size, counter_fd, index = exported
        if int(pid) == os.getpid():
            raise RuntimeError(
                "CUDA error (simulated): an IPC memory handle cannot be opened by the "
                "process that exported it"
            )
        self.pool_opens += 1
        with open(f"/proc/{int(pid)}/fd/{int(fd)}", "r+b") as f:
            mm = mmap.mmap(f.fileno(), max(int(size), nbytes))
        # the opener's deleter (THPStorage_newSharedCuda): subtract 1 when it dies
        return self._wrap(mm, device, _decrement, pid, fd, size, counter_fd, index)

    def copy_into(self, memory: Any, offset: int, t: Any) -> None:
        self.copies += 1
        nbytes = t.numel() * t.element_size()
        memory.narrow(0, offset, nbytes).view(t.dtype).view(t.shape).copy_(t.detach())

    def view(
        self,
        memory: Any,
        offset: int,
        nbytes: int,
        dtype: Any,
        shape: Any,
        owner: Any = None,
    ) -> tuple[Any, Any]:
        arr = self._arrays[memory.data_ptr()]
        span = _Span(arr[offset : offset + nbytes], memory if owner is None else owner)
        base = np.asarray(span)  # its base is the span: keeps the array and the owner
        return torch.from_numpy(base).view(dtype).view(tuple(shape)), base

    # streams and events
    def current_stream(self, device: int) -> Any:
        return ("stream", device)

    def new_event(self, device: int) -> tuple[Any, bytes]:
        with self._lock:
            index = self._next_event
            self._next_event += 1
            assert index < _EVENTS, "fake: out of events"
        self._event_mm[index] = 1
        handle = _EVENT.pack(os.getpid(), self._event_fd, index).ljust(64, b"\0")
        event = FakeEvent(handle, alive=self._event_mm, index=index)
        weakref.finalize(event, _destroy_event, self._event_mm, index)  # ~CUDAEvent
        return event, handle

    def record(self, event: Any, device: int) -> None:
        event.check()
        event.records += 1

    def open_event(self, device: int, handle: bytes) -> Any:
        pid, fd, index = _EVENT.unpack(handle[: _EVENT.size])
        if pid == os.getpid():
            raise RuntimeError(
                "CUDA error (simulated): an IPC event handle cannot be opened by the "
                "process that exported it"
            )
        table = self._peer_tables.get((pid, fd))
        if table is None:
            with open(f"/proc/{pid}/fd/{fd}", "rb") as f:
                table = mmap.mmap(f.fileno(), _EVENTS, prot=mmap.PROT_READ)
            self._peer_tables[(pid, fd)] = table
        event = FakeEvent(handle, alive=table, index=index)
        event.check()
        self.event_opens += 1
        return event

    def wait_event(self, event: Any, stream: Any) -> None:
        event.check()
        self.waits += 1

    def release_event(self, stream: Any) -> Any:
        self.release_events += 1
        return FakeEvent(gate=self.gate)

    def synchronize(self, event: Any, device: int | None = None) -> None:
        assert event.gate is not None
        event.gate.wait()
        self.sync_devices.append(device)
        self.synchronized += 1


def _decrement(pid: Any, fd: Any, size: Any, counter_fd: Any, index: Any) -> None:
    """Subtract 1 from a counter of process ``pid`` (best effort, as torch: a gone
    producer is ignored)."""
    try:
        with open(f"/proc/{int(pid)}/fd/{int(counter_fd)}", "r+b") as f:
            mm = mmap.mmap(f.fileno(), _COUNTERS * 8)
    except OSError:
        return
    view = memoryview(mm).cast("q")
    try:
        view[int(index)] -= 1
    finally:
        view.release()
        mm.close()


def _destroy_event(table: mmap.mmap, index: int) -> None:
    if not table.closed:
        table[index] = 0


def _close_tables(
    counters: memoryview, counter_mm: mmap.mmap, counter_fd: int, event_mm: mmap.mmap, event_fd: int
) -> None:
    counters.release()
    for mm in (counter_mm, event_mm):
        try:
            mm.close()
        except BufferError:
            pass
    os.close(counter_fd)
    os.close(event_fd)


def install(ndevices: int = 1, uuids: list[bytes] | None = None) -> FakeCudaBackend:
    backend = FakeCudaBackend(ndevices, uuids)
    set_cuda_backend(backend)
    return backend


__all__ = ["FakeCudaBackend", "FakeEvent", "default_uuid", "install"]
