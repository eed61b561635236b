"""The life of this process's ZeroMQ sockets: the context, a connection socket's options,
monitors, and closing a connection's socket late.

Why late: libzmq drops what a peer had received but not yet read when a connection
goes, so a socket closed at once could take our last records, ``E`` and ``B`` with it.
A closed connection's socket is *retired* instead and closed once its peer hung up too
or after :data:`GRACE` seconds (:func:`retire`, :func:`reap`); at exit, everything left
is flushed for at most :data:`LINGER_MS`.  Monitors are switched off before they are
closed (:func:`close_monitored`): libzmq's I/O thread sends monitor events blocking.
"""

from __future__ import annotations

import atexit
import itertools
import os
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

__all__ = [
    "GONE_EVENTS",
    "GRACE",
    "HANDSHAKE_FAILED",
    "LINGER_MS",
    "MONITOR_EVENTS",
    "close_monitored",
    "configure",
    "context",
    "monitor_of",
    "reap",
    "retire",
]

LINGER_MS = 2000  # a closed socket keeps sending what was queued this long at most

_ctx: zmq.Context[Any] | None = None
_ctx_pid = 0


def context() -> zmq.Context[Any]:
    """This process's ZeroMQ context (a fresh one in a forked child); at exit it
    flushes what closed sockets still queue, for at most :data:`LINGER_MS`."""
    global _ctx, _ctx_pid
    if _graveyard and _ctx_pid == os.getpid():
        reap()
    if _ctx is None or _ctx_pid != os.getpid() or _ctx.closed:
        _ctx = zmq.Context()
        _ctx_pid = os.getpid()
        _graveyard.clear()  # (a forked child's copies belong to the parent)
        atexit.register(_at_exit, _ctx, _ctx_pid)
    return _ctx


def _at_exit(ctx: zmq.Context[Any], pid: int) -> None:
    if pid == os.getpid() and not ctx.closed:
        # the connections closed last get their grace too: a peer reading our last
        # records, E and B over a slow or lossy link hangs up when it has them
        while _graveyard and reap() and time.monotonic() < _graveyard_until():
            time.sleep(0.02)
        reap(everything=True)
        ctx.destroy(linger=LINGER_MS)


def _graveyard_until() -> float:
    with _graveyard_lock:
        return max((until for _, _, until in _graveyard), default=0.0)


def configure(sock: zmq.Socket[Any], heartbeat: float, max_message: int) -> None:
    """Options of a connection socket: no reconnection, heartbeats, a bound on how long
    sent data may stay unacknowledged, no high-water mark (ringwire bounds what is in
    flight itself), a largest message."""
    ms = max(100, int(heartbeat * 1000))
    ms -= ms % 100  # HEARTBEAT_TTL counts tenths of a second
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.RECONNECT_IVL, -1)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(50, ms // 4))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(ms, 6553500))
    # data sent and not acknowledged for two heartbeats ends the connection (Linux's
    # TCP_USER_TIMEOUT): ZeroMQ sends its heartbeat only between messages, so while a
    # large message is stuck in a partition the heartbeat alone never fires.  (Twice the
    # heartbeat: a lossy link's retransmissions back off 0.2, 0.4, 0.8... s.)
    sock.setsockopt(zmq.TCP_MAXRT, 2 * ms)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message)


GONE_EVENTS = (
    zmq.EVENT_DISCONNECTED,
    zmq.EVENT_CLOSED,
    zmq.EVENT_MONITOR_STOPPED,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)
# a bound socket's failed handshakes are other peers' (their value is an error code, not
# the descriptor): one knocking on an open connection's port must not end that connection
HANDSHAKE_FAILED = GONE_EVENTS[3:]


MONITOR_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


_monitor_ids = itertools.count()


def monitor_of(sock: zmq.Socket[Any], events: int = MONITOR_EVENTS) -> zmq.Socket[Any]:
    """The monitor socket of ``sock`` (by default the events liveness needs).  Its pipe
    has no high-water mark: libzmq's I/O thread sends monitor events blocking, so a
    full pipe -- a flood of failed handshakes on a port nobody reads the monitor of --
    would stop every socket of the context; unread events cost memory instead."""
    addr = f"inproc://ringwire.monitor.{os.getpid()}.{next(_monitor_ids)}"
    sock.monitor(addr, events)
    mon = sock.context.socket(zmq.PAIR)
    mon.setsockopt(zmq.RCVHWM, 0)
    mon.setsockopt(zmq.LINGER, 0)
    mon.connect(addr)
    return mon


def close_monitored(sock: zmq.Socket[Any], mon: zmq.Socket[Any], linger: int) -> None:
    """Close ``sock`` and its monitor, in the only safe order: libzmq's I/O thread
    sends monitor events blocking, so a monitor closed while its socket still emits
    events (as it is torn down) would hang that thread -- and every socket of the
    context with it.  The monitor is switched off first."""
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass
    mon.close(0)
    sock.close(linger)


# Closed connections' sockets, kept open until the peer hung up too or for GRACE seconds:
# libzmq drops what a peer had received but not yet read when the connection goes, so
# a socket closed at once could take our last records, E and B with it.
GRACE = 2.0
_graveyard: list[tuple[zmq.Socket[Any], zmq.Socket[Any], float]] = []
_graveyard_lock = threading.Lock()


def retire(sock: zmq.Socket[Any], mon: zmq.Socket[Any], *, peer_left: bool = False) -> None:
    """Close ``sock`` (and its monitor) once the peer is gone, or after :data:`GRACE`;
    at once if ``peer_left`` (its monitor already said so)."""
    with _graveyard_lock:
        _graveyard.append((sock, mon, time.monotonic() + (0.0 if peer_left else GRACE)))
    reap()


def reap(everything: bool = False) -> bool:
    """Close the retired sockets whose peer is gone or whose grace is over; ``True``
    if some are left."""
    now = time.monotonic()
    with _graveyard_lock:
        keep = []
        for sock, mon, until in _graveyard:
            gone = everything or now >= until
            while not gone:
                try:
                    ev = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    gone = True
                    break
                gone = ev["event"] in GONE_EVENTS and ev["event"] not in HANDSHAKE_FAILED
            if gone:
                close_monitored(sock, mon, LINGER_MS)
            else:
                keep.append((sock, mon, until))
        _graveyard[:] = keep
        return bool(keep)
