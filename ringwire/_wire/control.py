"""The control-socket protocol: handshake messages, a sans-I/O handshake state machine,
doorbell bytes, (the Unix-socket helpers are in :mod:`ringwire._shm.sockets`).

Every connection has one Unix stream socket (a listener's accepted socket, or one end
of a ``socketpair`` for :func:`ringwire.pair`).  It carries, in order:

1. **The handshake**, length-prefixed msgpack messages ``[u32 big-endian length]
   [msgpack map]`` of at most :data:`MAX_MESSAGE` bytes::

       client -> server   Hello    protocol versions, the client's segments, ring placement
       server -> client   Welcome  chosen version, the server's own segments (none yet)
                   (or)   Refused  a reason; the connection ends
       client -> server   Ready    the client attached everything

   The client creates the ring segment and unlinks its name as soon as it reads
   ``Welcome`` (the server has attached by then); the server unlinks the names of its
   own segments (tensor slot pools, later) when it reads ``Ready``.  Unknown map keys
   are ignored, so later versions can add fields; a message of an unknown kind, a bad
   length, a bad version or a segment layout that does not add up is a
   :class:`HandshakeError`.

2. **Doorbell bytes**, one byte each, after the handshake: ``D`` (data was published
   in the ring you read), ``S`` (space was freed in the ring you write), ``C`` (I
   closed my sending side).  Any of them only means "re-check the rings".  One more
   message may come last: ``X`` + u16 big-endian length + that many bytes of UTF-8,
   the *abort*: "I drop this connection, and this is why" (an undecodable record, a
   forged reference, a missing torch...); the sender closes right after it, and the
   reason reaches the peer's next operation as a ``BrokenResourceError``.  Any other
   byte is a protocol error.

3. **Liveness**: end of file (or ``ECONNRESET``) means the peer is gone.  Whether it
   closed cleanly is told by the closed flags in the ring headers, not by the socket.

This module does no I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Literal, Union

import msgspec

from .._errors import HandshakeError, ProtocolError
from .names import is_memfd_label, is_segment_name
from .ring import HEADER_SIZE, MAX_CAPACITY, validate_capacity

__all__ = [
    "ABORT",
    "DOORBELL_BYTES",
    "DOORBELL_CLOSE",
    "DOORBELL_DATA",
    "DOORBELL_SPACE",
    "MAX_MESSAGE",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "Handshake",
    "ControlReader",
    "Hello",
    "Message",
    "Ready",
    "Refused",
    "RingSpec",
    "SegmentSpec",
    "Welcome",
    "choose_version",
    "encode_abort",
    "decode_message",
    "encode_message",
    "validate_hello",
    "validate_segments",
]

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MAX_MESSAGE = 64 * 1024
MAGIC = "ringwire"

DOORBELL_DATA = b"D"
DOORBELL_SPACE = b"S"
DOORBELL_CLOSE = b"C"
DOORBELL_BYTES = b"DSC"
ABORT = b"X"
MAX_ABORT_REASON = 1024  # bytes of UTF-8 an abort carries at most (longer ones are cut)
_ABORT_LEN = struct.Struct(">H")

_LEN = struct.Struct(">I")


# -- messages -------------------------------------------------------------------------


class SegmentSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A shared-memory segment one side created: its name, size and purpose, and how
    it travels: ``fd`` is the index of its descriptor among those passed with this
    message (``SCM_RIGHTS``; a memory file, whose ``name`` is only a label
    ``memfd:rw.<pid>.<hex>``), or -1 for a named segment the peer opens by ``name``."""

    name: str
    size: int
    role: str = "rings"
    fd: int = -1


class RingSpec(msgspec.Struct, frozen=True):
    """Where one ring lane lives: segment index, byte offset, data capacity."""

    segment: int
    offset: int
    capacity: int


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    magic: str = MAGIC
    versions: list[int]
    pid: int
    segments: list[SegmentSpec]
    c2s: RingSpec  # the lane the client writes
    s2c: RingSpec  # the lane the server writes
    features: list[str] = []


class Welcome(msgspec.Struct, tag="welcome", kw_only=True):
    version: int
    pid: int
    segments: list[SegmentSpec] = []
    features: list[str] = []


class Ready(msgspec.Struct, tag="ready"):
    pass


class Refused(msgspec.Struct, tag="reject"):
    """The handshake is refused, and why (its tag on the wire is "reject").  Every
    handshake of the package calls its refusal ``Refused``: the broadcast join's
    (:mod:`.broadcast_control`) and the TCP rendezvous' (:mod:`ringwire._wire.net_control`)
    are messages of their own protocols, with their own tags."""

    reason: str


Message = Union[Hello, Welcome, Ready, Refused]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_message(msg: Message) -> bytes:
    """One length-prefixed handshake frame."""
    body = _encoder.encode(msg)
    if len(body) > MAX_MESSAGE:
        raise HandshakeError(f"handshake message of {len(body)} bytes is too large")
    return _LEN.pack(len(body)) + body


