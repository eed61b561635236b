"""ringwire._shm.sockets: the one driver of every handshake generator on a Unix socket.

A toy handshake (send a greeting, read an answer of a known length, return it) stands
for the channel handshake and the broadcast join, which drive through the same loop:
the result comes back, the generator is closed however the drive ends (its cleanup
runs: a real handshake unlinks its segments there), a peer gone while we send is a
HandshakeError unless the send was best effort, the deadline is a TimeoutError."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Generator

import anyio
import pytest

from ringwire._errors import HandshakeError
from ringwire._shm.sockets import Step, drive_handshake_async, drive_handshake_sync


def _recv(sock: socket.socket) -> bytes:
    return sock.recv(65536)


class Toy:
    """A handshake generator that records how it ended."""

    def __init__(self, greeting: bytes = b"hello", want: int = 7, kind: str = "send") -> None:
        self.greeting, self.want, self.kind = greeting, want, kind
        self.closed = False
        self.answers: list[bytes | None] = []

    def run(self) -> Generator[Step, bytes | None, bytes]:
        try:
            self.answers.append((yield (self.kind, self.greeting)))
            got = b""
            while len(got) < self.want:
                data = yield ("recv", None)
                assert data is not None
                if not data:
                    raise HandshakeError("the peer closed the connection")
                got += data
            return got
        finally:
            self.closed = True


@pytest.fixture
def pair() -> Generator[tuple[socket.socket, socket.socket], None, None]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _sync(toy: Toy, sock: socket.socket, timeout: float = 5.0) -> bytes:
    return drive_handshake_sync(
        toy.run(),
        sock,
        time.monotonic() + timeout,
        recv=_recv,
        eof=b"",
        closed="gone while we sent",
        timed_out="the toy handshake timed out",
    )


def test_sync_returns_the_result_and_answers_a_send_with_eof(pair) -> None:
    a, b = pair
    b.sendall(b"wel")  # part now, the rest while the driver waits
    toy = Toy()

    def later() -> None:
        time.sleep(0.05)
        b.sendall(b"come")

    t = threading.Thread(target=later)
    t.start()
    try:
        assert _sync(toy, a) == b"welcome"
    finally:
        t.join()
    assert b.recv(100) == b"hello"
    assert toy.closed and toy.answers == [b""]


def test_sync_times_out_and_closes_the_generator(pair) -> None:
    a, _ = pair
    toy = Toy()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="toy handshake timed out"):
        _sync(toy, a, timeout=0.1)
    assert 0.09 <= time.monotonic() - t0 < 2.0
    assert toy.closed


def test_end_of_file_is_answered_with_eof(pair) -> None:
    a, b = pair
    b.sendall(b"wel")
    b.shutdown(socket.SHUT_WR)  # end of file after "wel" (our hello still goes out)
    toy = Toy()
    with pytest.raises(HandshakeError, match="peer closed"):
        _sync(toy, a)
    assert toy.closed


def test_a_send_to_a_gone_peer_fails_unless_best_effort(pair) -> None:
    a, b = pair
    b.close()
    toy = Toy(greeting=b"x" * 1024)
    with pytest.raises(HandshakeError, match="gone while we sent"):
        _sync(toy, a)
    assert toy.closed
    # a refusal is sent best effort: its failure is ignored, the handshake goes on
    # (here to the end of file)
    toy = Toy(kind="send_best_effort")
    with pytest.raises(HandshakeError, match="peer closed"):
        _sync(toy, a)
    assert toy.closed


def test_a_large_send_waits_for_room(pair) -> None:
    a, b = pair
    big = b"y" * (4 << 20)  # more than the socket buffers hold
    toy = Toy(greeting=big, want=2)
    got = bytearray()

    def reader() -> None:
        while len(got) < len(big):
            got.extend(b.recv(1 << 20))
        b.sendall(b"ok")

    t = threading.Thread(target=reader)
    t.start()
    try:
        assert _sync(toy, a) == b"ok"
    finally:
        t.join()
    assert bytes(got) == big


async def _async(toy: Toy, sock: socket.socket) -> bytes:
    return await drive_handshake_async(
        toy.run(), sock, recv=_recv, eof=b"", closed="gone while we sent"
    )


@pytest.mark.anyio
async def test_async_returns_the_result(pair) -> None:
    a, b = pair
    toy = Toy()

    async def later() -> None:
        await anyio.sleep(0.05)
        b.sendall(b"welcome")

    async with anyio.create_task_group() as tg:
        tg.start_soon(later)
        assert await _async(toy, a) == b"welcome"
    assert b.recv(100) == b"hello"
    assert toy.closed


@pytest.mark.anyio
async def test_async_cancelled_closes_the_generator(pair) -> None:
    a, _ = pair
    toy = Toy()
    with anyio.move_on_after(0.1) as scope:
        await _async(toy, a)
    assert scope.cancelled_caught
    assert toy.closed
