"""A listener that dies while the client reserves its (large) slot pool is noticed
within the reservation, not after it: the 100 ms detection promise holds here too."""

from __future__ import annotations

import os
import socket
import threading
import time
from functools import partial

import pytest

from ringwire import HandshakeError, SlotConfig
from ringwire._pool import segment
from ringwire._shm.handshake import client_handshake, drive_sync
from ringwire._shm.sockets import hung_up


def test_the_client_stops_reserving_when_the_listener_dies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = os.posix_fallocate
    calls: list[float] = []

    def slow_fallocate(fd: int, off: int, n: int) -> None:  # a busy machine: 25 ms a chunk
        calls.append(time.monotonic())
        time.sleep(0.025)
        real(fd, off, n)

    monkeypatch.setattr(segment.os, "posix_fallocate", slow_fallocate)
    client, listener = socket.socketpair()
    client.setblocking(False)
    died: list[float] = []

    def die() -> None:
        time.sleep(0.06)
        died.append(time.monotonic())
        listener.close()

    t = threading.Thread(target=die)
    t.start()
    try:
        gen = client_handshake(4096, SlotConfig(), partial(hung_up, client))  # 81 MiB pool
        with pytest.raises(HandshakeError, match="listener closed the connection"):
            drive_sync(gen, client, time.monotonic() + 10)
        noticed = time.monotonic()
    finally:
        t.join()
        client.close()
    assert died and noticed - died[0] < 0.1, noticed - died[0]
    assert len(calls) < 81 // 16 + 2  # it stopped part-way through the reservation
