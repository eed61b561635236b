"""Calls: the sans-IO core that both call drivers share (ids, dispatch, failure).

Theory of operation
-------------------
A client (:class:`~ringwire.Client`, :class:`~ringwire.SyncClient`) and a server
(:func:`~ringwire.serve`, :func:`~ringwire.serve_sync`) share one channel, which
carries nothing but :class:`~ringwire._wire.envelope.Envelope` records::

    [kind, id, time_left, payload, error]      kind: CALL REPLY ERROR CANCEL

This module holds everything about them that is not waiting: :class:`ClientCore` (the
id counter, the pending table, reply dispatch, the deferred cancels, the failure that
ends a client), :class:`ClientBase` (what both clients are: the channel they own, the
envelope type they decode, their core), :class:`ServerBase` (the same of both servers,
and how an undecodable call ends one), and :class:`ServerCore` (the admitted calls, the queue, the workers'
bookkeeping, CALL / CANCEL dispatch, the answers to a deadline or an unsendable
reply), and every error text of the calls.  It does no I/O and never waits: the
drivers (:mod:`~ringwire._conn.calls` with tasks, :mod:`~ringwire._conn.sync_calls`
with threads) receive envelopes, hand them here, and do what the core returns
(wake a caller, start or wake a worker, cancel a handler, abort the channel with a
reason).  Neither core is thread-safe: the blocking drivers hold their lock around
every method.

**The id space.**  The client numbers its calls 1, 2, 3, ... (2**63 calls are never
reached) and keeps each call in flight in ``pending`` under its id.  Replies may come
back in any order: whoever receives hands each to the waiter of its id.  A reply for an
id no longer pending (the call was cancelled or timed out, or a duplicate of one
answered: the two look alike) is dropped, which releases its slots; a reply for an id
the client never issued is a protocol violation.  On the server an id is in flight
from the CALL's arrival until its reply is sent; a CALL reusing an id in flight is a
violation, a CANCEL for an id not in flight is ignored (the call finished already).

**Ordering and fairness.**  Calls go out in the order callers ask (nobody overtakes a
caller waiting for room in the ring), the server starts them in arrival order, and
replies go out in completion order.

**Backpressure.**  The server admits at most ``concurrency`` running handlers plus
``max_queued`` waiting ones.  With that many admitted it stops reading: the ring fills,
and the callers' sends wait for room (or for tensor slots) -- the channel's own
backpressure, with no queue that grows without bound anywhere.  A full server checks
every :data:`POLL_PEER_S` that its client still lives.

**Cancellation and deadlines.**  A call with ``timeout=`` carries ``time_left``; the
server's deadline is its arrival time plus that (no common clock needed).  A caller
that gives up (cancelled, timed out, interrupted) forgets the id and sends CANCEL
without waiting (deferred while the ring is full).  The server drops a queued call so
cancelled and cancels a running handler (a blocking one sees it by polling).  A call
whose deadline passed before a handler was free is refused, and a handler still running
at the deadline is cancelled; both answer ERROR ``DeadlineExceeded``, which the client
raises as :class:`~ringwire.DeadlineExceeded` (a ``TimeoutError``; the caller's own
timer, which fires first, raises ``TimeoutError`` too).

**Errors.**  A handler's exception travels as data, ``[type name, message, details]``
(never pickle, never a traceback) and is raised by the caller as
:class:`~ringwire.RemoteError`.  A reply that cannot be sent is answered with the error
that stopped it.  The end of a connection fails every pending call at once: the server
closed (``BrokenResourceError``), died (``BrokenResourceError`` carrying why), the
client's channel was closed (``ClosedResourceError``).  A malformed envelope breaks that
connection: the side that saw it aborts the channel with the reason (the peer gets
``BrokenResourceError`` carrying it) and raises :class:`~ringwire.ProtocolError`
(server) or fails every call with ``BrokenResourceError`` caused by it (client).

**Tracing and timings.**  A CALL may carry the caller's W3C trace context
(``trace``), and then its answer carries the server's ``[queued, handled]`` seconds
(``timing``: :meth:`ServerCore.timed`, from ``Job.received`` / ``Job.started``).  What
spans that makes, and the client's ``on_timing`` hook that gets ``(queued, wire,
handled)`` per answered call, are :mod:`ringwire._conn.tracing`'s; an untraced call
pays one check in the drivers and nothing here.

The states of a call:

============  ===============================  =======================================
side, state   what it is                       leaves by
============  ===============================  =======================================
client        waiting for its turn to send or  sent -> *in flight*; cancelled or timed
*sending*     for room / slots in the ring     out -> done (nothing was sent; a CANCEL
                                               follows if it may have been published)
client        id in ``pending``; the caller    REPLY -> returns the payload; ERROR ->
*in flight*   waits for its waiter             raises RemoteError / DeadlineExceeded;
                                               gave up -> CANCEL sent, done;
                                               connection lost -> raises
                                               BrokenResourceError (all at once)
server        admitted, waiting for one of     a handler is free -> *running*; CANCEL
*queued*      ``concurrency`` handlers         -> dropped (no reply); deadline passed
                                               -> ERROR DeadlineExceeded when started
server        handler running in a worker      returns -> REPLY; raises -> ERROR;
*running*                                      CANCEL -> cancelled, no reply;
                                               deadline -> cancelled, ERROR
                                               DeadlineExceeded
============  ===============================  =======================================
"""

