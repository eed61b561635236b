"""Calls, the async drivers: :class:`Client` and :func:`serve` over one Channel.

What a call is -- the envelope, ids, ordering, backpressure, cancellation, deadlines,
errors and the states of a call -- is the sans-IO core's, :mod:`ringwire._conn.callcore`
(its docstring is the theory of operation); the blocking twins are in
:mod:`ringwire._conn.sync_calls`.  Here is only how tasks wait:

**Sending.**  Calls and replies go out through a :class:`_Sender`: ``send_nowait``
while nobody waits, else a FIFO lock behind which ``send`` waits for room, so nobody
overtakes a caller waiting for room in the ring.

**The client.**  One receiver task reads every reply (in batches) and hands them to
the core, which wakes each caller's :class:`_Waiter` (a bare asyncio future, or an
``anyio.Event`` on other backends).  Under asyncio a call's ``timeout`` is a loop
timer (cheaper than a cancel scope); elsewhere a cancel scope.  A caller that gives
up sends CANCEL with ``send_nowait``; if the ring is full, a background task sends it
as soon as there is room.

**The server.**  A reader task admits calls while there is room (else it waits, and
checks the client still lives every ``POLL_PEER_S``).  Handlers run in at most
``concurrency`` worker tasks, started as needed and kept: an idle worker is handed the
next call, a busy one takes the next from the queue when it is done.  Each worker
holds one cancel scope around call after call, and only a cancellation (the
client's, or a deadline) spends it -- a task or a scope per call would cost more than
most handlers.  A blocking handler runs in a thread (``anyio.to_thread``); the
cancellation reaches it through ``anyio.from_thread.check_cancelled()``.
"""

from __future__ import annotations

import asyncio
import builtins
import math
import sys
from typing import Any, Callable, Optional

import anyio
import anyio.abc
import anyio.to_thread
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream, WouldBlock

from .._errors import DecodeError, EncodeError, ProtocolError, SlotsExhausted
from .._wire.envelope import CALL, CANCEL, REPLY, Envelope
from . import observed, tracing
from .async_channel import Channel
from .callcore import (
    CANCEL_RUNNING,
    DEFAULT_CONCURRENCY,
    POLL_PEER_S,
    START,
    ClientBase,
    Job,
    ServerBase,
    ServerCore,
    Worker,
    is_async,
    no_time,
    outcome,
    server_limits,
    timed_out,
)

__all__ = ["Client", "serve"]

_BATCH = 256  # replies read at once by the client


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


