"""Shared-memory segments: named POSIX ones (creation, attach checks, unlink, sweep,
full /dev/shm) with ``RINGWIRE_SEGMENTS=named``, and memory files (seals, descriptor
checks, no name anywhere, the memory limit named when full)."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from ringwire._errors import RingwireError, SegmentError, SharedMemoryFull
from ringwire._pool import segment as _segment
from ringwire._pool.segment import SHM_DIR, Segment, sweep, unlink_segment
from ringwire._wire.names import is_segment_name, name_pid, new_segment_name


def shm_path(name: str) -> str:
    return SHM_DIR + name


@pytest.fixture(autouse=True)
def named_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests of this module without a ``kind=`` are about named segments."""
    monkeypatch.setenv("RINGWIRE_SEGMENTS", "named")


def test_names():
    name = new_segment_name()
    assert is_segment_name(name)
    assert len(name) <= 31
    assert name_pid(name) == os.getpid()
    assert new_segment_name() != name
    for bad in (
        "rw.1.abcdefabcdef",
        "/rw.1.abc",
        "/rw.x.abcdefabcdef",
        "/rw.1.ABCDEFABCDEF",
        "/other",
        "/rw.0.abcdefabcdef",
        "/rw.1.abcdefabcdef/../x",
    ):
        assert not is_segment_name(bad), bad
    with pytest.raises(ValueError):
        name_pid("/nope")


def test_create_attach_unlink():
    seg = Segment.create(10000)
    try:
        assert seg.size % 4096 == 0 and seg.size >= 10000
        st = os.stat(shm_path(seg.name))
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == seg.size
        assert st.st_uid == os.geteuid()
        assert st.st_blocks * 512 >= seg.size  # reserved up front (fallocate)
        seg.buf[:5] = b"hello"
        other = Segment.attach(seg.name, seg.size)
        try:
            assert other.buf[:5] == b"hello"
            other.buf[5:6] = b"!"
            assert seg.buf[:6] == b"hello!"
            assert not other.created
            other.unlink()  # a no-op for an attacher
            assert os.path.exists(shm_path(seg.name))
        finally:
            assert other.close()
        seg.unlink()
        assert not os.path.exists(shm_path(seg.name))
        seg.unlink()  # idempotent
        assert seg.buf[:6] == b"hello!"  # the mapping outlives the name
    finally:
        seg.unlink()
        seg.close()
    assert seg.close()  # twice is fine
    assert "closed" in repr(seg)


def test_close_with_live_view_defers():
    seg = Segment.create(4096)
    seg.unlink()
    view = memoryview(seg.buf)
    assert not seg.close()  # a view is alive: the mapping goes with it
    view.release()
    assert seg.close()


def test_attach_checks():
    seg = Segment.create(4096)
    try:
        with pytest.raises(SegmentError, match="bytes"):
            Segment.attach(seg.name, 8192)
        with pytest.raises(SegmentError, match="not a ringwire segment name"):
            Segment.attach("/somebody-elses", 4096)
        os.chmod(shm_path(seg.name), 0o644)
        with pytest.raises(SegmentError, match="accessible"):
            Segment.attach(seg.name, 4096)
    finally:
        seg.unlink()
        seg.close()
    with pytest.raises(SegmentError, match="does not exist"):
        Segment.attach(seg.name, 4096)


def test_create_bad_size():
    with pytest.raises(ValueError):
        Segment.create(0)


def test_full_dev_shm_is_a_clear_error(monkeypatch):
    before = set(os.listdir(SHM_DIR))

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(SharedMemoryFull, match="/dev/shm") as ei:
        Segment.create(1 << 20)
    assert isinstance(ei.value, RingwireError)
    assert "1048576" in str(ei.value)
    assert set(os.listdir(SHM_DIR)) == before  # the name did not stay


def test_really_full_dev_shm():
    """Ask for more than /dev/shm holds: fallocate fails at once, no SIGBUS later."""
    vfs = os.statvfs(SHM_DIR)
    total = vfs.f_blocks * vfs.f_frsize
    if total == 0:  # pragma: no cover - unlimited tmpfs
        pytest.skip("/dev/shm has no size limit")
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(SharedMemoryFull):
        Segment.create(total + (1 << 30))
    assert set(os.listdir(SHM_DIR)) == before


def test_fallocate_unsupported_falls_back(monkeypatch):
    def nope(fd, offset, size):
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(os, "posix_fallocate", nope)
    seg = Segment.create(3 * 4096)
    try:
        assert os.fstat(os.open(shm_path(seg.name), os.O_RDONLY)).st_size == 3 * 4096
    finally:
        seg.unlink()
        seg.close()


def test_other_fallocate_error(monkeypatch):
    def broken(fd, offset, size):
        raise OSError(errno.EIO, "io")

    monkeypatch.setattr(os, "posix_fallocate", broken)
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(SegmentError):
        Segment.create(4096)
    assert set(os.listdir(SHM_DIR)) == before


