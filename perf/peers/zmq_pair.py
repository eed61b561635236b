"""``zmq.asyncio`` PAIR sockets over ``ipc://``."""

from __future__ import annotations

import contextlib
from typing import Any

from perf.peers.base import (
    ENC,
    KINDS,
    Peer,
    PeerUnavailable,
    aserve_rounds,
    clock,
    run_async,
    tmpdir,
)


def _child_zmq(ctrl: Any, loop_kind: str, addr: str, size: int = 100) -> None:
    import zmq
    import zmq.asyncio

    dec = KINDS[size].dec.decode

    async def main() -> None:
        zctx = zmq.asyncio.Context()
        sock = zctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)

        async def serve(n: int) -> None:
            for _ in range(n):
                rec = dec(await sock.recv(copy=True))
                await sock.send(ENC.encode(rec))

        try:
            await aserve_rounds(ctrl, serve)
        finally:
            sock.close(0)
            zctx.term()

    run_async(loop_kind, main)


class ZmqAsync(Peer):
    """``zmq.asyncio`` PAIR sockets over ``ipc://``, msgspec records both ways."""

    kind = "rt"
    is_async = True

    def __init__(self, loop_kind: str, size: int = 100) -> None:
        super().__init__()
        self.loop_kind = loop_kind
        self.kind_ = KINDS[size]
        self.name = f"zmq.asyncio PAIR ipc://{self.kind_.suffix} [{loop_kind}]"

    async def asetup(self) -> None:
        try:
            import zmq
            import zmq.asyncio
        except ImportError as e:
            raise PeerUnavailable("pyzmq not installed") from e
        d = tmpdir(self)
        addr = f"ipc://{d}/pair.sock"
        self.zctx = zmq.asyncio.Context()
        self.sock = self.zctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr)
        self.spawn(_child_zmq, self.loop_kind, addr, self.kind_.size)
        self.ready_info = self.expect("ready")

    async def rt_round(self, n: int) -> list[int]:
        sock = self.sock
        rec = self.kind_.make(0)
        dec = self.kind_.dec.decode
        out = []
        self.start_round(n)
        for i in range(n):
            t0 = clock()
            rec.seq = i
            await sock.send(ENC.encode(rec))
            dec(await sock.recv(copy=True))
            out.append(clock() - t0)
        return out

    async def aclose_transport(self) -> None:
        with contextlib.suppress(Exception):
            self.sock.close(0)
            self.zctx.term()