class Client(ClientBase[Channel]):
    """Many concurrent calls over one :class:`~ringwire.Channel`::

        async with ringwire.Client(channel, type=Reply) as client:
            reply = await client.call(request, timeout=5.0)

    Any number of tasks may call at once; each call gets a correlation id, and replies
    are matched to their callers whatever their order.  ``request`` and the reply are
    any values the channel can send (records, arrays and tensors by slot or inline);
    replies are decoded as ``type`` (default: untyped).  Raises ``TypeError`` for a
    ``type`` msgspec cannot decode.

    The client owns the channel from ``async with`` on: a background task is its only
    receiver, and leaving the block closes it (calls still pending then raise
    ``ClosedResourceError``).  See :func:`serve` for the other side, and
    :mod:`ringwire._conn.callcore` for ids, cancellation and the states of a call.
    """

    def __init__(self, channel: Channel, *, type: Any = Any) -> None:
        super().__init__(channel, type=type)
        self._tg: anyio.abc.TaskGroup | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sender: _Sender | None = None
        self._deferred_event: anyio.Event | None = None

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
        self._core.close()
        self._chan.close()

    # -- calls --------------------------------------------------------------------------

    async def call(self, request: Any, *, timeout: float | None = None) -> Any:
        """Send ``request``, wait for its reply and return it.

        ``timeout`` (seconds) travels with the call as its deadline: the server refuses
        or cancels the work once it has passed.  Raises ``TimeoutError`` when it
        expires here (the server is told to cancel), :class:`RemoteError` if the
        handler raised (:class:`DeadlineExceeded`, also a ``TimeoutError``, if the
        server stopped it at the deadline), ``BrokenResourceError`` if the server died
        or broke the connection (every pending call at once), ``ClosedResourceError``
        after :meth:`aclose`, ``RuntimeError`` outside ``async with``, and what
        ``Channel.send`` raises for a request that cannot be sent
        (:class:`EncodeError`, :class:`SlotsExhausted`).  Cancelling the caller
        cancels the call on the server."""
        sender = self._sender
        core = self._core
        if core.failure is not None:
            raise core.failure_exc()
        if sender is None:
            raise RuntimeError("use the client inside `async with Client(channel) as client:`")
        hook = core.on_timing
        if hook is None and observed.recording:
            hook = self._timed  # (metrics: ringwire.metrics is exporting)
        if hook is not None or tracing.OTEL_TRACE in sys.modules:
            tr = tracing.call_trace(tracing.OTEL_TRACE in sys.modules, hook, self._chan.peer_pid)
            if tr is not None:
                with tr:
                    return await self._traced(sender, request, timeout, tr)
        if timeout is None:
            return await self._call(sender, request, None, None)
        if timeout <= 0:
            raise no_time(timeout)
        loop = self._loop
        if loop is not None:  # asyncio: a timer, cheaper than a cancel scope
            return await self._call(sender, request, loop.time() + timeout, timeout)
        deadline = anyio.current_time() + timeout
        with anyio.CancelScope(deadline=deadline):
            return await self._call(sender, request, deadline, None)
        raise timed_out(timeout)

    async def _traced(
        self, sender: _Sender, request: Any, timeout: float | None, tr: tracing.CallTrace
    ) -> Any:
        """:meth:`call` of a traced (or timed) call: ``tr`` makes its CALL."""
        if timeout is None:
            return await self._call(sender, request, None, None, tr)
        if timeout <= 0:
            raise no_time(timeout)
        loop = self._loop
        if loop is not None:
            return await self._call(sender, request, loop.time() + timeout, timeout, tr)
        deadline = anyio.current_time() + timeout
        with anyio.CancelScope(deadline=deadline):
            return await self._call(sender, request, deadline, None, tr)
        raise timed_out(timeout)

    async def _call(
        self,
        sender: _Sender,
        request: Any,
        deadline: float | None,
        timer: float | None,
        tr: tracing.CallTrace | None = None,
    ) -> Any:
        """One call; with ``timer`` (asyncio) it times out at ``deadline`` by itself,
        else the caller's cancel scope does it.  ``tr``: a traced call's trace."""
        core = self._core
        loop = self._loop
        w = _Waiter(loop)
        cid = core.open(w)
        if deadline is None:
            time_left = None
        else:  # (asyncio's clock is anyio's)
            time_left = deadline - (loop.time() if loop is not None else anyio.current_time())
        sending = True
        handle = None
        try:
            env = (
                Envelope(CALL, cid, time_left, request)
                if tr is None
                else tr.envelope(cid, time_left, request)
            )
            await sender.send(env, timer and deadline)
            del env
            sending = False
            if w.fut is not None:
                if timer is not None:
                    assert loop is not None and deadline is not None
                    handle = loop.call_at(deadline, self._expire, cid, w, timer)
                await w.fut
            else:
                assert w.event is not None
                await w.event.wait()
        except BaseException as exc:
            # in flight, or stopped while sending (it may have been published)
            due = core.forget(cid, w)
            if due and (
                not sending or isinstance(exc, (TimeoutError, anyio.get_cancelled_exc_class()))
            ):
                self._send_cancel(cid)
            if isinstance(exc, TimeoutError) and sending and timer is not None:
                raise timed_out(timer) from None  # (no room before the deadline)
            raise
        finally:
            if handle is not None:
                handle.cancel()
        if tr is not None:
            tr.answered(w.env)
        return outcome(w)

    def _expire(self, cid: int, w: _Waiter, timeout: float) -> None:
        """The timer of call ``cid`` (asyncio): no reply in time."""
        if self._core.expire(cid, w, timeout):
            self._send_cancel(cid)

    def _send_cancel(self, cid: int) -> None:
        """Tell the server to drop call ``cid``; never waits (a cancelled caller
        cannot), so a full ring defers it to the cancel task."""
        try:
            self._chan.send_nowait(Envelope(CANCEL, cid))
        except WouldBlock:
            self._core.deferred.append(cid)
            if self._deferred_event is not None:
                self._deferred_event.set()
        except Exception:  # the connection is failing: the receiver reports it
            pass

    async def _cancel_loop(self) -> None:
        sender = self._sender
        deferred = self._core.deferred
        assert sender is not None
        try:
            while True:
                if not deferred:
                    ev = self._deferred_event = anyio.Event()
                    await ev.wait()
                    continue
                await sender.send(Envelope(CANCEL, deferred.popleft()))
        except (BrokenResourceError, ClosedResourceError):
            return  # the receiver reports the failure

    # -- the receiver -------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        chan, tp, core = self._chan, self._env_type, self._core
        try:
            while True:
                # let the callers just woken run before looking (and maybe spinning):
                # the next calls they make are what the server waits for
                await anyio.lowlevel.checkpoint()
                try:
                    envs = chan.receive_many_nowait(_BATCH, type=tp)
                except WouldBlock:
                    envs = await chan.receive_many(_BATCH, type=tp)
                err = core.dispatch(envs)
                del envs  # hold no reply past its hand-over
                if err is not None:
                    chan.abort(str(err))
                    return
        except Exception as exc:  # the end of the connection (or of the channel)
            err = core.lost(exc)
            if err is not None:
                chan.abort(str(err))


