"""The bandwidth floor and the fan-in peers of :mod:`perf.tcp`.

* :class:`Floor` -- the floor of a one-way transfer over loopback TCP: a bare
  ``socket.sendall`` of the array's buffer in this process, ``recv_into`` a buffer the
  child allocated (and touched) once, then a one-byte ack.  Nothing but the kernel's
  two copies; what any transport over TCP pays at least.
* :class:`FanRingwire` / :class:`FanZmq` -- fan-in: :data:`PRODUCERS` producer
  processes send 100-byte records to one consumer, this process.  ringwire: the
  producers are blocking :func:`ringwire.connect_sync` clients sending
  ``send_many`` batches, the consumer an async :func:`ringwire.listen` listener
  reading ``Listener.receive_many``.  zmq: ``PUSH`` producers (``send`` per record,
  or ``send_multipart`` of a batch) into one ``zmq.asyncio`` ``PULL``, which awaits a
  message and then reads every waiting one without waiting (the fastest way to drain
  a zmq socket from asyncio).  Both decode every record with msgspec.  A round is
  timed from the moment the producers are told to go (a line on their stdin) until
  the consumer has decoded all ``n`` records.

Children die with this process (``PR_SET_PDEATHSIG``) and are killed and reaped in
``close``.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from perf._common import die_with_parent

ROOT = Path(__file__).resolve().parent.parent
PRODUCERS = 4
BATCH = 256
RECORD_BODY = "x" * 80


def spawn(call: str, *, stdin: bool = False) -> subprocess.Popen[bytes]:
    """A child running ``perf._tcp_more.<call>`` (e.g. ``"_floor_child(5)"``)."""
    return subprocess.Popen(
        [sys.executable, "-c", f"import perf._tcp_more as m; m.{call}"],
        cwd=ROOT,
        preexec_fn=die_with_parent,
        stdin=subprocess.PIPE if stdin else None,
    )


def _reap(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


# -- the floor ----------------------------------------------------------------------------


def _floor_child(port: int) -> None:  # pragma: no cover - child
    import struct

    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray()
    view = memoryview(buf)
    head = bytearray(8)
    try:
        while True:
            got = 0
            while got < 8:
                k = s.recv_into(memoryview(head)[got:])
                if not k:
                    return
                got += k
            (n,) = struct.unpack(">Q", head)
            if n == 0:
                return
            if len(buf) < n:  # allocated (and touched) once per size
                view.release()
                buf = bytearray(n)
                view = memoryview(buf)
            got = 0
            while got < n:
                k = s.recv_into(view[got:n])
                if not k:
                    return
                got += k
            s.sendall(b"k")
    finally:
        s.close()


class Floor:
    """Bare loopback TCP: ``sendall`` here, ``recv_into`` a preallocated buffer there."""

    name = "floor: socket sendall → recv_into (preallocated)"

    async def open(self) -> None:
        lsock = socket.create_server(("127.0.0.1", 0))
        port = lsock.getsockname()[1]
        self.proc = spawn(f"_floor_child({port})")
        lsock.settimeout(30)
        try:
            self.sock, _ = await asyncio.to_thread(lsock.accept)
        finally:
            lsock.close()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def close(self) -> None:
        try:
            self.sock.sendall((0).to_bytes(8, "big"))
            await asyncio.to_thread(self.proc.wait, 10)
        finally:
            self.sock.close()
            _reap([self.proc])

    async def handoff(self, arr: Any, n: int) -> list[int]:
        sock, out, clock = self.sock, [], time.perf_counter_ns
        data = memoryview(arr).cast("B")
        head = arr.nbytes.to_bytes(8, "big")
        for _ in range(n):
            t0 = clock()
            sock.sendall(head)
            sock.sendall(data)  # (blocking: nothing else runs on this loop meanwhile)
            if sock.recv(1) != b"k":
                raise RuntimeError("the floor child went away")
            out.append(clock() - t0)
        return out


# -- fan-in -------------------------------------------------------------------------------


def _records(n: int) -> list[Any]:
    return [{"seq": i, "body": RECORD_BODY} for i in range(n)]


def _ringwire_producer(url: str) -> None:  # pragma: no cover - child
    import ringwire

    with ringwire.connect_sync(url, slots=None, handshake_timeout=30) as ch:
        for line in sys.stdin:
            n = int(line)
            if n <= 0:
                return
            recs = _records(n)
            for i in range(0, n, BATCH):
                ch.send_many(recs[i : i + BATCH])


def _zmq_producer(url: str, multipart: bool) -> None:  # pragma: no cover - child
    import msgspec
    import zmq

    enc = msgspec.msgpack.Encoder().encode
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 1000
    sock.connect(url)
    try:
        for line in sys.stdin:
            n = int(line)
            if n <= 0:
                return
            recs = _records(n)
            if multipart:
                for i in range(0, n, BATCH):
                    sock.send_multipart([enc(r) for r in recs[i : i + BATCH]])
            else:
                for r in recs:
                    sock.send(enc(r))
    finally:
        sock.close()
        ctx.term()


class _Fan:
    name = ""
    procs: list[subprocess.Popen[bytes]]

    def _go(self, n: int) -> None:
        share = n // PRODUCERS
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(f"{share}\n".encode())
            p.stdin.flush()

    async def _stop_children(self) -> None:
        try:
            for p in self.procs:
                if p.stdin is not None and p.poll() is None:
                    p.stdin.write(b"0\n")
                    p.stdin.close()
            for p in self.procs:
                await asyncio.to_thread(p.wait, 10)
        finally:
            _reap(self.procs)


class FanRingwire(_Fan):
    name = f"ringwire: {PRODUCERS} × connect_sync send_many → Listener.receive_many"

    async def open(self) -> None:
        import ringwire

        self._lst = ringwire.listen("tcp://127.0.0.1:0", slots=None)
        await self._lst.__aenter__()
        self.procs = [
            spawn(f"_ringwire_producer({self._lst.path!r})", stdin=True) for _ in range(PRODUCERS)
        ]
        for _ in range(PRODUCERS):
            await asyncio.wait_for(self._lst.accept(), 30)

    async def close(self) -> None:
        try:
            await self._stop_children()
        finally:
            await self._lst.__aexit__(None, None, None)

    async def round(self, n: int) -> list[int]:
        lst, got = self._lst, 0
        n -= n % PRODUCERS
        t0 = time.perf_counter_ns()
        self._go(n)
        while got < n:
            got += len(await lst.receive_many(4096))
        return [time.perf_counter_ns() - t0]


class FanZmq(_Fan):
    def __init__(self, multipart: bool) -> None:
        self.multipart = multipart
        how = f"send_multipart ({BATCH})" if multipart else "send per record"
        self.name = f"zmq: {PRODUCERS} × PUSH {how} → zmq.asyncio PULL + msgspec"

    async def open(self) -> None:
        import msgspec
        import zmq
        import zmq.asyncio

        self._dec = msgspec.msgpack.Decoder().decode
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.PULL)
        self.sock.linger = 0
        self.sock.bind("tcp://127.0.0.1:*")
        self._raw = zmq.Socket.shadow(self.sock.underlying)  # for the non-waiting reads
        url = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.procs = [
            spawn(f"_zmq_producer({url!r}, {self.multipart})", stdin=True) for _ in range(PRODUCERS)
        ]
        # the PUSH sockets connect in the background: a first small round proves it
        await self.round(PRODUCERS)

    async def close(self) -> None:
        try:
            await self._stop_children()
        finally:
            self.sock.close()
            self._ctx.term()

    async def round(self, n: int) -> list[int]:
        import zmq

        sock, raw, dec, got = self.sock, self._raw, self._dec, 0
        n -= n % PRODUCERS
        t0 = time.perf_counter_ns()
        self._go(n)
        while got < n:
            for f in await sock.recv_multipart():
                dec(f)
                got += 1
            while got < n:
                try:
                    frames = raw.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                for f in frames:
                    dec(f)
                    got += 1
        return [time.perf_counter_ns() - t0]
