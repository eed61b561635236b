"""Transport benchmark: ringwire's shared-memory channels vs the usual IPC suspects.

Run from the repository root::

    python -m perf.transport            # ~3.5 minutes on a 2-core VM
    python -m perf.transport --quick    # ~1 minute
    python -m perf.transport --json perf/results/transport.json

Every message is a msgpack record (the ~100-byte :class:`perf.peers.Req`; in the round
trip tables also the 4 KiB :class:`perf.peers.Blob`), encoded and decoded with msgspec
on both sides; the peer is a ``spawn`` child process.  Five tables:

* **async round trip** -- both ends parked between messages (the waiting side sleeps in
  the event loop).  Floors: two event loops exchanging one byte over ``os.pipe``
  (``loop.add_reader`` callbacks, and asyncio streams); ``zmq.asyncio`` PAIR over
  ``ipc://``; ringwire with ``spin_us=0`` (parks at once: every message goes through
  the doorbell), with its default spin budget, and (information) without a slot pool,
  and with ``anyio.wait_readable`` per park instead of the asyncio driver's reader
  registered once (what trio's path costs, and what the registration saves).
  One column per event loop (asyncio, and uvloop when installed).
* **hot round trip** -- spinning readers: two processes busy-polling a shared int64
  (the floor), a posix_ipc semaphore ping-pong, ``multiprocessing.Pipe``, iceoryx2
  publish-subscribe (when ``import iceoryx2`` works; skipped with the reason otherwise),
  ringwire's blocking (and async) endpoints with a spin budget longer than a round.
* **throughput** -- one producer, one consumer, a fixed count of records per round:
  ``multiprocessing.Queue``, faster-fifo (per record, and ``put_many``/``get_many``),
  ringwire per record and with ``send_many``/``receive_many`` (batches of 256).
* **fan-in** -- k producer processes, one consumer (:mod:`perf._fanin`):
  ``multiprocessing.Queue``, faster-fifo, zmq PUSH/PULL, ringwire's listener (its
  ``async for`` fan-in, and one ``receive_many`` task per connection).
* **idle** -- a parked ringwire consumer's CPU use (``/proc/<pid>/stat``) while nothing
  arrives.

Exit status 1 when a peer failed (crashed, or could not start: it measured nothing);
a peer skipped for a package that is not installed, or a missed target, is only
reported.

Drift: the machine this runs on is noisy (2 shared cores; absolute times move 2-3x
between runs), so every table's peers run *interleaved* in one process tree: all
children start, then each round runs every peer once (rotating who goes first), and
statistics pool all rounds.  Compare the ratios, not the absolute microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.metadata
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf import peers as P
from perf._common import format_table, format_targets, machine_info, summarize

try:
    import uvloop  # noqa: F401

    HAVE_UVLOOP = True
except ImportError:
    HAVE_UVLOOP = False


@dataclass
class Config:
    rounds: int  # measured rounds per table
    warmup_msgs: int  # discarded round trips at the start of every round
    async_n: int  # measured round trips per peer per round
    hot_n: int
    tp_n: int  # records per throughput round
    tp_warm_rounds: int
    idle_s: float
    fan_n: int = 20_000  # records per fan-in round (split over the producers)
    fan_rounds: int = 6
    fan_producers: tuple[int, ...] = (1, 4)
    fan_uvloop_modes: tuple[str, ...] = ("tasks",)  # ringwire fan-in modes also on uvloop
    round_timeout: float = 60.0


# Many short rounds mix better than a few long ones: the scheduler's placement of the
# two processes (same core / other core) persists for a while and moves the async
# numbers by 2x, so every peer should see many placements.
QUICK = Config(
    rounds=6,
    warmup_msgs=100,
    async_n=500,
    hot_n=1500,
    tp_n=30_000,
    tp_warm_rounds=1,
    idle_s=3.0,
    fan_n=20_000,
    fan_rounds=6,
    fan_producers=(1, 4),
    fan_uvloop_modes=("tasks",),
)
FULL = Config(
    rounds=15,
    warmup_msgs=200,
    async_n=1000,
    hot_n=3000,
    tp_n=100_000,
    tp_warm_rounds=1,
    idle_s=10.0,
    fan_n=60_000,
    fan_rounds=10,
    fan_producers=(1, 2, 4),
    fan_uvloop_modes=("fanin", "fanin_many", "tasks"),
)

# targets (from the issue)
T_ASYNC_VS_FLOOR = 1.5
T_ASYNC_VS_ZMQ = 0.3  # issue 27 (was 0.5)
T_HOT_VS_SEM = 1.0
T_HOT_VS_PIPE = 0.2
T_TP_VS_FF = 5.0
T_TP_VS_MPQ = 20.0
T_TP_BATCH_RATE = 1_000_000
T_IDLE_PCT = 1.0


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, steal) clock ticks of the whole machine, from /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    return user + nice + system + irq + softirq, steal


def _proc_jiffies(pid: int | None) -> int:
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return 0


def load_snapshot(child_pids: list[int]) -> tuple[int, int, int] | None:
    """(machine busy ticks, steal ticks, ticks of this process and ``child_pids``)."""
    m = _cpu_jiffies()
    if m is None:
        return None
    return m[0], m[1], _proc_jiffies(os.getpid()) + sum(_proc_jiffies(p) for p in child_pids)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the runner


@dataclass
class GroupResult:
    samples: dict[str, list[float]] = field(default_factory=dict)
    infos: dict[str, Any] = field(default_factory=dict)
    # name -> [parent CPU ns, child CPU ns, messages] summed over measured rounds
    cpu: dict[str, list[int]] = field(default_factory=dict)
    # name -> [busy ticks of other processes, steal ticks, wall ns] over measured rounds
    load: dict[str, list[int]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    # name -> sums over measured rounds of the numeric "*_cpu_ns" / "records" fields
    # of the child's round info (fan-in peers: consumer and producers separately)
    sums: dict[str, dict[str, float]] = field(default_factory=dict)


class Harness:
    """Owns one event loop per loop kind (asyncio, uvloop) and runs peers' methods.

    The loops take turns: each async call runs to completion on its peer's loop with
    ``run_until_complete``, so peers on different loops interleave like the others."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}

    def loop(self, kind: str) -> asyncio.AbstractEventLoop:
        lp = self._loops.get(kind)
        if lp is None:
            lp = self._loops[kind] = P.new_loop(kind)
        return lp

    def close(self) -> None:
        for lp in self._loops.values():
            with contextlib.suppress(Exception):
                P.close_loop(lp)
        self._loops.clear()

    def call(self, peer: P.Peer, meth: str, *args: Any, timeout: float) -> Any:
        """Run ``peer.meth(*args)`` (on the peer's loop if it is async) under a
        watchdog that kills the child a little after ``timeout``."""
        dog = threading.Timer(timeout + 5.0, peer.kill_child)
        dog.daemon = True
        dog.start()
        try:
            res = getattr(peer, meth)(*args)
            if asyncio.iscoroutine(res):
                assert peer.loop_kind is not None
                lp = self.loop(peer.loop_kind)
                asyncio.set_event_loop(lp)
                try:
                    res = lp.run_until_complete(asyncio.wait_for(res, timeout))
                except asyncio.TimeoutError:
                    raise P.PeerFailed(f"{meth} timed out after {timeout:g} s") from None
                finally:
                    asyncio.set_event_loop(None)
            return res
        finally:
            dog.cancel()

    def start(self, peers: list[P.Peer], out: GroupResult) -> list[P.Peer]:
        live = []
        for p in peers:
            log(f"  starting {p.name}")
            try:
                self.call(p, "asetup" if p.is_async else "setup", timeout=P.SETUP_TIMEOUT_S)
            except P.PeerUnavailable as e:
                out.skipped[p.name] = str(e)
                log(f"  skipped {p.name}: {e}")
                self.stop(p)
                continue
            except BaseException as e:
                out.failed[p.name] = _why(e)
                log(f"  FAILED to start {p.name}: {_why(e)}")
                self.stop(p)
                if isinstance(e, KeyboardInterrupt):
                    raise
                continue
            live.append(p)
        return live

    def stop(self, p: P.Peer) -> None:
        if p.is_async and p.loop_kind is not None:
            with contextlib.suppress(BaseException):
                self.call(p, "aclose_transport", timeout=10.0)
        p.close()

    def interleave(
        self,
        peers: list[P.Peer],
        rounds: int,
        one: Callable[[P.Peer], tuple[list[float], int]],
        out: GroupResult,
    ) -> None:
        """``rounds`` rounds; in each, every live peer runs once, rotating who starts."""
        live = list(peers)
        for p in live:
            out.samples.setdefault(p.name, [])
        for r in range(rounds):
            k = len(live)
            if not k:
                break
            order = [live[(r + j) % k] for j in range(k)]
            for p in order:
                try:
                    p.last_info = None
                    gc.collect()
                    gc.disable()
                    pids = p.child_pids()
                    s0, w0 = load_snapshot(pids), time.monotonic_ns()
                    c0 = time.process_time_ns()
                    try:
                        samples, msgs = one(p)
                    finally:
                        parent_cpu = time.process_time_ns() - c0
                        s1, w1 = load_snapshot(pids), time.monotonic_ns()
                        gc.enable()
                    if s0 is not None and s1 is not None:
                        acc_l = out.load.setdefault(p.name, [0, 0, 0])
                        acc_l[0] += (s1[0] - s0[0]) - (s1[2] - s0[2])  # busy, not ours
                        acc_l[1] += s1[1] - s0[1]  # steal
                        acc_l[2] += w1 - w0
                    out.samples[p.name].extend(samples)
                    li = p.last_info or {}
                    if li.get("info") is not None:
                        out.infos[p.name] = li["info"]
                        if isinstance(li["info"], dict):
                            acc_s = out.sums.setdefault(p.name, {})
                            for key, v in li["info"].items():
                                if key.endswith("_cpu_ns") or key == "records":
                                    acc_s[key] = acc_s.get(key, 0) + v
                    acc = out.cpu.setdefault(p.name, [0, 0, 0])
                    acc[0] += parent_cpu
                    acc[1] += int(li.get("cpu_ns", 0))
                    acc[2] += msgs
                except KeyboardInterrupt:
                    raise
                except BaseException as e:
                    out.failed[p.name] = _why(e)
                    log(f"  FAILED {p.name} in round {r}: {_why(e)}")
                    live.remove(p)
                    self.stop(p)
            log(f"  round {r + 1}/{rounds} done")

    # -- the tables

    def rt_group(self, title: str, peers: list[P.Peer], n: int) -> GroupResult:
        cfg = self.cfg
        out = GroupResult()
        log(f"{title}: {len(peers)} peers, {cfg.rounds} rounds x {n} round trips")
        live: list[P.Peer] = []
        try:
            live = self.start(peers, out)

            def one(p: P.Peer) -> tuple[list[float], int]:
                total = cfg.warmup_msgs + n
                s = self.call(p, "rt_round", total, timeout=cfg.round_timeout)
                p.finish_round(cfg.round_timeout)
                return s[cfg.warmup_msgs :], total

            self.interleave(live, cfg.rounds, one, out)
        finally:
            for p in live:
                self.stop(p)
        return out

    def tp_group(
        self, title: str, peers: list[P.Peer], n: int | None = None, rounds: int | None = None
    ) -> GroupResult:
        cfg = self.cfg
        out = GroupResult()
        n = n or cfg.tp_n
        rounds = rounds or cfg.rounds
        log(
            f"{title}: {len(peers)} peers, {rounds} rounds (+{cfg.tp_warm_rounds} warm-up) x {n} records"
        )
        live: list[P.Peer] = []
        try:
            live = self.start(peers, out)
            warm = GroupResult()
            self.interleave(
                live,
                cfg.tp_warm_rounds,
                lambda p: (
                    [
                        self.call(
                            p, "tp_round", n // 4, cfg.round_timeout, timeout=cfg.round_timeout
                        )
                    ],
                    0,
                ),
                warm,
            )
            out.failed.update(warm.failed)
            live = [p for p in live if p.name not in warm.failed]

            def one(p: P.Peer) -> tuple[list[float], int]:
                ns = self.call(p, "tp_round", n, cfg.round_timeout, timeout=cfg.round_timeout)
                return [n / (ns / 1e9)], n

            self.interleave(live, rounds, one, out)
        finally:
            for p in live:
                self.stop(p)
        return out

    def idle_group(self, peers: list[P.Peer]) -> GroupResult:
        """All idle peers wait at once (they are parked: they do not compete)."""
        cfg = self.cfg
        out = GroupResult()
        log(f"idle: {len(peers)} consumers parked for {cfg.idle_s:.0f} s")
        live: list[P.Peer] = []
        try:
            live = self.start(peers, out)
            for p in live:
                p.start_round(1)
            time.sleep(0.5)  # past any spin budget
            c0 = {p.name: P.proc_cpu_seconds(p.proc.pid) for p in live}
            t0 = time.monotonic()
            time.sleep(cfg.idle_s)
            c1 = {p.name: P.proc_cpu_seconds(p.proc.pid) for p in live}
            t1 = time.monotonic()
            for p in live:
                try:
                    p.chan.send(P.make_record(), cfg.round_timeout)  # type: ignore[attr-defined]
                    info = p.finish_round(cfg.round_timeout)
                except BaseException as e:
                    out.failed[p.name] = _why(e)
                    continue
                cpu = c1[p.name] - c0[p.name]
                out.samples[p.name] = [100.0 * cpu / (t1 - t0)]
                out.infos[p.name] = {
                    "cpu_s": cpu,
                    "wall_s": t1 - t0,
                    **((info or {}).get("info") or {}),
                }
        finally:
            for p in live:
                self.stop(p)
        return out


