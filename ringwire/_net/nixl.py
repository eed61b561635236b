"""Large tensors through NIXL on a TCP connection: the process's agent and memory.

When it is used
---------------
Both peers of a ``tcp://`` connection say in the handshake (``Hello.nixl`` /
``Welcome.nixl``) whether they can move tensors through NIXL (``nixl-cu12``
installed, an agent with the UCX backend created in this process, and
``RINGWIRE_NIXL`` not ``0``): :func:`offer` is that statement -- ``""`` (no),
``"DRAM"`` or ``"DRAM,VRAM:<n>"`` (the reads can land in ``n`` CUDA devices).  Only
when both offered does the connection use NIXL (:mod:`.nixlpools`); otherwise every
array travels as a ZeroMQ frame (Ext 20), as before.  Nothing is assumed: a peer
that says nothing (an older ringwire) gets frames.

One agent per process
---------------------
:func:`process` creates the agent lazily, on the first ``tcp://`` connection that
offers NIXL, named ``ringwire-<host>-<pid>-<random>``.  A forked child of a
process that made one gets none (UCX does not survive a fork: a fresh agent there
created fine but its reads hung): its connections offer no NIXL and use frames, and
the parent's agent object is kept, never destroyed, in the child.  A child that is
spawned, or forked before the first ``tcp://`` connection, makes its own.  At exit
every registration is deregistered and the agent dropped.
Agent metadata travels over the connection's own control path: after the
handshake each side sends an ``N`` control message (:class:`Note`: its agent name,
its full metadata, whether it reads through NIXL, the regions it sends from), again
whenever it registers a new region (a GPU pool).  The receiver loads it with
``add_remote_agent`` (a reload updates what it knows of the peer's registrations).

Memory, registered once
-----------------------
An :class:`Arena` is one contiguous buffer registered with the agent once, for the
life of the connection: the sender's *send arena* (its whole budget, from which the
pool carves every buffer and loan: no registration per transfer) and, per CUDA
device it sends from, a GPU arena of the same size; the receiver's *mirror* of each
peer region, of the same size.  A transfer of bytes ``[o, o + n)`` of the peer's
region lands at ``[o, o + n)`` of the mirror: the sender reuses ``[o, o + n)`` only
after the receiver released the array there, which it does only when its last view
of it died -- so the mirror never needs an allocator and never fragments, and a
reference that would land on a live view is a forgery (refused).

Who moves the bytes
-------------------
The receiver READs from the sender's arena into its mirror.  The sender does no
NIXL call per array at all: it copies into its arena (or the user filled a loan
there), and the record carries the transfer list.  The reads are posted and polled
by one *worker thread* per process (:class:`Agent`): UCX may complete a read inside
the post itself (its ``cma`` transport copies within ``postXferReq`` on one host), so
no driver thread -- and no event loop -- ever posts or waits for a transfer; the
worker rings the transport's wake descriptor when a record's transfers are done,
and the existing wait machinery hands it out.

The agent runs without NIXL's own progress thread: NIXL's Python agent starts it
with no delay, a loop of ``sched_yield`` that kept a third to a half of a core busy in
every process with an agent, idle or not (measured here; it slowed every small
record on a 2-vCPU machine).  The worker progresses UCX instead: a read's own polls
progress the reader; and while arrays this process sent through NIXL are out (a peer
may be reading them: UCX over TCP, and the wire-up of any transport, need the
target to progress) it progresses every :data:`SERVE_POLL` seconds, and sleeps when
nothing is out.

Lifetimes
---------
A receiver's mirror and a sender's arena are deregistered when the connection
closes, once no transfer of theirs is in flight.  A sender that closes with arrays
still out keeps its arena registered for :data:`LINGER` seconds (the peer may still
be reading what was sent; the ZeroMQ socket lingers as long); at exit the process
waits for those at most until their linger ends.  The peer's agent is removed when
its last connection in this process is gone.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

__all__ = [
    "LINGER",
    "Agent",
    "Arena",
    "Job",
    "Note",
    "arena_size",
    "offer",
    "process",
    "registrations",
    "why_not",
]

LINGER = 2.0
"""Seconds a closed sender keeps its arena registered for reads still to come."""
SERVE_POLL = 0.0002
"""Seconds between the worker's progress calls while this process's arrays are out."""
CLOSE_PROGRESS = 2.0
"""Seconds the worker progresses UCX after removing a peer agent (its endpoint's
sockets close as UCX progresses)."""
ALIGN = 256  # every buffer of an arena starts at a multiple of this
logger = logging.getLogger("ringwire")


def arena_size(budget: int) -> int:
    """The size of the arena (and of the peer's mirror) for a send budget: the budget
    with room for every buffer's alignment, rounded to a page."""
    n = budget + 64 * ALIGN
    return (n + 4095) // 4096 * 4096


class Note(msgspec.Struct, array_like=True):
    """The body of an ``N`` control message (see the module docstring)."""

    agent: str
    metadata: bytes
    ready: bool  # the sender of the note reads what its peer sends through NIXL
    vram: int  # ... and its reads can land in this many CUDA devices
    regions: list[tuple[int, str, int, int, int]]  # (region, mem, device, address, size)


# -- the arena ---------------------------------------------------------------------------


class Arena:
    """One registered buffer: ``memory`` (a numpy ``uint8`` array, or a CUDA
    ``uint8`` tensor), its address, size, NIXL memory kind and device, and a
    first-fit allocator over it (used by the sender; a mirror never allocates)."""

    def __init__(self, agent: Agent, memory: Any, region: int, mem: str, device: int) -> None:
        self.memory = memory
        self.region = region
        self.mem = mem
        self.device = device
        if mem == "DRAM":
            self.base = int(memory.__array_interface__["data"][0])
            self.size = int(memory.nbytes)
        else:
            self.base = int(memory.data_ptr())
            self.size = int(memory.numel())
        self.end = self.base + self.size
        self._starts = [0]  # free extents, sorted by start
        self._sizes = {0: self.size}
        self._taken: dict[int, int] = {}
        self.inflight = 0  # transfers into / out of it the worker has not finished
        self._agent = agent
        self.reg = agent.register(self)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of ``nbytes`` free bytes (``None``: no extent is large enough)."""
        need = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        for i, start in enumerate(self._starts):
            size = self._sizes[start]
            if size >= need:
                del self._starts[i]
                del self._sizes[start]
                if size > need:
                    bisect.insort(self._starts, start + need)
                    self._sizes[start + need] = size - need
                self._taken[start] = need
                return start
        return None

    def free(self, offset: int) -> None:
        size = self._taken.pop(offset)
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] == offset + size:  # merge the next
            size += self._sizes.pop(self._starts.pop(i))
        if i and self._starts[i - 1] + self._sizes[self._starts[i - 1]] == offset:
            self._sizes[self._starts[i - 1]] += size
        else:
            self._starts.insert(i, offset)
            self._sizes[offset] = size

    def host_view(self, offset: int, nbytes: int) -> np.ndarray[Any, Any]:
        """A root ``uint8`` array over ``[offset, offset + nbytes)`` (its views keep
        it, not the arena, as their base: a finalizer on it sees the last view die)."""
        return np.frombuffer(self.memory.data[offset : offset + nbytes], np.uint8)

    def descriptor(self) -> tuple[int, str, int, int, int]:
        return (self.region, self.mem, self.device, self.base, self.size)


# -- transfers ---------------------------------------------------------------------------


class Job:
    """One READ of ``spans`` (``(local address, remote address, nbytes)``, one memory
    kind per side) from ``peer``; ``done(error)`` is called once from the worker
    thread (``error`` ``None`` on success)."""

    __slots__ = ("peer", "local", "remote", "spans", "done", "handle", "cancelled", "started")

    def __init__(
        self,
        peer: str,
        local: Arena,
        remote: tuple[str, int],
        spans: list[tuple[int, int, int]],
        done: Callable[[str | None], None],
    ) -> None:
        self.peer = peer
        self.local = local
        self.remote = remote  # (mem, device) of the peer's region
        self.spans = spans
        self.done = done
        self.handle: Any = None
        self.cancelled = False
        self.started = 0.0


class Agent:
    """This process's NIXL agent and its worker thread (see the module docstring)."""

    def __init__(self) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)  # not an INFO per agent

        self.pid = os.getpid()
        self.name = f"ringwire-{socket.gethostname()}-{self.pid}-{secrets.token_hex(4)}"
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.nixl = nixl_agent(self.name, config)
        if "UCX" not in self.nixl.backends:
            raise RuntimeError("the UCX backend of NIXL is not available")
        self.lock = threading.RLock()  # every call into the agent
        self._cond = threading.Condition()
        self._new: list[Job] = []
        self._active: list[Job] = []
        self.regions: dict[int, Arena] = {}  # id -> arena registered now
        self._retired: list[tuple[Arena, float]] = []
        self._remotes: dict[str, int] = {}  # peer agent -> connections using it
        self.senders: weakref.WeakSet[Any] = weakref.WeakSet()  # send pools (for exit)
        self._forget: list[str] = []  # peer agents to remove once idle
        self._serving = False  # arrays sent through NIXL may be out: progress for them
        self._served = 0  # serve() calls (a look that found none out is stale after one)
        self._closing_until = 0.0  # a peer agent was removed: progress its endpoint's close
        self.reads = 0
        self.read_bytes = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ringwire-nixl", daemon=True)
        self._thread.start()

    # registrations

    def register(self, arena: Arena) -> Any:
        with self.lock:
            reg = self.nixl.register_memory(
                [(arena.base, arena.size, arena.device, "")], arena.mem, backends=["UCX"]
            )
            self.regions[id(arena)] = arena
        return reg

    def retire(self, arena: Arena, linger: float = 0.0) -> None:
        """Deregister ``arena`` once no transfer uses it and ``linger`` seconds passed."""
        with self._cond:
            self._retired.append((arena, time.monotonic() + linger))
            self._cond.notify()

    def metadata(self) -> bytes:
        with self.lock:
            return bytes(self.nixl.get_agent_metadata())

    def add_remote(self, metadata: bytes, known: bool, name: str) -> str:
        """Load a peer's metadata (its agent name); ``known``: this connection loaded
        it before (a reload after a new registration).  A peer in this process is this
        agent itself: NIXL reads from it as a loopback, nothing to load."""
        if name == self.name:
            return name
        with self.lock:
            name = self.nixl.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            if not known:
                self._remotes[name] = self._remotes.get(name, 0) + 1
                with contextlib.suppress(ValueError):
                    self._forget.remove(name)
        return name

    def drop_remote(self, name: str) -> None:
        if name == self.name:
            return
        with self._cond:
            n = self._remotes.get(name, 0) - 1
            if n > 0:
                self._remotes[name] = n
                return
            self._remotes.pop(name, None)
            self._forget.append(name)
            self._cond.notify()

    # the worker

    def serve(self) -> None:
        """An array went out through NIXL (it is in its pool's ``sent`` already):
        progress UCX until none is out."""
        with self._cond:
            self._served += 1
            if not self._serving:
                self._serving = True
                self._cond.notify()

    def _still_serving(self) -> bool:
        try:
            return any(p.sent and not p.gone for p in list(self.senders))
        except RuntimeError:  # (the set changed under us: look again next time)
            return True

    def submit(self, job: Job) -> None:
        with self._cond:
            job.local.inflight += 1
            self._new.append(job)
            self._cond.notify()

    def _run(self) -> None:
        pause = 0.0
        while True:
            with self._cond:
                while not (self._new or self._active or self._closed) and not (
                    self._retired or self._forget or self._serving
                ):
                    left = self._closing_until - time.monotonic()
                    if left > 0:
                        self._cond.wait(0.005)
                        break
                    self._cond.wait()
                if self._closed and not self._active and not self._new:
                    return
                new, self._new = self._new, []
            try:
                for job in new:
                    self._post(job)
                busy = self._poll()
                if self._retired or self._forget:
                    self._reap()
            except Exception:  # pragma: no cover - a bug here must not stop every read
                logger.exception("ringwire's NIXL worker")
                busy = True
            if busy:
                pause = min(0.001, pause * 2 or 0.00002)
                time.sleep(min(pause, SERVE_POLL) if self._serving else pause)
            else:
                pause = 0.0
                if self._serving and self._still_out():
                    self._progress()  # for the peers reading this process's arrays
                    time.sleep(SERVE_POLL)
                elif time.monotonic() < self._closing_until:  # (then waits 5 ms)
                    self._progress()
                elif self._retired and not self._active and not self._new:
                    time.sleep(0.02)  # a lingering arena: look again soon

    def _still_out(self) -> bool:
        """Are arrays this process sent through NIXL still out?  Clears ``_serving``
        when none is (and none went out while it looked)."""
        with self._cond:
            served = self._served
        if self._still_serving():
            return True
        with self._cond:
            if self._served == served:
                self._serving = False
        return False

    def _progress(self) -> None:
        """Progress UCX (any call into the backend progresses its worker: the
        notifications are not used)."""
        with self.lock, contextlib.suppress(Exception):
            self.nixl.get_new_notifs()

    def _post(self, job: Job) -> None:
        nixl = self.nixl
        try:
            with self.lock:
                local = nixl.get_xfer_descs(
                    [(a, n, job.local.device) for a, _, n in job.spans], job.local.mem
                )
                remote = nixl.get_xfer_descs(
                    [(r, n, job.remote[1]) for _, r, n in job.spans], job.remote[0]
                )
                job.handle = nixl.initialize_xfer("READ", local, remote, job.peer)
            job.started = time.monotonic()
            state = nixl.transfer(job.handle)  # outside the lock: it may copy it all
        except Exception as exc:  # noqa: BLE001 - a refused transfer breaks one connection
            self._finish(job, f"NIXL refused the read: {type(exc).__name__}: {exc}")
            return
        if state == "DONE":
            self._finish(job, None)
        elif state == "ERR":
            self._finish(job, "NIXL reported a failed read")
        else:
            self._active.append(job)

    def _poll(self) -> bool:
        keep = []
        for job in self._active:
            try:
                with self.lock:
                    state = self.nixl.check_xfer_state(job.handle)
            except Exception as exc:  # noqa: BLE001
                self._finish(job, f"NIXL lost the read: {type(exc).__name__}: {exc}")
                continue
            if state == "DONE":
                self._finish(job, None)
            elif state == "ERR":
                self._finish(job, "NIXL reported a failed read (is the peer gone?)")
            elif job.cancelled and self._release(job):
                self._finish(job, "cancelled", released=True)
            else:
                keep.append(job)
        self._active = keep
        return bool(keep)

    def _release(self, job: Job) -> bool:
        if job.handle is None:
            return True
        try:
            with self.lock:
                job.handle.release()
        except Exception:  # noqa: BLE001 - still in progress: try again later
            return False
        job.handle = None
        return True

    def _finish(self, job: Job, error: str | None, released: bool = False) -> None:
        if not released:
            self._release(job)  # a finished request is released at once
        with self._cond:
            job.local.inflight -= 1
        if error is None:
            self.reads += 1
            self.read_bytes += sum(n for _, _, n in job.spans)
        if not job.cancelled:
            with contextlib.suppress(Exception):
                job.done(error)

    def _reap(self, everything: bool = False) -> None:
        now = time.monotonic()
        with self._cond:
            retired, self._retired = self._retired, []
            forget, self._forget = self._forget, []
        keep = []
        for arena, until in retired:
            if arena.inflight > 0 or (now < until and not everything):
                keep.append((arena, until))
                continue
            if self.regions.pop(id(arena), None) is not None:
                with self.lock, contextlib.suppress(Exception):
                    self.nixl.deregister_memory(arena.reg, backends=["UCX"])
        busy = any(job.peer in forget for job in self._active + self._new)
        for name in forget if not busy else []:
            with self.lock, contextlib.suppress(Exception):
                self.nixl.remove_remote_agent(name)
            # UCX closes the endpoint (and its sockets) as it progresses: for a while
            self._closing_until = time.monotonic() + CLOSE_PROGRESS
        with self._cond:
            self._retired.extend(keep)
            if busy:
                self._forget.extend(forget)

    def close(self) -> None:
        """At exit: wait for lingering arenas (at most until their linger ends), then
        deregister everything and stop the worker."""
        with self._cond:
            until = max((u for _, u in self._retired), default=0.0)
        if any(pool.sent and not pool.gone for pool in list(self.senders)):
            until = time.monotonic() + LINGER  # open connections with arrays still out
        deadline = min(until, time.monotonic() + LINGER)
        while time.monotonic() < deadline and (
            self._retired or any(p.sent and not p.gone for p in list(self.senders))
        ):
            time.sleep(0.01)
        with self._cond:
            for job in self._active + self._new:
                job.cancelled = True
            self._closed = True
            self._cond.notify()
        self._thread.join(1.0)
        with self._cond:
            retired = {id(a) for a, _ in self._retired}
        for arena in list(self.regions.values()):
            if id(arena) not in retired:
                self.retire(arena)
        self._reap(everything=True)


