"""ringwire's own peers: async and blocking round trips, throughput, an idle consumer."""

from __future__ import annotations

import contextlib
from typing import Any

from perf.peers.base import (
    BATCH,
    CHILD_WAIT_S,
    KINDS,
    SETUP_TIMEOUT_S,
    Peer,
    Req,
    aserve_rounds,
    clock,
    make_record,
    run_async,
    serve_rounds,
)


def rw_pair() -> Any:
    """A new ``pair()`` from ringwire's channel module (public name if exported)."""
    import ringwire

    return ringwire.pair()


HOT_SPIN_US = 2_000_000.0  # "hot": spin up to 2 s before parking -- never parks in a round


# ---- async round trip


def _slots_kw(pool: bool) -> dict[str, Any]:
    """``connect`` keywords: the default tensor-slot pool, or none (``slots=None``)."""
    return {} if pool else {"slots": None}


def per_park_wait(chan: Any) -> None:
    """Make ``chan`` wait the way any anyio backend does (``anyio.wait_readable`` on the
    descriptor per park: an ``epoll_ctl`` add and remove and a handle each time)
    instead of the asyncio driver's reader registered once for the connection's life:
    the comparison row for that registration."""
    waker = chan._waker
    waker.unregister()
    waker._aio_ok = False


def _rw_async_child(
    ctrl: Any, loop_kind: str, end: Any, make_serve: Any, per_park: bool = False, **connect: Any
) -> None:
    """Connect ``end`` asynchronously, serve the parent's rounds with
    ``make_serve(chan)`` (an ``async serve(n)``), close.  ``per_park``: see
    :func:`per_park_wait`."""

    async def main() -> None:
        chan = await end.connect(**connect)
        if per_park:
            per_park_wait(chan)
        try:
            await aserve_rounds(ctrl, make_serve(chan))
        finally:
            await chan.aclose()

    run_async(loop_kind, main)


def _rw_sync_child(ctrl: Any, end: Any, make_serve: Any, **connect: Any) -> None:
    """The blocking form of :func:`_rw_async_child`."""
    chan = end.connect_sync(**connect)
    try:
        serve_rounds(ctrl, make_serve(chan))
    finally:
        chan.close()


def _child_rw_async_rt(
    ctrl: Any,
    loop_kind: str,
    end: Any,
    spin_us: float,
    size: int = 100,
    pool: bool = True,
    per_park: bool = False,
) -> None:
    def make_serve(chan: Any) -> Any:
        async def serve(n: int) -> dict[str, Any]:
            recv, send = chan.receive, chan.send
            for _ in range(n):
                await send(await recv())
            return rw_stats(chan)

        return serve

    _rw_async_child(
        ctrl,
        loop_kind,
        end,
        make_serve,
        per_park,
        type=KINDS[size].type,
        spin_us=spin_us,
        **_slots_kw(pool),
    )


def rw_stats(chan: Any) -> dict[str, Any]:
    try:
        st = chan.statistics()
        return {
            "receive_parks": st.receive_parks,
            "send_parks": st.send_parks,
            "doorbells_sent": st.doorbells_sent,
            "doorbells_received": st.doorbells_received,
            "records_received": st.records_received,
        }
    except Exception:
        return {}