def _why(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}".strip()
    return s if len(s) < 2000 else s[:2000] + "..."


# --------------------------------------------------------------------------- reporting


def _loop_of(name: str) -> tuple[str, str]:
    for kind in ("asyncio", "uvloop"):
        suffix = f" [{kind}]"
        if name.endswith(suffix):
            return name[: -len(suffix)], kind
    return name, ""


def _us(ns: float) -> str:
    us = ns / 1000
    return f"{us:.1f}" if us >= 10 else f"{us:.2f}"


def _x(r: float | None) -> str:
    if r is None:
        return "—"
    return f"{r:.3f}×" if r < 1 else f"{r:.2f}×"


class Report:
    def __init__(self) -> None:
        self.targets: list[dict[str, Any]] = []
        self.tables: dict[str, str] = {}
        self.data: dict[str, Any] = {}

    def target(self, what: str, value: float | None, limit: float, op: str, shown: str) -> None:
        ok = None if value is None else (value <= limit if op == "<=" else value >= limit)
        self.targets.append(
            {
                "target": what,
                "value": value,
                "limit": limit,
                "op": op,
                "shown": shown,
                "status": "n/a" if ok is None else "HIT" if ok else "MISS",
            }
        )

    def print_table(self, key: str, title: str, text: str) -> None:
        self.tables[key] = text
        print(f"\n### {title}\n")
        print(text)


