"""Calls: many concurrent request -> reply exchanges over one channel.

Theory of operation
-------------------
A :class:`Client` and a server (:func:`serve`) share one :class:`~ringwire.Channel`,
which carries nothing but :class:`~ringwire._wire.envelope.Envelope` records::

    [kind, id, time_left, payload, error]      kind: CALL REPLY ERROR CANCEL

**The id space.**  The client numbers its calls 1, 2, 3, ... (one counter per client;
2**63 calls are never reached) and keeps each call in flight in ``pending`` under its
id.  Replies may come back in any order: one receiver task reads every reply and
resolves the waiter of that id.  A reply for an id no longer pending (the call was
cancelled or timed out) is dropped, which releases its slots; a reply for an id the
client never issued is a protocol violation.  On the server an id is in flight from
the CALL's arrival until its reply is sent; a CALL reusing an id in flight is a
violation, a CANCEL for an id not in flight is ignored (the call finished already).

**Ordering and fairness.**  Calls go out in the order callers ask (a FIFO lock behind
a ``send_nowait`` fast path: nobody overtakes a caller waiting for room in the ring),
the server starts them in arrival order, and replies go out in completion order
through the same kind of lock.

**Backpressure.**  The server admits at most ``concurrency`` running handlers plus
``backlog`` waiting ones.  With that many admitted it stops reading: the ring fills,
and the callers' sends wait for room (or for tensor slots) -- the channel's own
backpressure, with no queue that grows without bound anywhere.

**Cancellation and deadlines.**  A call with ``timeout=`` carries ``time_left``; the
server's deadline is its arrival time plus that.  A caller that is cancelled (an anyio
cancel scope, its own timeout, a client disconnect in an HTTP server) forgets the id
and sends CANCEL (``send_nowait``; if the ring is full, a background task sends it as
soon as there is room).  The server drops a queued call so cancelled and cancels a
running handler's cancel scope (a blocking handler runs on in its thread until it
returns, or until it calls ``anyio.from_thread.check_cancelled()``).  A call whose
deadline passed before a handler was free is refused, and a handler still running
at the deadline is cancelled; both answer ERROR ``DeadlineExceeded``, which the client
raises as :class:`~ringwire.DeadlineExceeded` (a ``TimeoutError``; the caller's own
timer, which fires first, raises ``TimeoutError`` too).

**Workers.**  The server runs handlers in at most ``concurrency`` worker tasks, started
as needed and kept: an idle worker is handed the next call, a busy one takes the next
from the queue when it is done.  Each worker holds one cancel scope around call after
call, and only a cancellation (the client's, or a deadline) spends it -- a task or a
scope per call would cost more than most handlers.

**Errors.**  A handler's exception travels as data, ``[type name, message, details]``
(never pickle, never a traceback) and is raised by the caller as
:class:`~ringwire.RemoteError`.  A dead server fails every pending call at once with
``BrokenResourceError`` (the receiver task sees the hang-up at once).  A malformed
envelope breaks that connection: the side that saw it aborts the channel with the
reason (the peer gets ``BrokenResourceError`` carrying it), fails what was pending
there, and raises :class:`~ringwire.ProtocolError` (server) or fails every call with
``BrokenResourceError`` caused by it (client).  Nothing else in the process is touched.

The states of a call:

============  ===============================  =======================================
side, state   what it is                       leaves by
============  ===============================  =======================================
client        waiting for the send lock or     sent -> *in flight*; cancelled or timed
*sending*     for room / slots in the ring     out -> done (nothing was sent; a CANCEL
                                               follows if it may have been published)
client        id in ``pending``; the caller    REPLY -> returns the payload; ERROR ->
*in flight*   awaits its waiter                raises RemoteError / DeadlineExceeded;
                                               cancelled / timed out -> CANCEL sent,
                                               done; connection lost -> raises
                                               BrokenResourceError (all at once)
server        admitted, waiting for one of     a handler is free -> *running*; CANCEL
*queued*      ``concurrency`` handlers         -> dropped (no reply); deadline passed
                                               -> ERROR DeadlineExceeded when started
server        handler running in a worker      returns -> REPLY; raises -> ERROR;
*running*     task, in its cancel scope        CANCEL -> cancelled, no reply;
                                               deadline -> cancelled, ERROR
                                               DeadlineExceeded
============  ===============================  =======================================
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import math
from typing import Any, Callable, Optional

import anyio
import anyio.abc
import anyio.to_thread
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream, WouldBlock

from .._errors import DecodeError, EncodeError, ProtocolError, SlotsExhausted
from .._wire.envelope import (
    CALL,
    CANCEL,
    DEADLINE_TYPE,
    ERROR,
    KIND_NAMES,
    REPLY,
    Envelope,
    ErrorInfo,
    envelope_type,
    error_info,
    remote_error,
)
from .async_channel import Channel

__all__ = ["DEFAULT_CONCURRENCY", "Client", "serve"]

logger = logging.getLogger("ringwire.calls")

DEFAULT_CONCURRENCY = 32
_BATCH = 256  # replies read at once by the client
_POLL_PEER_S = 0.25  # a full server checks this often that its client still lives


class _Sender:
    """Sends in FIFO order: ``send_nowait`` while nobody waits, else a fair lock."""

    def __init__(self, chan: Channel) -> None:
        self.chan = chan
        self.lock = anyio.Lock(fast_acquire=True)

    async def send(self, env: Envelope, deadline: float | None = None) -> None:
        """Send ``env``; ``TimeoutError`` if it had to wait past ``deadline`` (it may
        have been published nonetheless, at the very end)."""
        if not self.lock.locked():
            try:
                self.chan.send_nowait(env)
                return
            except WouldBlock:
                pass
        if deadline is None:
            async with self.lock:
                await self.chan.send(env)
            return
        with anyio.CancelScope(deadline=deadline):
            async with self.lock:
                await self.chan.send(env)
            return
        raise TimeoutError("no room in the ring before the call's deadline")


def _abort(chan: Any, reason: str) -> ProtocolError:
    """Break the connection over a protocol violation, telling the peer why."""
    chan.abort(reason)
    return ProtocolError(reason)


# -- the client ----------------------------------------------------------------------------


class _Waiter:
    """One call's rendezvous with the receiver.  The reply is kept here, not as a
    future's result: asyncio keeps the future alive (in the wake-up handle) until the
    woken task's step ends, and a reply held that long would keep its slots."""

    __slots__ = ("env", "error", "event", "fut")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.env: Any = None
        self.error: BaseException | None = None
        # asyncio: a bare future (the cheapest wake-up); elsewhere an anyio.Event
        self.fut = loop.create_future() if loop is not None else None
        self.event = anyio.Event() if loop is None else None

    def wake(self) -> None:
        fut = self.fut
        if fut is None:
            assert self.event is not None
            self.event.set()
        elif not fut.done():  # (cancelled: its caller is leaving)
            fut.set_result(None)


