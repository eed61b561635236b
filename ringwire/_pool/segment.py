"""POSIX shared-memory segments: create, attach, unlink, sweep.

A segment is a ``posix_ipc.SharedMemory`` object (``/dev/shm/<name>`` on Linux), never
``multiprocessing.shared_memory`` (whose resource tracker, before Python 3.13, unlinks
segments that another process created).

* Names are short (at most 31 characters, the macOS limit), unguessable, and embed the
  creator's pid: ``/rw.<pid>.<12 hex digits>``.  :func:`sweep` uses the pid to remove
  the names of creators that are gone.
* Creation is ``O_CREAT | O_EXCL`` with mode 0600, then ``posix_fallocate`` of the
  whole size *before* mapping: on a full ``/dev/shm`` this fails at once with
  :class:`SharedMemoryFull` instead of a SIGBUS on first touch later.
* The file descriptor is closed right after ``mmap``; the mapping keeps the memory.
* Attaching checks that the segment belongs to our uid, is not accessible to anybody
  else, and has the announced size.
* The creator unlinks the name as soon as every peer has attached (the handshake tells
  it when), so normally nothing stays in ``/dev/shm`` while the connection lives.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections.abc import Callable

import posix_ipc

from .._errors import SegmentError, SharedMemoryFull
from .._wire.names import is_segment_name, name_pid, new_segment_name

__all__ = [
    "SHM_DIR",
    "Segment",
    "pid_alive",
    "stale_segments",
    "sweep",
    "unlink_segment",
]

SHM_DIR = "/dev/shm"
_PAGE = mmap.PAGESIZE


def unlink_segment(name: str) -> bool:
    """Remove ``name`` from ``/dev/shm``; ``False`` if it was already gone."""
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True


def _round_up(size: int) -> int:
    return (size + _PAGE - 1) // _PAGE * _PAGE


_CHUNK = 16 << 20  # a reservation asks ``keep_going`` again after this many bytes


def _allocate(fd: int, size: int, keep_going: Callable[[], None] | None = None) -> None:
    """Reserve ``size`` bytes of tmpfs for ``fd`` now, so that touching them later
    cannot SIGBUS.  ``keep_going`` (if given) is called between chunks of
    :data:`_CHUNK` bytes and may raise to stop: reserving a large pool takes tens of
    milliseconds on a busy machine, and the peer may die meanwhile."""
    chunk = size if keep_going is None else _CHUNK
    off = 0
    try:
        while off < size:
            n = min(chunk, size - off)
            os.posix_fallocate(fd, off, n)
            off += n
            if keep_going is not None and off < size:
                keep_going()
        return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    # no fallocate on this filesystem: size the file and write every page once
    os.ftruncate(fd, size)
    zeros = bytes(min(size, 1 << 20))
    off = 0
    while off < size:
        off += os.pwrite(fd, zeros[: size - off], off)
        if keep_going is not None and off % _CHUNK < len(zeros) and off < size:
            keep_going()


class Segment:
    """A mapped shared-memory segment.  ``buf`` is the ``mmap``."""

    __slots__ = ("name", "size", "buf", "created", "_unlinked", "__weakref__")

    def __init__(self, name: str, size: int, buf: mmap.mmap, created: bool) -> None:
        self.name = name
        self.size = size
        self.buf = buf
        self.created = created
        self._unlinked = not created

    def __repr__(self) -> str:
        state = "closed" if self.buf.closed else "open"
        return f"<Segment {self.name} {self.size} bytes {state}>"

    @classmethod
    def create(cls, size: int, keep_going: Callable[[], None] | None = None) -> Segment:
        """Create, reserve and map a new segment of at least ``size`` bytes;
        ``keep_going`` may stop a long reservation (see :func:`_allocate`)."""
        if size <= 0:
            raise ValueError("segment size must be positive")
        size = _round_up(size)
        for _ in range(8):
            name = new_segment_name()
            try:
                shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
            except posix_ipc.ExistentialError:
                continue  # astronomically unlikely: a name collision
            break
        else:  # pragma: no cover
            raise SegmentError("could not find a free shared-memory name")
        try:
            try:
                _allocate(shm.fd, size, keep_going)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise SharedMemoryFull(
                        f"cannot reserve {size} bytes of shared memory in {SHM_DIR} "
                        f"({os.strerror(exc.errno)}): {SHM_DIR} is full or too small; "
                        f"free space there, remount it larger, or use smaller rings"
                    ) from None
                raise SegmentError(f"cannot reserve {size} bytes for {name}: {exc}") from exc
            buf = mmap.mmap(shm.fd, size)
        except BaseException:
            shm.close_fd()
            unlink_segment(name)
            raise
        shm.close_fd()
        return cls(name, size, buf, created=True)

    @classmethod
    def attach(cls, name: str, size: int) -> Segment:
        """Map the existing segment ``name``, which must have exactly ``size`` bytes."""
        if not is_segment_name(name):
            raise SegmentError(f"refusing to attach {name!r}: not a ringwire segment name")
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise SegmentError(f"shared-memory segment {name} does not exist") from None
        except posix_ipc.PermissionsError:
            raise SegmentError(f"no permission to open shared-memory segment {name}") from None
        try:
            st = os.fstat(shm.fd)
            if st.st_uid != os.geteuid():
                raise SegmentError(f"segment {name} belongs to uid {st.st_uid}, not to us")
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise SegmentError(
                    f"segment {name} is accessible to others (mode {stat.S_IMODE(st.st_mode):o})"
                )
            if st.st_size != size:
                raise SegmentError(
                    f"segment {name} has {st.st_size} bytes, the peer announced {size}"
                )
            buf = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        return cls(name, size, buf, created=False)

    def unlink(self) -> None:
        """Remove the name (the mapping stays valid).  Idempotent."""
        if not self._unlinked:
            self._unlinked = True
            unlink_segment(self.name)

    @property
    def unlinked(self) -> bool:
        return self._unlinked

    def close(self) -> bool:
        """Unmap.  ``False`` if views are still alive (the mapping then goes with them)."""
        if self.buf.closed:
            return True
        try:
            self.buf.close()
        except BufferError:
            return False
        return True


def pid_alive(pid: int) -> bool:
    """Is process ``pid`` alive (a zombie -- dead, not yet reaped -- counts as dead)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return True  # no /proc: trust kill()
    return stat_line[stat_line.rfind(b")") + 2 :][:1] != b"Z"


def stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Names (``/rw.<pid>.<12 hex>``) in ``shm_dir`` owned by our uid whose creator
    process is gone: what :func:`sweep` removes.  Nothing is touched."""
    stale: list[str] = []
    try:
        entries = sorted(os.listdir(shm_dir))
    except OSError:
        return stale
    uid = os.geteuid()
    for entry in entries:
        name = "/" + entry
        if not is_segment_name(name):
            continue
        if pid_alive(name_pid(name)):
            continue
        try:
            if os.stat(os.path.join(shm_dir, entry)).st_uid != uid:
                continue
        except OSError:
            continue
        stale.append(name)
    return stale


def sweep(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove ringwire segments whose creator process is gone; return their names.

    Only names of the form ``rw.<pid>.<12 hex>`` owned by our uid are considered
    (:func:`stale_segments` lists them without removing anything).
    """
    return [name for name in stale_segments(shm_dir) if unlink_segment(name)]