# -- the server ----------------------------------------------------------------------------

_UNSET: Any = object()


class _Server(ServerBase[Channel]):
    def __init__(
        self,
        chan: Channel,
        handler: Callable[[Any], Any],
        concurrency: int,
        max_queued: int,
        type: Any,
        blocking: bool,
    ) -> None:
        super().__init__(chan, handler, concurrency, max_queued, type)
        self.blocking = blocking
        self.room: anyio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
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
        chan, tp, core = self.chan, self.env_type, self.core
        dispatch = core.dispatch
        tg = self.tg
        assert tg is not None
        drain = False
        while True:
            room = core.room()
            if room <= 0 and not drain:
                # full: stop reading, so the ring fills and the callers wait; but check
                # now and then that the client still lives (a handler running for a
                # dead one is wasted work)
                ev = self.room = anyio.Event()
                with anyio.move_on_after(POLL_PEER_S):
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
                raise self.undecodable(exc) from exc
            now = self.now()
            try:
                for env in envs:
                    act = dispatch(env, now)
                    if act is not None:
                        verb, me = act
                        if verb is START:
                            tg.start_soon(self.worker, me)
                        elif verb is CANCEL_RUNNING:
                            me.scope.cancel()
                        else:  # WAKE
                            me.waiter.wake()
                    del env
            except ProtocolError as err:
                chan.abort(str(err))
                raise
            del envs

    def now(self) -> float:
        loop = self.loop
        return loop.time() if loop is not None else anyio.current_time()

    async def worker(self, me: Worker) -> None:
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
                out = None if job.cancelled else self.core.deadline_error(job, self.now(), True)
            await self.answer(job, None if job.cancelled else out)
            await self.next_job(me)

    async def attempt(self, me: Worker) -> Envelope | None:
        """Run ``me.job``'s handler: the envelope that answers it (``None``: none)."""
        job = me.job
        scope = me.scope
        if job.cancelled:
            return None  # cancelled after it was handed over, before it started
        if job.deadline is not None:
            refused = self.core.refusal(job, self.now())
            if refused is not None:
                return refused
            scope.deadline = job.deadline
        payload, job.payload = job.payload, None
        if job.trace is not None:
            return await self.attempt_traced(me, payload)
        me.in_handler = True
        try:
            if self.blocking:
                result = await anyio.to_thread.run_sync(self.handler, payload, limiter=self.limiter)
            else:
                result = await self.handler(payload)
        except Exception as exc:
            return self.core.raised(job, exc)
        finally:
            me.in_handler = False
            if job.deadline is not None:
                scope.deadline = math.inf
        return Envelope(REPLY, job.id, None, result)

    async def attempt_traced(self, me: Worker, payload: Any) -> Envelope | None:
        """:meth:`attempt` of a call that carried ``trace``: its handler runs in a
        ``ringwire.serve <type>`` span continuing the caller's context (see
        :mod:`ringwire._conn.tracing`), which ends with the answer."""
        job = me.job
        scope = me.scope
        job.started = now = self.now()
        assert job.trace is not None
        span = tracing.serve_span(job.trace, payload, job.id, now - job.received)
        out: Envelope | None = None
        failure: Exception | None = None
        me.in_handler = True
        try:
            if span is not None:
                span.enter()
            if self.blocking:
                result = await anyio.to_thread.run_sync(self.handler, payload, limiter=self.limiter)
            else:
                result = await self.handler(payload)
            out = Envelope(REPLY, job.id, None, result)
        except Exception as exc:
            out = self.core.raised(job, exc)
            failure = exc
        except BaseException as exc:  # cancelled: by the client, or at the deadline
            if span is not None:
                now = self.now()
                if job.cancelled or job.deadline is None or now < job.deadline:
                    span.end(exc, cancelled=True)  # (or serving ended)
                else:
                    span.answer(self.core.deadline_error(job, now, True))
                span = None
            raise
        finally:
            me.in_handler = False
            if job.deadline is not None:
                scope.deadline = math.inf
            if span is not None:
                span.answer(out, failure)
            del failure
        return out

    async def answer(self, job: Job, out: Envelope | None) -> None:
        if out is not None and job.trace is not None:
            out = ServerCore.timed(job, out, self.now())
        try:
            if out is not None:
                await self.reply(out)
        finally:
            del out
            self.core.finish(job)
            ev = self.room
            if ev is not None:  # wake the reader
                self.room = None
                ev.set()

    async def next_job(self, me: Worker) -> None:
        """The next call for worker ``me``: from the queue, or handed over later."""
        if not self.core.next_job(me):
            w = me.waiter = _Waiter(self.loop)
            if w.fut is not None:
                await w.fut
            else:
                assert w.event is not None
                await w.event.wait()

    async def reply(self, env: Envelope) -> None:
        send = self.sender.send
        try:
            try:
                await send(env)
            except (EncodeError, SlotsExhausted) as exc:
                # nothing was sent: answer with an error the caller can act on
                env = ServerCore.unsendable(env, exc)
                try:
                    await send(env)
                except (EncodeError, SlotsExhausted):  # a tiny ring: the bare type name
                    await send(ServerCore.bare(env))
        except (BrokenResourceError, ClosedResourceError) as exc:
            # the client is gone: a clean end if it had closed, else serve raises
            self.stop(None if self.eof else exc)