def decode_message(body: bytes | memoryview) -> Message:
    """Decode the body of one handshake frame (without its length prefix)."""
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # msgspec: bad UTF-8 in a str
        raise HandshakeError(f"malformed handshake message: {exc}") from None


def choose_version(
    offered: list[int], supported: Sequence[int] = SUPPORTED_VERSIONS, what: str = "protocol"
) -> int:
    """The highest version both the peer (``offered``) and this side (``supported``)
    speak -- of the connection handshake, or (``what``) of another protocol: the
    broadcast join's.  Raises :class:`HandshakeError` (naming both lists) if none."""
    common = set(offered) & set(supported)
    if not common:
        raise HandshakeError(
            f"no common {what} version: the peer offers {sorted(offered)!r:.200}, "
            f"this side speaks {list(supported)!r}"
        )
    return max(common)


MAX_SEGMENTS = 16  # segments (and so descriptors) one handshake message may carry


def validate_segments(specs: Sequence[SegmentSpec], nfds: int, who: str) -> None:
    """Check the segments a message announces against the ``nfds`` descriptors that
    came with it: a named segment has a ringwire name; a memory file has a label and
    the index of its own descriptor; every descriptor belongs to exactly one segment.
    Raises :class:`HandshakeError` naming ``who`` sent what."""
    if len(specs) > MAX_SEGMENTS:
        raise HandshakeError(
            f"{who} announced {len(specs)} segments: a message carries between 1 and "
            f"{MAX_SEGMENTS} segments"
        )
    used: set[int] = set()
    for seg in specs:
        if seg.fd == -1:
            if not is_segment_name(seg.name):
                raise HandshakeError(f"bad segment name {seg.name!r:.100}")  # fits a Refused
        else:
            if not is_memfd_label(seg.name):
                raise HandshakeError(f"bad memory-file label {seg.name!r:.100}")
            if not isinstance(seg.fd, int) or not 0 <= seg.fd < nfds or seg.fd in used:
                raise HandshakeError(
                    f"{who} announced segment {seg.name} as descriptor {seg.fd!r:.20}, "
                    f"but passed {nfds} descriptor(s) (or that one twice)"
                )
            used.add(seg.fd)
        if not 0 < seg.size <= 1 << 40:
            raise HandshakeError(f"bad segment size {seg.size!r}")
    if len(used) != nfds:
        raise HandshakeError(
            f"{who} passed {nfds} descriptor(s) for {len(used)} memory file(s)"
        )


def validate_hello(hello: Hello, *, max_capacity: int = MAX_CAPACITY, nfds: int = 0) -> None:
    """Check everything a server must check before attaching the client's segments
    (``nfds``: how many descriptors came with the hello)."""
    if hello.magic != MAGIC:
        raise HandshakeError(f"not a ringwire client (magic {hello.magic!r})")
    if not hello.segments:
        raise HandshakeError("a hello must announce between 1 and 16 segments")
    validate_segments(hello.segments, nfds, "the client")
    regions = []
    for label, ring in (("c2s", hello.c2s), ("s2c", hello.s2c)):
        if not 0 <= ring.segment < len(hello.segments):
            raise HandshakeError(f"{label} ring refers to a missing segment")
        try:
            validate_capacity(ring.capacity)
        except ValueError as exc:
            raise HandshakeError(f"{label} ring: {exc}") from None
        if ring.capacity > max_capacity:
            raise HandshakeError(
                f"{label} ring capacity {ring.capacity} exceeds this listener's "
                f"limit of {max_capacity}"
            )
        seg = hello.segments[ring.segment]
        end = ring.offset + HEADER_SIZE + ring.capacity
        if ring.offset < 0 or ring.offset % 64 or end > seg.size:
            raise HandshakeError(f"{label} ring does not fit its segment")
        regions.append((ring.segment, ring.offset, end))
    (sa, a0, a1), (sb, b0, b1) = regions
    if sa == sb and a0 < b1 and b0 < a1:
        raise HandshakeError("the two rings overlap")


# -- the handshake state machine ----------------------------------------------------------

_EXPECT: dict[str, tuple[type, ...]] = {
    "await_hello": (Hello,),
    "await_welcome": (Welcome, Refused),
    "await_ready": (Ready,),
}
_MAY_SEND: dict[str, tuple[type, ...]] = {
    "send_hello": (Hello,),
    "send_welcome": (Welcome, Refused),
    "send_ready": (Ready,),
    "await_ready": (Refused,),
    "await_welcome": (),
}
_AFTER_SEND = {Hello: "await_welcome", Welcome: "await_ready", Ready: "done", Refused: "failed"}
_AFTER_RECV = {Hello: "send_welcome", Welcome: "send_ready", Ready: "done", Refused: "failed"}


