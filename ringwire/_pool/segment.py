"""Shared-memory segments: memory files and named POSIX segments.

A segment is one of two kinds (:func:`segment_kind` says which a new one is):

``"memfd"`` (Linux, the default)
    a *memory file* (``memfd_create``): it has no name in any file system, lives in the
    kernel's internal shared-memory mount (so ``/dev/shm``'s size does not limit it; it
    is charged to the memory cgroup like any memory), and reaches the peer as a file
    descriptor over the connection's Unix control socket (``SCM_RIGHTS``).  It is
    created mode 0600, reserved with ``posix_fallocate``, then sealed against shrinking
    and growing (``F_SEAL_SHRINK | F_SEAL_GROW``, then ``F_SEAL_SEAL``): a peer cannot
    truncate it under the other side's mapping (which would be a SIGBUS on touch).  The
    kernel frees it when the last descriptor and mapping are gone, whatever killed
    whom, at any instant: there is nothing to leak and nothing to sweep.  Its name
    (``rw.<pid>.<12 hex>``, seen as ``/memfd:rw.… (deleted)`` in ``/proc/<pid>/maps``
    and ``/proc/<pid>/fd``) is only a label for ``python -m ringwire inspect``.
``"named"`` (the portable path; ``RINGWIRE_SEGMENTS=named`` chooses it on Linux)
    a ``posix_ipc.SharedMemory`` object (``/dev/shm/<name>``), never
    ``multiprocessing.shared_memory`` (whose resource tracker, before Python 3.13,
    unlinks segments that another process created).  The rules below keep its name's
    life short.

Named segments:

* Names are short (at most 31 characters, the macOS limit), unguessable, and embed the
  creator's pid: ``/rw.<pid>.<12 hex digits>``.  :func:`sweep` uses the pid to remove
  the names of creators that are gone.
* Creation is ``O_CREAT | O_EXCL`` with mode 0600, then ``posix_fallocate`` of the
  whole size *before* mapping: on a full ``/dev/shm`` this fails at once with
  :class:`SharedMemoryFull` instead of a SIGBUS on first touch later.
* The file descriptor is closed right after ``mmap``; the mapping keeps the memory.
  (A memory file keeps its descriptor until :meth:`Segment.close_fd`: the handshake
  sends it to the peer first.)
* Attaching checks that the segment belongs to our uid, is not accessible to anybody
  else, and has the announced size.
* The creator unlinks the name as soon as every peer has attached (the handshake tells
  it when), so normally nothing stays in ``/dev/shm`` while the connection lives.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
from collections.abc import Callable

import posix_ipc

from .._errors import SegmentError, SharedMemoryFull
from .._wire.names import is_segment_name, name_pid, new_segment_name
from .cgroup import read_memory_limit

__all__ = [
    "KINDS",
    "SEALS",
    "SHM_DIR",
    "Segment",
    "check_descriptor",
    "memfd_supported",
    "memory_limit",
    "pid_alive",
    "HUGE_PAGE",
    "SHORT_OF_MEMORY",
    "huge_pages_on_shmem",
    "populate_huge",
    "segment_kind",
    "thp_shmem",
    "stale_segments",
    "sweep",
    "unlink_segment",
]

SHM_DIR = "/dev/shm"
KINDS = ("memfd", "named")
ENV_KIND = "RINGWIRE_SEGMENTS"
_PAGE = mmap.PAGESIZE
_MEMFD_PREFIX = "memfd:"

# the seals every memory file carries before a peer sees it (and a received one must)
SEALS = (
    getattr(fcntl, "F_SEAL_SHRINK", 0x2)
    | getattr(fcntl, "F_SEAL_GROW", 0x4)
    | getattr(fcntl, "F_SEAL_SEAL", 0x1)
)
_F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
_MUST_HAVE = SEALS & ~getattr(fcntl, "F_SEAL_SEAL", 0x1)  # shrink and grow
# seals that would make a writable shared mapping impossible
_NO_WRITE = getattr(fcntl, "F_SEAL_WRITE", 0x8) | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)

_memfd_ok: bool | None = None


def memfd_supported() -> bool:
    """Can this process make sealed memory files (Linux ``memfd_create`` with
    ``MFD_ALLOW_SEALING``)?  Tried once, then remembered."""
    global _memfd_ok
    if _memfd_ok is None:
        try:
            fd = os.memfd_create("rw.probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (AttributeError, OSError):
            _memfd_ok = False
        else:
            try:
                fcntl.fcntl(fd, _F_ADD_SEALS, SEALS)
                _memfd_ok = True
            except OSError:
                _memfd_ok = False
            finally:
                os.close(fd)
    return _memfd_ok


def segment_kind() -> str:
    """The kind of segment this process creates: ``"memfd"`` where memory files work,
    else ``"named"``; the environment variable ``RINGWIRE_SEGMENTS=named`` chooses named
    POSIX segments explicitly (``=memfd`` insists on memory files).  Raises
    :class:`SegmentError` for another value, or ``memfd`` where there are none."""
    want = os.environ.get(ENV_KIND, "").strip().lower()
    if want in ("", "auto"):
        return "memfd" if memfd_supported() else "named"
    if want not in KINDS:
        raise SegmentError(
            f"{ENV_KIND}={want!r} is not a segment kind: use 'memfd', 'named' or 'auto'"
        )
    if want == "memfd" and not memfd_supported():
        raise SegmentError(
            f"{ENV_KIND}=memfd, but this system has no sealed memory files "
            "(memfd_create): unset it to use named segments in /dev/shm"
        )
    return want


def memory_limit() -> str:
    """Words for the limit a memory file's reservation runs into: the memory cgroup's
    (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``, the smallest of its cgroup and
    their ancestors) where one is set, else the machine's memory."""
    reading = read_memory_limit()
    if reading["limit"] is not None:
        return (
            f"the memory cgroup's limit ({reading['where']}: {reading['limit']} bytes, "
            f"cgroup v{reading['version']})"
        )
    return "the machine's memory (no memory cgroup limit applies)"


