"""Spawning worker processes: ``multiprocessing``'s ``spawn``, with the child's start-up
data written before the child exists.

The standard spawn start forks and execs a fresh interpreter, *then* writes the pickled
preparation data and process object into a pipe the child reads first thing.  A
supervisor killed (``kill -9``) between the two leaves a child that finds the pipe empty
and prints multiprocessing's own ``EOFError: Ran out of input`` traceback before any
ringwire code runs in it.  Here the data goes into the pipe first (it is small: the
pipe's buffer, grown if need be, holds it all), so a child that exists always has its
arguments, and a supervisor's death at any later point is seen by the worker itself
(:mod:`ringwire.runtime._worker`), which says so in one line.

Everything else is the standard spawn start: the same command line, the same
descriptors passed, the same sentinel and finalizer.  Where the data does not fit a
pipe's buffer (or the platform cannot size one), the standard order is used.
"""

from __future__ import annotations

import io
import os
import sys
from multiprocessing import process, reduction, spawn, util
from multiprocessing.context import SpawnContext, set_spawning_popen
from typing import Any

__all__ = ["context"]


def _fits(fd: int, n: int) -> bool:
    """Can ``n`` bytes be written into the pipe ``fd`` before anybody reads it?  (Grows
    its buffer if need be.)"""
    try:
        import fcntl

        get, set_ = fcntl.F_GETPIPE_SZ, fcntl.F_SETPIPE_SZ  # Linux
    except (ImportError, AttributeError):
        return False
    try:
        return fcntl.fcntl(fd, get) >= n or fcntl.fcntl(fd, set_, n) >= n
    except OSError:  # over /proc/sys/fs/pipe-max-size for an unprivileged user
        return False


def _close_fds(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


if sys.platform != "win32":
    from multiprocessing import popen_spawn_posix

    class _Popen(popen_spawn_posix.Popen):
        """``popen_spawn_posix.Popen`` with the data written before the spawn."""

        _fds: list[int]  # set by popen_spawn_posix.Popen.__init__

        def _launch(self, process_obj: Any) -> None:
            from multiprocessing import resource_tracker

            tracker_fd: Any = resource_tracker.getfd()
            self._fds.append(tracker_fd)
            prep_data = spawn.get_preparation_data(process_obj.name)
            fp = io.BytesIO()
            set_spawning_popen(self)
            try:
                reduction.dump(prep_data, fp)
                reduction.dump(process_obj, fp)
            finally:
                set_spawning_popen(None)
            data = fp.getbuffer()
            parent_r = child_w = child_r = parent_w = None
            try:
                parent_r, child_w = os.pipe()
                child_r, parent_w = os.pipe()
                early = _fits(parent_w, len(data))
                if early:
                    with open(parent_w, "wb", closefd=False) as f:
                        f.write(data)
                cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
                self._fds.extend([child_r, child_w])
                exe: Any = spawn.get_executable()
                self.pid = util.spawnv_passfds(exe, cmd, self._fds)
                self.sentinel = parent_r
                if not early:
                    with open(parent_w, "wb", closefd=False) as f:
                        f.write(data)
            finally:
                fds_to_close = [fd for fd in (parent_r, parent_w) if fd is not None]
                self.finalizer = util.Finalize(self, _close_fds, fds_to_close)
                for fd in (child_r, child_w):
                    if fd is not None:
                        os.close(fd)

    class _Process(process.BaseProcess):
        _start_method = "spawn"

        @staticmethod
        def _Popen(process_obj: Any) -> Any:
            return _Popen(process_obj)

        @staticmethod
        def _after_fork() -> None:
            pass

    class _Context(SpawnContext):
        Process = _Process  # type: ignore[assignment]

    _CONTEXT: SpawnContext = _Context()
else:  # pragma: no cover - ringwire runs on Linux
    _CONTEXT = SpawnContext()


def context() -> SpawnContext:
    """The ``spawn`` context the supervisor starts its workers with."""
    return _CONTEXT
