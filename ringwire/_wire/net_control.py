"""The TCP transport's messages, parsed with no I/O (the socket code is
:mod:`ringwire._net`).

Everything here takes bytes a peer sent and returns values or raises -- no socket, no
state beyond what is passed in -- so the fuzz targets (``fuzz/net_targets.py``) drive
the very code the connections run:

* :func:`parse_control` -- the body of a control message ``[b"", body]`` of a
  connection (the table in :mod:`ringwire._net.transport`); :func:`check_credit` --
  a credit against what was sent.  Each raises :class:`~ringwire.ProtocolError`
  naming what was wrong.
* the rendezvous messages (:class:`Hello`, :class:`Welcome`, :class:`Refused`,
  msgpack) and the attach (``H`` + token + session id, answered by ``K``):
  :func:`decode_rendezvous`, :func:`check_hello`, :func:`check_welcome`,
  :func:`check_attach`, :func:`check_attach_answer`, each raising
  :class:`~ringwire.HandshakeError`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import msgspec

from .._errors import HandshakeError, ProtocolError
from .control import PROTOCOL_VERSION

__all__ = [
    "MAX_BUDGET",
    "MAX_REASON",
    "Hello",
    "Refused",
    "Welcome",
    "check_attach",
    "check_attach_answer",
    "check_credit",
    "check_hello",
    "check_welcome",
    "decode_rendezvous",
    "encode_control",
    "encode_rendezvous",
    "parse_control",
]

MAX_REASON = 2000  # bytes of an abort's reason kept
MAX_BUDGET = 1 << 40  # the largest send budget a peer may announce (for MAXMSGSIZE)
SESSION = TOKEN = 16  # bytes of a session id and of an attach token
_Q = struct.Struct(">Q")
_EMPTY_BODY = (b"E", b"X", b"B", b"K", b"Y")
_REASON_BODY = (b"A", b"O")


# -- a connection's control messages ----------------------------------------------------


def parse_control(body: bytes) -> tuple[bytes, Any]:
    """``(kind, value)`` of a control message body: ``C`` -> the credit (int), ``R`` ->
    a list of ``(tag, generation)``, ``A`` / ``O`` -> the reason (str), ``H`` ->
    ``(token, session)``, ``E`` / ``X`` / ``B`` / ``K`` / ``Y`` -> ``None``.  Raises
    :class:`ProtocolError` for anything else."""
    kind, rest = body[:1], body[1:]
    if kind == b"C":
        if len(rest) != 8:
            raise ProtocolError(f"a credit of {len(rest)} bytes")
        return kind, _Q.unpack(rest)[0]
    if kind == b"R":
        if not rest or len(rest) % 16:
            raise ProtocolError(f"a release message of {len(rest)} bytes")
        vals = struct.unpack(f">{len(rest) // 8}Q", rest)
        return kind, list(zip(vals[::2], vals[1::2]))
    if kind in _REASON_BODY:
        return kind, rest[:MAX_REASON].decode("utf-8", "replace") or "no reason given"
    if kind in _EMPTY_BODY:
        if rest:
            raise ProtocolError(f"a {kind.decode()} message with {len(rest)} bytes of body")
        return kind, None
    if kind == b"H":
        if len(rest) != TOKEN + SESSION:
            raise ProtocolError(f"an attach of {len(rest)} bytes")
        return kind, (rest[:TOKEN], rest[TOKEN:])
    raise ProtocolError(f"an unknown control message {body[:16]!r}")


def encode_control(kind: bytes, value: Any = None) -> bytes:
    """The body of a control message (the inverse of :func:`parse_control`)."""
    if kind == b"C":
        return kind + _Q.pack(value)
    if kind == b"R":
        flat = [x for pair in value for x in pair]
        return kind + struct.pack(f">{len(flat)}Q", *flat)
    if kind in _REASON_BODY:
        return kind + str(value).encode("utf-8", "replace")[:MAX_REASON]
    if kind == b"H":
        return kind + value[0] + value[1]
    return kind


def check_credit(n: int, sent: int, acked: int) -> None:
    """A credit of ``n`` bytes consumed in all must not go backwards (below ``acked``,
    the last one) nor past what was sent; :class:`ProtocolError` otherwise."""
    if n < acked or n > sent:
        raise ProtocolError(f"a credit of {n} bytes (sent {sent}, credited {acked})")


# -- the rendezvous and the attach --------------------------------------------------------


class Hello(msgspec.Struct, array_like=True, tag="hello"):
    version: int
    session: bytes
    capacity: int
    budget: int
    pid: int
    host: str
    nixl: str = ""  # what this side can do with NIXL ("" nothing; see .nixl.offer)


class Welcome(msgspec.Struct, array_like=True, tag="welcome"):
    version: int
    port: int
    token: bytes
    capacity: int
    budget: int
    pid: int
    nixl: str = ""


class Refused(msgspec.Struct, array_like=True, tag="refuse"):
    """The listener refuses the connection, and why (its tag on the wire is "refuse";
    the rendezvous' :class:`~ringwire._wire.control.Refused`)."""

    reason: str


_decoder = msgspec.msgpack.Decoder(Hello | Welcome | Refused)
_encoder = msgspec.msgpack.Encoder()


def encode_rendezvous(msg: Hello | Welcome | Refused) -> bytes:
    return _encoder.encode(msg)


def decode_rendezvous(data: bytes, what: str) -> Hello | Welcome | Refused:
    """A rendezvous message; :class:`HandshakeError` naming ``what`` if malformed."""
    try:
        msg: Hello | Welcome | Refused = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise HandshakeError(f"malformed {what}: {exc}") from exc
    return msg


def check_hello(msg: Any, max_capacity: int) -> Hello:
    """A client's hello, checked (the listener refuses with the error's text)."""
    if not isinstance(msg, Hello):
        raise HandshakeError(f"expected a hello, got {type(msg).__name__}")
    if msg.version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"protocol version {msg.version}; this listener speaks {PROTOCOL_VERSION}"
        )
    if len(msg.session) != SESSION:
        raise HandshakeError(f"a session id must have {SESSION} bytes")
    cap = msg.capacity
    if cap < 1024 or cap > max_capacity or cap & (cap - 1):
        raise HandshakeError(f"lane capacity {cap} (a power of two from 1 KiB to {max_capacity})")
    if not 0 <= msg.budget <= MAX_BUDGET:
        raise HandshakeError(f"a send budget of {msg.budget} bytes")
    return msg