class RingwireAsyncRT(Peer):
    """ringwire async endpoints (``ringwire.pair()``), ``send``/``receive`` of the record.

    ``spin_us=0``: both ends park on every wait (the doorbell path, every message);
    the default spin budget shows what a busy conversation gets."""

    kind = "rt"
    is_async = True

    def __init__(
        self,
        loop_kind: str,
        spin_us: float,
        label: str,
        size: int = 100,
        pool: bool = True,
        per_park: bool = False,
    ) -> None:
        super().__init__()
        self.loop_kind = loop_kind
        self.spin_us = spin_us
        self.kind_ = KINDS[size]
        self.pool = pool
        self.per_park = per_park  # both ends: anyio.wait_readable per park (see per_park_wait)
        extra = "" if pool else ", no slot pool"
        if per_park:
            extra += ", wait_readable per park"
        self.name = f"ringwire {label}{extra}{self.kind_.suffix} [{loop_kind}]"

    async def asetup(self) -> None:
        a, b = rw_pair()
        self.spawn(
            _child_rw_async_rt,
            self.loop_kind,
            b,
            self.spin_us,
            self.kind_.size,
            self.pool,
            self.per_park,
        )
        self.chan = await a.connect(
            type=self.kind_.type,
            spin_us=self.spin_us,
            handshake_timeout=SETUP_TIMEOUT_S,
            **_slots_kw(self.pool),
        )
        if self.per_park:
            per_park_wait(self.chan)
        self.ready_info = self.expect("ready")

    async def rt_round(self, n: int) -> list[int]:
        send, recv = self.chan.send, self.chan.receive
        rec = self.kind_.make(0)
        out = []
        self.start_round(n)
        for i in range(n):
            t0 = clock()
            rec.seq = i
            await send(rec)
            await recv()
            out.append(clock() - t0)
        return out

    async def aclose_transport(self) -> None:
        with contextlib.suppress(Exception):
            await self.chan.aclose()


# ---- hot (spinning) round trip, blocking API


def _child_rw_sync_rt(ctrl: Any, end: Any, spin_us: float, size: int = 100) -> None:
    chan = end.connect_sync(
        type=KINDS[size].type, spin_us=spin_us, handshake_timeout=SETUP_TIMEOUT_S
    )
    try:

        def serve(n: int) -> dict[str, Any]:
            recv, send = chan.receive, chan.send
            for _ in range(n):
                send(recv(CHILD_WAIT_S))
            return rw_stats(chan)

        serve_rounds(ctrl, serve)
    finally:
        chan.close()


class RingwireSyncRT(Peer):
    """ringwire blocking endpoints (``SyncChannel``); with a large spin budget both
    readers spin on the ring and never park during a round."""

    kind = "rt"

    def __init__(self, spin_us: float, label: str, size: int = 100) -> None:
        super().__init__()
        self.spin_us = spin_us
        self.kind_ = KINDS[size]
        self.name = f"ringwire {label}{self.kind_.suffix}"

    def setup(self) -> None:
        a, b = rw_pair()
        self.spawn(_child_rw_sync_rt, b, self.spin_us, self.kind_.size)
        self.chan = a.connect_sync(
            type=self.kind_.type, spin_us=self.spin_us, handshake_timeout=SETUP_TIMEOUT_S
        )
        self.on_cleanup(self.chan.close)
        self.ready_info = self.expect("ready")

    def rt_round(self, n: int) -> list[int]:
        send, recv = self.chan.send, self.chan.receive
        rec = self.kind_.make(0)
        out = []
        self.start_round(n)
        for i in range(n):
            t0 = clock()
            rec.seq = i
            send(rec)
            recv(10.0)
            out.append(clock() - t0)
        return out


# ---- throughput


def _child_rw_tp(
    ctrl: Any, loop_kind: str | None, end: Any, batch: bool, pool: bool = True
) -> None:
    connect = {"type": Req, "handshake_timeout": SETUP_TIMEOUT_S, **_slots_kw(pool)}
    if loop_kind is None:  # blocking consumer

        def make_sync_serve(chan: Any) -> Any:
            def serve(n: int) -> dict[str, Any]:
                got = 0
                if batch:
                    rm = chan.receive_many
                    while got < n:
                        got += len(rm(BATCH, CHILD_WAIT_S))
                else:
                    recv = chan.receive
                    while got < n:
                        recv(CHILD_WAIT_S)
                        got += 1
                return rw_stats(chan)

            return serve

        _rw_sync_child(ctrl, end, make_sync_serve, **connect)
        return

    def make_serve(chan: Any) -> Any:
        async def serve(n: int) -> dict[str, Any]:
            got = 0
            if batch:
                rm = chan.receive_many
                while got < n:
                    got += len(await rm(BATCH))
            else:
                recv = chan.receive
                while got < n:
                    await recv()
                    got += 1
            return rw_stats(chan)

        return serve

    _rw_async_child(ctrl, loop_kind, end, make_serve, **connect)