def _cpu(res: GroupResult, name: str) -> tuple[float, float] | None:
    """(parent, child) CPU µs per message, over every round the peer ran."""
    acc = res.cpu.get(name)
    if not acc or not acc[2]:
        return None
    return acc[0] / acc[2] / 1000, acc[1] / acc[2] / 1000


def _cpu_cell(res: GroupResult, name: str) -> str:
    c = _cpu(res, name)
    return "—" if c is None else f"{c[0]:.1f} + {c[1]:.1f}"


def _other_load(res: GroupResult, name: str) -> float | None:
    """CPU cores used by everything else on the machine (other processes, kernel
    threads, hypervisor steal) while this peer was measured, on average."""
    acc = res.load.get(name)
    if not acc or not acc[2]:
        return None
    return max(0.0, (acc[0] + acc[1]) / os.sysconf("SC_CLK_TCK") / (acc[2] / 1e9))


def _other_cell(res: GroupResult, name: str) -> str:
    v = _other_load(res, name)
    return "—" if v is None else f"{v:.2f}"


def _stats(samples: list[float]) -> Any:
    return summarize([int(s) for s in samples]) if samples else None


SIZE_4K = P.KINDS[P.BLOB_BYTES].suffix  # ", 4 KiB"


def _size_of(label: str) -> str:
    """The record-size suffix of a row label ("" for the 100-byte record)."""
    return SIZE_4K if label.endswith(SIZE_4K) else ""


