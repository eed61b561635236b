"""Fan-in throughput peers: k producer processes -> one consumer process.

Used by :mod:`perf.transport` (table ``fanin``).  Every peer here is one transport in
one mode with a fixed number of producers; the parent only orchestrates: it spawns
the consumer (a ``spawn`` child), waits until it listens, spawns the k producers
(in parallel), and per round tells the consumer to take ``n`` records, then every
producer to send ``n / k``.  The time runs from just before the producers are told
until the consumer reports that it has received and decoded all ``n``.

All children use the control-pipe protocol of :mod:`perf.peers` (``ready`` /
``round`` / ``done`` / exit) and block on their pipe between rounds, so the peers of
the table can be interleaved round-robin like every other table.

Transports (all msgspec-encoded :class:`perf.peers.Req` records, decoded by the
consumer):

* ``multiprocessing.Queue`` -- ``put`` of encoded bytes / ``get`` (no batch API);
* faster-fifo -- msgspec as ``dumps``/``loads``; ``put``/``get`` and
  ``put_many``/``get_many`` (batches of :data:`perf.peers.BATCH`);
* pyzmq -- ``ipc://`` PUSH (each producer connects) / PULL (the consumer binds);
  one frame per record, or ``send_multipart`` of a batch (one frame per record);
* ringwire -- the consumer is an async :func:`ringwire.listen` listener (the fan-in
  API; there is no blocking fan-in), the producers blocking :func:`ringwire.connect_sync`
  clients (like the other transports' producers).  Modes: *listener fan-in*
  (``async for conn, record in listener``: fair round-robin over the connections, one
  record at a time) with producers sending one record per ``send`` or batches with
  ``send_many``; *per-connection tasks* (one task per accepted connection calling
  ``conn.receive_many``, producers ``send_many``).  No tensor-slot pools
  (``slots=None`` on both ends): these are record-only connections, and a default pool
  per connection and side would reserve 81 MiB of ``/dev/shm`` each.
* a *decode ceiling* row: no transport, this process decoding ``n`` records; one
  consumer cannot go faster than that however many producers feed it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from perf import peers as P
from perf.peers import BATCH, CHILD_WAIT_S, ENC, SETUP_TIMEOUT_S, Peer, PeerUnavailable

clock = time.perf_counter_ns
DEC = P.DEC


# --------------------------------------------------------------------------- base


class _Producer(Peer):
    """One producer child of a fan-in peer (only spawn / expect / rounds / close)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


