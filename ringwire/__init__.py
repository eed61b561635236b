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
    Receipt,
    SyncChannel,
    SyncListener,
    SyncReceipt,
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
from ._slotlayout import SlotClass
from ._slots import (
    DEFAULT_SLOTS,
    SlotConfig,
    SlotMisuse,
    SlotsExhausted,
    borrow,
    copy_out,
    release,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_SLOTS",
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
    "Receipt",
    "Record",
    "RingCorrupted",
    "RingwireError",
    "SegmentError",
    "SharedMemoryFull",
    "SlotClass",
    "SlotConfig",
    "SlotMisuse",
    "SlotRef",
    "SlotsExhausted",
    "SyncChannel",
    "SyncListener",
    "SyncReceipt",
    "WouldBlock",
    "__version__",
    "borrow",
    "connect",
    "connect_sync",
    "copy_out",
    "decode",
    "encode",
    "listen",
    "pair",
    "release",
    "sweep_segments",
]