def _size_word(suffix: str) -> str:
    return "4 KiB" if suffix else "100 B"


def report_async(res: GroupResult, rep: Report) -> None:
    stats = {name: _stats(s) for name, s in res.samples.items() if s}
    rows: dict[str, dict[str, Any]] = {}
    names: dict[tuple[str, str], str] = {}
    loops: list[str] = []
    for name, st in stats.items():
        label, kind = _loop_of(name)
        rows.setdefault(label, {})[kind] = st
        names[label, kind] = name
        if kind not in loops:
            loops.append(kind)
    floor: dict[str, float | None] = {}
    zmq: dict[tuple[str, str], float | None] = {}  # (loop, size suffix) -> median
    for kind in loops:
        fl = [r[kind].median_ns for lbl, r in rows.items() if "floor" in lbl and kind in r]
        floor[kind] = min(fl) if fl else None
        for lbl, r in rows.items():
            if lbl.startswith("zmq") and kind in r:
                zmq.setdefault((kind, _size_of(lbl)), r[kind].median_ns)
    headers = ["peer", "record"]
    for kind in loops:
        headers += [f"{kind} median µs", "p99 µs", "× floor", "× zmq", "CPU µs/RT", "other load"]
    table = []
    # 100-byte rows first, then the 4 KiB ones, each in the order they ran
    for label, r in sorted(rows.items(), key=lambda kv: _size_of(kv[0]) != ""):
        size = _size_of(label)
        row = [label.removesuffix(size), _size_word(size) if "floor" not in label else "1 B"]
        for kind in loops:
            st = r.get(kind)
            if st is None:
                row += ["—"] * 6
                continue
            z = zmq.get((kind, size))
            row += [
                _us(st.median_ns),
                _us(st.p99_ns),
                _x(st.median_ns / floor[kind] if floor[kind] else None),
                _x(st.median_ns / z if z else None),
                _cpu_cell(res, names[label, kind]),
                _other_cell(res, names[label, kind]),
            ]
        table.append(row)
    for name, why in {**res.skipped, **res.failed}.items():
        table.append([name + f" — {why.splitlines()[0][:80]}"] + ["—"] * (len(headers) - 1))
    rep.print_table(
        "async_rt",
        "Async round trip, both ends parked (100-byte and 4 KiB records; floor = one byte; "
        "× zmq: same record size)",
        format_table(headers, table, "ll" + "r" * (len(headers) - 2)),
    )
    rep.data["async_rt"] = {
        n: {
            **s.to_dict(),
            "cpu_us_parent_child": _cpu(res, n),
            "other_load_cores": _other_load(res, n),
        }
        for n, s in stats.items()
    }
    rep.data["async_rt_infos"] = res.infos
    for size in ("", SIZE_4K):
        for kind in loops:
            rw = rows.get(f"ringwire parked (spin_us=0){size}", {}).get(kind)
            v = rw.median_ns if rw else None
            if size and v is None:
                continue
            tag = "" if kind == "asyncio" else f" [{kind}]"
            info = "(info) " if size else ""
            what = f"{info}async RT{tag}{' 4 KiB' if size else ''}"
            rf = v / floor[kind] if v and floor[kind] else None
            z = zmq.get((kind, size))
            rz = v / z if v and z else None
            rep.target(
                f"{what}: ringwire ≤ {T_ASYNC_VS_FLOOR}× asyncio-pipe floor",
                rf,
                T_ASYNC_VS_FLOOR,
                "<=",
                _x(rf),
            )
            rep.target(
                f"{what}: ringwire ≤ {T_ASYNC_VS_ZMQ}× zmq.asyncio",
                rz,
                T_ASYNC_VS_ZMQ,
                "<=",
                _x(rz),
            )