class Client:
    """Many concurrent calls over one :class:`~ringwire.Channel`::

        async with ringwire.Client(channel, reply_type=Reply) as client:
            reply = await client.call(request, timeout=5.0)

    Any number of tasks may call at once; each call gets a correlation id, and replies
    are matched to their callers whatever their order.  ``request`` and the reply are
    any values the channel can send (records, arrays and tensors by slot or inline);
    replies are decoded as ``reply_type`` (default: untyped).

    The client owns the channel from ``async with`` on: a background task is its only
    receiver, and leaving the block closes it (calls still pending then raise
    ``ClosedResourceError``).  See :func:`serve` for the other side, and the module
    docstring for ids, cancellation and the states of a call.
    """

    def __init__(self, channel: Channel, *, reply_type: Any = Any) -> None:
        self._chan = channel
        self._env_type = envelope_type(reply_type)
        self._pending: dict[int, _Waiter] = {}
        self._next_id = 1
        self._failure: tuple[type[Exception], str, BaseException | None] | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sender: _Sender | None = None
        self._deferred: collections.deque[int] = collections.deque()
        self._deferred_event: anyio.Event | None = None

    def __repr__(self) -> str:
        state = "open" if self._failure is None else "failed"
        return f"<Client over {self._chan!r}, {len(self._pending)} pending, {state}>"

    @property
    def channel(self) -> Channel:
        """The channel the calls travel over (for ``loan`` and ``statistics``)."""
        return self._chan

    @property
    def pending(self) -> int:
        """Calls sent and not answered yet."""
        return len(self._pending)

    # -- life ---------------------------------------------------------------------------

    async def __aenter__(self) -> Client:
        if self._tg is not None:
            raise RuntimeError("a Client is entered once")
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None  # trio (or another anyio backend): anyio.Event wake-ups
        self._sender = _Sender(self._chan)
        self._deferred_event = anyio.Event()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(self._receive_loop, name="ringwire.Client receiver")
        tg.start_soon(self._cancel_loop, name="ringwire.Client cancels")
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        tg = self._tg
        assert tg is not None
        try:
            self.close()
        finally:
            tg.cancel_scope.cancel()
            # the body's exception is not handed to the task group, which would wrap it
            # in an ExceptionGroup: the background tasks never raise, so it propagates
            await tg.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Close the channel; calls still pending raise ``ClosedResourceError``, and so
        does every later call."""
        self.close()
        await anyio.lowlevel.checkpoint()

    def close(self) -> None:
        """:meth:`aclose` without awaiting (from the event loop's thread)."""
        self._fail(ClosedResourceError, "the client was closed", None)
        self._chan.close()

    # -- calls --------------------------------------------------------------------------

    async def call(self, request: Any, *, timeout: float | None = None) -> Any:
        """Send ``request``, wait for its reply and return it.

        ``timeout`` (seconds) travels with the call as its deadline: the server refuses
        or cancels the work once it has passed.  Raises ``TimeoutError`` when it
        expires here (the server is told to cancel), :class:`RemoteError` if the
        handler raised (:class:`DeadlineExceeded` if the server stopped it at the
        deadline), ``BrokenResourceError`` if the server died or broke the connection
        (every pending call at once), ``ClosedResourceError`` after :meth:`aclose`,
        and what ``Channel.send`` raises for a request that cannot be sent
        (:class:`EncodeError`, :class:`SlotsExhausted`).  Cancelling the caller
        cancels the call on the server."""
        sender = self._sender
        if self._failure is not None:
            raise self._failure_exc()
        if sender is None:
            raise RuntimeError("use the client inside `async with Client(channel) as client:`")
        if timeout is None:
            return await self._call(sender, request, None, None)
        if timeout <= 0:
            raise TimeoutError(f"timeout={timeout!r}: no time to make a call")
        loop = self._loop
        if loop is not None:  # asyncio: a timer, cheaper than a cancel scope
            return await self._call(sender, request, loop.time() + timeout, timeout)
        deadline = anyio.current_time() + timeout
        with anyio.CancelScope(deadline=deadline):
            return await self._call(sender, request, deadline, None)
        raise TimeoutError(f"no reply within {timeout:g} s")

    async def _call(
        self, sender: _Sender, request: Any, deadline: float | None, timer: float | None
    ) -> Any:
        """One call; with ``timer`` (asyncio) it times out at ``deadline`` by itself,
        else the caller's cancel scope does it."""
        cid = self._next_id
        self._next_id = cid + 1
        w = _Waiter(self._loop)
        self._pending[cid] = w
        if deadline is None:
            time_left = None
        else:  # (asyncio's clock is anyio's)
            loop = self._loop
            time_left = deadline - (loop.time() if loop is not None else anyio.current_time())
        sending = True
        handle = None
        try:
            await sender.send(Envelope(CALL, cid, time_left, request), timer and deadline)
            sending = False
            if w.fut is not None:
                if timer is not None:
                    assert self._loop is not None and deadline is not None
                    handle = self._loop.call_at(deadline, self._expire, cid, w, timer)
                await w.fut
            else:
                assert w.event is not None
                await w.event.wait()
        except BaseException as exc:
            self._pending.pop(cid, None)
            answered = w.env is not None or w.error is not None
            if not answered and (
                not sending or isinstance(exc, (TimeoutError, anyio.get_cancelled_exc_class()))
            ):
                # in flight, or stopped while sending (it may have been published)
                self._send_cancel(cid)
            if isinstance(exc, TimeoutError) and sending:
                raise TimeoutError(f"no reply within {timer:g} s") from None
            raise
        finally:
            if handle is not None:
                handle.cancel()
        if w.error is not None:
            raise w.error
        env, w.env = w.env, None
        if env.kind == REPLY:
            return env.payload
        raise remote_error(env.error)

    def _expire(self, cid: int, w: _Waiter, timeout: float) -> None:
        """The timer of call ``cid`` (asyncio): no reply in time."""
        if self._pending.get(cid) is w:
            del self._pending[cid]
            w.error = TimeoutError(f"no reply within {timeout:g} s")
            w.wake()
            self._send_cancel(cid)

    def _send_cancel(self, cid: int) -> None:
        """Tell the server to drop call ``cid``; never waits (a cancelled caller
        cannot), so a full ring defers it to the cancel task."""
        if self._failure is not None:
            return
        try:
            self._chan.send_nowait(Envelope(CANCEL, cid))
        except WouldBlock:
            self._deferred.append(cid)
            if self._deferred_event is not None:
                self._deferred_event.set()
        except Exception:  # the connection is failing: the receiver reports it
            pass

    async def _cancel_loop(self) -> None:
        sender = self._sender
        assert sender is not None
        try:
            while True:
                if not self._deferred:
                    ev = self._deferred_event = anyio.Event()
                    await ev.wait()
                    continue
                await sender.send(Envelope(CANCEL, self._deferred.popleft()))
        except (BrokenResourceError, ClosedResourceError):
            return  # the receiver reports the failure

    # -- the receiver -------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        chan, tp, pending = self._chan, self._env_type, self._pending
        peer = f"the server (pid {chan.peer_pid})"
        try:
            while True:
                # let the callers just woken run before looking (and maybe spinning):
                # the next calls they make are what the server waits for
                await anyio.lowlevel.checkpoint()
                try:
                    envs = chan.receive_many_nowait(_BATCH, type=tp)
                except WouldBlock:
                    envs = await chan.receive_many(_BATCH, type=tp)
                for env in envs:
                    kind = env.kind
                    if kind == REPLY or (kind == ERROR and env.error is not None):
                        w = pending.pop(env.id, None)
                        if w is not None:
                            w.env = env
                            w.wake()
                        elif env.id >= self._next_id:
                            self._violation(f"a {KIND_NAMES[kind]} for call {env.id}, never made")
                    elif kind == ERROR:
                        self._violation(f"an error envelope for call {env.id} without an error")
                    else:
                        self._violation(f"a {KIND_NAMES[kind]} envelope sent to the client")
                    env = w = None  # hold no reply past its hand-over
                del envs
        except EndOfStream:
            self._fail(BrokenResourceError, f"{peer} closed the connection", None)
        except BrokenResourceError as exc:
            self._fail(BrokenResourceError, f"{peer} is gone: {exc}", exc)
        except ClosedResourceError as exc:
            self._fail(ClosedResourceError, "the client's channel was closed", exc)
        except DecodeError as exc:
            err = _abort(
                chan, f"calls: an undecodable reply envelope from pid {chan.peer_pid}: {exc}"
            )
            self._fail(BrokenResourceError, f"connection broken: {err}", err)
        except ProtocolError as exc:
            self._fail(BrokenResourceError, f"connection broken: {exc}", exc)

    def _violation(self, what: str) -> None:
        raise _abort(self._chan, f"calls: pid {self._chan.peer_pid} sent {what}")

    def _fail(self, cls: type[Exception], message: str, cause: BaseException | None) -> None:
        """The connection is over: fail every pending call (and every later one)."""
        if self._failure is None:
            self._failure = (cls, message, cause)
        waiters = list(self._pending.values())
        self._pending.clear()
        for w in waiters:
            if w.env is None and w.error is None:
                w.error = self._failure_exc()
                w.wake()

    def _failure_exc(self) -> Exception:
        assert self._failure is not None
        cls, message, cause = self._failure
        exc = cls(message)
        exc.__cause__ = cause
        return exc


# -- the server ----------------------------------------------------------------------------

_QUEUED, _RUNNING, _DROPPED = 0, 1, 2


class _Job:
    __slots__ = ("cancelled", "deadline", "id", "payload", "received", "state", "worker")

    def __init__(self, cid: int, payload: Any, received: float, deadline: float | None) -> None:
        self.id = cid
        self.payload = payload
        self.received = received
        self.deadline = deadline
        self.state = _QUEUED
        self.cancelled = False  # by the client
        self.worker: _Worker | None = None


class _Worker:
    """One of the server's worker tasks: the call it runs, and the cancel scope around
    its handlers.  The scope serves call after call: only a cancellation spends it (a
    scope per call cost a third of the server's time, and garbage-collector churn)."""

    __slots__ = ("in_handler", "job", "scope", "waiter")

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.scope: anyio.CancelScope | None = None
        self.in_handler = False  # cancelling the scope now reaches job's handler
        self.waiter: _Waiter | None = None


_UNSET: Any = object()


class _Server:
    def __init__(
        self,
        chan: Channel,
        handler: Callable[[Any], Any],
        concurrency: int,
        backlog: int,
        request_type: Any,
        blocking: bool,
    ) -> None:
        self.chan = chan
        self.handler = handler
        self.blocking = blocking
        self.concurrency = concurrency
        self.bound = concurrency + backlog
        self.env_type = envelope_type(request_type)
        self.jobs: dict[int, _Job] = {}  # admitted: queued and running
        self.queue: collections.deque[_Job] = collections.deque()
        self.workers = 0  # worker tasks started (at most concurrency; they stay)
        self.idle: list[_Worker] = []  # idle workers, each waiting to be handed a job
        self.room: anyio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.eof = False
        self.failure: BaseException | None = None
        self.limiter = anyio.CapacityLimiter(concurrency) if blocking else None
        self.sender = _Sender(chan)
        self.tg: anyio.abc.TaskGroup | None = None

    async def run(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        async with anyio.create_task_group() as tg:
            self.tg = tg
            task_status.started()
            try:
                await self.read()
            except Exception as exc:
                self.stop(exc)
            else:
                # end of stream: a client closes only when it wants no more replies, so
                # what still runs for it is cancelled, and what waits is dropped
                self.stop(None)
        if self.failure is not None:
            raise self.failure

    def stop(self, exc: BaseException | None) -> None:
        """End serving: cancel every handler; ``exc`` (if any) is what serve raises."""
        if self.failure is None and exc is not None:
            self.failure = exc
        assert self.tg is not None
        self.tg.cancel_scope.cancel()

    async def read(self) -> None:
        chan, tp = self.chan, self.env_type
        drain = False
        while True:
            room = self.bound - len(self.jobs)
            if room <= 0 and not drain:
                # full: stop reading, so the ring fills and the callers wait; but check
                # now and then that the client still lives (a handler running for a
                # dead one is wasted work)
                ev = self.room = anyio.Event()
                with anyio.move_on_after(_POLL_PEER_S):
                    await ev.wait()
                if ev.is_set() or chan.poll_peer():
                    continue
                drain = True  # gone or closed: read what it sent, then the end
            # let the handlers just handed a call run before looking (and maybe
            # spinning): the reply they send is what the client waits for
            await anyio.lowlevel.checkpoint()
            try:
                try:
                    envs = chan.receive_many_nowait(max(room, 1), type=tp)
                except WouldBlock:
                    envs = await chan.receive_many(max(room, 1), type=tp)
            except EndOfStream:
                self.eof = True
                return
            except DecodeError as exc:
                raise _abort(
                    chan, f"calls: an undecodable call envelope from pid {chan.peer_pid}: {exc}"
                ) from exc
            now = self.now()
            for env in envs:
                self.dispatch(env, now)
                del env
            del envs

    def dispatch(self, env: Any, now: float) -> None:
        kind, cid = env.kind, env.id
        if kind == CALL:
            if cid in self.jobs:
                raise self.violation(f"call id {cid} again while that call is in flight")
            tl = env.time_left
            job = _Job(cid, env.payload, now, None if tl is None else now + tl)
            self.jobs[cid] = job
            if self.idle:  # hand it to an idle worker
                me = self.idle.pop()
                self.take(job, me)
                assert me.waiter is not None
                me.waiter.wake()
            elif self.workers < self.concurrency:
                self.workers += 1
                assert self.tg is not None
                self.tg.start_soon(self.worker, self.take(job, _Worker(job)))
            else:
                self.queue.append(job)
        elif kind == CANCEL:
            victim = self.jobs.get(cid)
            if victim is None:
                return  # finished already (or never seen: a cancel for an unsent call)
            if victim.state == _QUEUED:
                victim.state = _DROPPED
                victim.payload = None
                del self.jobs[cid]
                self.wake_reader()
            else:
                victim.cancelled = True
                runner = victim.worker
                if runner is not None and runner.in_handler and runner.job is victim:
                    assert runner.scope is not None
                    runner.scope.cancel()  # (else it has not started, or it is answering)
        else:
            raise self.violation(f"a {KIND_NAMES[kind]} envelope to the server")

    def violation(self, what: str) -> ProtocolError:
        return _abort(self.chan, f"calls: pid {self.chan.peer_pid} sent {what}")

    def now(self) -> float:
        loop = self.loop
        return loop.time() if loop is not None else anyio.current_time()

    def take(self, job: _Job, me: _Worker) -> _Worker:
        """Worker ``me`` runs ``job`` from now on."""
        job.state = _RUNNING
        job.worker = me
        me.job = job
        return me

    async def worker(self, me: _Worker) -> None:
        """Run calls, the next from the queue as soon as one is answered; when there is
        none, wait to be handed one.  No task per call: starting one costs more than
        most handlers.  Every call but a cancelled one is answered outside the scope."""
        while True:
            out = _UNSET
            with anyio.CancelScope() as scope:
                me.scope = scope
                while True:
                    out = _UNSET
                    out = await self.attempt(me)  # raises if its handler was cancelled
                    if scope.cancel_called:
                        break  # spent (a cancellation that came too late): leave it
                    await self.answer(me.job, out)
                    await self.next_job(me)
            job = me.job
            if out is _UNSET:  # the handler was cancelled: by the client, or its deadline
                out = None if job.cancelled else self.deadline_error(job, started=True)
            await self.answer(job, None if job.cancelled else out)
            await self.next_job(me)

    async def attempt(self, me: _Worker) -> Envelope | None:
        """Run ``me.job``'s handler: the envelope that answers it (``None``: none)."""
        job = me.job
        scope = me.scope
        assert scope is not None
        if job.cancelled:
            return None  # cancelled after it was handed over, before it started
        if job.deadline is not None:
            if self.now() >= job.deadline:
                return self.deadline_error(job, started=False)
            scope.deadline = job.deadline
        payload, job.payload = job.payload, None
        me.in_handler = True
        try:
            if self.blocking:
                result = await anyio.to_thread.run_sync(self.handler, payload, limiter=self.limiter)
            else:
                result = await self.handler(payload)
        except Exception as exc:
            logger.debug("call %d: the handler raised", job.id, exc_info=True)
            return Envelope(ERROR, job.id, None, None, error_info(exc))
        finally:
            me.in_handler = False
            if job.deadline is not None:
                scope.deadline = math.inf
        return Envelope(REPLY, job.id, None, result)

    async def answer(self, job: _Job, out: Envelope | None) -> None:
        try:
            if out is not None:
                await self.reply(out)
        finally:
            del out
            self.jobs.pop(job.id, None)
            self.wake_reader()

    async def next_job(self, me: _Worker) -> None:
        """The next call for worker ``me``: from the queue, or handed over later."""
        queue = self.queue
        while queue and queue[0].state != _QUEUED:
            queue.popleft()  # dropped by a cancel
        if queue:
            self.take(queue.popleft(), me)
            return
        w = me.waiter = _Waiter(self.loop)
        self.idle.append(me)
        if w.fut is not None:
            await w.fut
        else:
            assert w.event is not None
            await w.event.wait()

    def wake_reader(self) -> None:
        ev = self.room
        if ev is not None:
            self.room = None
            ev.set()

    def deadline_error(self, job: _Job, started: bool) -> Envelope:
        now = self.now()
        waited = now - job.received
        if started:
            what = f"the handler was cancelled at the call's deadline, {waited:.3f} s after it came"
        else:
            what = (
                f"refused: its deadline passed while it waited {waited:.3f} s "
                f"for a free handler (concurrency {self.concurrency})"
            )
        return Envelope(
            ERROR, job.id, None, None, ErrorInfo(DEADLINE_TYPE, f"call {job.id}: {what}")
        )

    async def reply(self, env: Envelope) -> None:
        cid, kind, err = env.id, env.kind, env.error
        send = self.sender.send
        try:
            try:
                await send(env)
            except (EncodeError, SlotsExhausted) as exc:
                # nothing was sent: answer with an error the caller can act on
                del env
                if kind == ERROR and err is not None and err.details is not None:
                    note = f" (its details could not be sent: {exc})"
                    info = ErrorInfo(err.type, err.message + note)
                else:
                    e = error_info(exc)
                    info = ErrorInfo(
                        e.type, f"call {cid}: the reply could not be sent: {e.message}"
                    )
                try:
                    await send(Envelope(ERROR, cid, None, None, info))
                except (EncodeError, SlotsExhausted):  # a tiny ring: the bare type name
                    await send(Envelope(ERROR, cid, None, None, ErrorInfo(info.type)))
        except (BrokenResourceError, ClosedResourceError) as exc:
            # the client is gone: a clean end if it had closed, else serve raises
            self.stop(None if self.eof else exc)


def _is_async(handler: Any) -> bool:
    """An ``async def`` function, a partial of one, or an object with ``async def __call__``."""
    if inspect.iscoroutinefunction(handler):
        return True
    return not inspect.isroutine(handler) and inspect.iscoroutinefunction(type(handler).__call__)


async def serve(
    channel: Channel,
    handler: Callable[[Any], Any],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    backlog: Optional[int] = None,
    request_type: Any = Any,
    blocking: Optional[bool] = None,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Answer the calls of a :class:`Client` on ``channel``: ``reply = handler(request)``.

    ``handler`` is an ``async def`` function, or a plain function (``blocking``: by
    default, whether it is not a coroutine function) that runs in a worker thread
    (``anyio.to_thread``, with a limiter of its own).  At most ``concurrency`` handlers
    run at once, and at most ``backlog`` more calls (default: ``concurrency``) wait
    for one; beyond that the server stops reading, so the callers' sends wait (the
    channel's backpressure).  Requests are decoded as ``request_type`` (default:
    untyped).  A handler runs in a cancel scope that is cancelled when its caller
    cancels and at the call's deadline (``anyio.current_effective_deadline()`` tells
    it; a blocking handler sees the cancellation through
    ``anyio.from_thread.check_cancelled()``).  An exception the handler raises goes
    back as :class:`RemoteError` data (its traceback stays here: logger
    ``ringwire.calls``, level DEBUG); a reply that cannot be sent goes back as the
    error that stopped it.

    Returns once the client has closed the connection (a closed client reads no more
    replies, so the handlers still running for it are cancelled).  Raises
    ``BrokenResourceError`` if the client died (its handlers are cancelled),
    :class:`ProtocolError` if it sent a malformed envelope (the connection is aborted
    with the reason), ``ClosedResourceError`` if the channel is closed under it.
    Cancel it to stop serving (running handlers are cancelled).  Does not close
    ``channel``.  With ``anyio.abc.TaskGroup.start`` it reports being ready once it
    reads."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency!r}")
    backlog = concurrency if backlog is None else backlog
    if backlog < 0:
        raise ValueError(f"backlog must be at least 0, not {backlog!r}")
    if not callable(handler):
        raise TypeError(f"handler must be callable, not {type(handler).__name__}")
    if blocking is None:
        blocking = not _is_async(handler)
    server = _Server(channel, handler, concurrency, backlog, request_type, bool(blocking))
    await server.run(task_status)
