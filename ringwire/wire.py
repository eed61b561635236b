"""What ringwire's wire format is made of: for tools that read or forge frames.

An application never needs these names to send and receive records: it sends arrays
and tensors, and receives arrays and tensors.  They are public for what looks at the
wire itself -- a protocol test, a fuzzer, a peer written in another language, a tool
that inspects a captured frame:

``ExtCode``
    the msgpack extension types ringwire's codec uses (the table is in
    ``ringwire/_wire/ext.py``).
``SlotRef``, ``CudaRef``
    Ext 4 / Ext 5: an array in a shared-memory slot / a CUDA tensor in a GPU pool
    of the sender, by reference (pool, slot, generation, byte range, shape, dtype).
``NetRef``, ``NixlRef``
    Ext 20 / Ext 21: over TCP, an array that travels as a frame of its own beside
    the record / that the receiver reads with NIXL from the sender's memory.

Every descriptor is versioned (its first field); a decoder refuses a version it does
not know.  A receiver checks every reference against what its transport owns, so a
forged one is a :class:`ringwire.DecodeError`, never a read outside the connection.
"""

from __future__ import annotations

from ._wire.descriptors import CudaRef, NetRef, NixlRef, SlotRef
from ._wire.ext import ExtCode

__all__ = ["CudaRef", "ExtCode", "NetRef", "NixlRef", "SlotRef"]
