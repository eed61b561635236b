"""Ray workers: workers placed by a Ray cluster, wired to the front by ringwire.

A :class:`~ringwire.runtime.RayWorker` is a remote worker whose process the topology
starts itself, as a Ray actor (:class:`RayHost`), instead of waiting for somebody to
run ``python -m ringwire.runtime join`` on another host.  Everything after the start is
the join protocol of :mod:`ringwire.runtime._remote`: the actor joins a *desk* by
name (a control connection and a data connection), and from then on it is supervised
exactly as a joined worker -- its death is the loss of its control connection, seen
at once for a killed process.

One incarnation of a Ray worker, as the front runs it (:meth:`RaySupervision._ray_incarnation`):

1. create the actor with the worker's ``ray_options`` as they are, plus
   ``max_restarts=0, max_task_retries=0`` (one policy decides: the topology's);
2. ask it where Ray placed it (``where``: its kernel's boot id, host, pid, Ray node);
   an actor Ray cannot place within ``ready_timeout`` (an unsatisfiable resource) is a
   :class:`WorkerStartError` naming what it asked for;
3. pick the transport: the same boot id as the front (the same kernel, not just the
   same address) and ``transport="auto"`` -> the Unix-socket desk (shared-memory
   channels); otherwise the ``tcp://`` desk, with CURVE keys this topology generated
   at its start (one server pair, one client pair, in a private 0700 directory); the
   client's secret travels to the actor through Ray's own control plane, so TCP here
   trusts exactly what Ray trusts (whoever can submit work to the cluster);
4. call ``run`` on the actor (it joins and runs the entry) and wait for its join,
   racing the call's result: an actor whose entry cannot be imported fails the call
   before it joins, and that error is the start error;
5. supervise the join as :mod:`._remote` does; when it ends, Ray's own view (the
   ``run`` call's error: the actor died, its node is gone) is added to the
   :class:`WorkerExit` as ``ray`` (waited for briefly), then the actor is killed
   (``ray.kill``: an actor whose entry returned still holds its process).

Stopping the topology kills the actors it made and nothing else; a ``ray.init`` the
topology made itself (nothing was initialised) is shut down with it.  Ray's awaitables
are asyncio futures: a topology with Ray workers runs on the asyncio backend.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

import ringwire
from ringwire._net.keys import keygen

from ._join import run_joined
from ._remote import Desk, Ended, Joined, watch
from ._state import Notifier, WorkerState
from ._topology import RayWorker, WorkerEvent, WorkerExit
from ._worker import resolve_entry

__all__ = ["RayHost", "RaySupervision", "boot_id"]

logger = logging.getLogger("ringwire.runtime")

_RAY_VERDICT_WAIT = 2.0  # after the channel broke, how long Ray's own view is waited for
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """This kernel's boot id (two processes with the same one share a kernel, so shared
    memory and Unix sockets); ``""`` where it cannot be read."""
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def import_ray() -> Any:
    """The ``ray`` module; ``ModuleNotFoundError`` saying how to install it."""
    try:
        import ray
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        raise ModuleNotFoundError(
            "ringwire.runtime.RayWorker needs Ray: pip install 'ringwire[ray]'", name="ray"
        ) from exc
    return ray


class RayHost:
    """The actor a Ray worker runs in (``ray.remote(RayHost)``, made by the front)."""

    def where(self) -> dict[str, Any]:
        """Where Ray placed this actor."""
        import ray

        return {
            "boot_id": boot_id(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
        }

    def run(
        self, address: str, name: str, entry: str, keys: tuple[bytes, bytes] | None,
        settings: dict[str, Any],
    ) -> int:  # fmt: skip
        """Join the topology at ``address`` and run ``entry`` until it returns or the
        topology stops; the worker's exit status.  Raises what importing the entry
        raises, :class:`~ringwire.runtime.JoinRefused`."""
        fn = resolve_entry(entry)  # a bad entry fails this call: the start error
        with tempfile.TemporaryDirectory(prefix="ringwire-ray-keys-") as tmp:
            client_keys = None
            if keys is not None:  # the CURVE client pair, written 0600 only to be read
                secret, server = Path(tmp, "client.key_secret"), Path(tmp, "server.key")
                for path, data in ((secret, keys[0]), (server, keys[1])):
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                client_keys = ringwire.ClientKeys(secret=secret, server=server)
            return anyio.run(
                lambda: run_joined(address, name, fn, keys=client_keys, retry_for=5.0, **settings)
            )


def _condense(exc: BaseException) -> str:
    """One line of Ray's error (its messages span lines; keep the gist).  A task's error
    is the exception the actor raised (``RayTaskError.cause``)."""
    cause = getattr(exc, "cause", None)
    if type(exc).__name__.startswith("RayTaskError") and isinstance(cause, BaseException):
        exc = cause
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc) or type(exc).__name__)
    text = re.sub(r"\s+", " ", text).strip()
    why = text.find("The actor is dead because")  # Ray's verdict, past the actor's ids
    if why > 0:
        text = f"{text[: text.find('.') + 1]} {text[why:]}"
    return f"{type(exc).__name__}: {text[:400]}"


def _unplaceable(ray: Any, options: Mapping[str, Any]) -> str:
    """Why no live node of the cluster can hold an actor asking ``options`` (``""``:
    some node could, it was busy)."""
    wanted: dict[str, float] = dict(options.get("resources") or {})
    for key, res in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
        if options.get(key):
            wanted[res] = float(options[key])
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if any(all(have.get(k, 0.0) >= v for k, v in wanted.items()) for have in nodes):
        return ""
    return f"no live node of the cluster has {wanted} (nodes: {nodes})"


_actor_class: list[Any] = []


def actor_class(ray: Any) -> Any:
    """``ray.remote(RayHost)``, made once."""
    if not _actor_class:
        _actor_class.append(ray.remote(RayHost))
    return _actor_class[0]


async def _result(ref: Any) -> Any:
    """Await a Ray object ref (the asyncio backend)."""
    return await asyncio.wrap_future(ref.future())


class RaySupervision:
    """What :class:`~ringwire.runtime.Topology` adds for its Ray workers (a mixin:
    these methods run on the topology, beside the rest of its supervision)."""

    if TYPE_CHECKING:  # the topology's own, used here
        _workers: dict[str, WorkerState]
        _ready_timeout: float
        _stop_started: bool
        _changed: Notifier

        def _emit(self, event: WorkerEvent) -> None: ...
        def _spawn_stop(self, reason: str) -> None: ...
        def _kill(self, w: WorkerState, reason: str) -> None: ...
        def _publish(self, w: WorkerState, chan: ringwire.Channel, t0: float, host: str | None = None) -> None: ...  # fmt: skip
        async def _request_stop(self, w: WorkerState) -> None: ...

    def _ray_setup(self, specs: Iterable[object], slots: Any, heartbeat: float) -> None:
        specs = list(specs)
        self._ray_specs = {s.name: s for s in specs if isinstance(s, RayWorker)}
        self._ray_others = [getattr(s, "name", "") for s in specs if not isinstance(s, RayWorker)]
        self._ray_slots, self._ray_heartbeat = slots, heartbeat
        self._ray_desks: dict[str, Desk] = {}
        self._ray_dir: str | None = None
        self._ray_keys: tuple[bytes, bytes] | None = None
        self._ray_owned = False  # this topology called ray.init (and shuts it down)
        self._ray_tcp_address = ""

    async def _ray_start(self, tg: anyio.abc.TaskGroup) -> None:
        """Connect to Ray, make the keys, open both desks.  Raises
        ``ModuleNotFoundError`` (no Ray), ``RuntimeError`` (not on asyncio)."""
        if not self._ray_specs:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "a topology with Ray workers runs on the asyncio backend (Ray's futures "
                "are asyncio's); run it with backend='asyncio'"
            ) from None
        ray = import_ray()
        if not ray.is_initialized():
            main = threading.current_thread() is threading.main_thread()
            sigterm = signal.getsignal(signal.SIGTERM) if main else None
            ray.init()  # RAY_ADDRESS, else a running local cluster, else a new one
            self._ray_owned = True
            if sigterm is not None:  # ray.init installs a SIGTERM handler (sys.exit): ours stays
                signal.signal(signal.SIGTERM, sigterm)
        self._ray_dir = tmp = tempfile.mkdtemp(prefix="ringwire-ray-")
        keygen(tmp, "server")  # this topology's pairs: the server's, and one for its actors
        keygen(tmp, "ray")
        os.mkdir(Path(tmp, "clients"), 0o700)
        shutil.copy(Path(tmp, "ray.key"), Path(tmp, "clients", "ray.key"))
        self._ray_keys = (
            Path(tmp, "ray.key_secret").read_bytes(),
            Path(tmp, "server.key").read_bytes(),
        )
        server = ringwire.ServerKeys(secret=Path(tmp, "server.key_secret"), clients=Path(tmp, "clients"))  # fmt: skip
        common = dict(
            remote=self._ray_specs, local=self._ray_others, slots=self._ray_slots,
            heartbeat=self._ray_heartbeat, insecure=False,
        )  # fmt: skip
        self._ray_desks = {
            "shm": Desk(os.path.join(tmp, "desk.sock"), unix=True, **common),
            "tcp": Desk("tcp://0.0.0.0:0", keys=server, **common),
        }
        for desk in self._ray_desks.values():
            await tg.start(desk.run)
        port = self._ray_desks["tcp"].address.rsplit(":", 1)[1]
        self._ray_tcp_address = f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def _ray_begin_stop(self) -> None:
        for desk in self._ray_desks.values():
            desk.begin_stop()

    async def _ray_aclose(self) -> None:
        for desk in self._ray_desks.values():
            await desk.aclose()
        self._ray_desks = {}
        if self._ray_dir is not None:
            shutil.rmtree(self._ray_dir, ignore_errors=True)
            self._ray_dir = None
        if self._ray_owned:
            import_ray().shutdown()
            self._ray_owned = False

    def _ray_kill(self, w: WorkerState, reason: str | None = None) -> None:
        """Kill worker ``w``'s actor (Ray does it asynchronously; idempotent)."""
        if reason is not None:
            w.kill_reason = w.kill_reason or reason
        actor, w.actor = w.actor, None
        if actor is not None:
            try:
                import_ray().kill(actor, no_restart=True)
            except Exception as exc:  # the actor is gone already, or Ray is
                logger.debug("ringwire.runtime: ray.kill of %r: %r", w.spec.name, exc)

    def _ray_fail(self, w: WorkerState, note: str) -> None:
        """Worker ``w``'s actor did not join: kill it, say why, stop the topology."""
        self._ray_kill(w)
        if not self._stop_started:
            w.note = note
            logger.error("ringwire.runtime: %s", note)
            self._spawn_stop(note)

    async def _ray_incarnation(self, w: WorkerState) -> WorkerExit | None:
        """Create worker ``w``'s actor, let it join, supervise it until it ends; report
        and clean up (see the module docstring).  ``None``: it never joined."""
        spec = w.spec
        assert isinstance(spec, RayWorker)
        ray = import_ray()
        name, timeout = spec.name, self._ready_timeout
        options = {**(spec.ray_options or {}), "max_restarts": 0, "max_task_retries": 0}
        w.kill_reason, w.stop_requested, w.state = None, False, "starting"
        self._changed.notify()
        t0 = time.monotonic()
        try:
            w.actor = actor_class(ray).options(**options).remote()
            with anyio.fail_after(timeout):
                where = await _result(w.actor.where.remote())
        except TimeoutError:
            why = _unplaceable(ray, options) or "the cluster had no room for it in time"
            self._ray_fail(w, f"Ray did not start worker {name!r} within {timeout:g} s "
                           f"(ray_options={dict(spec.ray_options or {})}): {why}")  # fmt: skip
            return None
        except Exception as exc:  # bad ray_options, a runtime_env that failed, ...
            self._ray_fail(w, f"Ray could not start worker {name!r}: {_condense(exc)}")
            return None
        local = spec.transport == "auto" and where["boot_id"] == boot_id() != ""
        desk = self._ray_desks["shm" if local else "tcp"]
        address = desk.address if local else self._ray_tcp_address
        settings = dict(
            ready=spec.ready, slots=spec.slots, capacity=spec.capacity,
            heartbeat=self._ray_heartbeat, timeout=timeout,
        )  # fmt: skip
        keys = None if local else self._ray_keys
        desk.number_next(name, w.incarnation + 1)
        run_ref = w.actor.run.remote(address, name, spec.entry, keys, settings)
        outcome: list[Any] = []
        finished = anyio.Event()

        async def await_run() -> None:
            try:
                outcome.append(await _result(run_ref))
            except Exception as exc:
                outcome.append(exc)
            finished.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(await_run)
            j: Joined | None = None
            async with anyio.create_task_group() as race:

                async def join() -> None:
                    nonlocal j
                    j = await desk.wait_join(name, timeout)
                    race.cancel_scope.cancel()

                async def fail() -> None:
                    await finished.wait()
                    race.cancel_scope.cancel()

                race.start_soon(join)
                race.start_soon(fail)
            if j is None:
                if finished.is_set():
                    what = outcome[0]
                    what = _condense(what) if isinstance(what, BaseException) else f"exit status {what}"  # fmt: skip
                    note = f"Ray worker {name!r} failed before joining: {what}"
                else:
                    note = f"Ray worker {name!r} did not join {address} within {timeout:g} s"
                self._ray_fail(w, note)
                tg.cancel_scope.cancel()
                return None
            ex = await self._ray_joined(w, j, where, t0, desk)
            if not ex.expected and not finished.is_set():
                with anyio.move_on_after(_RAY_VERDICT_WAIT):
                    await finished.wait()
            verdict = None
            if outcome and isinstance(outcome[0], BaseException):
                verdict = _condense(outcome[0])
            self._ray_kill(w)
            tg.cancel_scope.cancel()
        ex = replace(ex, ray=verdict)
        self._emit(ex)
        self._changed.notify()
        return ex

    async def _ray_joined(
        self, w: WorkerState, j: Joined, where: dict[str, Any], t0: float, desk: Desk
    ) -> WorkerExit:
        """Supervise the join ``j`` of Ray worker ``w`` until its control connection ends."""
        w.incarnation, w.joined, w.pid = j.incarnation, j, int(where["pid"])
        w.host = f"{where['host']} (Ray node {str(where['node'])[:12]})"
        ended = Ended(detected=j.t0)
        ready = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._bring_up_joined, w, j, ready, t0)
            await watch(j, ready, ended)
            tg.cancel_scope.cancel()
        desk.release(w.spec.name, j)
        host = w.host
        ex = w.joined_exit(j, ended, self._stop_started)
        return replace(ex, pid=int(where["pid"]), host=host)

    async def _bring_up_joined(
        self, w: WorkerState, j: Joined, ready: anyio.Event, t0: float | None = None
    ) -> None:
        """Publish joined worker ``w``'s channel once it says ``ready`` (or kill it
        after ``ready_timeout``); ``t0``: when its start began (default: its join)."""
        with anyio.move_on_after(self._ready_timeout) as scope:
            await ready.wait()
        if scope.cancelled_caught:
            self._kill(w, f"not ready within {self._ready_timeout:g} s")
            return
        assert j.data is not None
        self._publish(w, j.data, j.t0 if t0 is None else t0, w.host if t0 is not None else j.host)
        if self._stop_started:
            await self._request_stop(w)
