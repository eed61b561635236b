"""The C ring against the pure-Python ring, side by side, with issue 15's targets.

Run from the repository root (the C ring built: ``pip install -e .`` with gcc)::

    python -m perf.native --quick       # ~5 minutes on a 2-core VM
    python -m perf.native               # full runs of perf.transport and perf.slots
    python -m perf.native --from DIR    # rebuild the table from DIR's JSON, run nothing
    python -m perf.native --from DIR --plot   # and draw it: perf/figures/native_targets.png

It runs ``perf.transport`` and ``perf.slots`` once per path (``RINGWIRE_PURE=0`` and
``RINGWIRE_PURE=1``, in alternating order: native first for transport, pure first for
slots), each with its own peers in the same run, plus a sparse-load measurement of
its own (a consumer answering 100 requests/s, its CPU share), and prints one table:
each issue-15 target as a row, the ratio on each path, HIT or MISS.  The ratios are
ringwire ÷ the peer *of the same run*, so both paths are judged against peers measured
under the same machine load; the absolute figures are in each run's log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf._common import format_table, machine_info

PATHS = ("native", "pure")
SPARSE_RATE = 100  # requests per second
SPARSE_CPU_PCT = 3.0


def _run(module: str, path: str, out: Path, quick: bool) -> None:
    env = dict(os.environ, RINGWIRE_PURE="1" if path == "pure" else "0")
    cmd = [sys.executable, "-m", f"perf.{module}", "--json", str(out / f"{module}-{path}.json")]
    if quick:
        cmd.append("--quick")
    log = out / f"{module}-{path}.log"
    print(f"running {' '.join(cmd[1:])} [{path}] (log: {log})", flush=True)
    with open(log, "w", encoding="utf-8") as f:
        subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)


# -- the sparse-load measurement ---------------------------------------------------------


def _sparse_child(seconds: float, rate: int, path: str) -> None:  # pragma: no cover - child
    """Answer requests arriving at ``rate``/s for ``seconds``; print the consumer's CPU."""
    os.environ["RINGWIRE_PURE"] = "1" if path == "pure" else "0"
    import multiprocessing as mp

    import ringwire

    ctx = mp.get_context("spawn")
    a, b = ringwire.pair()
    q = ctx.Queue()
    p = ctx.Process(target=_echo_cpu, args=(b, q), daemon=True)
    p.start()
    with a.connect_sync() as ch:
        period = 1.0 / rate
        t0 = time.monotonic()
        n = 0
        while time.monotonic() - t0 < seconds:
            ch.send({"seq": n, "body": "x" * 80})
            ch.receive()
            n += 1
            time.sleep(max(0.0, t0 + n * period - time.monotonic()))
        ch.send("stop")
        cpu, wall, native = q.get(timeout=30)
    p.join(10)
    print(json.dumps({"cpu_pct": 100 * cpu / wall, "requests": n, "native": native}))


def _echo_cpu(end: Any, q: Any) -> None:  # pragma: no cover - grandchild
    import ringwire

    with end.connect_sync() as ch:
        t0, c0 = time.monotonic(), time.process_time()
        for x in ch:
            if x == "stop":
                break
            ch.send(x)
        q.put((time.process_time() - c0, time.monotonic() - t0, ringwire.native))


def _sparse(path: str, out: Path, seconds: float) -> None:
    print(f"running the sparse-load consumer ({SPARSE_RATE}/s, {seconds:g} s) [{path}]", flush=True)
    code = f"import perf.native as m; m._sparse_child({seconds}, {SPARSE_RATE}, {path!r})"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=seconds + 120
    )
    res: dict[str, Any] = {"error": proc.stderr[-2000:]} if proc.returncode else {}
    if not proc.returncode:
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    (out / f"sparse-{path}.json").write_text(json.dumps(res))


# -- the table ----------------------------------------------------------------------------


