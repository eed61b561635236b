"""Profile ringwire's async round trip (or the listener fan-in) with py-spy.

Run from the repository root::

    python -m perf.profile_rt                    # parked RT, 20 s under py-spy, top table
    python -m perf.profile_rt --case fanin       # Listener fan-in consumer, 4 producers
    python -m perf.profile_rt --seconds 30 --out perf/results/profile
    python -m perf.profile_rt --worker           # just the workload, no profiler

The workload is the row the targets judge: ``ringwire.pair()`` async endpoints with
``spin_us=0`` (every message parks and rings), the 100-byte :class:`perf.peers.Req`
record, parent sends / child echoes / parent receives, back to back, for ``--seconds``.
``--case fanin``: an async :func:`ringwire.listen` consumer doing ``async for conn,
record in listener`` over 4 blocking producers that ``send`` as fast as they can.

``py-spy record --subprocesses --format raw`` samples every process of the tree
(``--rate`` Hz, default 997); the collapsed stacks are written to ``--out`` and
summarised per process: the share of *active* samples (py-spy's default drops idle
ones: a parked endpoint sleeping in ``epoll_wait`` is not counted) spent in each
function itself ("self") and below it ("total"), with ringwire's own functions
listed separately.  ``--svg`` also writes py-spy's flame graph.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf import peers as P
from perf._common import format_table

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- CPU breakdown

# (label, module, class, method): what --breakdown times with the thread CPU clock.
# Nested entries are inclusive (_try_send includes _ring when it rings).
BREAKDOWN = (
    (
        "send: encode + slot bookkeeping (_encode_placed)",
        "ringwire._conn.channel",
        "_ChannelBase",
        "_encode_placed",
    ),
    (
        "send: slot safe point (_slot_safe_point)",
        "ringwire._conn.channel",
        "_ChannelBase",
        "_slot_safe_point",
    ),
    (
        "send: ring write, incl. doorbell (_try_send)",
        "ringwire._conn.channel",
        "_ChannelBase",
        "_try_send",
    ),
    ("doorbell: socket.send (_ring)", "ringwire._conn.channel", "_ChannelBase", "_ring"),
    (
        "receive: ring read + decode (_try_receive)",
        "ringwire._conn.channel",
        "_ChannelBase",
        "_try_receive",
    ),
    (
        "receive: park, future (_wake_waitable)",
        "ringwire._conn.channel",
        "Channel",
        "_wake_waitable",
    ),
    (
        "wake: reader callback (_aio_on_readable)",
        "ringwire._conn.channel",
        "Channel",
        "_aio_on_readable",
    ),
    ("wake: socket.recv of doorbells (_drain)", "ringwire._conn.channel", "_ChannelBase", "_drain"),
    ("event loop: epoll_wait (EpollSelector.select)", "selectors", "EpollSelector", "select"),
)


def instrument() -> dict[str, list[int]]:
    """Wrap the BREAKDOWN methods; returns {label: [calls, thread CPU ns]}."""
    import importlib

    tt = time.thread_time_ns
    acc: dict[str, list[int]] = {}
    for label, mod, cls_name, meth in BREAKDOWN:
        try:
            cls = getattr(importlib.import_module(mod), cls_name)
            orig = cls.__dict__[meth]
        except (ImportError, AttributeError, KeyError):
            continue
        a = acc[label] = [0, 0]
        if meth == "_try_receive":  # split: found nothing (a probe) / read a record
            empty = acc["receive: ... of which empty probes"] = [0, 0]
            sentinel = importlib.import_module(mod)._EMPTY

            def wrap_rx(
                *args: Any,
                _o: Any = orig,
                _a: list[int] = a,
                _e: list[int] = empty,
                _s: Any = sentinel,
                **kw: Any,
            ) -> Any:
                t0 = tt()
                r = _o(*args, **kw)
                dt = tt() - t0
                _a[0] += 1
                _a[1] += dt
                if r is _s:
                    _e[0] += 1
                    _e[1] += dt
                return r

            setattr(cls, meth, wrap_rx)
            continue

        def wrap(*args: Any, _o: Any = orig, _a: list[int] = a, **kw: Any) -> Any:
            t0 = tt()
            try:
                return _o(*args, **kw)
            finally:
                _a[0] += 1
                _a[1] += tt() - t0

        setattr(cls, meth, wrap)
    return acc


def clock_overhead_ns() -> float:
    """What one wrapped call adds: two thread_time_ns reads and the wrapper."""
    tt = time.thread_time_ns
    n = 20000
    t0 = tt()
    for _ in range(n):
        tt()
        tt()
    return (tt() - t0) / n


def breakdown_table(acc: dict[str, list[int]], rts: int, cpu_ns: int, overhead: float) -> str:
    rows = []
    for label, (calls, ns) in acc.items():
        if not calls:
            continue
        net = max(0.0, ns - calls * overhead)
        rows.append(
            [
                label,
                f"{calls / rts:.2f}",
                f"{net / calls / 1000:.2f}",
                f"{net / rts / 1000:.2f}",
                f"{100 * net / cpu_ns:.1f} %",
            ]
        )
    rows.append(
        ["whole process (time.process_time)", "—", "—", f"{cpu_ns / rts / 1000:.2f}", "100 %"]
    )
    return format_table(
        ["operation (inclusive)", "calls per RT", "CPU µs per call", "CPU µs per RT", "share"],
        rows,
        "lrrrr",
    )


# --------------------------------------------------------------------------- workloads


def _rt_child(ctrl: Any, end: Any, seconds: float, breakdown: bool = False) -> None:
    acc = instrument() if breakdown else {}
    counts = {"rts": 0, "cpu_ns": 0}

    async def main() -> None:
        chan = await end.connect(type=P.Req, spin_us=0.0)
        ctrl.send(("ready", None))
        recv, send = chan.receive, chan.send
        c0 = time.process_time_ns()
        n = 0
        try:
            while True:
                await send(await recv())
                n += 1
        except Exception:
            pass
        finally:
            counts.update(rts=n, cpu_ns=time.process_time_ns() - c0)
            await chan.aclose()

    asyncio.run(main())
    if breakdown:
        ctrl.send(("breakdown", {"acc": acc, **counts, "overhead": clock_overhead_ns()}))


def run_rt(seconds: float, loop_kind: str, breakdown: bool = False) -> dict[str, Any]:
    acc = instrument() if breakdown else {}
    ctx = mp.get_context("spawn")
    a, b = P.rw_pair()
    pe, ce = ctx.Pipe()
    proc = ctx.Process(
        target=P.child_entry, args=(_rt_child, ce, b, seconds, breakdown), daemon=True
    )
    proc.start()
    ce.close()
    out: dict[str, Any] = {}

    async def main() -> None:
        chan = await a.connect(type=P.Req, spin_us=0.0, handshake_timeout=P.SETUP_TIMEOUT_S)
        try:
            if not pe.poll(P.SETUP_TIMEOUT_S):
                raise RuntimeError("child did not start")
            pe.recv()
            rec = P.make_record()
            send, recv = chan.send, chan.receive
            n = 0
            for _ in range(500):  # warm-up, not counted
                await send(rec)
                await recv()
            for v in acc.values():
                v[0] = v[1] = 0
            t_end = time.monotonic() + seconds
            t0 = time.perf_counter_ns()
            c0 = time.process_time_ns()
            while time.monotonic() < t_end:
                for _ in range(200):
                    rec.seq = n
                    await send(rec)
                    await recv()
                    n += 1
            out["cpu_ns"] = time.process_time_ns() - c0
            out["round_trips"] = n
            out["us_per_rt"] = (time.perf_counter_ns() - t0) / n / 1000
            out["stats"] = P.rw_stats(chan)
        finally:
            await chan.aclose()

    try:
        loop = P.new_loop(loop_kind)
        try:
            loop.run_until_complete(main())
        finally:
            P.close_loop(loop)
        if breakdown:
            over = clock_overhead_ns()
            out["breakdown_parent"] = breakdown_table(acc, out["round_trips"], out["cpu_ns"], over)
            if pe.poll(10):
                tag, d = pe.recv()
                if tag == "breakdown":
                    # the child's loop also served the 500 warm-up round trips
                    out["breakdown_child"] = breakdown_table(
                        d["acc"], max(1, d["rts"]), d["cpu_ns"], d["overhead"]
                    )
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(2)
        pe.close()
    return out


def _fan_producer(ctrl: Any, path: str) -> None:
    import ringwire

    chan = ringwire.connect_sync(path, type=P.Req, handshake_timeout=P.SETUP_TIMEOUT_S, slots=None)
    ctrl.send(("ready", None))
    recs = [P.make_record(i) for i in range(P.BATCH)]
    try:
        i = 0
        while not ctrl.poll(0):
            for _ in range(256):
                chan.send(recs[i % P.BATCH], 5.0)
                i += 1
    except Exception:
        pass
    finally:
        chan.close()


def run_fanin(seconds: float, loop_kind: str, producers: int = 4) -> dict[str, Any]:
    import tempfile

    import anyio

    import ringwire

    ctx = mp.get_context("spawn")
    d = tempfile.mkdtemp(prefix="rwperf-")
    path = os.path.join(d, "rw.sock")
    out: dict[str, Any] = {}
    kids: list[tuple[Any, Any]] = []

    async def main() -> None:
        async with ringwire.listen(path, type=P.Req, slots=None) as lst:
            for _ in range(producers):
                pe, ce = ctx.Pipe()
                p = ctx.Process(target=P.child_entry, args=(_fan_producer, ce, path), daemon=True)
                p.start()
                ce.close()
                kids.append((p, pe))
            with anyio.fail_after(P.SETUP_TIMEOUT_S):
                for _ in range(producers):
                    await lst.accept()
            n = 0
            t_end = time.monotonic() + seconds
            t0 = time.perf_counter_ns()
            recv = lst.receive
            while time.monotonic() < t_end:
                for _ in range(1000):
                    await recv()
                n += 1000
            out["records"] = n
            out["records_per_s"] = n / ((time.perf_counter_ns() - t0) / 1e9)
            tot: dict[str, int] = {}
            for c in lst.connections:
                for key, v in P.rw_stats(c).items():
                    tot[key] = tot.get(key, 0) + v
            out["consumer_stats"] = tot
            for _, pe in kids:
                pe.send(None)

    try:
        loop = P.new_loop(loop_kind)
        try:
            loop.run_until_complete(main())
        finally:
            P.close_loop(loop)
    finally:
        for p, pe in kids:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(2)
            pe.close()
        shutil.rmtree(d, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- py-spy output


def summarize(raw: Path, top: int = 25) -> str:
    """Per process: self and total share of active samples per function."""
    per_proc: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    nsamp: collections.Counter[str] = collections.Counter()
    for line in raw.read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        # --subprocesses: the stack starts with 'process <pid>:"<command line>"' for the
        # process and each of its ancestors (the command line may contain ';')
        m = _PROC_PREFIX.match(stack)
        proc = "main"
        if m:
            pids = _PROC_ONE.findall(m.group(0))
            proc = f"pid {pids[-1][0]}" + (" (child)" if len(pids) > 1 else " (parent)")
            stack = stack[m.end() :]
        frames = [f for f in stack.split(";") if f and not f.startswith("thread ")]
        if not frames:
            continue
        nsamp[proc] += c
        per_proc[proc][_fn(frames[-1])] += c
        for f in set(map(_fn, frames)):
            totals[proc][f] += c
    out: list[str] = []
    for proc in sorted(nsamp, key=lambda p: -nsamp[p]):
        n = nsamp[proc]
        out.append(f"#### {_short_proc(proc)}: {n} active samples\n")
        rows = []
        for fn, c in per_proc[proc].most_common(top):
            rows.append([fn, f"{100 * c / n:.1f} %", f"{100 * totals[proc][fn] / n:.1f} %"])
        out.append(format_table(["function (self)", "self", "total"], rows, "lrr"))
        out.append("")
        rw = [(fn, c) for fn, c in totals[proc].items() if "ringwire/" in fn]
        rw.sort(key=lambda x: -x[1])
        rows = [
            [fn, f"{100 * per_proc[proc][fn] / n:.1f} %", f"{100 * c / n:.1f} %"]
            for fn, c in rw[:top]
        ]
        out.append(format_table(["ringwire function", "self", "total"], rows, "lrr"))
        out.append("")
    return "\n".join(out)


def _fn(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)`` keeping the package dir."""
    name, _, loc = frame.partition(" (")
    loc = loc.rstrip(")")
    path = loc.rsplit(":", 1)[0]
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if len(parts) >= 2 else path
    return f"{name} ({short})" if loc else name


