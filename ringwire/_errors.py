"""Every exception class ringwire defines, in one place.

Every error ringwire raises on purpose derives from :class:`RingwireError`, so one
``except RingwireError`` catches them all.  The codec errors are also msgspec's own
(``EncodeError`` is a :class:`msgspec.EncodeError`, ``DecodeError`` is a
:class:`msgspec.DecodeError` and therefore a :class:`ValueError`), so code written
against msgspec keeps working.

Not every failure is a ``RingwireError``.  The state of a connection is said with
anyio's exceptions, with the meaning anyio gives them (re-exported from
:mod:`ringwire`; they are not ``RingwireError`` s):

``EndOfStream``
    the peer closed its sending side cleanly and everything it sent was received.
``BrokenResourceError``
    the peer is gone (crashed, killed, its connection dropped or aborted, a protocol
    violation on this connection: the cause is chained, the reason in the message).
``ClosedResourceError``
    *this* side closed the object (a channel, listener, broadcaster, subscriber).
``WouldBlock``
    a ``*_nowait`` call that would have to wait.

A wait that timed out is a :class:`TimeoutError` (Python's builtin, an ``OSError``),
whatever else it is: a blocking call's ``timeout=`` (``receive``, ``send``, ``accept``,
``wait``, ``call``), a ``handshake_timeout``, and three ringwire errors that are also
``TimeoutError`` s -- :class:`SlotWaitTimeout` (a slot wait past the pool's
``wait_timeout``), :class:`ReaderStalled` (a broadcast writer past its
``stall_timeout``) and :class:`DeadlineExceeded` (a call past its deadline).  So
``except TimeoutError`` catches every timeout, and ``except RingwireError`` every
ringwire error.  (An async call is bounded by anyio cancel scopes instead:
``anyio.fail_after`` raises ``TimeoutError`` too.)  Bad arguments are ``ValueError`` /
``TypeError`` naming the argument; ``connect`` to a path with no listener raises
``FileNotFoundError`` / ``ConnectionRefusedError`` / ``PermissionError`` naming it.

::

    RingwireError
    ├── EncodeError (msgspec.EncodeError)
    │   ├── FrameTooLarge           a record larger than the ring can carry
    │   └── SlotMisuse              a loaned buffer sent twice or after sending
    ├── DecodeError (msgspec.DecodeError, ValueError)
    ├── ProtocolError               garbage on the control socket, a bad frame
    │   └── HandshakeError          bad message, version, layout, or a refusal
    │       └── PeerCredentialsError (PermissionError)  another uid; a CURVE key refused
    ├── RingCorrupted               an inconsistent ring header or frame
    ├── SegmentError                a segment cannot be created or attached
    │   └── SharedMemoryFull        no room in /dev/shm
    ├── SlotsExhausted              no slot free (policy "error", or none ever can be)
    │   └── SlotWaitTimeout (TimeoutError)  policy "wait" waited the pool's wait_timeout
    ├── SlotRefused                 a release the producer never handed out
    ├── ReaderStalled (TimeoutError)  a broadcast writer waited too long for named readers
    └── RemoteError                 a call's handler raised (type name, message, details)
        └── DeadlineExceeded (TimeoutError)  the server refused or cancelled it at its deadline

:class:`NeedSlot` is not an error: it is the signal by which encoding under policy
``"wait"`` tells the send path to wait for a slot and encode again.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "DeadlineExceeded",
    "DecodeError",
    "EncodeError",
    "FrameTooLarge",
    "HandshakeError",
    "NeedSlot",
    "NixlUnreachable",
    "PeerCredentialsError",
    "ProtocolError",
    "RemoteError",
    "ReaderStalled",
    "RingCorrupted",
    "RingwireError",
    "SegmentError",
    "SharedMemoryFull",
    "SlotMisuse",
    "SlotRefused",
    "SlotWaitTimeout",
    "SlotsExhausted",
]


class RingwireError(Exception):
    """Base class of every error ringwire raises on purpose."""


# -- the codec -------------------------------------------------------------------------


class EncodeError(RingwireError, msgspec.EncodeError):
    """A value cannot be put on the wire (unsupported type, object dtype, too large...)."""


class DecodeError(RingwireError, msgspec.DecodeError):
    """Bytes from the wire are malformed, truncated, or refer to something not given.

    Also a :class:`msgspec.DecodeError` and a :class:`ValueError`.
    """


class FrameTooLarge(EncodeError):
    """A record is larger than the ring can carry (at most half its capacity).

    Send large arrays and tensors through tensor slots instead of inline, or open the
    channel with a larger ``capacity``.
    """


# -- the control protocol and the rings ----------------------------------------------------


class ProtocolError(RingwireError):
    """The peer broke the control protocol (garbage on the socket, a bad frame)."""


class HandshakeError(ProtocolError):
    """The connection handshake failed (bad message, version, layout, or refusal)."""


class PeerCredentialsError(HandshakeError, PermissionError):
    """The peer's credentials are refused: on one host it runs as another user
    (ringwire connects only processes of one uid); over ``tcp://`` the CURVE handshake
    failed (a client key the listener does not list, keys on one side only, a wrong
    server key)."""


class RingCorrupted(RingwireError):
    """The ring's header or a frame in it is inconsistent: the peer is broken or hostile."""


