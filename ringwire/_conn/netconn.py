"""``tcp://`` addresses: connecting and accepting over :mod:`ringwire._net`.

:func:`ringwire.connect`, :func:`ringwire.connect_sync`, :class:`ringwire.Listener` and
:class:`ringwire.SyncListener` route a ``tcp://host:port`` address here; the channels
they return are the same :class:`Channel` / :class:`SyncChannel` over a
:class:`~ringwire._net.transport.NetTransport`.  pyzmq is imported on first use; without
it a ``tcp://`` address raises ``ModuleNotFoundError`` saying what to install.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable
from typing import Any

import anyio

from .._net.keys import check_client, check_server

__all__ = [
    "DEFAULT_HEARTBEAT",
    "accept_loop",
    "check_heartbeat",
    "drive_async",
    "drive_sync",
    "load",
    "open_acceptor",
]

DEFAULT_HEARTBEAT = 3.0  # (ringwire._net.transport.DEFAULT_HEARTBEAT, without pyzmq)


def load() -> Any:
    """The :mod:`ringwire._net.handshake` module (imports pyzmq)."""
    try:
        from .._net import handshake
    except ModuleNotFoundError as exc:
        if exc.name != "zmq":
            raise
        raise ModuleNotFoundError(
            "tcp:// addresses need pyzmq: pip install 'ringwire[net]'", name="zmq"
        ) from exc
    return handshake


def check_heartbeat(heartbeat: float) -> None:
    if (
        isinstance(heartbeat, bool)
        or not isinstance(heartbeat, (int, float))
        or not 0.1 <= heartbeat <= 3600
    ):
        raise ValueError(
            f"heartbeat must be a number of seconds from 0.1 to 3600, not {heartbeat!r}"
        )


def _wait_ms(until: float) -> int:
    return max(0, int((until - time.monotonic()) * 1000) + 1)


def drive_sync(gen: Any) -> Any:
    """Run a handshake generator (see :mod:`ringwire._net.handshake`), blocking."""
    try:
        sock, until = next(gen)
        while True:
            sock.poll(_wait_ms(until))
            sock, until = gen.send(None)
    except StopIteration as stop:
        return stop.value
    finally:
        gen.close()


async def drive_async(gen: Any) -> Any:
    """Run a handshake generator on the event loop (cancellable).  It waits on an
    epoll descriptor over the ZeroMQ socket's, never on ZeroMQ's own: libuv (uvloop)
    must not poll a descriptor that libzmq reads."""
    import zmq

    ep = select.epoll()
    fd = -1
    try:
        sock, until = next(gen)
        while True:
            new = int(sock.getsockopt(zmq.FD))
            if new != fd:
                if fd >= 0:
                    ep.unregister(fd)
                ep.register(new, select.EPOLLIN)
                fd = new
            with anyio.move_on_after(max(0.0, until - time.monotonic())):
                await anyio.wait_readable(ep.fileno())
            sock, until = gen.send(None)
    except StopIteration as stop:
        return stop.value
    finally:
        gen.close()
        ep.close()


def connect_transport(
    url: str,
    *,
    capacity: int,
    slots: Any,
    heartbeat: float,
    timeout: float,
    keys: Any = None,
    max_message: int | None = None,
    offer_nixl: bool = True,
) -> tuple[Any, Any]:
    """The handshake generator for a client of ``url``, after checking and resolving
    the address (``ValueError`` / ``OSError`` naming it); ``keys`` a
    :class:`~ringwire.ClientKeys` or ``None`` (``TypeError`` otherwise)."""
    check_client(keys)
    hs = load()
    addr = hs.resolve(hs.parse_address(url))
    gen = hs.client_handshake(
        url,
        addr,
        capacity=capacity,
        slots=slots,
        heartbeat=heartbeat,
        deadline=time.monotonic() + timeout,
        keys=keys,
        max_message=max_message,
        offer_nixl=offer_nixl,
    )
    return hs, gen


def open_acceptor(
    url: str,
    *,
    max_capacity: int,
    slots: Any,
    heartbeat: float,
    handshake_timeout: float,
    insecure: bool,
    keys: Any = None,
    backlog: int = 128,
    offer_nixl: bool = True,
    clamp_capacity: bool = False,
) -> Any:
    """Bind the rendezvous at ``url``, with CURVE when ``keys`` (a
    :class:`~ringwire.ServerKeys`) are given.  A non-loopback address needs keys or
    ``insecure=True``.  ``offer_nixl=False``: tensors travel as frames on every
    connection; ``clamp_capacity``: a client asking for a larger lane than
    ``max_capacity`` gets ``max_capacity`` (instead of a refusal).  Raises ``ValueError`` / ``OSError`` naming the address."""
    hs = check_bind(url, insecure, keys)
    return hs.NetAcceptor(
        url,
        max_capacity=max_capacity,
        slots=slots,
        heartbeat=heartbeat,
        handshake_timeout=handshake_timeout,
        capacity_default=1 << 20,
        keys=keys,
        backlog=backlog,
        offer_nixl=offer_nixl,
        clamp_capacity=clamp_capacity,
    )


def check_bind(url: str, insecure: bool, keys: Any = None) -> Any:
    """Refuse a bad or (without keys or ``insecure``) non-loopback ``url``, and keys
    that are not :class:`~ringwire.ServerKeys` (``TypeError``), before anything is
    made; returns the handshake module."""
    check_server(keys)
    hs = load()
    addr = hs.parse_address(url, bind=True)
    if keys is not None and insecure:
        raise ValueError(
            f"listen({url!r}) was given both keys= and insecure=True: with keys the "
            "listener admits only its listed clients; drop insecure=True"
        )
    if not addr.is_loopback() and not insecure and keys is None:
        raise ValueError(
            f"refusing to listen at {url}: a non-loopback TCP address is reachable by "
            "anyone on the network; pass keys=ringwire.ServerKeys(secret=..., clients=...) "
            "(make keys with python -m ringwire keygen), bind 127.0.0.1, or pass "
            "insecure=True on a network you trust"
        )
    return hs


async def accept_loop(
    acceptor: Any, adopt: Callable[[Any], Any], refuse: Callable[[BaseException], None]
) -> None:
    """Accept on ``acceptor`` until it closes: ``adopt(transport)`` (which starts a
    task) for each finished handshake, ``refuse(exc)`` for each refusal."""
    while not acceptor.closed:
        done, refused = acceptor.step()
        for exc in refused:
            refuse(exc)
        for t in done:
            adopt(t)
        until = acceptor.next_deadline()
        try:
            with anyio.move_on_after(1.0 if until is None else max(0.0, until - time.monotonic())):
                await anyio.wait_readable(acceptor.fileno())
        except (anyio.ClosedResourceError, OSError, ValueError):
            return
