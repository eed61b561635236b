"""POSIX shared-memory segments and processes: the sweep removes only the names of dead
creators, and a zombie counts as dead."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import posix_ipc
import pytest

from ringwire._pool.segment import SHM_DIR, pid_alive, sweep, unlink_segment

pytestmark = pytest.mark.multiprocess  # every test here starts a process


def shm_path(name: str) -> str:
    return SHM_DIR + name


SPAWN_CTX = mp.get_context("spawn")


def _exit_now() -> None:
    pass


def _dead_pid() -> int:
    p = mp.get_context("spawn").Process(target=_exit_now)
    p.start()
    p.join()
    return p.pid  # type: ignore[return-value]


def test_sweep_removes_only_dead_creators():
    dead = _dead_pid()
    dead_name = f"/rw.{dead}.{'ab' * 6}"
    live_name = f"/rw.{os.getpid()}.{'cd' * 6}"
    foreign = "/rwx-not-ours"
    made = []
    try:
        for name in (dead_name, live_name, foreign):
            posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
            made.append(name)
        removed = sweep()
        assert dead_name in removed
        assert not os.path.exists(shm_path(dead_name))
        assert os.path.exists(shm_path(live_name))
        assert os.path.exists(shm_path(foreign))
    finally:
        for name in made:
            unlink_segment(name)


def test_pid_alive_treats_zombies_as_dead():
    p = SPAWN_CTX.Process(target=_exit_now)
    p.start()
    assert p.pid is not None
    try:
        deadline = time.monotonic() + 10
        while pid_alive(p.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # exited but not reaped yet: a zombie
        assert not pid_alive(p.pid)
    finally:
        p.join()
    assert pid_alive(os.getpid())
    assert not pid_alive(_dead_pid())
