"""Unix-socket helpers of the shared-memory transport: peer credentials, listening,
and the one driver of every handshake on such a socket.

Every connection's control socket is a Unix stream socket (mode 0600); the kernel
tells each side who the other is (``SO_PEERCRED``), so a peer running as another user
is refused before a byte of the handshake is read.

A handshake -- a channel's (:mod:`ringwire._shm.handshake`) or a broadcast reader's
join (:mod:`ringwire._shm.broadcast_reader`) -- is a sans-I/O generator of
:data:`Step`; :func:`drive_handshake_sync` and :func:`drive_handshake_async` perform
its steps on a non-blocking socket, receiving with a callable the caller passes (plain
bytes, or bytes and descriptors).  Both run one loop (:func:`_perform`), which yields
what to wait for; they only wait.
"""

from __future__ import annotations

import math
import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Generator
from typing import TypeVar

import anyio

from .._errors import HandshakeError, PeerCredentialsError
from .._wire.control import DOORBELL_SPACE, ControlReader, encode_abort

__all__ = [
    "ControlSocketEnd",
    "ring_at",
    "Step",
    "bind_unix_socket",
    "check_peer",
    "drive_handshake_async",
    "drive_handshake_sync",
    "hung_up",
    "peer_credentials",
    "poll_fd",
    "recv_with_fds",
]

_HANGUP = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR


def hung_up(sock: socket.socket) -> bool:
    """Has the other end of ``sock`` closed (or died)?  Never waits, reads nothing."""
    p = select.poll()
    p.register(sock.fileno(), _HANGUP)
    return bool(p.poll(0))