from __future__ import annotations

import collections
import inspect
import logging
from typing import Any, Callable, Generic, Optional, Protocol, TypeVar

from anyio import BrokenResourceError, ClosedResourceError, EndOfStream

from .._errors import DecodeError, ProtocolError
from .._wire.envelope import (
    CALL,
    CANCEL,
    DEADLINE_TYPE,
    ERROR,
    KIND_NAMES,
    REPLY,
    Envelope,
    ErrorInfo,
    TracedEnvelope,
    envelope_type,
    error_info,
    remote_error,
)
from . import observed

__all__ = [
    "CANCEL_RUNNING",
    "ClientBase",
    "DEFAULT_CONCURRENCY",
    "POLL_PEER_S",
    "START",
    "WAKE",
    "ClientCore",
    "Job",
    "ServerBase",
    "ServerCore",
    "Waiter",
    "Worker",
    "is_async",
    "no_time",
    "outcome",
    "server_limits",
    "timed_out",
]

logger = logging.getLogger("ringwire.calls")

DEFAULT_CONCURRENCY = 32
POLL_PEER_S = 0.25  # a full server checks this often that its client still lives


def no_time(timeout: float) -> TimeoutError:
    """What a call with ``timeout <= 0`` raises (it is not sent)."""
    return TimeoutError(f"timeout={timeout!r}: no time to make a call")


def timed_out(timeout: float) -> TimeoutError:
    """What a call raises when its own ``timeout`` expires."""
    return TimeoutError(f"no reply within {timeout:g} s")


def _a(kind: int) -> str:
    """``a call``, ``a reply``, ``an error``, ``a cancel``."""
    name = KIND_NAMES[kind]
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _violation(peer_pid: int, what: str) -> ProtocolError:
    return ProtocolError(f"calls: pid {peer_pid} sent {what}")


# -- the client ----------------------------------------------------------------------------


class Waiter(Protocol):
    """A caller's rendezvous, made by the driver: the core stores the answer in ``env``
    or the failure in ``error``, then calls ``wake``."""

    env: Any
    error: BaseException | None

    def wake(self) -> None: ...


def outcome(w: Waiter) -> Any:
    """What a caller whose waiter was answered gets: the reply's payload, or the raise
    of its error (:class:`RemoteError`, :class:`DeadlineExceeded`, the failure)."""
    if w.error is not None:
        raise w.error
    env, w.env = w.env, None  # hold no reply (and its slots) past the hand-over
    if env.kind == REPLY:
        return env.payload
    raise remote_error(env.error)


