"""Pairs: two connectable ends of one connection, for a parent and a child process.

:func:`pair` makes an anonymous ``socketpair`` (no socket file); each
:class:`PairEnd` crosses into a child as a ``multiprocessing.Process`` argument
(``spawn``, ``forkserver`` or ``fork``) and connects there with the same handshake as
a listener's connections.
"""

from __future__ import annotations

import os
import socket
import time
import warnings
import weakref
from functools import partial
from typing import Any

import anyio
from anyio import ClosedResourceError

from .._pool.slotconfig import DEFAULT_SLOTS, SlotConfig, resolve_config
from .._shm.handshake import (
    HandshakeGen,
    client_handshake,
    drive_async,
    drive_sync,
    server_handshake,
)
from .._shm.sockets import check_peer, hung_up
from .._wire.ring import MAX_CAPACITY, validate_capacity
from .async_channel import Channel
from .connect import DEFAULT_CAPACITY
from .endpoint import DEFAULT_SPIN_US, Endpoint
from .options import check_options, receiving
from .sync_channel import SyncChannel

__all__ = ["DEFAULT_PAIR_TIMEOUT", "PairEnd", "pair"]

DEFAULT_PAIR_TIMEOUT = 60.0

_fork_epoch = 0


def _after_fork() -> None:  # pragma: no cover - runs around fork
    global _fork_epoch
    _fork_epoch += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_parent=_after_fork, after_in_child=_after_fork)


