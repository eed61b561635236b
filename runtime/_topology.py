"""Declaring a topology: workers, restart policies, the events the supervisor reports."""

from __future__ import annotations

import re
import signal as _signal
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Literal, Union

import ringwire

__all__ = [
    "JoinRefused",
    "Rejoin",
    "RayWorker",
    "RemoteWorker",
    "Restart",
    "RuntimeFailure",
    "TopologyStopping",
    "Worker",
    "WorkerAwaitingRejoin",
    "WorkerEvent",
    "WorkerExit",
    "WorkerGone",
    "WorkerReady",
    "WorkerRestarting",
    "WorkerStartError",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Restart:
    """Restart a worker that exits unexpectedly, after ``backoff * 2**(n-1)`` seconds
    (at most ``max_backoff``) for its n-th restart within ``window`` seconds; a worker
    that needs more than ``max_restarts`` restarts within ``window`` stops the
    topology."""

    max_restarts: int = 5
    window: float = 60.0
    backoff: float = 0.1
    max_backoff: float = 5.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window <= 0 or self.backoff < 0 or self.max_backoff < 0:
            raise ValueError(f"bad restart policy {self!r}")

    def delay(self, n: int) -> float:
        """The backoff before the ``n``-th restart within the window (n >= 1)."""
        return float(min(self.max_backoff, self.backoff * 2 ** max(0, n - 1)))


@dataclass(frozen=True)
class Rejoin:
    """The policy of a :class:`RemoteWorker`: when its connection is lost (the remote
    process died, its host froze, the network broke), wait up to ``within`` seconds
    for a worker of that name to join again -- a new connection, a new incarnation,
    a new channel (:meth:`Topology.wait_channel`) -- else stop the topology.  At most
    ``max_rejoins`` rejoins within ``window`` seconds (then the topology stops)."""

    within: float = 30.0
    max_rejoins: int = 5
    window: float = 60.0

    def __post_init__(self) -> None:
        for what in ("within", "window"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Rejoin({what}=...) must be > 0 seconds, not {value!r}")
        if isinstance(self.max_rejoins, bool) or not isinstance(self.max_rejoins, int):
            raise ValueError(f"Rejoin(max_rejoins=...) must be an int, not {self.max_rejoins!r}")
        if self.max_rejoins < 0:
            raise ValueError(f"Rejoin(max_rejoins=...) must be >= 0, not {self.max_rejoins}")


Policy = Union[Literal["stop"], Restart]


@dataclass(frozen=True)
class Worker:
    """One named worker process of a topology.

    ``entry``
        ``"package.module:function"``: an importable ``async def function(ctx)`` taking a
        :class:`~ringwire.runtime.WorkerContext`.
    ``policy``
        what an unexpected exit (a crash, a kill, or the entry returning on its own)
        does: ``"stop"`` stops the whole topology (the default), a :class:`Restart`
        restarts the worker with backoff.
    ``options``
        a mapping handed to the worker as ``ctx.options`` (anything ringwire can
        encode: numbers, strings, lists, tuples, arrays; no pickle).
    ``slots``
        the worker's send pool (tensor slots it lends to the front); ``None``: no
        pool, everything inline.
    ``ready``
        ``"auto"``: ready once its channel is connected, just before the entry runs;
        ``"explicit"``: ready when the entry calls ``ctx.ready()`` (after loading a
        model, say).
    ``backend`` / ``backend_options``
        the worker's anyio backend (``"asyncio"``, ``"trio"``; ``{"use_uvloop": True}``).
    ``fast_exit``
        once the entry has returned and the channel is closed, run the ``atexit``
        handlers, flush stdio and ``os._exit``: skips the interpreter's teardown
        (half a second with torch loaded), which makes stops and restarts quicker.
    """

    name: str
    entry: str
    policy: Policy = "stop"
    options: Mapping[str, Any] = field(default_factory=dict)
    slots: ringwire.SlotConfig | None = ringwire.DEFAULT_SLOTS
    capacity: int = ringwire.DEFAULT_CAPACITY
    spin_us: float = ringwire.DEFAULT_SPIN_US
    ready: Literal["auto", "explicit"] = "auto"
    backend: str = "asyncio"
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    fast_exit: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(f"worker names are 1-64 of [A-Za-z0-9_.-], not {self.name!r}")
        if not isinstance(self.entry, str) or self.entry.count(":") != 1:
            raise ValueError(f"entry must look like 'package.module:function', not {self.entry!r}")
        if self.policy != "stop" and not isinstance(self.policy, Restart):
            raise ValueError(f"policy must be 'stop' or a Restart, not {self.policy!r}")
        if self.ready not in ("auto", "explicit"):
            raise ValueError(f"ready must be 'auto' or 'explicit', not {self.ready!r}")


@dataclass(frozen=True)
class RemoteWorker:
    """A worker that runs on another machine and *joins* the topology by name over TCP
    (``python -m ringwire.runtime join tcp://front:7100 --name NAME --entry ...``, or
    :func:`ringwire.runtime.join`); the topology must listen (``Topology(listen=...)``).

    The front gets its channel as for a local worker (``topo.channel(name)``).  Its
    death is noticed by liveness -- the connection's hang-up, at once for a killed
    process on a live network, or ``heartbeat`` seconds of silence -- not by a process
    sentinel.  ``policy``: ``"stop"`` (the default) stops the topology when the worker
    is lost; :class:`Rejoin` waits for it to join again.  ``options`` is handed to the
    remote entry as ``ctx.options`` (as for a local worker).  The worker's own
    settings (its entry, send pool, ring capacity, backend) are the joining side's.
    """

    name: str
    policy: Union[Literal["stop"], Rejoin] = "stop"
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(f"worker names are 1-64 of [A-Za-z0-9_.-], not {self.name!r}")
        if self.policy != "stop" and not isinstance(self.policy, Rejoin):
            raise ValueError(
                f"a remote worker's policy must be 'stop' or a Rejoin, not {self.policy!r}"
            )
        if not isinstance(self.options, Mapping):
            raise ValueError(f"options must be a mapping, not {type(self.options).__name__}")


@dataclass(frozen=True)
class RayWorker:
    """A worker that runs as a Ray actor, placed by the Ray cluster the topology
    connects to (``ray.init()``'s address rules, or the one this program already
    initialised; ``pip install 'ringwire[ray]'``).

    The actor runs the same ``async def entry(ctx)`` with the same
    :class:`~ringwire.runtime.WorkerContext`; the front gets ``topo.channel(name)``.
    ``ray_options`` go to Ray as they are (``num_cpus``, ``num_gpus``, ``resources``,
    ``scheduling_strategy``, ``runtime_env``, ...), except Ray's own restarts, which
    stay off (``max_restarts`` / ``max_task_retries`` are refused: ``policy`` decides).
    ``transport``: ``"auto"`` -- shared memory when Ray placed the actor on the
    front's host (the same kernel boot id), ``tcp://`` with CURVE keys the topology
    generates otherwise; ``"tcp"`` forces TCP.  ``policy``: ``"stop"`` stops the
    topology when the actor dies, :class:`Restart` creates a new actor (same
    ``ray_options``: Ray may place it on another node).  ``options``, ``slots``,
    ``capacity``, ``ready``: as for :class:`Worker`.  Raises ``ValueError``.
    """

    name: str
    entry: str
    _: KW_ONLY
    ray_options: Mapping[str, Any] | None = None
    policy: Policy = "stop"
    options: Mapping[str, Any] = field(default_factory=dict)
    transport: Literal["auto", "tcp"] = "auto"
    slots: ringwire.SlotConfig | None = ringwire.DEFAULT_SLOTS
    capacity: int = ringwire.DEFAULT_CAPACITY
    ready: Literal["auto", "explicit"] = "auto"

    def __post_init__(self) -> None:
        check_name(self.name)
        if not isinstance(self.entry, str) or self.entry.count(":") != 1:
            raise ValueError(f"entry must look like 'package.module:function', not {self.entry!r}")
        if self.policy != "stop" and not isinstance(self.policy, Restart):
            raise ValueError(f"policy must be 'stop' or a Restart, not {self.policy!r}")
        if self.transport not in ("auto", "tcp"):
            raise ValueError(f"transport must be 'auto' or 'tcp', not {self.transport!r}")
        if self.ready not in ("auto", "explicit"):
            raise ValueError(f"ready must be 'auto' or 'explicit', not {self.ready!r}")
        if not isinstance(self.options, Mapping):
            raise ValueError(f"options must be a mapping, not {type(self.options).__name__}")
        opts = self.ray_options
        if opts is not None and not isinstance(opts, Mapping):
            raise ValueError(f"ray_options must be a mapping, not {type(opts).__name__}")
        for key in ("max_restarts", "max_task_retries"):
            if opts and opts.get(key):
                raise ValueError(
                    f"ray_options={{{key!r}: {opts[key]!r}}}: Ray's own restarts stay off; "
                    f"give RayWorker(..., policy=Restart(...)) instead"
                )


def check_name(name: object) -> str:
    """``name`` if it is a valid worker name; ``ValueError`` naming it otherwise."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"worker names are 1-64 of [A-Za-z0-9_.-], not {name!r}")
    return name


# -- events ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerReady:
    """A worker process (first start or restart) is connected and ready."""

    name: str
    pid: int
    incarnation: int
    startup_s: float  # from spawn (a remote worker: from its join) to ready
    at: float  # time.monotonic() in the supervising process
    host: str | None = None  # a remote worker's host (None: a local process)

    def describe(self) -> str:
        """This event as one line of text, as the supervisor logs it."""
        again = f" (restart {self.incarnation})" if self.incarnation else ""
        if self.host:
            again = f" (rejoin {self.incarnation})" if self.incarnation else ""
            return (
                f"worker {self.name!r} (pid {self.pid} on {self.host}) joined and ready in "
                f"{self.startup_s:.2f} s{again}"
            )
        return f"worker {self.name!r} (pid {self.pid}) ready in {self.startup_s:.2f} s{again}"


@dataclass(frozen=True)
class WorkerExit:
    """A worker process ended; ``expected`` when the supervisor asked it to."""

    name: str
    pid: int
    incarnation: int
    exitcode: int | None  # the exit status, or None when killed by a signal
    signal: _signal.Signals | None  # the signal that killed it
    expected: bool
    at: float  # time.monotonic() when the supervisor noticed
    uptime_s: float
    error: str | None = None  # the traceback the worker reported, if any
    reason: str | None = None  # why the supervisor killed it (a start timeout, a force stop)
    slots_reclaimed: int = 0  # front slots the worker held, taken back at its death
    slots_in_use_after: int = 0  # front slots still in use on that connection afterwards
    swept: tuple[str, ...] = ()  # /dev/shm names it left behind, removed by the sweep
    host: str | None = None  # a remote worker's host (None: a local process)
    lost: str | None = None  # a remote worker whose connection broke: how
    ray: str | None = None  # a Ray worker: Ray's own view of the actor's end

    @property
    def status(self) -> str:
        if self.lost is not None:
            return f"lost its connection ({self.lost})"
        if self.signal is not None:
            return f"killed by {self.signal.name}"
        return f"exit status {self.exitcode}"

    def describe(self) -> str:
        """This event as one line of text, as the supervisor logs it."""
        how = "stopped" if self.expected else "died"
        where = f" on {self.host}" if self.host else ""
        text = f"worker {self.name!r} (pid {self.pid}{where}) {how}: {self.status}"
        if self.reason:
            text += f" ({self.reason})"
        if self.slots_reclaimed:
            text += f"; {self.slots_reclaimed} slot(s) reclaimed"
        if self.swept:
            text += f"; swept {len(self.swept)} /dev/shm name(s)"
        if self.ray:
            text += f"; Ray: {self.ray}"
        return text


@dataclass(frozen=True)
class WorkerRestarting:
    """The supervisor will restart a worker after ``delay`` seconds."""

    name: str
    attempt: int  # restarts of this worker within the policy window, this one included
    delay: float
    at: float

    def describe(self) -> str:
        """This event as one line of text, as the supervisor logs it."""
        return f"restarting worker {self.name!r} in {self.delay:.2f} s (restart #{self.attempt})"


@dataclass(frozen=True)
class WorkerAwaitingRejoin:
    """A remote worker was lost; the topology waits ``within`` seconds for it to join
    again (its :class:`Rejoin` policy)."""

    name: str
    attempt: int  # rejoins of this worker within the policy window, this one included
    within: float
    at: float

    def describe(self) -> str:
        """This event as one line of text, as the supervisor logs it."""
        return (
            f"waiting up to {self.within:g} s for worker {self.name!r} to rejoin "
            f"(rejoin #{self.attempt})"
        )


@dataclass(frozen=True)
class TopologyStopping:
    """The topology is stopping (``force``: workers are killed, not drained)."""

    reason: str
    force: bool
    at: float

    def describe(self) -> str:
        """This event as one line of text, as the supervisor logs it."""
        return f"stopping{' (forced)' if self.force else ''}: {self.reason}"


WorkerEvent = Union[
    WorkerReady, WorkerExit, WorkerRestarting, WorkerAwaitingRejoin, TopologyStopping
]
"""What a topology reports, in order, to ``Topology(on_event=...)``: one of these
dataclasses; each has ``describe()``, the line the supervisor logs."""


# -- errors ------------------------------------------------------------------------------


class RuntimeFailure(ringwire.RingwireError):
    """Base of the runtime's errors."""


class WorkerStartError(RuntimeFailure):
    """A worker did not become ready (``exit`` says how its process ended)."""

    def __init__(self, message: str, exit: WorkerExit | None = None) -> None:
        super().__init__(message)
        self.exit = exit


class WorkerGone(RuntimeFailure):
    """A worker has no channel and will not get one (stopped, or given up on)."""


class JoinRefused(RuntimeFailure):
    """A worker could not join a topology: no topology listens at the address, the
    name is unknown or already joined, the topology is stopping (the message says
    which, and names the address and the worker)."""
