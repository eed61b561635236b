"""Calls, the blocking drivers: :class:`SyncClient` and :func:`serve_sync`, with threads.

The same envelope, ids, deadlines and errors as :class:`ringwire.Client` and
:func:`ringwire.serve`: all of it is the sans-IO core's
(:mod:`ringwire._conn.callcore`), and any client talks to any server.  Here is only
how threads wait; each driver holds one lock around every use of its core.

**The client** has no background thread: the calling threads take turns at receiving
(leader / followers).  The first thread that must wait for a reply becomes the
receiver: it reads every reply that arrives, hands each to its caller, wakes every
waiting thread, and gives the role up when its own reply is in; a waiting thread then
takes it over.  A lone caller (a plain script) thus reads its own reply with no thread
hop.  A call that times out sends CANCEL without waiting (``send(timeout=0)``); if the
ring is full or another thread is sending, the cancel goes out before the next call or
after the next batch of replies (best effort).  A blocking caller cannot be cancelled
from outside: ``timeout`` is its bound, and a KeyboardInterrupt still cancels the call
on the server.

**The server** reads on the thread that calls :func:`serve_sync` and runs handlers on
at most ``concurrency`` worker threads, started as needed and kept until it returns:
an idle worker is handed the next call (its own condition variable), a busy one takes
the next from the queue when it is done.  A thread cannot be interrupted, so a
handler learns of its cancellation (its client's CANCEL, its deadline, the end of
serving) by asking :func:`call_cancelled`; whatever a cancelled handler returns is
not sent (a call past its deadline is answered ``DeadlineExceeded``) -- what async
:func:`~ringwire.serve` does for a blocking handler too.
"""

from __future__ import annotations

import builtins
import sys
import threading
import time
from typing import Any, Callable, Optional

from anyio import BrokenResourceError, ClosedResourceError, EndOfStream