HUGE_PAGE = _HUGE = 2 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14 (not in Python 3.11's mmap module)
_SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def thp_shmem() -> str:
    """The kernel's policy for transparent huge pages on shared memory (the word in
    brackets in ``shmem_enabled``: ``always``, ``within_size``, ``advise``, ``never``,
    ``deny``, ``force``), or ``""`` where there is none."""
    try:
        with open(_SHMEM_ENABLED) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def huge_pages_on_shmem() -> bool:
    """May a memory file's mapping ask for transparent huge pages (``MADV_HUGEPAGE``)?
    Asked at every creation: an administrator may change it while we run."""
    return thp_shmem() in ("always", "within_size", "advise", "force")


def populate_huge(buf: mmap.mmap, size: int, keep_going: Callable[[], None] | None = None) -> None:
    """Ask for transparent huge pages on mapping ``buf`` (``MADV_HUGEPAGE``) and reserve
    its first ``size`` bytes by faulting every page in (``MADV_POPULATE_WRITE``, in
    chunks that ask ``keep_going``): the faults take huge pages where the kernel has
    them, where ``posix_fallocate`` would take small pages, and a shortage is an
    ``OSError`` (``ENOMEM``, ``EFAULT``, ``ENOSPC``), never a SIGBUS.  ``EINVAL`` /
    ``ENOSYS`` / ``EOPNOTSUPP``: the kernel cannot populate (older than 5.14)."""
    buf.madvise(mmap.MADV_HUGEPAGE)
    off = 0
    while off < size:
        n = min(_CHUNK, size - off)
        buf.madvise(_MADV_POPULATE_WRITE, off, n)
        off += n
        if keep_going is not None and off < size:
            keep_going()


_CANNOT_POPULATE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)
SHORT_OF_MEMORY = (errno.ENOMEM, errno.EFAULT, errno.ENOSPC)


def _populate_huge(fd: int, size: int, keep_going: Callable[[], None] | None) -> mmap.mmap | None:
    """Size memory file ``fd``, map it and reserve it with :func:`populate_huge`.
    ``None`` when the kernel cannot populate: the caller reserves the plain way.
    Raises :class:`SharedMemoryFull` when the memory cannot be had."""
    os.ftruncate(fd, size)
    buf = mmap.mmap(fd, size)
    try:
        populate_huge(buf, size, keep_going)
    except OSError as exc:
        buf.close()
        if exc.errno in _CANNOT_POPULATE:
            os.ftruncate(fd, 0)
            return None
        if exc.errno in SHORT_OF_MEMORY:
            raise _full(exc, size, "memfd") from None
        raise SegmentError(f"cannot reserve {size} bytes of a memory file: {exc}") from exc
    except BaseException:
        buf.close()
        raise
    return buf


