"""Broadcast benchmark: one writer, N reader processes (default 4), one step at a time.

Run from the repository root::

    python -m perf.broadcast            # ~2 minutes on a 2-core VM
    python -m perf.broadcast --quick    # ~40 s
    python -m perf.broadcast --readers 8 --json perf/results/broadcast.json
    python -m perf.broadcast --arrays   # the 2.4 MB-array table (perf/_broadcast_arrays.py)

Every step is a ~100-byte msgspec record carrying the writer's clock at send
(``time.perf_counter_ns``: CLOCK_MONOTONIC, one clock for every process of the host).
Each reader notes, per step, its own clock when it has decoded the record; the
**step latency** is the slowest reader's: "writer send -> last reader has it".  Steps
are paced (2-3 ms apart, jittered) so that parked readers really park between steps.

The peers, all with the writer in this process and every reader a ``spawn`` child:

* **ringwire broadcast, parked** -- :func:`ringwire.broadcast_sync` and
  :func:`ringwire.subscribe_sync` readers with ``spin_us=0`` (they park at once);
* **ringwire broadcast, adaptive spin** -- the same, readers at the default spin;
* **ringwire, N separate channels** -- one :func:`ringwire.pair` per reader, the
  writer sending the record to each in turn (parked readers); and the same with one
  reader (**1:1 channel, one way**: what a parked reader's wake-up costs on its own);
* **ZeroMQ PUB/SUB** over ``ipc://``, blocking sockets, msgspec;
* **vLLM MessageQueue scheme** -- :mod:`perf._vllm_mq`, a re-implementation from its
  public description: fixed chunks with per-reader flags, readers spinning
  (``sched_yield``) for 1 s after each read, then waiting on a ZeroMQ notify;
* **vLLM MessageQueue (real)** -- vLLM's own ``shm_broadcast.py`` loaded from a vLLM
  release (:mod:`perf.peers.vllm_shm`; skipped when none is found), measured as it is:
  it pickles the record, its readers spin for 1 s after each read;
* the baseline, **ringwire 1:1 parked round trip / 2** -- a pair, both ends parked
  (``spin_us=0``), one record there and back, halved.

Reader CPU: one step every 10 ms for a few seconds; each reader reports its own CPU
time (``getrusage``) over that window, as % of one core.

Drift: peers run in interleaved rounds (the order rotates every round), all readers
alive for the whole run; after a vLLM round the run pauses past its readers' 1 s busy
loop, so they do not eat the next peer's CPU.  Compare the ratios, not the µs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec

from perf._common import (
    await_ready,
    format_table,
    format_targets,
    machine_info,
    spawn_readers,
    started_peers,
)

clock = time.perf_counter_ns
T_VS_RT_HALF = 1.3  # the targets
T_CPU_PCT = 2.0


class Step(msgspec.Struct, array_like=True):
    """A ~100-byte step record (what a scheduler sends its ranks, abridged)."""

    seq: int
    t: int  # the writer's clock at send
    tokens: list[int]
    model: str


ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder(Step)
TOKENS = [1000 + 7 * i for i in range(10)]


def make_step(seq: int) -> Step:
    return Step(seq, clock(), TOKENS, "llama-3.1-8b-instruct")


# ======================================================================================
# readers (children)
# ======================================================================================


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _serve(ctrl: Any, recv: Callable[[], Step]) -> None:
    """The reader side of the protocol: ``("round", n)`` -> per-step latencies,
    ``("cpu", n)`` -> (cpu s, wall s), ``("stop",)``."""
    ctrl.send(("ready", os.getpid()))
    while True:
        cmd = ctrl.recv()
        if cmd[0] == "stop":
            return
        n = cmd[1]
        ctrl.send(("armed",))
        if cmd[0] == "round":
            lat = array("q", bytes(8 * n))
            for _ in range(n):
                rec = recv()
                lat[rec.seq] = clock() - rec.t
            ctrl.send(("lat", lat.tobytes()))
        else:
            c0, t0 = _cpu(), time.monotonic()
            for _ in range(n):
                recv()
            ctrl.send(("cpu", _cpu() - c0, time.monotonic() - t0))


def reader_ringwire(ctrl: Any, path: str, spin_us: float) -> None:
    import ringwire

    with ringwire.subscribe_sync(path, type=Step, spin_us=spin_us, handshake_timeout=60) as sub:
        _serve(ctrl, lambda: sub.receive(timeout=120))


def reader_pair(ctrl: Any, end: Any, echo: bool) -> None:
    with end.connect_sync(type=Step, spin_us=0, slots=None) as ch:
        if echo:
            ctrl.send(("ready", os.getpid()))
            while True:
                rec = ch.receive(timeout=600)
                if rec.seq < 0:
                    return
                ch.send(rec, timeout=60)
        _serve(ctrl, lambda: ch.receive(timeout=120))


def reader_zmq(ctrl: Any, addr: str) -> None:
    import zmq

    zctx = zmq.Context()
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    sub.connect(addr)
    try:
        _serve(ctrl, lambda: DEC.decode(sub.recv()))
    finally:
        sub.close(0)
        zctx.term()


def reader_vllm(ctrl: Any, handle: Any, rank: int) -> None:
    from perf._vllm_mq import MQReader

    mq = MQReader(handle, rank)
    try:
        _serve(ctrl, lambda: DEC.decode(mq.dequeue()))
    finally:
        mq.close()


def reader_vllm_real(ctrl: Any, fields: dict[str, Any], rank: int, rpc_dir: str) -> None:
    from perf.peers.vllm_shm import load_message_queue, reader_from_fields

    load_message_queue(rpc_dir)
    mq = reader_from_fields(fields, rank)
    mq.wait_until_ready()
    _serve(ctrl, lambda: mq.dequeue(timeout=120))


# ======================================================================================
# peers (the writer's side)
# ======================================================================================


@dataclass
class Peer:
    name: str
    send: Callable[[bytes, Step], None]  # (encoded step, step)
    ctrls: list[Any]
    procs: list[Any]
    close: Callable[[], None]
    settle_s: float = 0.0  # pause after a round (vLLM's busy loop)
    encodes: bool = False  # ``send`` encodes itself (separate channels)
    lat: list[int] = field(default_factory=list)  # per-step slowest reader, ns
    first: list[int] = field(default_factory=list)  # per-step fastest reader, ns
    cpu: list[float] = field(default_factory=list)  # % of a core, per reader


def peer_broadcast(tmp: str, n: int, spin_us: float, label: str) -> Peer:
    import ringwire

    path = os.path.join(tmp, f"b{int(spin_us)}.sock")
    bc = ringwire.broadcast_sync(path, readers=n, slots=None)
    ctrls, procs = spawn_readers(reader_ringwire, [(path, spin_us)] * n)
    await_ready(ctrls, 60)
    bc.wait_ready(n, timeout=60)

    def send(payload: bytes, rec: Step) -> None:
        bc.send(rec, timeout=60)

    return Peer(label, send, ctrls, procs, bc.close)


def peer_channels(n: int, label: str | None = None) -> Peer:
    import ringwire

    ends = [ringwire.pair() for _ in range(n)]
    ctrls, procs = spawn_readers(reader_pair, [(b, False) for _, b in ends])
    chans = [a.connect_sync(type=Step, slots=None) for a, _ in ends]
    await_ready(ctrls, 60)

    def send(payload: bytes, rec: Step) -> None:
        for ch in chans:
            ch.send(rec, timeout=60)

    def close() -> None:
        for ch in chans:
            ch.close()

    name = label or f"ringwire, {n} separate channels (parked)"
    return Peer(name, send, ctrls, procs, close, encodes=True)


def peer_zmq(tmp: str, n: int) -> Peer:
    import zmq

    addr = f"ipc://{tmp}/pub.ipc"
    zctx = zmq.Context()
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(addr)
    ctrls, procs = spawn_readers(reader_zmq, [(addr,)] * n)
    await_ready(ctrls, 60)
    time.sleep(0.5)  # PUB/SUB's slow joiner: subscriptions reach the publisher

    def close() -> None:
        pub.close(0)
        zctx.term()

    return Peer("ZeroMQ PUB/SUB ipc:// + msgspec", lambda p, r: pub.send(p), ctrls, procs, close)


def peer_vllm(tmp: str, n: int) -> Peer:
    from perf._vllm_mq import MQWriter

    mq = MQWriter(n, f"ipc://{tmp}/notify.ipc")
    ctrls, procs = spawn_readers(reader_vllm, [(mq.handle(), r) for r in range(n)])
    await_ready(ctrls, 60)
    time.sleep(0.5)
    return Peer(
        "vLLM MessageQueue scheme (re-implemented)",
        lambda p, r: mq.enqueue(p, timeout=60),
        ctrls,
        procs,
        mq.close,
        settle_s=1.2,
    )


def peer_vllm_real(tmp: str, n: int) -> Peer:
    from perf.peers.vllm_shm import handle_fields, load_message_queue

    mq = load_message_queue(tmp)(n, n)
    ctrls, procs = spawn_readers(reader_vllm_real, [(handle_fields(mq), r, tmp) for r in range(n)])
    mq.wait_until_ready()
    await_ready(ctrls, 60)

    def close() -> None:
        nonlocal mq
        del mq  # its ShmRingBuffer unlinks the segment when collected (vLLM's way)
        gc.collect()

    # vLLM pickles the record itself: ``send`` hands it the record, not our bytes
    return Peer(
        "vLLM MessageQueue (real, pickles)",
        lambda p, r: mq.enqueue(r, timeout=60),
        ctrls,
        procs,
        close,
        settle_s=1.2,
    )


# ======================================================================================
# the run
# ======================================================================================


@dataclass
class Config:
    rounds: int
    steps: int  # measured steps per peer per round
    warmup: int  # discarded steps at the start of every round
    cpu_s: float  # seconds of one step every 10 ms
    gap_s: float = 0.002


QUICK = Config(rounds=3, steps=150, warmup=20, cpu_s=2.0)
FULL = Config(rounds=8, steps=300, warmup=30, cpu_s=6.0)


def _cmd(peer: Peer, cmd: tuple[Any, ...]) -> None:
    for c in peer.ctrls:
        c.send(cmd)
    for c in peer.ctrls:
        if not c.poll(60):
            raise RuntimeError(f"{peer.name}: a reader did not answer")
        assert c.recv()[0] == "armed"


def _steps(peer: Peer, n: int, gap: Callable[[], float]) -> None:
    for seq in range(n):
        rec = make_step(seq)
        peer.send(b"" if peer.encodes else ENC.encode(rec), rec)
        time.sleep(gap())


def run_round(peer: Peer, cfg: Config, rng: random.Random) -> None:
    n = cfg.warmup + cfg.steps
    _cmd(peer, ("round", n))
    _steps(peer, n, lambda: cfg.gap_s * (1 + rng.random() / 2))
    lats = []
    for c in peer.ctrls:
        if not c.poll(120):
            raise RuntimeError(f"{peer.name}: a reader never finished its round")
        kind, raw = c.recv()
        lats.append(array("q", raw))
    cols = list(zip(*lats, strict=True))[cfg.warmup :]  # the warm-up steps are dropped
    peer.lat.extend(max(col) for col in cols)
    peer.first.extend(min(col) for col in cols)
    if peer.settle_s:
        time.sleep(peer.settle_s)


def run_cpu(peer: Peer, cfg: Config) -> None:
    n = int(cfg.cpu_s / 0.01)
    _cmd(peer, ("cpu", n))
    _steps(peer, n, lambda: 0.01)
    for c in peer.ctrls:
        if not c.poll(120):
            raise RuntimeError(f"{peer.name}: a reader never finished its CPU window")
        _, cpu_s, wall_s = c.recv()
        peer.cpu.append(100 * cpu_s / wall_s)
    if peer.settle_s:
        time.sleep(peer.settle_s)


def rt_half(tmp: str, cfg: Config, rng: random.Random) -> list[int]:
    """The baseline: a 1:1 ringwire pair, both ends parked, round trip / 2 (ns)."""
    import ringwire

    a, b = ringwire.pair()
    ctrls, procs = spawn_readers(reader_pair, [(b, True)])
    out: list[int] = []
    try:
        with a.connect_sync(type=Step, spin_us=0, slots=None) as ch:
            await_ready(ctrls, 60)
            for _ in range(cfg.rounds):
                for k in range(cfg.warmup + cfg.steps):
                    t0 = clock()
                    ch.send(Step(k, t0, TOKENS, "llama-3.1-8b-instruct"), timeout=60)
                    ch.receive(timeout=60)
                    if k >= cfg.warmup:
                        out.append((clock() - t0) // 2)
                    time.sleep(cfg.gap_s * (1 + rng.random() / 2))
            ch.send(Step(-1, 0, [], ""), timeout=60)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return out


def _pct(samples: list[int], q: float) -> float:
    s = sorted(samples)
    return s[max(0, min(len(s) - 1, int(q * len(s)) - 1))] / 1000 if s else float("nan")


@contextlib.contextmanager
def _peers(tmp: str, n: int, only: set[str] | None) -> Iterator[list[Peer]]:
    from ringwire import DEFAULT_SPIN_US

    makers: list[tuple[str, Callable[[], Peer]]] = [
        ("parked", lambda: peer_broadcast(tmp, n, 0.0, "ringwire broadcast, parked (spin_us=0)")),
        (
            "spin",
            lambda: peer_broadcast(
                tmp,
                n,
                DEFAULT_SPIN_US,
                f"ringwire broadcast, adaptive spin ({DEFAULT_SPIN_US:g} µs)",
            ),
        ),
        ("channels", lambda: peer_channels(n)),
        ("oneway", lambda: peer_channels(1, "ringwire 1:1 channel, one way, 1 reader (parked)")),
        ("zmq", lambda: peer_zmq(tmp, n)),
        ("vllm", lambda: peer_vllm(tmp, n)),
        ("vllm-real", lambda: peer_vllm_real(tmp, n)),
    ]
    with started_peers(makers, only, close_first=True) as peers:
        yield peers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument(
        "--only", action="append", help="parked, spin, channels, oneway, zmq, vllm, vllm-real"
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--arrays",
        action="store_true",
        help="the other table: a 2.4 MB array per step, lockstep, against vLLM's real "
        "MessageQueue (perf/_broadcast_arrays.py; --only loan, loan-parked, send, vllm, "
        "vllm-scheme)",
    )
    args = ap.parse_args(argv)
    if args.arrays:
        from perf import _broadcast_arrays

        return _broadcast_arrays.main(args.readers, args.quick, args.only)
    cfg = QUICK if args.quick else FULL
    n = args.readers
    rng = random.Random(1)
    tmp = tempfile.mkdtemp(prefix="rwbench-")
    t_start = time.monotonic()
    try:
        print(f"# broadcast to {n} readers ({'quick' if args.quick else 'full'})", file=sys.stderr)
        base = rt_half(tmp, cfg, rng)
        with _peers(tmp, n, set(args.only) if args.only else None) as peers:
            for r in range(cfg.rounds):
                for j in range(len(peers)):
                    peer = peers[(r + j) % len(peers)]
                    run_round(peer, cfg, rng)
                print(f"  round {r + 1}/{cfg.rounds}", file=sys.stderr)
            for peer in peers:
                run_cpu(peer, cfg)
            results = [
                {
                    "name": p.name,
                    "p50_us": _pct(p.lat, 0.5),
                    "p99_us": _pct(p.lat, 0.99),
                    "first_p50_us": _pct(p.first, 0.5),
                    "cpu_pct": statistics.fmean(p.cpu) if p.cpu else float("nan"),
                    "cpu_max_pct": max(p.cpu) if p.cpu else float("nan"),
                    "samples": len(p.lat),
                }
                for p in peers
            ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base50, base99 = _pct(base, 0.5), _pct(base, 0.99)
    rows = [
        [
            "ringwire 1:1 pair, parked round trip ÷ 2 (baseline)",
            f"{base50:.1f}",
            f"{base99:.1f}",
            "1.00",
            "—",
            "—",
        ]
    ]
    for res in results:
        rows.append(
            [
                res["name"],
                f"{res['p50_us']:.1f}",
                f"{res['p99_us']:.1f}",
                f"{res['p50_us'] / base50:.2f}",
                f"{res['first_p50_us']:.1f}",
                f"{res['cpu_pct']:.2f} (max {res['cpu_max_pct']:.2f})",
            ]
        )
    info = machine_info(["ringwire", "msgspec", "zmq"])
    print()
    print(
        f"Broadcast to {n} reader processes, ~100-byte msgspec step records, steps 2-3 ms "
        f"apart; step = writer send -> slowest reader decoded it (µs), first reader = the "
        f"fastest one. CPU: {info['cpu']}, {info['cpus_usable']} usable cores, Python "
        f"{info['python']}."
    )
    print()
    print(
        format_table(
            [
                "transport",
                "step p50 µs",
                "step p99 µs",
                "p50 ÷ baseline",
                "first reader p50 µs",
                "reader CPU @ 1 step / 10 ms, % of a core",
            ],
            rows,
            "lrrrrr",
        )
    )
    by = {r["name"]: r for r in results}
    parked = next((r for r in results if r["name"].startswith("ringwire broadcast, parked")), None)
    targets = []
    if parked is not None:
        ratio = parked["p50_us"] / base50
        targets.append(
            {
                "target": f"broadcast (parked) p50 ≤ {T_VS_RT_HALF}× 1:1 parked RT/2",
                "shown": f"{ratio:.2f}×",
                "status": "met" if ratio <= T_VS_RT_HALF else "missed",
            }
        )
        for other in results:
            if other is parked or other["name"].startswith(("ringwire broadcast", "ringwire 1:1")):
                continue
            r = parked["p50_us"] / other["p50_us"]
            targets.append(
                {
                    "target": f"broadcast (parked) ahead of {other['name']}",
                    "shown": f"{r:.2f}× its p50",
                    "status": "met" if r < 1 else "missed",
                }
            )
    for r in results:
        if r["name"].startswith("ringwire broadcast"):
            targets.append(
                {
                    "target": f"{r['name']}: reader CPU ≤ {T_CPU_PCT} % of a core",
                    "shown": f"{r['cpu_pct']:.2f} %",
                    "status": "met" if r["cpu_pct"] <= T_CPU_PCT else "missed",
                }
            )
    print()
    print(format_targets(targets))
    print(
        f"\n({time.monotonic() - t_start:.0f} s; compare ratios: absolute µs move with the machine)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "machine": info,
                    "readers": n,
                    "config": cfg.__dict__,
                    "baseline_rt_half_us": {"p50": base50, "p99": base99},
                    "results": results,
                    "targets": targets,
                    "by_name": list(by),
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
