"""The shared-memory transport's handshake: one generator per role, two drivers.

The protocol (messages, order, the sans-I/O state machine) is
:mod:`ringwire._wire.control`.  Here each role is a generator that creates, attaches,
checks and unlinks segments and yields what to do on the control socket --
``("send", bytes)``, ``("send_best_effort", bytes)`` (a refusal) or ``("recv", None)``,
answered with the bytes received (``b""`` at end of file) -- and returns a
:class:`HandshakeResult`.  :func:`drive_async` and :func:`drive_sync` perform those
steps on a non-blocking socket (with the one handshake driver of
:mod:`ringwire._shm.sockets`) and return the :class:`~ringwire._shm.transport.ShmTransport`.
Whatever goes wrong, a failed handshake leaves no segment and no name behind.
"""

from __future__ import annotations

import mmap
import os
import socket
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import posix_ipc

from .._errors import HandshakeError, RingCorrupted, RingwireError, SegmentError
from .._pool.arena import ArenaFile, ArenaMapper
from .._pool.segment import Segment, check_descriptor, unlink_segment
from .._pool.slotconfig import SlotConfig, attach_pool, create_pool
from .._wire.control import (
    MAX_SEGMENTS,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Handshake,
    Hello,
    Ready,
    Refused,
    RingSpec,
    SegmentSpec,
    Welcome,
    choose_version,
    validate_hello,
    validate_segments,
)
from .._wire.names import name_pid
from .._wire.ring import check_ring, init_ring, ring_size
from .sockets import Step, drive_handshake_async, drive_handshake_sync, recv_with_fds
from .transport import OwnPool, PeerPool, ShmTransport

__all__ = [
    "HandshakeGen",
    "HandshakeResult",
    "client_handshake",
    "drive_async",
    "drive_sync",
    "server_handshake",
]


# A handshake generator yields ringwire._shm.sockets.Step: ("send", bytes),
# ("send_best_effort", bytes) or ("recv", None); the driver answers a "recv" with the
# bytes received (b"" at EOF).


@dataclass
class HandshakeResult:
    segments: list[Segment]
    tx: tuple[int, int]
    rx: tuple[int, int]
    peer_pid: int
    own_pool: OwnPool | None
    peer_pool: PeerPool | None


Received = tuple[bytes, "list[int] | None"]
HandshakeGen = Generator[Step, Received, HandshakeResult]
_TOO_MANY = f"more descriptors than a handshake message carries ({MAX_SEGMENTS})"


class Descriptors(list[int]):
    """The descriptors received during a handshake (the receiver closes them);
    ``cut``: the peer sent more than a message carries (the kernel cut them off)."""

    cut = False


def _recv_message(hs: Handshake, fds: Descriptors) -> Generator[Step, Received, Any]:
    """The next handshake message; the descriptors that came with its bytes are added
    to ``fds`` (the caller closes them, whatever happens)."""
    while True:
        msg = hs.next_message()
        if msg is not None:
            return msg
        data, got = yield ("recv", None)
        if got is None:
            fds.cut = True
        else:
            fds.extend(got)
        hs.receive_data(data)


def _spec(seg: Segment | ArenaFile, role: str, fds: list[int]) -> SegmentSpec:
    """How ``seg`` (a segment or an arena's file) is announced: by name, or as the
    next of the descriptors ``fds`` sent with the message."""
    if seg.kind == "memfd":
        fds.append(seg.fd)
        return SegmentSpec(seg.name, seg.size, role, fd=len(fds) - 1)
    return SegmentSpec(seg.name, seg.size, role)


def _attach(spec: SegmentSpec, fds: Sequence[int]) -> Segment:
    """Map the segment ``spec`` announces (checked by :func:`validate_segments`)."""
    if spec.fd == -1:
        return Segment.attach(spec.name, spec.size)
    return Segment.from_fd(fds[spec.fd], spec.name, spec.size, "memfd")