def _med(rows: dict[str, Any], prefix: str, key: str, four_k: bool = False) -> float | None:
    for name, v in rows.items():
        if name.startswith(prefix) and name.endswith(", 4 KiB") == four_k:
            return float(v[key])
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _targets(out: Path, path: str) -> list[tuple[str, float | None, float, str]]:
    """(target, value, limit, op) for one path."""
    try:
        t = json.loads((out / f"transport-{path}.json").read_text())["results"]
    except (OSError, KeyError, ValueError):
        t = {}
    hot, asy, tp = t.get("hot_rt", {}), t.get("async_rt", {}), t.get("throughput", {})
    rw_hot = _med(hot, "ringwire hot, blocking API", "median_ns")
    rw_async = _med(asy, "ringwire parked (spin_us=0) [asyncio]", "median_ns")
    floor = _med(asy, "asyncio pipe floor (add_reader, callback echo) [asyncio]", "median_ns")
    zmq = None
    for n, v in asy.items():
        if n.startswith("zmq") and n.endswith("[asyncio]") and ", 4 KiB" not in n:
            zmq = float(v["median_ns"])
            break
    sb = _med(tp, "ringwire sync send_many", "median_rps")
    ss = _med(tp, "ringwire sync send/receive", "median_rps")
    ffb = _med(tp, "faster-fifo put_many", "median_rps")
    codec = _med(tp, "codec", "median_rps")
    idle = t.get("idle", {})
    idle_pct = max((float(v["cpu_pct"]) for v in idle.values()), default=None)
    rows = [
        (
            "hot RT, 100 B, blocking: ≤ 0.7× posix_ipc semaphore ping-pong",
            _ratio(rw_hot, _med(hot, "posix_ipc semaphore ping-pong", "median_ns")),
            0.7,
            "<=",
        ),
        (
            "hot RT, 100 B, blocking: ≤ 10× busy-polled shared int",
            _ratio(rw_hot, _med(hot, "busy-poll", "median_ns")),
            10.0,
            "<=",
        ),
        (
            "async RT parked, asyncio: ≤ 1.5× socketpair add_reader floor",
            _ratio(rw_async, floor),
            1.5,
            "<=",
        ),
        ("async RT parked, asyncio: ≤ 0.3× zmq.asyncio", _ratio(rw_async, zmq), 0.3, "<="),
        ("batched 1→1, 100 B: ≥ 3× faster-fifo put_many/get_many", _ratio(sb, ffb), 3.0, ">="),
        (
            "batched 1→1, 100 B: ≥ 0.6× codec ceiling (encode + decode)",
            _ratio(sb, codec),
            0.6,
            ">=",
        ),
        ("per-record 1→1, 100 B: ≥ 1× faster-fifo batched", _ratio(ss, ffb), 1.0, ">="),
    ]
    try:
        s = json.loads((out / f"slots-{path}.json").read_text())
    except (OSError, ValueError):
        s = {}
    rows.append(("8 MiB copy-in: ≥ 0.85× one np.copyto of 8 MiB", _copy_ratio(s), 0.85, ">="))
    # where the copy-in's time goes (information, same limit): the slot memory itself
    # (tmpfs, 4 KiB pages) and the parked consumer's wake-up
    c8 = s.get("results", {}).get("copy_in", {}).get("8 MiB", {})
    rw8 = _one_way(c8, "ringwire copy-in")
    rows.append(
        (
            "(info) 8 MiB: np.copyto into a slot ÷ np.copyto (the slot memory)",
            _ratio(_one_way(c8, "memcpy np.copyto (floor)"), _one_way(c8, "memcpy into a slot")),
            0.85,
            ">=",
        )
    )
    rows.append(
        (
            "(info) 8 MiB: copy-in ÷ np.copyto into a slot (ringwire's own part)",
            _ratio(_one_way(c8, "memcpy into a slot"), rw8),
            0.85,
            ">=",
        )
    )
    rows.append(
        (
            "(info) 8 MiB: copy-in, consumer spinning ÷ np.copyto (no wake-up)",
            _ratio(_one_way(c8, "memcpy np.copyto (floor)"), _one_way(c8, "ringwire copy-in, sp")),
            0.85,
            ">=",
        )
    )
    rows.append(("idle consumer: 0 % of a core (≤ 0.1 %)", idle_pct, 0.1, "<="))
    try:
        sp = json.loads((out / f"sparse-{path}.json").read_text()).get("cpu_pct")
    except (OSError, ValueError):
        sp = None
    rows.append((f"consumer at {SPARSE_RATE} sparse requests/s: ≤ 3 % of a core", sp, 3.0, "<="))
    return rows


def _one_way(group: dict[str, Any], prefix: str) -> float | None:
    """The median one-way ns (a memcpy row: its copy) of the row named ``prefix...``."""
    for name, v in group.items():
        if name.startswith(prefix) and isinstance(v, dict):
            x = v.get("one_way_median_ns")
            return float(x) if x else None
    return None


