"""The supervisor: start a topology, watch its workers, restart or stop, clean up.

Lifecycle
---------
``async with Topology(...) as topo`` (or :meth:`Topology.start`) spawns every worker
with the ``spawn`` start method, hands each one end of a :func:`ringwire.pair` (the
other end becomes ``topo.channel(name)`` in the supervising process, the *front*) and
waits until every worker is ready.  Leaving the block (or :meth:`Topology.stop`) stops
the topology gracefully:

1. *stop accepting*: ``topo.stopping`` turns true, every worker gets a ``stop``
   message (``ctx.stopping`` is set) and the front sends end-of-stream on every
   channel, so a worker's ``async for request in ctx.channel`` ends after the last
   request;
2. *drain*: workers answer what they received and return; the front keeps receiving
   their replies until each channel reports ``EndOfStream`` (``drain_timeout``
   seconds in all);
3. workers still running are cancelled (``kill_timeout`` seconds), then killed;
4. every channel is closed, processes are joined, ``/dev/shm`` is swept.

A second stop request with ``force=True`` (a second Ctrl-C) kills the workers at once.

Supervision
-----------
Each worker incarnation has a task that awaits the process *sentinel* (a file
descriptor that becomes readable when the process ends: no polling).  An exit the
supervisor did not ask for is reported as a :class:`WorkerExit` (name, pid, exit
status or signal) at once, the slots the dead worker held are reclaimed, the names it
left in ``/dev/shm`` are swept, and its policy applies: ``"stop"`` stops the topology,
:class:`Restart` starts a new process after a backoff, with a new channel
(:meth:`Topology.wait_channel` returns it).

Remote workers
--------------
A :class:`RemoteWorker` runs on another machine and joins by name over TCP through
``Topology(listen="tcp://host:port")`` (:mod:`ringwire.runtime._remote`); its channel
is a TCP channel, its death the loss of its control connection (liveness, not a
sentinel), and its :class:`Rejoin` policy waits for it to join again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AsyncExitStack
from functools import partial
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, TypeVar

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

import ringwire

from . import _spawn, _worker
from ._ray import RaySupervision
from ._remote import DEFAULT_HEARTBEAT, Desk, Ended, watch
from ._state import Notifier, WorkerState, WorkerStatus, close_quietly
from ._topology import (
    RayWorker,
    Rejoin,
    RemoteWorker,
    Restart,
    TopologyStopping,
    Worker,
    WorkerAwaitingRejoin,
    WorkerEvent,
    WorkerExit,
    WorkerGone,
    WorkerReady,
    WorkerRestarting,
    WorkerStartError,
)

__all__ = ["Topology", "WorkerStatus"]

logger = logging.getLogger("ringwire.runtime")

T = TypeVar("T")

_CLOSE_GRACE = 2.0  # a worker whose channel failed to connect gets this long to exit
_JOIN_AFTER_KILL = 10.0  # a SIGKILLed process is always reaped well within this


class Topology(RaySupervision):
    """Named worker processes, each connected to this (the front) process by a channel.

    ::

        topo = Topology([
            Worker("tok", "myapp.workers:tokenize"),
            Worker("gpu", "myapp.workers:infer", policy=Restart(max_restarts=3)),
        ])
        async with topo:                             # spawned, connected, all ready
            chan = topo.channel("gpu")
            await chan.send({"prompt": "hi"})
            reply = await chan.receive()
        # graceful stop: drained, closed, joined, swept

        # from a plain script (SIGINT / SIGTERM handled; a second one forces):
        topo.run(main)                               # async def main(topo): ...

    ``slots``: the front's send pool on every channel (``None``: inline only);
    ``ready_timeout``: how long a worker may take to become ready (then it is killed);
    ``drain_timeout``: how long a graceful stop waits for workers to finish;
    ``kill_timeout``: after that, how long cancelled workers get before SIGKILL;
    ``handle_signals``: install SIGINT/SIGTERM handlers while running (main thread
    only; :meth:`run` turns them on); ``on_event``: called with every
    :class:`WorkerEvent` (in the event loop; keep it quick).  ``listen``,
    ``insecure``, ``heartbeat``, ``keys``: where :class:`RemoteWorker` s join (see
    :mod:`ringwire.runtime._remote`).  Raises ``ValueError`` / ``TypeError``.
    """

    def __init__(
        self,
        workers: Iterable[Worker],
        *,
        slots: ringwire.SlotConfig | None = ringwire.DEFAULT_SLOTS,
        ready_timeout: float = 60.0,
        drain_timeout: float = 5.0,
        kill_timeout: float = 2.0,
        handle_signals: bool = False,
        on_event: Callable[[WorkerEvent], None] | None = None,
        listen: str | None = None,
        insecure: bool = False,
        heartbeat: float = DEFAULT_HEARTBEAT,
        keys: Any = None,
    ) -> None:
        self._workers: dict[str, WorkerState] = {}
        for spec in workers:
            if not isinstance(spec, (Worker, RemoteWorker, RayWorker)):
                raise TypeError(
                    "expected a ringwire.runtime.Worker, RemoteWorker or RayWorker, "
                    f"not {type(spec).__name__}"
                )
            if spec.name in self._workers:
                raise ValueError(f"two workers are named {spec.name!r}")
            self._workers[spec.name] = WorkerState(spec)
        if not self._workers:
            raise ValueError("a topology needs at least one worker")
        remote = {n: w.spec for n, w in self._workers.items() if isinstance(w.spec, RemoteWorker)}
        if remote and listen is None:
            raise ValueError(
                f"remote workers {sorted(remote)} join over TCP: give the topology an address "
                "to listen at, Topology(..., listen='tcp://127.0.0.1:7100')"
            )
        if listen is not None and not remote:
            raise ValueError(f"listen={listen!r}: the topology has no RemoteWorker to join it")
        self._desk: Desk | None = None
        if listen is not None:
            local = [n for n in self._workers if n not in remote]
            self._desk = Desk(
                listen, remote=remote, local=local, slots=slots, heartbeat=heartbeat,
                insecure=insecure, keys=keys,
            )  # fmt: skip
        self._ray_setup([w.spec for w in self._workers.values()], slots, heartbeat)
        self._front_slots = slots
        self._ready_timeout = float(ready_timeout)
        self._drain_timeout = float(drain_timeout)
        self._kill_timeout = float(kill_timeout)
        self._handle_signals = handle_signals
        self._on_event = on_event
        self._mp = _spawn.context()  # spawn, with a child's start-up data written first
        self._state = "new"
        self._stop_reason: str | None = None
        self._stop_started = False
        self._force = False
        self._changed = Notifier()
        self._stopped: anyio.Event | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._stack: AsyncExitStack | None = None
        self._subscribers: list[MemoryObjectSendStream[WorkerEvent]] = []
        self._main_scope: anyio.CancelScope | None = None
        self._main_task: int | None = None
        self._main_done: anyio.Event | None = None
        self.history: deque[WorkerEvent] = deque(maxlen=1000)
        """The latest events (at most 1000), oldest first."""

    def __repr__(self) -> str:
        return f"<Topology {self._state} workers={list(self._workers)}>"

    # -- inspection --------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """The workers' names, in declaration order."""
        return list(self._workers)

    @property
    def state(self) -> str:
        """``"new"``, ``"starting"``, ``"running"``, ``"stopping"`` or ``"stopped"``."""
        return self._state

    @property
    def address(self) -> str | None:
        """Where remote workers join (the bound ``tcp://`` address once started, its
        port filled in), or ``None`` without remote workers."""
        return None if self._desk is None else self._desk.address

    @property
    def stopping(self) -> bool:
        """Has a stop begun?  (The front should stop sending new work.)"""
        return self._stop_started

    @property
    def stop_reason(self) -> str | None:
        """Why the topology stopped (``"SIGINT received"``, a worker's death, ...)."""
        return self._stop_reason

    def status(self) -> dict[str, WorkerStatus]:
        """A snapshot of every worker, by name: its state, pid, incarnation, restarts
        so far and host (``""`` for a local worker).  Never waits, never raises."""
        return {
            name: WorkerStatus(name, w.state, w.pid, max(w.incarnation, 0), w.restarts, w.host)
            for name, w in self._workers.items()
        }

    def _get(self, name: str) -> WorkerState:
        try:
            return self._workers[name]
        except KeyError:
            raise KeyError(f"no worker named {name!r} (workers: {list(self._workers)})") from None

    def channel(self, name: str) -> ringwire.Channel:
        """The front's channel to worker ``name`` (its current process).  Raises
        :class:`WorkerGone` while the worker is down (restarting or stopped)."""
        w = self._get(name)
        if w.chan is None:
            raise WorkerGone(f"worker {name!r} has no channel now (state: {w.state})")
        return w.chan

    async def wait_channel(
        self, name: str, *, replacing: ringwire.Channel | None = None
    ) -> ringwire.Channel:
        """The channel to worker ``name`` once it is ready -- a channel other than
        ``replacing`` (pass the one that just broke to wait for the restarted worker).
        Raises :class:`WorkerGone` if the worker will not come back (the topology is
        stopping, or the worker's policy gave up)."""
        w = self._get(name)
        while True:
            chan = w.chan
            if chan is not None and chan is not replacing and not self._stop_started:
                return chan
            if w.done or self._stop_started or self._state == "stopped":
                raise WorkerGone(f"worker {name!r} is not coming back ({self._stop_reason})")
            await self._changed.wait()

    async def wait_stopped(self) -> None:
        """Wait until the topology has stopped (by :meth:`stop`, a signal or a policy)."""
        if self._stopped is None:
            raise RuntimeError("the topology was never started")
        await self._stopped.wait()

    def subscribe(self, max_buffer: int = 256) -> MemoryObjectReceiveStream[WorkerEvent]:
        """A stream of the events from now on; it ends when the topology has stopped.
        Use it as a context manager (``with topo.subscribe() as events:``).  A
        subscriber that falls ``max_buffer`` events behind misses events."""
        send, receive = anyio.create_memory_object_stream[WorkerEvent](max_buffer)
        if self._state == "stopped":
            send.close()
        else:
            self._subscribers.append(send)
        return receive

    def _emit(self, event: WorkerEvent) -> None:
        self.history.append(event)
        text = event.describe()
        if isinstance(event, (WorkerRestarting,)) or (
            isinstance(event, WorkerExit) and not event.expected
        ):
            logger.warning("ringwire.runtime: %s", text)
        else:
            logger.info("ringwire.runtime: %s", text)
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:
                logger.exception("ringwire.runtime: on_event callback failed")
        for send in list(self._subscribers):
            try:
                send.send_nowait(event)
            except anyio.WouldBlock:
                pass
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._subscribers.remove(send)
                send.close()

    # -- starting ----------------------------------------------------------------------

    async def __aenter__(self) -> Topology:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        await self.aclose(exc_type, exc, tb)
        return None

    async def start(self) -> None:
        """Spawn every worker and wait until all are ready (or raise
        :class:`WorkerStartError`, with everything already cleaned up).  Pair it with
        :meth:`aclose` in the same task (``async with`` does both)."""
        if self._state != "new":
            raise RuntimeError(f"a topology starts once (this one is {self._state})")
        self._state = "starting"
        self._stopped = anyio.Event()
        self._stack = AsyncExitStack()
        await self._stack.__aenter__()
        try:
            self._tg = tg = await self._stack.enter_async_context(anyio.create_task_group())
            if self._handle_signals:
                await tg.start(self._watch_signals)
            if self._desk is not None:
                await tg.start(self._desk.run)
            await self._ray_start(tg)
            for w in self._workers.values():
                w.done = False
                tg.start_soon(self._supervise, w, name=f"ringwire supervisor {w.spec.name}")
            failed = await self._wait_settled()
            if failed is not None or self._stop_started:
                reason = self._stop_reason
                if failed is not None:
                    exit_ = self._last_exit(failed)
                    what = exit_.describe() if exit_ is not None else "it did not start"
                    reason = f"worker {failed.spec.name!r} did not become ready: {what}"
                    if exit_ is None and failed.note:
                        reason = failed.note
                    if exit_ is not None and exit_.error:
                        reason += "\n" + exit_.error.rstrip()
                await self.stop(reason=reason or "start failed")
                raise WorkerStartError(
                    reason or "the topology was stopped while starting",
                    self._last_exit(failed) if failed is not None else None,
                )
            self._state = "running"
        except BaseException as exc:
            await self.aclose(type(exc), exc, exc.__traceback__)
            raise

    async def _wait_settled(self) -> WorkerState | None:
        """Until every worker is ready, or one has failed to start (returned)."""
        while True:
            for w in self._workers.values():
                if w.settled and w.state != "ready":
                    return w
            if all(w.settled for w in self._workers.values()) or self._stop_started:
                return None
            await self._changed.wait()

    def _last_exit(self, w: WorkerState) -> WorkerExit | None:
        for ev in reversed(self.history):
            if isinstance(ev, WorkerExit) and ev.name == w.spec.name:
                return ev
        return None

    # -- one worker ----------------------------------------------------------------------

    async def _supervise(self, w: WorkerState) -> None:
        try:
            while True:
                run = self._incarnation if not (w.ray or w.remote) else self._joined_incarnation
                ex = await (self._ray_incarnation(w) if w.ray else run(w))
                if ex is None or ex.expected or self._stop_started or self._state == "starting":
                    break
                policy = w.spec.policy
                if not isinstance(policy, (Restart, Rejoin)):
                    self._spawn_stop(f"worker {w.spec.name!r} {ex.status}")
                    break
                now = time.monotonic()
                w.recent.append(now)
                while w.recent and w.recent[0] < now - policy.window:
                    w.recent.popleft()
                attempt = len(w.recent)
                rejoin = isinstance(policy, Rejoin)
                limit = policy.max_rejoins if isinstance(policy, Rejoin) else policy.max_restarts
                if attempt > limit:
                    self._spawn_stop(
                        f"worker {w.spec.name!r} {ex.status} and exceeded its "
                        f"{'rejoin' if rejoin else 'restart'} limit "
                        f"({limit} within {policy.window:g} s)"
                    )
                    break
                if isinstance(policy, Rejoin):  # the next incarnation waits for the join
                    w.restarts += 1
                    self._emit(WorkerAwaitingRejoin(w.spec.name, attempt, policy.within, now))
                    continue
                delay = policy.delay(attempt)
                w.state = "restarting"
                self._emit(WorkerRestarting(w.spec.name, attempt, delay, time.monotonic()))
                with anyio.move_on_after(delay):
                    while not self._stop_started:
                        await self._changed.wait()
                if self._stop_started:
                    break
                w.restarts += 1
        except Exception:  # a bug here must not take the user's task group down
            logger.exception("ringwire.runtime: supervising %r failed", w.spec.name)
            self._spawn_stop(f"supervising worker {w.spec.name!r} failed")
        finally:
            w.done = True
            w.settled = True
            if w.state != "exited":
                w.state = "stopped"
            elif self._stop_started:
                w.state = "stopped"
            self._changed.notify()

    def _spawn_stop(self, reason: str) -> None:
        if not self._stop_started and self._tg is not None:
            self._tg.start_soon(partial(self.stop, reason=reason))

    async def _incarnation(self, w: WorkerState) -> WorkerExit:
        """Run one process of worker ``w`` until it ends; report and clean up."""
        spec = w.local
        w.incarnation += 1
        w.kill_reason = None
        w.stop_requested = False
        launch = _worker.Launch(
            name=spec.name,
            entry=spec.entry,
            incarnation=w.incarnation,
            options=ringwire.encode(dict(spec.options)),
            slots=spec.slots,
            spin_us=spec.spin_us,
            connect_timeout=self._ready_timeout,
            auto_ready=spec.ready == "auto",
            backend=spec.backend,
            backend_options=dict(spec.backend_options),
            fast_exit=spec.fast_exit,
            supervisor_pid=os.getpid(),
        )
        front, back = ringwire.pair(capacity=spec.capacity)
        ctrl, child_ctrl = self._mp.Pipe(duplex=True)
        proc = self._mp.Process(
            target=_worker.main,
            args=(launch, back, child_ctrl),
            name=f"ringwire-{spec.name}",
            daemon=True,
        )
        t0 = time.monotonic()
        try:
            proc.start()
        except Exception as exc:
            front.close()
            ctrl.close()
            reason = f"could not spawn: {exc!r}"
            logger.error("ringwire.runtime: worker %r %s", spec.name, reason)
            ex = WorkerExit(spec.name, 0, w.incarnation, None, None, False, t0, 0.0, reason=reason)
            w.state = "exited"
            w.settled = True
            self._emit(ex)
            self._changed.notify()
            return ex
        finally:
            back.close()  # the child has its own copy now
            child_ctrl.close()
        w.proc, w.ctrl, w.pid = proc, ctrl, proc.pid
        w.state = "starting"
        errors: list[str] = []
        ready = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read_control, ctrl, ready, errors)
                tg.start_soon(self._bring_up, w, front, ready, t0)
                await anyio.wait_readable(proc.sentinel)
                detected = time.monotonic()
                tg.cancel_scope.cancel()
        finally:
            front.close()  # unless it connected
            if proc.exitcode is None:  # cancelled from outside: never leave it running
                with contextlib.suppress(OSError):
                    proc.kill()
            proc.join()
        with contextlib.suppress(EOFError, OSError):
            while ctrl.poll(0):
                msg = _worker.recv_msg(ctrl)
                if msg.get("kind") == "error":
                    errors.append(str(msg.get("text")))
        ctrl.close()
        w.proc = w.ctrl = None
        code = proc.exitcode
        sig: signal.Signals | None = None
        if code is not None and code < 0:
            try:
                sig = signal.Signals(-code)
                code = None
            except ValueError:
                pass
        reclaimed, in_use = w.retire_channel()
        swept = tuple(ringwire.sweep_segments())
        expected = w.stop_requested and code == 0 or self._stop_started
        ex = WorkerExit(
            name=spec.name,
            pid=proc.pid or 0,
            incarnation=w.incarnation,
            exitcode=code,
            signal=sig,
            expected=bool(expected),
            at=detected,
            uptime_s=detected - t0,
            error=errors[-1] if errors else None,
            reason=w.kill_reason,
            slots_reclaimed=reclaimed,
            slots_in_use_after=in_use,
            swept=swept,
        )
        w.state = "exited"
        w.settled = True
        self._emit(ex)
        self._changed.notify()
        return ex

    async def _joined_incarnation(self, w: WorkerState) -> WorkerExit | None:
        """Wait for remote worker ``w`` to join, run that join until its control
        connection ends; report and clean up.  ``None``: it did not join in time."""
        spec, desk = w.spec, self._desk
        assert isinstance(spec, RemoteWorker) and desk is not None
        first, policy = w.incarnation < 0, spec.policy
        timeout = policy.within if isinstance(policy, Rejoin) and not first else self._ready_timeout
        w.state = "joining" if first else "rejoining"
        self._changed.notify()
        j = await desk.wait_join(spec.name, timeout)
        if j is None:
            if not self._stop_started:
                w.note = desk.no_show(spec.name, first, timeout)
                self._spawn_stop(w.note)
            return None
        w.incarnation, w.joined, w.pid, w.host = j.incarnation, j, j.pid, j.host
        w.kill_reason, w.stop_requested, w.state = None, False, "starting"
        ended = Ended(detected=j.t0)
        ready = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._bring_up_joined, w, j, ready)
            await watch(j, ready, ended)
            tg.cancel_scope.cancel()
        desk.release(spec.name, j)
        ex = w.joined_exit(j, ended, self._stop_started)
        self._emit(ex)
        self._changed.notify()
        return ex

    async def _read_control(self, ctrl: Connection, ready: anyio.Event, errors: list[str]) -> None:
        while True:
            await anyio.wait_readable(ctrl.fileno())
            try:
                msg = _worker.recv_msg(ctrl)
            except (EOFError, OSError):
                return
            kind = msg.get("kind")
            if kind == "ready":
                ready.set()
            elif kind == "error":
                errors.append(str(msg.get("text")))

    async def _bring_up(
        self, w: WorkerState, front: ringwire.PairEnd, ready: anyio.Event, t0: float
    ) -> None:
        spec = w.local
        chan: ringwire.Channel | None = None
        try:
            with anyio.fail_after(self._ready_timeout):
                chan = await front.connect(
                    slots=self._front_slots,
                    spin_us=spec.spin_us,
                    handshake_timeout=self._ready_timeout,
                )
                await ready.wait()
        except TimeoutError:
            if chan is not None:
                close_quietly(chan)
            self._kill(w, f"not ready within {self._ready_timeout:g} s")
            return
        except Exception as exc:  # the worker died during the handshake, or refused it
            if chan is not None:
                close_quietly(chan)
            await anyio.sleep(_CLOSE_GRACE)  # it normally exits first (and cancels this)
            self._kill(w, f"its channel failed: {exc}")
            return
        except BaseException:
            if chan is not None:
                close_quietly(chan)
            raise
        self._publish(w, chan, t0)
        if self._stop_started:
            await self._request_stop(w)

    def _publish(
        self, w: WorkerState, chan: ringwire.Channel, t0: float, host: str | None = None
    ) -> None:
        """Worker ``w`` is ready: ``chan`` is its channel now."""
        w.chan = chan
        w.state = "ready"
        w.settled = True
        for old in w.stale:
            close_quietly(old)
        w.stale.clear()
        now = time.monotonic()
        assert w.pid is not None
        self._emit(WorkerReady(w.spec.name, w.pid, w.incarnation, now - t0, now, host))
        self._changed.notify()

    def _kill(self, w: WorkerState, reason: str) -> None:
        if w.joined is not None:  # a remote process cannot be killed: drop its connections
            w.kill_reason = w.kill_reason or reason
            w.joined.abort(f"the front dropped worker {w.spec.name!r}: {reason}")
        if w.actor is not None and w.joined is None:  # a Ray actor not joined yet
            self._ray_kill(w, reason)
        proc = w.proc
        if proc is not None and proc.exitcode is None:
            if w.kill_reason is None:
                w.kill_reason = reason
            with contextlib.suppress(OSError):
                proc.kill()

    async def _request_stop(self, w: WorkerState) -> None:
        """Stop accepting: tell the worker, and end the stream of requests."""
        w.stop_requested = True
        w.tell("stop")
        if w.chan is not None:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                await w.chan.send_eof()

    # -- stopping ----------------------------------------------------------------------

    async def stop(
        self,
        *,
        force: bool = False,
        reason: str = "stop() called",
        drain_timeout: float | None = None,
    ) -> None:
        """Stop the topology (see the module docs); returns once everything is gone.
        A call while a stop is in progress waits for it (``force=True`` hurries it)."""
        if self._state == "new":
            raise RuntimeError("the topology was never started")
        if force and not self._force:
            self._force = True
            self._changed.notify()
        assert self._stopped is not None
        if self._stop_started:
            await self._stopped.wait()
            return
        self._stop_started = True
        self._stop_reason = reason
        self._state = "stopping"
        self._emit(TopologyStopping(reason, self._force, time.monotonic()))
        self._changed.notify()
        try:
            with anyio.CancelScope(shield=True):
                await self._stop(self._drain_timeout if drain_timeout is None else drain_timeout)
        finally:
            self._state = "stopped"
            for send in self._subscribers:
                send.close()
            self._subscribers.clear()
            self._stopped.set()
            self._changed.notify()

    def _all_done(self) -> bool:
        return all(w.done for w in self._workers.values())

    async def _wait_done(self, timeout: float, *, or_force: bool) -> None:
        with anyio.move_on_after(timeout):
            while not self._all_done() and not (or_force and self._force):
                await self._changed.wait()

    async def _stop(self, drain_timeout: float) -> None:
        workers = list(self._workers.values())
        if self._desk is not None:
            self._desk.begin_stop()
        self._ray_begin_stop()
        if not self._force:
            for w in workers:
                if w.proc is not None or w.joined is not None:
                    await self._request_stop(w)
            await self._wait_done(drain_timeout, or_force=True)
        if not self._force and not self._all_done():
            for w in workers:
                w.tell("cancel")
            await self._wait_done(self._kill_timeout, or_force=True)
        for w in workers:
            if not w.done:
                why = "forced stop" if self._force else "did not stop within the drain deadline"
                self._kill(w, why)
        await self._wait_done(_JOIN_AFTER_KILL, or_force=False)
        # a run() main is told to finish before its channels go away
        scope, done = self._main_scope, self._main_done
        if scope is not None and done is not None and not done.is_set():
            scope.cancel()
            current = anyio.get_current_task().id
            if current != self._main_task:
                await done.wait()
        for w in workers:
            for chan in [*w.stale, *([w.chan] if w.chan is not None else [])]:
                close_quietly(chan)
            w.stale.clear()
            w.chan = None
        if self._desk is not None:
            await self._desk.aclose()
        await self._ray_aclose()
        ringwire.sweep_segments()

    async def aclose(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        """Stop (if not stopped yet) and end the runtime's background tasks."""
        if self._stack is None:
            return
        try:
            if self._state != "stopped":
                with anyio.CancelScope(shield=True):
                    await self.stop(reason="the topology's block ended")
        finally:
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
            stack, self._stack = self._stack, None
            # the background tasks are cancelled: the task group exits cleanly, and an
            # exception from the block propagates as itself (not in an ExceptionGroup)
            await stack.__aexit__(None, None, None)

    # -- signals -------------------------------------------------------------------------

    async def _watch_signals(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if not self._stop_started:
                    logger.warning(
                        "ringwire.runtime: %s: stopping gracefully (again to force)", name
                    )
                    self._spawn_stop(f"{name} received")
                else:
                    logger.warning("ringwire.runtime: %s again: forcing the stop", name)
                    self._force = True
                    self._changed.notify()

    # -- plain scripts -------------------------------------------------------------------

    def run(
        self,
        main: Callable[[Topology], Awaitable[T]] | None = None,
        *,
        backend: str = "asyncio",
        backend_options: dict[str, Any] | None = None,
        handle_signals: bool = True,
    ) -> T | None:
        """Run the topology from a plain script: start it, run ``await main(topo)``
        (or, without ``main``, wait until it is stopped), stop it.

        SIGINT/SIGTERM stop it gracefully (a second one forces); when the topology
        stops before ``main`` returns, ``main`` is cancelled once the workers are gone
        and ``run`` returns ``None`` -- see :attr:`stop_reason`.  A start interrupted
        by a signal also returns ``None``."""
        self._handle_signals = handle_signals
        return anyio.run(self._run, main, backend=backend, backend_options=backend_options or None)

    async def _run(self, main: Callable[[Topology], Awaitable[T]] | None) -> T | None:
        try:
            await self.start()
        except WorkerStartError:
            if self._stop_reason is not None and self._stop_reason.endswith(" received"):
                return None  # interrupted while starting
            raise
        result: T | None = None
        try:
            if main is None:
                await self.wait_stopped()
            else:
                self._main_done = anyio.Event()
                self._main_task = anyio.get_current_task().id
                with anyio.CancelScope() as scope:
                    self._main_scope = scope
                    try:
                        result = await main(self)
                    finally:
                        self._main_done.set()
        except BaseException as exc:
            await self.aclose(type(exc), exc, exc.__traceback__)
            raise
        if self._state != "stopped":
            with anyio.CancelScope(shield=True):
                await self.stop(reason="main() returned" if main is not None else "stopped")
        await self.aclose()
        return result