def _open_arena(spec: SegmentSpec, fds: Sequence[int], pool_id: int) -> ArenaMapper:
    """The peer's arena (see :mod:`ringwire._pool.arena`): checked like a segment,
    not mapped (each reference maps its own range); its descriptor is kept."""
    if spec.size % mmap.PAGESIZE:
        raise HandshakeError(f"arena size {spec.size} is not a whole number of pages")
    if spec.fd >= 0:
        check_descriptor(fds[spec.fd], spec.name, spec.size, "memfd")
        fd = os.dup(fds[spec.fd])
    else:
        try:
            shm = posix_ipc.SharedMemory(spec.name)
        except posix_ipc.Error as exc:
            raise SegmentError(f"cannot open the peer's arena {spec.name}: {exc}") from None
        try:
            check_descriptor(shm.fd, spec.name, spec.size, "named")
            fd = os.dup(shm.fd)
        finally:
            shm.close_fd()
    return ArenaMapper(fd, spec.size, pool_id)


def _roles(specs: Sequence[SegmentSpec], who: str) -> dict[str, int]:
    """Index of the one "slots" and the one "arena" segment among ``specs`` (if any);
    an arena needs a pool.  Raises :class:`HandshakeError`."""
    found: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if spec.role in ("slots", "arena"):
            if spec.role in found:
                raise HandshakeError(f"{who} announced more than one {spec.role} segment")
            found[spec.role] = i
    if "arena" in found and "slots" not in found:
        raise HandshakeError(f"{who} announced an arena without a slot pool")
    return found


def _attach_peer_pool(specs: Sequence[SegmentSpec], fds: Sequence[int]) -> PeerPool | None:
    """Attach and check the peer's send pool (the one segment of role "slots") and
    open its arena (role "arena")."""
    validate_segments(specs, len(fds), "the listener")
    roles = _roles(specs, "the listener")
    if "slots" not in roles:
        return None
    spec = specs[roles["slots"]]
    try:
        seg = _attach(spec, fds)
    except SegmentError as exc:
        raise HandshakeError(f"cannot attach the peer's slot pool: {exc}") from None
    try:
        layout = attach_pool(seg)
        mapper = None
        if "arena" in roles:
            mapper = _open_arena(specs[roles["arena"]], fds, layout.pool_id)
    except (RingwireError, OSError) as exc:
        seg.close()
        raise HandshakeError(f"the peer's slot pool is malformed: {exc}") from None
    return seg, layout, mapper


def _make_pool(
    slots: SlotConfig, specs: list[SegmentSpec], out: list[int], keep_going: Any = None
) -> OwnPool:
    """This side's send pool (and arena), announced in ``specs`` / ``out``."""
    pseg, layout = create_pool(slots, keep_going)
    arena = None
    try:
        if slots.large_limit is not None:
            arena = ArenaFile()
        specs.append(_spec(pseg, "slots", out))
        if arena is not None:
            specs.append(_spec(arena, "arena", out))
    except BaseException:
        pseg.unlink()
        pseg.close()
        if arena is not None:
            arena.close()
        raise
    return pseg, layout, slots, arena


def _drop_own(own: OwnPool | None) -> None:
    if own is not None:
        own[0].unlink()
        own[0].close()
        if own[3] is not None:
            own[3].close()


def _unlink_own(own: OwnPool | None) -> None:
    if own is not None:
        own[0].unlink()
        if own[3] is not None:
            own[3].unlink()


def _drop_peer(peer: PeerPool | None) -> None:
    if peer is not None:
        peer[0].close()
        if peer[2] is not None:
            peer[2].close()


