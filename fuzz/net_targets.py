"""Fuzz targets for the TCP transport's parsers (``ringwire._net``); registered in
:data:`targets.TARGETS` by ``fuzz/targets.py``, so the hypothesis tests and atheris
run them with the others.  Same contract: return the outcome, raise anything
undocumented; :class:`targets.Finding` for a broken invariant.

``net_control``    :func:`~ringwire._wire.net_control.parse_control` (every control byte of
                   the table in ``ringwire/_net/transport.py``, ``H`` / ``K``
                   included) and :func:`check_credit`: a :class:`ProtocolError` or a
                   value that encodes back to the same bytes.
``net_transport``  the receive path of a real :class:`NetTransport` over a fake
                   ZeroMQ socket (no I/O): a stream of messages -- records with
                   array frames, control messages, empty or extra frames -- pumped by
                   ``drain()`` against a reference model of the table (credit going
                   backwards or past what was sent, records past the credit, a record
                   after ``E``...: the model and the transport must agree on whether,
                   and at which message, the connection breaks); then every record
                   accepted is decoded by the connection's :class:`NetRecvPool`
                   (Ext 20 resolution against the message's frames); a release must
                   name an array the records referenced, no more often, and nothing
                   may stay held once the records are dropped.
``net_handshake``  the rendezvous and the attach: :func:`decode_rendezvous`,
                   :func:`check_hello`, :func:`check_welcome`, :func:`check_attach`:
                   a :class:`HandshakeError` or a message that passes every check.
"""

from __future__ import annotations

import gc
import os
import struct
from collections import deque
from typing import Any

import msgspec
import numpy as np
import zmq

from ringwire._errors import DecodeError, HandshakeError, ProtocolError
from ringwire._net.pools import NetEncoder, NetRecvPool, NetSendPool
from ringwire._net.transport import NetTransport
from ringwire._pool.slotconfig import SlotClass, SlotConfig
from ringwire._wire import ext as X
from ringwire._wire import net_control as M
from ringwire._wire.codec import Decoder
from ringwire._wire.control import PROTOCOL_VERSION
from ringwire._wire.descriptors import NetRef, decode_descriptor

__all__ = ["NET_TARGETS", "net_control", "net_handshake", "net_transport"]


class Finding(AssertionError):
    """Replaced by targets.Finding when registered (one class for every target)."""


def refused(exc: DecodeError) -> str:
    """Replaced by targets' check that a DecodeError is not the codec's last resort."""
    return "refused"


# ------------------------------------------------------------------- control messages

_ROUND_TRIP = {b"C", b"R", b"E", b"X", b"B", b"K", b"H"}


def net_control(data: bytes) -> str:
    try:
        kind, value = M.parse_control(data)
    except ProtocolError:
        return "refused"
    if kind in _ROUND_TRIP and M.encode_control(kind, value) != data:
        raise Finding(f"control {data!r} parsed as {value!r}, which encodes differently")
    if kind == b"A" and not (isinstance(value, str) and 0 < len(value) <= M.MAX_REASON):
        raise Finding(f"an abort reason of {len(value)} characters")
    if kind == b"C":
        sent, acked = value + (data[1] if len(data) > 1 else 0), value // 2
        M.check_credit(value, sent, acked)  # must pass: acked <= value <= sent
        for bad in ((value, value - 1, acked), (value, sent, value + 1)):
            try:
                M.check_credit(*bad)
            except ProtocolError:
                continue
            raise Finding(f"check_credit{bad} passed")
    return "ok"


# ------------------------------------------------------- the transport's receive path

