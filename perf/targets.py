"""Issue 27's table from one run: each row with its target, the measured ratio, HIT/MISS.

Run from the repository root::

    python -m perf.targets                  # the quick modes, ~5 minutes on a 2-core VM
    python -m perf.targets --from DIR       # rebuild the table from DIR's JSON, run nothing

It runs ``perf.transport --quick`` (async and hot round trips, batched 1→1, fan-in,
idle), ``perf.slots --quick --copy-sizes 8`` (the 8 MiB copy-in, the loaned handoff)
and ``perf.tcp --quick`` (the TCP round trip) one after the other, each writing its
JSON under ``--out``, and reads the rows from those: every ratio is ringwire ÷ a peer
*of the same run* (peers interleaved), so it is judged under the load it was measured
in.  The broadcast rows come from the broadcast benchmark's own runs (``perf.broadcast``
and its vLLM comparison), which this does not start: they are listed as not run.

Exit status: 1 when a benchmark run failed -- a crash, or a correctness check (a wrong
answer, a leak: see ``perf.longrun`` and ``perf.slots``) -- so its rows are missing;
0 otherwise, misses included (a missed speed target is a result).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf._common import format_table, machine_info

# (name, module, arguments after --json PATH)
RUNS = (
    ("transport", "perf.transport", ["--quick"]),
    ("slots", "perf.slots", ["--quick", "--copy-sizes", "8"]),
    ("tcp", "perf.tcp", ["--quick"]),
)


def _run(name: str, module: str, args: list[str], out: Path) -> int:
    cmd = [sys.executable, "-m", module, "--json", str(out / f"{name}.json"), *args]
    log = out / f"{name}.log"
    print(f"running {' '.join(cmd[1:])} (log: {log})", flush=True)
    with open(log, "w", encoding="utf-8") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    (out / f"{name}.rc").write_text(f"{rc}\n", encoding="utf-8")
    return rc


def _load(out: Path, name: str) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = json.loads((out / f"{name}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc


def _target(doc: dict[str, Any] | None, prefix: str) -> float | None:
    """The value of the first target of ``doc`` whose name starts with ``prefix``."""
    for t in (doc or {}).get("targets", []):
        if t.get("target", "").startswith(prefix):
            v = t.get("value")
            return float(v) if isinstance(v, (int, float)) else None
    return None


def _hot_vs_busy_poll(doc: dict[str, Any] | None) -> float | None:
    hot = ((doc or {}).get("results") or {}).get("hot_rt") or {}
    floor = hot.get("busy-poll shared int64 (floor)", {}).get("median_ns")
    rw = hot.get("ringwire hot, blocking API", {}).get("median_ns")
    return rw / floor if rw and floor else None


# (row, target text, limit, op, value getter over the loaded documents)
Getter = Callable[[dict[str, Any]], float | None]
ROWS: tuple[tuple[str, str, float, str, Getter | None], ...] = (
    (
        "async RT, both ends parked, 100 B, asyncio",
        "≤ 1.5× socketpair callback-echo floor",
        1.5,
        "<=",
        lambda d: _target(d["transport"], "async RT: ringwire ≤ 1.5× asyncio-pipe floor"),
    ),
    (
        "",
        "≤ 0.3× zmq.asyncio + msgspec",
        0.3,
        "<=",
        lambda d: _target(d["transport"], "async RT: ringwire ≤ 0.3× zmq.asyncio"),
    ),
    (
        "hot RT, blocking, 100 B",
        "≤ 0.7× posix_ipc semaphore ping-pong",
        0.7,
        "<=",
        lambda d: _target(d["transport"], "hot RT: ringwire ≤ 1.0× posix_ipc semaphore"),
    ),
    ("", "≤ 10× busy-polled int", 10.0, "<=", lambda d: _hot_vs_busy_poll(d["transport"])),
    (
        "8 MiB copy-in handoff",
        "≥ 0.85× one np.copyto (bandwidth)",
        0.85,
        ">=",
        lambda d: _target(d["slots"], "copy-in 8 MiB: bandwidth"),
    ),
    ("broadcast, 4 readers, 2.4 MB per step", "≤ 0.7× vLLM MessageQueue", 0.7, "<=", None),
    (
        "TCP RT, 100 B (load: see the note)",
        "≤ 1.0× zmq.asyncio",
        1.0,
        "<=",
        lambda d: _target(d["tcp"], "async RT 100 B over TCP"),
    ),
    (
        "batched 1→1, 100 B records",
        "≥ 8× faster-fifo batch",
        8.0,
        ">=",
        lambda d: _target(d["transport"], "throughput: ringwire batch ≥ 5× faster-fifo batch"),
    ),
    (
        "",
        "≥ 1 M records/s (value: M records/s)",
        1.0,
        ">=",
        lambda d: _rate(d["transport"]),
    ),
    (
        "fan-in 4→1, 100 B",
        "≥ 5× faster-fifo",
        5.0,
        ">=",
        lambda d: _target(d["transport"], "fan-in, 4 producers: ringwire ≥"),
    ),
    (
        "keep: loaned handoff flat",
        "256 MiB ≤ 2× 4 KiB (one-way)",
        2.0,
        "<=",
        lambda d: _target(d["slots"], "loaned handoff flat"),
    ),
    (
        "keep: idle CPU (async consumer)",
        "≤ 1 % of a core (value: %)",
        1.0,
        "<=",
        lambda d: _target(d["transport"], "idle: ringwire async consumer [asyncio]"),
    ),
    ("keep: small-record broadcast", "≤ vLLM's latency", 1.0, "<=", None),
)


def _rate(doc: dict[str, Any] | None) -> float | None:
    v = _target(doc, "throughput: ringwire batch ≥ 1 M records/s")
    return v / 1e6 if v is not None else None


def table(out: Path) -> tuple[str, list[str]]:
    """The Markdown table of ``out``'s runs, and the runs that failed or are missing."""
    docs = {name: _load(out, name) for name, _m, _a in RUNS}
    failed = []
    for name, _m, _a in RUNS:
        rc_file = out / f"{name}.rc"
        rc = rc_file.read_text(encoding="utf-8").strip() if rc_file.exists() else "?"
        if rc != "0" or docs[name] is None:
            failed.append(f"{name} (exit {rc}, log: {out / (name + '.log')})")
    rows = []
    for row, what, limit, op, get in ROWS:
        if get is None:
            rows.append([row, what, "not run here (perf.broadcast)", "—"])
            continue
        v = get(docs)
        if v is None:
            rows.append([row, what, "—", "n/a"])
            continue
        ok = v <= limit if op == "<=" else v >= limit
        shown = f"{v:.3g}" if "value:" in what else f"{v:.3g}×"
        rows.append([row, what, shown, "HIT" if ok else "MISS"])
    loads = []
    for name in ("transport", "slots", "tcp"):
        d = docs.get(name) or {}
        m = d.get("machine") or {}
        start = d.get("load_start") or m.get("loadavg_start")
        if isinstance(start, list) and start:
            loads.append(f"{name} {start[0]:.2f}")
    text = format_table(["measurement", "target", "measured", "status"], rows, "llrl")
    if loads:
        text += "\n\nload average at the start of each run: " + ", ".join(loads)
    return text, failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="perf/results/targets", help="where the JSON and logs go")
    ap.add_argument("--from", dest="from_dir", metavar="DIR", help="only rebuild the table")
    args = ap.parse_args(argv)
    out = Path(args.from_dir or args.out)
    info = machine_info()
    if not args.from_dir:
        out.mkdir(parents=True, exist_ok=True)
        for name, module, extra in RUNS:
            _run(name, module, extra, out)
    text, failed = table(out)
    print("## Issue 27's targets, one run\n")
    print(
        f"- CPU: {info['cpu']}; cpus: {info['cpu_count']} ({info['cpus_usable']} usable); "
        f"load average now: {os.getloadavg()[0]:.2f}; runs: {out}\n"
    )
    print(text)
    if failed:
        print("\nFAILED runs (their rows are missing or wrong): " + "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
