"""The kernel's view of this host's TCP connections (Linux ``NETLINK_SOCK_DIAG``).

``python -m ringwire inspect`` asks it, once per address family, for every
established TCP connection's queues and ``tcp_info`` -- in particular
``tcpi_last_data_recv``, the milliseconds since data last arrived, which counts
ZeroMQ's heartbeat PINGs too (ringwire never sees those): the true "last heard from
the peer" of a connection, whatever ringwire's own messages do.  What ``ss -ti``
shows, read the same way; no privileges needed for sockets of any user.  No pyzmq.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

__all__ = ["TCP_STATES", "connections"]

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_INET_DIAG_INFO = 2
_NLMSG = struct.Struct("=IHHII")
_REQ = struct.Struct("=BBBBI")  # family, protocol, extensions, pad, states
_MSG_SIZE = 72  # struct inet_diag_msg
_LAST_DATA_RECV = 52  # offsetof(struct tcp_info, tcpi_last_data_recv)
TCP_STATES = {1: "established", 8: "close-wait", 4: "fin-wait-1", 5: "fin-wait-2", 9: "last-ack"}
_STATES = sum(1 << s for s in TCP_STATES)


def _hostport(family: int, raw: bytes, port: int) -> str:
    host = socket.inet_ntop(family, raw[:4] if family == socket.AF_INET else raw[:16])
    return f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"


def _parse(family: int, msg: bytes) -> tuple[tuple[str, str], dict[str, Any]] | None:
    if len(msg) < _MSG_SIZE:
        return None
    state = msg[1]
    sport, dport = struct.unpack_from(">HH", msg, 4)
    rqueue, wqueue, uid, inode = struct.unpack_from("=IIII", msg, 56)
    info: dict[str, Any] = {
        "tcp_state": TCP_STATES.get(state, str(state)),
        "recv_queue": rqueue,
        "send_queue": wqueue,
        "heard_ms": None,
        "inode": inode,
    }
    off = _MSG_SIZE
    while off + 4 <= len(msg):
        alen, atype = struct.unpack_from("=HH", msg, off)
        if alen < 4:
            break
        if atype == _INET_DIAG_INFO and alen >= 4 + _LAST_DATA_RECV + 4:
            (info["heard_ms"],) = struct.unpack_from("=I", msg, off + 4 + _LAST_DATA_RECV)
        off += (alen + 3) & ~3
    local = _hostport(family, msg[8:24], sport)
    peer = _hostport(family, msg[24:40], dport)
    return (local, peer), info


def _dump(family: int) -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as s:
        s.settimeout(2.0)
        req = _REQ.pack(family, socket.IPPROTO_TCP, 1 << (_INET_DIAG_INFO - 1), 0, _STATES)
        req += bytes(48)  # struct inet_diag_sockid: any
        s.sendto(_NLMSG.pack(_NLMSG.size + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0) + req, (0, 0))  # fmt: skip
        while True:
            data = s.recv(1 << 16)
            off = 0
            while off + _NLMSG.size <= len(data):
                length, kind = _NLMSG.unpack_from(data, off)[:2]
                if kind == _NLMSG_DONE or length < _NLMSG.size:
                    return out
                if kind == _NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", data, off + _NLMSG.size)
                    raise OSError(-err, "sock_diag refused the request")
                parsed = _parse(family, data[off + _NLMSG.size : off + length])
                if parsed is not None:
                    out[parsed[0]] = parsed[1]
                off += (length + 3) & ~3
            if not data:
                return out


def connections() -> dict[tuple[str, str], dict[str, Any]]:
    """``(local "ip:port", peer "ip:port") -> {tcp_state, recv_queue, send_queue,
    heard_ms, inode}`` for this host's live TCP connections (empty where netlink is
    unavailable)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            out.update(_dump(family))
        except OSError:
            continue
    return out
