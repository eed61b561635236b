"""Broadcast with a remote reader: 2 local readers + 1 over TCP, against ZeroMQ PUB/SUB.

Run from the repository root (pyzmq installed: ``pip install -e '.[bench]'``)::

    python -m perf.broadcast_remote                # ~130 s on a 2-core VM
    python -m perf.broadcast_remote --quick        # ~30 s
    python -m perf.broadcast_remote --tcp-host 127.0.0.1 --json PATH

One question: with two readers on this host (shared memory) and one "remote" reader
(TCP), what are a broadcast's step latency and throughput against ZeroMQ PUB/SUB of
the same shape, and what does attaching the remote reader cost the local ones?

The peers, each a writer in this process and its readers ``spawn`` children (all alive
for the whole run; the "remote" reader is on this host too, connected over TCP to
``--tcp-host``, default 127.0.0.1):

* **ringwire, 2 local + 1 remote** -- :func:`ringwire.broadcast_sync` at a Unix path
  with ``tcp="tcp://HOST:0"``; ranks 0 and 1 :func:`ringwire.subscribe_sync` the path,
  rank 2 subscribes the writer's ``tcp_address``.  Arrays go by reference through the
  slot pool to the local readers and as ZeroMQ frames to the remote one;
* **ZeroMQ PUB/SUB, 2 ipc:// + 1 tcp://** -- one ``PUB`` bound to an ``ipc://`` path
  and to ``tcp://HOST:*``, three ``SUB`` readers (two on ipc, one on tcp), msgspec for
  the record, the array as a zero-copy second frame
  (``send_multipart([header, memoryview(arr)], copy=False)``; the reader views it with
  ``np.frombuffer``).  PUB/SUB's slow joiner: the writer publishes warm-up records
  until every reader has received one; high-water marks are off (no drops);
* **ringwire, 2 local only** -- the same broadcast without ``tcp``: the baseline for
  what a remote reader costs the local readers;
* **ringwire, 3 local readers** -- the control: the same broadcast without ``tcp``
  and a third reader process on the Unix path instead of the remote one.  On a
  machine with few cores a third reader process costs the other two CPU time whatever
  its transport; local readers with a remote reader ÷ with a third local one
  separates what the remote path itself costs them from that contention.

Records: a ~100-byte msgspec struct carrying the writer's clock at send
(``time.perf_counter_ns``: CLOCK_MONOTONIC, one clock for every process of the host),
and the same struct carrying a 4 MiB ``uint8`` array.  A reader that gets an array
reads 64 bytes spread over it (one every 64 KiB) and checks them, so the bytes did
arrive; it notes its clock after that.  ringwire's writer uses ``send`` (one copy into
its pool per step); ZeroMQ's sends the same array every step without a copy.

Measurements, per peer, in interleaved rounds (every measurement runs for each peer in
turn, the first peer rotated every round):

* **step latency**: steps paced (small records 2-3 ms apart, arrays 20-30 ms apart,
  jittered), "writer send -> the slowest reader has decoded it"; for the remote peers
  also the slowest *local* reader and the remote reader separately.  p50 / p99 over
  every measured step (the first steps of every round are dropped);
* **throughput**: the writer sends a fixed count back to back, readers consume as fast
  as they can; time from the first send until the slowest reader has the last record
  (median over rounds), as steps/s and, for arrays, MiB/s per reader.

Ratios: ringwire ÷ ZeroMQ (latency: below 1 is ringwire faster; throughput: above 1
is ringwire faster), local readers with a remote reader attached ÷ without (targets:
ringwire ≤ 1.0× ZeroMQ's step latency p50; with ÷ without ≤ 1.1× p50), and (info)
local readers with a remote reader ÷ with a third local reader (the control).

Clean-up: children die with this process (``PR_SET_PDEATHSIG``), are told to stop,
then killed if still alive and reaped, in a ``finally``; the Unix paths live in a
temporary directory that is removed; TCP ports are chosen by the kernel (port 0).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import ipaddress
import os
import random
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
    die_with_parent,
    format_table,
    format_targets,
    machine_info,
    spawn_readers,
    started_peers,
    summarize,
)
from perf._common import write_report as write_json

clock = time.perf_counter_ns
MiB = 1 << 20
ARRAY_BYTES = 4 * MiB
STRIDE = 64 * 1024  # a reader reads one byte every 64 KiB of an array: 64 bytes
FILL = 7
T_VS_ZMQ = 1.0  # the targets: ringwire step latency p50 ÷ ZeroMQ's
T_WITH_REMOTE = 1.1  # local readers' step latency p50, with a remote reader ÷ without
ANSWER_S = 120.0  # how long the writer waits for a reader's answer


class Step(msgspec.Struct, array_like=True):
    """A ~100-byte step record; ``data``: the array (ringwire) or, for ZeroMQ, the
    array's ``(dtype, shape)`` (its bytes are the message's second frame)."""

    seq: int
    t: int  # the writer's clock at send
    tokens: list[int]
    model: str
    data: Any = None


ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder(Step)
TOKENS = [1000 + 7 * i for i in range(20)]
MODEL = "llama-3.1-8b-instruct"
WARMUP_SEQ = -1  # ZeroMQ's slow-joiner records


# ======================================================================================
# readers (children)
# ======================================================================================


def _touch(arr: Any) -> None:
    """Read 64 bytes spread over the array and check them: it did arrive."""
    probe = arr[::STRIDE]
    if int(probe.sum()) != FILL * len(probe):
        raise RuntimeError(f"reader {os.getpid()}: the array's bytes are wrong")


def _serve(ctrl: Any, recv: Callable[[], Step]) -> None:
    """The reader side: ``("lat", n)`` -> per-step latencies (ns, by seq), ``("tput",
    n)`` -> the clock when the n-th record was in, ``("stop",)``.  Records with a
    negative seq (ZeroMQ's warm-ups) are skipped."""
    ctrl.send(("ready", os.getpid()))
    while True:
        cmd = ctrl.recv()
        if cmd[0] == "stop":
            return
        n = cmd[1]
        ctrl.send(("armed",))
        got = 0
        if cmd[0] == "lat":
            lat = array("q", bytes(8 * n))
            while got < n:
                rec = recv()
                if rec.seq < 0:
                    continue
                if rec.data is not None:
                    _touch(rec.data)
                lat[rec.seq] = clock() - rec.t
                got += 1
                del rec  # a slot's view dies here: the writer gets the slot back
            ctrl.send(("lat", lat.tobytes()))
        else:
            while got < n:
                rec = recv()
                if rec.seq < 0:
                    continue
                if rec.data is not None:
                    _touch(rec.data)
                got += 1
                del rec
            ctrl.send(("tput", clock()))


def reader_ringwire(ctrl: Any, addr: str, rank: int) -> None:  # pragma: no cover - child
    die_with_parent()
    import ringwire

    with ringwire.subscribe_sync(addr, rank=rank, type=Step, handshake_timeout=60) as sub:
        _serve(ctrl, lambda: sub.receive(timeout=ANSWER_S))


def reader_zmq(ctrl: Any, addr: str) -> None:  # pragma: no cover - child
    die_with_parent()
    import numpy as np
    import zmq

    zctx = zmq.Context()
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 0)
    if addr.startswith("tcp://["):
        sub.setsockopt(zmq.IPV6, 1)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(addr)

    def recv() -> Step:
        rec = DEC.decode(sub.recv())
        if sub.rcvmore:
            body = sub.recv(copy=False)
            dtype, shape = rec.data
            rec.data = np.frombuffer(body.buffer, dtype).reshape(shape)
        return rec

    try:
        while recv().seq != WARMUP_SEQ:  # subscribed: the writer's warm-ups reach us
            pass
        _serve(ctrl, recv)
    finally:
        sub.close(0)
        zctx.term()