def _copy_ratio(s: dict[str, Any]) -> float | None:
    """np.copyto time ÷ ringwire copy-in time at 8 MiB (higher is better)."""
    for t in s.get("targets", []):
        what = str(t.get("target", ""))
        if what.startswith("copy-in 8 MiB") and "memcpy" in what:
            v = t.get("value")
            return float(v) if v is not None else None
    return None


def _fmt(v: float | None, pct: bool) -> str:
    if v is None:
        return "—"
    return f"{v:.2f} %" if pct else (f"{v:.3f}×" if v < 1 else f"{v:.2f}×")


def table(out: Path) -> str:
    per = {p: _targets(out, p) for p in PATHS}
    rows = []
    for i, (what, _, limit, op) in enumerate(per["native"]):
        pct = "%" in what
        cells = [what]
        for p in PATHS:
            v = per[p][i][1]
            ok = None if v is None else (v <= limit if op == "<=" else v >= limit)
            cells += [_fmt(v, pct), "n/a" if ok is None else "HIT" if ok else "MISS"]
        rows.append(cells)
    return format_table(["target (issue 15)", "native", "", "pure", ""], rows, "lrlrl")


def plot(out: Path, path: Path) -> Path:
    """A bar per issue-15 target and path: how far each is from its target (the ratio
    to the limit, oriented so that right of 1 is a HIT), log scale.  Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    per = {p: _targets(out, p) for p in PATHS}
    names = [r[0] for r in per["native"]]
    fig, ax = plt.subplots(figsize=(10.5, 0.45 * len(names) + 1.6))
    for j, (p, colour) in enumerate(zip(PATHS, ("tab:green", "tab:gray"))):
        score = []
        for _, v, limit, op in per[p]:
            if v is None:
                score.append(float("nan"))
            elif "%" in _ and op == "<=":  # a CPU share: 0 % is "infinitely" good
                score.append(limit / max(v, limit / 100))
            else:
                score.append(limit / v if op == "<=" else v / limit)
        y = [i + (j - 0.5) * 0.38 for i in range(len(names))]
        ax.barh(y, score, height=0.36, color=colour, label="C ring" if p == "native" else p)
        for yi, sc in zip(y, score):
            if sc == sc:
                ax.text(sc, yi, f" {sc:.2f}", va="center", fontsize=6)
    ax.axvline(1.0, color="k", lw=1)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([textwrap.fill(n, 60) for n in names], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("how far from the target: value ÷ limit, oriented (> 1: HIT), log scale")
    try:
        info = json.loads((out / "native.json").read_text())
        sub = (
            f"{info['machine'].get('cpu')}, load {info['load_start']:.1f} → {info['load_end']:.1f}"
        )
    except (OSError, ValueError, KeyError):
        sub = ""
    ax.set_title(
        f"Issue 15 targets, C ring and pure ring (python -m perf.native)\n{sub}", fontsize=9
    )
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the quick modes (~5 minutes)")
    ap.add_argument("--out", default="perf/results/native", help="where the JSON and logs go")
    ap.add_argument("--from", dest="from_dir", metavar="DIR", help="only rebuild the table")
    ap.add_argument("--sparse-seconds", type=float, default=10.0)
    ap.add_argument(
        "--plot",
        metavar="PNG",
        nargs="?",
        const="perf/figures/native_targets.png",
        help="also draw the table (default perf/figures/native_targets.png)",
    )
    args = ap.parse_args(argv)
    out = Path(args.from_dir or args.out)
    if not args.from_dir:
        out.mkdir(parents=True, exist_ok=True)
        load0 = os.getloadavg()[0]
        for module, order in (("transport", PATHS), ("slots", PATHS[::-1])):
            for path in order:
                _run(module, path, out, args.quick)
        for path in PATHS:
            _sparse(path, out, args.sparse_seconds)
        info = {"machine": machine_info(), "load_start": load0, "load_end": os.getloadavg()[0]}
        (out / "native.json").write_text(json.dumps(info, indent=2))
    text = table(out)
    try:
        info = json.loads((out / "native.json").read_text())
        m = info["machine"]
        print(
            f"CPU: {m.get('cpu')}, {m.get('cpu_count')} cpus; load average "
            f"{info['load_start']:.2f} at start, {info['load_end']:.2f} at end"
        )
    except (OSError, ValueError, KeyError):
        pass
    print(text)
    (out / "native.md").write_text(text + "\n")
    if args.plot:
        print(f"plot: {plot(out, Path(args.plot))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