async def serve(
    channel: Channel,
    handler: Callable[[Any], Any],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    max_queued: Optional[int] = None,
    type: Any = Any,
    blocking: Optional[bool] = None,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Answer the calls of a :class:`Client` (or :class:`SyncClient`) on ``channel``:
    ``reply = handler(request)``.

    ``handler`` is an ``async def`` function, or a plain function (``blocking``: by
    default, whether it is not a coroutine function) that runs in a worker thread
    (``anyio.to_thread``, with a limiter of its own).  At most ``concurrency`` handlers
    run at once, and at most ``max_queued`` more calls (default: ``concurrency``) wait
    for one; beyond that the server stops reading, so the callers' sends wait (the
    channel's backpressure).  Requests are decoded as ``type`` (default: untyped).  A
    handler runs in a cancel scope that is cancelled when its caller cancels and at the
    call's deadline (``anyio.current_effective_deadline()`` tells it; a blocking handler
    sees the cancellation through ``anyio.from_thread.check_cancelled()``).  An
    exception the handler raises goes back as :class:`RemoteError` data (its traceback
    stays here: logger ``ringwire.calls``, level DEBUG); a reply that cannot be sent
    goes back as the error that stopped it.  :func:`serve_sync` is the blocking twin.

    Returns once the client has closed the connection (a closed client reads no more
    replies, so the handlers still running for it are cancelled).  Raises
    ``BrokenResourceError`` if the client died (its handlers are cancelled),
    :class:`ProtocolError` if it sent a malformed envelope (the connection is aborted
    with the reason), ``ClosedResourceError`` if the channel is closed under it;
    ``ValueError`` for a ``concurrency`` below 1 or a negative ``max_queued``,
    ``TypeError`` for a handler that is not callable or a ``type`` msgspec cannot
    decode.  Cancel it to stop serving (running handlers are cancelled).  Does not
    close ``channel``.  With ``anyio.abc.TaskGroup.start`` it reports being ready once
    it reads."""
    max_queued = server_limits(concurrency, max_queued)
    if not callable(handler):
        raise TypeError(f"handler must be callable, not {builtins.type(handler).__name__}")
    if blocking is None:
        blocking = not is_async(handler)
    server = _Server(channel, handler, concurrency, max_queued, type, bool(blocking))
    await server.run(task_status)