_agent: Agent | None = None
_agent_pid = 0
_failed: str | None = None
_lock = threading.Lock()
_orphans: list[Any] = []  # a forked child keeps its parent's agent object, unused


def _disabled() -> str | None:
    if os.environ.get("RINGWIRE_NIXL", "1").strip().lower() in ("0", "no", "off", "false"):
        return "RINGWIRE_NIXL=0"
    return None


def process() -> Agent | None:
    """This process's agent (created on first use); ``None`` when NIXL is not usable
    here (:func:`why_not` says why)."""
    global _agent, _agent_pid, _failed
    pid = os.getpid()
    if _agent is not None and _agent_pid == pid:
        return _agent
    with _lock:
        if _agent is not None and _agent_pid != pid:  # (a fork the hook did not see)
            _orphans.append(_agent)  # the parent's: never destroyed here
            _agent = None
            _failed = "a forked child of a process with a NIXL agent (UCX is not fork-safe)"
        if _agent is None and _failed is None:
            _failed = _disabled()
            if _failed is None:
                try:
                    _agent = Agent()
                    _agent_pid = pid
                    atexit.register(_at_exit, pid)
                except Exception as exc:  # noqa: BLE001 - no NIXL: ZeroMQ frames
                    _failed = f"{type(exc).__name__}: {exc}"
        return _agent


