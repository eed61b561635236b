"""ringwire: typed msgpack records and zero-copy tensors over shared-memory rings.

The public API is what ``__all__`` lists; every ``ringwire._*`` module is private.
"""

from __future__ import annotations

from anyio import BrokenResourceError, ClosedResourceError, EndOfStream, WouldBlock

from ._codec import Decoder, Encoder, decode, encode
from ._descriptors import CudaRef, SlotRef
from ._errors import DecodeError, EncodeError, RingwireError
from ._ext import ExtCode
from ._record import Record

__version__ = "0.1.0"

__all__ = [
    "BrokenResourceError",
    "ClosedResourceError",
    "CudaRef",
    "DecodeError",
    "Decoder",
    "EncodeError",
    "Encoder",
    "EndOfStream",
    "ExtCode",
    "Record",
    "RingwireError",
    "SlotRef",
    "WouldBlock",
    "__version__",
    "decode",
    "encode",
]