# descriptors for the fakes' FD options: the socket's always readable (the transport
# then reads until the fake says Again), the monitor's never
_SOCK_FD = os.eventfd(1, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
_MON_FD = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


class _Frame(zmq.Frame):
    more = False  # the last frame of its message


class _FrameMore(zmq.Frame):
    more = True  # more frames of its message follow


class _FakeMonitor:
    gone = False  # set before the transport closes: its sockets are then closed at once

    def getsockopt(self, opt: int) -> int:
        return _MON_FD

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        if self.gone:
            raise zmq.ZMQError(zmq.ENOTSOCK)
        raise zmq.Again()

    def close(self, linger: int = 0) -> None:
        pass


class _FakeSocket:
    """What NetTransport asks of its ZeroMQ PAIR socket, over a list of messages."""

    def __init__(self, messages: list[list[bytes]]) -> None:
        self.queue = deque(messages)
        self.cur: deque[bytes] = deque()
        self.sent: list[list[bytes]] = []

    def getsockopt(self, opt: int) -> int:
        if opt == zmq.FD:
            return _SOCK_FD
        if opt == zmq.RCVMORE:
            return int(bool(self.cur))
        if opt == zmq.EVENTS:
            return zmq.POLLOUT | (zmq.POLLIN if self.queue or self.cur else 0)
        if opt == zmq.HEARTBEAT_TIMEOUT:
            return 3000
        raise AssertionError(f"getsockopt({opt})")

    def recv(self, flags: int = 0, copy: bool = True) -> Any:
        if not self.cur:
            if not self.queue:
                raise zmq.Again()
            self.cur = deque(self.queue.popleft())
        frame = self.cur.popleft()
        if copy:
            return frame
        return _FrameMore(frame) if self.cur else _Frame(frame)

    def send(self, data: Any, flags: int = 0, copy: bool = True) -> None:
        self.sent.append([bytes(data)])

    def send_multipart(self, parts: Any, flags: int = 0) -> None:
        self.sent.append([bytes(p) for p in parts])

    def poll(self, timeout: int = 0, flags: int = 0) -> int:
        return 0

    def disable_monitor(self) -> None:
        pass

    def close(self, linger: int = 0) -> None:
        pass


NET_SLOTS = SlotConfig(classes=(SlotClass(4096, 4),), threshold=64)
LANE = 1024  # the receiving lane's capacity (records past its credit break the connection)


def _transport(
    messages: list[list[bytes]], sent: int
) -> tuple[NetTransport, _FakeSocket, _FakeMonitor]:
    sock = _FakeSocket([])  # (the constructor pumps once: the messages come after)
    mon = _FakeMonitor()

    def pools(t: NetTransport) -> tuple[Any, Any, Any]:
        return NetSendPool(NET_SLOTS, t.releases, 1 << 12), NetRecvPool(t, False), NetEncoder()

    t = NetTransport(
        sock,  # type: ignore[arg-type]
        mon,  # type: ignore[arg-type]
        capacity=LANE,
        peer_capacity=1 << 16,
        peer_pid=1,
        peer_fd=None,
        address="tcp://fuzz",
        pools=pools,
    )
    t.tx.sent = sent
    sock.queue.extend(messages)
    return t, sock, mon


def _split(data: bytes) -> tuple[int, list[list[bytes]]]:
    """``sent`` (what our writer sent, for credits) and the messages: each frame is a
    u16 length, its bytes and a flag byte (bit 0: more frames of this message)."""
    sent = int.from_bytes(data[:2], "big") * 4
    msgs: list[list[bytes]] = []
    cur: list[bytes] = []
    pos = 2
    while pos < len(data):
        n = int.from_bytes(data[pos : pos + 2], "big")
        frame = data[pos + 2 : pos + 2 + n]
        flags = data[pos + 2 + n] if pos + 2 + n < len(data) else 0
        pos += 3 + n
        cur.append(frame)
        if not flags & 1:
            msgs.append(cur)
            cur = []
    if cur:
        msgs.append(cur)
    return sent, msgs


def _join(sent: int, msgs: list[list[bytes]]) -> bytes:
    out = bytearray((sent // 4).to_bytes(2, "big"))
    for msg in msgs:
        for i, f in enumerate(msg):
            out += len(f).to_bytes(2, "big") + f + bytes([i < len(msg) - 1])
    return bytes(out)


def _model(sent: int, msgs: list[list[bytes]]) -> tuple[int | None, int]:
    """The table, read independently: the index of the message that breaks the
    connection (``None``: none does) and the number of records accepted before it."""
    acked, inbox, eof, records = 0, 0, False, 0
    for i, msg in enumerate(msgs):
        first = msg[0]
        if first:
            if eof:
                return i, records
            inbox += len(first) + 4
            if inbox > LANE:
                return i, records
            records += 1
            continue
        if len(msg) != 2:
            return i, records
        body = msg[1]
        k, rest = body[:1], body[1:]
        if k == b"M":  # a batch: n x (u32 length, record), two records at least
            if eof:
                return i, records
            pos, batch = 0, []
            while pos < len(rest):
                if pos + 4 > len(rest):
                    return i, records
                n = struct.unpack(">I", rest[pos : pos + 4])[0]
                pos += 4
                if n == 0 or pos + n > len(rest):
                    return i, records
                batch.append(n)
                pos += n
            if len(batch) < 2 or inbox + sum(n + 4 for n in batch) > LANE:
                return i, records
            inbox += sum(n + 4 for n in batch)
            records += len(batch)
        elif k == b"C" and len(rest) == 8:
            n = struct.unpack(">Q", rest)[0]
            if not acked <= n <= sent:
                return i, records
            acked = n
        elif k == b"R" and rest and len(rest) % 16 == 0:
            pass
        elif k == b"E" and not rest:
            eof = True
        elif k in (b"X", b"B") and not rest or k == b"A":
            pass
        else:
            return i, records  # unknown, malformed, or H / K after the attach
    return None, records


def _net_refs(payload: bytes) -> list[int]:
    """The tags of the well-formed Ext 20 references anywhere in ``payload``."""
    tags: list[int] = []

    def hook(code: int, data: memoryview) -> Any:
        if code == X.NET_REF:
            try:
                tags.append(decode_descriptor(NetRef, data).tag)
            except DecodeError:
                pass
        return None

    try:
        msgspec.msgpack.Decoder(ext_hook=hook).decode(payload)
    except Exception:  # noqa: BLE001 - only the references matter here
        pass
    return tags


def net_transport(data: bytes) -> str:
    sent, msgs = _split(data)
    broken_at, n_records = _model(sent, msgs)
    t, sock, mon = _transport(msgs, sent)
    recv: NetRecvPool = t.recv_pool
    try:
        outcome = "ok"
        try:
            t.drain()
        except ProtocolError:
            outcome = "broken"
        if (outcome == "broken") != (broken_at is not None):
            raise Finding(f"the model says {broken_at}, the transport {outcome}: {msgs!r}")
        rx = t.rx
        if outcome == "ok":
            if len(rx.inbox) != n_records:
                raise Finding(f"{len(rx.inbox)} records in the inbox, the model {n_records}")
            if t.tx.acked > t.tx.sent or rx.inbox_bytes > rx.capacity:
                raise Finding(f"credit {t.tx.acked}/{t.tx.sent}, inbox {rx.inbox_bytes}")
        # the records accepted (before the break, if any) go through the resolver
        referenced: dict[int, int] = {}
        dec = Decoder(resolver=recv.resolve)
        decoded = 0
        values: list[Any] = []
        while (view := rx.next_frame()) is not None:
            for tag in _net_refs(bytes(view)):
                referenced[tag] = referenced.get(tag, 0) + 1
            try:
                values.append(recv.decode(dec, view))
                decoded += 1
            except DecodeError as exc:
                refused(exc)
            view.release()
            rx.commit()
        values.clear()
        if recv.held:
            gc.collect()
        if recv.held:
            raise Finding(f"arrays still held after the records were dropped: {recv.held}")
        recv.flush()
        released: dict[int, int] = {}
        for msg in sock.sent:
            if len(msg) == 2 and msg[1][:1] == b"R":
                for tag, _ in M.parse_control(msg[1])[1]:
                    released[tag] = released.get(tag, 0) + 1
        for tag, k in released.items():
            if k > referenced.get(tag, 0):
                raise Finding(f"array {tag} released {k} times, referenced {referenced}")
        if len(recv.queue):
            raise Finding("releases stuck in the queue")
        return outcome if decoded or outcome == "broken" else "ok, nothing decoded"
    finally:
        mon.gone = True
        t.close()


# ----------------------------------------------------------------- rendezvous, attach


def net_handshake(data: bytes) -> str:
    if not data:
        return "empty"
    mode, body = data[0] % 3, data[1:]
    if mode == 2:  # the attach: token and session are the first 32 bytes
        token, session, rest = body[:16], body[16:32], body[32:]
        frames = [f for f in rest.split(b"|")][:4]
        try:
            note = M.check_attach(frames, token, session)
        except HandshakeError:
            return "refused"
        if frames != [b"", b"H" + token + session + note]:
            raise Finding(f"an attach {frames!r} passed")
        return "ok"
    try:
        msg = M.decode_rendezvous(body, "fuzz")
    except HandshakeError:
        return "refused"
    try:
        if mode == 0:
            hello = M.check_hello(msg, 1 << 30)
            if not (1024 <= hello.capacity <= 1 << 30 and len(hello.session) == 16):
                raise Finding(f"a bad hello passed: {hello!r}")
        else:
            w = M.check_welcome(msg, "tcp://fuzz")
            if not (1 <= w.port <= 65535 and len(w.token) == 16):
                raise Finding(f"a bad welcome passed: {w!r}")
    except HandshakeError:
        return "invalid"
    if M.decode_rendezvous(M.encode_rendezvous(msg), "again") != msg:
        raise Finding(f"{msg!r} does not round-trip")
    return "ok"


# ---------------------------------------------------------------------------- seeds


def _control_seeds() -> list[bytes]:
    return [
        M.encode_control(b"C", 4096),
        M.encode_control(b"R", [(1, 1), (2, 1)]),
        b"E",
        b"X",
        b"B",
        b"K",
        M.encode_control(b"A", "ProtocolError: garbage"),
        M.encode_control(b"H", (b"t" * 16, b"s" * 16)),
        b"C\x00",
        b"R" + b"\x00" * 15,
        b"Z",
        b"",
    ]


def _framed_record(obj: Any, pool: NetSendPool) -> list[bytes]:
    placement = pool.placement(None)
    payload = NetEncoder().encode_with(obj, placement)
    return [bytes(payload), *(bytes(f) for f in getattr(payload, "frames", []))]


def _transport_seeds() -> list[bytes]:
    pool = NetSendPool(NET_SLOTS, deque(), 1 << 12)
    arr = np.arange(64, dtype=np.float32)
    rec1 = _framed_record({"x": arr, "n": 1}, pool)
    rec2 = _framed_record([arr[:32], np.ones(40, np.int16), "s"], pool)
    plain = [msgspec.msgpack.encode({"k": 1})]
    credit = [b"", M.encode_control(b"C", 64)]
    rel = [b"", M.encode_control(b"R", [(1, 1)])]
    eof = [b"", b"E"]
    forged = NetRef(1, 99, 1, 0, 300, (75,), "<f4", "numpy")
    lying = [msgspec.msgpack.encode(msgspec.msgpack.Ext(X.NET_REF, msgspec.msgpack.encode(forged)))]
    lying.append(b"\x00" * 256)  # says 300 bytes, has 256
    return [
        _join(256, [rec1, plain, credit, rec2]),
        _join(32, [plain, rel, eof]),
        _join(32, [rec1, eof, plain]),  # a record after E
        _join(8, [credit]),  # credit past what was sent
        _join(64, [rec2, rec2[:1], rec2 + [b"extra"]]),  # frames missing, extra
        _join(64, [lying]),
        _join(0, [[b"", b"C"], [b""], [b"", b"Q", b"x"]]),
        _join(0, [plain] * 150),  # past the lane's credit
        _join(0, [[b"", M.encode_control(b"A", "bye")], [b"", b"B"]]),
        _join(0, [[b"", _batch([b"\x01", b"\x02", plain[0]])], plain]),  # a send_many batch
        _join(0, [[b"", _batch([b"\x01"])], [b"", _batch([b"\x01", b""])]]),  # 1; an empty one
        _join(0, [[b"", _batch([b"x" * 300] * 4)]]),  # a batch past the credit
    ]


def _batch(records: list[bytes]) -> bytes:
    """An ``M`` message body: n x (u32 length, record)."""
    return b"M" + b"".join(struct.pack(">I", len(r)) + r for r in records)


def _hello(**kw: Any) -> bytes:
    args = dict(
        version=PROTOCOL_VERSION,
        session=b"s" * 16,
        capacity=1 << 16,
        budget=1 << 20,
        pid=1,
        host="h",
    )
    args.update(kw)
    return M.encode_rendezvous(M.Hello(**args))


def _handshake_seeds() -> list[bytes]:
    welcome = M.encode_rendezvous(M.Welcome(PROTOCOL_VERSION, 5555, b"t" * 16, 1 << 16, 1 << 20, 7))
    refuse = M.encode_rendezvous(M.Refused("no"))
    return [
        b"\x00" + _hello(),
        b"\x00" + _hello(capacity=1000),
        b"\x00" + _hello(session=b"short"),
        b"\x00" + welcome,
        b"\x01" + welcome,
        b"\x01" + refuse,
        b"\x01" + _hello(),
        b"\x02" + b"t" * 16 + b"s" * 16 + b"|H" + b"t" * 16 + b"s" * 16,
        b"\x02" + b"t" * 16 + b"s" * 16 + b"|H" + b"x" * 32,
    ]


NET_TARGETS = (
    ("net_control", net_control, _control_seeds, "TCP control messages (C R E X A B H K)"),
    ("net_transport", net_transport, _transport_seeds, "NetTransport receive path + Ext 20"),
    ("net_handshake", net_handshake, _handshake_seeds, "TCP rendezvous hello/welcome, attach"),
)
