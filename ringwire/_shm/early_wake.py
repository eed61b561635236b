"""Waking a parked reader before a large copy-in ends, so its wake-up overlaps the copy.

A copy-in (``send`` of a private array into a slot) of :data:`LARGE_COPY` bytes or
more is done in two parts.  Between them the writer

1. stores the ring's *copy hint* (header word ``COPY_HINT`` of the lane it writes, see
   :mod:`ringwire._wire.ring`): the ``CLOCK_MONOTONIC`` nanoseconds by which it expects
   to publish the record -- the rest of the copy at a conservative
   :data:`ASSUMED_BYTES_PER_NS`, plus :data:`SLACK_NS`;
2. rings the doorbell if the reader is parked (the eventcount's own test, so the
   park it rings for is not rung again when the record is published; a reader that
   parks again later gets a fresh doorbell as always).

The reader (:func:`ringwire._conn.waits.receive`) wakes while the last
:data:`WAKE_BYTES` are copied, finds the ring empty, sees the hint and spins until
the record lands or the hint's time passes (at most :data:`MAX_SPIN_NS`), instead of
parking again.  So a parked reader's wake-up -- tens to hundreds of microseconds on a
loaded machine -- is paid during the copy, not after it.  The early doorbell is an
ordinary ``D`` ("re-check the rings"): a reader that does not know the hint wakes,
finds nothing, parks again and is rung at the publish, as before.  The hint is only
ever a hint: a stale or absurd value makes a reader spin at most
:data:`MAX_SPIN_NS` per wait, and never changes what it receives.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .._wire.control import DOORBELL_DATA
from .._wire.ring import COPY_HINT

__all__ = [
    "ASSUMED_BYTES_PER_NS",
    "LARGE_COPY",
    "MAX_SPIN_NS",
    "SLACK_NS",
    "WAKE_BYTES",
    "EarlyWake",
    "copy_bytes",
]

LARGE_COPY = 2 << 20  # copy-ins at least this large wake the reader before they end
WAKE_BYTES = 1 << 20  # the part copied after the reader was woken
ASSUMED_BYTES_PER_NS = 2.0  # 2 GB/s: slower than any copy measured (5-11 GB/s here)
SLACK_NS = 100_000  # for the encoding and the publish after the copy
MAX_SPIN_NS = 2_000_000  # the longest a reader spins on one hint


class EarlyWake:
    """The hook a send pool calls before the last part of a large copy-in: sets the
    copy hint of ``lane`` (the ring the writer publishes into) and rings ``ring``
    (the transport's doorbell method, held weakly: the transport owns the pool that
    owns this) if the reader is parked."""

    __slots__ = ("_lane", "_ring", "woken")

    def __init__(self, lane: Any, ring: Callable[[bytes], bool]) -> None:
        self._lane = lane
        self._ring = weakref.WeakMethod(ring)
        self.woken = 0  # early doorbells rung (statistics, tests)

    def __call__(self, remaining: int) -> None:
        lane = self._lane
        until = time.monotonic_ns() + int(remaining / ASSUMED_BYTES_PER_NS) + SLACK_NS
        try:
            lane.header[COPY_HINT] = until
            if lane.reader_needs_doorbell():  # fences, then reads the parked flag
                ring = self._ring()
                if ring is not None:
                    self.woken += 1
                    ring(DOORBELL_DATA)  # a failed ring: the publish will notice
        except ValueError:  # the lane's views were released: the transport closed
            pass


def copy_bytes(src: Any, dst: Any, nbytes: int, wake: Callable[[int], None] | None) -> None:
    """Copy ``nbytes`` from ``src`` to ``dst`` (uint8 arrays); when ``wake`` is given
    and the copy is large, in two parts with ``wake(bytes left)`` between them."""
    if wake is None or nbytes < LARGE_COPY:
        np.copyto(dst, src, casting="no")
        return
    cut = nbytes - WAKE_BYTES
    np.copyto(dst[:cut], src[:cut], casting="no")
    wake(WAKE_BYTES)
    np.copyto(dst[cut:], src[cut:], casting="no")