# ======================================================================================
# peers (the writer's side)
# ======================================================================================


@dataclass
class Peer:
    key: str
    name: str
    send: Callable[[int, Any], None]  # (seq, array or None)
    ctrls: list[Any]
    procs: list[Any]
    local: list[int]  # indices (into ctrls) of the local readers compared across peers
    remote: list[int]  # ... and of the remote one(s)
    close: Callable[[], None]
    ready: Callable[[], None] = lambda: None  # every reader subscribed
    third: list[int] = field(default_factory=list)  # the control's third local reader
    where: str = ""  # the writer's TCP address, where it has one
    lat: dict[str, list[int]] = field(default_factory=dict)  # "small/all" -> ns per step
    tput: dict[str, list[float]] = field(default_factory=dict)  # "array/local" -> s per round


def _host_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _answer(peer: Peer, i: int, what: str, timeout: float = ANSWER_S) -> Any:
    """Reader ``i``'s next answer, which must be ``what``; a dead or silent reader is
    an error naming the peer, the reader and what was awaited."""
    c = peer.ctrls[i]
    role = "remote" if i in peer.remote else "local"
    try:
        if not c.poll(timeout):
            raise RuntimeError(
                f"{peer.name}: {role} reader {i} sent no {what!r} in {timeout:.0f} s"
            )
        msg = c.recv()
    except (EOFError, OSError) as exc:
        code = peer.procs[i].exitcode
        raise RuntimeError(
            f"{peer.name}: {role} reader {i} is gone (exit code {code}) before {what!r}"
        ) from exc
    if msg[0] != what:
        raise RuntimeError(f"{peer.name}: {role} reader {i} answered {msg[0]!r}, not {what!r}")
    return msg


