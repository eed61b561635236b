"""ringwire: typed msgpack records and zero-copy tensors over shared-memory rings.

The public API is what ``__all__`` lists; every ``ringwire._*`` module is private.
"""

from __future__ import annotations

from anyio import BrokenResourceError, ClosedResourceError, EndOfStream, WouldBlock

from ._conn.async_channel import Channel, Receipt
from ._conn.connect import DEFAULT_CAPACITY, connect, connect_sync
from ._conn.endpoint import DEFAULT_SPIN_US
from ._conn.listener import Listener, SyncListener, listen
from ._conn.pair import PairEnd, pair
from ._conn.statistics import ChannelStatistics, ListenerStatistics
from ._conn.sync_channel import SyncChannel, SyncReceipt
from ._errors import (
    DecodeError,
    EncodeError,
    FrameTooLarge,
    HandshakeError,
    PeerCredentialsError,
    ProtocolError,
    RingCorrupted,
    RingwireError,
    SegmentError,
    SharedMemoryFull,
    SlotMisuse,
    SlotsExhausted,
)
from ._shm.segment import sweep as sweep_segments
from ._shm.slotconfig import DEFAULT_SLOTS, SlotConfig
from ._shm.views import borrow, copy_out, release
from ._wire.codec import Decoder, Encoder, decode, encode
from ._wire.descriptors import CudaRef, SlotRef
from ._wire.ext import ExtCode
from ._wire.record import Record
from ._wire.slotlayout import SlotClass

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
