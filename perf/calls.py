"""Calls benchmark: concurrent request -> reply over one connection.

Run from the repository root::

    python -m perf.calls            # ~1.5 minutes on a 2-core VM
    python -m perf.calls --quick    # ~25 s
    python -m perf.calls --json perf/results/calls.json [--loop uvloop]

The question: what does ``ringwire.Client`` / ``ringwire.serve`` (correlation ids in an
envelope, deadlines that travel, cancellation, fair sends, bounded worker tasks on the
server) cost against

* **hand-written futures over a Channel** -- the pattern ``examples/asgi_server.py``
  had before (``WorkerClient``): an id field in the record, a dict of futures, one
  receiver task, ``asyncio.wait_for`` for the timeout; the server a plain
  ``async for record in chan: await chan.send(reply)`` loop (no concurrency, no
  cancellation, no deadlines: the floor of what the pattern can cost);
* **zmq.asyncio DEALER / ROUTER + msgspec** over ``ipc://``, the same futures on the
  DEALER side, the ROUTER echoing ``[identity, payload]``.

Every call carries the ~100-byte :class:`perf.peers.Req` record (msgspec, typed decode
on both sides) and a 30 s timeout; the server echoes it.  C caller tasks in the parent
(one asyncio loop) share one connection to a ``spawn`` child and make calls back to
back until a round's N calls are done.  Per (peer, C): throughput (median over rounds
of N / wall time), per-call latency p50 / p99 (pooled over rounds), and CPU per call
(parent + child, ``/proc/<pid>/stat``).  Rounds run interleaved across the peers
(rotating who goes first), so a noisy machine's drift lands on all alike.  Compare the
ratios (``÷ Client``), not the absolute microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf._common import format_table, machine_info
from perf.peers.base import (
    ENC,
    RECORD_BYTES,
    SETUP_TIMEOUT_S,
    Peer,
    PeerFailed,
    PeerUnavailable,
    Req,
    clock,
    make_record,
    new_loop,
    proc_cpu_seconds,
    run_async,
    tmpdir,
)

TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Config:
    rounds: int
    calls: int  # per round
    concurrency: tuple[int, ...]


QUICK = Config(rounds=3, calls=2000, concurrency=(1, 16, 128))
FULL = Config(rounds=5, calls=8000, concurrency=(1, 8, 64, 256))


class Call(msgspec.Struct, array_like=True):
    """The hand-written patterns' record: the caller's id, then the request."""

    id: int
    req: Req


CALL_DEC = msgspec.msgpack.Decoder(Call)


# -- the children (servers) -------------------------------------------------------------


def _child_rw_serve(ctrl: Any, loop_kind: str, end: Any) -> None:
    import ringwire

    async def echo(req: Req) -> Req:
        return req

    async def main() -> None:
        async with await end.connect(handshake_timeout=SETUP_TIMEOUT_S) as chan:
            ctrl.send(("ready", os.getpid()))
            # returns when the parent's client closes the connection
            await ringwire.serve(chan, echo, type=Req, concurrency=512)

    run_async(loop_kind, main)


def _child_rw_loop(ctrl: Any, loop_kind: str, end: Any) -> None:
    async def main() -> None:
        async with await end.connect(type=Call, handshake_timeout=SETUP_TIMEOUT_S) as chan:
            ctrl.send(("ready", os.getpid()))
            async for call in chan:  # the old worker loop: receive, answer, repeat
                await chan.send(call)

    run_async(loop_kind, main)


def _child_zmq_router(ctrl: Any, loop_kind: str, addr: str) -> None:
    import zmq
    import zmq.asyncio

    async def main() -> None:
        zctx = zmq.asyncio.Context()
        sock = zctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(addr)
        ctrl.send(("ready", os.getpid()))
        try:
            while True:
                ident, payload = await sock.recv_multipart(copy=True)
                if not payload:  # the parent's stop message
                    return
                await sock.send_multipart([ident, ENC.encode(CALL_DEC.decode(payload))])
        finally:
            sock.close(0)
            zctx.term()

    run_async(loop_kind, main)


# -- the parent side of each peer -------------------------------------------------------


class CallPeer(Peer):
    """A server child and the client of one connection to it, in the parent's loop."""

    is_async = True

    def __init__(self, loop_kind: str) -> None:
        super().__init__()
        self.loop_kind = loop_kind

    async def call(self, rec: Req) -> Any:
        raise NotImplementedError