class ClientCore:
    """One client's calls without I/O: ids, the pending table, reply dispatch, the
    cancels waiting for room, and the failure that ends the client.

    A driver registers a call (:meth:`open`), sends its CALL, hands every batch of
    received envelopes to :meth:`dispatch` (and what ended receiving to :meth:`lost`),
    and, for a caller that leaves unanswered, asks :meth:`forget` whether a CANCEL is
    due.  A method that returns a :class:`ProtocolError` has failed every call; the
    driver aborts the channel with ``str()`` of it."""

    __slots__ = ("deferred", "failure", "next_id", "on_timing", "peer_pid", "pending")

    def __init__(self, peer_pid: int) -> None:
        self.peer_pid = peer_pid
        # called with (queued, wire, handled) seconds per answered call whose server
        # reports them; set, calls ask for them (see ringwire._conn.tracing)
        self.on_timing: Callable[[float, float, float], None] | None = None
        self.pending: dict[int, Waiter] = {}
        self.next_id = 1
        self.failure: tuple[type[Exception], str, BaseException | None] | None = None
        self.deferred: collections.deque[int] = collections.deque()  # cancels to send

    def state(self) -> str:
        return f"{len(self.pending)} pending, {'open' if self.failure is None else 'failed'}"

    def open(self, waiter: Waiter) -> int:
        """Register a call: its id.  Raises the client's failure (``BrokenResourceError``,
        ``ClosedResourceError``) once it has one."""
        if self.failure is not None:
            raise self.failure_exc()
        cid = self.next_id
        self.next_id = cid + 1
        self.pending[cid] = waiter
        return cid

    def forget(self, cid: int, waiter: Waiter) -> bool:
        """The caller of call ``cid`` leaves without its answer (cancelled, timed out,
        interrupted, or its send failed).  Whether the server must be told to cancel:
        the call is unanswered and the connection stands."""
        self.pending.pop(cid, None)
        return waiter.env is None and waiter.error is None and self.failure is None

    def expire(self, cid: int, waiter: Waiter, timeout: float) -> bool:
        """Call ``cid``'s own timer fired: fail it with ``TimeoutError`` and wake it
        unless it was answered meanwhile.  Whether a CANCEL is due."""
        if self.pending.get(cid) is not waiter:
            return False
        del self.pending[cid]
        waiter.error = timed_out(timeout)
        waiter.wake()
        return self.failure is None

    def dispatch(self, envs: list[Any]) -> ProtocolError | None:
        """Hand each reply to its caller (``env`` set, ``wake()`` called).  A violation
        (a CALL or CANCEL to the client, an ERROR without error data, a reply for an id
        never issued) fails every call and returns the :class:`ProtocolError`."""
        pending = self.pending
        for env in envs:
            kind = env.kind
            if kind == REPLY or (kind == ERROR and env.error is not None):
                w = pending.pop(env.id, None)
                if w is not None:
                    w.env = env
                    w.wake()
                elif env.id >= self.next_id:
                    return self.violation(f"{_a(kind)} for call {env.id}, never made")
                # else: for a call given up, or a duplicate: dropped (its slots with it)
            elif kind == ERROR:
                return self.violation(f"an error envelope for call {env.id} without an error")
            else:
                return self.violation(f"{_a(kind)} envelope to the client")
        return None

    def violation(self, what: str) -> ProtocolError:
        """The server broke the protocol: every call fails with ``BrokenResourceError``
        caused by the :class:`ProtocolError` returned (the driver aborts with it)."""
        err = _violation(self.peer_pid, what)
        self.fail(BrokenResourceError, f"connection broken: {err}", err)
        return err

    def lost(self, exc: Exception) -> ProtocolError | None:
        """Receiving raised ``exc``: the client is over, and every call fails with what
        that means.  A :class:`ProtocolError` returned: abort the channel with it."""
        peer = f"the server (pid {self.peer_pid})"
        if isinstance(exc, EndOfStream):
            self.fail(BrokenResourceError, f"{peer} closed the connection", None)
        elif isinstance(exc, BrokenResourceError):
            self.fail(BrokenResourceError, f"{peer} is gone: {exc}", exc)
        elif isinstance(exc, ClosedResourceError):
            self.fail(ClosedResourceError, "the client's channel was closed", exc)
        elif isinstance(exc, DecodeError):
            return self.violation(f"an undecodable reply envelope: {exc}")
        elif isinstance(exc, ProtocolError):
            self.fail(BrokenResourceError, f"connection broken: {exc}", exc)
        else:
            what = f"{type(exc).__name__}: {exc}"
            self.fail(BrokenResourceError, f"receiving from {peer} failed: {what}", exc)
        return None

    def close(self) -> None:
        """The client was closed: every pending and later call raises
        ``ClosedResourceError``."""
        self.fail(ClosedResourceError, "the client was closed", None)

    def fail(self, cls: type[Exception], message: str, cause: BaseException | None) -> None:
        """The client is over (the first failure stays): fail and wake every pending
        call; every later one raises it too."""
        if self.failure is None:
            self.failure = (cls, message, cause)
        self.deferred.clear()
        waiters = list(self.pending.values())
        self.pending.clear()
        for w in waiters:
            if w.env is None and w.error is None:
                w.error = self.failure_exc()
                w.wake()

    def failure_exc(self) -> Exception:
        """A new exception for the client's failure (one per caller: each gets its own
        traceback), caused by what caused it."""
        assert self.failure is not None
        cls, message, cause = self.failure
        exc = cls(message)
        exc.__cause__ = cause
        return exc