# -- shared memory ------------------------------------------------------------------------


class SegmentError(RingwireError):
    """A shared-memory segment cannot be created or attached."""


class SharedMemoryFull(SegmentError):
    """There is not enough room in ``/dev/shm`` for a new segment."""


# -- tensor slots -------------------------------------------------------------------------


class SlotsExhausted(RingwireError):
    """No slot is free for an array (policy ``"error"``), or none can ever be (the
    record needs more slots than the pool has), or a wait for one timed out
    (:class:`SlotWaitTimeout`)."""


class SlotWaitTimeout(SlotsExhausted, TimeoutError):
    """Policy ``"wait"`` waited the pool's ``wait_timeout`` for a slot and none was
    released: the receiver keeps every array it got.  Also a :class:`TimeoutError`."""


class SlotMisuse(EncodeError):
    """An array lives in a slot of this pool that is not a live loan: a loaned buffer
    was sent twice, or used after it was sent."""


class SlotRefused(RingwireError):
    """A release names a slot or generation this producer did not hand out."""


class NeedSlot(Exception):
    """Not an error: policy "wait" found no free slot for ``nbytes`` (an ``int``, or a
    ``CudaNeed`` for a GPU slot); the send path gives back what the record took, waits
    for a release and encodes again."""

    def __init__(self, nbytes: Any) -> None:
        super().__init__(nbytes)
        self.nbytes = nbytes


class NixlUnreachable(Exception):
    """Not raised to users: NIXL could not load a peer's metadata in the handshake (UCX
    found no way to its agent), and the connection falls back to ZeroMQ frames
    (ringwire._net.nixlpools)."""


# -- calls ----------------------------------------------------------------------------------


class RemoteError(RingwireError):
    """The handler of a call raised: what the server sent back instead of a reply.

    Nothing of the remote exception object crosses the process -- no pickle, no
    traceback: :attr:`type_name` is its type's name (``"ValueError"``,
    ``"mypkg.errors.ModelError"``), :attr:`message` its ``str()``, and :attr:`details`
    an optional msgpack-able ``dict`` (the exception's ``details`` attribute, when it has
    one that is a dict).  A handler may raise ``RemoteError`` itself to choose the type
    name and details; one it re-raises from a call of its own passes through unchanged.
    """

    def __init__(
        self, type_name: str, message: str = "", details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(type_name, message, details)
        self.type_name = type_name
        self.message = message
        self.details = details

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}" if self.message else self.type_name

    def __repr__(self) -> str:
        extra = f", {self.details!r}" if self.details is not None else ""
        return f"{type(self).__name__}({self.type_name!r}, {self.message!r}{extra})"


class DeadlineExceeded(RemoteError, TimeoutError):
    """The server refused a call whose deadline had passed before a handler was free for
    it, or cancelled its handler at the deadline.  Also a :class:`TimeoutError`, which is
    what a caller's own timeout raises."""

    def __init__(
        self, type_name: str, message: str = "", details: dict[str, Any] | None = None
    ) -> None:
        RemoteError.__init__(self, type_name, message, details)


# -- broadcast --------------------------------------------------------------------------


class ReaderStalled(RingwireError, TimeoutError):
    """A broadcast writer waited too long for readers that are alive but do not read
    (or do not release their slots): :attr:`ranks` and :attr:`pids` name them, slowest
    first.  Nothing was published; drop them (``Broadcaster.drop_reader``) or retry.
    Also a :class:`TimeoutError`."""

    def __init__(
        self, message: str, ranks: tuple[int, ...] = (), pids: tuple[int, ...] = ()
    ) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.pids = pids