def client_handshake(
    capacity: int,
    slots: SlotConfig | None = None,
    peer_gone: Callable[[], bool] | None = None,
) -> HandshakeGen:
    """The connecting side.  ``peer_gone`` (non-blocking) is asked while the rings and
    the pool are reserved, which takes tens of milliseconds for a large pool on a busy
    machine: a listener that dies meanwhile is noticed then, not after."""

    def keep_going() -> None:
        if peer_gone is not None and peer_gone():
            raise HandshakeError(
                "the listener closed the connection during the handshake (while this "
                "side reserved its rings and slot pool)"
            )

    lane = ring_size(capacity)
    seg = Segment.create(2 * lane, keep_going)
    own: OwnPool | None = None
    peer: PeerPool | None = None
    got = Descriptors()  # received: ours to close
    try:
        init_ring(seg.buf, 0, capacity)
        init_ring(seg.buf, lane, capacity)
        out: list[int] = []
        specs = [_spec(seg, "rings", out)]
        if slots is not None:
            keep_going()
            own = _make_pool(slots, specs, out, keep_going)
            keep_going()
        hs = Handshake("client")
        hello = Hello(
            versions=list(SUPPORTED_VERSIONS),
            pid=os.getpid(),
            segments=specs,
            c2s=RingSpec(0, 0, capacity),
            s2c=RingSpec(0, lane, capacity),
        )
        yield ("send", (hs.send(hello), out))
        seg.close_fd()  # the descriptors are on their way: the mappings keep the memory
        if own is not None:
            own[0].close_fd()
        welcome = yield from _recv_message(hs, got)
        assert isinstance(welcome, Welcome)
        if got.cut:
            raise HandshakeError(f"the listener passed {_TOO_MANY}")
        if welcome.version not in SUPPORTED_VERSIONS:
            raise HandshakeError(f"the listener chose unsupported version {welcome.version}")
        seg.unlink()  # the server has attached: the names can go
        _unlink_own(own)
        peer = _attach_peer_pool(welcome.segments, got)  # other roles: not ours to use
        if peer is not None:  # attached: its names can go now (the server may die before Ready)
            for spec in welcome.segments:
                if spec.fd == -1 and spec.role in ("slots", "arena"):
                    unlink_segment(spec.name)
        yield ("send", hs.send(Ready()))
        return HandshakeResult([seg], (0, 0), (0, lane), welcome.pid, own, peer)
    except BaseException:
        seg.unlink()
        seg.close()
        _drop_own(own)
        _drop_peer(peer)  # the server unlinks its own names
        raise
    finally:
        for fd in got:
            os.close(fd)


