"""Counting a ring's records by walking its frames, for the views from outside the
hot path (``python -m ringwire top``, the metrics of :mod:`ringwire.metrics`).

A ring's header counts bytes, not records (see :mod:`ringwire._wire.ring`): the
records between two counters are found by following the frames' length words from
one counter to the other, wrap markers included.  The walk reads a copy of the bytes
and checks the chain: a chain that does not end exactly at the second counter (the
ring moved under the reader, or its bytes are not frames) is ``None``, never a wrong
count.  Bounded by the caller: a walk costs a Python step per record (about half a
microsecond).
"""

from __future__ import annotations

import struct
from typing import Any

from .ring import HEADER_WORDS, WRAP_MARKER, frame_size, max_payload

__all__ = ["count_frames", "unread_records"]

_U32 = struct.Struct("=I")
_TAIL = HEADER_WORDS["tail"]
_HEAD = HEADER_WORDS["head"]


def count_frames(data: bytes, start: int, capacity: int) -> int | None:
    """The frames in ``data``: the bytes of a ring of ``capacity`` from counter
    ``start`` on (taken modulo the capacity: ``data`` is what lies between two
    counters, however it wraps), or ``None`` when they are not a valid chain of frames
    that ends exactly at the end of ``data``."""
    limit = max_payload(capacity)
    mask = capacity - 1
    rel, n, end = 0, 0, len(data)
    while rel < end:
        off = (start + rel) & mask
        if rel + 4 > end:
            return None
        (length,) = _U32.unpack_from(data, rel)
        if length == WRAP_MARKER:
            rel += capacity - off
            continue
        size = frame_size(length)
        if length > limit or off + size > capacity:
            return None
        rel += size
        n += 1
    return n if rel == end else None


def unread_records(lane: Any, max_frames: int = 1024) -> int | None:
    """The records published in ``lane`` (a :class:`~ringwire._wire.ring.RingWriter`
    or :class:`~ringwire._wire.ring.RingReader` of this process, or a broadcast
    reader: from its own head, ``own_head``) and not consumed: a snapshot, from any
    thread, without touching the lane's state.

    The frames' length words are followed in place from the reader's head: exact up
    to ``max_frames`` frames; past them, the rest of the unread bytes are counted at
    the walked frames' mean size (an estimate, rounded).  ``None`` when the reader
    moved during the walk twice running (the writer may have reused what was walked)
    or the bytes are not a chain of frames."""
    q, data, capacity = lane.header, lane.data, lane.capacity
    mask, limit = capacity - 1, max_payload(capacity)
    own = hasattr(type(lane), "own_head")  # a broadcast reader (its header: the horizon)

    def head_now() -> int:
        return int(lane.own_head) if own else int(q[_HEAD])

    for _ in range(2):
        head, tail = head_now(), q[_TAIL]
        if not head <= tail <= head + capacity:
            return None
        at, n = head, 0
        while at < tail and n < max_frames:
            off = at & mask
            if off + 4 > capacity:
                break  # (a torn word: not a frame boundary)
            (length,) = _U32.unpack_from(data, off)
            if length == WRAP_MARKER:
                at += capacity - off
                continue
            if length > limit or off + frame_size(length) > capacity:
                break
            at += frame_size(length)
            n += 1
        if head_now() != head:  # the writer may have reused what was walked: again
            continue
        if at == tail:
            return n
        if n < max_frames or at > tail:
            return None  # not a chain of frames that ends at the tail
        return n + round((tail - at) * n / (at - head))
    return None