def _slots() -> Any:
    import ringwire

    # room for 8 arrays in flight (the ring itself is the default)
    return ringwire.SlotConfig(classes=(ringwire.SlotClass(ARRAY_BYTES, 8),))


def peer_ringwire(tmp: str, host: str, remote: bool, n_local: int = 2) -> Peer:
    """2 local + 1 remote reader (``remote``), or ``n_local`` local readers (2: the
    baseline, 3: the control)."""
    import ringwire

    key = "rw_remote" if remote else ("rw_local" if n_local == 2 else f"rw_local{n_local}")
    path = os.path.join(tmp, f"{key}.sock")
    n = 3 if remote else n_local
    kw: dict[str, Any] = {}
    if remote:
        kw["tcp"] = f"tcp://{_host_url(host)}:0"
        if not _is_loopback(host):
            kw["insecure"] = True  # a benchmark on a private network, no CURVE keys
    try:
        bc = ringwire.broadcast_sync(path, readers=n, slots=_slots(), **kw)
    except TypeError as exc:
        if remote:  # this ringwire predates remote broadcast readers
            raise ImportError(f"ringwire.broadcast_sync has no tcp= ({exc})") from exc
        raise
    try:
        addrs: list[tuple[Any, int]] = [(path, rank) for rank in range(n)]
        if remote:
            addrs[2] = (bc.tcp_address, 2)
        ctrls, procs = spawn_readers(reader_ringwire, addrs)
    except BaseException:
        bc.close()
        raise

    def send(seq: int, arr: Any) -> None:
        bc.send(Step(seq, clock(), TOKENS, MODEL, arr), timeout=60)

    if remote:
        name = "ringwire, 2 local + 1 remote"
    elif n == 2:
        name = "ringwire, 2 local (no remote)"
    else:
        name = f"ringwire, {n} local (no remote)"
    peer = Peer(key, name, send, ctrls, procs, [0, 1], [2] if remote else [], bc.close)
    peer.third = list(range(2, n)) if not remote else []
    peer.where = (bc.tcp_address or "") if remote else ""

    def ready() -> None:
        for i in range(n):
            _answer(peer, i, "ready", 90)
        bc.wait_ready(n, timeout=60)

    peer.ready = ready
    return peer


