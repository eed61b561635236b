"""Helpers of both halves of the channel tests (tests/unit/test_channel.py and
tests/process/test_channel.py): the small ring, the small default slot pool (an autouse
fixture: import it), a Record type and the /dev/shm names of given processes."""

from __future__ import annotations

import os

import pytest

from ringwire._pool.segment import SHM_DIR
from ringwire._pool.slotconfig import SlotConfig
from ringwire._wire.record import Record
from ringwire._wire.slotlayout import SlotClass

SMALL = 4096  # a small ring, to exercise wraparound and backpressure


@pytest.fixture(autouse=True)
def small_slot_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections made here get a small tensor-slot pool by default: the 81 MiB
    default pool costs ~30 ms of fallocate + unmap per side per connection, and these
    tests make hundreds of connections (tests/unit/test_slots.py covers slots, and the
    default pool).  Spawned children keep the real default."""
    monkeypatch.setattr(
        "ringwire._pool.slotconfig.default_slots", SlotConfig(classes=(SlotClass(64 * 1024, 4),))
    )


class Point(Record):
    x: int
    y: float
    tag: str = ""


def shm_names(*pids: int) -> set[str]:
    """ringwire names in /dev/shm created by ``pids`` (default: this process).

    Other processes on the machine (a concurrent test run, a benchmark) may come and
    go in /dev/shm meanwhile: only look at our own."""
    prefixes = tuple(f"rw.{pid}." for pid in (pids or (os.getpid(),)))
    return {n for n in os.listdir(SHM_DIR) if n.startswith(prefixes)}
