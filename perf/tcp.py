"""ringwire over ``tcp://127.0.0.1`` against plain pyzmq PAIR + msgspec doing the same job.

Run from the repository root (pyzmq installed: ``pip install -e '.[bench]'``)::

    python -m perf.tcp --quick          # about 50 s on a 2-core VM
    python -m perf.tcp                  # more rounds
    python -m perf.tcp --json PATH      # default perf/results/tcp.json

One question: what does ringwire's TCP transport cost over the ZeroMQ it rides on?
Each peer is a pair of processes joined by one TCP loopback connection: this process
(asyncio; ``ringwire.listen`` / a ``zmq.asyncio`` PAIR bound to ``tcp://127.0.0.1:*``)
and a child (blocking API; ``ringwire.connect_sync`` / a ``zmq`` PAIR).  The zmq peer
encodes and decodes with ``msgspec.msgpack``, as ringwire does.  Both peers are timed
in the same run, round-robin (one round of each per turn, the first peer rotated every
turn), and medians are reported:

* **(a) round trip** of a 100-byte record (a dict, decoded and re-encoded by the echo);
* **(b) batched throughput** of 100-byte records: ringwire ``send_many`` /
  ``receive_many`` against a zmq send loop and zmq ``send_multipart`` of 256 records,
  the receiver decoding every record and acknowledging the batch;
* **(c) one-way array handoff + small ack**, 8 MiB and 64 MiB ``uint8``: ringwire
  ``send`` (the array is copied once into the sender's pool, then goes as an Ext 20
  zero-copy frame) and ringwire ``loan`` (no copy; the loan is not filled) against zmq
  ``send_multipart([msgspec header, array], copy=False)``; the receiver views the
  buffer (``np.frombuffer``) and answers with a small ack;
* **(d) bandwidth**, 256 MiB one way + small ack: the (c) peers, zmq ``copy=False``
  with a naive receiver that copies the array out (``arr.copy()``), and the *floor*:
  a bare socket ``sendall`` here into ``recv_into`` a buffer the child allocated once
  (:class:`perf._tcp_more.Floor`);
* **(e) fan-in**: 4 producer processes → this process, 100-byte records, ringwire
  ``send_many`` → ``Listener.receive_many`` against zmq ``PUSH``/``PULL`` with msgspec
  (:mod:`perf._tcp_more`).

Ratios are ringwire ÷ zmq (times: below 1 is ringwire faster; throughput: above 1 is
ringwire faster).  The issue-17 targets checked: small-record async round trip ≤ 1.15×
the bare zmq.asyncio + msgspec echo; 256 MiB one way ≥ 0.8× the floor's bandwidth and
ahead of the copying zmq receiver.

Clean-up: the children are started by this script with ``PR_SET_PDEATHSIG``, killed in
a ``finally`` and waited for; nothing touches ``/dev/shm`` (a TCP channel has no ring).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf import _tcp_more as more
from perf._common import (
    die_with_parent,
    format_table,
    format_targets,
    interleaved_async,
    machine_info,
    summarize,
    write_report,
)

MiB = 1 << 20
RECORD = {"seq": 0, "body": "x" * 80}  # ~100 bytes of msgpack
BATCH = 256  # records per send_many / send_multipart
RT_TARGET = 1.15
BW_TARGET = 0.8  # ringwire's 256 MiB one-way bandwidth ÷ the bare-socket floor's
SIZES = (8 * MiB, 64 * MiB)
BIG = 256 * MiB  # the bandwidth row

MODES = {
    #        warmup, rounds, rt per round, records per round, handoffs per round,
    #        256 MiB transfers per round, bandwidth rounds, fan-in records per round
    "quick": dict(
        warmup=2, rounds=9, rt=100, records=20_000, handoffs=4, big=1, big_rounds=3, fan=20_000
    ),
    "full": dict(
        warmup=3, rounds=25, rt=200, records=100_000, handoffs=8, big=2, big_rounds=9, fan=100_000
    ),
}


def _slots() -> Any:
    import ringwire

    # room for two handoffs of each size in flight
    return ringwire.SlotConfig(classes=tuple(ringwire.SlotClass(s, 2) for s in (*SIZES, BIG)))


# -- the children (blocking API) ---------------------------------------------------------


def _child_ringwire(url: str) -> None:  # pragma: no cover - child
    import ringwire

    with ringwire.connect_sync(url, slots=_slots(), handshake_timeout=30) as ch:
        while True:
            msg = ch.receive()
            op = msg[0]
            if op == "e":
                ch.send(msg[1])
            elif op == "t":
                n, got = msg[1], 0
                while got < n:
                    got += len(ch.receive_many(4096))
                ch.send("ack")
            elif op == "a":
                nbytes = msg[1].nbytes
                del msg  # the view dies: the sender's slot comes back
                ch.send(nbytes)
            else:
                return


def _child_zmq(url: str) -> None:  # pragma: no cover - child
    import msgspec
    import numpy as np
    import zmq

    enc, dec = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.linger = 0
    sock.connect(url)
    try:
        while True:
            msg = dec(sock.recv())
            op = msg[0]
            if op == "e":
                sock.send(enc(msg[1]))
            elif op == "t":
                n, got = msg[1], 0
                while got < n:
                    frames = sock.recv_multipart()
                    for f in frames:
                        dec(f)
                    got += len(frames)
                sock.send(enc("ack"))
            elif op in ("a", "c"):
                _, dtype, shape = msg
                body = sock.recv(copy=False)  # the second part of the same message
                arr = np.frombuffer(body.buffer, dtype).reshape(shape)
                if op == "c":  # the naive receiver: an array of its own
                    arr = arr.copy()
                nbytes = arr.nbytes
                del arr, body
                sock.send(enc(nbytes))
            else:
                return
    finally:
        sock.close()
        ctx.term()


def _spawn(kind: str, url: str) -> subprocess.Popen[bytes]:
    code = f"import perf.tcp as m; m._child_{kind}({url!r})"
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent.parent,
        preexec_fn=die_with_parent,
    )


# -- the two peers, this side -------------------------------------------------------------


class _Ringwire:
    name = "ringwire tcp://"

    async def open(self) -> None:
        import ringwire

        self._lst = ringwire.listen("tcp://127.0.0.1:0", slots=_slots())
        await self._lst.__aenter__()
        self.proc = _spawn("ringwire", self._lst.path)
        self.ch = await asyncio.wait_for(self._lst.accept(), 30)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.ch.send(("stop",)), 5)
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait, 10), 11)
        finally:
            await self.ch.aclose()
            await self._lst.__aexit__(None, None, None)

    async def rt(self, n: int) -> list[int]:
        ch, out, clock = self.ch, [], time.perf_counter_ns
        for i in range(n):
            rec = {"seq": i, "body": RECORD["body"]}
            t0 = clock()
            await ch.send(("e", rec))
            await ch.receive()
            out.append(clock() - t0)
        return out

    async def throughput(self, recs: list[Any]) -> list[int]:
        ch = self.ch
        t0 = time.perf_counter_ns()
        await ch.send(("t", len(recs)))
        for i in range(0, len(recs), BATCH):
            await ch.send_many(recs[i : i + BATCH])
        assert await ch.receive() == "ack"
        return [time.perf_counter_ns() - t0]

    async def handoff(self, arr: Any, n: int) -> list[int]:
        ch, out, clock = self.ch, [], time.perf_counter_ns
        for _ in range(n):
            t0 = clock()
            await ch.send(("a", arr))
            got = await ch.receive()
            out.append(clock() - t0)
            assert got == arr.nbytes, got
        return out

    async def loan(self, arr: Any, n: int) -> list[int]:
        ch, out, clock = self.ch, [], time.perf_counter_ns
        for _ in range(n):
            t0 = clock()
            buf = await ch.loan(arr.shape, arr.dtype)
            await ch.send(("a", buf))
            del buf
            got = await ch.receive()
            out.append(clock() - t0)
            assert got == arr.nbytes, got
        return out


class _Zmq:
    name = "zmq PAIR tcp:// + msgspec"

    async def open(self) -> None:
        import msgspec
        import zmq
        import zmq.asyncio

        self._enc = msgspec.msgpack.Encoder().encode
        self._dec = msgspec.msgpack.Decoder().decode
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.PAIR)
        self.sock.linger = 0
        self.sock.bind("tcp://127.0.0.1:*")
        url = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.proc = _spawn("zmq", url)
        await self.rt(1)  # the child is connected

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.sock.send(self._enc(("stop",))), 5)
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait, 10), 11)
        finally:
            self.sock.close()
            self._ctx.term()

    async def rt(self, n: int) -> list[int]:
        sock, enc, dec, out, clock = self.sock, self._enc, self._dec, [], time.perf_counter_ns
        for i in range(n):
            rec = {"seq": i, "body": RECORD["body"]}
            t0 = clock()
            await sock.send(enc(("e", rec)))
            dec(await sock.recv())
            out.append(clock() - t0)
        return out

    async def throughput_loop(self, recs: list[Any]) -> list[int]:
        sock, enc = self.sock, self._enc
        t0 = time.perf_counter_ns()
        await sock.send(enc(("t", len(recs))))
        for r in recs:
            await sock.send(enc(r))
        assert self._dec(await sock.recv()) == "ack"
        return [time.perf_counter_ns() - t0]

    async def throughput_multipart(self, recs: list[Any]) -> list[int]:
        sock, enc = self.sock, self._enc
        t0 = time.perf_counter_ns()
        await sock.send(enc(("t", len(recs))))
        for i in range(0, len(recs), BATCH):
            await sock.send_multipart([enc(r) for r in recs[i : i + BATCH]])
        assert self._dec(await sock.recv()) == "ack"
        return [time.perf_counter_ns() - t0]

    async def handoff(self, arr: Any, n: int, op: str = "a") -> list[int]:
        sock, enc, out, clock = self.sock, self._enc, [], time.perf_counter_ns
        for _ in range(n):
            t0 = clock()
            await sock.send_multipart([enc((op, arr.dtype.str, arr.shape)), arr], copy=False)
            got = self._dec(await sock.recv())
            out.append(clock() - t0)
            assert got == arr.nbytes, got
        return out


# -- timing --------------------------------------------------------------------------------


def _ratio_text(r: float) -> str:
    return f"{r:.3f}×" if r < 1 else f"{r:.2f}×"


async def _run(mode: dict[str, int]) -> dict[str, Any]:
    import numpy as np

    rw, zq = _Ringwire(), _Zmq()
    opened: list[Any] = []
    try:
        for p in (rw, zq):
            await p.open()
            opened.append(p)
        kw = dict(rounds=mode["rounds"], warmup=mode["warmup"])
        res: dict[str, Any] = {}

        # (a) round trip
        s = await interleaved_async(
            {rw.name: lambda: rw.rt(mode["rt"]), zq.name: lambda: zq.rt(mode["rt"])}, **kw
        )
        res["rt_100B_us"] = {n: _stats_us(v) for n, v in s.items()}

        # (b) throughput
        recs = [{"seq": i, "body": RECORD["body"]} for i in range(mode["records"])]
        names = (
            "ringwire send_many/receive_many",
            "zmq send loop",
            f"zmq send_multipart ({BATCH})",
        )
        s = await interleaved_async(
            {
                names[0]: lambda: rw.throughput(recs),
                names[1]: lambda: zq.throughput_loop(recs),
                names[2]: lambda: zq.throughput_multipart(recs),
            },
            **kw,
        )
        res["throughput_100B_rps"] = {
            n: {"median_rps": len(recs) / (summarize(v).median_ns / 1e9), "rounds": len(v)}
            for n, v in s.items()
        }

        # (c) array one way + small ack
        res["handoff_ms"] = {}
        for size in SIZES:
            arr = np.full(size, 7, np.uint8)
            h = int(max(2, mode["handoffs"] // (size // SIZES[0]) ** 0.5))
            s = await interleaved_async(_handoff_peers(rw, zq, arr, h), **kw)
            res["handoff_ms"][f"{size // MiB} MiB"] = {n: _stats_ms(v) for n, v in s.items()}
            del arr, s

        # (d) 256 MiB one way: against the bare-socket floor and a copying zmq receiver
        floor = more.Floor()
        opened.append(floor)  # (closed in the finally below, even half-open)
        await floor.open()
        big = np.full(BIG, 7, np.uint8)
        h = mode["big"]
        peers = _handoff_peers(rw, zq, big, h)
        peers[ZMQ_COPY] = lambda: zq.handoff(big, h, "c")
        peers[floor.name] = lambda: floor.handoff(big, h)
        s = await interleaved_async(peers, rounds=mode["big_rounds"], warmup=1)
        res["bandwidth_256MiB_ms"] = {n: _stats_ms(v) for n, v in s.items()}
        del s, peers

        # (e) fan-in: 4 producer processes, one consumer (this process)
        fans = [more.FanRingwire(), more.FanZmq(False), more.FanZmq(True)]
        for f in fans:
            opened.append(f)
            await f.open()
        n = mode["fan"]
        s = await interleaved_async({f.name: (lambda f=f: f.round(n)) for f in fans}, **kw)
        res["fanin_100B_rps"] = {
            name: {"median_rps": n / (summarize(v).median_ns / 1e9), "rounds": len(v)}
            for name, v in s.items()
        }
        return res
    finally:
        for p in reversed(opened):  # (listeners' task groups must exit in LIFO order)
            try:
                await p.close()
            except Exception as exc:  # noqa: BLE001 - report, then kill below
                print(f"closing {p.name}: {exc!r}", file=sys.stderr)
        for p in (rw, zq, *opened):
            proc = getattr(p, "proc", None)
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


RW_SEND = "ringwire send (copy into pool, Ext 20 frame)"
RW_LOAN = "ringwire loan (no copy, not filled)"
ZMQ_VIEW = "zmq send_multipart copy=False"
ZMQ_COPY = "zmq copy=False + receiver copy"


def _handoff_peers(
    rw: _Ringwire, zq: _Zmq, arr: Any, n: int
) -> dict[str, Callable[[], Awaitable[list[int]]]]:
    return {
        RW_SEND: lambda: rw.handoff(arr, n),
        RW_LOAN: lambda: rw.loan(arr, n),
        ZMQ_VIEW: lambda: zq.handoff(arr, n),
    }


def _stats_us(v: list[int]) -> dict[str, float]:
    st = summarize(v)
    return {"median": st.median_ns / 1e3, "p99": st.p99_ns / 1e3, "n": st.n}


def _stats_ms(v: list[int]) -> dict[str, float]:
    st = summarize(v)
    return {"median": st.median_ns / 1e6, "p99": st.p99_ns / 1e6, "n": st.n}


def report(res: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    lines: list[str] = []
    rt = res["rt_100B_us"]
    rw_rt, zq_rt = rt[_Ringwire.name]["median"], rt[_Zmq.name]["median"]
    lines.append("### (a) async round trip, 100 B record (µs, smaller is better)\n")
    lines.append(
        format_table(
            ["peer", "median", "p99", "samples", "× zmq"],
            [
                [
                    n,
                    f"{v['median']:.1f}",
                    f"{v['p99']:.1f}",
                    v["n"],
                    _ratio_text(v["median"] / zq_rt),
                ]
                for n, v in rt.items()
            ],
            "lrrrr",
        )
    )
    tp = res["throughput_100B_rps"]
    best_zmq = max(v["median_rps"] for n, v in tp.items() if n.startswith("zmq"))
    lines.append("\n### (b) throughput, 100 B records (records/s, larger is better)\n")
    lines.append(
        format_table(
            ["peer", "median", "rounds", "ringwire ÷ this"],
            [
                [
                    n,
                    f"{v['median_rps']:,.0f}",
                    v["rounds"],
                    ""
                    if n.startswith("ringwire")
                    else _ratio_text(
                        tp["ringwire send_many/receive_many"]["median_rps"] / v["median_rps"]
                    ),
                ]
                for n, v in tp.items()
            ],
            "lrrr",
        )
    )
    lines.append("\n### (c) array one way + small ack (ms, smaller is better)\n")
    rows = []
    for size, peers in res["handoff_ms"].items():
        z = peers[ZMQ_VIEW]["median"]
        for n, v in peers.items():
            gbps = int(size.split()[0]) * MiB / (v["median"] / 1e3) / 1e9
            rows.append(
                [
                    size,
                    n,
                    f"{v['median']:.3f}",
                    f"{v['p99']:.3f}",
                    f"{gbps:.2f}",
                    v["n"],
                    _ratio_text(v["median"] / z),
                ]
            )
    lines.append(
        format_table(["size", "peer", "median", "p99", "GB/s", "samples", "× zmq"], rows, "llrrrrr")
    )
    rt_ratio = rw_rt / zq_rt
    tp_ratio = tp["ringwire send_many/receive_many"]["median_rps"] / best_zmq
    targets = [
        {
            "target": f"async RT 100 B over TCP: ringwire ≤ {RT_TARGET}× zmq.asyncio + msgspec",
            "value": rt_ratio,
            "shown": _ratio_text(rt_ratio),
            "status": "HIT" if rt_ratio <= RT_TARGET else "MISS",
        },
        {
            "target": "(info) batched 100 B: ringwire ÷ best zmq (records/s)",
            "value": tp_ratio,
            "shown": _ratio_text(tp_ratio),
            "status": "info",
        },
    ]
    for size, peers in res["handoff_ms"].items():
        z = peers[ZMQ_VIEW]["median"]
        for n, v in peers.items():
            if n.startswith("ringwire"):
                r = v["median"] / z
                targets.append(
                    {
                        "target": f"(info) {size} handoff: {n} ÷ zmq copy=False (time)",
                        "value": r,
                        "shown": _ratio_text(r),
                        "status": "info",
                    }
                )
    bw = res["bandwidth_256MiB_ms"]
    floor_ms = bw[more.Floor.name]["median"]
    lines.append(
        "\n### (d) 256 MiB one way + small ack (ms, smaller is better; × floor: bandwidth "
        "÷ the bare socket's, larger is better)\n"
    )
    lines.append(
        format_table(
            ["peer", "median", "p99", "GB/s", "samples", "× floor (bandwidth)"],
            [
                [
                    n,
                    f"{v['median']:.1f}",
                    f"{v['p99']:.1f}",
                    f"{BIG / (v['median'] / 1e3) / 1e9:.2f}",
                    v["n"],
                    _ratio_text(floor_ms / v["median"]),
                ]
                for n, v in bw.items()
            ],
            "lrrrrr",
        )
    )
    fan = res["fanin_100B_rps"]
    rw_fan = next(v["median_rps"] for n, v in fan.items() if n.startswith("ringwire"))
    best_zmq_fan = max(v["median_rps"] for n, v in fan.items() if n.startswith("zmq"))
    lines.append(
        f"\n### (e) fan-in, {more.PRODUCERS} producer processes → 1 consumer, 100 B records "
        "(records/s, larger is better)\n"
    )
    lines.append(
        format_table(
            ["peer", "median", "rounds", "ringwire ÷ this"],
            [
                [
                    n,
                    f"{v['median_rps']:,.0f}",
                    v["rounds"],
                    "" if n.startswith("ringwire") else _ratio_text(rw_fan / v["median_rps"]),
                ]
                for n, v in fan.items()
            ],
            "lrrr",
        )
    )
    zc = bw[ZMQ_COPY]["median"]
    for name in (RW_SEND, RW_LOAN):
        r = floor_ms / bw[name]["median"]
        targets.append(
            {
                "target": f"256 MiB one way: {name} ≥ {BW_TARGET}× the floor's bandwidth",
                "value": r,
                "shown": _ratio_text(r),
                "status": "HIT" if r >= BW_TARGET else "MISS",
            }
        )
        r = zc / bw[name]["median"]
        targets.append(
            {
                "target": f"256 MiB one way: {name} ahead of {ZMQ_COPY} (bandwidth ratio > 1)",
                "value": r,
                "shown": _ratio_text(r),
                "status": "HIT" if r > 1 else "MISS",
            }
        )
    r = rw_fan / best_zmq_fan
    targets.append(
        {
            "target": f"(info) fan-in {more.PRODUCERS} → 1: ringwire ÷ best zmq PUSH/PULL (records/s)",
            "value": r,
            "shown": _ratio_text(r),
            "status": "info",
        }
    )
    lines.append("\n### Ratios\n")
    lines.append(format_targets(targets))
    return "\n".join(lines), targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short runs (< 40 s)")
    ap.add_argument("--json", default="perf/results/tcp.json", help="where the JSON goes")
    args = ap.parse_args(argv)
    # the rows say "Ext 20 frame": measure the ZeroMQ frames even where nixl-cu12 is
    # installed (perf/nixl.py has the NIXL rows); the children inherit it
    os.environ.setdefault("RINGWIRE_NIXL", "0")
    try:
        import zmq  # noqa: F401
    except ImportError:
        print("perf.tcp needs pyzmq: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    mode_name = "quick" if args.quick else "full"
    load0 = os.getloadavg()
    t0 = time.monotonic()
    res = asyncio.run(_run(MODES[mode_name]))
    seconds = time.monotonic() - t0
    load1 = os.getloadavg()
    text, targets = report(res)
    machine = machine_info(["ringwire", "numpy", "msgspec", "pyzmq"])
    print(
        f"perf.tcp ({mode_name}, {seconds:.0f} s): CPU {machine.get('cpu')}, "
        f"{machine.get('cpu_count')} cpus; load average {load0[0]:.2f} at start, "
        f"{load1[0]:.2f} at end\n"
    )
    print(text)
    write_report(args.json, "tcp", mode_name, seconds, (load0, load1), machine, res, targets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
