"""What the supervisor keeps per worker, and small helpers it shares with the remote side."""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import anyio

import ringwire

from . import _worker
from ._remote import Ended, Joined, message
from ._topology import RayWorker, RemoteWorker, Worker, WorkerExit

__all__ = ["Notifier", "WorkerState", "WorkerStatus", "close_quietly", "notice_peer_gone"]


@dataclass(frozen=True)
class WorkerStatus:
    """A snapshot of one worker."""

    name: str
    state: str  # "starting", "ready", "restarting", "exited", "stopped"; "joining", "rejoining"
    pid: int | None
    incarnation: int
    restarts: int  # restarts (a remote worker: rejoins) so far (all time)
    host: str | None = None  # a remote worker's host while joined


class Notifier:
    """Wake every task waiting for 'something changed' (they re-check their condition)."""

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    def notify(self) -> None:
        ev, self._event = self._event, None
        if ev is not None:
            ev.set()

    async def wait(self) -> None:
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()


class WorkerState:
    def __init__(self, spec: Worker | RemoteWorker | RayWorker) -> None:
        self.spec = spec
        self.remote = isinstance(spec, RemoteWorker)
        self.ray = isinstance(spec, RayWorker)
        self.actor: Any = None  # a Ray worker's current actor (ringwire.runtime._ray)
        self.joined: Joined | None = None  # a remote worker's current join
        self.host: str | None = None
        self.note: str | None = None  # why it never came up, when no exit says
        self.proc: BaseProcess | None = None
        self.ctrl: Connection | None = None
        self.chan: ringwire.Channel | None = None
        self.stale: list[ringwire.Channel] = []  # channels of dead incarnations
        self.incarnation = -1
        self.state = "new"
        self.pid: int | None = None
        self.restarts = 0
        self.recent: deque[float] = deque()  # restart times within the policy window
        self.kill_reason: str | None = None
        self.stop_requested = False
        self.settled = False  # the first incarnation became ready or ended
        self.done = True  # no supervising task runs (not started yet, or finished)

    @property
    def local(self) -> Worker:
        """The declaration of a local worker."""
        assert isinstance(self.spec, Worker)
        return self.spec

    def retire_channel(self) -> tuple[int, int]:
        """The channel of an incarnation that ended: told its peer is gone, kept
        until replaced or the stop (unread replies stay readable); returns the slots
        reclaimed from the peer and those still in use."""
        chan, self.chan = self.chan, None
        if chan is None:
            return 0, 0
        notice_peer_gone(chan)
        stats = chan.statistics()
        self.stale.append(chan)
        return stats.slots_reclaimed, stats.slots_in_use

    def tell(self, kind: str) -> None:
        """Send ``stop`` / ``cancel`` to the worker's control pipe (or connection)."""
        if self.ctrl is not None:
            with contextlib.suppress(OSError):
                _worker.send_msg(self.ctrl, kind=kind)
        if self.joined is not None:
            with contextlib.suppress(
                anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError
            ):
                self.joined.ctrl.send_nowait(message(kind))

    def joined_exit(self, j: Joined, ended: Ended, stopping: bool) -> WorkerExit:
        """The end of remote join ``j``: its connections closed, the exit it makes."""
        self.joined = None
        reclaimed, in_use = self.retire_channel()
        if j.data is not None and j.data not in self.stale:
            close_quietly(j.data)  # it never became the worker's channel
        close_quietly(j.ctrl)
        code = ended.code
        self.state, self.settled, self.host = "exited", True, None
        return WorkerExit(
            name=self.spec.name, pid=j.pid, incarnation=j.incarnation, exitcode=code,
            signal=None, expected=bool(self.stop_requested and code == 0 or stopping),
            at=ended.detected, uptime_s=ended.detected - j.t0,
            error=ended.errors[-1] if ended.errors else None, reason=self.kill_reason,
            slots_reclaimed=reclaimed, slots_in_use_after=in_use, host=j.host,
            lost=ended.lost if code is None else None,
        )  # fmt: skip


def close_quietly(chan: ringwire.Channel) -> None:
    """Close a channel whose peer is gone: arrays still viewing its slots stay valid,
    so the 'closed while received arrays are alive' warning is noise here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=ResourceWarning)
        chan.close()


def notice_peer_gone(chan: ringwire.Channel) -> None:
    """Read the control socket of a channel whose peer just died, so that it knows now
    (and reclaims the slots the peer held) rather than at its next operation."""
    if not chan.closed:
        chan.poll_peer()  # non-blocking: reads EOF, runs the slot safe point
