"""Remote workers, the front's side: the door a worker on another machine joins through.

A topology with :class:`~ringwire.runtime.RemoteWorker` s listens at a ``tcp://``
address (``Topology(listen=...)``: one :class:`ringwire.Listener`, the *desk*).  A
worker joins with two connections to it:

1. the **control** connection: the joiner sends ``join`` (its name, pid, host); the
   desk checks the name -- known, remote, not joined now, the topology not stopping
   -- and answers ``welcome`` (a one-time token, the incarnation, the worker's
   options) or ``refuse`` (a reason and a code: ``unknown``, ``local``, ``joined``,
   ``closed``, ``stopping``, ``version``, ``bad``);
2. the **data** connection: the joiner sends ``attach`` with the token; the desk
   answers ``attached`` on the control connection.  From then on the data
   connection is the worker's channel -- exactly what a local worker's pair end is --
   and carries nothing but the user's records.

The control connection then carries what a local worker's control pipe does:
``ready`` / ``error`` / ``exit`` from the worker, ``stop`` / ``cancel`` from the front.
Its end is the worker's death: end of stream after ``exit`` is a clean exit, a
hang-up is a lost worker (a killed process is seen at once on a live network, a
silent host after the connections' ``heartbeat``).  A worker that comes back is a
*new* join: new connections, a new incarnation, a new channel; nothing of the old
one's is carried over (what it had not acknowledged is not silently re-sent).

Every message is a small map ``{"ringwire.runtime": kind, "v": 1, ...}`` (the
channel's own codec; no pickle).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc

import ringwire
from ringwire._conn.netconn import DEFAULT_HEARTBEAT, check_bind, check_heartbeat

from ._topology import RayWorker, Rejoin, RemoteWorker

__all__ = [
    "DEFAULT_HEARTBEAT",
    "KEY",
    "VERSION",
    "Desk",
    "Ended",
    "Joined",
    "kind_of",
    "message",
    "net_keys",
    "watch",
]

logger = logging.getLogger("ringwire.runtime")

KEY = "ringwire.runtime"
VERSION = 1
ADMIT_TIMEOUT = 10.0  # a connection must say what it is (and a join attach) within this


def message(kind: str, **fields: Any) -> dict[str, Any]:
    return {KEY: kind, "v": VERSION, **fields}


def kind_of(record: Any) -> str | None:
    """The kind of a runtime message, or ``None`` for anything else."""
    if isinstance(record, dict) and isinstance(record.get(KEY), str):
        return str(record[KEY])
    return None


def net_keys(keys: Any, call: Any) -> dict[str, Any]:
    """The keyword that passes ``keys`` (CURVE key material) to ``call``
    (:class:`ringwire.Listener`: a :class:`ringwire.ServerKeys`; :func:`ringwire.connect`:
    a :class:`ringwire.ClientKeys`): ``{}`` without keys.  The files are the transport's
    business (it checks them); the kind is checked here, so that a topology or a join
    given the wrong one fails when it is made.  Raises ``TypeError`` for another kind."""
    if keys is None:
        return {}
    want = ringwire.ServerKeys if call is ringwire.Listener else ringwire.ClientKeys
    if not isinstance(keys, want):
        side = "a topology's (its listener's)" if want is ringwire.ServerKeys else "a join's"
        raise TypeError(
            f"keys={keys!r}: {side} keys must be ringwire.{want.__name__}(...) "
            "(make a pair with python -m ringwire keygen DIR)"
        )
    return {"keys": keys}


@dataclass(eq=False)
class Joined:
    """One join of a remote worker: its two connections and who it is."""

    name: str
    pid: int
    host: str
    ctrl: ringwire.Channel
    incarnation: int
    t0: float = field(default_factory=time.monotonic)
    data: ringwire.Channel | None = None
    attached: anyio.Event = field(default_factory=anyio.Event)

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"

    def abort(self, reason: str) -> None:
        for chan in (self.ctrl, self.data):
            if chan is not None and not chan.closed:
                chan.abort(reason)


class Desk:
    """The listener remote workers join through (see the module docstring).

    ``remote``: the remote workers by name; ``local``: the names of the local ones
    (refused with their own reason).  Constructing it validates the address (a bad
    one, or a non-loopback one without ``insecure=True``, raises ``ValueError``);
    :meth:`run` binds it.  ``unix``: ``url`` is a Unix socket path (shared-memory
    channels; the desk of the Ray workers on the front's host)."""

    def __init__(
        self,
        url: str,
        *,
        remote: Mapping[str, RemoteWorker | RayWorker],
        local: Iterable[str],
        slots: ringwire.SlotConfig | None,
        heartbeat: float,
        insecure: bool,
        keys: Any = None,
        unix: bool = False,
    ) -> None:
        if unix:  # Ray workers on this host join at a Unix socket path (ringwire._ray)
            keys = None
        elif not isinstance(url, str) or not url.startswith("tcp://"):
            raise ValueError(
                f"listen= takes a tcp://host:port address for remote workers to join, not {url!r}"
            )
        check_heartbeat(heartbeat)
        self._listen_kw: dict[str, Any] = dict(
            slots=slots,
            heartbeat=heartbeat,
            insecure=insecure,
            handshake_timeout=ADMIT_TIMEOUT,
            **net_keys(keys, ringwire.Listener),  # CURVE keys: the transport's business
        )
        if keys is None and not unix:  # (with keys, the transport judges a non-loopback bind)
            check_bind(url, insecure)  # a bad address; non-loopback without insecure=True
        self._listener: ringwire.Listener | None = None
        self.address = url
        self._remote = dict(remote)
        self._local = set(local)
        # per name: "waiting" (a join is welcome), "joining" (one is in progress),
        # "joined" (the supervisor has it), "lost" (the supervisor decides), "closed"
        self._state = dict.fromkeys(self._remote, "waiting")
        self._current: dict[str, Joined] = {}
        self._arrived: dict[str, Joined] = {}
        self._tokens: dict[bytes, Joined] = {}
        self._incarnation = dict.fromkeys(self._remote, 0)
        self._event = anyio.Event()
        self.stopping = False

    def _notify(self) -> None:
        ev, self._event = self._event, anyio.Event()
        ev.set()

    # -- running ------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Bind, then admit connections until :meth:`aclose` (raises ``OSError``
        naming the address when it cannot bind)."""
        self._listener = ringwire.Listener(self.address, **self._listen_kw)
        async with self._listener as listener, anyio.create_task_group() as tg:
            self.address = listener.path
            logger.info("ringwire.runtime: remote workers join at %s", self.address)
            task_status.started()
            while True:
                try:
                    chan = await listener.accept()
                except (anyio.ClosedResourceError, anyio.EndOfStream):
                    tg.cancel_scope.cancel()
                    return
                tg.start_soon(self._admit, chan)

    def begin_stop(self) -> None:
        """Refuse every join from now on (the joined workers drain)."""
        self.stopping = True
        self._notify()

    async def aclose(self) -> None:
        """Refuse every join from now on and close every connection."""
        self.stopping = True
        self._notify()
        for j in [*self._current.values(), *self._arrived.values(), *self._tokens.values()]:
            j.abort("the topology stopped")
        if self._listener is not None:
            await self._listener.aclose()

    # -- admitting ----------------------------------------------------------------------

    async def _admit(self, chan: ringwire.Channel) -> None:
        try:
            with anyio.fail_after(ADMIT_TIMEOUT):
                first = await chan.receive()
        except TimeoutError:
            return self._drop(chan, f"said nothing within {ADMIT_TIMEOUT:g} s")
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            return chan.close()
        except Exception as exc:  # broken, or undecodable: that connection only
            return self._drop(chan, f"{type(exc).__name__}: {exc}")
        kind = kind_of(first)
        if kind == "join":
            await self._join(chan, first)
        elif kind == "attach":
            j = self._tokens.pop(first.get("token"), None)
            if j is None:
                return self._drop(chan, "an attach with an unknown or used token")
            j.data = chan
            j.attached.set()
        else:
            self._drop(chan, "not a ringwire.runtime join (the first record must be one)")

    def _drop(self, chan: ringwire.Channel, why: str) -> None:
        logger.warning(
            "ringwire.runtime: %s dropped a connection from pid %s: %s",
            self.address,
            chan.peer_pid,
            why,
        )
        chan.abort(f"ringwire.runtime at {self.address}: {why}")

    def _refusal(self, name: Any, version: Any) -> tuple[str, str] | None:
        """``(code, reason)`` when a join of ``name`` must be refused."""
        where = f"the topology at {self.address}"
        if version != VERSION:
            return "version", f"{where} speaks runtime protocol {VERSION}, the worker {version!r}"
        if not isinstance(name, str) or not name:
            return "bad", f"a join must name its worker (got {name!r})"
        if self.stopping:
            return "stopping", f"{where} is stopping"
        if name not in self._remote:
            if name in self._local:
                return "local", (
                    f"{name!r} is a local worker of {where} (the front starts it); only "
                    f"remote workers join (remote workers: {sorted(self._remote)})"
                )
            return (
                "unknown",
                f"{where} has no remote worker named {name!r} (remote workers: {sorted(self._remote)})",
            )
        state = self._state[name]
        if state in ("joining", "joined") or name in self._arrived:
            cur = self._current.get(name) or self._arrived.get(name)
            who = f" ({cur.describe()}, for {time.monotonic() - cur.t0:.1f} s)" if cur else ""
            return "joined", (
                f"worker {name!r} is already joined to {where}{who}; a worker that comes "
                "back can join once the front has noticed the old one is gone"
            )
        if state != "waiting":
            return "closed", f"{where} does not take worker {name!r} any more (it is {state})"
        return None

    async def _join(self, chan: ringwire.Channel, hello: dict[str, Any]) -> None:
        name, pid, host = hello.get("name"), hello.get("pid"), hello.get("host")
        refusal = self._refusal(name, hello.get("v"))
        if refusal is not None:
            code, reason = refusal
            logger.warning("ringwire.runtime: refused a join of %r: %s", name, reason)
            with anyio.move_on_after(1.0):
                try:
                    await chan.send(message("refuse", code=code, reason=reason))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass
            await chan.aclose()
            return
        assert isinstance(name, str)
        token = secrets.token_bytes(16)
        j = Joined(
            name,
            pid if isinstance(pid, int) else 0,
            host if isinstance(host, str) else "?",
            chan,
            self._incarnation[name],
        )
        self._state[name] = "joining"
        self._tokens[token] = j
        try:
            opts = ringwire.encode(dict(self._remote[name].options))
            await chan.send(
                message("welcome", token=token, incarnation=j.incarnation, options=opts)
            )
            with anyio.fail_after(ADMIT_TIMEOUT):
                await j.attached.wait()
            await chan.send(message("attached"))
        except BaseException as exc:
            self._tokens.pop(token, None)
            j.abort(f"the join did not complete: {exc!r}")
            if self._state.get(name) == "joining":
                self._state[name] = "waiting"
            if not isinstance(exc, Exception):
                raise
            logger.warning(
                "ringwire.runtime: the join of %r (%s) failed: %r", name, j.describe(), exc
            )
            return
        if self._state.get(name) != "joining":  # given up on meanwhile
            j.abort(f"the topology at {self.address} does not take worker {name!r} any more")
            return
        self._incarnation[name] += 1
        self._arrived[name] = j
        self._notify()

    # -- the supervisor's side ----------------------------------------------------------

    async def wait_join(self, name: str, timeout: float) -> Joined | None:
        """The next join of ``name`` within ``timeout`` seconds (``None``: none came,
        or the topology is stopping; the name is then closed to joins)."""
        if self._state[name] in ("lost", "closed"):
            self._state[name] = "waiting"
        with anyio.move_on_after(timeout):
            while name not in self._arrived and not self.stopping:
                await self._event.wait()
        j = self._arrived.pop(name, None)
        if j is None or self.stopping:
            self._state[name] = "closed"
            if j is not None:
                j.abort("the topology is stopping")
            return None
        self._state[name] = "joined"
        self._current[name] = j
        return j

    def number_next(self, name: str, incarnation: int) -> None:
        """The next join of ``name`` is its incarnation ``incarnation`` (a Ray worker's
        incarnations may join through either of two desks: the supervisor counts)."""
        self._incarnation[name] = incarnation

    def no_show(self, name: str, first: bool, timeout: float) -> str:
        """Why the topology stops when ``name`` did not (re)join in time."""
        what = "join" if first else "rejoin"
        return f"remote worker {name!r} did not {what} {self.address} within {timeout:g} s"

    def release(self, name: str, j: Joined) -> None:
        """``j`` has ended: a new join of ``name`` is welcome if its policy rejoins."""
        if self._current.get(name) is j:
            del self._current[name]
        if self._state[name] == "joined":
            rejoin = isinstance(self._remote[name].policy, Rejoin) and not self.stopping
            self._state[name] = "waiting" if rejoin else "lost"


@dataclass
class Ended:
    """How a joined worker's control connection ended."""

    detected: float
    code: int | None = None  # the exit status it reported (None: it did not)
    lost: str | None = None  # the connection broke: how
    errors: list[str] = field(default_factory=list)
    ready: bool = False


async def watch(j: Joined, ready: anyio.Event, ended: Ended) -> None:
    """Read ``j``'s control connection until it ends (``ready`` is set at its
    ``ready``); fills ``ended``."""
    try:
        async for msg in j.ctrl:
            kind = kind_of(msg)
            if kind == "ready":
                ended.ready = True
                ready.set()
            elif kind == "error":
                ended.errors.append(str(msg.get("text")))
            elif kind == "exit" and isinstance(msg.get("code"), int):
                ended.code = msg["code"]
    except anyio.ClosedResourceError:
        ended.lost = "closed by the front"
    except Exception as exc:  # BrokenResourceError (a hang-up, silence), garbage
        ended.lost = str(exc) or type(exc).__name__
    else:
        if ended.code is None:
            ended.lost = "its control connection ended without an exit status"
    ended.detected = time.monotonic()
