"""The worker side: what runs inside a spawned worker process.

The supervisor starts ``main(launch, end, ctrl)`` with the ``spawn`` start method.  It

1. ignores SIGINT (a Ctrl-C in a terminal reaches the whole process group; the
   supervisor decides how its workers stop),
2. imports the entry function (``"package.module:function"``),
3. runs ``anyio.run`` on the chosen backend: connects its end of the front channel,
   tells the supervisor it is ready (at once, or when the entry calls
   :meth:`WorkerContext.ready`), and awaits ``entry(ctx)``,
4. closes the channel cleanly when the entry returns (the front then receives
   everything the worker sent, followed by ``EndOfStream``).

The control pipe (a ``multiprocessing`` pipe, msgpack messages, no pickle) carries
``ready`` / ``error`` to the supervisor and ``stop`` / ``cancel`` to the worker.  End of
file on it means the supervisor is gone: the worker cancels its entry and exits, so a
killed supervisor leaves no orphans.  A supervisor that dies while the worker starts
(its handshake fails, ``ready`` meets a broken pipe) or runs (its channel breaks) is
told apart from a real error -- the worker has been re-parented, or the supervisor's end
of the control pipe hung up -- and the worker says so in one line on stderr, with no
traceback, and exits with :data:`EXIT_ORPHANED`.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import anyio
import msgspec

import ringwire

__all__ = [
    "EXIT_ENTRY_FAILED",
    "EXIT_OK",
    "EXIT_ORPHANED",
    "EXIT_START_FAILED",
    "WorkerContext",
    "resolve_entry",
]

EXIT_OK = 0
EXIT_ENTRY_FAILED = 1  # the entry function raised
EXIT_START_FAILED = 2  # import, channel or backend setup failed
EXIT_ORPHANED = 3  # the supervisor went away

_msg_encoder = msgspec.msgpack.Encoder()
_msg_decoder = msgspec.msgpack.Decoder(dict)


def send_msg(conn: Connection, **msg: Any) -> None:
    """One control message (a small msgpack map; never pickle)."""
    conn.send_bytes(_msg_encoder.encode(msg))


def recv_msg(conn: Connection) -> dict[str, Any]:
    """The next control message (raises ``EOFError`` at end of file)."""
    data = conn.recv_bytes(1 << 20)
    try:
        return _msg_decoder.decode(data)
    except msgspec.DecodeError:
        return {"kind": "garbage"}


def resolve_entry(entry: str) -> Callable[[WorkerContext], Awaitable[Any]]:
    """Import ``"package.module:function"`` (``function`` may be dotted)."""
    module_name, sep, attr = entry.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"entry must look like 'package.module:function', not {entry!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"entry {entry!r} is not callable")
    return obj


@dataclass(frozen=True)
class Launch:
    """Everything a worker process needs to start (a spawn argument)."""

    name: str
    entry: str
    incarnation: int
    options: bytes  # ringwire-encoded mapping
    slots: ringwire.SlotConfig | None
    spin_us: float
    connect_timeout: float
    auto_ready: bool
    backend: str
    backend_options: dict[str, Any] = field(default_factory=dict)
    fast_exit: bool = True
    supervisor_pid: int = 0  # the spawning process (0: take the parent at start-up)


class WorkerContext:
    """What a worker's entry function gets.

    ``name``
        the worker's name in the topology.
    ``incarnation``
        0 for the first process of this worker, 1 after its first restart, ...
    ``channel``
        the :class:`ringwire.Channel` to the front (the supervising process).  When the
        topology stops gracefully the front sends end-of-stream: ``async for`` over the
        channel ends after the last request, so a loop that answers every request it
        receives drains naturally.  The runtime closes the channel after the entry
        returns.
    ``options``
        the worker's ``options`` mapping, as declared in the topology.
    ``stopping``
        an :class:`anyio.Event` set when the supervisor asks the worker to stop (for
        workers that do not read the channel until its end).
    """

    def __init__(
        self,
        name: str,
        incarnation: int,
        channel: ringwire.Channel,
        options: dict[str, Any],
        stopping: anyio.Event,
        ctrl: Connection,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.incarnation = incarnation
        self.channel = channel
        self.options = options
        self.stopping = stopping
        self._ctrl = ctrl
        self._on_lost = on_lost
        self._ready = False

    def __repr__(self) -> str:
        return f"<WorkerContext {self.name!r} incarnation {self.incarnation} pid {os.getpid()}>"

    @property
    def pid(self) -> int:
        return os.getpid()

    def ready(self) -> None:
        """Tell the supervisor this worker is ready (idempotent).  Called for you before
        the entry starts unless the worker was declared with ``ready="explicit"``.  If
        the supervisor is gone it does not raise: the entry is cancelled at its next
        ``await`` and the worker exits (one line on stderr says why)."""
        if not self._ready:
            self._ready = True
            try:
                send_msg(self._ctrl, kind="ready")
            except OSError:  # the supervisor is gone: the entry is cancelled at its next await
                if self._on_lost is None:
                    raise
                self._on_lost()


# how long an error that a dying supervisor causes (a broken pipe, a failed handshake, a
# broken channel) waits for the evidence that it did die: the kernel closes a killed
# process's descriptors one by one, then re-parents its children
_GONE_GRACE = 0.25
_LOST_ERRORS = (
    OSError,
    EOFError,
    anyio.BrokenResourceError,
    anyio.EndOfStream,
    ringwire.RingwireError,
)


def supervisor_gone(launch: Launch, ctrl: Connection) -> bool:
    """Has the supervisor gone away?  This process was re-parented, or the supervisor's
    end of the control pipe hung up (checked without reading a message)."""
    if launch.supervisor_pid and os.getppid() != launch.supervisor_pid:
        return True
    try:
        poller = select.poll()
        poller.register(ctrl.fileno(), select.POLLRDHUP)
        return any(ev & (select.POLLHUP | select.POLLRDHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError):  # closed: nobody can talk to us any more
        return True


def _is_lost(launch: Launch, ctrl: Connection, exc: BaseException | None) -> bool:
    """Was this failure the supervisor's death?  Waits a moment for the evidence when
    the error is one that its death causes (blocking: only on the way out)."""
    deadline = time.monotonic() + (_GONE_GRACE if isinstance(exc, _LOST_ERRORS) else 0.0)
    while True:
        if supervisor_gone(launch, ctrl):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _say_orphaned(launch: Launch) -> None:
    """The one line an orphaned worker prints (instead of a traceback)."""
    who = f"pid {launch.supervisor_pid}" if launch.supervisor_pid else "its parent"
    line = (
        f"ringwire worker {launch.name!r} (pid {os.getpid()}): the supervisor ({who}) is "
        "gone; exiting\n"
    )
    try:  # one write: the lines of workers orphaned together do not interleave
        sys.stderr.flush()
        sys.stderr.write(line)
        sys.stderr.flush()
    except (OSError, ValueError):  # nobody reads our stderr any more either
        pass


def main(launch: Launch, end: ringwire.PairEnd, ctrl: Connection) -> None:
    """The worker process's target (spawned by the supervisor)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not launch.supervisor_pid:
        launch = dataclasses.replace(launch, supervisor_pid=os.getppid())
    try:
        entry = resolve_entry(launch.entry)
        options = ringwire.decode(launch.options)
        if not isinstance(options, dict):
            raise TypeError("worker options must be a mapping")
    except BaseException:
        _report(ctrl, launch, "could not load the entry")
        end.close()
        sys.exit(EXIT_START_FAILED)
    try:
        code = anyio.run(
            _amain,
            launch,
            entry,
            options,
            end,
            ctrl,
            backend=launch.backend,
            backend_options=launch.backend_options or None,
        )
    except BaseException as exc:
        if _is_lost(launch, ctrl, exc):
            code = EXIT_ORPHANED
        else:
            _report(ctrl, launch, "crashed")
            code = EXIT_START_FAILED
    finally:
        end.close()
    if code == EXIT_ORPHANED:
        _say_orphaned(launch)
    if launch.fast_exit:
        _fast_exit(code)
    sys.exit(code)


