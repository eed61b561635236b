"""Connecting and accepting over TCP: addresses, the rendezvous, the attach.

A listener binds one ZeroMQ ``ROUTER`` socket at its address (the *rendezvous*).  A
client connects a ``DEALER`` there and sends a ``Hello`` (protocol version, a random
session id, its lane capacity and send budget, pid, host name).  The listener answers
with a ``Welcome`` -- the port of a ``PAIR`` socket it just bound for this connection
alone, and a random token -- or a ``Refused`` with the reason (the messages:
:mod:`ringwire._wire.net_control`).
The client connects a ``PAIR`` to that port and sends the attach (``H`` + token +
session id); the listener checks it, notes which TCP connection it came from (its
monitor then names that one's hang-up) and answers ``K``.  The connection's identity
is that session: a peer that comes back is a new connection (nothing reconnects).

Both hello and welcome end with ``nixl``: what the side can do with NIXL
(:func:`ringwire._net.nixl.offer`, ``""`` for nothing); large tensors go through NIXL
only when both said something (:mod:`.nixlpools`), and as ZeroMQ frames otherwise.
Then each side's NIXL note (agent metadata, regions) rides at the end of the attach
and of its answer (``H`` ... note, ``K`` note), so that both know the other's before
the first record; a side that cannot load the other's note turns NIXL off for that
connection and says so (``K O`` + why from the listener, ``O`` + why from the
client; the client confirms a loaded note with ``Y``), and the tensors travel as
frames (the table in :mod:`.nixlpools`).

With keys (:mod:`.keys`) every one of these sockets runs CURVE and the listener admits
only its listed clients; a refusal is an error on the client at once and a logged
refusal on the listener (:mod:`.curve`).

:func:`parse_address` validates a ``tcp://host:port`` address; a client resolves the
host first, so a bad name is an error naming it, and a refused rendezvous is a
``ConnectionRefusedError`` naming the address, as on one host.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import select
import socket
import time
from collections.abc import Generator
from typing import Any, NamedTuple

import zmq
from zmq.utils.monitor import parse_monitor_message

from .._errors import HandshakeError, NixlUnreachable, PeerCredentialsError, ProtocolError
from .._pool.slotconfig import SlotConfig
from .._wire.control import PROTOCOL_VERSION
from .._wire.net_control import (
    MAX_BUDGET,
    Hello,
    Refused,
    Welcome,
    check_attach,
    check_attach_answer,
    check_hello,
    check_welcome,
    decode_rendezvous,
    encode_control,
    encode_rendezvous,
    parse_control,
)
from . import nixl
from .curve import FAILED_EVENTS, Guard, client_refusal, flood, secure_client, server_refusal
from .keys import ClientKeys, ServerKeys
from .pools import NetEncoder, NetRecvPool, NetSendPool, budget_of
from .transport import NetTransport
from .zmqlife import close_monitored, configure, context, monitor_of

__all__ = [
    "Address",
    "NetAcceptor",
    "client_handshake",
    "is_tcp",
    "parse_address",
]

_LOGGED = 20  # failed handshakes one step reports one by one (the rest: counted)


class Address(NamedTuple):
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def is_tcp(path: Any) -> bool:
    return isinstance(path, str) and path.startswith("tcp://")


def parse_address(url: str, *, bind: bool = False) -> Address:
    """``tcp://host:port`` as an :class:`Address`.  Raises ``ValueError`` naming the
    address for anything else (``port`` 0 only when binding: any free port)."""
    if not is_tcp(url):
        raise ValueError(f"not a TCP address: {url!r} (expected tcp://host:port)")
    rest = url[len("tcp://") :]
    host, sep, port_s = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_s.isdigit():
        raise ValueError(f"bad TCP address {url!r}: expected tcp://host:port")
    port = int(port_s)
    if not (0 if bind else 1) <= port <= 65535:
        raise ValueError(f"bad TCP address {url!r}: port {port} out of range")
    if host == "*":
        host = "0.0.0.0"
    return Address(host, port)


def resolve(addr: Address) -> Address:
    """``addr`` with its host resolved to an IP address; ``OSError`` naming it."""
    try:
        infos = socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(exc.errno, f"cannot resolve the host of {addr.url}: {exc.strerror}") from exc
    return Address(str(infos[0][4][0]), addr.port)


def _make_transport(
    sock: zmq.Socket[Any],
    mon: zmq.Socket[Any],
    *,
    capacity: int,
    peer_capacity: int,
    peer_pid: int,
    peer_fd: int | None,
    address: str,
    slots: SlotConfig | None,
    link: Any = None,
    nixl_off: str = "",
) -> NetTransport:
    def pools(t: NetTransport) -> tuple[Any, Any, Any]:
        if link is not None:
            from .nixlpools import nixl_pools

            return nixl_pools(t, link, slots, peer_capacity)
        send = None
        if slots is not None:
            send = NetSendPool(slots, t.releases, peer_capacity // 2 - 1024)
        # (copy_out is set on the receive pool by whoever makes the endpoint)
        return send, NetRecvPool(t, False), NetEncoder()

    t = NetTransport(
        sock,
        mon,
        capacity=capacity,
        peer_capacity=peer_capacity,
        peer_pid=peer_pid,
        peer_fd=peer_fd,
        address=address,
        pools=pools,
    )
    t.nixl_off = nixl_off
    return t


def _budget(slots: SlotConfig | None) -> int:
    return budget_of(slots) if slots is not None else 0


def _nixl_link(slots: SlotConfig | None, peer_budget: int) -> Any:
    """The NIXL side of a connection whose both ends offered NIXL (its arenas made
    and registered; :mod:`.nixlpools`)."""
    from .nixlpools import prepare

    return prepare(_budget(slots), min(peer_budget, MAX_BUDGET))


def _drop_link(link: Any) -> None:
    link.close_send(False)
    link.close_recv()


def _load_note(link: Any, note: bytes, peer: str) -> str:
    """Load the peer's NIXL note into ``link``: ``""``, or why NIXL is off on this
    connection (logged; the link is closed then).  :class:`HandshakeError` for a
    malformed note."""
    try:
        link.load(note)
    except NixlUnreachable as exc:
        return _nixl_off(link, peer, str(exc))
    except ProtocolError as exc:
        raise HandshakeError(f"{peer} sent a bad NIXL note: {exc}") from None
    return ""


def _nixl_off(link: Any, peer: str, why: str) -> str:
    """NIXL is off on the connection with ``peer``: drop ``link``, say so (a warning),
    and return ``why``."""
    _drop_link(link)
    nixl.logger.warning(
        "NIXL is off on the connection with %s (tensors travel as ZeroMQ frames): %s",
        peer,
        why,
    )
    return why


def _no_nixl_here() -> str:
    return f"no NIXL in this process ({nixl.why_not() or 'nixl-cu12 is not installed'})"


# -- the client ------------------------------------------------------------------------

# A handshake is a generator that yields (socket, deadline): "wait until it is
# readable"; the sync and async drivers (ringwire._conn.connect) perform the waits.
Handshake = Generator[tuple[zmq.Socket[Any], float], None, NetTransport]


_STEP = 0.02  # seconds between looks at the rendezvous connection while waiting


def _recv_ready(sock: zmq.Socket[Any]) -> bool:
    return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def _send_now(sock: zmq.Socket[Any], parts: list[bytes]) -> None:
    """Send without waiting.  A handshake that failed already (a refused key can be
    quicker than this thread between ``connect`` and here) took the socket's only
    pipe with it, and a blocking send would wait forever; the monitor says why."""
    try:
        sock.send_multipart(parts, zmq.NOBLOCK)
    except zmq.Again:
        pass


def _events(mon: zmq.Socket[Any]) -> Generator[tuple[int, int], None, None]:
    """The events waiting on the monitor socket ``mon``, as ``(event, value)``."""
    while _recv_ready(mon):
        ev = parse_monitor_message(mon.recv_multipart())
        yield int(ev["event"]), int(ev["value"])


def client_handshake(
    url: str,
    addr: Address,
    *,
    capacity: int,
    slots: SlotConfig | None,
    heartbeat: float,
    deadline: float,
    keys: ClientKeys | None = None,
    max_message: int | None = None,
    offer_nixl: bool = True,
) -> Handshake:
    """Connect to the listener at ``addr`` (resolved); see the module docstring.
    Raises ``ConnectionRefusedError`` / ``TimeoutError`` naming ``url``,
    :class:`HandshakeError` when the listener refuses or misbehaves,
    :class:`~ringwire.PeerCredentialsError` when the CURVE handshake fails (a key
    refused, keys missing on one side, a wrong server key)."""
    ctx = context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        secure_client(dealer, keys)
    # the rendezvous connection stays open until the attach is answered: its hang-up is
    # a listener that died during the handshake (seen at once, not at the timeout)
    dmon = monitor_of(
        dealer,
        zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | FAILED_EVENTS,
    )
    pair: zmq.Socket[Any] | None = None
    pmon: zmq.Socket[Any] | None = None
    link: Any = None
    done = False
    connected = False

    def check_listener() -> None:
        nonlocal connected
        for event, value in _events(dmon):
            if event & FAILED_EVENTS:
                raise client_refusal(event, value, url, keys)
            if event == zmq.EVENT_CONNECTED:
                connected = True
            elif event == zmq.EVENT_CONNECT_RETRIED and not connected:
                raise ConnectionRefusedError(
                    111,
                    f"no ringwire listener at {url}: the connection was refused (start "
                    "the listener first, or check the host and port)",
                )
            elif event == zmq.EVENT_DISCONNECTED:
                raise HandshakeError(f"the listener at {url} went away during the handshake")

    try:
        dealer.connect(addr.url)
        session = secrets.token_bytes(16)
        hello = Hello(
            PROTOCOL_VERSION,
            session,
            capacity,
            _budget(slots),
            os.getpid(),
            socket.gethostname(),
            nixl.offer() if offer_nixl else "",  # (False: no agent is made)
        )
        _send_now(dealer, [encode_rendezvous(hello)])
        while not _recv_ready(dealer):
            check_listener()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no answer from a ringwire listener at {url} (timeout)")
            yield dealer, min(deadline, time.monotonic() + _STEP)
        reply = check_welcome(decode_rendezvous(dealer.recv(), "answer from the listener"), url)
        pair = ctx.socket(zmq.PAIR)
        if max_message is None:  # (a broadcast's remote reader: -1, any array size)
            max_message = max(capacity, min(reply.budget, MAX_BUDGET)) + 64
        configure(pair, heartbeat, max_message)
        if keys is not None:
            secure_client(pair, keys)
        pmon = monitor_of(pair)
        pair.connect(Address(addr.host, reply.port).url)
        nixl_off = (
            _no_nixl_here()
            if not hello.nixl
            else (f"the listener at {url} offered no NIXL" if not reply.nixl else "")
        )
        if not nixl_off:
            link = _nixl_link(slots, reply.budget)
        _send_now(pair, [b"", b"H" + reply.token + session + (link.note() if link else b"")])
        tcp_fd = None  # the connection's descriptor (its addresses go to inspect's row)
        while not _recv_ready(pair):
            check_listener()
            for event, value in _events(pmon):
                if event & FAILED_EVENTS:
                    raise client_refusal(event, value, url, keys)
                if event == zmq.EVENT_DISCONNECTED:
                    raise HandshakeError(f"the listener at {url} closed the attach")
                if event == zmq.EVENT_CONNECTED:
                    tcp_fd = value
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the listener at {url} did not answer the attach (timeout)")
            yield pair, min(deadline, time.monotonic() + _STEP)
        kind, value = check_attach_answer(pair.recv_multipart(), url, link is not None)
        if link is not None and kind == b"N":
            nixl_off = _load_note(link, value, f"the listener at {url}")
            # (first on the connection: the listener sends through NIXL only after Y)
            _send_now(pair, [b"", encode_control(b"O", nixl_off) if nixl_off else b"Y"])
        elif link is not None:
            nixl_off = _nixl_off(
                link,
                f"the listener at {url}",
                f"the listener at {url} could not use NIXL with this side: {value}"
                if kind == b"O"
                else f"the listener at {url} took no NIXL",
            )
        if nixl_off:
            link = None
        t = _make_transport(
            pair,
            pmon,
            capacity=capacity,
            peer_capacity=reply.capacity,
            peer_pid=reply.pid,
            peer_fd=None,
            address=url,
            slots=slots,
            link=link,
            nixl_off=nixl_off,
        )
        if tcp_fd is not None:
            t.status.endpoints(tcp_fd)
        done = True
        return t
    finally:
        close_monitored(dealer, dmon, 0)
        if not done and pair is not None and pmon is not None:
            close_monitored(pair, pmon, 0)
        if not done and link is not None:
            _drop_link(link)


# -- the listener ----------------------------------------------------------------------


MAX_PENDING = 128
"""Attaches in progress a listener keeps at most (as a Unix listener's backlog): each
holds a socket and a port until its client attaches or ``handshake_timeout`` passes, so
a flood of hellos is refused beyond this instead of exhausting descriptors and ports."""


def _curve_user(frame: zmq.Frame) -> str:
    """The CURVE key (z85) a message of a keyed socket came with: the User-Id the
    authenticator gave it.  :class:`HandshakeError` if it has none."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        user = ""
    if not user:
        raise HandshakeError("a message without a CURVE identity on a keyed listener")
    return str(user)


class _Pending:
    __slots__ = ("sock", "mon", "token", "hello", "deadline", "user", "nixl", "link", "fd")

    def __init__(
        self,
        sock: Any,
        mon: Any,
        token: bytes,
        hello: Hello,
        deadline: float,
        user: str | None,
        nixl: str = "",
    ) -> None:
        self.sock = sock
        self.mon = mon
        self.token = token
        self.hello = hello
        self.deadline = deadline
        self.user = user  # the client's CURVE key (z85) that said hello (keyed listeners)
        self.nixl = nixl  # what this side offered it (NIXL is on when both did)
        # answered with our NIXL note: waiting for the client's Y (or O) before the
        # connection is handed out, with its link and the attach's descriptor
        self.link: Any = None
        self.fd = 0

    @property
    def client(self) -> str:
        """The client, for messages: ``client pid N on 'host'``."""
        return f"client pid {self.hello.pid} on {self.hello.host!r}"


class NetAcceptor:
    """The listening side: the rendezvous socket and the attaches in progress.

    Never blocks: :meth:`step` does what can be done now and returns the transports
    of connections that finished their handshake, and the refusals (as exceptions);
    :meth:`waitables` says which sockets to wait on, and until when.  With ``keys``
    every socket runs CURVE, a :class:`~.curve.Guard` admits the listed clients only,
    and the refusals come out of :meth:`step` with the others.  ``backlog`` is the
    rendezvous's TCP listen backlog."""

    def __init__(
        self,
        url: str,
        *,
        max_capacity: int,
        slots: SlotConfig | None,
        heartbeat: float,
        handshake_timeout: float,
        capacity_default: int,
        keys: ServerKeys | None = None,
        backlog: int = 128,
        offer_nixl: bool = True,
        clamp_capacity: bool = False,
    ) -> None:
        self.url = url
        self._offer_nixl = offer_nixl  # (False: tensors travel as frames on every connection)
        # (True: a client asking for more than max_capacity gets max_capacity towards it)
        self._clamp = clamp_capacity
        addr = parse_address(url, bind=True)
        self._bind_host = addr.host
        self._max_capacity = max_capacity
        self._slots = slots
        self._heartbeat = heartbeat
        self._timeout = handshake_timeout
        self._capacity_default = capacity_default
        ctx = context()
        self._guard = Guard(keys, url) if keys is not None else None
        self._rmon: zmq.Socket[Any] | None = None
        try:
            self.router = ctx.socket(zmq.ROUTER)
        except BaseException:
            if self._guard is not None:
                self._guard.close()
            raise
        try:
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.setsockopt(zmq.MAXMSGSIZE, 4096)
            self.router.setsockopt(zmq.BACKLOG, backlog)  # (a full queue drops SYNs: 1 s stalls)
            if self._guard is not None:
                self._guard.secure(self.router)
                self._rmon = monitor_of(self.router, FAILED_EVENTS)
            if addr.port == 0:
                port = self.router.bind_to_random_port(
                    f"tcp://{addr.host if ':' not in addr.host else '[' + addr.host + ']'}"
                )
            else:
                self.router.bind(addr.url)
                port = addr.port
        except zmq.ZMQError as exc:
            self._close_rendezvous()
            raise OSError(exc.errno, f"cannot listen at {url}: {exc.strerror}") from exc
        except BaseException:
            self._close_rendezvous()
            raise
        self.address = Address(addr.host, port)
        self._pending: list[_Pending] = []
        self.backlog: list[NetTransport] = []  # accepted, not yet handed out (sync)
        self._ep = select.epoll()
        self._ep.register(int(self.router.getsockopt(zmq.FD)), select.EPOLLIN)
        if self._guard is not None and self._rmon is not None:
            self._ep.register(self._guard.fileno(), select.EPOLLIN)
            self._ep.register(int(self._rmon.getsockopt(zmq.FD)), select.EPOLLIN)
        self.closed = False

    def _close_rendezvous(self) -> None:
        if self._rmon is not None:
            close_monitored(self.router, self._rmon, 0)
        else:
            self.router.close(0)
        if self._guard is not None:
            self._guard.close()

    def _key_refusals(self) -> list[BaseException]:
        """The keyed rendezvous's refusals: the authenticator's, and the handshakes
        that failed below it (its monitor)."""
        guard, rmon = self._guard, self._rmon
        if guard is None or rmon is None:
            return []
        out = guard.refusals()
        more = 0
        for event, value in _events(rmon):
            exc = server_refusal(event, value, self.url, guard.keys)
            if exc is not None and len(out) < _LOGGED:
                out.append(exc)
            elif exc is not None:
                more += 1
        if more:
            out.append(flood(more, "failed CURVE handshakes"))
        return out

    def fileno(self) -> int:
        """Readable when :meth:`step` may have something to do."""
        return self._ep.fileno()

    def next_deadline(self) -> float | None:
        """When the earliest attach in progress times out (``None``: none is)."""
        return min((p.deadline for p in self._pending), default=None)

    def step(self) -> tuple[list[NetTransport], list[BaseException]]:
        done: list[NetTransport] = []
        refused: list[BaseException] = []
        if self.closed:
            return done, refused
        refused.extend(self._key_refusals())
        while _recv_ready(self.router):
            try:
                msg = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(msg) != 2:
                refused.append(HandshakeError(f"a hello of {len(msg)} frames"))
                continue
            rid = msg[0].bytes
            try:
                user = _curve_user(msg[1]) if self._guard is not None else None
                self._hello(rid, msg[1].bytes, user)
            except HandshakeError as exc:
                refused.append(exc)
                self.router.send_multipart(
                    (rid, encode_rendezvous(Refused(str(exc)))), zmq.NOBLOCK
                )
        now = time.monotonic()
        for p in list(self._pending):
            try:
                t = self._attach(p, now)
            except HandshakeError as exc:
                refused.append(exc)
                self._drop(p, str(exc))
                continue
            if t is not None:
                self._forget(p)
                done.append(t)
        return done, refused

    def _hello(self, rid: bytes, data: bytes, user: str | None) -> None:
        hello = check_hello(
            decode_rendezvous(data, "hello"), 1 << 30 if self._clamp else self._max_capacity
        )
        cap = self._lane(hello)
        if len(self._pending) >= MAX_PENDING:
            raise HandshakeError(
                f"{MAX_PENDING} handshakes are in progress at {self.url} (pid {hello.pid} on "
                f"{hello.host!r} refused): try again later"
            )
        sock: Any = None
        mon: Any = None
        try:
            sock = context().socket(zmq.PAIR)
            configure(sock, self._heartbeat, max(cap, hello.budget) + 64)
            if self._guard is not None:
                self._guard.secure(sock)
            mon = monitor_of(sock)
            host = self._bind_host if ":" not in self._bind_host else f"[{self._bind_host}]"
            port = sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:  # out of descriptors or ports: refuse this one
            if mon is not None:
                close_monitored(sock, mon, 0)
            elif sock is not None:
                sock.close(0)
            raise HandshakeError(f"no port for pid {hello.pid} on {hello.host!r}: {exc}") from exc
        token = secrets.token_bytes(16)
        offer = nixl.offer() if hello.nixl and self._offer_nixl else ""
        p = _Pending(sock, mon, token, hello, time.monotonic() + self._timeout, user, offer)
        self._pending.append(p)
        self._ep.register(int(sock.getsockopt(zmq.FD)), select.EPOLLIN)
        welcome = Welcome(
            PROTOCOL_VERSION, port, token, cap, _budget(self._slots), os.getpid(), offer
        )
        self.router.send_multipart((rid, encode_rendezvous(welcome)), zmq.NOBLOCK)

    def _attach(self, p: _Pending, now: float) -> NetTransport | None:
        sock = p.sock
        if not _recv_ready(sock):
            if now >= p.deadline:
                raise HandshakeError(
                    f"{p.client} did not "
                    f"{'confirm NIXL' if p.link is not None else 'attach'} within "
                    f"{self._timeout} s"
                )
            return None
        if p.link is not None:
            return self._confirmed(p)
        first = sock.recv(zmq.NOBLOCK, copy=False)
        fd = int(first.get(zmq.SRCFD))
        rest = sock.recv_multipart(zmq.NOBLOCK) if first.more else []
        try:
            peer_note = check_attach([first.bytes, *rest], p.token, p.hello.session)
        except HandshakeError as exc:
            raise HandshakeError(
                f"{exc} on the port given to pid {p.hello.pid} on {p.hello.host!r}"
            ) from None
        if p.user is not None and _curve_user(first) != p.user:
            raise PeerCredentialsError(
                f"the attach on the port given to pid {p.hello.pid} on {p.hello.host!r} "
                "came with another CURVE key than its hello"
            )
        peer = p.client
        link = None
        if not p.hello.nixl:
            nixl_off = f"{peer} offered no NIXL"
        elif not p.nixl:
            nixl_off = _no_nixl_here()
        else:
            nixl_off = "" if peer_note else f"{peer} sent no NIXL note"
        answer = b"K"
        if not nixl_off:
            link = _nixl_link(self._slots, p.hello.budget)
            try:
                nixl_off = _load_note(link, peer_note, peer)
            except BaseException:
                _drop_link(link)
                raise
            if nixl_off:
                link = None
                answer = b"K" + encode_control(b"O", nixl_off)
            else:
                answer = b"K" + link.note()
        try:
            sock.send_multipart((b"", answer), zmq.NOBLOCK)
        except BaseException:
            if link is not None:
                _drop_link(link)
            raise
        if link is not None:  # the client says whether it could load ours: Y or O
            p.link, p.fd = link, fd
            return self._confirmed(p) if _recv_ready(sock) else None
        return self._transport(p, fd, None, nixl_off)

    def _confirmed(self, p: _Pending) -> NetTransport:
        """The client's answer to our NIXL note (the first message after the attach):
        ``Y`` (it loaded it: NIXL on) or ``O`` + why (NIXL off: frames)."""
        link = p.link
        p.link = None
        try:
            msg = p.sock.recv_multipart(zmq.NOBLOCK)
            peer = p.client
            kind, value = (b"", None)
            if len(msg) == 2 and msg[0] == b"":
                with contextlib.suppress(ProtocolError):
                    kind, value = parse_control(msg[1])
            if kind not in (b"Y", b"O"):
                raise HandshakeError(
                    f"{peer} answered our NIXL note with {msg!r:.100} (expected Y or O)"
                )
        except BaseException:
            _drop_link(link)
            raise
        nixl_off = ""
        if kind == b"O":
            nixl_off = _nixl_off(link, peer, f"{peer} could not use NIXL with this side: {value}")
            link = None
        return self._transport(p, p.fd, link, nixl_off)

    def _lane(self, hello: Hello) -> int:
        """The lane a connection gets for ``hello``: what it asked (clamped to
        ``max_capacity`` by an acceptor that clamps)."""
        return min(hello.capacity, self._max_capacity) if self._clamp else hello.capacity

    def _transport(self, p: _Pending, fd: int, link: Any, nixl_off: str) -> NetTransport:
        host = f"{p.hello.host} pid {p.hello.pid}"
        cap = self._lane(p.hello)
        t = _make_transport(
            p.sock,
            p.mon,
            capacity=cap,
            peer_capacity=cap,
            peer_pid=p.hello.pid,
            peer_fd=fd,
            address=f"{self.url} <- {host}",
            slots=self._slots,
            link=link,
            nixl_off=nixl_off,
        )
        t.peer_host = p.hello.host
        return t

    def _forget(self, p: _Pending) -> None:
        if p in self._pending:
            self._pending.remove(p)
            self._ep.unregister(int(p.sock.getsockopt(zmq.FD)))

    def _drop(self, p: _Pending, reason: str | None = None) -> None:
        """Close an attach in progress; with a ``reason``, tell the peer on that port
        first (an abort, ``A`` + reason, as on a connection)."""
        self._forget(p)
        if p.link is not None:
            _drop_link(p.link)
            p.link = None
        linger = 0
        if reason is not None:
            with contextlib.suppress(zmq.ZMQError):  # (no peer on the port: nobody to tell)
                p.sock.send_multipart((b"", encode_control(b"A", reason)), zmq.NOBLOCK)
                linger = 200
        close_monitored(p.sock, p.mon, linger)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for p in list(self._pending):
                self._drop(p)
            self._close_rendezvous()
            self._ep.close()
            for t in self.backlog:
                t.close()
            self.backlog.clear()