def unlink_segment(name: str) -> bool:
    """Remove ``name`` from ``/dev/shm``; ``False`` if it was already gone (or it is
    a memory file's label, which names nothing)."""
    if name.startswith(_MEMFD_PREFIX):
        return False
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


def _full(exc: OSError, size: int, kind: str) -> SharedMemoryFull:
    if kind == "memfd":
        where = f"memory files are limited by {memory_limit()}"
        fix = "free memory, raise that limit, or use smaller rings and slot pools"
    else:
        where = f"{SHM_DIR} is full or too small"
        fix = "free space there, remount it larger, or use smaller rings"
        if memfd_supported():
            fix += f" (or unset {ENV_KIND}: memory files do not use {SHM_DIR})"
    return SharedMemoryFull(
        f"cannot reserve {size} bytes of shared memory ({kind} segment: "
        f"{os.strerror(exc.errno or 0)}): {where}; {fix}"
    )


class Segment:
    """A mapped shared-memory segment.  ``buf`` is the ``mmap``; ``kind`` is
    ``"memfd"`` or ``"named"``; ``fd`` is a memory file's descriptor while this side
    still holds it (-1 otherwise)."""

    __slots__ = ("name", "size", "buf", "created", "kind", "fd", "_unlinked", "__weakref__")

    def __init__(
        self,
        name: str,
        size: int,
        buf: mmap.mmap,
        created: bool,
        kind: str = "named",
        fd: int = -1,
    ) -> None:
        self.name = name
        self.size = size
        self.buf = buf
        self.created = created
        self.kind = kind
        self.fd = fd
        self._unlinked = not created or kind == "memfd"

    def __repr__(self) -> str:
        state = "closed" if self.buf.closed else "open"
        return f"<Segment {self.name} {self.size} bytes {state}>"

    @classmethod
    def create(
        cls, size: int, keep_going: Callable[[], None] | None = None, kind: str | None = None
    ) -> Segment:
        """Create, reserve and map a new segment of at least ``size`` bytes, of ``kind``
        (default: :func:`segment_kind`); ``keep_going`` may stop a long reservation (see
        :func:`_allocate`).  Raises :class:`SharedMemoryFull` (naming the limit that
        applies) and :class:`SegmentError`."""
        if size <= 0:
            raise ValueError("segment size must be positive")
        size = _round_up(size)
        kind = segment_kind() if kind is None else kind
        if kind == "memfd":
            return cls._create_memfd(size, keep_going)
        if kind != "named":
            raise ValueError(f"segment kind must be one of {KINDS}, not {kind!r}")
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
                    raise _full(exc, size, "named") from None
                raise SegmentError(f"cannot reserve {size} bytes for {name}: {exc}") from exc
            buf = mmap.mmap(shm.fd, size)
        except BaseException:
            shm.close_fd()
            unlink_segment(name)
            raise
        shm.close_fd()
        return cls(name, size, buf, created=True)

    @classmethod
    def _create_memfd(cls, size: int, keep_going: Callable[[], None] | None) -> Segment:
        label = new_segment_name()[1:]
        try:
            fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise SegmentError(
                    f"cannot create a memory file: {exc.strerror} (raise the limit on "
                    "open files: ulimit -n)"
                ) from None
            raise SegmentError(f"cannot create a memory file: {exc}") from exc
        try:
            os.fchmod(fd, 0o600)
            buf = None
            if size >= _HUGE and huge_pages_on_shmem():
                buf = _populate_huge(fd, size, keep_going)
            if buf is None:
                try:
                    _allocate(fd, size, keep_going)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                        raise _full(exc, size, "memfd") from None
                    raise SegmentError(f"cannot reserve {size} bytes for {label}: {exc}") from exc
            fcntl.fcntl(fd, _F_ADD_SEALS, SEALS)
            if buf is None:
                buf = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(_MEMFD_PREFIX + label, size, buf, created=True, kind="memfd", fd=fd)

    @classmethod
    def attach(cls, name: str, size: int) -> Segment:
        """Map the existing named segment ``name``, which must have exactly ``size``
        bytes.  Raises :class:`SegmentError`."""
        if not is_segment_name(name):
            raise SegmentError(f"refusing to attach {name!r}: not a ringwire segment name")
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise SegmentError(f"shared-memory segment {name} does not exist") from None
        except posix_ipc.PermissionsError:
            raise SegmentError(f"no permission to open shared-memory segment {name}") from None
        try:
            return cls._map_checked(shm.fd, name, size, "named")
        finally:
            shm.close_fd()

    @classmethod
    def from_fd(cls, fd: int, name: str, size: int, kind: str) -> Segment:
        """Map the segment a peer passed as descriptor ``fd`` (which stays the
        caller's to close), checked by :func:`check_descriptor`.  Raises
        :class:`SegmentError`."""
        check_descriptor(fd, name, size, kind)
        return cls._map(fd, name, size, kind)

    @classmethod
    def _map_checked(cls, fd: int, name: str, size: int, kind: str) -> Segment:
        _check_owner_and_size(os.fstat(fd), name, size)
        return cls._map(fd, name, size, kind)

    @classmethod
    def _map(cls, fd: int, name: str, size: int, kind: str) -> Segment:
        try:
            buf = mmap.mmap(fd, size)
        except (OSError, ValueError) as exc:
            raise SegmentError(f"cannot map segment {name}: {exc}") from None
        return cls(name, size, buf, created=False, kind=kind)

    def close_fd(self) -> None:
        """Close a memory file's descriptor (the mapping keeps the memory; the peer
        has its own).  Idempotent."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the name (the mapping stays valid).  Idempotent; nothing for a
        memory file."""
        if not self._unlinked:
            self._unlinked = True
            unlink_segment(self.name)

    @property
    def unlinked(self) -> bool:
        return self._unlinked

    def close(self) -> bool:
        """Unmap (and close a memory file's descriptor).  ``False`` if views are
        still alive (the mapping then goes with them)."""
        self.close_fd()
        if self.buf.closed:
            return True
        try:
            self.buf.close()
        except BufferError:
            return False
        return True