def _fast_exit(code: int) -> None:
    """Exit without the interpreter's teardown (clearing every module and a final
    garbage collection: half a second with torch loaded), after doing what a normal exit
    of a ``multiprocessing`` child does that matters: multiprocessing's finalizers and
    children, ``atexit`` handlers, flushing stdio."""
    try:
        from multiprocessing import util

        # what multiprocessing's own bootstrap and the interpreter's exit call
        util._exit_function()  # type: ignore[attr-defined]  # noqa: SLF001
        atexit._run_exitfuncs()  # noqa: SLF001
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _report(ctrl: Connection, launch: Launch, what: str) -> None:
    text = traceback.format_exc()
    print(f"ringwire worker {launch.name!r} (pid {os.getpid()}) {what}:\n{text}", file=sys.stderr)
    try:
        send_msg(ctrl, kind="error", text=text)
    except OSError:
        pass


async def _amain(
    launch: Launch,
    entry: Callable[[WorkerContext], Awaitable[Any]],
    options: dict[str, Any],
    end: ringwire.PairEnd,
    ctrl: Connection,
) -> int:
    stopping = anyio.Event()
    code = EXIT_OK
    try:
        chan = await end.connect(
            slots=launch.slots, spin_us=launch.spin_us, handshake_timeout=launch.connect_timeout
        )
    except Exception as exc:
        if _is_lost(launch, ctrl, exc):
            return EXIT_ORPHANED  # killed during our start-up: nothing to report to
        _report(ctrl, launch, "could not connect its channel")
        return EXIT_START_FAILED
    entry_scope = anyio.CancelScope()
    orphaned = False

    def lost() -> None:
        nonlocal orphaned
        orphaned = True  # the supervisor is gone: do not outlive it
        entry_scope.cancel()

    async def control() -> None:
        while True:
            await anyio.wait_readable(ctrl.fileno())
            try:
                msg = recv_msg(ctrl)
            except (EOFError, OSError):
                lost()
                return
            kind = msg.get("kind")
            if kind == "stop":
                stopping.set()
            elif kind == "cancel":
                stopping.set()
                entry_scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(control)
            ctx = WorkerContext(
                launch.name, launch.incarnation, chan, options, stopping, ctrl, on_lost=lost
            )
            with entry_scope:
                try:
                    if launch.auto_ready:
                        ctx.ready()
                    await entry(ctx)
                except Exception as exc:
                    if orphaned or _is_lost(launch, ctrl, exc):
                        orphaned = True  # its channel broke because the supervisor died
                    else:
                        _report(ctrl, launch, "failed")
                        code = EXIT_ENTRY_FAILED
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await chan.aclose()
    if orphaned:
        return EXIT_ORPHANED
    return code