class Handshake:
    """The handshake of one side, as a sans-I/O state machine.

    Feed received bytes with :meth:`receive_data`, take complete messages with
    :meth:`next_message`, and turn messages into bytes to send with :meth:`send`.
    Each checks that the message is the one the protocol expects now.
    """

    def __init__(self, role: Literal["client", "server"]) -> None:
        if role not in ("client", "server"):
            raise ValueError("role must be 'client' or 'server'")
        self.role = role
        self.state = "send_hello" if role == "client" else "await_hello"
        self._buf = bytearray()
        self._eof = False

    @property
    def leftover(self) -> bytes:
        """Bytes received after the last handshake message (doorbells)."""
        return bytes(self._buf) if self.state == "done" else b""

    def send(self, msg: Message) -> bytes:
        allowed = _MAY_SEND.get(self.state, ())
        if not isinstance(msg, allowed):
            raise HandshakeError(
                f"cannot send {type(msg).__name__} in state {self.state!r} ({self.role})"
            )
        data = encode_message(msg)
        self.state = _AFTER_SEND[type(msg)]
        return data

    def receive_data(self, data: bytes) -> None:
        """Add received bytes; ``b""`` means the peer closed the socket."""
        if not data:
            self._eof = True
        else:
            self._buf += data
            if len(self._buf) > 4 + MAX_MESSAGE + 1024 and self.state != "done":
                raise self._fail("too much handshake data")

    def _fail(self, why: str) -> HandshakeError:
        self.state = "failed"
        return HandshakeError(why)

    def next_message(self) -> Message | None:
        """The next complete message, or ``None`` if more bytes are needed.

        Raises :class:`HandshakeError` on garbage, an unexpected message, a refusal,
        or end of file in the middle of the handshake.
        """
        expected = _EXPECT.get(self.state)
        if expected is None:
            raise HandshakeError(f"not expecting a message in state {self.state!r}")
        buf = self._buf
        if len(buf) >= 4:
            (n,) = _LEN.unpack_from(buf)
            if n == 0 or n > MAX_MESSAGE:
                raise self._fail(
                    f"bad handshake frame length {n} (is the peer a ringwire endpoint?)"
                )
            if len(buf) >= 4 + n:
                body = bytes(buf[4 : 4 + n])
                del buf[: 4 + n]
                try:
                    msg = decode_message(body)
                except HandshakeError:
                    self.state = "failed"
                    raise
                if not isinstance(msg, expected):
                    raise self._fail(
                        f"unexpected {type(msg).__name__} in handshake state {self.state!r}"
                    )
                self.state = _AFTER_RECV[type(msg)]
                if isinstance(msg, Refused):
                    raise HandshakeError(f"the peer refused the connection: {msg.reason}")
                return msg
        if self._eof:
            raise self._fail("the peer closed the connection during the handshake")
        return None


# -- after the handshake: doorbells and the abort ---------------------------------------


def encode_abort(reason: str) -> bytes:
    """The abort message for ``reason`` (cut to :data:`MAX_ABORT_REASON` bytes)."""
    raw = reason.encode("utf-8", "replace")[:MAX_ABORT_REASON]
    raw = raw.decode("utf-8", "ignore").encode()  # no half character at the cut
    return ABORT + _ABORT_LEN.pack(len(raw)) + raw


class ControlReader:
    """Parses what arrives on the control socket after the handshake: doorbell bytes
    and, last, at most one abort.  Feed it the bytes as they come (an abort may arrive
    split across reads); it keeps the tail of an unfinished abort.

    :meth:`feed` returns how many doorbells the data held; :attr:`reason` is the
    peer's abort reason once one arrived (``None`` until then).  Raises
    :class:`ProtocolError` for any other byte, an abort that is not last, or a bad
    length."""

    __slots__ = ("_partial", "reason")

    def __init__(self) -> None:
        self._partial = b""
        self.reason: str | None = None

    def feed(self, data: bytes) -> int:
        if self._partial:
            data, self._partial = self._partial + data, b""
        elif not data.strip(DOORBELL_BYTES):
            return len(data)  # the common case: doorbells only
        if self.reason is not None:
            raise ProtocolError(f"bytes after the peer's abort: {data[:16]!r}")
        i = data.find(ABORT)
        bells = data if i < 0 else data[:i]
        if bells.strip(DOORBELL_BYTES):
            raise ProtocolError(f"unexpected bytes on the control socket: {bells[:16]!r}")
        if i < 0:
            return len(bells)
        rest = data[i + 1 :]
        if len(rest) < _ABORT_LEN.size:
            self._partial = data[i:]
            return len(bells)
        (n,) = _ABORT_LEN.unpack_from(rest)
        if n > MAX_ABORT_REASON:
            raise ProtocolError(f"an abort reason of {n} bytes (at most {MAX_ABORT_REASON})")
        body = rest[_ABORT_LEN.size :]
        if len(body) < n:
            self._partial = data[i:]
            return len(bells)
        if len(body) > n:
            raise ProtocolError(f"bytes after the peer's abort: {body[n : n + 16]!r}")
        self.reason = body.decode("utf-8", "replace")
        return len(bells)
