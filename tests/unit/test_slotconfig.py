"""ringwire._pool.slotconfig: creating a slot pool where /dev/shm has no room."""

from __future__ import annotations

import os

import pytest
from chaos.workers import CHAOS_SLOTS

import ringwire


def test_a_slot_pool_that_does_not_fit_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """SharedMemoryFull for a slot pool names the pool and the remedies (it used to
    advise smaller rings)."""
    import errno

    from ringwire._pool.slotconfig import create_pool

    def full(fd: int, off: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setenv("RINGWIRE_SEGMENTS", "named")
    with pytest.raises(ringwire.SharedMemoryFull, match="/dev/shm") as info:
        create_pool(CHAOS_SLOTS)
    assert "tensor-slot pool (8 x 4 KiB, 4 x 64 KiB)" in str(info.value)
    monkeypatch.setenv("RINGWIRE_SEGMENTS", "auto")
    with pytest.raises(ringwire.SharedMemoryFull) as info:
        create_pool(CHAOS_SLOTS)
    assert "tensor-slot pool (8 x 4 KiB, 4 x 64 KiB)" in str(info.value)
    assert "slots=None" in str(info.value)


def test_copy_out_is_not_a_send_pool_setting() -> None:
    """copy_out is the receiving side's keyword (connect, listen, pair ends,
    subscribe), not a field of the send pool's configuration."""
    import dataclasses
    import inspect

    assert "copy_out" not in {f.name for f in dataclasses.fields(ringwire.SlotConfig)}
    with pytest.raises(TypeError, match="copy_out"):
        ringwire.SlotConfig(copy_out=True)  # type: ignore[call-arg]
    for fn in (ringwire.connect, ringwire.connect_sync, ringwire.listen, ringwire.listen_sync):
        assert inspect.signature(fn).parameters["copy_out"].default is False, fn
