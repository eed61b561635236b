"""Run every ringwire benchmark, merge the results, write a report and plots.

    python -m perf --quick            # < 5 minutes on a 2-core VM
    python -m perf --full             # the scripts' default modes (the default)
    python -m perf --out DIR          # where to write (default perf/results/)
    python -m perf --only slots       # a subset (repeatable): codec, transport, slots, longrun,
                                      #   calls, broadcast, pipeline, tcp, broadcast_remote
    python -m perf --report-only      # rebuild report.md and the plots from DIR's JSON

Each benchmark runs as a subprocess ``python -m perf.<name> --json DIR/<name>.json``
(``--quick`` in quick mode) with a timeout; its output goes to DIR/logs/<name>.log.
A benchmark that times out is interrupted (SIGINT, so its cleanup runs), then killed
with its whole process group.  In quick mode the whole suite also has a budget
(:data:`QUICK_BUDGET_S`): every timeout is cut to what is left of it, and a benchmark
that would get less than :data:`MIN_SLICE_S` is not started (reported as skipped), so a
quick run stays under 5 minutes even when something hangs.  Then DIR/results.json
(machine info, versions and every benchmark's JSON), DIR/report.md and DIR/*.png are
written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from perf import _report

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = (
    "codec",
    "transport",
    "slots",
    "longrun",
    "calls",
    "broadcast",
    "pipeline",
    "tcp",
    "broadcast_remote",
    "tracing",
    "metrics",
)
# (expected seconds on a 2-core VM, timeout seconds)
EXPECTED = {
    "quick": {
        "codec": (11, 40),
        "transport": (55, 110),
        "slots": (36, 75),
        "longrun": (4, 30),
        "calls": (10, 60),
        "broadcast": (40, 80),
        "pipeline": (35, 75),
        "tcp": (60, 110),
        "broadcast_remote": (25, 60),
        "tracing": (6, 40),
        "metrics": (29, 60),
    },
    "full": {
        "codec": (30, 180),
        "transport": (150, 480),
        "slots": (80, 360),
        "longrun": (35, 180),
        "calls": (90, 240),
        "broadcast": (120, 300),
        "pipeline": (380, 720),
        "tcp": (150, 360),
        "broadcast_remote": (100, 240),
        "tracing": (90, 240),
        "metrics": (90, 240),
    },
}
# quick mode: the whole suite's wall-clock budget (the report is written after it) and
# the least time worth starting a benchmark with
QUICK_BUDGET_S = 330.0
MIN_SLICE_S = 8.0


class _Runner:
    """Runs one benchmark subprocess, streaming its output into a log file."""

    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name = name
        self.last_line = ""
        self._log = log.open("w", encoding="utf-8")
        # the benchmark's temporary files (socket directories, ...) go in a directory of
        # its own, removed when it ends: a benchmark killed at its timeout cannot clean up
        self.tmp = tempfile.mkdtemp(prefix="rwperf-run-")
        env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=self.tmp)
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            encoding="utf-8",
            errors="replace",
            start_new_session=True,  # its own process group: one kill reaches every child
        )
        self._t = threading.Thread(target=self._pump, daemon=True)
        self._t.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            s = line.strip()
            if s and not s.startswith("|"):  # skip table rows
                self.last_line = s

    def stop(self) -> None:
        """SIGINT the group (cleanup runs), then SIGKILL whatever is left."""
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGINT, 8.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                # children may outlive the leader briefly
                if sig is signal.SIGINT:
                    time.sleep(0.5)
                    os.killpg(pgid, signal.SIGKILL)
                break
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                break

    def finish(self) -> None:
        self._t.join(5)
        self._log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _run_all(args: argparse.Namespace, out: Path, names: list[str]) -> dict[str, Any]:
    mode = "quick" if args.quick else "full"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    done: dict[str, Any] = {}
    fancy = sys.stdout.isatty() and not args.plain
    progress: Any = None
    if fancy:
        from rich.progress import (
            BarColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        progress = Progress(
            TextColumn("{task.fields[state]:>7}"),
            TextColumn("[bold]{task.description:<10}"),
            BarColumn(bar_width=30),
            TimeElapsedColumn(),
            TextColumn("[dim]{task.fields[line]}", justify="left"),
        )
        tasks = {
            n: progress.add_task(
                n, total=EXPECTED[mode][n][0], start=False, state="waiting", line=""
            )
            for n in names
        }
        progress.start()
    suite_t0 = time.monotonic()
    try:
        for i, name in enumerate(names, 1):
            expected, timeout = EXPECTED[mode][name]
            timeout = timeout * args.timeout_scale
            if args.quick and not args.no_budget:
                left = QUICK_BUDGET_S * args.timeout_scale - (time.monotonic() - suite_t0)
                if left < MIN_SLICE_S:
                    why = (
                        f"not started: {left:.0f} s left of the {QUICK_BUDGET_S:.0f} s quick budget"
                    )
                    done[name] = {
                        "status": "skipped",
                        "error": why,
                        "rc": None,
                        "elapsed_s": 0.0,
                        "command": ["python", "-m", f"perf.{name}", "--quick"],
                        "log": None,
                        "json": None,
                        "result": None,
                    }
                    if fancy:
                        progress.update(tasks[name], state="[red]skipped", line=why)
                    else:
                        print(f"[{i}/{len(names)}] {name}: {why}", flush=True)
                    continue
                timeout = min(timeout, left)
            jpath = out / f"{name}.json"
            jpath.unlink(missing_ok=True)
            cmd = [sys.executable, "-m", f"perf.{name}", "--json", str(jpath)]
            if args.quick:
                cmd.append("--quick")
            shown = ["python", *cmd[1:]]
            if fancy:
                progress.start_task(tasks[name])
                progress.update(tasks[name], state="running")
            else:
                print(
                    f"[{i}/{len(names)}] {name}: {' '.join(shown)} (timeout {timeout:.0f} s)",
                    flush=True,
                )
            t0 = time.monotonic()
            r = _Runner(name, cmd, logs / f"{name}.log")
            status, error = "ok", None
            try:
                while r.proc.poll() is None:
                    el = time.monotonic() - t0
                    if el > timeout:
                        r.stop()
                        status, error = "timeout", f"killed after {timeout:.0f} s"
                        break
                    if fancy:
                        progress.update(
                            tasks[name], completed=min(el, expected * 0.98), line=r.last_line[:60]
                        )
                    time.sleep(0.2)
            except BaseException:
                # Ctrl-C reaches only us (the benchmark has its own session): pass it on,
                # so its cleanup runs, then make sure nothing of its process group is left
                r.stop()
                r.finish()
                raise
            rc = r.proc.wait()
            r.finish()
            el = time.monotonic() - t0
            result = None
            if status == "ok":
                if rc != 0:
                    status, error = "failed", f"exit status {rc}: {r.last_line[:200]}"
                else:
                    try:
                        result = json.loads(jpath.read_text(encoding="utf-8"))
                    except (OSError, ValueError) as e:
                        status, error = "failed", f"no JSON: {e}"
            done[name] = {
                "status": status,
                "error": error,
                "rc": rc,
                "elapsed_s": el,
                "command": shown,
                "log": str(logs / f"{name}.log"),
                "json": str(jpath) if result is not None else None,
                "result": result,
            }
            if fancy:
                progress.update(
                    tasks[name],
                    total=max(el, 0.01),
                    completed=max(el, 0.01),
                    state="[green]done" if status == "ok" else f"[red]{status}",
                    line=error or "",
                )
                progress.stop_task(tasks[name])
            else:
                print(
                    f"      {name}: {status} in {el:.0f} s" + (f" ({error})" if error else ""),
                    flush=True,
                )
    finally:
        if progress is not None:
            progress.stop()
    return done


def _load_existing(out: Path, names: list[str]) -> dict[str, Any]:
    old = out / "results.json"
    prev = json.loads(old.read_text(encoding="utf-8")) if old.exists() else {}
    done: dict[str, Any] = {}
    for name in names:
        jpath = out / f"{name}.json"
        b = dict(prev.get("benchmarks", {}).get(name) or {})
        if jpath.exists():
            b.update(
                status="ok",
                result=json.loads(jpath.read_text(encoding="utf-8")),
                json=str(jpath),
            )
        else:
            b.update(status=b.get("status", "missing"), result=None)
        b.setdefault("elapsed_s", 0.0)
        b.setdefault("command", ["python", "-m", f"perf.{name}"])
        b.setdefault("error", None)
        done[name] = b
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="short runs, < 5 minutes in all")
    mode.add_argument("--full", action="store_true", help="the scripts' default modes (default)")
    ap.add_argument("--out", metavar="DIR", default=str(ROOT / "perf" / "results"))
    ap.add_argument("--only", choices=BENCHMARKS, action="append", help="repeatable")
    ap.add_argument(
        "--timeout-scale",
        type=float,
        default=1.0,
        metavar="F",
        help="multiply every per-benchmark timeout by F (slow machines)",
    )
    ap.add_argument("--plain", action="store_true", help="plain progress lines, no bar")
    ap.add_argument(
        "--no-budget",
        action="store_true",
        help=f"quick mode: no {QUICK_BUDGET_S:.0f} s suite budget (per-benchmark timeouts only)",
    )
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rebuild results.json, report.md and plots from DIR/<name>.json",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in BENCHMARKS if not args.only or n in args.only]

    t0 = time.monotonic()
    started = _report.now_iso()
    if args.report_only:
        benchmarks = _load_existing(out, names)
        mode_name = (
            "quick"
            if any((b.get("result") or {}).get("quick") for b in benchmarks.values())
            else "full"
        )
    else:
        mode_name = "quick" if args.quick else "full"
        benchmarks = _run_all(args, out, names)
    results: dict[str, Any] = {
        "suite": "python -m perf",
        "mode": mode_name,
        "started": started,
        "elapsed_s": time.monotonic() - t0,
        "machine": _report.suite_machine_info(),
        "benchmarks": benchmarks,
    }
    rpath = out / "results.json"
    rpath.write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")

    plots: list[Path] = []
    if not args.no_plots:
        try:
            plots = _report.write_plots(results, out)
        except ImportError:
            print("matplotlib is not installed (pip install -e '.[bench]'): no plots")
    _report.write_report(results, out / "report.md", plots)

    print(f"\nwrote {rpath}, {out / 'report.md'}" + "".join(f", {p}" for p in plots))
    print(f"(total {time.monotonic() - t0:.0f} s)")
    bad = [n for n, b in benchmarks.items() if b["status"] != "ok"]
    if bad:
        print("not ok: " + ", ".join(f"{n} ({benchmarks[n]['status']})" for n in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        print("\ninterrupted: the running benchmark was stopped (its cleanup ran)", file=sys.stderr)
        raise SystemExit(130) from None
