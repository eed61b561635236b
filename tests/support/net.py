"""TCP pairs for the channel tests: two connected ends over ``tcp://127.0.0.1``.

The accepting end is made from a :class:`~ringwire._net.handshake.NetAcceptor`
directly (no :class:`~ringwire.Listener`, which would close its connections with
itself), so a TCP pair is used exactly like a shared-memory one.  Skips the test when
pyzmq is missing.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import anyio
import pytest

from ringwire._conn.async_channel import Channel
from ringwire._conn.connect import connect, connect_sync
from ringwire._conn.endpoint import DEFAULT_SPIN_US, Endpoint
from ringwire._conn.sync_channel import SyncChannel
from ringwire._pool.slotconfig import DEFAULT_SLOTS, resolve_config

zmq = pytest.importorskip("zmq")

from ringwire._net.handshake import NetAcceptor  # noqa: E402

_SERVER_KEYS = ("type", "spin_us", "slots", "heartbeat")


def _acceptor(kw: dict[str, Any]) -> NetAcceptor:
    return NetAcceptor(
        "tcp://127.0.0.1:0",
        max_capacity=1 << 30,
        slots=resolve_config(kw.get("slots", DEFAULT_SLOTS)),
        heartbeat=kw.get("heartbeat", 3.0),
        handshake_timeout=10.0,
        capacity_default=1 << 20,
    )


def _accept(acc: NetAcceptor, deadline: float) -> Any:
    while time.monotonic() < deadline:
        done, refused = acc.step()
        assert not refused, refused
        if done:
            return done[0]
        time.sleep(0.001)
    raise TimeoutError("no TCP connection accepted")


def _server_end(acc: NetAcceptor, kw: dict[str, Any], transport: Any) -> Endpoint:
    return Endpoint(
        transport,
        type=kw.get("type", Any),
        spin_us=kw.get("spin_us", DEFAULT_SPIN_US),
        name=acc.url,
    )


async def tcp_pair(**kw: Any) -> tuple[Channel, Channel]:
    """``(client, server)`` async channels; ``kw`` as for ``connect``."""
    acc = _acceptor(kw)
    try:
        url = acc.address.url
        client: Channel | None = None

        async def dial() -> None:
            nonlocal client
            client = await connect(url, **kw)

        async with anyio.create_task_group() as tg:
            tg.start_soon(dial)
            deadline = time.monotonic() + 10
            while True:
                done, refused = acc.step()
                assert not refused, refused
                if done:
                    break
                assert time.monotonic() < deadline, "no TCP connection accepted"
                await anyio.sleep(0.001)
        assert client is not None
        return client, Channel(_server_end(acc, kw, done[0]))
    finally:
        acc.close()


def tcp_sync_pair(**kw: Any) -> tuple[SyncChannel, SyncChannel]:
    """``(client, server)`` blocking channels."""
    acc = _acceptor(kw)
    try:
        out: list[SyncChannel] = []
        t = threading.Thread(target=lambda: out.append(connect_sync(acc.address.url, **kw)))
        t.start()
        transport = _accept(acc, time.monotonic() + 10)
        t.join()
        return out[0], SyncChannel(_server_end(acc, kw, transport))
    finally:
        acc.close()


def free_url() -> str:
    """A ``tcp://127.0.0.1`` address whose port was free a moment ago."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"tcp://127.0.0.1:{port}"


def port_free(url: str, patience: float = 2.0) -> bool:
    """Nothing listens at ``url`` any more (within ``patience`` seconds: libzmq closes
    sockets in its own thread).  SO_REUSEADDR: a connection in TIME_WAIT is no leak."""
    deadline = time.monotonic() + patience
    while True:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
        finally:
            s.close()
        time.sleep(0.05)
