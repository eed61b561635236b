"""The blocking client: :class:`SyncClient`, many threads' calls over one SyncChannel.

The same envelope, ids and errors as :class:`ringwire.Client` (see
:mod:`ringwire._conn.calls`), without a background thread: the calling threads take
turns at receiving (leader / followers).  The first thread that must wait for a reply
becomes the receiver: it reads every reply that arrives, hands each to its caller and
wakes it, and gives the role up when its own reply is in; a waiting thread then takes
it over.  A lone caller (a plain script) thus reads its own reply with no thread hop.

A call that times out sends CANCEL without waiting (``send(timeout=0)``); if the ring
is full or another thread is sending, the cancel goes out before the next call or
after the next batch of replies (best effort).  A blocking caller cannot be cancelled
from outside: ``timeout`` is its bound, and a KeyboardInterrupt still cancels the call
on the server.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from anyio import BrokenResourceError, ClosedResourceError, EndOfStream

from .._errors import DecodeError, ProtocolError
from .._wire.envelope import (
    CALL,
    CANCEL,
    ERROR,
    KIND_NAMES,
    REPLY,
    Envelope,
    envelope_type,
    remote_error,
)
from .sync_channel import SyncChannel

__all__ = ["SyncClient"]

_BATCH = 256


class _Slot:
    __slots__ = ("env", "error")

    def __init__(self) -> None:
        self.env: Any = None
        self.error: BaseException | None = None


class SyncClient:
    """Blocking calls over one :class:`~ringwire.SyncChannel`, from any number of threads::

        with ringwire.SyncClient(channel, reply_type=Reply) as client:
            reply = client.call(request, timeout=5.0)

    The twin of :class:`ringwire.Client` (the same server, :func:`ringwire.serve`,
    answers both): the same envelope, ids, deadlines and errors.  The client owns the
    channel: :meth:`close` (or leaving the ``with`` block) closes it, and calls still
    waiting raise ``ClosedResourceError``.
    """

    def __init__(self, channel: SyncChannel, *, reply_type: Any = Any) -> None:
        self._chan = channel
        self._env_type = envelope_type(reply_type)
        self._cv = threading.Condition(threading.Lock())
        self._pending: dict[int, _Slot] = {}
        self._next_id = 1
        self._receiving = False
        self._failure: tuple[type[Exception], str, BaseException | None] | None = None
        self._deferred: collections.deque[int] = collections.deque()

    def __repr__(self) -> str:
        state = "open" if self._failure is None else "failed"
        return f"<SyncClient over {self._chan!r}, {len(self._pending)} pending, {state}>"

    @property
    def channel(self) -> SyncChannel:
        """The channel the calls travel over (for ``loan`` and ``statistics``)."""
        return self._chan

    @property
    def pending(self) -> int:
        """Calls sent and not answered yet."""
        return len(self._pending)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel; calls still waiting raise ``ClosedResourceError``, and so
        does every later call."""
        with self._cv:
            self._fail(ClosedResourceError, "the client was closed", None)
        self._chan.close()

    # -- calls --------------------------------------------------------------------------

    def call(self, request: Any, *, timeout: float | None = None) -> Any:
        """Send ``request``, block until its reply and return it.

        Raises what :meth:`ringwire.Client.call` raises: ``TimeoutError`` after
        ``timeout`` seconds (the server is told to cancel), :class:`RemoteError` /
        :class:`DeadlineExceeded`, ``BrokenResourceError`` (every waiting call at once
        when the server dies), ``ClosedResourceError`` after :meth:`close`, and what
        ``SyncChannel.send`` raises for a request that cannot be sent."""
        if timeout is not None and timeout <= 0:
            raise TimeoutError(f"timeout={timeout!r}: no time to make a call")
        deadline = None if timeout is None else time.monotonic() + timeout
        cv = self._cv
        with cv:
            if self._failure is not None:
                raise self._failure_exc()
            cid = self._next_id
            self._next_id = cid + 1
            slot = self._pending[cid] = _Slot()
        self._flush_cancels()
        left = None if deadline is None else deadline - time.monotonic()
        try:
            self._chan.send(Envelope(CALL, cid, left, request), left)
        except Exception:  # not sent (a timeout included)
            with cv:
                self._pending.pop(cid, None)
            raise
        except BaseException:  # KeyboardInterrupt: it may have been sent
            self._abandon(cid)
            raise
        try:
            with cv:
                while slot.env is None and slot.error is None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    if self._receiving:
                        cv.wait(left)
                    else:
                        self._receive(left)
        except BaseException:
            self._abandon(cid)
            raise
        if slot.error is not None:
            raise slot.error
        env = slot.env
        if env is None:
            self._abandon(cid)
            raise TimeoutError(f"no reply within {timeout:g} s")
        if env.kind == REPLY:
            return env.payload
        raise remote_error(env.error)

    def _abandon(self, cid: int) -> None:
        with self._cv:
            slot = self._pending.pop(cid, None)
            if slot is None or self._failure is not None:
                return  # answered (or failed) meanwhile
            self._deferred.append(cid)
        self._flush_cancels()

    def _flush_cancels(self) -> None:
        """Send the deferred cancels that go out without waiting."""
        deferred = self._deferred
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
        cv, chan = self._cv, self._chan
        peer = f"the server (pid {chan.peer_pid})"
        failure: tuple[type[Exception], str, BaseException | None] | None = None
        envs: list[Any] = []
        self._receiving = True
        cv.release()
        try:
            try:
                envs = chan.receive_many(_BATCH, left, type=self._env_type)
            except TimeoutError:
                pass
            except EndOfStream:
                failure = (BrokenResourceError, f"{peer} closed the connection", None)
            except BrokenResourceError as exc:
                failure = (BrokenResourceError, f"{peer} is gone: {exc}", exc)
            except ClosedResourceError as exc:
                failure = (ClosedResourceError, "the client's channel was closed", exc)
            except DecodeError as exc:
                failure = self._violation(f"an undecodable reply envelope ({exc})")
        finally:
            cv.acquire()
            self._receiving = False
            cv.notify_all()
        pending = self._pending
        for env in envs:
            kind = env.kind
            if kind == REPLY or (kind == ERROR and env.error is not None):
                slot = pending.pop(env.id, None)
                if slot is not None:
                    slot.env = env
                elif env.id >= self._next_id:
                    failure = self._violation(f"a {KIND_NAMES[kind]} for call {env.id}, never made")
                    break
            else:
                failure = self._violation(f"a {KIND_NAMES[kind]} envelope to the client")
                break
        del envs
        if failure is not None:
            self._fail(*failure)
        if self._deferred:
            cv.release()
            try:
                self._flush_cancels()
            finally:
                cv.acquire()

    def _violation(self, what: str) -> tuple[type[Exception], str, BaseException]:
        """Abort the connection over a malformed envelope; the failure it means."""
        reason = f"calls: pid {self._chan.peer_pid} sent {what}"
        self._chan.abort(reason)
        err = ProtocolError(reason)
        return (BrokenResourceError, f"connection broken: {reason}", err)

    def _fail(self, cls: type[Exception], message: str, cause: BaseException | None) -> None:
        """With the condition held: fail every waiting call, and every later one."""
        if self._failure is None:
            self._failure = (cls, message, cause)
        for slot in self._pending.values():
            if slot.env is None and slot.error is None:
                slot.error = self._failure_exc()
        self._pending.clear()
        self._cv.notify_all()

    def _failure_exc(self) -> Exception:
        assert self._failure is not None
        cls, message, cause = self._failure
        exc = cls(message)
        exc.__cause__ = cause
        return exc
