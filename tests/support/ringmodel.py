"""What a ring lane must do, from the layout's rules alone: the model of the ring's
model tests (tests/unit/test_ring.py, tests/unit/test_lanes.py).

The rules (the module docstring of :mod:`ringwire._wire.ring`): a frame of ``n`` bytes
takes ``frame_size(n)`` bytes at ``tail % capacity``; one that does not fit before the
end of the data area skips the rest of it (the skipped tail counts as used) and starts
at offset 0; a frame is written exactly when what it takes, skip included, is free
(``capacity - (tail - head)``); ``write_many`` writes a prefix, up to the first frame
that does not fit; the reader hands the frames back in order and its commit frees what
they took.  So the tests can assert that a write that fits *succeeds* and one that does
not fails, not only that what was written comes back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ringwire._wire.ring import frame_size

__all__ = ["RingModel"]


class RingModel:
    """A ring lane of ``capacity`` whose counters start at ``start`` (head == tail)."""

    def __init__(self, capacity: int, start: int = 0) -> None:
        self.capacity = capacity
        self.tail = self.head = start
        self.frames: deque[tuple[bytes, int]] = deque()  # (payload, bytes it took)
        self._read = 0  # bytes taken by the frames read since the last commit

    def __len__(self) -> int:
        return len(self.frames)

    def _takes(self, n: int) -> int:
        need = frame_size(n)
        to_end = self.capacity - self.tail % self.capacity
        return need if need <= to_end else to_end + need

    def fits(self, n: int) -> bool:
        """Would a payload of ``n`` bytes be written now?"""
        return self._takes(n) <= self.capacity - (self.tail - self.head)

    def write(self, payload: bytes) -> bool:
        """A ``try_write``: whether it must succeed (and then the frame is in)."""
        if not self.fits(len(payload)):
            return False
        took = self._takes(len(payload))
        self.frames.append((payload, took))
        self.tail += took
        return True

    def write_many(self, payloads: Sequence[bytes]) -> int:
        """A ``write_many``: how many frames it must write."""
        k = 0
        for p in payloads:
            if not self.write(p):
                break
            k += 1
        return k

    def read(self) -> bytes | None:
        """The next frame a reader must hand out (``None``: the ring is empty)."""
        if not self.frames:
            return None
        payload, took = self.frames.popleft()
        self._read += took
        return payload

    def commit(self) -> None:
        self.head += self._read
        self._read = 0

    def payloads(self) -> list[bytes]:
        return [p for p, _ in self.frames]
