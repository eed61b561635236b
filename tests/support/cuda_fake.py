"""A simulated CUDA backend, so that the Ext 5 protocol runs in CI without a GPU.

"Device memory" is a ``memfd`` the producer keeps open; the consumer "opens the IPC
handle" by mapping ``/proc/<pid>/fd/<fd>`` (no ``/dev/shm`` name, so a killed producer
leaves nothing behind).  A "CUDA tensor" is a CPU tensor made by :meth:`tensor` (or
any view into a pool).  Events do nothing except count, and release events complete
only while :attr:`gate` is set, so a test can hold acknowledgements back and check
that the slot stays taken until the consumer's "kernels" are done.

Everything here is test scaffolding; ringwire itself ships only the torch backend.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import weakref
from typing import Any

import numpy as np
import torch

from ringwire._shm.cuda import set_cuda_backend


class FakeEvent:
    def __init__(self, handle: bytes = b"", gate: threading.Event | None = None) -> None:
        self.handle = handle
        self.gate = gate
        self.records = 0


class FakeCudaBackend:
    name = "fake-cuda"

    def __init__(self, ndevices: int = 1) -> None:
        self.ndevices = ndevices
        self.gate = threading.Event()
        self.gate.set()
        self.pools_allocated = 0
        self.pool_opens = 0
        self.event_opens = 0
        self.waits = 0
        self.copies = 0
        self.release_events = 0
        self.synchronized = 0
        self._pools: list[tuple[int, int, int]] = []  # (lo, hi, device)
        self._maps: dict[int, mmap.mmap] = {}

    # tensors
    def tensor(self, data: Any, device: int = 0) -> Any:
        t = torch.as_tensor(data).clone()
        t._rw_fake_device = device  # type: ignore[attr-defined]
        return t

    def empty(self, shape: Any, dtype: Any, device: int) -> Any:
        return self.tensor(torch.empty(shape, dtype=dtype), device)

    def _device_at(self, addr: int) -> int | None:
        for lo, hi, device in self._pools:
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

    # pools
    def _map(self, fd: int, nbytes: int, device: int) -> Any:
        mm = mmap.mmap(fd, nbytes)
        arr = np.frombuffer(mm, np.uint8)
        memory = torch.from_numpy(arr)
        lo = memory.data_ptr()
        self._maps[lo] = mm
        self._pools.append((lo, lo + nbytes, device))
        return memory

    def alloc_pool(self, device: int, nbytes: int) -> Any:
        fd = os.memfd_create("rw-fake-cuda")
        os.ftruncate(fd, nbytes)
        memory = self._map(fd, nbytes, device)
        memory._rw_fd = fd  # type: ignore[attr-defined]
        weakref.finalize(memory, os.close, fd).atexit = True
        self.pools_allocated += 1
        return memory

    def address(self, memory: Any) -> int:
        return int(memory.data_ptr())

    def export_pool(self, memory: Any) -> list[Any]:
        return [os.getpid(), memory._rw_fd, memory.numel()]

    def open_pool(self, device: int, exported: list[Any], nbytes: int) -> Any:
        pid, fd, size = exported
        self.pool_opens += 1
        with open(f"/proc/{int(pid)}/fd/{int(fd)}", "r+b") as f:
            return self._map(f.fileno(), max(int(size), nbytes), device)

    def copy_into(self, memory: Any, offset: int, t: Any) -> None:
        self.copies += 1
        nbytes = t.numel() * t.element_size()
        memory.narrow(0, offset, nbytes).view(t.dtype).view(t.shape).copy_(t.detach())

    def view(
        self, memory: Any, offset: int, nbytes: int, dtype: Any, shape: Any
    ) -> tuple[Any, Any]:
        mm = self._maps[memory.data_ptr()]
        base = np.frombuffer(mm, np.uint8, count=nbytes, offset=offset)
        return torch.from_numpy(base).view(dtype).view(tuple(shape)), base

    # streams and events
    def current_stream(self, device: int) -> Any:
        return ("stream", device)

    def new_event(self, device: int) -> tuple[Any, bytes]:
        handle = secrets.token_bytes(64)
        return FakeEvent(handle), handle

    def record(self, event: Any, device: int) -> None:
        event.records += 1

    def open_event(self, device: int, handle: bytes) -> Any:
        self.event_opens += 1
        return FakeEvent(handle)

    def wait_event(self, event: Any, stream: Any) -> None:
        self.waits += 1

    def release_event(self, stream: Any) -> Any:
        self.release_events += 1
        return FakeEvent(gate=self.gate)

    def synchronize(self, event: Any) -> None:
        assert event.gate is not None
        event.gate.wait()
        self.synchronized += 1


def install(ndevices: int = 1) -> FakeCudaBackend:
    backend = FakeCudaBackend(ndevices)
    set_cuda_backend(backend)
    return backend