def _check_owner_and_size(st: os.stat_result, name: str, size: int) -> None:
    if st.st_uid != os.geteuid():
        raise SegmentError(f"segment {name} belongs to uid {st.st_uid}, not to us")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise SegmentError(
            f"segment {name} is accessible to others (mode {stat.S_IMODE(st.st_mode):o})"
        )
    if st.st_size != size:
        raise SegmentError(f"segment {name} has {st.st_size} bytes, the peer announced {size}")


def check_descriptor(fd: int, name: str, size: int, kind: str) -> None:
    """Check a segment a peer passed as descriptor ``fd``: a sealed memory file
    (``kind="memfd"``) or a named segment's descriptor whose name is gone (``"named"``,
    a broadcast join's), ours, not accessible to others, of exactly ``size`` bytes.
    Raises :class:`SegmentError` naming what is wrong: not a regular file (a pipe, a
    socket), a file on a disk, a memory file without the seals (or with a write
    seal), another owner, the wrong size."""
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise SegmentError(f"descriptor for segment {name!r:.80}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SegmentError(
            f"the descriptor for segment {name!r:.80} is not a shared-memory file "
            f"(file type {stat.S_IFMT(st.st_mode):o})"
        )
    try:
        seals = fcntl.fcntl(fd, _F_GET_SEALS)
    except OSError:
        raise SegmentError(
            f"the descriptor for segment {name!r:.80} is not a shared-memory file "
            "(a file on a disk, not a memory file or /dev/shm)"
        ) from None
    if kind == "memfd":
        if seals & _MUST_HAVE != _MUST_HAVE:
            raise SegmentError(
                f"memory file {name!r:.80} is not sealed against shrinking and growing "
                f"(seals {seals:#x}): a peer could truncate it under this side"
            )
        if seals & _NO_WRITE:
            raise SegmentError(f"memory file {name!r:.80} is sealed against writing")
    _check_owner_and_size(st, name, size)


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