class RingwireTP(Peer):
    """One producer -> one consumer over ringwire, default spin budget.  ``send`` /
    ``receive`` per record, or ``send_many`` / ``receive_many`` in batches of BATCH.
    ``loop_kind=None``: the blocking API on both ends."""

    kind = "tp"

    def __init__(self, loop_kind: str | None, batch: bool, pool: bool = True) -> None:
        super().__init__()
        self.loop_kind = loop_kind
        self.is_async = loop_kind is not None
        self.batch = batch
        self.pool = pool
        api = "send_many/receive_many" if batch else "send/receive"
        where = f"async [{loop_kind}]" if loop_kind else "sync"
        self.name = f"ringwire {where} {api}" + ("" if pool else ", no slot pool (info)")

    def setup(self) -> None:
        a, b = rw_pair()
        self.spawn(_child_rw_tp, None, b, self.batch, self.pool)
        self.chan = a.connect_sync(
            type=Req, handshake_timeout=SETUP_TIMEOUT_S, **_slots_kw(self.pool)
        )
        self.on_cleanup(self.chan.close)
        self.ready_info = self.expect("ready")

    async def asetup(self) -> None:
        a, b = rw_pair()
        self.spawn(_child_rw_tp, self.loop_kind, b, self.batch, self.pool)
        self.chan = await a.connect(
            type=Req, handshake_timeout=SETUP_TIMEOUT_S, **_slots_kw(self.pool)
        )
        self.ready_info = self.expect("ready")

    async def aclose_transport(self) -> None:
        with contextlib.suppress(Exception):
            await self.chan.aclose()

    def _records(self) -> list[Req]:
        return [make_record(i) for i in range(BATCH)]

    def tp_round(self, n: int, timeout: float) -> Any:
        if self.is_async:
            return self._atp_round(n, timeout)
        return self._stp_round(n, timeout)

    def _stp_round(self, n: int, timeout: float) -> int:
        recs = self._records()
        chan = self.chan
        self.start_round(n)
        t0 = clock()
        if self.batch:
            left = n
            while left > 0:
                k = min(BATCH, left)
                chan.send_many(recs[:k] if k < BATCH else recs, timeout)
                left -= k
        else:
            send = chan.send
            for i in range(n):
                send(recs[i % BATCH], timeout)
        self.finish_round(timeout)
        return clock() - t0

    async def _atp_round(self, n: int, timeout: float) -> int:
        recs = self._records()
        chan = self.chan
        self.start_round(n)
        t0 = clock()
        if self.batch:
            left = n
            while left > 0:
                k = min(BATCH, left)
                await chan.send_many(recs[:k] if k < BATCH else recs)
                left -= k
        else:
            send = chan.send
            for i in range(n):
                await send(recs[i % BATCH])
        self.finish_round(timeout)
        return clock() - t0


# ---- idle


def _child_rw_idle(ctrl: Any, loop_kind: str | None, end: Any) -> None:
    if loop_kind is None:

        def make_sync_serve(chan: Any) -> Any:
            def serve(n: int) -> dict[str, Any]:
                for _ in range(n):
                    chan.receive(CHILD_WAIT_S)
                return rw_stats(chan)

            return serve

        _rw_sync_child(ctrl, end, make_sync_serve, type=Req, handshake_timeout=SETUP_TIMEOUT_S)
        return

    def make_serve(chan: Any) -> Any:
        async def serve(n: int) -> dict[str, Any]:
            for _ in range(n):
                await chan.receive()
            return rw_stats(chan)

        return serve

    _rw_async_child(ctrl, loop_kind, end, make_serve, type=Req, handshake_timeout=SETUP_TIMEOUT_S)


class RingwireIdle(Peer):
    """A ringwire consumer (default spin budget) waiting on an empty channel."""

    kind = "idle"

    def __init__(self, loop_kind: str | None) -> None:
        super().__init__()
        self.loop_kind = loop_kind
        self.name = (
            f"ringwire async consumer [{loop_kind}], parked"
            if loop_kind
            else "ringwire blocking consumer, parked"
        )

    def setup(self) -> None:
        a, b = rw_pair()
        self.spawn(_child_rw_idle, self.loop_kind, b)
        self.chan = a.connect_sync(type=Req, handshake_timeout=SETUP_TIMEOUT_S)
        self.on_cleanup(self.chan.close)
        self.ready_info = self.expect("ready")
