"""The control protocol: handshake state machine (sans I/O) and socket helpers."""

from __future__ import annotations

import os
import socket
import stat
import struct

import msgspec
import pytest

from ringwire._errors import HandshakeError, PeerCredentialsError, ProtocolError, RingwireError
from ringwire._shm.sockets import bind_unix_socket, check_peer, peer_credentials
from ringwire._wire.control import (
    MAX_MESSAGE,
    SUPPORTED_VERSIONS,
    Handshake,
    Hello,
    Ready,
    Refused,
    RingSpec,
    SegmentSpec,
    Welcome,
    choose_version,
    decode_message,
    encode_message,
    validate_hello,
)
from ringwire._wire.ring import HEADER_SIZE

NAME = "/rw.123.0123456789ab"


def hello(**kw) -> Hello:
    cap = 4096
    lane = HEADER_SIZE + cap
    args = dict(
        versions=[1],
        pid=123,
        segments=[SegmentSpec(NAME, 2 * lane, "rings")],
        c2s=RingSpec(0, 0, cap),
        s2c=RingSpec(0, lane, cap),
    )
    args.update(kw)
    return Hello(**args)  # type: ignore[arg-type]


def exchange(client: Handshake, server: Handshake, data: bytes):
    server.receive_data(data)
    return server.next_message()


# -- messages -------------------------------------------------------------------------------


def test_message_roundtrip():
    for msg in (hello(), Welcome(version=1, pid=5), Ready(), Refused("no")):
        frame = encode_message(msg)
        (n,) = struct.unpack(">I", frame[:4])
        assert n == len(frame) - 4
        assert decode_message(frame[4:]) == msg


def test_unknown_fields_are_ignored():
    body = msgspec.msgpack.encode({"type": "welcome", "version": 1, "pid": 3, "future": [1, 2]})
    assert decode_message(body) == Welcome(version=1, pid=3)


def test_garbage_message():
    with pytest.raises(HandshakeError):
        decode_message(b"\xc1garbage")
    with pytest.raises(HandshakeError):
        decode_message(msgspec.msgpack.encode({"type": "nope"}))
    with pytest.raises(HandshakeError):
        decode_message(msgspec.msgpack.encode({"type": "welcome", "version": "1", "pid": 1}))


def test_error_hierarchy():
    assert issubclass(HandshakeError, ProtocolError)
    assert issubclass(ProtocolError, RingwireError)
    assert issubclass(PeerCredentialsError, PermissionError)


def test_choose_version():
    assert choose_version([1, 2, 99]) == 1
    with pytest.raises(HandshakeError, match="version"):
        choose_version([2, 3])
    assert SUPPORTED_VERSIONS == (1,)


# -- validate_hello ---------------------------------------------------------------------------


def test_validate_good_hello():
    validate_hello(hello())


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"magic": "http"}, "magic"),
        ({"segments": []}, "segments"),
        ({"segments": [SegmentSpec("/etc/passwd", 9000)]}, "name"),
        ({"segments": [SegmentSpec(NAME, -1)]}, "size"),
        ({"segments": [SegmentSpec(NAME, 1000)]}, "fit"),
        ({"c2s": RingSpec(1, 0, 4096)}, "missing segment"),
        ({"c2s": RingSpec(0, 0, 3000)}, "power of two"),
        ({"c2s": RingSpec(0, 8, 4096)}, "fit"),
        ({"s2c": RingSpec(0, 0, 4096)}, "overlap"),
        ({"c2s": RingSpec(0, 0, 1 << 31)}, "capacity"),
    ],
)
def test_validate_bad_hello(kw, match):
    with pytest.raises(HandshakeError, match=match):
        validate_hello(hello(**kw))


def test_validate_max_capacity():
    with pytest.raises(HandshakeError, match="limit"):
        validate_hello(hello(), max_capacity=2048)


# -- the state machine -----------------------------------------------------------------------


def test_happy_path_in_small_pieces():
    client, server = Handshake("client"), Handshake("server")
    data = client.send(hello())
    assert client.state == "await_welcome"
    for i in range(len(data) - 1):  # one byte at a time
        server.receive_data(data[i : i + 1])
        assert server.next_message() is None
    server.receive_data(data[-1:])
    got = server.next_message()
    assert got == hello()
    assert server.state == "send_welcome"
    client.receive_data(server.send(Welcome(version=1, pid=7)))
    assert isinstance(client.next_message(), Welcome)
    assert client.state == "send_ready"
    server.receive_data(client.send(Ready()) + b"DD")  # doorbells right behind
    assert server.next_message() == Ready()
    assert client.state == server.state == "done"
    assert server.leftover == b"DD"