def why_not() -> str | None:
    """Why :func:`process` gave ``None`` (``None`` when it did not)."""
    return _failed if _agent is None or _agent_pid != os.getpid() else None


def _at_exit(pid: int) -> None:
    if _agent is not None and _agent_pid == pid == os.getpid():
        _agent.close()


def offer() -> str:
    """What this process says about NIXL in a handshake (see the module docstring)."""
    if _disabled() is not None:
        return ""
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        return ""
    agent = process()
    if agent is None:
        return ""
    return f"DRAM,VRAM:{_cuda_devices()}" if _cuda_devices() else "DRAM"


def peer_vram(offer_text: str) -> int:
    """How many CUDA devices a peer's offer says its reads can land in."""
    for part in offer_text.split(","):
        if part.startswith("VRAM:") and part[5:].isdigit():
            return int(part[5:])
    return 0


def _cuda_devices() -> int:
    from .._wire.dtypes import torch_loaded, torch_module

    if not torch_loaded():
        return 0
    torch = torch_module()
    try:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def registrations() -> int:
    """How many arenas this process has registered with NIXL now (for tests)."""
    agent = _agent if _agent_pid == os.getpid() else None
    return 0 if agent is None else len(agent.regions)


def _after_fork() -> None:
    global _agent, _failed
    if _agent is not None:  # UCX does not survive a fork: this child uses frames
        _orphans.append(_agent)
        _failed = "a forked child of a process with a NIXL agent (UCX is not fork-safe)"
    _agent = None


os.register_at_fork(after_in_child=_after_fork)