def report_hot(res: GroupResult, rep: Report) -> None:
    stats = {name: _stats(s) for name, s in res.samples.items() if s}

    def med(prefix: str, size: str = "") -> float | None:
        for n, s in stats.items():
            if n.startswith(prefix) and _size_of(n) == size:
                return s.median_ns
        return None

    floor = med("busy-poll")
    sem = (
        stats["posix_ipc semaphore ping-pong"].median_ns
        if "posix_ipc semaphore ping-pong" in stats
        else None
    )
    pinned = med("posix_ipc semaphore ping-pong, both pinned")
    headers = [
        "peer",
        "record",
        "median µs",
        "p99 µs",
        "× busy-poll",
        "× semaphore",
        "× mp.Pipe",
        "× iceoryx2",
        "CPU µs/RT",
        "other load",
    ]
    table = []
    for n, s in sorted(stats.items(), key=lambda kv: _size_of(kv[0]) != ""):
        m = s.median_ns
        size = _size_of(n)
        pipe, iox = med("multiprocessing.Pipe", size), med("iceoryx2", size)
        payload = "none" if n.startswith(("busy-poll", "posix_ipc")) else _size_word(size)
        table.append(
            [
                n.removesuffix(size),
                payload,
                _us(m),
                _us(s.p99_ns),
                _x(m / floor if floor else None),
                _x(m / sem if sem else None),
                _x(m / pipe if pipe else None),
                _x(m / iox if iox else None),
                _cpu_cell(res, n),
                _other_cell(res, n),
            ]
        )
    for name, why in {**res.skipped, **res.failed}.items():
        table.append([name + f" — {why.splitlines()[0][:100]}"] + ["—"] * (len(headers) - 1))
    rep.print_table(
        "hot_rt",
        "Hot round trip, spinning readers (floors carry no payload; × mp.Pipe and × iceoryx2: "
        "same record size)",
        format_table(headers, table, "ll" + "r" * (len(headers) - 2)),
    )
    rep.data["hot_rt"] = {
        n: {
            **s.to_dict(),
            "cpu_us_parent_child": _cpu(res, n),
            "other_load_cores": _other_load(res, n),
        }
        for n, s in stats.items()
    }
    rep.data["hot_rt_infos"] = res.infos
    rep.data["hot_rt_skipped"] = dict(res.skipped)
    rw = med("ringwire hot, blocking API")
    pipe = med("multiprocessing.Pipe")
    rs = rw / sem if rw and sem else None
    rp = rw / pipe if rw and pipe else None
    rep.target(
        f"hot RT: ringwire ≤ {T_HOT_VS_SEM}× posix_ipc semaphore", rs, T_HOT_VS_SEM, "<=", _x(rs)
    )
    rep.target(
        f"hot RT: ringwire ≤ {T_HOT_VS_PIPE}× multiprocessing.Pipe", rp, T_HOT_VS_PIPE, "<=", _x(rp)
    )
    rq = rw / pinned if rw and pinned else None
    rep.target(
        "(info) hot RT: ringwire ≤ 1× semaphore with both processes pinned to one CPU",
        rq,
        T_HOT_VS_SEM,
        "<=",
        _x(rq),
    )
    rw4, pipe4 = med("ringwire hot, blocking API", SIZE_4K), med("multiprocessing.Pipe", SIZE_4K)
    if rw4 and pipe4:
        r = rw4 / pipe4
        rep.target(
            f"(info) hot RT 4 KiB: ringwire ≤ {T_HOT_VS_PIPE}× multiprocessing.Pipe",
            r,
            T_HOT_VS_PIPE,
            "<=",
            _x(r),
        )
    for size in ("", SIZE_4K):
        rws, iox = med("ringwire hot, blocking API", size), med("iceoryx2", size)
        if rws and iox:
            r = rws / iox
            rep.target(
                f"(info) hot RT {_size_word(size)}: ringwire ≤ 1× iceoryx2 pub/sub",
                r,
                1.0,
                "<=",
                _x(r),
            )