def test_sweep_missing_dir(tmp_path):
    assert sweep(str(tmp_path / "nope")) == []


def test_unlink_segment_missing():
    assert unlink_segment(new_segment_name()) is False


def test_module_constants():
    assert _segment.SHM_DIR == "/dev/shm"


# -- memory files -----------------------------------------------------------------------

needs_memfd = pytest.mark.skipif(
    not _segment.memfd_supported(), reason="this system has no sealed memory files"
)


def _memfd_fds() -> set[int]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:rw."):
                out.add(int(fd))
        except OSError:
            pass
    return out


@needs_memfd
def test_memfd_has_no_name_is_sealed_and_maps_across_a_descriptor():
    before = set(os.listdir(SHM_DIR))
    seg = Segment.create(10000, kind="memfd")
    try:
        assert seg.kind == "memfd" and seg.unlinked and seg.fd >= 0
        assert set(os.listdir(SHM_DIR)) == before  # no name, ever
        st = os.fstat(seg.fd)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == seg.size == 12288
        assert st.st_blocks * 512 >= seg.size  # reserved up front
        import fcntl

        seals = fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 4096)  # nobody can shrink it under a mapping
        assert os.readlink(f"/proc/self/fd/{seg.fd}").startswith("/memfd:rw.")
        assert name_pid(seg.name) == os.getpid()
        seg.buf[:5] = b"hello"
        other = Segment.from_fd(seg.fd, seg.name, seg.size, "memfd")
        try:
            assert other.buf[:5] == b"hello" and other.fd == -1
        finally:
            assert other.close()
        seg.close_fd()
        seg.close_fd()  # idempotent
        assert seg.buf[:5] == b"hello"  # the mapping keeps the memory
    finally:
        seg.close()
    assert not _memfd_fds() & {seg.fd}


@needs_memfd
def test_a_received_descriptor_of_the_wrong_kind_is_refused(tmp_path):
    import fcntl

    r, w = os.pipe()
    reg = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(reg, 4096)
    plain = os.memfd_create("rw.1.aaaaaaaaaaaa", os.MFD_CLOEXEC)  # no sealing at all
    os.fchmod(plain, 0o600)
    os.ftruncate(plain, 4096)
    short = Segment.create(4096, kind="memfd")
    wsealed = os.memfd_create("x", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.fchmod(wsealed, 0o600)
    os.ftruncate(wsealed, 4096)
    fcntl.fcntl(wsealed, fcntl.F_ADD_SEALS, _segment.SEALS | fcntl.F_SEAL_WRITE)
    try:
        cases = [
            (r, "not a shared-memory file"),
            (reg, "a file on a disk"),
            (plain, "not sealed"),
            (short.fd, "has 4096 bytes, the peer announced 8192"),
            (wsealed, "sealed against writing"),
        ]
        for fd, why in cases:
            size = 8192 if fd == short.fd else 4096
            with pytest.raises(SegmentError, match=why):
                Segment.from_fd(fd, "memfd:rw.1.aaaaaaaaaaaa", size, "memfd")
        with pytest.raises(SegmentError, match="Bad file descriptor"):
            Segment.from_fd(987654, "memfd:rw.1.aaaaaaaaaaaa", 4096, "memfd")
    finally:
        for fd in (r, w, reg, plain, wsealed):
            os.close(fd)
        short.close()


@needs_memfd
def test_a_full_memory_limit_names_it(monkeypatch):
    def full(fd, offset, size):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(os, "posix_fallocate", full)
    held = _memfd_fds()
    with pytest.raises(SharedMemoryFull, match="memory files are limited by") as ei:
        Segment.create(1 << 20, kind="memfd")
    assert "1048576" in str(ei.value) and "/dev/shm" not in str(ei.value)
    assert _memfd_fds() == held  # the descriptor did not stay


def test_the_kind_switch(monkeypatch):
    monkeypatch.setenv("RINGWIRE_SEGMENTS", "named")
    assert _segment.segment_kind() == "named"
    seg = Segment.create(4096)
    assert seg.kind == "named" and os.path.exists(shm_path(seg.name))
    seg.unlink()
    assert seg.close()
    monkeypatch.setenv("RINGWIRE_SEGMENTS", "bogus")
    with pytest.raises(SegmentError, match="RINGWIRE_SEGMENTS='bogus'"):
        _segment.segment_kind()
    monkeypatch.delenv("RINGWIRE_SEGMENTS")
    expected = "memfd" if _segment.memfd_supported() else "named"
    assert _segment.segment_kind() == expected
    monkeypatch.setattr(_segment, "_memfd_ok", False)
    assert _segment.segment_kind() == "named"
    monkeypatch.setenv("RINGWIRE_SEGMENTS", "memfd")
    with pytest.raises(SegmentError, match="no sealed memory files"):
        _segment.segment_kind()
