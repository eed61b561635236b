"""POSIX shared-memory segments: creation, attach checks, unlink, sweep, full /dev/shm."""

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