def report_tp(res: GroupResult, rep: Report) -> None:
    med = {n: statistics.median(s) for n, s in res.samples.items() if s}

    def get(prefix: str) -> float | None:
        for n, v in med.items():
            if n.startswith(prefix):
                return v
        return None

    mpq = get("multiprocessing.Queue")
    ff1, ffb = get("faster-fifo put/get"), get("faster-fifo put_many")
    headers = [
        "peer",
        "records/s",
        "min–max",
        "× mp.Queue",
        "× faster-fifo (same mode)",
        "CPU µs/rec producer + consumer",
        "other load",
    ]
    table = []
    for n, v in med.items():
        s = res.samples[n]
        batch = "many" in n
        ff = ffb if batch else ff1
        is_rw = n.startswith("ringwire")
        table.append(
            [
                n,
                f"{v:,.0f}",
                f"{min(s):,.0f}–{max(s):,.0f}",
                _x(v / mpq if mpq else None),
                _x(v / ff if ff and is_rw else None),
                _cpu_cell(res, n) if not n.startswith("codec") else "—",
                _other_cell(res, n),
            ]
        )
    for name, why in {**res.skipped, **res.failed}.items():
        table.append([name + f" — {why.splitlines()[0][:80]}"] + ["—"] * 6)
    rep.print_table(
        "throughput",
        f"Throughput, one producer → one consumer (100-byte records, batches of {P.BATCH})",
        format_table(headers, table),
    )
    rep.data["throughput"] = {
        n: {
            "median_rps": med[n],
            "samples_rps": res.samples[n],
            "cpu_us_producer_consumer": _cpu(res, n),
            "other_load_cores": _other_load(res, n),
        }
        for n in med
    }
    rep.data["throughput_infos"] = res.infos
    # Each transport in its best mode: ringwire and faster-fifo batched, mp.Queue per
    # record (it has no batch API).  Judged on ringwire's blocking API (the baselines are
    # blocking queues); the async rows and per-record ratios are shown for information.
    sb, ss = get("ringwire sync send_many"), get("ringwire sync send/receive")
    ab = get("ringwire async [asyncio] send_many")

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    def rate(v: float | None) -> str:
        return f"{v:,.0f}/s" if v else "—"

    r = ratio(sb, ffb)
    rep.target(
        f"throughput: ringwire batch ≥ {T_TP_VS_FF:g}× faster-fifo batch (blocking APIs)",
        r,
        T_TP_VS_FF,
        ">=",
        _x(r),
    )
    r = ratio(sb, mpq)
    rep.target(
        f"throughput: ringwire batch ≥ {T_TP_VS_MPQ:g}× mp.Queue (blocking APIs)",
        r,
        T_TP_VS_MPQ,
        ">=",
        _x(r),
    )
    rep.target(
        "throughput: ringwire batch ≥ 1 M records/s (blocking API)",
        sb,
        T_TP_BATCH_RATE,
        ">=",
        rate(sb),
    )
    r = ratio(ss, ff1)
    rep.target(
        f"(info) per record: ringwire ≥ {T_TP_VS_FF:g}× faster-fifo put/get",
        r,
        T_TP_VS_FF,
        ">=",
        _x(r),
    )
    r = ratio(ss, mpq)
    rep.target(
        f"(info) per record: ringwire ≥ {T_TP_VS_MPQ:g}× mp.Queue", r, T_TP_VS_MPQ, ">=", _x(r)
    )
    r = ratio(ab, ffb)
    rep.target(
        f"(info) async [asyncio]: ringwire batch ≥ {T_TP_VS_FF:g}× faster-fifo batch",
        r,
        T_TP_VS_FF,
        ">=",
        _x(r),
    )
    r = ratio(ab, mpq)
    rep.target(
        f"(info) async [asyncio]: ringwire batch ≥ {T_TP_VS_MPQ:g}× mp.Queue",
        r,
        T_TP_VS_MPQ,
        ">=",
        _x(r),
    )
    rep.target(
        "(info) async [asyncio]: ringwire batch ≥ 1 M records/s",
        ab,
        T_TP_BATCH_RATE,
        ">=",
        rate(ab),
    )


def _fan_transport(name: str) -> str:
    for key in ("ringwire", "faster-fifo", "zmq", "multiprocessing.Queue", "decode ceiling"):
        if name.startswith(key):
            return key
    return name


def _fan_batch(name: str) -> bool:
    """Batched on the producer side: send_many, put_many, send_multipart."""
    return "many" in name or "multipart" in name