_PROC_ONE = re.compile(r'process (\d+):"([^"]*)"')
_PROC_PREFIX = re.compile(r'(?:process \d+:"[^"]*";?)+')


def _short_proc(proc: str) -> str:
    return "process" if proc == "main" else proc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=["rt", "fanin"], default="rt")
    ap.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rate", type=int, default=997, help="py-spy samples per second")
    ap.add_argument("--out", default=str(ROOT / "perf" / "results" / "profile"))
    ap.add_argument("--svg", action="store_true", help="also write a py-spy flame graph")
    ap.add_argument("--native", action="store_true", help="py-spy --native (C frames)")
    ap.add_argument("--worker", action="store_true", help="run the workload only")
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="rt: no py-spy; time ringwire's steps with the thread CPU clock in both processes",
    )
    args = ap.parse_args(argv)

    if args.breakdown:
        res = run_rt(args.seconds, args.loop, breakdown=True)
        print(
            f"{res['round_trips']} round trips, {res['us_per_rt']:.1f} µs each (wall), "
            f"{res['cpu_ns'] / res['round_trips'] / 1000:.1f} µs CPU per RT in the parent; "
            f"{res['stats']}\n"
        )
        print("parent (sends, then awaits the echo):\n")
        print(res.get("breakdown_parent", "(none)"))
        print("\nchild (awaits, echoes):\n")
        print(res.get("breakdown_child", "(none)"))
        return 0
    if args.worker:
        res = (run_rt if args.case == "rt" else run_fanin)(args.seconds, args.loop)
        print(res, flush=True)
        return 0

    spy = shutil.which("py-spy")
    if spy is None:
        print("py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    worker = [
        sys.executable,
        "-m",
        "perf.profile_rt",
        "--worker",
        "--case",
        args.case,
        "--loop",
        args.loop,
        "--seconds",
        str(args.seconds),
    ]
    raw = out / f"{args.case}-{args.loop}.txt"
    cmd = [spy, "record", "--subprocesses", "--rate", str(args.rate), "--format", "raw"]
    cmd += ["--nonblocking"] if not args.native else ["--native"]
    cmd += ["-o", str(raw), "--", *worker]
    print("$ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=ROOT, check=False)
    if r.returncode != 0 or not raw.exists():
        print(f"py-spy failed (exit {r.returncode})", file=sys.stderr)
        return 1
    if args.svg:
        svg = raw.with_suffix(".svg")
        subprocess.run(
            [
                spy,
                "record",
                "--subprocesses",
                "--rate",
                str(args.rate),
                "-o",
                str(svg),
                "--",
                *worker,
            ],
            cwd=ROOT,
            check=False,
        )
    text = summarize(raw)
    (out / f"{args.case}-{args.loop}.md").write_text(text + "\n", encoding="utf-8")
    print(text)
    print(f"raw stacks: {raw}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
