"""CURVE on the sockets of a ``tcp://`` connection, and the ZAP authenticator.

What is protected
-----------------
Every socket of a keyed connection runs CURVE: the client's rendezvous ``DEALER`` and
the listener's ``ROUTER`` (the hello, the welcome and its token travel encrypted), and
both ``PAIR`` sockets of the connection.  A listener admits a client only if its key
is in :attr:`ServerKeys.clients <ringwire._net.keys.ServerKeys>` -- on the rendezvous
and again on the connection's own port -- and the attach must come from the same key
as the hello (the ``User-Id`` libzmq attaches to each message), so a token alone opens
nothing.  Server sockets set ``ZMQ_ZAP_ENFORCE_DOMAIN``: without an authenticator
answering, libzmq refuses every client instead of admitting every one.

The authenticator
-----------------
libzmq asks a ZAP handler (a socket bound at ``inproc://zeromq.zap.01`` of the
socket's context) whether a client's key may connect, and waits for the answer.  This
process's one context (:func:`~.zmqlife.context`) gets one handler, shared by every
keyed listener of the process, each under a ZAP domain of its own (:class:`Guard`):
pyzmq's :class:`zmq.auth.Authenticator` (the ZAP protocol and the key check, through
its credentials callback) answering from a thread of ours, ``ringwire-zap``.  It is
started with the first keyed listener and stopped -- the thread joined, its sockets
closed -- when the last one closes, so nothing outlives the listeners.

A thread, not :class:`zmq.auth.asyncio.AsyncioAuthenticator`: the answer must come
whatever API the listener is driven by (a :class:`~ringwire.SyncListener` in a thread
has no event loop; trio is not asyncio) and however busy the caller's loop is -- a
handshake waits for it, and a client's ``connect`` with it.  Not pyzmq's
:class:`~zmq.auth.thread.ThreadAuthenticator` either: its thread runs an event loop
made by the global asyncio policy, and under ``uvloop.install()`` that loop never
answered (every keyed connect hung; measured).  Ours waits with a plain
:class:`zmq.Poller` and runs pyzmq's answer (a coroutine since pyzmq 25, which never
waits here) to completion on a private selector loop.

Refusals are reported
---------------------
libzmq's refusals are silent to the application on both ends; the socket monitors say
what happened (``EVENT_HANDSHAKE_FAILED_AUTH`` / ``_PROTOCOL`` / ``_NO_DETAIL``), and
this module turns them into a :class:`~ringwire.PeerCredentialsError` saying why and
what to do.  A client raises it at once (:func:`client_refusal`); a listener logs it
(logger ``ringwire``) and counts it in ``statistics().refused``, and keeps serving.  A
key refusal names the client's address (the ZAP request carries it); a failure below
that (a client without keys, or without this listener's public key) does not: libzmq's
monitor does not say which peer a failed handshake came from.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import itertools
import logging
import os
import socket
import threading
from collections import deque
from typing import Any

import zmq
from zmq.auth.base import Authenticator

from .._errors import HandshakeError, PeerCredentialsError
from .keys import PUBLIC_SUFFIX, SECRET_SUFFIX, ClientKeys, ServerKeys
from .zmqlife import context

__all__ = ["FAILED_EVENTS", "Guard", "client_refusal", "flood", "secure_client", "server_refusal"]

FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_MISMATCH = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
_CRYPTO = zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC


def secure_client(sock: zmq.Socket[Any], keys: ClientKeys) -> None:
    """CURVE client options on ``sock`` (before it connects)."""
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_serverkey = keys.server_key


def client_refusal(event: int, value: int, url: str, keys: ClientKeys | None) -> HandshakeError:
    """The error a client raises for a failed ZeroMQ handshake with ``url``."""
    mine = ""
    if keys is not None:
        name = keys.secret.name
        stem = name[: -len(SECRET_SUFFIX)] if name.endswith(SECRET_SUFFIX) else "NAME"
        mine = f"{keys.secret.with_name(stem + PUBLIC_SUFFIX)} (this client's public key)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return PeerCredentialsError(
            f"the listener at {url} refused this client's CURVE key "
            f"{keys.public_key.decode() if keys else ''} (ZAP status {value}): it is not "
            f"among the listener's clients; copy {mine} into its clients directory"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MISMATCH:
        if keys is None:
            return PeerCredentialsError(
                f"the listener at {url} requires CURVE keys: connect with "
                "keys=ringwire.ClientKeys(secret=..., server=...) (make a pair with "
                "python -m ringwire keygen)"
            )
        return PeerCredentialsError(
            f"the listener at {url} does not use CURVE keys but this client was given "
            "keys=: it cannot prove who it is, so nothing was sent (start the listener "
            "with keys=ringwire.ServerKeys(...), or connect without keys=)"
        )
    if keys is not None:
        return PeerCredentialsError(
            f"the CURVE handshake with {url} failed ({_what(event, value)}): the listener "
            f"does not hold the secret key of the server certificate {keys.server} (a "
            "wrong or outdated server key), or it dropped the connection"
        )
    return HandshakeError(f"the ZeroMQ handshake with {url} failed ({_what(event, value)})")


def _what(event: int, value: int) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == _CRYPTO:
            return "a message did not decrypt"
        if value == _MISMATCH:
            return "the peers speak different security mechanisms"
        return f"ZeroMQ protocol error {value:#x}"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return f"the connection closed: {os.strerror(value) if 0 < value < 200 else value}"
    return f"ZeroMQ handshake event {event} ({value})"


def server_refusal(event: int, value: int, url: str, keys: ServerKeys) -> HandshakeError | None:
    """What a keyed listener's rendezvous reports for a failed handshake (``None``
    for a key refusal: the authenticator reported it, with the address)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return None
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MISMATCH:
        why = "a client connected without CURVE keys (it must connect with keys=ClientKeys)"
    elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _CRYPTO:
        why = (
            "a client's CURVE hello did not decrypt: it does not have this listener's "
            f"public key {keys.public_key.decode()} (the {PUBLIC_SUFFIX} of {keys.secret})"
        )
    else:
        why = f"a client's CURVE handshake failed ({_what(event, value)})"
    return PeerCredentialsError(
        f"{why}; ZeroMQ does not say which address a failed handshake came from"
    )


