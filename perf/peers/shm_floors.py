"""The hot round-trip floors: busy-polling a shared int64, a posix_ipc semaphore ping-pong."""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable
from typing import Any

from perf.peers.base import CHILD_WAIT_S, Peer, PeerFailed, PeerUnavailable, clock, serve_rounds


def _posix_ipc() -> Any:
    try:
        import posix_ipc
    except ImportError as e:
        raise PeerUnavailable("posix_ipc not installed") from e
    return posix_ipc


def _shm_unlinker(posix_ipc: Any, name: str) -> Callable[[], None]:
    def unlink() -> None:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)

    return unlink


def _sem_unlinker(posix_ipc: Any, name: str) -> Callable[[], None]:
    def unlink() -> None:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_semaphore(name)

    return unlink


# ---- busy-poll floor: two processes spinning on shared int64s


def _child_busypoll(ctrl: Any, shm_name: str) -> None:
    import posix_ipc

    shm = posix_ipc.SharedMemory(shm_name)
    mm = mmap.mmap(shm.fd, 4096)
    shm.close_fd()
    mv = memoryview(mm).cast("q")
    state = {"seq": 0}

    def serve(n: int) -> None:
        seq = state["seq"]
        deadline = time.monotonic() + CHILD_WAIT_S
        for _ in range(n):
            seq += 1
            k = 0
            while mv[0] != seq:
                k += 1
                if not k & 0xFFFFF and time.monotonic() > deadline:
                    raise TimeoutError("busy-poll: parent stopped pinging")
            mv[8] = seq
        state["seq"] = seq

    try:
        serve_rounds(ctrl, serve)
    finally:
        mv.release()
        mm.close()


class BusyPoll(Peer):
    """Two processes busy-polling one shared int64 each way (ping at byte 0, pong at
    byte 64 -- separate cache lines): the hardware-and-interpreter floor."""

    name = "busy-poll shared int64 (floor)"
    kind = "rt"

    def setup(self) -> None:
        posix_ipc = _posix_ipc()
        shm = posix_ipc.SharedMemory(None, posix_ipc.O_CREX, mode=0o600, size=4096)
        self.on_cleanup(_shm_unlinker(posix_ipc, shm.name))
        self.mm = mmap.mmap(shm.fd, 4096)
        shm.close_fd()
        self.mv = memoryview(self.mm).cast("q")
        self.on_cleanup(self._unmap)
        self.seq = 0
        self.spawn(_child_busypoll, shm.name)
        self.ready_info = self.expect("ready")
        posix_ipc.unlink_shared_memory(shm.name)

    def _unmap(self) -> None:
        self.mv.release()
        self.mm.close()

    def rt_round(self, n: int) -> list[int]:
        mv = self.mv
        seq = self.seq
        out = []
        deadline = time.monotonic() + 60.0
        self.start_round(n)
        for _ in range(n):
            seq += 1
            t0 = clock()
            mv[0] = seq
            k = 0
            while mv[8] != seq:
                k += 1
                if not k & 0xFFFFF and (time.monotonic() > deadline or not self.proc.is_alive()):
                    raise PeerFailed("busy-poll: child stopped answering")
            out.append(clock() - t0)
        self.seq = seq
        return out


# ---- posix_ipc semaphore ping-pong


def _child_sem(ctrl: Any, ping: str, pong: str, cpu: int | None = None) -> None:
    import posix_ipc

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})

    s_ping = posix_ipc.Semaphore(ping)
    s_pong = posix_ipc.Semaphore(pong)

    def serve(n: int) -> None:
        acq, rel = s_ping.acquire, s_pong.release
        for _ in range(n):
            acq(CHILD_WAIT_S)
            rel()

    try:
        serve_rounds(ctrl, serve)
    finally:
        s_ping.close()
        s_pong.close()


class SemPingPong(Peer):
    """Two POSIX named semaphores (posix_ipc), blocking ``sem_wait``: no payload."""

    name = "posix_ipc semaphore ping-pong"
    kind = "rt"

    def __init__(self, pin_cpu: int | None = None) -> None:
        super().__init__()
        self.pin_cpu = pin_cpu
        if pin_cpu is not None:
            self.name = f"posix_ipc semaphore ping-pong, both pinned to CPU {pin_cpu} (info)"

    def setup(self) -> None:
        posix_ipc = _posix_ipc()
        self.ping = posix_ipc.Semaphore(None, posix_ipc.O_CREX, mode=0o600, initial_value=0)
        self.on_cleanup(_sem_unlinker(posix_ipc, self.ping.name))
        self.on_cleanup(self.ping.close)
        self.pong = posix_ipc.Semaphore(None, posix_ipc.O_CREX, mode=0o600, initial_value=0)
        self.on_cleanup(_sem_unlinker(posix_ipc, self.pong.name))
        self.on_cleanup(self.pong.close)
        self.spawn(_child_sem, self.ping.name, self.pong.name, self.pin_cpu)
        self.ready_info = self.expect("ready")
        self.ping.unlink()
        self.pong.unlink()

    def _acquire_slowly(self, acq: Callable[[float], None]) -> None:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and self.proc.is_alive():
            try:
                acq(0.5)
                return
            except Exception:
                continue
        raise PeerFailed("semaphore: the child stopped answering")

    def rt_round(self, n: int) -> list[int]:
        rel, acq = self.ping.release, self.pong.acquire
        out = []
        saved = os.sched_getaffinity(0)
        if self.pin_cpu is not None:
            os.sched_setaffinity(0, {self.pin_cpu})
        try:
            self.start_round(n)
            for _ in range(n):
                t0 = clock()
                rel()
                try:
                    acq(0.5)
                except Exception:  # posix_ipc.BusyError: no answer yet -- is it alive?
                    self._acquire_slowly(acq)
                out.append(clock() - t0)
        finally:
            if self.pin_cpu is not None:
                os.sched_setaffinity(0, saved)
        return out