class FanInPeer(Peer):
    """Parent side: the consumer is this peer's own child (``self.proc``); the
    producers are :class:`_Producer` children.  Subclasses implement ``make`` (shared
    resources), ``consumer`` (child function + args) and ``producer`` (same)."""

    kind = "tp"
    transport = "?"
    mode = "?"
    batch = False
    # does the consumer send ("listening", None) before its producers may start?
    listens = False

    def __init__(self, producers: int) -> None:
        super().__init__()
        self.k = producers
        self.name = f"{self.transport} {self.mode}, {producers} producer{'s' * (producers > 1)}"
        self.producers: list[_Producer] = []

    # -- to implement
    def make(self) -> None:
        """Create what producers and consumer share (queues, paths)."""

    def consumer(self) -> tuple[Any, tuple[Any, ...]]:
        raise NotImplementedError

    def producer(self, i: int) -> tuple[Any, tuple[Any, ...]]:
        raise NotImplementedError

    def after_start(self) -> None:
        """Called once every child is ready."""

    # -- lifecycle
    def setup(self) -> None:
        self.make()
        fn, args = self.consumer()
        self.spawn(fn, *args)
        if self.listens:
            self.expect("listening")
        for i in range(self.k):
            pr = _Producer(f"{self.name} #{i}")
            self.producers.append(pr)
            pfn, pargs = self.producer(i)
            pr.spawn(pfn, *pargs)
        for pr in self.producers:
            pr.expect("ready")
        self.ready_info = self.expect("ready")
        self.after_start()

    def child_pids(self) -> list[int]:
        return [p.proc.pid for p in (self, *self.producers) if p.proc is not None]

    def kill_child(self) -> None:
        for pr in self.producers:
            pr.kill_child()
        super().kill_child()

    def close(self) -> None:
        for pr in self.producers:  # producers first: nothing more in flight
            pr.close()
        self.producers.clear()
        super().close()

    def tp_round(self, n: int, timeout: float) -> int:
        per = max(1, n // self.k)
        total = per * self.k
        self.start_round(total)
        t0 = clock()
        for pr in self.producers:
            pr.start_round(per)
        info = self.finish_round(timeout) or {}
        t1 = clock()
        pcpu = 0
        for pr in self.producers:
            pcpu += int((pr.finish_round(timeout) or {}).get("cpu_ns", 0))
        ccpu = int(info.get("cpu_ns", 0))
        extra = info.get("info")
        self.last_info = {
            "cpu_ns": ccpu + pcpu,
            "info": {
                "consumer_cpu_ns": ccpu,
                "producers_cpu_ns": pcpu,
                "records": total,
                **(extra if isinstance(extra, dict) else {}),
            },
        }
        return int((t1 - t0) * n / total)  # the harness divides n by this


def _records() -> list[P.Req]:
    return [P.make_record(i) for i in range(BATCH)]


def _send_loop(n: int, put_one: Any, put_batch: Any) -> None:
    """Send n records: one by one (``put_batch`` None) or in batches of BATCH."""
    recs = _records()
    if put_batch is None:
        for i in range(n):
            put_one(recs[i % BATCH])
        return
    left = n
    while left > 0:
        k = min(BATCH, left)
        put_batch(recs if k == BATCH else recs[:k])
        left -= k


# --------------------------------------------------------------------------- decode ceiling


class DecodeCeiling(Peer):
    """No transport: decode n encoded records in this process (the consumer's share of
    the codec work; producers encode in parallel, in their own processes)."""

    kind = "tp"
    name = "decode ceiling (no transport; one consumer decoding)"
    k = 0

    def setup(self) -> None:
        pass

    def child_pids(self) -> list[int]:
        return []

    def tp_round(self, n: int, timeout: float) -> int:
        recs = _records()
        bufs = [ENC.encode(recs[i % BATCH]) for i in range(n)]
        dec = DEC.decode
        t0 = clock()
        for b in bufs:
            dec(b)
        t1 = clock()
        self.last_info = {"cpu_ns": 0, "info": None}
        return t1 - t0


# --------------------------------------------------------------------------- mp.Queue


def _p_mpq(ctrl: Any, q: Any) -> None:
    put, enc = q.put, ENC.encode

    def serve(n: int) -> None:
        _send_loop(n, lambda r: put(enc(r)), None)

    try:
        P.serve_rounds(ctrl, serve)
    finally:
        q.close()
        q.join_thread()


class MpQueueFanIn(FanInPeer):
    transport = "multiprocessing.Queue"
    mode = "put/get"

    def make(self) -> None:
        self.q: Any = self.ctx.Queue()
        self.on_cleanup(self._close_q)

    def _close_q(self) -> None:
        self.q.close()
        self.q.join_thread()

    def consumer(self) -> tuple[Any, tuple[Any, ...]]:
        return P.child_mpqueue, (self.q,)

    def producer(self, i: int) -> tuple[Any, tuple[Any, ...]]:
        return _p_mpq, (self.q,)

    def after_start(self) -> None:
        P.unlink_semlocks(self.q._rlock, self.q._wlock, self.q._sem)


# --------------------------------------------------------------------------- faster-fifo


def _p_ff(ctrl: Any, q: Any, batch: bool) -> None:
    def serve(n: int) -> None:
        _send_loop(
            n,
            lambda r: q.put(r, timeout=CHILD_WAIT_S),
            (lambda rs: q.put_many(rs, timeout=CHILD_WAIT_S)) if batch else None,
        )

    P.serve_rounds(ctrl, serve)


class FasterFifoFanIn(FanInPeer):
    transport = "faster-fifo"

    def __init__(self, producers: int, batch: bool) -> None:
        self.batch = batch
        self.mode = "put_many/get_many" if batch else "put/get"
        super().__init__(producers)

    def make(self) -> None:
        try:
            import faster_fifo
        except ImportError as e:
            raise PeerUnavailable("faster-fifo not installed") from e
        self.q = faster_fifo.Queue(
            max_size_bytes=8 * 1024 * 1024, dumps=P.ff_dumps, loads=P.ff_loads
        )
        self.on_cleanup(self.q.close)

    def consumer(self) -> tuple[Any, tuple[Any, ...]]:
        return P.child_ff, (self.q, self.batch)

    def producer(self, i: int) -> tuple[Any, tuple[Any, ...]]:
        return _p_ff, (self.q, self.batch)


# --------------------------------------------------------------------------- pyzmq


def _c_zmq(ctrl: Any, addr: str, batch: bool) -> None:
    import zmq

    zctx = zmq.Context()
    sock = zctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(CHILD_WAIT_S * 1000))
    sock.bind(addr)
    ctrl.send(("listening", None))
    dec = DEC.decode

    def serve(n: int) -> None:
        got = 0
        if batch:
            recv_multipart = sock.recv_multipart
            while got < n:
                frames = recv_multipart(copy=True)
                for f in frames:
                    dec(f)
                got += len(frames)
        else:
            recv = sock.recv
            while got < n:
                dec(recv(copy=True))
                got += 1

    try:
        P.serve_rounds(ctrl, serve)
    finally:
        sock.close(0)
        zctx.term()


