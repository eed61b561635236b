"""ringwire: typed msgpack records and zero-copy tensors over shared-memory rings.

The public API is what ``__all__`` lists (and :mod:`ringwire.wire`, the wire format's
descriptors, and :mod:`ringwire.runtime`, worker processes); every ``ringwire._*``
module is private.

One voice: the names every entry point uses
-------------------------------------------
Every async object has a blocking twin with the same methods and keywords (a blocking
call adds ``timeout=``): :class:`Channel` / :class:`SyncChannel`, :class:`Receipt` /
:class:`SyncReceipt`, :class:`Listener` / :class:`SyncListener` (:func:`listen` /
:func:`listen_sync`), :func:`connect` / :func:`connect_sync`, :class:`Broadcaster` /
:class:`SyncBroadcaster` (:func:`broadcast` / :func:`broadcast_sync`),
:class:`BroadcastReceipt` / :class:`SyncBroadcastReceipt`, :class:`Subscriber` /
:class:`SyncSubscriber` (:func:`subscribe` / :func:`subscribe_sync`), :class:`Client` /
:class:`SyncClient`, :func:`serve` and its blocking, thread-based twin.  The same idea
has the same keyword everywhere:

``handshake_timeout=``
    seconds the making of a connection may take, on every entry point that makes one
    (connect, listen, subscribe, broadcast, a pair end's connect, and their twins).
    A wait of one operation takes ``timeout=`` (the blocking drivers' ``receive``,
    ``send``, ``accept``, ``wait``, ``call``).
``type=``
    the type what arrives is decoded as (``Channel.receive(type=)``, ``connect``,
    ``listen``, ``subscribe``, ``Client``, ``serve``).
``backlog=``
    the socket's listen backlog, only (listen, broadcast); the calls a server has
    accepted and not started are its ``max_queued=``.
``slots=``
    this side's *send* pool (:class:`SlotConfig`; ``None``: every array inline).
``copy_out=``
    the *receiving* side's choice: arrays that arrive in the peer's slots are copied
    into private memory and the slots released at once (connect, listen, subscribe, a
    pair end's connect, and their twins; it needs no send pool of one's own).

A wait that timed out raises a :class:`TimeoutError`, whatever else it is
(:class:`SlotWaitTimeout`, :class:`ReaderStalled`, :class:`DeadlineExceeded`, a
blocking call's ``timeout=``); the state of a connection is said with anyio's
exceptions (``EndOfStream``, ``BrokenResourceError``, ``ClosedResourceError``,
``WouldBlock``); every other error ringwire raises on purpose is a
:class:`RingwireError` (the tree is in ``ringwire/_errors.py``).

How the package is built (imports point one way: down)::

    ringwire/__init__.py   the public names, re-exported from below
    ringwire/wire.py       the wire format's public descriptors (ringwire.wire)
    ringwire/metrics.py    metrics of every queue, to Prometheus / OpenTelemetry
    runtime/               ringwire.runtime: worker processes and their channels
    ringwire/demo/         python -m ringwire.demo;  ringwire/_cli.py: python -m ringwire
    ringwire/_conn/        one endpoint core and the drivers around it:
        transport.py       the seam: what a transport does and guarantees (read first)
        endpoint.py        the endpoint core: state, every operation that does not wait
        waits.py           every waiting loop, written once, as generators
        async_channel.py   Channel: the anyio driver (asyncio, trio, uvloop)
        sync_channel.py    SyncChannel: the blocking driver (threads, scripts)
        driving.py         what both drivers share (receipts, the facade)
        options.py         the keywords every connection-making entry point shares
        listener.py, sync_listener.py   Listener / SyncListener: accept, fan-in
        connect.py, pair.py, netconn.py   how connections are made
        broadcast.py, broadcasting.py, subscriber.py   broadcast 1 -> N (the writer's
                           core, Broadcaster, Subscriber)
        memory.py          an in-memory transport (tests drive the core with it)
        calls.py, sync_calls.py, callcore.py   request -> reply (drivers; sans-IO core)
        tracing.py, record_tracing.py   OpenTelemetry: calls' and records' trace context
        statistics.py      the statistics snapshots
        observed.py        the weak registry of live endpoints the metrics read
    ringwire/_shm/         the shared-memory transport: Unix sockets, the handshake,
                           slot pools (send / receive), the broadcast ring's ends
    ringwire/_net/         the TCP transport (ZeroMQ, NIXL), beside _shm: neither
                           imports the other
    ringwire/_pool/        what both transports' tensor pools share: SlotConfig, the
                           pool protocols, received views, the CUDA backend, segments
    ringwire/_wire/        the wire format, pure (no I/O; testable on a bytearray): codec,
                           Ext table, records, dtypes, descriptors, ring and slot layout,
                           control messages and the handshake state machine, release queue;
                           lanes.py picks the ring's C fast path (_cring.c) or the pure one
    ringwire/_errors.py    every exception class

Why this cut: what a byte on the wire means (``_wire``) changes only with the protocol
version; how bytes move between processes (``_shm``, ``_net``) is a transport behind
one seam (``_conn/transport.py``, with the pools' ``_pool/protocols.py``); what an
endpoint does with them (``_conn``) is written once for every transport and both
drivers.  A new transport is a new ``_<name>/`` beside ``_shm`` and ``_net``, importing
neither (``tests/unit/test_layers.py`` checks the layers, and that no import circles).
"""