def check_welcome(msg: Any, url: str) -> Welcome:
    """The listener's answer to our hello, checked: a :class:`Refused` or anything
    malformed is a :class:`HandshakeError` naming ``url``."""
    if isinstance(msg, Refused):
        raise HandshakeError(f"the listener at {url} refused the connection: {msg.reason}")
    if not isinstance(msg, Welcome) or msg.version != PROTOCOL_VERSION:
        raise HandshakeError(f"the listener at {url} speaks another protocol: {msg!r}")
    if not 1 <= msg.port <= 65535 or len(msg.token) != TOKEN:
        raise HandshakeError(f"the listener at {url} sent a bad welcome")
    if not 1024 <= msg.capacity <= 1 << 40 or not 0 <= msg.budget <= MAX_BUDGET:
        raise HandshakeError(f"the listener at {url} sent a bad welcome")
    return msg


def check_attach(frames: Sequence[bytes], token: bytes, session: bytes) -> bytes:
    """The first message on a connection's port must be ``[b"", b"H" + token +
    session + note]`` with the token given to this client and its session id; returns
    the note (the client's NIXL agent, :mod:`.nixl`; empty without NIXL)."""
    attach = b"H" + token + session
    if len(frames) != 2 or frames[0] != b"" or not frames[1].startswith(attach):
        raise HandshakeError("a bad attach (wrong token or session id, or not an attach)")
    return frames[1][len(attach) :]


def check_attach_answer(frames: Sequence[bytes], url: str, nixl: bool) -> tuple[bytes, Any]:
    """The listener's answer to the attach, as ``(kind, value)``: ``K`` -> ``None``
    (no NIXL), ``N`` -> the listener's NIXL note (bytes), ``O`` -> why the listener
    turned NIXL off (str).  ``nixl``: this client sent a note (only then may the
    answer carry ``N`` or ``O``).  :class:`HandshakeError` naming ``url`` for a
    refusal (``A`` + reason) or anything else."""
    if len(frames) == 2 and frames[0] == b"":
        body = frames[1]
        kind, rest = body[:1], body[1:]
        if kind == b"A":
            reason = rest[:MAX_REASON].decode("utf-8", "replace") or "no reason given"
            raise HandshakeError(f"the listener at {url} refused the attach: {reason}")
        if kind == b"K" and not rest:
            return b"K", None
        if kind == b"K" and nixl and rest[:1] == b"N" and len(rest) > 1:
            return b"N", rest[1:]
        if kind == b"K" and nixl and rest[:1] == b"O":
            why = rest[1 : 1 + MAX_REASON].decode("utf-8", "replace") or "no reason given"
            return b"O", why
    raise HandshakeError(f"the listener at {url} answered the attach with {list(frames)!r:.200}")