def _p_zmq(ctrl: Any, addr: str, batch: bool) -> None:
    import zmq

    zctx = zmq.Context()
    sock = zctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(CHILD_WAIT_S * 1000))
    sock.connect(addr)
    enc = ENC.encode

    def serve(n: int) -> None:
        _send_loop(
            n,
            lambda r: sock.send(enc(r), copy=True),
            (lambda rs: sock.send_multipart([enc(r) for r in rs], copy=True)) if batch else None,
        )

    try:
        P.serve_rounds(ctrl, serve)
    finally:
        sock.close(0)
        zctx.term()


class ZmqFanIn(FanInPeer):
    transport = "zmq PUSH/PULL ipc://"
    listens = True

    def __init__(self, producers: int, batch: bool) -> None:
        self.batch = batch
        self.mode = "send_multipart (a frame per record)" if batch else "send/recv"
        super().__init__(producers)

    def make(self) -> None:
        try:
            import zmq  # noqa: F401
        except ImportError as e:
            raise PeerUnavailable("pyzmq not installed") from e
        self.addr = f"ipc://{P.tmpdir(self)}/pull.sock"

    def consumer(self) -> tuple[Any, tuple[Any, ...]]:
        return _c_zmq, (self.addr, self.batch)

    def producer(self, i: int) -> tuple[Any, tuple[Any, ...]]:
        return _p_zmq, (self.addr, self.batch)


# --------------------------------------------------------------------------- ringwire


def _c_rw(ctrl: Any, loop_kind: str, path: str, k: int, mode: str) -> None:
    import anyio

    import ringwire

    async def main() -> None:
        async with ringwire.listen(path, type=P.Req, slots=None) as lst:
            ctrl.send(("listening", None))
            conns = []
            with anyio.fail_after(SETUP_TIMEOUT_S):
                for _ in range(k):
                    conns.append(await lst.accept())

            async def drain(conn: Any, per: int) -> None:
                got = 0
                rm = conn.receive_many
                while got < per:
                    got += len(await rm(min(BATCH, per - got)))

            async def serve(n: int) -> dict[str, Any]:
                if mode == "tasks":
                    per = n // len(conns)
                    async with anyio.create_task_group() as tg:
                        for c in conns:
                            tg.start_soon(drain, c, per)
                elif mode == "fanin_many":
                    got, rm = 0, lst.receive_many
                    while got < n:
                        got += len(await rm(min(BATCH, n - got)))
                else:
                    recv = lst.receive
                    for _ in range(n):
                        await recv()
                tot: dict[str, Any] = {}
                for c in conns:
                    for key, v in P.rw_stats(c).items():
                        tot[key] = tot.get(key, 0) + v
                return tot

            await P.aserve_rounds(ctrl, serve)

    P.run_async(loop_kind, main)


def _p_rw(ctrl: Any, path: str, batch: bool) -> None:
    import ringwire

    chan = ringwire.connect_sync(path, type=P.Req, handshake_timeout=SETUP_TIMEOUT_S, slots=None)
    try:

        def serve(n: int) -> dict[str, Any]:
            _send_loop(
                n,
                lambda r: chan.send(r, CHILD_WAIT_S),
                (lambda rs: chan.send_many(rs, CHILD_WAIT_S)) if batch else None,
            )
            return P.rw_stats(chan)

        P.serve_rounds(ctrl, serve)
    finally:
        chan.close()


RW_MODES = {
    # mode key: (consumer mode, producers batch?, label)
    "fanin": ("fanin", False, "listener fan-in (async for), producers send"),
    "fanin_many": ("fanin", True, "listener fan-in (async for), producers send_many"),
    "listener_many": (
        "fanin_many",
        True,
        "listener receive_many, producers send_many",
    ),
    "tasks": ("tasks", True, "per-connection receive_many tasks, producers send_many"),
}


class RingwireFanIn(FanInPeer):
    listens = True

    def __init__(self, producers: int, mode: str, loop_kind: str = "asyncio") -> None:
        self.cmode, self.batch, label = RW_MODES[mode]
        self.loop_kind_ = loop_kind
        self.transport = "ringwire"
        self.mode = f"{label} [{loop_kind}]"
        super().__init__(producers)

    def make(self) -> None:
        try:
            import ringwire  # noqa: F401
        except ImportError as e:
            raise PeerUnavailable(f"ringwire not importable: {e}") from e
        self.path = f"{P.tmpdir(self)}/rw.sock"

    def consumer(self) -> tuple[Any, tuple[Any, ...]]:
        return _c_rw, (self.loop_kind_, self.path, self.k, self.cmode)

    def producer(self, i: int) -> tuple[Any, tuple[Any, ...]]:
        return _p_rw, (self.path, self.batch)


def rw_name_parts(name: str) -> tuple[str, int]:
    """``(peer name without the producer count, producers)`` of a fan-in row name."""
    head, _, tail = name.rpartition(", ")
    with contextlib.suppress(ValueError):
        return head, int(tail.split()[0])
    return name, 0
