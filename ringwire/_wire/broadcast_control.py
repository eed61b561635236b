"""A broadcast's control protocol: the join handshake and what follows it; no I/O.

Every reader of a broadcast has one Unix stream socket to the writer (accepted at the
broadcast's path, mode 0600, peer uid checked).  It carries, in order:

1. **The join**, length-prefixed msgpack messages ``[u32 big-endian length][msgpack
   map]`` of at most :data:`~ringwire._wire.control.MAX_MESSAGE` bytes, as the
   connection handshake of :mod:`ringwire._wire.control` (whose ``choose_version``
   picks the version here too, from :data:`BROADCAST_VERSIONS`)::

       reader -> writer   Join     versions, the reader's pid, the rank it wants (or -1)
       writer -> reader   Joined   version, writer pid, rank, start position, ring and
                                   pool geometry; the segments' file descriptors ride
                                   along (SCM_RIGHTS), announced by ``fds``
                   (or)   Refused  a reason (rank taken, table full, bad version...)
       reader -> writer   Started  the reader attached both segments and checked them

   The writer admits the reader when it sends ``Joined``: from then on the ring keeps
   space for it from ``start`` on, and every record it publishes counts the reader
   among those who must release its slots.  The segments' names were unlinked when
   they were made -- they travel as descriptors, so a late joiner can attach at any
   time and a crash of anyone leaves nothing in ``/dev/shm``.

2. **Doorbells and the abort** afterwards, exactly as on a connection's control
   socket (:class:`~ringwire._wire.control.ControlReader`): ``D`` from the writer
   (published while you were parked), ``C`` (closed while you were parked), ``S`` from
   a reader (space or a slot release, while the writer was parked), and last perhaps
   one abort ``X`` + u16 length + UTF-8 reason ("the broadcast failed: reader 2 died").

3. **Liveness**: end of file.  A reader that set its closed flag first has left; one
   that did not has died.

A reader on another host joins over a TCP connection (:mod:`ringwire._net`) instead:
after the connection's own handshake its first record is the same ``Join`` (msgpack,
unframed: the connection delimits records), answered by one record,
:class:`RemoteJoined` (no segments: every step travels on that connection), or by the
connection's abort carrying the reason.  :func:`decode_remote_join` and
:func:`check_remote_joined` check them.

This module does no I/O.
"""

from __future__ import annotations

import struct
from typing import Union

import msgspec

from .._errors import HandshakeError
from .broadcast_ring import MAX_READERS
from .control import MAX_MESSAGE, SegmentSpec
from .ring import validate_capacity

__all__ = [
    "BROADCAST_MAGIC",
    "BROADCAST_VERSIONS",
    "Join",
    "Joined",
    "MessageReader",
    "Refused",
    "RemoteJoined",
    "Started",
    "check_remote_joined",
    "decode_remote_join",
    "encode_broadcast_message",
    "encode_remote",
    "validate_join",
    "validate_joined",
]

BROADCAST_MAGIC = "ringwire-broadcast"
BROADCAST_VERSIONS = (1,)
_LEN = struct.Struct(">I")


class Join(msgspec.Struct, tag="join", kw_only=True):
    magic: str = BROADCAST_MAGIC
    versions: list[int]
    pid: int
    rank: int = -1  # -1: any free rank
    features: list[str] = []


class Joined(msgspec.Struct, tag="joined", kw_only=True):
    version: int
    pid: int  # the writer's
    rank: int
    start: int  # the tail at admission: the first byte this reader reads
    capacity: int
    readers: int  # entries in the reader table
    ring: SegmentSpec  # role "broadcast"
    pool: SegmentSpec | None = None  # role "slots": the writer's slot pool and release lanes
    lane_offset: int = 0  # where this reader's release lane lies in the pool segment
    fds: int = 0  # descriptors sent with this message: the ring's, the pool's, the arena's
    arena: SegmentSpec | None = None  # role "arena": the pool's arena (large arrays)
    features: list[str] = []


class Refused(msgspec.Struct, tag="refused"):
    """The join is refused, and why (the broadcast's :class:`~.control.Refused`)."""

    reason: str


class Started(msgspec.Struct, tag="started"):
    pass


class RemoteJoined(msgspec.Struct, tag="remote-joined", kw_only=True):
    """The writer's answer to a remote reader's ``Join``: admitted as ``rank``."""

    version: int
    pid: int  # the writer's
    rank: int
    start: int  # the writer's ring position at admission (as Joined.start)
    readers: int
    window: int  # record bytes the writer may have in flight to this reader (its credit)
    features: list[str] = []


Message = Union[Join, Joined, Refused, Started]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_broadcast_message(msg: Message) -> bytes:
    """One length-prefixed frame."""
    body = _encoder.encode(msg)
    if len(body) > MAX_MESSAGE:
        raise HandshakeError(f"broadcast message of {len(body)} bytes is too large")
    return _LEN.pack(len(body)) + body


