"""ringwire: typed msgpack records and zero-copy tensors over shared-memory rings.

The public API is what ``__all__`` lists; every ``ringwire._*`` module is private.
"""

from __future__ import annotations

from anyio import BrokenResourceError, ClosedResourceError, EndOfStream, WouldBlock

from ._channel import (
    DEFAULT_CAPACITY,
    DEFAULT_SPIN_US,
    Channel,
    ChannelStatistics,
    Listener,
    ListenerStatistics,
    PairEnd,
    SyncChannel,
    SyncListener,
    connect,
    connect_sync,
    listen,
    pair,
)
from ._codec import Decoder, Encoder, decode, encode
from ._control import HandshakeError, PeerCredentialsError, ProtocolError
from ._descriptors import CudaRef, SlotRef
from ._errors import DecodeError, EncodeError, RingwireError
from ._ext import ExtCode
from ._record import Record
from ._ringlayout import FrameTooLarge, RingCorrupted
from ._segment import SegmentError, SharedMemoryFull
from ._segment import sweep as sweep_segments

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_SPIN_US",
    "BrokenResourceError",
    "Channel",
    "ChannelStatistics",
    "ClosedResourceError",
    "CudaRef",
    "DecodeError",
    "Decoder",
    "EncodeError",
    "Encoder",
    "EndOfStream",
    "ExtCode",
    "FrameTooLarge",
    "HandshakeError",
    "Listener",
    "ListenerStatistics",
    "PairEnd",
    "PeerCredentialsError",
    "ProtocolError",
    "Record",
    "RingCorrupted",
    "RingwireError",
    "SegmentError",
    "SharedMemoryFull",
    "SlotRef",
    "SyncChannel",
    "SyncListener",
    "WouldBlock",
    "__version__",
    "connect",
    "connect_sync",
    "decode",
    "encode",
    "listen",
    "pair",
    "sweep_segments",
]