def report_fanin(res: GroupResult, rep: Report, n: int) -> None:
    from perf._fanin import rw_name_parts

    med = {name: statistics.median(s) for name, s in res.samples.items() if s}
    by_k: dict[int, dict[str, float]] = {}
    for name, v in med.items():
        _, k = rw_name_parts(name)
        by_k.setdefault(k, {})[name] = v
    ceiling = next((v for name, v in med.items() if name.startswith("decode ceiling")), None)

    def pick(k: int, transport: str, batch: bool | None) -> tuple[str, float] | None:
        """The fastest row of ``transport`` with k producers (in that mode)."""
        cands = [
            (name, v)
            for name, v in by_k.get(k, {}).items()
            if _fan_transport(name) == transport and (batch is None or _fan_batch(name) == batch)
        ]
        return max(cands, key=lambda c: c[1]) if cands else None

    headers = [
        "peer",
        "producers",
        "records/s",
        "min–max",
        "× mp.Queue",
        "× faster-fifo (same mode)",
        "× zmq (same mode)",
        "× decode ceiling",
        "CPU µs/rec consumer + producers",
        "other load",
    ]
    table = []
    for k in sorted(by_k):
        for name, v in by_k[k].items():
            sm = res.samples[name]
            tr = _fan_transport(name)
            batch = _fan_batch(name)
            mpq = pick(k, "multiprocessing.Queue", None)
            ff = pick(k, "faster-fifo", batch)
            zq = pick(k, "zmq", batch)
            sums = res.sums.get(name, {})
            recs = sums.get("records") or 0
            cpu = (
                f"{sums.get('consumer_cpu_ns', 0) / recs / 1000:.2f} + "
                f"{sums.get('producers_cpu_ns', 0) / recs / 1000:.2f}"
                if recs
                else "—"
            )
            head, _ = rw_name_parts(name)
            table.append(
                [
                    head if k else name,
                    str(k) if k else "—",
                    f"{v:,.0f}",
                    f"{min(sm):,.0f}–{max(sm):,.0f}",
                    _x(v / mpq[1] if mpq and tr != "multiprocessing.Queue" and k else None),
                    _x(v / ff[1] if ff and tr not in ("faster-fifo",) and k else None),
                    _x(v / zq[1] if zq and tr not in ("zmq",) and k else None),
                    _x(v / ceiling if ceiling and k else None),
                    cpu,
                    _other_cell(res, name),
                ]
            )
    for name, why in {**res.skipped, **res.failed}.items():
        table.append([name + f" — {why.splitlines()[0][:80]}"] + ["—"] * (len(headers) - 1))
    rep.print_table(
        "fanin",
        f"Fan-in throughput, k producers → one consumer (100-byte records, {n:,} per round "
        f"split over the producers, batches of {P.BATCH})",
        format_table(headers, table, "llrrrrrrrr"),
    )
    rep.data["fanin"] = {
        name: {
            "producers": rw_name_parts(name)[1],
            "peer": rw_name_parts(name)[0],
            "transport": _fan_transport(name),
            "batch": _fan_batch(name),
            "median_rps": v,
            "samples_rps": res.samples[name],
            "cpu_sums": res.sums.get(name),
            "other_load_cores": _other_load(res, name),
            "info": res.infos.get(name),
        }
        for name, v in med.items()
    }
    for k in sorted(kk for kk in by_k if kk):
        pl = f"{k} producer{'s' * (k > 1)}"
        rw, ff = pick(k, "ringwire", None), pick(k, "faster-fifo", None)
        r = rw[1] / ff[1] if rw and ff else None
        rep.target(
            f"fan-in, {pl}: ringwire ≥ {T_TP_VS_FF:g}× faster-fifo (each in its best mode)",
            r,
            T_TP_VS_FF,
            ">=",
            _x(r) + (f" ({rw[1]:,.0f} vs {ff[1]:,.0f}/s)" if rw and ff else ""),
        )
        rw1, ff1 = pick(k, "ringwire", False), pick(k, "faster-fifo", False)
        r = rw1[1] / ff1[1] if rw1 and ff1 else None
        rep.target(
            f"(info) fan-in, {pl}: ringwire listener per record ≥ {T_TP_VS_FF:g}× faster-fifo put/get",
            r,
            T_TP_VS_FF,
            ">=",
            _x(r),
        )
        zq = pick(k, "zmq", None)
        r = rw[1] / zq[1] if rw and zq else None
        rep.target(
            f"(info) fan-in, {pl}: ringwire ≥ 1× zmq PUSH/PULL (each in its best mode)",
            r,
            1.0,
            ">=",
            _x(r),
        )


def report_idle(res: GroupResult, rep: Report, seconds: float) -> None:
    headers = ["consumer", "CPU % of one core", "CPU s", "window s", "parks"]
    table = []
    for n, s in res.samples.items():
        info = res.infos.get(n, {})
        table.append(
            [
                n,
                f"{s[0]:.2f}",
                f"{info.get('cpu_s', 0):.2f}",
                f"{info.get('wall_s', 0):.1f}",
                str(info.get("receive_parks", "?")),
            ]
        )
    for name, why in {**res.skipped, **res.failed}.items():
        table.append([name + f" — {why.splitlines()[0][:80]}"] + ["—"] * 4)
    rep.print_table(
        "idle",
        f"Idle: a parked consumer over {seconds:g} s of silence",
        format_table(headers, table),
    )
    rep.data["idle"] = {
        n: {"cpu_pct": s[0], **res.infos.get(n, {})} for n, s in res.samples.items()
    }
    for n, s in res.samples.items():
        rep.target(
            f"idle: {n} ≤ {T_IDLE_PCT:g} % of a core", s[0], T_IDLE_PCT, "<=", f"{s[0]:.2f} %"
        )