class MessageReader:
    """Splits the bytes of a control socket into join messages.  :meth:`feed` the bytes
    as they come; :meth:`next` returns the next whole message (or ``None``);
    :attr:`rest` holds what follows the last message taken (after ``Started``: the
    first doorbells, for a :class:`~ringwire._wire.control.ControlReader`)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) > MAX_MESSAGE + _LEN.size + 4096:
            raise HandshakeError("a join message too large (or garbage on the socket)")

    def next(self) -> Message | None:
        buf = self._buf
        if len(buf) < _LEN.size:
            return None
        (n,) = _LEN.unpack_from(buf)
        if n > MAX_MESSAGE:
            raise HandshakeError(f"a join message of {n} bytes (at most {MAX_MESSAGE})")
        if len(buf) < _LEN.size + n:
            return None
        body = bytes(buf[_LEN.size : _LEN.size + n])
        del buf[: _LEN.size + n]
        try:
            return _decoder.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise HandshakeError(f"malformed broadcast message: {exc}") from None

    @property
    def rest(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


def validate_join(msg: Join, readers: int) -> None:
    """What a writer checks in a ``Join`` before it admits anyone."""
    if msg.magic != BROADCAST_MAGIC:
        raise HandshakeError(f"not a ringwire broadcast reader (magic {msg.magic!r:.60})")
    if not isinstance(msg.rank, int) or not -1 <= msg.rank < readers:
        raise HandshakeError(
            f"rank {msg.rank!r:.20} is outside this broadcast's table (0..{readers - 1})"
        )


def validate_joined(msg: Joined, fds: int) -> None:
    """What a reader checks in ``Joined`` before it maps anything."""
    if msg.version not in BROADCAST_VERSIONS:
        raise HandshakeError(f"the writer chose unsupported version {msg.version}")
    try:
        validate_capacity(msg.capacity)
    except ValueError as exc:
        raise HandshakeError(f"broadcast ring: {exc}") from None
    if not 1 <= msg.readers <= MAX_READERS or not 0 <= msg.rank < msg.readers:
        raise HandshakeError(f"rank {msg.rank} of {msg.readers} readers")
    if msg.arena is not None and msg.pool is None:
        raise HandshakeError("the writer announced an arena without a slot pool")
    want = 1 + (msg.pool is not None) + (msg.arena is not None)
    if msg.fds != want or fds != want:
        raise HandshakeError(f"expected {want} descriptor(s) with Joined, got {fds}")
    for spec in (msg.ring, msg.pool, msg.arena):
        if spec is not None and not 0 < spec.size <= 1 << 40:
            raise HandshakeError(f"bad segment size {spec.size!r}")
    if msg.pool is not None and not 0 < msg.lane_offset < msg.pool.size:
        raise HandshakeError(f"release lane offset {msg.lane_offset} outside the pool")
    if msg.start < 0:
        raise HandshakeError(f"bad start position {msg.start}")


_join_decoder = msgspec.msgpack.Decoder(Join)


def encode_remote(msg: Join | RemoteJoined) -> bytes:
    """A remote join message: one record on the TCP connection."""
    return _encoder.encode(msg)


def decode_remote_join(data: bytes | memoryview, readers: int) -> Join:
    """A remote reader's first record, checked (:func:`validate_join`); raises
    :class:`HandshakeError` for anything else."""
    if len(data) > MAX_MESSAGE:
        raise HandshakeError(f"a join record of {len(data)} bytes (at most {MAX_MESSAGE})")
    try:
        msg = _join_decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise HandshakeError(f"the first record is not a broadcast join: {exc}") from None
    validate_join(msg, readers)
    if not isinstance(msg.pid, int) or msg.pid < 0:
        raise HandshakeError(f"bad pid {msg.pid!r:.20} in the join")
    return msg


def check_remote_joined(msg: RemoteJoined, asked: int) -> RemoteJoined:
    """The writer's answer to a remote join that asked for a lane of ``asked`` bytes,
    checked; :class:`HandshakeError` otherwise."""
    if msg.version not in BROADCAST_VERSIONS:
        raise HandshakeError(f"the writer chose unsupported version {msg.version}")
    if not 1 <= msg.readers <= MAX_READERS or not 0 <= msg.rank < msg.readers:
        raise HandshakeError(f"rank {msg.rank} of {msg.readers} readers")
    if msg.start < 0:
        raise HandshakeError(f"bad start position {msg.start}")
    if not 1024 <= msg.window <= asked:
        raise HandshakeError(f"a window of {msg.window} bytes (asked for at most {asked})")
    return msg
