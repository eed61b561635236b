"""Unix-socket helpers of the shared-memory transport: peer credentials, listening.

Every connection's control socket is a Unix stream socket (mode 0600); the kernel
tells each side who the other is (``SO_PEERCRED``), so a peer running as another user
is refused before a byte of the handshake is read.
"""

from __future__ import annotations

import os
import select
import socket
import stat
import struct

from .._errors import PeerCredentialsError
from .._wire.control import DOORBELL_SPACE, ControlReader, encode_abort

__all__ = ["ControlSocketEnd", "bind_unix_socket", "check_peer", "hung_up", "peer_credentials"]

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