# -- the server ----------------------------------------------------------------------------

QUEUED, RUNNING, DROPPED = 0, 1, 2
START, WAKE, CANCEL_RUNNING = "start", "wake", "cancel"  # what ServerCore.dispatch asks


class _Peer(Protocol):
    @property
    def peer_pid(self) -> int: ...
    def abort(self, reason: str) -> None: ...


_Chan = TypeVar("_Chan", bound=_Peer)


class ClientBase(Generic[_Chan]):
    """What both call clients are, without waiting: the channel they own (its only
    receiver), the envelope type replies decode as (``type``; ``TypeError`` for one
    msgspec cannot decode), and their :class:`ClientCore`."""

    def __init__(self, channel: _Chan, *, type: Any = Any) -> None:
        self._chan = channel
        self._env_type = envelope_type(type)
        self._core = ClientCore(channel.peer_pid)
        observed.mark(channel, "client")
        # while a metrics exporter records (observed.recording), each call's parts
        self._timed = observed.client_hook(getattr(channel, "name", "") or "")

    def __repr__(self) -> str:
        return f"<{self.__class__.__name__} over {self._chan!r}, {self._core.state()}>"

    @property
    def channel(self) -> _Chan:
        """The channel the calls travel over (for ``loan`` and ``statistics``)."""
        return self._chan

    @property
    def pending(self) -> int:
        """Calls sent and not answered yet."""
        return len(self._core.pending)


class ServerBase(Generic[_Chan]):
    """What both call servers are, without waiting: the channel (they do not own it),
    the handler, their :class:`ServerCore`, the envelope type calls decode as, whether
    the client closed (``eof``) and what serving raises at the end (``failure``)."""

    def __init__(
        self, chan: _Chan, handler: Any, concurrency: int, max_queued: int, type: Any
    ) -> None:
        self.chan = chan
        self.handler = handler
        self.core = ServerCore(concurrency, max_queued, chan.peer_pid)
        observed.mark(chan, "server")
        self.env_type = envelope_type(type)
        self.eof = False
        self.failure: BaseException | None = None

    def undecodable(self, exc: DecodeError) -> ProtocolError:
        """A call envelope that does not decode: the channel is aborted with the reason
        (the client gets ``BrokenResourceError`` carrying it); the error serving raises."""
        err = self.core.undecodable(exc)
        self.chan.abort(str(err))
        return err


class Job:
    """One admitted call."""

    __slots__ = (
        "cancelled",
        "deadline",
        "id",
        "payload",
        "received",
        "started",
        "state",
        "trace",
        "worker",
    )

    def __init__(
        self,
        cid: int,
        payload: Any,
        received: float,
        deadline: float | None,
        trace: list[str] | None = None,
    ) -> None:
        self.id = cid
        self.payload = payload
        self.received = received
        self.deadline = deadline  # on the driver's clock, as ``received``
        self.trace = trace  # the CALL's trace context (not None: answer with timing)
        self.started: float | None = None  # when its handler started (traced calls only)
        self.state = QUEUED
        self.cancelled = False  # by the client
        self.worker: Worker | None = None