# --------------------------------------------------------------------------- main


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in (
        "ringwire",
        "msgspec",
        "anyio",
        "pyzmq",
        "faster-fifo",
        "posix_ipc",
        "uvloop",
        "numpy",
    ):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer/shorter rounds (~1 minute)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument(
        "--only",
        choices=["async", "hot", "tp", "fanin", "idle"],
        action="append",
        help="run only these tables (repeatable)",
    )
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    only = set(args.only or ["async", "hot", "tp", "fanin", "idle"])
    loops = ["asyncio"] + (["uvloop"] if HAVE_UVLOOP else [])

    info = machine_info()
    info["versions"] = _versions()
    info["loadavg_start"] = os.getloadavg()
    print("## Transport benchmark" + (" (--quick)" if args.quick else ""))
    print()
    print(
        f"- platform: {info['platform']}; CPU: {info['cpu']}; "
        f"cpus: {info['cpu_count']} ({info['cpus_usable']} usable); python {info['python']}"
    )
    print("- versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print(
        f"- record: {P.RECORD_BYTES} bytes msgpack (msgspec); rounds: {cfg.rounds}, interleaved; "
        f"load average at start: {info['loadavg_start'][0]:.2f}"
    )
    if not HAVE_UVLOOP:
        print("- uvloop not installed: asyncio column only")

    rep = Report()
    h = Harness(cfg)
    failed: dict[str, str] = {}  # peer -> why: it crashed (a skip for a missing package is not)

    def failed_in(res: GroupResult) -> GroupResult:
        failed.update(res.failed)
        return res

    t_start = time.monotonic()
    try:
        if "async" in only:
            peers: list[P.Peer] = []
            for lk in loops:
                peers += [
                    P.PipeFloor(lk),
                    P.PipeFloor(lk, task=True),
                    P.PipeStreams(lk),
                    P.ZmqAsync(lk),
                    P.RingwireAsyncRT(lk, 0.0, "parked (spin_us=0)"),
                    P.RingwireAsyncRT(lk, _default_spin(), "default spin"),
                    P.RingwireAsyncRT(lk, 0.0, "parked (spin_us=0)", pool=False),
                    P.RingwireAsyncRT(lk, 0.0, "parked (spin_us=0)", per_park=True),
                    P.ZmqAsync(lk, size=P.BLOB_BYTES),
                    P.RingwireAsyncRT(lk, 0.0, "parked (spin_us=0)", size=P.BLOB_BYTES),
                    P.RingwireAsyncRT(lk, _default_spin(), "default spin", size=P.BLOB_BYTES),
                ]
            report_async(failed_in(h.rt_group("async RT", peers, cfg.async_n)), rep)
        if "hot" in only:
            peers = [
                P.BusyPoll(),
                P.SemPingPong(),
                P.SemPingPong(pin_cpu=0),
                P.MpPipe(),
                P.Iceoryx2RT(),
                P.RingwireSyncRT(P.HOT_SPIN_US, "hot, blocking API"),
                P.RingwireAsyncRT("asyncio", P.HOT_SPIN_US, "hot, async API"),
                P.MpPipe(size=P.BLOB_BYTES),
                P.Iceoryx2RT(size=P.BLOB_BYTES),
                P.RingwireSyncRT(P.HOT_SPIN_US, "hot, blocking API", size=P.BLOB_BYTES),
            ]
            report_hot(failed_in(h.rt_group("hot RT", peers, cfg.hot_n)), rep)
        if "tp" in only:
            peers = [
                P.CodecCeiling(),
                P.MpQueueTP(),
                P.FasterFifoTP(batch=False),
                P.FasterFifoTP(batch=True),
                P.RingwireTP(None, batch=False),
                P.RingwireTP(None, batch=True),
                P.RingwireTP("asyncio", batch=False),
                P.RingwireTP("asyncio", batch=True),
                P.RingwireTP(None, batch=False, pool=False),
                P.RingwireTP(None, batch=True, pool=False),
            ]
            report_tp(failed_in(h.tp_group("throughput", peers)), rep)
        if "fanin" in only:
            from perf import _fanin as F

            peers = [F.DecodeCeiling()]
            for k in cfg.fan_producers:
                peers += [
                    F.MpQueueFanIn(k),
                    F.FasterFifoFanIn(k, batch=False),
                    F.FasterFifoFanIn(k, batch=True),
                    F.ZmqFanIn(k, batch=False),
                    F.ZmqFanIn(k, batch=True),
                ]
                peers += [F.RingwireFanIn(k, m) for m in F.RW_MODES]
                if HAVE_UVLOOP:
                    peers += [F.RingwireFanIn(k, m, "uvloop") for m in cfg.fan_uvloop_modes]
            res = failed_in(h.tp_group("fan-in", peers, cfg.fan_n, cfg.fan_rounds))
            report_fanin(res, rep, cfg.fan_n)
        if "idle" in only:
            peers = [P.RingwireIdle("asyncio"), P.RingwireIdle(None)]
            report_idle(failed_in(h.idle_group(peers)), rep, cfg.idle_s)
    finally:
        h.close()

    print("\n### Targets\n")
    print(format_targets(rep.targets))
    elapsed = time.monotonic() - t_start
    info["loadavg_end"] = os.getloadavg()
    print(f"\n(total {elapsed:.0f} s; load average at end: {info['loadavg_end'][0]:.2f})")

    if args.json:
        out = {
            "machine": info,
            "config": cfg.__dict__,
            "quick": args.quick,
            "results": rep.data,
            "failed": failed,
            "targets": rep.targets,
            "tables": rep.tables,
            "elapsed_s": elapsed,
        }
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2, default=str) + "\n", encoding="utf-8")
        log(f"wrote {path}")
    if failed:  # a peer that failed measured nothing: the run is broken, not slow
        print("\nFAILED peers: " + "; ".join(f"{n}: {w}" for n, w in failed.items()))
        return 1
    return 0


def _default_spin() -> float:
    import ringwire

    return float(ringwire.DEFAULT_SPIN_US)


if __name__ == "__main__":
    raise SystemExit(main())
