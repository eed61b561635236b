"""GPU pool blocks and their exports: who may still read a block, and when it can be
reused or freed (Ext 5; the pools themselves are in :mod:`ringwire._pool.cuda`).

A *block* is the GPU memory of one producer's pool for one device.  Each connection
that uses it gets an *export* of its own: a fresh ``cudaIpcGetMemHandle`` announcement
through torch (``UntypedStorage._share_cuda_``), the slots' interprocess events and a
*lease*.  A block is never handed to another connection, nor freed, while anybody may
still read it through an earlier export.

What torch does (``torch/csrc/StorageSharing.cpp``, ``torch/csrc/CudaIPCTypes.cpp``)
--------------------------------------------------------------------------------------
Every ``_share_cuda_`` puts the storage behind a new ``CudaIPCSentData`` whose
reference counter (a word in a shared ref-counter file) starts at 1, wrapping the
previous data pointer (so exports nest).  A storage opened with ``_new_shared_cuda``
has a deleter that synchronizes the opener's stream and subtracts 1.  When the
producer's storage dies, ``CudaIPCSentDataDelete`` frees the block only if the counter
is not above 0; otherwise the block waits in torch's *limbo*, which is looked at again
only at the next sent-data delete, ``torch.cuda.ipc_collect()`` or an out-of-memory
callback.  Nobody decrements for an opener that was killed, that never opened (no
CUDA, failed, never read a reference), or that is this very process (a CUDA IPC handle
cannot be opened by its exporter: the local path never calls ``_new_shared_cuda``).

So this module keeps its own account, and releases the counter itself
(``UntypedStorage._release_ipc_counter_cuda``) when nobody else will:

* **Who maps an export.**  A consumer in another process takes a shared ``flock`` on
  the export's lease (a ``memfd`` of the producer, opened through
  ``/proc/<pid>/fd/<n>``) *before* it opens the pool, and drops it only after its
  mapping -- every view included -- is gone and torch's deleter has run.  The kernel
  drops the lock of a killed process.  A consumer in this process registers its
  mapping object instead (weakly: it dies with the last view).  The producer tests
  the lease with a non-blocking exclusive ``flock``.  Opening the lease needs the
  producer's ``/proc/<pid>`` (one PID namespace, same user -- what ringwire's peer
  checks assume anyway); a consumer that cannot take it refuses the pool with a
  :class:`~ringwire.DecodeError` rather than map memory nobody accounts for.
* **Who can still open it.**  Nobody, once the consumer is gone: end of file on the
  control socket (the producer's :meth:`ShmSendPool.reclaim`), or the consumer's closed
  flag on the release lane (set by :meth:`ShmRecvPool.close`; it still tells after the
  producer itself closed).
* **Retiring.**  When the producer closes the connection, each export is retired:
  if the consumer is gone and nothing maps it, it is *settled* at once -- the counter
  released (a consumer that unmapped cleanly already subtracted; one more makes it
  -1, which torch treats as 0), the events destroyed, the lease closed -- and the
  block goes to the idle list for the next connection of this process (or is freed,
  then ``ipc_collect``).  Otherwise the export *lingers*, memory and events kept, so
  that a consumer still reading records the producer published before closing gets
  them intact (``close`` promises the peer receives what was sent; using an imported
  event after its exporter destroyed it is undefined behaviour, see
  ``cudaIpcOpenEventHandle``).  Lingering exports are settled at the next
  :func:`sweep`: when a CUDA pool is made, a connection with a CUDA pool closes or
  reclaims, a consumer unmaps, and in :func:`drop_idle_pools`.

Known limit: a producer that closed first can no longer see its consumer's socket.
If that consumer then dies without closing -- killed -- and without ever having opened
the pool, nothing tells the producer, and the block stays reserved until the producer
exits (torch's limbo would hold it the same way).  A consumer that closes, or that was
killed after opening the pool, is seen.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
import weakref
from typing import Any

import msgspec

from .._errors import DecodeError, RingwireError

__all__ = [
    "MAX_EXPORTS",
    "Block",
    "Export",
    "Lease",
    "Mapping",
    "drop_idle_pools",
    "lingering_pools",
    "local_export",
    "retire",
    "sweep",
    "take_idle",
    "take_lease",
]

# A block is exported once per connection that uses it; torch nests one sent-data
# record (and one interprocess event) per export until the block is freed.  After this
# many the block is freed instead of kept idle.
MAX_EXPORTS = 64
LEASE_NAME = "ringwire-cuda-lease"
_LEASE = struct.Struct("<II")  # producer pid, descriptor number
_LEASE_TRIES = 500  # x 1 ms: the producer holds its test lock for microseconds


class Block:
    """One device's GPU memory for a producer's pool (reused across connections)."""

    __slots__ = ("backend", "device", "exports", "key", "memory", "nbytes")

    def __init__(self, backend: Any, device: int, nbytes: int, key: tuple[Any, ...]) -> None:
        self.backend = backend
        self.device = device
        self.nbytes = nbytes
        self.key = key
        self.memory: Any = backend.alloc_pool(device, nbytes)
        self.exports = 0


class Lease:
    """The producer's end of an export's lease: a memfd consumers ``flock`` shared."""

    __slots__ = ("descriptor", "fd")

    def __init__(self) -> None:
        memfd_create = getattr(os, "memfd_create", None)
        if memfd_create is None:  # pragma: no cover - CUDA IPC is Linux-only here
            raise RingwireError("CUDA pools need Linux (os.memfd_create)")
        self.fd: int = memfd_create(LEASE_NAME, os.MFD_CLOEXEC)
        self.descriptor = _LEASE.pack(os.getpid(), self.fd)

    def held(self) -> bool:
        """Does a live process hold the lease (map the export)?"""
        if self.fd < 0:
            return False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def take_lease(descriptor: bytes, pid: int) -> int:
    """The consumer's side: open the lease ``descriptor`` names (of producer ``pid``)
    and hold it shared; return the descriptor to close once the mapping is gone."""
    if len(descriptor) != _LEASE.size:
        raise DecodeError(f"malformed CUDA pool lease ({len(descriptor)} bytes)")
    lpid, lfd = _LEASE.unpack(descriptor)
    if lpid != pid:
        raise DecodeError(f"CUDA pool lease of pid {lpid}, but the pool is pid {pid}'s")
    path = f"/proc/{lpid}/fd/{lfd}"
    want = "/memfd:" + LEASE_NAME
    try:
        if not os.readlink(path).startswith(want):
            raise DecodeError(f"{path} is not a ringwire CUDA lease")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise DecodeError(f"cannot take the CUDA pool's lease {path}: {exc}") from exc
    try:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith(want):
            raise DecodeError(f"{path} is not a ringwire CUDA lease")
        for _ in range(_LEASE_TRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                time.sleep(0.001)
        raise DecodeError("the CUDA pool's lease stays locked by its producer")
    except BaseException:
        os.close(fd)
        raise


class Mapping:
    """The consumer's hold on one export: its memory (mapped, or the producer's own
    tensor in this process) and, for another process's export, the lease.  Every view
    of a received tensor keeps it alive; when the last goes, the memory goes first
    (torch's deleter runs: the counter drops), then the lease."""

    __slots__ = ("__weakref__", "_lease", "memory")

    def __init__(self, memory: Any, lease_fd: int = -1) -> None:
        self.memory = memory
        self._lease = lease_fd

    def __del__(self) -> None:
        self.memory = None
        fd, self._lease = self._lease, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


# announcement -> its export, for a consumer in this process (which cannot open the
# IPC handle of its own process)
_LOCAL: weakref.WeakValueDictionary[bytes, Export] = weakref.WeakValueDictionary()


def local_export(announcement: bytes) -> Export | None:
    return _LOCAL.get(announcement)


class Export:
    """One connection's view of a block: announcement, reference counter, events,
    lease, and the mappings of consumers in this process."""

    __slots__ = (
        "__weakref__",
        "announcement",
        "block",
        "events",
        "exported",
        "handles",
        "holders",
        "lease",
        "settled",
    )

    def __init__(self, block: Block, spec: list[list[int]]) -> None:
        backend = block.backend
        lease = Lease()
        try:
            # a fresh reference counter every time (torch.multiprocessing, too, shares
            # once per send): never the counter an earlier consumer already released
            exported = backend.export_pool(block.memory)
        except BaseException:
            lease.close()
            raise
        block.exports += 1
        self.block = block
        self.exported = exported
        self.lease = lease
        self.events: dict[int, tuple[Any, bytes]] = {}  # slot -> (event, IPC handle)
        self.handles: dict[bytes, Any] = {}  # IPC handle -> event (a local consumer's)
        self.holders: weakref.WeakSet[Mapping] = weakref.WeakSet()
        self.settled = False
        # every reference carries the announcement so that the consumer never depends
        # on having read one particular earlier record
        self.announcement = msgspec.msgpack.encode([exported, block.nbytes, spec, os.getpid()])
        _LOCAL[self.announcement] = self

    def event_for(self, slot: int) -> bytes:
        """Record the slot's interprocess event on the current stream; its handle."""
        entry = self.events.get(slot)
        backend = self.block.backend
        if entry is None:
            entry = self.events[slot] = backend.new_event(self.block.device)
            self.handles[entry[1]] = entry[0]
        else:
            backend.record(entry[0], self.block.device)
        return entry[1]

    def local_event(self, handle: bytes) -> Any:
        return self.handles.get(handle)

    def map_locally(self) -> Mapping:
        """A consumer in this process maps the export (it cannot open the handle)."""
        mapping = Mapping(self.block.memory)
        self.holders.add(mapping)
        return mapping

    def in_use(self) -> bool:
        """Does anybody map the export (a consumer here, or a live process)?"""
        return len(self.holders) > 0 or self.lease.held()

    def settle(self) -> None:
        """Nobody maps the export and nobody can open it any more: release its
        reference counter (nobody else will: see the module docstring), destroy its
        events, close the lease."""
        if self.settled:
            return
        self.settled = True
        _LOCAL.pop(self.announcement, None)
        with contextlib.suppress(Exception):  # best effort, as torch's own release
            self.block.backend.release_counter(self.exported)
        self.events.clear()
        self.handles.clear()
        self.lease.close()


# -- retired exports and idle blocks ------------------------------------------------------

# Reentrant: a connection garbage-collected unclosed closes (and retires its exports)
# inside a collection, which may interrupt this very module in the same thread.
_LOCK = threading.RLock()
# blocks nobody can read, kept for the next connection of this process:
# (backend id, device, bytes, slot classes) -> blocks
_IDLE: dict[tuple[Any, ...], list[Block]] = {}
_LINGERING: list[_Retired] = []


class _Retired:
    """An export whose connection the producer closed, until it is settled."""

    __slots__ = ("export", "gone", "lane", "loaned")

    def __init__(self, export: Export, loaned: bool, gone: bool, lane: Any) -> None:
        self.export = export
        self.loaned = loaned  # a loan of the producer's may still write the block
        self.gone = gone
        self.lane = lane  # the release lane, whose closed flag the consumer sets

    def consumer_gone(self) -> bool:
        if self.gone:
            return True
        try:
            self.gone = bool(self.lane.writer_closed)
        except (AttributeError, ValueError):  # no lane, or its views are gone
            self.gone = True
        return self.gone

    def ready(self) -> bool:
        try:
            return self.consumer_gone() and not self.export.in_use()
        except OSError:
            return False

    def finish(self) -> None:
        export = self.export
        export.settle()
        lane, self.lane = self.lane, None
        if lane is not None:
            with contextlib.suppress(ValueError):
                lane.release()
        block = export.block
        if self.loaned or block.exports >= MAX_EXPORTS or block.memory is None:
            _drop(block)
        else:
            with _LOCK:
                _IDLE.setdefault(block.key, []).append(block)


def retire(export: Export, *, loaned: bool, consumer_gone: bool, lane: Any) -> bool:
    """The producer closed the connection of ``export``: settle it now if it can be
    (``True``), or keep it lingering until a :func:`sweep` can.  ``lane``: a reader of
    the connection's release lane (released here), for its closed flag."""
    entry = _Retired(export, loaned, consumer_gone, lane)
    if entry.ready():
        entry.finish()
        return True
    with _LOCK:
        _LINGERING.append(entry)
    return False


def sweep(blocking: bool = True) -> int:
    """Settle the lingering exports that can be; return how many.  ``blocking=False``
    (from code that may run inside garbage collection): skip if another thread is
    sweeping, rather than wait for it."""
    if not _LOCK.acquire(blocking):
        return 0
    ready: list[_Retired] = []
    try:
        for e in list(_LINGERING):
            if e.ready():
                try:
                    _LINGERING.remove(e)  # a nested sweep (see _LOCK) may have taken it
                except ValueError:
                    continue
                ready.append(e)
    finally:
        _LOCK.release()
    for e in ready:
        e.finish()
    return len(ready)


def take_idle(key: tuple[Any, ...]) -> Block | None:
    """An idle block for ``key`` (settled lingering exports first), or ``None``."""
    sweep()
    with _LOCK:
        idle = _IDLE.get(key)
        return idle.pop() if idle else None


def _drop(block: Block) -> None:
    backend = block.backend
    block.memory = None  # freed now: every counter of the block was settled
    with contextlib.suppress(Exception):
        backend.collect()  # torch.cuda.ipc_collect(): limbo blocks whose counter is 0


def drop_idle_pools() -> int:
    """Settle what can be settled, then free the GPU blocks kept for reuse; return how
    many were freed."""
    sweep()
    with _LOCK:
        blocks = [b for v in _IDLE.values() for b in v]
        _IDLE.clear()
    for b in blocks:
        _drop(b)
    return len(blocks)


def lingering_pools() -> int:
    """How many exports wait for their consumer (see :func:`retire`)."""
    with _LOCK:
        return len(_LINGERING)
