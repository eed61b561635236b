"""Connecting to a listener: :func:`connect` (async) and :func:`connect_sync`."""

from __future__ import annotations

import os
import socket
import time
from functools import partial
from typing import Any

import anyio

from .._net.keys import ClientKeys
from .._pool.slotconfig import DEFAULT_SLOTS, SlotConfig, resolve_config
from .._shm.handshake import client_handshake, drive_async, drive_sync
from .._shm.sockets import check_peer, hung_up
from .._wire.ring import validate_capacity
from .async_channel import Channel
from .endpoint import DEFAULT_SPIN_US, Endpoint
from .netconn import DEFAULT_HEARTBEAT, check_heartbeat, connect_transport
from .netconn import drive_async as net_drive_async
from .netconn import drive_sync as net_drive_sync
from .options import DEFAULT_HANDSHAKE_TIMEOUT, check_options, receiving
from .sync_channel import SyncChannel

__all__ = ["DEFAULT_CAPACITY", "connect", "connect_sync"]

DEFAULT_CAPACITY = 1 << 20
"""Bytes of each ring lane's data area (records up to half of it travel inline)."""


def _client_socket(path: str | os.PathLike[str]) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock


def _no_listener(path: str | os.PathLike[str], exc: OSError) -> OSError:
    """``exc`` from connecting to ``path``, said in terms of what was tried and what to
    do; the same exception type (so ``except FileNotFoundError`` still works), with
    the original chained."""
    where = os.fspath(path)
    if isinstance(exc, FileNotFoundError):
        what = (
            f"no ringwire listener at {where}: the socket file does not exist (start the "
            "listener first, or check the path)"
        )
    elif isinstance(exc, ConnectionRefusedError):
        what = (
            f"no ringwire listener at {where}: nothing accepts connections there (a "
            "listener that exited left its socket file, or the path is not a listening "
            "socket); start the listener, or remove the stale file"
        )
    elif isinstance(exc, PermissionError):
        what = (
            f"cannot connect to the ringwire listener at {where}: permission denied "
            "(its socket is 0600: run as the listener's user)"
        )
    else:
        what = f"cannot connect to a ringwire listener at {where}: {exc.strerror or exc}"
    return type(exc)(exc.errno, what)


def _checked(
    path: str | os.PathLike[str],
    capacity: int,
    spin_us: float,
    handshake_timeout: float,
    slots: SlotConfig | None,
    copy_out: bool,
    heartbeat: float,
    keys: ClientKeys | None,
) -> tuple[SlotConfig | None, Any]:
    """What both connects check before anything is made (raising ``ValueError`` /
    ``TypeError``): the resolved ``slots``, and for a ``tcp://`` address the handshake
    generator to drive (``None``: a Unix socket path)."""
    validate_capacity(capacity)
    check_options(spin_us, handshake_timeout, copy_out)
    slots = resolve_config(slots)
    if isinstance(path, str) and path.startswith("tcp://"):
        check_heartbeat(heartbeat)
        _, gen = connect_transport(
            path,
            capacity=capacity,
            slots=slots,
            heartbeat=heartbeat,
            timeout=handshake_timeout,
            keys=keys,
        )
        return slots, gen
    if keys is not None:
        raise ValueError(
            f"keys= is for tcp:// addresses; {os.fspath(path)!r} is a Unix socket, whose "
            "listener admits processes of its own uid only"
        )
    return slots, None


