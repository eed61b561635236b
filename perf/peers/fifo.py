"""faster-fifo ``Queue`` throughput, msgspec as its serializer."""

from __future__ import annotations

from typing import Any

from perf.peers.base import (
    BATCH,
    CHILD_WAIT_S,
    DEC,
    ENC,
    Peer,
    PeerUnavailable,
    clock,
    make_record,
    serve_rounds,
)


def ff_dumps(obj: Any) -> bytes:  # faster-fifo serializer: msgspec instead of pickle
    return ENC.encode(obj)


def ff_loads(buf: Any) -> Any:
    return DEC.decode(buf)


def child_ff(ctrl: Any, q: Any, batch: bool) -> None:
    from faster_fifo import Empty

    def serve(n: int) -> int:
        got = 0
        if batch:
            get_many = q.get_many
            while got < n:
                try:
                    got += len(get_many(timeout=CHILD_WAIT_S, max_messages_to_get=BATCH))
                except Empty:
                    raise TimeoutError("faster-fifo: nothing to get") from None
        else:
            get = q.get
            while got < n:
                get(timeout=CHILD_WAIT_S)
                got += 1
        return got

    serve_rounds(ctrl, serve)


class FasterFifoTP(Peer):
    """faster-fifo ``Queue`` with msgspec as its ``dumps``/``loads`` (no pickle):
    ``put``/``get`` per record, or ``put_many``/``get_many`` in batches of BATCH."""

    kind = "tp"

    def __init__(self, batch: bool) -> None:
        super().__init__()
        self.batch = batch
        self.name = "faster-fifo put_many/get_many" if batch else "faster-fifo put/get"

    def setup(self) -> None:
        try:
            import faster_fifo
        except ImportError as e:
            raise PeerUnavailable("faster-fifo not installed") from e
        self.q = faster_fifo.Queue(max_size_bytes=8 * 1024 * 1024, dumps=ff_dumps, loads=ff_loads)
        self.on_cleanup(self.q.close)
        self.spawn(child_ff, self.q, self.batch)
        self.ready_info = self.expect("ready")

    def tp_round(self, n: int, timeout: float) -> int:
        recs = [make_record(i) for i in range(BATCH)]
        q = self.q
        self.start_round(n)
        t0 = clock()
        if self.batch:
            put_many = q.put_many
            left = n
            while left > 0:
                k = min(BATCH, left)
                put_many(recs[:k] if k < BATCH else recs, timeout=timeout)
                left -= k
        else:
            put = q.put
            for i in range(n):
                put(recs[i % BATCH], timeout=timeout)
        self.finish_round(timeout)
        return clock() - t0
