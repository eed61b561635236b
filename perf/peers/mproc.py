"""multiprocessing: ``Pipe`` round trips, ``Queue`` throughput, and the unlinking of a
queue's semaphore names."""

from __future__ import annotations

import contextlib
from typing import Any

from perf.peers.base import (
    CHILD_WAIT_S,
    DEC,
    ENC,
    KINDS,
    Peer,
    PeerFailed,
    clock,
    make_record,
    serve_rounds,
)

# ---- multiprocessing.Pipe


def _child_mppipe(ctrl: Any, conn: Any, size: int = 100) -> None:
    dec = KINDS[size].dec.decode

    def serve(n: int) -> None:
        recv, send = conn.recv_bytes, conn.send_bytes
        for _ in range(n):
            send(ENC.encode(dec(recv())))

    serve_rounds(ctrl, serve)


class MpPipe(Peer):
    """``multiprocessing.Pipe()`` (a socketpair), ``send_bytes``/``recv_bytes`` of
    msgspec-encoded records."""

    kind = "rt"

    def __init__(self, size: int = 100) -> None:
        super().__init__()
        self.kind_ = KINDS[size]
        self.name = f"multiprocessing.Pipe{self.kind_.suffix}"

    def setup(self) -> None:
        a, b = self.ctx.Pipe()
        self.conn = a
        self.on_cleanup(a.close)
        self.spawn(_child_mppipe, b, self.kind_.size)
        b.close()
        self.ready_info = self.expect("ready")

    def rt_round(self, n: int) -> list[int]:
        send, recv = self.conn.send_bytes, self.conn.recv_bytes
        rec = self.kind_.make(0)
        dec = self.kind_.dec.decode
        out = []
        self.start_round(n)
        for i in range(n):
            t0 = clock()
            rec.seq = i
            send(ENC.encode(rec))
            try:
                dec(recv())
            except EOFError:
                raise PeerFailed("mp.Pipe: child closed") from None
            out.append(clock() - t0)
        return out


# ---- multiprocessing.Queue


def child_mpqueue(ctrl: Any, q: Any) -> None:
    def serve(n: int) -> int:
        get, dec = q.get, DEC.decode
        for _ in range(n):
            dec(get(timeout=CHILD_WAIT_S))
        return n

    serve_rounds(ctrl, serve)


def unlink_semlocks(*locks: Any) -> None:
    """Unlink the ``/dev/shm/sem.mp-*`` names of spawn-context locks now that the child
    has opened them (multiprocessing would keep them until the queue is collected).
    Best effort: uses multiprocessing internals, and does nothing if they changed."""
    try:
        from multiprocessing import resource_tracker, synchronize, util

        util_: Any = util  # private names: no stubs
        synchronize_: Any = synchronize
        names = {lk._semlock.name for lk in locks if lk is not None and lk._semlock.name}
        for fin in list(util_._finalizer_registry.values()):
            if (
                getattr(fin, "_callback", None) is synchronize_.SemLock._cleanup
                and fin._args[0] in names
            ):
                fin.cancel()
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                synchronize_.sem_unlink(name)
            resource_tracker.unregister(name, "semaphore")
    except Exception:  # pragma: no cover - internals moved; the names go at exit anyway
        pass


class MpQueueTP(Peer):
    """``multiprocessing.Queue``: ``put`` / ``get`` of msgspec-encoded records."""

    name = "multiprocessing.Queue"
    kind = "tp"

    def setup(self) -> None:
        self.q: Any = self.ctx.Queue()
        self.on_cleanup(self._close_q)
        self.spawn(child_mpqueue, self.q)
        self.ready_info = self.expect("ready")
        unlink_semlocks(*(getattr(self.q, a) for a in ("_rlock", "_wlock", "_sem")))

    def _close_q(self) -> None:
        self.q.close()
        self.q.join_thread()

    def tp_round(self, n: int, timeout: float) -> int:
        put = self.q.put
        rec = make_record()
        self.start_round(n)
        t0 = clock()
        for i in range(n):
            rec.seq = i
            put(ENC.encode(rec))
        self.finish_round(timeout)
        return clock() - t0