def peer_zmq(tmp: str, host: str) -> Peer:
    import zmq

    ipc = f"ipc://{tmp}/pub.ipc"
    zctx = zmq.Context()
    pub = zctx.socket(zmq.PUB)
    try:
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 0)
        if ":" in host:
            pub.setsockopt(zmq.IPV6, 1)
        pub.bind(ipc)
        pub.bind(f"tcp://{_host_url(host)}:*")
        tcp = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        ctrls, procs = spawn_readers(reader_zmq, [(ipc,), (ipc,), (tcp,)])
    except BaseException:
        pub.close(0)
        zctx.term()
        raise

    def send(seq: int, arr: Any) -> None:
        if arr is None:
            pub.send(ENC.encode(Step(seq, clock(), TOKENS, MODEL)))
        else:
            head = ENC.encode(Step(seq, clock(), TOKENS, MODEL, (arr.dtype.str, arr.shape)))
            pub.send_multipart([head, memoryview(arr)], copy=False)

    def close() -> None:
        pub.close(0)
        zctx.term()

    peer = Peer(
        "zmq", "ZeroMQ PUB/SUB, 2 ipc:// + 1 tcp://", send, ctrls, procs, [0, 1], [2], close
    )
    peer.where = tcp

    def ready(timeout: float = 90) -> None:
        """PUB/SUB's slow joiner: publish warm-ups until every reader has had one."""
        deadline = time.monotonic() + timeout
        pending = set(range(len(ctrls)))
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{peer.name}: readers {sorted(pending)} never got a warm-up")
            send(WARMUP_SEQ, None)
            for i in list(pending):
                if ctrls[i].poll(0.01):
                    _answer(peer, i, "ready", 0)
                    pending.discard(i)

    peer.ready = ready
    return peer


# ======================================================================================
# the run
# ======================================================================================


@dataclass
class Config:
    rounds: int
    small_steps: int  # measured paced steps per peer per round, small records
    array_steps: int  # ... 4 MiB arrays
    warmup: int  # dropped steps at the start of every latency round (arrays: a third)
    small_count: int  # back-to-back records per throughput round
    array_count: int
    small_gap_s: float = 0.002  # pacing: gap * (1 + U[0, 0.5))
    array_gap_s: float = 0.020


QUICK = Config(
    rounds=5, small_steps=120, array_steps=24, warmup=12, small_count=2000, array_count=16
)
FULL = Config(
    rounds=14, small_steps=250, array_steps=50, warmup=15, small_count=4000, array_count=32
)


def _cmd(peer: Peer, cmd: tuple[Any, ...]) -> None:
    for i, c in enumerate(peer.ctrls):
        try:
            c.send(cmd)
        except OSError as exc:
            role = "remote" if i in peer.remote else "local"
            raise RuntimeError(
                f"{peer.name}: {role} reader {i} is gone (exit code {peer.procs[i].exitcode}) "
                f"before {cmd[0]!r}"
            ) from exc
    for i in range(len(peer.ctrls)):
        _answer(peer, i, "armed", 60)


def run_lat(
    peer: Peer, kind: str, arr: Any, warm: int, n: int, gap_s: float, rng: random.Random
) -> None:
    total = warm + n
    _cmd(peer, ("lat", total))
    gc.disable()
    try:
        for seq in range(total):
            peer.send(seq, arr)
            time.sleep(gap_s * (1 + rng.random() / 2))
    finally:
        gc.enable()
    cols = [array("q", _answer(peer, i, "lat")[1]) for i in range(len(peer.ctrls))]
    groups = {
        "all": list(range(len(cols))),
        "local": peer.local,
        "remote": peer.remote,
        "third": peer.third,
    }
    for role, idx in groups.items():
        if not idx:
            continue
        out = peer.lat.setdefault(f"{kind}/{role}", [])
        out.extend(max(cols[i][seq] for i in idx) for seq in range(warm, total))


def run_tput(peer: Peer, kind: str, arr: Any, n: int, record: bool = True) -> None:
    _cmd(peer, ("tput", n))
    gc.disable()
    try:
        t0 = clock()
        for seq in range(n):
            peer.send(seq, arr)
    finally:
        gc.enable()
    ends = [_answer(peer, i, "tput")[1] for i in range(len(peer.ctrls))]
    if not record:
        return
    groups = {
        "all": list(range(len(ends))),
        "local": peer.local,
        "remote": peer.remote,
        "third": peer.third,
    }
    for role, idx in groups.items():
        if idx:
            peer.tput.setdefault(f"{kind}/{role}", []).append(
                (max(ends[i] for i in idx) - t0) / 1e9
            )