def flood(n: int, what: str) -> PeerCredentialsError:
    """One refusal standing for ``n`` (its ``count``) that are not logged one by one."""
    exc = PeerCredentialsError(f"{n} more {what} (a flood: not logged one by one)")
    exc.count = n  # type: ignore[attr-defined]
    return exc


# -- the authenticator -------------------------------------------------------------------------


logger = logging.getLogger("ringwire")
THREAD_NAME = "ringwire-zap"


class _Authenticator(Authenticator):
    """pyzmq's ZAP authenticator, answering from the ``ringwire-zap`` thread; it notes
    each request's address (:attr:`peer`) for the refusal it may become."""

    peer = ""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        super().__init__(ctx)
        self._stop_r, self._stop_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True)

    def start(self) -> None:
        super().start()  # binds the ZAP socket
        self._thread.start()

    def _serve(self) -> None:
        loop = asyncio.SelectorEventLoop()  # only runs pyzmq's answer to completion
        poller = zmq.Poller()
        poller.register(self.zap_socket, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._stop_r.fileno() in ready:  # (a plain socket comes back as its fd)
                    return
                try:
                    msg = self.zap_socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                # ZAP request: version, request id, domain, address, identity, mechanism...
                self.peer = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
                try:
                    answer = self.handle_zap_message(msg)
                    if inspect.isawaitable(answer):
                        loop.run_until_complete(answer)
                except Exception:  # never leave libzmq waiting: deny (ZAP, RFC 27)
                    logger.exception("ringwire: the CURVE authenticator failed; client denied")
                    with contextlib.suppress(zmq.ZMQError):
                        rid = msg[1] if len(msg) > 1 else b""
                        self.zap_socket.send_multipart([b"1.0", rid, b"500", b"error", b"", b""])
        finally:
            loop.close()

    def stop(self) -> None:
        """Stop and join the thread, then close the ZAP socket."""
        if self._thread.is_alive():
            self._stop_w.send(b"x")
            self._thread.join()
        super().stop()
        self._stop_r.close()
        self._stop_w.close()


_lock = threading.Lock()
_auth: _Authenticator | None = None
_auth_pid = 0
_guards: dict[str, Guard] = {}
_ids = itertools.count(1)
_QUEUED = 100  # refusals a guard keeps until the listener takes them (then: counted)


def _stop_authenticator() -> None:
    global _auth
    with _lock:  # (the authenticator's thread never takes the lock)
        auth, _auth = _auth, None
        _guards.clear()
        if auth is not None and _auth_pid == os.getpid():
            auth.stop()


class Guard:
    """One keyed listener's hold on the authenticator: its ZAP domain and its refusals.

    :meth:`secure` puts the listener's keys and domain on a server socket.  The
    authenticator's thread calls :meth:`callback` for each client of the domain; a
    refusal is queued and :meth:`fileno` becomes readable until :meth:`refusals`
    takes them."""

    def __init__(self, keys: ServerKeys, url: str) -> None:
        global _auth, _auth_pid
        self.keys = keys
        self.url = url
        self.domain = f"ringwire.{os.getpid()}.{next(_ids)}"
        self._queue: deque[BaseException] = deque(maxlen=_QUEUED)
        self._dropped = 0  # refusals that fell off the full queue (a flood)
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self.closed = False
        ctx = context()
        with _lock:
            if _auth is not None and (_auth_pid != os.getpid() or _auth.context is not ctx):
                _auth = None  # a forked child's copy, or a closed context's
                _guards.clear()
            if _auth is None:
                auth = _Authenticator(ctx)
                auth.start()
                _auth, _auth_pid = auth, os.getpid()
                # after the context's own exit hook, so it runs first (LIFO)
                atexit.unregister(_stop_authenticator)
                atexit.register(_stop_authenticator)
            _guards[self.domain] = self
            _auth.configure_curve_callback(self.domain, self)

    def secure(self, sock: zmq.Socket[Any]) -> None:
        """CURVE server options on ``sock`` (before it binds)."""
        sock.curve_server = True
        sock.curve_secretkey = self.keys.secret_key
        sock.curve_publickey = self.keys.public_key
        sock.zap_domain = self.domain.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def callback(self, domain: str, key: bytes) -> bool:
        """The authenticator's question (in its thread): may ``key`` (z85) connect?"""
        peer = _auth.peer if _auth is not None else "?"
        try:
            if key in self.keys.admitted():
                return True
            why = (
                f"the client at {peer} presented the CURVE key {key.decode()}, which is not "
                f"among this listener's clients in {self.keys.clients} (copy the client's "
                f"{PUBLIC_SUFFIX} there to admit it)"
            )
        except Exception as exc:  # the directory went away or went bad: admit nobody
            why = f"the client at {peer} was refused: its key cannot be checked: {exc}"
        if len(self._queue) == _QUEUED:
            self._dropped += 1
        self._queue.append(PeerCredentialsError(why))
        with contextlib.suppress(OSError):
            self._w.send(b"r")
        return False

    def fileno(self) -> int:
        return self._r.fileno()

    def refusals(self) -> list[BaseException]:
        with contextlib.suppress(OSError):
            while self._r.recv(4096):
                pass
        out: list[BaseException] = []
        while self._queue:
            out.append(self._queue.popleft())
        dropped, self._dropped = self._dropped, 0
        if dropped:
            out.append(flood(dropped, "key refusals"))
        return out

    def close(self) -> None:
        """Give up the domain; the last guard of the process stops the authenticator."""
        global _auth
        if self.closed:
            return
        self.closed = True
        with _lock:  # held while stopping: a new guard must not bind the ZAP socket meanwhile
            if _guards.get(self.domain) is self:
                del _guards[self.domain]
                if _auth is not None:
                    _auth.credentials_providers.pop(self.domain, None)
                    if not _guards:
                        auth, _auth = _auth, None
                        auth.stop()
        self._r.close()
        self._w.close()