class RingwireClient(CallPeer):
    name = "ringwire Client / serve"

    async def asetup(self) -> None:
        import ringwire

        a, b = ringwire.pair()
        self.spawn(_child_rw_serve, self.loop_kind, b)
        chan = await a.connect(handshake_timeout=SETUP_TIMEOUT_S)
        self.client = ringwire.Client(chan, type=Req)
        await self.client.__aenter__()
        self.ready_info = self.expect("ready")

    async def call(self, rec: Req) -> Any:
        return await self.client.call(rec, timeout=TIMEOUT_S)

    async def aclose_transport(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.__aexit__(None, None, None)


class _Futures:
    """The hand-written client: futures keyed by id, one receiver task."""

    def __init__(self) -> None:
        self.ids = itertools.count()
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.receiver: asyncio.Task[None] | None = None

    def resolve(self, call: Call) -> None:
        fut = self.pending.pop(call.id, None)
        if fut is not None and not fut.done():
            fut.set_result(call.req)

    async def call(self, send: Any, rec: Req) -> Any:
        rid = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        try:
            await send(Call(rid, rec))
            return await asyncio.wait_for(fut, TIMEOUT_S)
        finally:
            self.pending.pop(rid, None)

    async def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.cancel()
            with contextlib.suppress(BaseException):
                await self.receiver


class HandWritten(CallPeer):
    name = "hand-written futures over a Channel"

    async def asetup(self) -> None:
        import ringwire

        a, b = ringwire.pair()
        self.spawn(_child_rw_loop, self.loop_kind, b)
        self.chan = await a.connect(type=Call, handshake_timeout=SETUP_TIMEOUT_S)
        self.futures = _Futures()
        self.futures.receiver = asyncio.get_running_loop().create_task(self._receive())
        self.ready_info = self.expect("ready")

    async def _receive(self) -> None:
        async for call in self.chan:
            self.futures.resolve(call)

    async def call(self, rec: Req) -> Any:
        return await self.futures.call(self.chan.send, rec)

    async def aclose_transport(self) -> None:
        await self.futures.stop()
        with contextlib.suppress(Exception):
            await self.chan.aclose()


class ZmqDealer(CallPeer):
    name = "zmq.asyncio DEALER/ROUTER + msgspec"

    async def asetup(self) -> None:
        try:
            import zmq
            import zmq.asyncio
        except ImportError as e:
            raise PeerUnavailable("pyzmq not installed") from e
        addr = f"ipc://{tmpdir(self)}/router.sock"
        self.spawn(_child_zmq_router, self.loop_kind, addr)
        self.ready_info = self.expect("ready")
        self.zctx = zmq.asyncio.Context()
        self.sock = self.zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.futures = _Futures()
        self.futures.receiver = asyncio.get_running_loop().create_task(self._receive())

    async def _receive(self) -> None:
        recv = self.sock.recv
        while True:
            self.futures.resolve(CALL_DEC.decode(await recv(copy=True)))

    async def _send(self, call: Call) -> None:
        await self.sock.send(ENC.encode(call))

    async def call(self, rec: Req) -> Any:
        return await self.futures.call(self._send, rec)

    async def aclose_transport(self) -> None:
        await self.futures.stop()
        with contextlib.suppress(Exception):
            await self.sock.send(b"")  # tells the ROUTER child to stop
            await asyncio.sleep(0.05)
            self.sock.close(0)
            self.zctx.term()


PEERS = (RingwireClient, HandWritten, ZmqDealer)


# -- measuring ----------------------------------------------------------------------------


async def one_round(peer: CallPeer, n: int, conc: int) -> dict[str, Any]:
    per = max(1, n // conc)
    lat: list[int] = []
    rec = make_record(1)

    async def caller() -> None:
        call, add = peer.call, lat.append
        for _ in range(per):
            t0 = clock()
            await call(rec)
            add(clock() - t0)

    child = peer.ready_info
    cpu0 = time.process_time(), proc_cpu_seconds(child)
    gc.disable()
    try:
        t0 = clock()
        await asyncio.gather(*(caller() for _ in range(conc)))
        wall = clock() - t0
    finally:
        gc.enable()
    cpu = time.process_time() - cpu0[0] + proc_cpu_seconds(child) - cpu0[1]
    calls = per * conc
    return {"calls": calls, "wall_ns": wall, "lat_ns": lat, "cpu_s": cpu}


def _p(sorted_ns: list[int], q: float) -> float:
    k = max(1, int(round(q * len(sorted_ns) + 0.5)))
    return sorted_ns[min(k, len(sorted_ns)) - 1] / 1e3


async def run(cfg: Config, loop_kind: str) -> dict[str, Any]:
    peers: list[CallPeer] = []
    skipped: dict[str, str] = {}
    try:
        for cls in PEERS:
            peer = cls(loop_kind)
            try:
                await peer.asetup()
            except PeerUnavailable as e:
                skipped[peer.name] = str(e)
                await peer.aclose_transport()
                peer.close()
                continue
            peers.append(peer)
        for peer in peers:  # warm up: every path taken once
            await one_round(peer, 200, 8)
        results: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for conc in cfg.concurrency:
            for r in range(cfg.rounds):
                order = peers[r % len(peers) :] + peers[: r % len(peers)]
                for peer in order:
                    res = await one_round(peer, cfg.calls, conc)
                    results.setdefault((peer.name, conc), []).append(res)
            print(f"  (concurrency {conc} done)", file=sys.stderr, flush=True)
    finally:
        for peer in peers:
            await peer.aclose_transport()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(peer.close)
    rows = []
    for (name, conc), rounds in results.items():
        lat = sorted(x for r in rounds for x in r["lat_ns"])
        calls = sum(r["calls"] for r in rounds)
        rows.append(
            {
                "peer": name,
                "concurrency": conc,
                "calls_per_s": statistics.median(r["calls"] / r["wall_ns"] * 1e9 for r in rounds),
                "p50_us": _p(lat, 0.50),
                "p99_us": _p(lat, 0.99),
                "cpu_us_per_call": sum(r["cpu_s"] for r in rounds) / calls * 1e6,
                "calls": calls,
            }
        )
    return {"rows": rows, "skipped": skipped}


def table(rows: list[dict[str, Any]]) -> str:
    base = {r["concurrency"]: r for r in rows if r["peer"] == RingwireClient.name}
    out = []
    for r in rows:
        b = base.get(r["concurrency"])
        out.append(
            [
                r["concurrency"],
                r["peer"],
                f"{r['calls_per_s']:,.0f}",
                f"{r['calls_per_s'] / b['calls_per_s']:.2f}" if b else "-",
                f"{r['p50_us']:.0f}",
                f"{r['p50_us'] / b['p50_us']:.2f}" if b else "-",
                f"{r['p99_us']:.0f}",
                f"{r['cpu_us_per_call']:.1f}",
                f"{r['cpu_us_per_call'] / b['cpu_us_per_call']:.2f}" if b else "-",
            ]
        )
    return format_table(
        [
            "callers",
            "peer",
            "calls/s",
            "÷ Client",
            "p50 µs",
            "÷ Client",
            "p99 µs",
            "CPU µs/call",
            "÷ Client",
        ],
        out,
        "rlrrrrrrr",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter rounds (~25 s)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    info = machine_info(["ringwire", "msgspec", "anyio", "zmq", "uvloop"])
    print("## Calls benchmark" + (" (--quick)" if args.quick else ""))
    print()
    print(
        f"- CPU: {info['cpu']}; cpus: {info['cpu_count']} ({info['cpus_usable']} usable); "
        f"{info['platform']}; python {info['python']}; event loop: {args.loop}"
    )
    print(
        f"- record: {RECORD_BYTES} bytes msgpack each way; {cfg.calls} calls a round, "
        f"{cfg.rounds} rounds per row, interleaved; load average at start: "
        f"{os.getloadavg()[0]:.2f}"
    )
    t0 = time.monotonic()
    loop = new_loop(args.loop)
    try:
        res = loop.run_until_complete(run(cfg, args.loop))
    except PeerFailed as e:
        print(f"a peer failed: {e}", file=sys.stderr)
        return 1
    finally:
        loop.close()
    for name, why in res["skipped"].items():
        print(f"- skipped: {name} ({why})")
    print()
    print(
        "calls/s: higher is better; p50, p99, CPU (parent + child per call): lower is better; "
        "÷ Client: this row over ringwire Client / serve at the same number of callers"
    )
    print()
    print(table(res["rows"]))
    elapsed = time.monotonic() - t0
    print(f"\n(total {elapsed:.0f} s; load average at end: {os.getloadavg()[0]:.2f})")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        out = {"machine": info, "config": cfg.__dict__, "quick": args.quick, **res}
        path.write_text(json.dumps(out, indent=2, default=str) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