@contextlib.contextmanager
def _peers(tmp: str, host: str, skipped: dict[str, str]) -> Iterator[list[Peer]]:
    makers: list[tuple[str, Callable[[], Peer]]] = [
        ("rw_remote", lambda: peer_ringwire(tmp, host, True)),
        ("zmq", lambda: peer_zmq(tmp, host)),
        ("rw_local", lambda: peer_ringwire(tmp, host, False)),
        ("rw_local3", lambda: peer_ringwire(tmp, host, False, 3)),
    ]
    with started_peers(makers, None, close_first=True, skipped=skipped) as peers:
        yield peers


def _pct_us(samples: list[int], q: float) -> float:
    if not samples:
        return float("nan")
    st = summarize(samples)
    return (st.median_ns if q == 0.5 else st.p99_ns) / 1e3


def _results(peers: list[Peer], cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in peers:
        r: dict[str, Any] = {"name": p.name, "where": p.where}
        for key, v in p.lat.items():
            r[f"lat/{key}"] = {"p50_us": _pct_us(v, 0.5), "p99_us": _pct_us(v, 0.99), "n": len(v)}
        for key, secs in p.tput.items():
            count = cfg.small_count if key.startswith("small") else cfg.array_count
            med = statistics.median(secs)
            r[f"tput/{key}"] = {
                "median_s": med,
                "steps_per_s": count / med,
                "mib_per_s": count * ARRAY_BYTES / MiB / med if key.startswith("array") else None,
                "rounds": len(secs),
            }
        out[p.key] = r
    return out


def _get(res: dict[str, Any], peer: str, key: str, field_: str) -> float:
    v = res.get(peer, {}).get(key)
    return float(v[field_]) if v and v.get(field_) is not None else float("nan")


def _x(r: float) -> str:
    return "n/a" if r != r else f"{r:.2f}×"


def _f(v: float, unit: str) -> str:
    if v != v:
        return "n/a"
    if unit == "us":
        return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _overlaps(res: dict[str, Any], cfg: Config) -> list[str]:
    """A warning for each latency p50 longer than the pacing's shortest gap: its steps
    overlapped, so the figure includes queueing behind the step before."""
    out = []
    for r in res.values():
        for kind, gap in (("small", cfg.small_gap_s), ("array", cfg.array_gap_s)):
            p50 = r.get(f"lat/{kind}/all", {}).get("p50_us", float("nan"))
            if p50 > gap * 1e6:
                out.append(
                    f"warning: {r['name']}, {kind} steps: p50 {p50:,.0f} µs > the {gap * 1e3:g} ms "
                    "gap between steps -- they overlapped, the latency includes queueing"
                )
    return out


def _status(ratio: float, limit: float | None) -> str:
    """``met`` / ``missed`` against ``limit`` (``None``: ``info``); NaN: not measured."""
    if ratio != ratio:
        return "not measured"
    if limit is None:
        return "info"
    return "met" if ratio <= limit else "missed"


def report(res: dict[str, Any]) -> tuple[dict[str, str], list[dict[str, Any]]]:
    tables: dict[str, str] = {}
    targets: list[dict[str, Any]] = []
    rw, zq, loc, loc3 = "rw_remote", "zmq", "rw_local", "rw_local3"

    # 1: ringwire (2 local + 1 remote) against ZeroMQ (2 ipc + 1 tcp)
    rows = []
    for kind, label in (("small", "~100 B record"), ("array", "4 MiB array")):
        for q in ("p50", "p99"):
            a = _get(res, rw, f"lat/{kind}/all", f"{q}_us")
            b = _get(res, zq, f"lat/{kind}/all", f"{q}_us")
            rows.append([f"step latency {q}, {label} (µs)", _f(a, "us"), _f(b, "us"), _x(a / b)])
            targets.append(
                {
                    "target": f"{label}: ringwire step latency {q} ≤ {T_VS_ZMQ}× ZeroMQ's"
                    + ("" if q == "p50" else " (info)"),
                    "value": a / b,
                    "shown": _x(a / b),
                    "status": _status(a / b, T_VS_ZMQ if q == "p50" else None),
                }
            )
    for kind, label in (("small", "~100 B records"), ("array", "4 MiB arrays")):
        a = _get(res, rw, f"tput/{kind}/all", "steps_per_s")
        b = _get(res, zq, f"tput/{kind}/all", "steps_per_s")
        rows.append([f"throughput, {label} (steps/s)", _f(a, ""), _f(b, ""), _x(a / b)])
        if kind == "array":
            a = _get(res, rw, f"tput/{kind}/all", "mib_per_s")
            b = _get(res, zq, f"tput/{kind}/all", "mib_per_s")
            rows.append(
                [f"throughput, {label} (MiB/s per reader)", _f(a, ""), _f(b, ""), _x(a / b)]
            )
        targets.append(
            {
                "target": f"(info) throughput, {label}: ringwire ÷ ZeroMQ steps/s (> 1: ringwire faster)",
                "value": a / b,
                "shown": _x(a / b),
                "status": _status(a / b, None),
            }
        )
    tables["ringwire vs ZeroMQ"] = format_table(
        [
            "measurement (slowest of the 3 readers)",
            "ringwire 2 local + 1 remote",
            "ZeroMQ 2 ipc + 1 tcp",
            "ringwire ÷ ZeroMQ",
        ],
        rows,
        "lrrr",
    )

    # 2: what a remote reader costs the local readers -- and what a third local reader
    # process costs them (the control: CPU contention, whatever the transport)
    rows = []
    for kind, label in (("small", "~100 B record"), ("array", "4 MiB array")):
        for q in ("p50", "p99"):
            a = _get(res, rw, f"lat/{kind}/local", f"{q}_us")
            b = _get(res, loc, f"lat/{kind}/local", f"{q}_us")
            c = _get(res, loc3, f"lat/{kind}/local", f"{q}_us")
            rows.append(
                [
                    f"step latency {q}, {label} (µs)",
                    _f(a, "us"),
                    _f(b, "us"),
                    _f(c, "us"),
                    _x(a / b),
                    _x(a / c),
                ]
            )
            targets.append(
                {
                    "target": f"{label}: local readers' step latency {q}, with a remote reader "
                    f"÷ without ≤ {T_WITH_REMOTE}×" + ("" if q == "p50" else " (info)"),
                    "value": a / b,
                    "shown": _x(a / b),
                    "status": _status(a / b, T_WITH_REMOTE if q == "p50" else None),
                }
            )
            if q == "p50":
                targets.append(
                    {
                        "target": f"(info) {label}: local readers' step latency p50, with a "
                        "remote reader ÷ with a third local reader (the control)",
                        "value": a / c,
                        "shown": _x(a / c),
                        "status": _status(a / c, None),
                    }
                )
    for kind, label in (("small", "~100 B records"), ("array", "4 MiB arrays")):
        a = _get(res, rw, f"tput/{kind}/local", "steps_per_s")
        b = _get(res, loc, f"tput/{kind}/local", "steps_per_s")
        c = _get(res, loc3, f"tput/{kind}/local", "steps_per_s")
        rows.append(
            [
                f"throughput, {label} (steps/s)",
                _f(a, ""),
                _f(b, ""),
                _f(c, ""),
                _x(a / b),
                _x(a / c),
            ]
        )
    tables["local readers with vs without a remote reader"] = format_table(
        [
            "measurement (slowest of local readers 0 and 1)",
            "with a remote reader",
            "without (2 local)",
            "with a 3rd local reader",
            "with remote ÷ without",
            "with remote ÷ with 3rd local",
        ],
        rows,
        "lrrrrr",
    )

    # 3: by reader: the slowest local reader and the remote reader, p50
    rows = []
    for peer in (rw, zq, loc, loc3):
        if peer not in res:
            continue
        row = [res[peer]["name"]]
        for kind in ("small", "array"):
            for role in ("local", "remote"):
                if peer == loc3 and role == "remote":
                    role = "third"
                row.append(_f(_get(res, peer, f"lat/{kind}/{role}", "p50_us"), "us"))
        rows.append(row)
    tables["by reader"] = format_table(
        [
            "peer (step latency p50, µs)",
            "100 B: slowest of locals 0, 1",
            "100 B: remote (or 3rd local)",
            "4 MiB: slowest of locals 0, 1",
            "4 MiB: remote (or 3rd local)",
        ],
        rows,
        "lrrrr",
    )
    return tables, targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short run (~30 s)")
    ap.add_argument("--tcp-host", default="127.0.0.1", help="the TCP address's host (127.0.0.1)")
    ap.add_argument("--json", type=Path, help="also write the results as JSON")
    args = ap.parse_args(argv)
    # the remote rows say "ZeroMQ frames": keep NIXL out where nixl-cu12 is installed
    os.environ.setdefault("RINGWIRE_NIXL", "0")
    try:
        import numpy as np
        import zmq  # noqa: F401
    except ImportError as exc:
        print(f"perf.broadcast_remote needs numpy and pyzmq ({exc})", file=sys.stderr)
        return 2
    mode = "quick" if args.quick else "full"
    cfg = QUICK if args.quick else FULL
    rng = random.Random(1)
    arr = np.full(ARRAY_BYTES, FILL, np.uint8)
    skipped: dict[str, str] = {}
    load0 = os.getloadavg()
    t_start = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="rwperf-bremote-")
    print(f"# broadcast, 2 local + 1 remote reader ({mode})", file=sys.stderr)
    try:
        with _peers(tmp, args.tcp_host, skipped) as peers:
            if not peers:
                raise RuntimeError("no peer could be started")
            for p in peers:
                p.ready()
            print(f"  readers up ({time.monotonic() - t_start:.0f} s)", file=sys.stderr)
            for p in peers:  # warm-up, not recorded
                run_lat(p, "small", None, 0, 20, cfg.small_gap_s, rng)
                run_tput(p, "array", arr, 4, record=False)
                p.lat.clear()
            for r in range(cfg.rounds):
                order = [peers[(r + j) % len(peers)] for j in range(len(peers))]
                for p in order:
                    run_lat(p, "small", None, cfg.warmup, cfg.small_steps, cfg.small_gap_s, rng)
                for p in order:
                    run_lat(p, "array", arr, cfg.warmup // 3, cfg.array_steps, cfg.array_gap_s, rng)
                for p in order:
                    run_tput(p, "small", None, cfg.small_count)
                for p in order:
                    run_tput(p, "array", arr, cfg.array_count)
                print(
                    f"  round {r + 1}/{cfg.rounds} ({time.monotonic() - t_start:.0f} s)",
                    file=sys.stderr,
                )
            res = _results(peers, cfg)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.monotonic() - t_start
    load1 = os.getloadavg()
    tables, targets = report(res)
    info = machine_info(["ringwire", "numpy", "msgspec", "zmq"])
    where = [
        f"{res[k]['name'].split(',')[0]} at {res[k]['where']}"
        for k in ("rw_remote", "zmq")
        if res.get(k, {}).get("where")
    ]
    print(
        f"\nperf.broadcast_remote ({mode}, {seconds:.0f} s): 2 local readers + 1 remote reader "
        f"(TCP: {'; '.join(where) or args.tcp_host}), and 2 or 3 local readers only; "
        f"every reader a process on this host.  CPU: {info['cpu']}, {info['cpus_usable']} "
        f"usable cores; Python {info['python']}, pyzmq {info['zmq']}; load average "
        f"{load0[0]:.2f} at start, {load1[0]:.2f} at end.  Step latency = writer send -> "
        f"the slowest reader has decoded the record (and read 64 bytes of its array); "
        f"throughput = back to back, until the slowest reader has the last one."
    )
    for title, table in tables.items():
        print(f"\n### {title}\n")
        print(table)
    print("\n### Targets\n")
    print(format_targets(targets))
    notes = _overlaps(res, cfg)
    for key, why in skipped.items():
        notes.append(f"not measured: {key} ({why})")
    for note in notes:
        print(f"\n{note}")
    print("\n(compare ratios within one run: absolute µs move with the machine's load)")
    if args.json:
        write_json(
            args.json,
            "broadcast_remote",
            mode,
            seconds,
            (load0, load1),
            info,
            res,
            targets,
            config=cfg.__dict__,
            tcp_host=args.tcp_host,
            skipped=skipped,
            notes=notes,
            tables=tables,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