from __future__ import annotations

from anyio import BrokenResourceError, ClosedResourceError, EndOfStream, WouldBlock

from . import metrics as metrics  # (Prometheus / OpenTelemetry export: ringwire.metrics)
from . import wire as wire  # (the wire format's descriptors: ringwire.wire)
from ._conn.async_channel import Channel, Receipt
from ._conn.broadcast import BroadcastStatistics, ReaderInfo
from ._conn.broadcasting import (
    Broadcaster,
    BroadcastReceipt,
    SyncBroadcaster,
    SyncBroadcastReceipt,
    broadcast,
    broadcast_sync,
)
from ._conn.calls import Client, serve
from ._conn.connect import DEFAULT_CAPACITY, connect, connect_sync
from ._conn.endpoint import DEFAULT_SPIN_US
from ._conn.listener import Listener, listen
from ._conn.pair import PairEnd, pair
from ._conn.record_tracing import continue_trace, received_trace, trace_records
from ._conn.statistics import ChannelStatistics, ListenerStatistics
from ._conn.subscriber import Subscriber, SyncSubscriber, subscribe, subscribe_sync
from ._conn.sync_calls import SyncClient, call_cancelled, serve_sync
from ._conn.sync_channel import SyncChannel, SyncReceipt
from ._conn.sync_listener import SyncListener, listen_sync
from ._errors import (
    DeadlineExceeded,
    DecodeError,
    EncodeError,
    FrameTooLarge,
    HandshakeError,
    PeerCredentialsError,
    ProtocolError,
    ReaderStalled,
    RemoteError,
    RingCorrupted,
    RingwireError,
    SegmentError,
    SharedMemoryFull,
    SlotMisuse,
    SlotsExhausted,
    SlotWaitTimeout,
)
from ._net.keys import ClientKeys, ServerKeys
from ._pool.segment import sweep as sweep_segments
from ._pool.slotconfig import DEFAULT_SLOTS, SlotConfig
from ._pool.views import borrow, copy_out, release
from ._wire.codec import Decoder, Encoder, decode, encode
from ._wire.lanes import NATIVE as native
from ._wire.lanes import REASON as native_reason
from ._wire.record import Record
from ._wire.sglang import SGLangRecord, SGLangState
from ._wire.slotlayout import SlotClass

__version__ = "0.1.0"

__all__ = [
    "BroadcastReceipt",
    "BroadcastStatistics",
    "Broadcaster",
    "BrokenResourceError",
    "Channel",
    "ChannelStatistics",
    "Client",
    "ClientKeys",
    "ClosedResourceError",
    "DEFAULT_CAPACITY",
    "DEFAULT_SLOTS",
    "DEFAULT_SPIN_US",
    "DeadlineExceeded",
    "DecodeError",
    "Decoder",
    "EncodeError",
    "Encoder",
    "EndOfStream",
    "FrameTooLarge",
    "HandshakeError",
    "Listener",
    "ListenerStatistics",
    "PairEnd",
    "PeerCredentialsError",
    "ProtocolError",
    "ReaderInfo",
    "ReaderStalled",
    "Receipt",
    "Record",
    "RemoteError",
    "RingCorrupted",
    "RingwireError",
    "SGLangRecord",
    "SGLangState",
    "SegmentError",
    "ServerKeys",
    "SharedMemoryFull",
    "SlotClass",
    "SlotConfig",
    "SlotMisuse",
    "SlotWaitTimeout",
    "SlotsExhausted",
    "Subscriber",
    "SyncBroadcastReceipt",
    "SyncBroadcaster",
    "SyncChannel",
    "SyncClient",
    "SyncListener",
    "SyncReceipt",
    "SyncSubscriber",
    "WouldBlock",
    "__version__",
    "borrow",
    "broadcast",
    "broadcast_sync",
    "call_cancelled",
    "connect",
    "connect_sync",
    "continue_trace",
    "copy_out",
    "decode",
    "encode",
    "listen",
    "listen_sync",
    "native",
    "native_reason",
    "pair",
    "received_trace",
    "release",
    "serve",
    "serve_sync",
    "subscribe",
    "subscribe_sync",
    "sweep_segments",
    "trace_records",
]