class PairEnd:
    """One end of :func:`pair`, not yet connected.

    Pass it to a child process (as a ``multiprocessing.Process`` argument, with the
    ``spawn``, ``forkserver`` or ``fork`` start method) and call :meth:`connect` /
    :meth:`connect_sync` there; connect the other end in the parent.  Once the child
    is started, connecting the other end closes the parent's copy of this one, so the
    parent notices when the child dies.
    """

    def __init__(
        self,
        sock: socket.socket,
        role: str,
        capacity: int,
        sibling: PairEnd | None = None,
    ) -> None:
        self._sock: socket.socket | None = sock
        self._role = role
        self._capacity = capacity
        self._sibling: weakref.ref[PairEnd] | None = weakref.ref(sibling) if sibling else None
        self._epoch = _fork_epoch
        self._sent = False

    def __repr__(self) -> str:
        state = "open" if self._sock is not None else "used"
        return f"<PairEnd {self._role} {state}>"

    def moved(self) -> bool:
        """Was this end sent to a child process (or is this a forked copy)?"""
        return self._sent or self._epoch != _fork_epoch

    def __reduce__(self) -> Any:
        from multiprocessing import context, reduction

        if self._sock is None:
            raise ValueError("this PairEnd was already connected or closed")
        if context.get_spawning_popen() is None:
            raise TypeError(
                "a PairEnd can only be pickled as an argument of a starting multiprocessing.Process"
            )
        self._sent = True
        return (
            _rebuild_pair_end,
            (reduction.DupFd(self._sock.fileno()), self._role, self._capacity),
        )

    def set_sibling(self, sibling: PairEnd) -> None:
        """Note the other end made by the same :func:`pair` call (weakly).
        :func:`pair` calls it; an application never needs to."""
        self._sibling = weakref.ref(sibling)

    def close(self) -> None:
        """Drop this end without connecting (the other end's connect then fails)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _take(self) -> socket.socket:
        if self._sock is None:
            raise ClosedResourceError("this PairEnd was already connected or closed")
        sibling = self._sibling() if self._sibling is not None else None
        if sibling is not None and sibling.moved():
            sibling.close()  # it lives in another process now
        sock, self._sock = self._sock, None
        return sock

    def _handshake(self, sock: socket.socket, pid: int, slots: SlotConfig | None) -> HandshakeGen:
        if self._role == "client":
            return client_handshake(self._capacity, slots, partial(hung_up, sock))
        return server_handshake(pid, MAX_CAPACITY, slots)

    async def connect(
        self,
        *,
        type: Any = Any,
        spin_us: float = DEFAULT_SPIN_US,
        handshake_timeout: float = DEFAULT_PAIR_TIMEOUT,
        slots: SlotConfig | None = DEFAULT_SLOTS,
        copy_out: bool = False,
    ) -> Channel:
        """Finish the connection (the other end must connect too); the async endpoint.

        The keywords are :func:`~ringwire.connect`'s: ``slots`` configures this end's
        tensor-slot send pool, ``copy_out`` makes this end copy the arrays it receives
        in the other end's slots (each end chooses for itself); ``handshake_timeout``
        (default 60 s: a child process may take a while to start) bounds the wait for
        the other end.  Raises ``ValueError`` / ``TypeError`` for a bad keyword (the
        end stays usable), ``ClosedResourceError`` if this end was already connected
        or closed, :class:`SharedMemoryFull`, :class:`HandshakeError` (the other end
        went away or broke the handshake), ``TimeoutError`` after
        ``handshake_timeout``."""
        check_options(spin_us, handshake_timeout, copy_out)
        slots = resolve_config(slots)
        sock = self._take()
        try:
            with anyio.fail_after(handshake_timeout):
                pid = check_peer(sock)
                transport = await drive_async(self._handshake(sock, pid, slots), sock)
        except BaseException:
            sock.close()
            raise
        receiving(transport, copy_out)
        name = f"pair:{self._role}"
        return Channel(Endpoint(transport, type=type, spin_us=spin_us, name=name))

    def connect_sync(
        self,
        *,
        type: Any = Any,
        spin_us: float = DEFAULT_SPIN_US,
        handshake_timeout: float = DEFAULT_PAIR_TIMEOUT,
        slots: SlotConfig | None = DEFAULT_SLOTS,
        copy_out: bool = False,
    ) -> SyncChannel:
        """Blocking :meth:`connect` (the same keywords, the same exceptions)."""
        check_options(spin_us, handshake_timeout, copy_out)
        slots = resolve_config(slots)
        sock = self._take()
        try:
            deadline = time.monotonic() + handshake_timeout
            pid = check_peer(sock)
            transport = drive_sync(self._handshake(sock, pid, slots), sock, deadline)
        except BaseException:
            sock.close()
            raise
        receiving(transport, copy_out)
        name = f"pair:{self._role}"
        return SyncChannel(Endpoint(transport, type=type, spin_us=spin_us, name=name))

    def __del__(self) -> None:
        if getattr(self, "_sock", None) is not None:
            if not self._sent and self._epoch == _fork_epoch:
                warnings.warn(f"unused ringwire {self!r}", ResourceWarning, stacklevel=1)
            self.close()


def _rebuild_pair_end(dupfd: Any, role: str, capacity: int) -> PairEnd:
    fd = dupfd.detach()
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    return PairEnd(sock, role, capacity)


def pair(*, capacity: int = DEFAULT_CAPACITY) -> tuple[PairEnd, PairEnd]:
    """Two connectable ends of a new connection, for a parent and a child process.

    ::

        a, b = ringwire.pair()
        proc = ctx.Process(target=child_main, args=(b,)); proc.start()
        async with await a.connect() as chan: ...      # child: await b.connect()

    The first end creates the rings (its process must be able to reserve ``2 x
    capacity`` bytes of ``/dev/shm``); both ends must connect for either to finish.
    Each end's connect takes the keywords of :func:`connect` (``copy_out`` too: each
    end chooses for itself).  Raises ``ValueError`` for a ``capacity`` that is not a
    power of two in range, ``OSError`` if no socket pair can be made.
    """
    validate_capacity(capacity)
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    s1.setblocking(False)
    s2.setblocking(False)
    a = PairEnd(s1, "client", capacity)
    b = PairEnd(s2, "server", capacity, sibling=a)
    a.set_sibling(b)
    return a, b