def test_wrong_message_for_state():
    client, server = Handshake("client"), Handshake("server")
    with pytest.raises(HandshakeError, match="cannot send"):
        client.send(Ready())
    with pytest.raises(HandshakeError, match="cannot send"):
        server.send(Welcome(version=1, pid=1))
    server.receive_data(encode_message(Ready()))
    with pytest.raises(HandshakeError, match="unexpected Ready"):
        server.next_message()
    assert server.state == "failed"


def test_bad_length():
    server = Handshake("server")
    server.receive_data(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(HandshakeError, match="bad handshake frame length"):
        server.next_message()
    server = Handshake("server")
    server.receive_data(b"\x00\x00\x00\x00")
    with pytest.raises(HandshakeError, match="length 0"):
        server.next_message()
    server = Handshake("server")
    server.receive_data(struct.pack(">I", MAX_MESSAGE + 1))
    with pytest.raises(HandshakeError):
        server.next_message()


def test_garbage_body():
    server = Handshake("server")
    server.receive_data(struct.pack(">I", 5) + b"\xff\xff\xff\xff\xff")
    with pytest.raises(HandshakeError, match="malformed"):
        server.next_message()
    assert server.state == "failed"


def test_eof_mid_handshake():
    server = Handshake("server")
    server.receive_data(encode_message(hello())[:10])
    assert server.next_message() is None
    server.receive_data(b"")
    with pytest.raises(HandshakeError, match="closed"):
        server.next_message()


def test_reject_reaches_client():
    client, server = Handshake("client"), Handshake("server")
    server.receive_data(client.send(hello()))
    server.next_message()
    client.receive_data(server.send(Refused("bad version")))
    with pytest.raises(HandshakeError, match="refused.*bad version"):
        client.next_message()
    assert client.state == server.state == "failed"


def test_server_may_reject_after_welcome():
    client, server = Handshake("client"), Handshake("server")
    server.receive_data(client.send(hello()))
    server.next_message()
    server.send(Welcome(version=1, pid=1))
    server.send(Refused("changed my mind"))
    assert server.state == "failed"


def test_too_much_data():
    server = Handshake("server")
    with pytest.raises(HandshakeError, match="too much"):
        server.receive_data(b"\x00" * (MAX_MESSAGE + 10000))


def test_not_expecting_messages_when_done():
    c = Handshake("client")
    with pytest.raises(HandshakeError):
        c.next_message()  # must send hello first
    with pytest.raises(ValueError):
        Handshake("observer")  # type: ignore[arg-type]


def test_leftover_empty_until_done():
    server = Handshake("server")
    server.receive_data(b"\x00")
    assert server.leftover == b""


def test_message_too_large():
    big = hello(segments=[SegmentSpec(NAME, 1 << 20, "x" * MAX_MESSAGE)])
    with pytest.raises(HandshakeError, match="too large"):
        encode_message(big)


# -- socket helpers --------------------------------------------------------------------------


def test_peer_credentials_socketpair():
    a, b = socket.socketpair()
    with a, b:
        pid, uid, gid = peer_credentials(a)
        assert (pid, uid, gid) == (os.getpid(), os.geteuid(), os.getegid())
        assert check_peer(a) == os.getpid()


def test_check_peer_refuses_other_uid(monkeypatch):
    a, b = socket.socketpair()
    with a, b:
        monkeypatch.setattr(os, "geteuid", lambda: 4242)
        with pytest.raises(PeerCredentialsError, match="uid"):
            check_peer(a)


def test_bind_mode_0600_and_stale_replacement(tmp_path):
    path = str(tmp_path / "l.sock")
    old = os.umask(0)
    try:
        sock = bind_unix_socket(path)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert not sock.getblocking()
        with pytest.raises(OSError, match="live"):
            bind_unix_socket(path)  # a live listener is not replaced
    finally:
        sock.close()
    # the listener died without unlinking: the stale socket file is replaced
    assert os.path.exists(path)
    sock = bind_unix_socket(path)
    sock.close()
    os.unlink(path)


def test_bind_refuses_non_socket(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(FileExistsError):
        bind_unix_socket(str(path))


def test_bind_path_too_long(tmp_path):
    with pytest.raises(ValueError, match="too long"):
        bind_unix_socket(str(tmp_path / ("x" * 120)))
