"""Remote workers, the joining side: run a worker entry on this machine as a named worker
of a topology running elsewhere.

::

    python -m ringwire.runtime join tcp://front:7100 --name tokenizer \\
        --entry myapp.workers:tokenize

    # or from Python (blocking; join_async in an event loop):
    from ringwire import runtime
    runtime.join("tcp://front:7100", "tokenizer", "myapp.workers:tokenize")

The entry is the same ``async def entry(ctx)`` a local worker runs: ``ctx.channel``
is a TCP channel to the front, ``ctx.options`` the options the topology declared for
the worker, ``ctx.stopping`` is set when the topology stops (and the front then ends
the stream of requests).  See :mod:`ringwire.runtime._remote` for the protocol.  The
call returns the worker's exit status (:data:`EXIT_OK`, :data:`EXIT_ENTRY_FAILED`, or
:data:`EXIT_ORPHANED` when the front went away); a join that fails raises
:class:`JoinRefused` naming the address and the worker.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

import ringwire

from ._remote import DEFAULT_HEARTBEAT, kind_of, message, net_keys
from ._topology import JoinRefused, check_name
from ._worker import (
    EXIT_ENTRY_FAILED,
    EXIT_OK,
    EXIT_ORPHANED,
    WorkerContext,
    resolve_entry,
)

__all__ = ["join", "join_async", "run_joined"]

_RETRY_EVERY = 0.2
_GONE_GRACE = 0.5  # an entry broken by the front's death waits this long for the verdict
_LOST_ERRORS = (
    OSError,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
    ringwire.RingwireError,
)
Entry = Callable[[WorkerContext], Awaitable[Any]]


class JoinedContext(WorkerContext):
    """The :class:`WorkerContext` of a joined worker: ``ready`` goes to the front over
    the control connection."""

    def __init__(self, name: str, incarnation: int, channel: ringwire.Channel, options: dict[str, Any], stopping: anyio.Event, control: ringwire.Channel) -> None:  # fmt: skip
        super().__init__(name, incarnation, channel, options, stopping, ctrl=None)  # type: ignore[arg-type]
        self.control = control

    def ready(self) -> None:
        """Tell the front this worker is ready (idempotent; called for you unless the
        worker joined with ``ready="explicit"``).  Does not raise if the front is gone
        (the entry is cancelled)."""
        if not self._ready:
            self._ready = True
            try:
                self.control.send_nowait(message("ready"))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
                pass  # the control task sees the loss and cancels the entry


def _check(address: Any, name: Any, entry: Any, timeout: Any, retry_for: Any) -> Entry:
    if not isinstance(address, str) or not address.startswith("tcp://"):
        raise ValueError(f"a worker joins a topology at a tcp://host:port address, not {address!r}")
    check_name(name)
    for what, value in (("timeout", timeout), ("retry_for", retry_for)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{what} must be a number of seconds >= 0, not {value!r}")
    if isinstance(entry, str):
        return resolve_entry(entry)
    if not callable(entry):
        raise TypeError(f"entry must be 'package.module:function' or a callable, not {entry!r}")
    return entry


async def _connect(address: str, name: str, deadline: float, **kw: Any) -> ringwire.Channel:
    """A connection to the topology at ``address``, retried until ``deadline`` while
    nobody listens there."""
    while True:
        try:
            return await ringwire.connect(address, **kw)
        except ConnectionRefusedError as exc:
            if time.monotonic() + _RETRY_EVERY >= deadline:
                raise JoinRefused(
                    f"worker {name!r} cannot join {address}: no topology listens there "
                    f"({exc.strerror or exc}); start the front with "
                    f"Topology(..., listen={address!r}) and a RemoteWorker({name!r})"
                ) from None
        except (OSError, ringwire.HandshakeError) as exc:
            raise JoinRefused(f"worker {name!r} cannot join {address}: {exc}") from exc
        await anyio.sleep(_RETRY_EVERY)


async def _enter(
    address: str, name: str, *, timeout: float, retry_for: float, net: dict[str, Any],
    slots: ringwire.SlotConfig | None, capacity: int,
) -> tuple[ringwire.Channel, ringwire.Channel, dict[str, Any]]:  # fmt: skip
    """Join: the control and data connections, and the welcome."""
    deadline = time.monotonic() + retry_for
    hello = message("join", name=name, pid=os.getpid(), host=socket.gethostname())
    while True:
        ctrl = await _connect(address, name, deadline, slots=None, handshake_timeout=timeout, **net)
        try:
            with anyio.fail_after(timeout):
                await ctrl.send(hello)
                reply = await ctrl.receive()
            kind = kind_of(reply)
            if kind == "refuse":
                reason, code = reply.get("reason"), reply.get("code")
                if code == "joined" and time.monotonic() + _RETRY_EVERY < deadline:
                    await ctrl.aclose()
                    await anyio.sleep(_RETRY_EVERY)
                    continue  # the front has not yet noticed our predecessor's death
                raise JoinRefused(f"the topology at {address} refused worker {name!r}: {reason}")
            if kind != "welcome" or not isinstance(reply.get("token"), bytes):
                raise JoinRefused(f"{address} is not a ringwire topology (it answered {reply!r})")
            with anyio.fail_after(timeout):
                data = await ringwire.connect(
                    address, slots=slots, capacity=capacity, handshake_timeout=timeout, **net
                )
                try:
                    await data.send(message("attach", token=reply["token"]))
                    if kind_of(await ctrl.receive()) != "attached":
                        raise JoinRefused(f"the topology at {address} did not attach {name!r}")
                except BaseException:
                    data.close()
                    raise
            return ctrl, data, reply
        except TimeoutError:
            ctrl.close()
            raise JoinRefused(
                f"worker {name!r} joining {address}: no answer within {timeout:g} s"
            ) from None
        except (anyio.EndOfStream, anyio.BrokenResourceError) as exc:
            ctrl.close()
            raise JoinRefused(
                f"worker {name!r} joining {address}: the front hung up ({exc or 'end of stream'})"
            ) from None
        except BaseException:
            ctrl.close()
            raise


async def join_async(
    address: str,
    name: str,
    entry: str | Entry,
    *,
    ready: str = "auto",
    slots: ringwire.SlotConfig | None = ringwire.DEFAULT_SLOTS,
    capacity: int = ringwire.DEFAULT_CAPACITY,
    heartbeat: float = DEFAULT_HEARTBEAT,
    timeout: float = 30.0,
    retry_for: float = 0.0,
    keys: Any = None,
) -> int:
    """Join the topology at ``address`` as its remote worker ``name`` and run ``entry``
    (``"package.module:function"`` or the function) until it returns or the topology
    stops; returns the exit status.

    ``ready``: ``"auto"`` (ready once joined) or ``"explicit"`` (``ctx.ready()``);
    ``slots`` / ``capacity``: this worker's send pool and ring (as for
    :func:`ringwire.connect`); ``heartbeat``: how long a silent front goes
    unnoticed; ``timeout``: each step of the join; ``retry_for``: keep trying this
    many seconds while no topology listens yet, or while the front still holds this
    worker's previous (dead) join; ``keys``: CURVE key material, handed to the TCP
    transport as it is.

    Raises :class:`JoinRefused` (nobody listens, unknown name, already joined, the
    topology is stopping), ``ValueError`` / ``TypeError`` for bad arguments and
    whatever importing a string ``entry`` raises.
    """
    fn = _check(address, name, entry, timeout, retry_for)
    return await run_joined(
        address, name, fn, ready=ready, slots=slots, capacity=capacity,
        heartbeat=heartbeat, timeout=timeout, retry_for=retry_for, keys=keys,
    )  # fmt: skip


async def run_joined(
    address: str, name: str, fn: Entry, *, ready: str, slots: ringwire.SlotConfig | None,
    capacity: int, heartbeat: float, timeout: float, retry_for: float, keys: Any,
) -> int:  # fmt: skip
    """:func:`join_async` once its arguments are checked; ``address`` may also be a
    Unix socket path (a Ray worker on the front's host: :mod:`ringwire.runtime._ray`)."""
    if ready not in ("auto", "explicit"):
        raise ValueError(f"ready must be 'auto' or 'explicit', not {ready!r}")
    net = {"heartbeat": heartbeat, **net_keys(keys, ringwire.connect)}
    ctrl, data, welcome = await _enter(
        address, name, timeout=timeout, retry_for=retry_for, net=net, slots=slots, capacity=capacity
    )
    try:
        options = dict(ringwire.decode(welcome.get("options") or ringwire.encode({})))
        incarnation = int(welcome.get("incarnation", 0))
    except (ringwire.RingwireError, TypeError, ValueError) as exc:
        data.close()
        ctrl.close()
        raise JoinRefused(f"the topology at {address} sent a bad welcome: {exc}") from exc
    stopping = anyio.Event()
    ctx = JoinedContext(name, incarnation, data, options, stopping, ctrl)
    entry_scope = anyio.CancelScope()
    lost: list[str] = []
    code = EXIT_OK

    async def control() -> None:
        try:
            async for msg in ctrl:
                kind = kind_of(msg)
                if kind in ("stop", "cancel"):
                    stopping.set()
                if kind == "cancel":
                    entry_scope.cancel()
        except anyio.ClosedResourceError:
            return
        except Exception as exc:
            lost.append(str(exc) or type(exc).__name__)
        else:
            lost.append("it ended the control connection")
        entry_scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(control)
            with entry_scope:
                try:
                    if ready == "auto":
                        ctx.ready()
                    await fn(ctx)
                except Exception as exc:
                    if isinstance(exc, _LOST_ERRORS):  # the front's death? its verdict first
                        with anyio.move_on_after(_GONE_GRACE):
                            while not lost:
                                await anyio.sleep(0.01)
                    if not lost:
                        text = traceback.format_exc()
                        print(f"ringwire worker {name!r} (pid {os.getpid()}) failed:\n{text}", file=sys.stderr)  # fmt: skip
                        _say(ctrl, message("error", text=text))
                        code = EXIT_ENTRY_FAILED
            if lost:
                code = EXIT_ORPHANED
            else:
                await data.aclose()  # the front receives everything, then end of stream
                _say(ctrl, message("exit", code=code))
            tg.cancel_scope.cancel()
    finally:
        data.close()
        ctrl.close()
    if lost:
        sys.stderr.write(
            f"ringwire worker {name!r} (pid {os.getpid()}): the front at {address} is gone "
            f"({lost[0]}); exiting\n"
        )
    return code


def _say(ctrl: ringwire.Channel, msg: dict[str, Any]) -> None:
    try:
        ctrl.send_nowait(msg)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
        pass


def join(
    address: str,
    name: str,
    entry: str | Entry,
    *,
    backend: str = "asyncio",
    backend_options: dict[str, Any] | None = None,
    **kw: Any,
) -> int:
    """:func:`join_async` from a plain script (runs its own event loop on
    ``backend``); the same arguments and errors."""
    return anyio.run(
        lambda: join_async(address, name, entry, **kw),
        backend=backend,
        backend_options=backend_options or None,
    )