class Worker:
    """One of a server's workers (a task, a thread): the call it runs; ``scope`` and
    ``waiter`` are the driver's (how it cancels a handler, how an idle worker waits to
    be handed a call)."""

    __slots__ = ("in_handler", "job", "scope", "waiter")

    def __init__(self, job: Job) -> None:
        self.job = job
        self.scope: Any = None
        self.in_handler = False  # cancelling now reaches job's handler
        self.waiter: Any = None


def server_limits(concurrency: int, max_queued: Optional[int]) -> int:
    """``max_queued`` with its default (``concurrency``); raises ``ValueError`` for a
    ``concurrency`` below 1 or a negative ``max_queued``."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency!r}")
    max_queued = concurrency if max_queued is None else max_queued
    if max_queued < 0:
        raise ValueError(f"max_queued must be at least 0, not {max_queued!r}")
    return max_queued


def is_async(handler: Any) -> bool:
    """An ``async def`` function, a partial of one, or an object with ``async def __call__``."""
    if inspect.iscoroutinefunction(handler):
        return True
    return not inspect.isroutine(handler) and inspect.iscoroutinefunction(type(handler).__call__)


class ServerCore:
    """One server's admitted calls without I/O: the job table, the queue, the workers'
    bookkeeping (at most ``concurrency``, started as needed and kept; the idle ones),
    CALL / CANCEL dispatch, and the answers the server makes itself."""

    __slots__ = ("bound", "concurrency", "idle", "jobs", "peer_pid", "queue", "workers")

    def __init__(self, concurrency: int, max_queued: int, peer_pid: int) -> None:
        self.concurrency = concurrency
        self.bound = concurrency + max_queued
        self.peer_pid = peer_pid
        self.jobs: dict[int, Job] = {}  # admitted: queued and running
        self.queue: collections.deque[Job] = collections.deque()
        self.workers = 0  # workers started (at most concurrency; they stay)
        self.idle: list[Worker] = []  # idle workers, each waiting to be handed a job

    def room(self) -> int:
        """How many more calls may be admitted (read) now."""
        return self.bound - len(self.jobs)

    def dispatch(self, env: Any, now: float) -> tuple[str, Worker] | None:
        """Take one received envelope (``now``: its arrival).  Returns what the driver
        must do: ``(START, w)`` start new worker ``w`` (its job set), ``(WAKE, w)`` wake
        idle worker ``w`` (handed a job), ``(CANCEL_RUNNING, w)`` cancel the handler
        ``w`` runs; ``None``: nothing (queued, dropped, ignored).  Raises
        :class:`ProtocolError` for a violation (abort the channel with it)."""
        kind, cid = env.kind, env.id
        if kind == CALL:
            if cid in self.jobs:
                raise self.violation(f"call id {cid} again while that call is in flight")
            tl = env.time_left
            job = Job(
                cid, env.payload, now, None if tl is None else now + tl, getattr(env, "trace", None)
            )
            self.jobs[cid] = job
            if self.idle:  # hand it to an idle worker
                me = self.idle.pop()
                self.take(job, me)
                return (WAKE, me)
            if self.workers < self.concurrency:
                self.workers += 1
                return (START, self.take(job, Worker(job)))
            self.queue.append(job)
            return None
        if kind == CANCEL:
            victim = self.jobs.get(cid)
            if victim is None:
                return None  # finished already (or never seen: a cancel for an unsent call)
            if victim.state == QUEUED:
                victim.state = DROPPED
                victim.payload = None
                del self.jobs[cid]
                return None
            victim.cancelled = True
            runner = victim.worker
            if runner is not None and runner.in_handler and runner.job is victim:
                return (CANCEL_RUNNING, runner)
            return None  # not started yet, or answering
        raise self.violation(f"{_a(kind)} envelope to the server")

    def violation(self, what: str) -> ProtocolError:
        """The client broke the protocol: the error serve raises (and aborts with)."""
        return _violation(self.peer_pid, what)

    def undecodable(self, exc: DecodeError) -> ProtocolError:
        return self.violation(f"an undecodable call envelope: {exc}")

    def take(self, job: Job, me: Worker) -> Worker:
        """Worker ``me`` runs ``job`` from now on."""
        job.state = RUNNING
        job.worker = me
        me.job = job
        return me

    def next_job(self, me: Worker) -> bool:
        """Hand worker ``me`` the next queued call (True), or make it idle (False: the
        driver waits on ``me.waiter`` until dispatch hands it one)."""
        queue = self.queue
        while queue and queue[0].state != QUEUED:
            queue.popleft()  # dropped by a cancel
        if queue:
            self.take(queue.popleft(), me)
            return True
        self.idle.append(me)
        return False

    def stop(self) -> list[Worker]:
        """Serving ends: every admitted call is cancelled (no reply goes out), the queue
        dropped.  The idle workers, for the driver to wake and end."""
        for job in self.jobs.values():
            job.cancelled = True
        self.queue.clear()
        self.jobs.clear()
        idle, self.idle = self.idle, []
        return idle

    def finish(self, job: Job) -> None:
        """``job`` is answered (or dropped): it leaves the table, making room."""
        self.jobs.pop(job.id, None)

    def refusal(self, job: Job, now: float) -> Envelope | None:
        """The answer to a call whose deadline passed before a handler was free for it,
        or ``None``: run it."""
        if job.deadline is not None and now >= job.deadline:
            return self.deadline_error(job, now, started=False)
        return None

    def deadline_error(self, job: Job, now: float, started: bool) -> Envelope:
        """ERROR ``DeadlineExceeded`` for ``job``: refused, or its handler cancelled."""
        waited = now - job.received
        if started:
            what = f"its handler was still running at its deadline, {waited:.3f} s after it came"
        else:
            what = (
                f"refused: its deadline passed while it waited {waited:.3f} s "
                f"for a free handler (concurrency {self.concurrency})"
            )
        return Envelope(
            ERROR, job.id, None, None, ErrorInfo(DEADLINE_TYPE, f"call {job.id}: {what}")
        )

    @staticmethod
    def timed(job: Job, out: Envelope, now: float) -> Envelope:
        """``out``, the answer to a call that carried ``trace``, with the server's
        ``timing``: ``[queued, handled]`` seconds (a call never started: all queued)."""
        started = now if job.started is None else job.started
        return TracedEnvelope(
            out.kind,
            out.id,
            None,
            out.payload,
            out.error,
            None,
            [max(0.0, started - job.received), max(0.0, now - started)],
        )

    @staticmethod
    def raised(job: Job, exc: BaseException) -> Envelope:
        """The ERROR that answers a handler that raised ``exc`` (its traceback stays
        here: logger ``ringwire.calls``, level DEBUG)."""
        logger.debug("call %d: the handler raised", job.id, exc_info=exc)
        return Envelope(ERROR, job.id, None, None, error_info(exc))

    @staticmethod
    def unsendable(env: Envelope, exc: BaseException) -> Envelope:
        """The ERROR that answers instead of ``env``, which could not be sent
        (``EncodeError``, ``SlotsExhausted``: nothing was sent)."""
        cid, err = env.id, env.error
        if env.kind == ERROR and err is not None and err.details is not None:
            info = ErrorInfo(err.type, f"{err.message} (its details could not be sent: {exc})")
        else:
            e = error_info(exc)
            info = ErrorInfo(e.type, f"call {cid}: the reply could not be sent: {e.message}")
        return Envelope(ERROR, cid, None, None, info)

    @staticmethod
    def bare(env: Envelope) -> Envelope:
        """``env``, an ERROR, cut to its type name (for a ring too small for more)."""
        assert env.error is not None
        return Envelope(ERROR, env.id, None, None, ErrorInfo(env.error.type))