from .._errors import DecodeError, EncodeError, ProtocolError, SlotsExhausted
from .._wire.envelope import CALL, CANCEL, ERROR, REPLY, Envelope
from . import observed, tracing
from .callcore import (
    DEFAULT_CONCURRENCY,
    POLL_PEER_S,
    START,
    WAKE,
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
from .sync_channel import SyncChannel

__all__ = ["SyncClient", "call_cancelled", "serve_sync"]

_BATCH = 256


class _Slot:
    """One call's rendezvous: the receiving thread notifies every waiter at once."""

    __slots__ = ("env", "error")

    def __init__(self) -> None:
        self.env: Any = None
        self.error: BaseException | None = None

    def wake(self) -> None:
        pass  # (the condition is notified once per batch)


class SyncClient(ClientBase[SyncChannel]):
    """Blocking calls over one :class:`~ringwire.SyncChannel`, from any number of threads::

        with ringwire.SyncClient(channel, type=Reply) as client:
            reply = client.call(request, timeout=5.0)

    The twin of :class:`ringwire.Client` (the same methods and keywords; either server,
    :func:`ringwire.serve` or :func:`ringwire.serve_sync`, answers both): the same
    envelope, ids, deadlines and errors.  Replies are decoded as ``type`` (default:
    untyped; ``TypeError`` for a type msgspec cannot decode).  The client owns the
    channel: :meth:`close` (or leaving the ``with`` block) closes it, and calls still
    waiting raise ``ClosedResourceError``.
    """

    def __init__(self, channel: SyncChannel, *, type: Any = Any) -> None:
        super().__init__(channel, type=type)
        self._cv = threading.Condition(threading.Lock())
        self._receiving = False

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel; calls still waiting raise ``ClosedResourceError``, and so
        does every later call."""
        with self._cv:
            self._core.close()
            self._cv.notify_all()
        self._chan.close()

    # -- calls --------------------------------------------------------------------------

    def call(self, request: Any, *, timeout: float | None = None) -> Any:
        """Send ``request``, block until its reply and return it.

        Raises what :meth:`ringwire.Client.call` raises: ``TimeoutError`` after
        ``timeout`` seconds (the server is told to cancel), :class:`RemoteError` /
        :class:`DeadlineExceeded`, ``BrokenResourceError`` (every waiting call at once
        when the server dies), ``ClosedResourceError`` after :meth:`close`, and what
        ``SyncChannel.send`` raises for a request that cannot be sent."""
        core = self._core
        tr = None  # a traced (or timed) call's trace; its span ends with the call
        hook = core.on_timing
        if hook is None and observed.recording:
            hook = self._timed  # (metrics: ringwire.metrics is exporting)
        if hook is not None or tracing.OTEL_TRACE in sys.modules:
            tr = tracing.call_trace(tracing.OTEL_TRACE in sys.modules, hook, self._chan.peer_pid)
        try:
            if timeout is not None and timeout <= 0:
                raise no_time(timeout)
            deadline = None if timeout is None else time.monotonic() + timeout
            cv, core = self._cv, self._core
            slot = _Slot()
            with cv:
                cid = core.open(slot)
            if core.deferred:
                self._flush_cancels()
            left = None if deadline is None else deadline - time.monotonic()
            try:
                env = (
                    Envelope(CALL, cid, left, request)
                    if tr is None
                    else tr.envelope(cid, left, request)
                )
                self._chan.send(env, left)
                del env
            except Exception as exc:  # not sent (a timeout included)
                with cv:
                    core.forget(cid, slot)
                if isinstance(exc, TimeoutError) and timeout is not None:
                    raise timed_out(timeout) from None  # (no room before the deadline)
                raise
            except BaseException:  # KeyboardInterrupt: it may have been sent
                self._abandon(cid, slot)
                raise
            try:
                with cv:
                    while slot.env is None and slot.error is None:
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            if core.forget(cid, slot):
                                core.deferred.append(cid)
                            break
                        if self._receiving:
                            cv.wait(left)
                        else:
                            self._receive(left)
            except BaseException:
                self._abandon(cid, slot)
                raise
            if slot.env is None and slot.error is None:
                assert timeout is not None
                self._flush_cancels()
                raise timed_out(timeout)
            if tr is not None:
                tr.answered(slot.env)
                reply = outcome(slot)  # (a RemoteError raised: recorded below)
                tr.end(None)
                return reply
            return outcome(slot)
        except BaseException as exc:
            if tr is not None:
                tr.end(exc)
            raise

    def _abandon(self, cid: int, slot: _Slot) -> None:
        with self._cv:
            if not self._core.forget(cid, slot):
                return  # answered (or failed) meanwhile
            self._core.deferred.append(cid)
        self._flush_cancels()

    def _flush_cancels(self) -> None:
        """Send the deferred cancels that go out without waiting."""
        deferred = self._core.deferred
        while deferred:
            try:
                cid = deferred.popleft()
            except IndexError:
                return
            try:
                self._chan.send(Envelope(CANCEL, cid), 0)
            except TimeoutError:  # the ring is full, or another thread is sending
                deferred.appendleft(cid)
                return
            except Exception:  # the connection is failing: the receiver reports it
                deferred.clear()
                return

    # -- receiving (one thread at a time, holding the role) --------------------------

    def _receive(self, left: float | None) -> None:
        """Called with the condition held: read replies (releasing it meanwhile) and
        hand them out; wakes every waiting thread when done."""
        cv, chan, core = self._cv, self._chan, self._core
        envs: list[Any] = []
        lost: Exception | None = None
        self._receiving = True
        cv.release()
        try:
            try:
                envs = chan.receive_many(_BATCH, left, type=self._env_type)
            except TimeoutError:
                pass
            except Exception as exc:  # the end of the connection (or of the channel)
                lost = exc
        finally:
            cv.acquire()
            self._receiving = False
            cv.notify_all()
        err = core.dispatch(envs) if lost is None else core.lost(lost)
        del envs, lost
        if err is None and not core.deferred:
            return
        cv.release()  # (aborting takes the channel's locks: a sender may hold one)
        try:
            if err is not None:
                chan.abort(str(err))
            self._flush_cancels()
        finally:
            cv.acquire()


# -- the server ----------------------------------------------------------------------------

_running = threading.local()  # .job: the call a serve_sync worker thread runs


def call_cancelled() -> bool:
    """In a handler that :func:`serve_sync` runs: whether its call is cancelled -- its
    client gave up, its deadline passed, or serving ended.  A long handler asks now
    and then, and returns (or raises) early: what it answers is not sent (a call past
    its deadline is answered ``DeadlineExceeded``).  Raises ``RuntimeError`` in any
    other thread (a blocking handler of async :func:`serve` asks
    ``anyio.from_thread.check_cancelled()``)."""
    job: Job | None = getattr(_running, "job", None)
    if job is None:
        raise RuntimeError(
            "call_cancelled() is asked in a handler that serve_sync runs "
            "(under serve, use anyio.from_thread.check_cancelled())"
        )
    return job.cancelled or (job.deadline is not None and time.monotonic() >= job.deadline)


class _SyncServer(ServerBase[SyncChannel]):
    def __init__(
        self,
        chan: SyncChannel,
        handler: Callable[[Any], Any],
        concurrency: int,
        max_queued: int,
        type: Any,
    ) -> None:
        super().__init__(chan, handler, concurrency, max_queued, type)
        self.lock = threading.Lock()
        self.room = threading.Condition(self.lock)  # the reader waits here when full
        self.threads: list[threading.Thread] = []
        self.stopping = False

    def run(self) -> None:
        try:
            self.read()
        finally:
            with self.lock:
                self.stopping = True
                for me in self.core.stop():
                    me.waiter.notify()
            for t in self.threads:
                t.join()
        if self.failure is not None:
            raise self.failure

    def fail(self, exc: BaseException | None) -> None:
        """A worker ends serving: ``exc`` (if any) is what serve_sync raises."""
        with self.lock:
            if self.failure is None and exc is not None:
                self.failure = exc
            self.stopping = True
            self.room.notify()

    def read(self) -> None:
        chan, tp, core, lock = self.chan, self.env_type, self.core, self.lock
        drain = False
        while True:
            with lock:
                if self.stopping:
                    return
                room = core.room()
                full = room <= 0 and not drain
                if full:
                    # stop reading, so the ring fills and the callers wait; but check
                    # now and then that the client still lives
                    self.room.wait(POLL_PEER_S)
                    if self.stopping:
                        return
                    room = core.room()
                    full = room <= 0
            if full:
                if not chan.poll_peer():
                    drain = True  # gone or closed: read what it sent, then the end
                continue
            try:
                envs = chan.receive_many(max(room, 1), POLL_PEER_S, type=tp)
            except TimeoutError:
                continue  # (a look at self.stopping)
            except EndOfStream:
                self.eof = True
                return
            except DecodeError as exc:
                raise self.undecodable(exc) from exc
            now = time.monotonic()
            bad = None
            with lock:
                try:
                    for env in envs:
                        act = core.dispatch(env, now)
                        if act is not None:
                            verb, me = act
                            if verb is START:
                                self.start(me)
                            elif verb is WAKE:
                                me.waiter.notify()
                            # CANCEL_RUNNING: the flag is set; call_cancelled() says so
                except ProtocolError as err:
                    bad = err
            del envs
            if bad is not None:
                chan.abort(str(bad))
                raise bad

    def start(self, me: Worker) -> None:
        me.waiter = threading.Condition(self.lock)
        n = len(self.threads) + 1
        t = threading.Thread(
            target=self.worker, args=(me,), name=f"ringwire.serve_sync worker {n}", daemon=True
        )
        self.threads.append(t)
        t.start()

    def worker(self, me: Worker) -> None:
        """Run calls, the next from the queue as soon as one is answered; when there is
        none, wait to be handed one."""
        lock, core = self.lock, self.core
        try:
            while True:
                job = me.job
                out = self.attempt(job)
                if out is not None:
                    self.reply(out)
                del out
                with lock:
                    core.finish(job)
                    self.room.notify()
                    if self.stopping:
                        return
                    if not core.next_job(me):
                        while me.job is job and not self.stopping:
                            me.waiter.wait()
                        if self.stopping:
                            return
        except BaseException as exc:  # (a handler's KeyboardInterrupt, SystemExit)
            self.fail(exc)

    def attempt(self, job: Job) -> Envelope | None:
        """Run ``job``'s handler: the envelope that answers it (``None``: none)."""
        if job.cancelled:
            return None  # cancelled after it was handed over, before it started
        core = self.core
        if job.deadline is not None:
            refused = core.refusal(job, time.monotonic())
            if refused is not None:
                return refused
        payload, job.payload = job.payload, None
        span = None
        if job.trace is not None:
            job.started = now = time.monotonic()
            span = tracing.serve_span(job.trace, payload, job.id, now - job.received)
            if span is not None:
                span.enter()
        _running.job = job
        out: Envelope | None = None
        failure: Exception | None = None
        try:
            out = Envelope(REPLY, job.id, None, self.handler(payload))
        except Exception as exc:
            out = core.raised(job, exc)
            failure = exc
        finally:
            _running.job = None
            del payload
            if span is not None and out is None:  # (a KeyboardInterrupt, SystemExit)
                span.end(None, cancelled=True)
                span = None
        if job.cancelled:
            out = None
        elif job.deadline is not None:
            now = time.monotonic()
            if now >= job.deadline:
                out = core.deadline_error(job, now, started=True)
        if span is not None:
            span.answer(out, failure if out is not None and out.kind == ERROR else None)
        del failure
        if out is not None and job.trace is not None:
            out = ServerCore.timed(job, out, time.monotonic())
        return out

    def reply(self, env: Envelope) -> None:
        send = self.chan.send
        try:
            try:
                send(env)
            except (EncodeError, SlotsExhausted) as exc:
                # nothing was sent: answer with an error the caller can act on
                env = ServerCore.unsendable(env, exc)
                try:
                    send(env)
                except (EncodeError, SlotsExhausted):  # a tiny ring: the bare type name
                    send(ServerCore.bare(env))
        except (BrokenResourceError, ClosedResourceError) as exc:
            # the client is gone: a clean end if it had closed, else serve_sync raises
            self.fail(None if self.eof else exc)


def serve_sync(
    channel: SyncChannel,
    handler: Callable[[Any], Any],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    max_queued: Optional[int] = None,
    type: Any = Any,
) -> None:
    """Answer the calls of a :class:`SyncClient` (or :class:`Client`) on ``channel``:
    ``reply = handler(request)``, each handler on a worker thread -- the blocking twin
    of :func:`serve`, for thread-based servers.

    At most ``concurrency`` handlers run at once (worker threads, started as needed),
    and at most ``max_queued`` more calls (default: ``concurrency``) wait for one;
    beyond that the server stops reading, so the callers' sends wait (the channel's
    backpressure).  Requests are decoded as ``type`` (default: untyped).  A handler
    cannot be interrupted: it asks :func:`call_cancelled` whether its caller gave up,
    its deadline passed or serving ended; the answer of a cancelled call is not sent,
    and a call past its deadline is answered :class:`DeadlineExceeded` (refused before
    it starts if a handler was free too late).  An exception the handler raises goes
    back as :class:`RemoteError` data (its traceback stays here: logger
    ``ringwire.calls``, level DEBUG); a reply that cannot be sent goes back as the
    error that stopped it.

    Blocks the calling thread, and returns once the client has closed the connection
    and every handler has returned (the calls still running are cancelled).  Raises
    ``BrokenResourceError`` if the client died, :class:`ProtocolError` if it sent a
    malformed envelope (the connection is aborted with the reason),
    ``ClosedResourceError`` if the channel is closed under it (that is how another
    thread stops it); ``ValueError`` for a ``concurrency`` below 1 or a negative
    ``max_queued``, ``TypeError`` for a handler that is not callable or is ``async``
    (serve that one with :func:`serve`), or a ``type`` msgspec cannot decode.  Does
    not close ``channel``."""
    max_queued = server_limits(concurrency, max_queued)
    if not callable(handler):
        raise TypeError(f"handler must be callable, not {builtins.type(handler).__name__}")
    if is_async(handler):
        raise TypeError(
            f"serve_sync runs handlers on threads, and {handler!r} is async: "
            "serve it with ringwire.serve"
        )
    _SyncServer(channel, handler, concurrency, max_queued, type).run()