def server_handshake(
    cred_pid: int, max_capacity: int, slots: SlotConfig | None = None, *, own_names: bool = False
) -> HandshakeGen:
    """The accepting side.  ``cred_pid`` is the peer's pid from SO_PEERCRED (for a
    socketpair, the pid of the process that made the pair).  ``own_names`` (a
    listener): every segment the client announces must carry the client's own pid, so
    a client cannot point the server at another process's segments (whose names are
    visible in ``/dev/shm`` while that process's handshake is in flight)."""
    hs = Handshake("server")
    got = Descriptors()  # received: ours to close, whatever happens
    try:
        hello = yield from _recv_message(hs, got)
    except HandshakeError as exc:
        for fd in got:
            os.close(fd)
        # a client that died before its Hello may leave a segment nobody can name;
        # the listener sweeps once that pid is gone
        exc.before_hello = True  # type: ignore[attr-defined]
        raise
    except BaseException:
        for fd in got:
            os.close(fd)
        raise
    assert isinstance(hello, Hello)
    attached: dict[int, Segment] = {}
    own: OwnPool | None = None
    peer: PeerPool | None = None
    mapper: ArenaMapper | None = None
    ok = False
    try:
        try:
            if got.cut:
                raise HandshakeError(f"the client passed {_TOO_MANY}")
            version = choose_version(hello.versions)
            validate_hello(hello, max_capacity=max_capacity, nfds=len(got))
            if own_names:  # (a memory file came from the client itself)
                for spec in hello.segments:
                    if spec.fd == -1 and name_pid(spec.name) != cred_pid:
                        raise HandshakeError(
                            f"segment {spec.name} was not made by the connecting process "
                            f"(pid {cred_pid})"
                        )
            roles = _roles(hello.segments, "the client")
            for role, i in roles.items():
                if i in (hello.c2s.segment, hello.s2c.segment):
                    raise HandshakeError(f"a ring lies in the {role} segment")
            for i, spec in enumerate(hello.segments):
                if i != roles.get("arena"):
                    attached[i] = _attach(spec, got)
            for ring in (hello.c2s, hello.s2c):
                check_ring(attached[ring.segment].buf, ring.offset, ring.capacity)
            if "slots" in roles:
                pseg = attached[roles["slots"]]
                try:
                    layout = attach_pool(pseg)
                except RingwireError as exc:
                    raise HandshakeError(f"malformed slot pool: {exc}") from None
                if "arena" in roles:
                    mapper = _open_arena(hello.segments[roles["arena"]], got, layout.pool_id)
                peer = (pseg, layout, mapper)
            for fd in got:  # mapped (or duplicated): the mappings keep the memory
                os.close(fd)
            got.clear()
            out: list[int] = []
            specs: list[SegmentSpec] = []
            if slots is not None:
                own = _make_pool(slots, specs, out)
        except (HandshakeError, SegmentError, RingCorrupted, OSError) as exc:
            yield ("send_best_effort", hs.send(Refused(str(exc))))
            raise HandshakeError(f"client pid {hello.pid}: {exc}") from None
        welcome = Welcome(version=version, pid=os.getpid(), segments=specs)
        yield ("send", (hs.send(welcome), out))
        if own is not None:
            own[0].close_fd()
        yield from _recv_message(hs, got)  # Ready: the client attached our pool
        if got or got.cut:
            raise HandshakeError(f"client pid {hello.pid} passed descriptors with Ready")
        _unlink_own(own)
        ok = True
        rings = [seg for seg in attached.values() if not (peer and seg is peer[0])]
        index = {id(seg): i for i, seg in enumerate(rings)}
        return HandshakeResult(
            rings,
            (index[id(attached[hello.s2c.segment])], hello.s2c.offset),
            (index[id(attached[hello.c2s.segment])], hello.c2s.offset),
            hello.pid,
            own,
            peer,
        )
    finally:
        for fd in got:
            os.close(fd)
        if not ok:
            for seg in attached.values():
                seg.close()
            if mapper is not None:
                mapper.close()
            _drop_own(own)
            # a client that died mid-handshake cannot unlink its names any more
            for spec in hello.segments:
                try:
                    if spec.fd == -1 and name_pid(spec.name) in (hello.pid, cred_pid):
                        unlink_segment(spec.name)
                except ValueError:
                    pass


def _finish(r: HandshakeResult, sock: socket.socket) -> ShmTransport:
    return ShmTransport(
        sock, r.segments, r.tx, r.rx, r.peer_pid, PROTOCOL_VERSION, r.own_pool, r.peer_pool
    )


_CLOSED = "the peer closed the connection during the handshake"


def _recv(sock: socket.socket) -> Received:
    return recv_with_fds(sock, MAX_SEGMENTS, strict=False)


_EOF: Received = (b"", [])  # (read only: the handshake only extends from it)


async def drive_async(gen: HandshakeGen, sock: socket.socket) -> ShmTransport:
    """Perform handshake ``gen`` on non-blocking ``sock`` (bounded by the caller's cancel
    scope) and make the transport.  Raises :class:`~ringwire.HandshakeError` and
    whatever ``gen`` raises."""
    result = await drive_handshake_async(gen, sock, recv=_recv, eof=_EOF, closed=_CLOSED)
    return _finish(result, sock)


def drive_sync(gen: HandshakeGen, sock: socket.socket, deadline: float) -> ShmTransport:
    """Perform handshake ``gen`` on non-blocking ``sock`` by ``deadline`` and make the
    transport.  Raises ``TimeoutError``, :class:`~ringwire.HandshakeError` and
    whatever ``gen`` raises."""
    result = drive_handshake_sync(
        gen,
        sock,
        deadline,
        recv=_recv,
        eof=_EOF,
        closed=_CLOSED,
        timed_out="the ringwire handshake timed out",
    )
    return _finish(result, sock)