async def connect(
    path: str | os.PathLike[str],
    *,
    capacity: int = DEFAULT_CAPACITY,
    type: Any = Any,
    spin_us: float = DEFAULT_SPIN_US,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    slots: SlotConfig | None = DEFAULT_SLOTS,
    copy_out: bool = False,
    heartbeat: float = DEFAULT_HEARTBEAT,
    keys: ClientKeys | None = None,
) -> Channel:
    """Connect to the :class:`Listener` at ``path``; return the async endpoint.

    ``path`` is a Unix socket path on this host, or ``"tcp://host:port"``: a listener
    on another host, over ZeroMQ (``pip install 'ringwire[net]'``; the same channel,
    arrays beside the record as zero-copy frames).  ``heartbeat`` (TCP only) is how
    many seconds a silent peer is given before the connection counts as broken; a
    bad ``tcp://`` address is a ``ValueError`` naming it, an unknown host an
    ``OSError``.  ``keys`` (TCP only): a :class:`~ringwire.ClientKeys` for a listener
    that requires CURVE keys; a refusal -- this client's key not listed, keys missing
    on either side, a wrong server key -- raises :class:`PeerCredentialsError` at once.

    ``capacity`` is the data capacity of each ring lane (a power of two); ``type``
    decodes what arrives (``Any``: plain msgpack types); ``spin_us`` is how long a
    waiting call spins before it parks; ``handshake_timeout`` bounds the connecting
    and the handshake.  ``slots`` configures this side's tensor-slot *send* pool
    (``None``: no pool, every array this side sends travels inline).  ``copy_out``
    is this side's choice as a *receiver*: every array that arrives in one of the
    peer's slots is copied into private, writable memory and the slot released at
    once (it works with ``slots=None`` too).

    Raises ``ValueError`` / ``TypeError`` for a bad keyword (before anything is
    made), ``FileNotFoundError`` / ``ConnectionRefusedError`` / ``PermissionError``
    (naming the path) when no listener can be reached there, ``OSError`` for an
    unknown host, :class:`SharedMemoryFull` if ``/dev/shm`` cannot hold the rings or
    the pool, :class:`HandshakeError` if the listener refuses
    (:class:`PeerCredentialsError` for refused credentials), ``TimeoutError`` after
    ``handshake_timeout``.
    """
    slots, gen = _checked(
        path, capacity, spin_us, handshake_timeout, slots, copy_out, heartbeat, keys
    )
    if gen is not None:  # tcp://
        transport = receiving(await net_drive_async(gen), copy_out)
        return Channel(Endpoint(transport, type=type, spin_us=spin_us, name=os.fspath(path)))
    sock = _client_socket(path)
    try:
        with anyio.fail_after(handshake_timeout):
            while True:
                try:
                    sock.connect(os.fspath(path))
                    break
                except (BlockingIOError, InterruptedError):
                    await anyio.sleep(0.001)  # listener backlog full: retry
                except OSError as exc:
                    raise _no_listener(path, exc) from exc
            check_peer(sock)
            transport = await drive_async(
                client_handshake(capacity, slots, partial(hung_up, sock)), sock
            )
    except BaseException:
        sock.close()
        raise
    receiving(transport, copy_out)
    return Channel(Endpoint(transport, type=type, spin_us=spin_us, name=os.fspath(path)))


def connect_sync(
    path: str | os.PathLike[str],
    *,
    capacity: int = DEFAULT_CAPACITY,
    type: Any = Any,
    spin_us: float = DEFAULT_SPIN_US,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    slots: SlotConfig | None = DEFAULT_SLOTS,
    copy_out: bool = False,
    heartbeat: float = DEFAULT_HEARTBEAT,
    keys: ClientKeys | None = None,
) -> SyncChannel:
    """Blocking :func:`connect`: returns a :class:`SyncChannel` (``tcp://`` too).  The
    keywords, and what it raises, are :func:`connect`'s."""
    slots, gen = _checked(
        path, capacity, spin_us, handshake_timeout, slots, copy_out, heartbeat, keys
    )
    if gen is not None:  # tcp://
        transport = receiving(net_drive_sync(gen), copy_out)
        return SyncChannel(Endpoint(transport, type=type, spin_us=spin_us, name=os.fspath(path)))
    deadline = time.monotonic() + handshake_timeout
    sock = _client_socket(path)
    try:
        while True:
            try:
                sock.connect(os.fspath(path))
                break
            except OSError as exc:
                if not isinstance(exc, (BlockingIOError, InterruptedError)):
                    raise _no_listener(path, exc) from exc
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cannot connect to {path}: listener busy") from None
                time.sleep(0.001)
        check_peer(sock)
        transport = drive_sync(
            client_handshake(capacity, slots, partial(hung_up, sock)), sock, deadline
        )
    except BaseException:
        sock.close()
        raise
    receiving(transport, copy_out)
    return SyncChannel(Endpoint(transport, type=type, spin_us=spin_us, name=os.fspath(path)))