class ControlSocketEnd:
    """The control-socket half of a shared-memory transport -- a channel's end
    (:class:`~ringwire._shm.transport.ShmTransport`) and a broadcast reader
    (:class:`~ringwire._shm.broadcast_reader.SubscriberTransport`) alike: doorbells out
    and in, the peer's abort, the hang-up.  A subclass sets ``_sock`` (non-blocking),
    ``_fd``, ``_control`` and the two doorbell counters."""

    _sock: socket.socket
    _fd: int
    _control: ControlReader
    doorbells_sent: int
    doorbells_received: int

    def _release_bell(self) -> None:
        # the release sink's doorbell: a finalizer may run it, so it never blocks
        self._sock.send(DOORBELL_SPACE)

    def fileno(self) -> int:
        return self._fd

    def ring(self, byte: bytes) -> bool:
        try:
            self._sock.send(byte)
            self.doorbells_sent += 1
        except BlockingIOError:
            pass  # the buffer holds unread doorbells: the peer will wake anyway
        except OSError:
            return False
        return True

    def drain(self) -> bool:
        sock = self._sock
        while True:
            try:
                data = sock.recv(512)
            except BlockingIOError:
                return False
            except InterruptedError:
                continue
            except OSError:
                return True
            if not data:
                return True
            self.doorbells_received += self._control.feed(data)
            if self._control.reason is not None:
                return True  # the peer dropped the connection (it closes right after)
            if len(data) < 512:
                return False

    @property
    def peer_reason(self) -> str | None:
        return self._control.reason

    def abort(self, reason: str) -> None:
        try:
            self._sock.send(encode_abort(reason))
        except OSError:
            pass  # a full socket (the peer stopped reading) or a gone peer

    def hung_up(self) -> bool:
        # POLLRDHUP is seen even behind unread doorbell bytes (they stay for the
        # waiters they belong to)
        return hung_up(self._sock)

    def shutdown(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


_UCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def check_peer(sock: socket.socket) -> int:
    """Refuse a peer with another uid; return its pid."""
    pid, uid, _ = peer_credentials(sock)
    if uid != os.geteuid():
        raise PeerCredentialsError(
            f"refusing a peer running as uid {uid} (pid {pid}); we are uid {os.geteuid()}"
        )
    return pid


def bind_unix_socket(path: str, backlog: int = 128) -> socket.socket:
    """A nonblocking listening Unix socket at ``path``, mode 0600."""
    path = os.fspath(path)
    if len(os.fsencode(path)) >= 108:
        raise ValueError(f"socket path too long for a Unix socket (max 107 bytes): {path!r}")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISSOCK(st.st_mode):
            # a leftover from a crashed listener is replaced; a live one is not
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(path)
            else:
                raise OSError(f"another listener is live at {path}")
            finally:
                probe.close()
        else:
            raise FileExistsError(f"{path} exists and is not a socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)  # the socket file is created 0600, never wider
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        try:
            os.chmod(path, 0o600)
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            os.unlink(path)
            raise
    except BaseException:
        sock.close()
        raise
    return sock


# -- driving a handshake ------------------------------------------------------------------

Step = tuple[str, "bytes | tuple[bytes, list[int]] | None"]
"""What a handshake generator asks of its driver: ``("send", bytes)`` or ``("send",
(bytes, descriptors))`` (the descriptors travel with the first byte, ``SCM_RIGHTS``; if
the peer is gone, :class:`~ringwire.HandshakeError`), ``("send_best_effort", bytes)``
(a refusal: a failure is ignored) or ``("recv", None)``.  A receive is answered with
what the receive callable returned (``eof`` at end of file or on a reset connection),
a send with ``eof``."""


def recv_with_fds(
    sock: socket.socket, maxfds: int, strict: bool = True
) -> tuple[bytes, list[int] | None]:
    """Receive bytes and the descriptors that came with them (at most ``maxfds``; the
    caller owns and closes them).  When the peer sent more, the kernel cut them off
    (and closed the rest); the ones that did arrive are closed here, and then
    ``strict`` raises :class:`~ringwire.HandshakeError`, else the descriptors are
    ``None`` (the bytes still count: the handshake can answer with a refusal)."""
    data, fds, flags, _ = socket.recv_fds(sock, 65536, maxfds)
    if flags & getattr(socket, "MSG_CTRUNC", 0):
        for fd in fds:
            os.close(fd)
        if not strict:
            return data, None
        raise HandshakeError(
            f"the peer passed more descriptors than a handshake message carries ({maxfds})"
        )
    return data, list(fds)

R = TypeVar("R")
T = TypeVar("T")


def poll_fd(fd: int, events: int, timeout: float | None) -> bool:
    """Wait until ``fd`` has one of ``events`` (``select.POLL*``), at most ``timeout``
    seconds (``None``: no limit); ``False`` if it timed out."""
    p = select.poll()
    p.register(fd, events)
    ms = -1 if timeout is None else max(0, math.ceil(timeout * 1000))
    return bool(p.poll(ms))


def _perform(
    gen: Generator[Step, R, T],
    sock: socket.socket,
    recv: Callable[[socket.socket], R],
    eof: R,
    closed: str,
) -> Generator[int, None, T]:
    """Perform ``gen``'s steps on ``sock``; yield ``select.POLLIN`` / ``POLLOUT`` when
    the socket must become readable / writable first; return ``gen``'s result.
    Raises :class:`~ringwire.HandshakeError` (``closed``) when a send finds the peer
    gone, and whatever ``gen`` or ``recv`` raise.  ``gen`` is closed in any case."""
    try:
        step = next(gen)
        while True:
            kind, data = step
            answer = eof
            if kind == "recv":
                while True:
                    try:
                        answer = recv(sock)
                        break
                    except (BlockingIOError, InterruptedError):
                        yield select.POLLIN
                    except (ConnectionResetError, BrokenPipeError):
                        break
            else:
                assert data is not None
                fds: list[int] = []
                if isinstance(data, tuple):
                    data, fds = data
                view = memoryview(data)
                try:
                    while view:
                        try:
                            if fds:  # with the first byte that goes
                                sent = socket.send_fds(sock, [view], fds)
                                fds = []
                            else:
                                sent = sock.send(view)
                            view = view[sent:]
                        except (BlockingIOError, InterruptedError):
                            yield select.POLLOUT
                except OSError:
                    if kind == "send":
                        raise HandshakeError(closed) from None
            step = gen.send(answer)
    except StopIteration as stop:
        result: T = stop.value
        return result
    finally:
        gen.close()


def drive_handshake_sync(
    gen: Generator[Step, R, T],
    sock: socket.socket,
    deadline: float,
    *,
    recv: Callable[[socket.socket], R],
    eof: R,
    closed: str,
    timed_out: str,
) -> T:
    """Run handshake ``gen`` on non-blocking ``sock`` by ``deadline`` (a
    ``time.monotonic()`` value): its result.  Raises ``TimeoutError`` (``timed_out``)
    past the deadline, :class:`~ringwire.HandshakeError` (``closed``: the peer went
    away while we sent), and whatever ``gen`` raises."""
    steps = _perform(gen, sock, recv, eof, closed)
    try:
        events = next(steps)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(timed_out)
            poll_fd(sock.fileno(), events, left)
            events = steps.send(None)
    except StopIteration as stop:
        result: T = stop.value
        return result
    finally:
        steps.close()


async def drive_handshake_async(
    gen: Generator[Step, R, T],
    sock: socket.socket,
    *,
    recv: Callable[[socket.socket], R],
    eof: R,
    closed: str,
) -> T:
    """Run handshake ``gen`` on non-blocking ``sock`` (bounded by the caller's cancel
    scope): its result.  Raises :class:`~ringwire.HandshakeError` (``closed``: the peer
    went away while we sent) and whatever ``gen`` raises."""
    steps = _perform(gen, sock, recv, eof, closed)
    try:
        events = next(steps)
        while True:
            if events == select.POLLIN:
                await anyio.wait_readable(sock)
            else:
                await anyio.wait_writable(sock)
            events = steps.send(None)
    except StopIteration as stop:
        result: T = stop.value
        return result
    finally:
        steps.close()


def ring_at(wake: socket.socket, when: float, closing: threading.Event) -> None:
    """(A thread) Ring ``wake`` at ``when``, unless the hub closes first."""
    if not closing.wait(max(0.0, when - time.monotonic()) + 0.01):
        try:
            wake.send(b"w")
        except OSError:
            pass
