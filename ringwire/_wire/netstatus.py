"""The layout of a process's TCP status table: what ``python -m ringwire inspect`` reads.

A process that opens a TCP connection creates one small shared-memory segment (and
unlinks its name at once: nothing can be left behind), a table of fixed-size slots,
one per open connection (:mod:`ringwire._net.status` writes it).  ``inspect`` finds it
in ``/proc/<pid>/maps`` like any ringwire segment and reads it through
``/proc/<pid>/mem``.  Pure layout: no I/O here.

Header (:data:`HEADER_SIZE` bytes): magic ``RWNETS\\0\\0``, version, slot count, the
creator's pid.  Slot (:data:`SLOT_SIZE` bytes): :data:`WORDS` unsigned 64-bit words
(native order, each written by one store: a reader sees every word whole, though not
all words of one moment), then three NUL-padded UTF-8 strings.  Times are
``CLOCK_MONOTONIC`` nanoseconds, one clock for every process of the host.
"""

from __future__ import annotations

import struct
from typing import Any

__all__ = [
    "FREE",
    "GONE",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "NSLOTS",
    "OPEN",
    "SEGMENT_SIZE",
    "SLOT_SIZE",
    "STRINGS",
    "VERSION",
    "WORDS",
    "parse",
    "word",
]

MAGIC = b"RWNETS"
VERSION = 1
HEADER = struct.Struct("=8sIII")  # magic, version, slots, creator pid
HEADER_SIZE = 256
SLOT_SIZE = 320
SEGMENT_SIZE = 16384
NSLOTS = (SEGMENT_SIZE - HEADER_SIZE) // SLOT_SIZE

FREE, OPEN, GONE = 0, 1, 2  # a slot's state

WORDS = (
    "state",  # FREE / OPEN / GONE (the peer hung up; the connection is not closed yet)
    "generation",  # bumped each time the slot is taken
    "opened_ns",
    "heard_ns",  # when the last message from the peer arrived
    "heartbeat_ms",  # the liveness bound
    "send_capacity",  # the credit window: record bytes in flight at most
    "sent",  # record bytes sent (payload + 4 each)
    "acked",  # record bytes the peer has credited
    "receive_capacity",
    "consumed",  # record bytes read here
    "inbox_bytes",  # record bytes received here, not read yet
    "inbox_records",
    "array_budget",  # bytes of arrays this side may have out (its send pool)
    "array_bytes_out",  # bytes of arrays sent and not released, or on loan
    "peer_pid",
    "server",  # 1: the accepting side
)
_INDEX = {name: i for i, name in enumerate(WORDS)}
STRINGS = (("peer", 48), ("local", 48), ("address", 96))  # name, bytes (after the words)
_WORDS = struct.Struct(f"={len(WORDS)}Q")
assert _WORDS.size + sum(n for _, n in STRINGS) <= SLOT_SIZE


def word(name: str) -> int:
    """The index of word ``name`` in a slot (for a ``memoryview.cast("Q")``)."""
    return _INDEX[name]


def string_offsets() -> dict[str, tuple[int, int]]:
    """``name -> (offset in the slot, size)`` of the slot's strings."""
    out, off = {}, _WORDS.size
    for name, n in STRINGS:
        out[name] = (off, n)
        off += n
    return out


def parse(data: bytes) -> tuple[int, list[dict[str, Any]]]:
    """The creator pid and the taken slots of a status table.  Raises ``ValueError``
    for anything that is not one."""
    if len(data) < HEADER_SIZE:
        raise ValueError(f"a TCP status table of {len(data)} bytes")
    magic, version, nslots, pid = HEADER.unpack_from(data, 0)
    if magic[:6] != MAGIC:
        raise ValueError("bad TCP status table magic")
    if version != VERSION:
        raise ValueError(f"TCP status table version {version}, not {VERSION}")
    if not 0 < nslots <= (len(data) - HEADER_SIZE) // SLOT_SIZE:
        raise ValueError(f"a TCP status table claims {nslots} slots")
    strings = string_offsets()
    rows = []
    for i in range(nslots):
        base = HEADER_SIZE + i * SLOT_SIZE
        values = dict(zip(WORDS, _WORDS.unpack_from(data, base)))
        if values["state"] not in (OPEN, GONE):
            continue
        for name, (off, n) in strings.items():
            raw = data[base + off : base + off + n]
            values[name] = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
        values["slot"] = i
        rows.append(values)
    return pid, rows
