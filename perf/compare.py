"""Before/after benchmark: the working tree's ringwire against an older revision, side by side.

Run from the repository root::

    python -m perf.compare --baseline HEAD            # ~3 minutes on a 2-core VM
    python -m perf.compare --baseline HEAD~3 --quick  # fewer, shorter rounds: < 1 minute
    python -m perf.compare --baseline v0.1 --rounds 15 --json cmp.json
    python -m perf.compare --baseline HEAD --new HEAD # A/A: the same revision both ways
    python -m perf.compare --pure-vs-native           # one tree: RINGWIRE_PURE=1 vs the C ring

How
---
The old tree is ``git archive REF`` unpacked into a temporary directory (no worktree,
no checkout: git's state is not touched).  The new tree is a copy of the working
tree's ``ringwire/`` taken at start (so edits made while it runs do not mix into the
measurement); ``--new REF`` measures another revision instead.  One *driver* process
per tree (:mod:`perf._compare_child`, the same file for both) runs with
``PYTHONPATH=<that tree>`` from an empty directory, and reports the
``ringwire.__file__`` it imported (so do the helper processes it starts); a driver
whose ringwire is not from its tree stops the run.

The measured code uses only ringwire's public API.  Every round runs every measurement
once on each tree, the two back to back (old, new -- then new, old in the next round,
and so on), so drift of a noisy machine hits both alike.  Each run of a measurement
starts fresh helper processes (spawn), warms up, and times one batch; the table shows
medians over rounds and the ratio new ÷ old of the medians; the per-round ratios (each
round's new over the same round's old) give the spread.

A tree with the C ring (``ringwire/_wire/_cring.c``) is measured native: an extracted
revision gets ``python setup.py build_ext --inplace`` first (a failed build leaves it
on the pure path; each side's line says which path it ran).  ``--pure-vs-native``
measures one tree both ways: "old" is the tree with ``RINGWIRE_PURE=1``, "new" the same
tree on the C ring.

Cleanup: the drivers run in their own sessions (a Ctrl-C reaches this process only,
which then stops them: exit, SIGTERM, SIGKILL of their process groups); every process
has ``PR_SET_PDEATHSIG``; the temporary directory (both trees, sockets, logs) is
removed; and any ``/dev/shm/rw.<pid>.*`` segment of one of our processes that is still
there at the end is unlinked (and reported).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf._common import format_table, machine_info

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "_compare_child.py"
SHM = "/dev/shm"
CALL_TIMEOUT_S = 90.0  # one measurement on one tree
HELLO_TIMEOUT_S = 60.0
NOISE = 0.05  # A/A runs (the same tree both ways) here differ by up to ~4 % per measurement


@dataclass(frozen=True)
class Measure:
    key: str
    label: str
    unit: str  # "µs" (lower is better) or "records/s" (higher is better)
    m: str  # the driver's measurement function
    args: dict[str, Any]
    full: tuple[int, int]  # (n, warm-up) of a default run
    quick: tuple[int, int]

    @property
    def higher_is_better(self) -> bool:
        return self.unit == "records/s"


MEASURES = (
    Measure(
        "async_rt",
        "(a) async round trip, both ends parked (spin_us=0), 100 B, asyncio",
        "µs",
        "async_rt",
        {"spin_us": 0.0},
        (12000, 1000),
        (4000, 400),
    ),
    Measure(
        "sync_rt",
        "(b) hot round trip, blocking API (connect_sync, default spin), 100 B",
        "µs",
        "sync_rt",
        {},
        (15000, 1500),
        (5000, 500),
    ),
    Measure(
        "tp_record",
        "(c) throughput 1→1, send/receive per record, 100 B, default slot pool",
        "records/s",
        "tp",
        {"batch": False, "pool": True},
        (200000, 20000),
        (60000, 6000),
    ),
    Measure(
        "tp_record_nopool",
        "(c) throughput 1→1, send/receive per record, 100 B, slots=None",
        "records/s",
        "tp",
        {"batch": False, "pool": False},
        (200000, 20000),
        (60000, 6000),
    ),
    Measure(
        "tp_batch",
        "(d) throughput 1→1, send_many/receive_many (256), 100 B, default slot pool",
        "records/s",
        "tp",
        {"batch": True, "pool": True},
        (500000, 50000),
        (150000, 15000),
    ),
    Measure(
        "tp_batch_nopool",
        "(d) throughput 1→1, send_many/receive_many (256), 100 B, slots=None",
        "records/s",
        "tp",
        {"batch": True, "pool": False},
        (500000, 50000),
        (150000, 15000),
    ),
    Measure(
        "fanin",
        "(e) fan-in 2 producers → 1 listener, send_many → Listener.receive_many, 100 B",
        "records/s",
        "fanin",
        {"producers": 2},
        (250000, 25000),
        (80000, 8000),
    ),
    Measure(
        "loan",
        "(f) loaned 8 MiB array: loan, write 1 byte, send → consumer drops it, answers",
        "µs",
        "handoff",
        {"loaned": True},
        (4000, 200),
        (1500, 100),
    ),
    Measure(
        "copy",
        "(g) copy-in 8 MiB array: send a private array (copied into a slot) → answer",
        "µs",
        "handoff",
        {"loaned": False},
        (600, 30),
        (200, 10),
    ),
    Measure(
        "bcast_step",
        "(h) broadcast step, 2 parked readers (spin_us=0), steps 1 ms apart, 100 B",
        "µs",
        "bcast_step",
        {"readers": 2},
        (3000, 300),
        (1000, 100),
    ),
    Measure(
        "bcast_tp",
        "(i) broadcast throughput, 2 readers (default spin), back to back, 100 B",
        "records/s",
        "bcast_tp",
        {"readers": 2},
        (100000, 10000),
        (30000, 3000),
    ),
    Measure(
        "call_rt",
        "(j) Client.call round trip to an async serve() echo, 100 B, asyncio",
        "µs",
        "call_rt",
        {},
        (8000, 800),
        (3000, 300),
    ),
)
BY_KEY = {m.key: m for m in MEASURES}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- git, trees


def git(*args: str) -> str:
    """A read-only git command in the repository (no optional index refresh)."""
    out = subprocess.run(
        ["git", "--no-optional-locks", "-C", str(ROOT), *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout.strip()


def resolve(ref: str) -> dict[str, str]:
    if ref.startswith("-"):
        raise SystemExit(f"not a revision: {ref!r}")
    sha = git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    return {"ref": ref, "commit": sha, "describe": git("log", "-1", "--format=%h %cs %s", sha)}


def package_parent(tree: Path) -> Path:
    """The directory to put on PYTHONPATH: the one holding ``ringwire/``."""
    for cand in (tree, tree / "src"):
        if (cand / "ringwire" / "__init__.py").is_file():
            return cand
    raise SystemExit(f"no ringwire package in {tree}")


def extract(commit: str, dest: Path) -> Path:
    """``git archive <commit> | tar -x -C dest``; returns the PYTHONPATH entry."""
    dest.mkdir(parents=True)
    proc = subprocess.Popen(
        ["git", "--no-optional-locks", "-C", str(ROOT), "archive", "--format=tar", commit],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tf:
            if hasattr(tarfile, "data_filter"):
                tf.extractall(dest, filter="data")
            else:  # pragma: no cover - Python without extraction filters
                tf.extractall(dest)  # noqa: S202 (our own repository's archive)
    finally:
        proc.stdout.close()
        rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"git archive {commit} failed ({rc})")
    parent = package_parent(dest)
    if (parent / "ringwire" / "_wire" / "_cring.c").is_file() and (parent / "setup.py").is_file():
        built = subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
            cwd=parent,
            capture_output=True,
            text=True,
        )
        if built.returncode != 0:
            log(f"{commit[:12]}: the C ring did not build; that side runs the pure path")
    return parent


def snapshot_worktree(dest: Path) -> Path:
    """A copy of the working tree's ``ringwire/`` package (uncommitted edits included,
    and the C ring as built there, if it is)."""
    src = package_parent(ROOT) / "ringwire"
    shutil.copytree(src, dest / "ringwire", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def worktree_rev() -> dict[str, Any]:
    head = git("rev-parse", "HEAD")
    rel = os.path.relpath(package_parent(ROOT) / "ringwire", ROOT)
    changed = [ln for ln in git("status", "--porcelain", "--", rel).splitlines() if ln.strip()]
    return {
        "ref": "working tree",
        "commit": head,
        "describe": git("log", "-1", "--format=%h %cs %s", head),
        "ringwire_changes": len(changed),
    }


# --------------------------------------------------------------------------- drivers


class DriverFailed(Exception):
    pass


BOOT = "import sys; sys.path.insert(0, {run!r}); import rwcmp_child; rwcmp_child.driver_main()"


class Driver:
    """One long-lived driver process for one tree (restarted if it dies)."""

    def __init__(
        self,
        side: str,
        pypath: Path,
        run_dir: Path,
        work: Path,
        pids: set[int],
        env: dict[str, str] | None = None,
    ):
        self.env = env or {}
        self.side = side
        self.pypath = pypath
        self.run_dir = run_dir
        self.work = work
        self.pids = pids
        self.log_path = work.parent / f"{side}.log"
        self.proc: subprocess.Popen[str] | None = None
        self.q: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.hello: dict[str, Any] = {}
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(self.pypath), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        env.pop("PYTHONSTARTUP", None)
        env.pop("RINGWIRE_PURE", None)
        env.update(self.env)
        with open(self.log_path, "a", encoding="utf-8") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", BOOT.format(run=str(self.run_dir))],
                cwd=self.run_dir,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logf,
                text=True,
                bufsize=1,
                start_new_session=True,  # a terminal's Ctrl-C reaches only us
            )
        self.pids.add(self.proc.pid)
        self.q = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.q), daemon=True).start()
        hello = self._next(time.monotonic() + HELLO_TIMEOUT_S, "start")
        want = os.path.realpath(self.pypath)
        got = hello.get("ringwire_file", "")
        if not got.startswith(want + os.sep):
            raise DriverFailed(f"{self.side}: imported ringwire from {got}, not from {want}")
        self.hello = hello

    @staticmethod
    def _read(proc: subprocess.Popen[str], q: queue.Queue[dict[str, Any] | None]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with contextlib.suppress(ValueError):
                q.put(json.loads(line))
        q.put(None)

    def _log_tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _next(self, deadline: float, what: str) -> dict[str, Any]:
        """The next reply or hello (pid events are recorded on the way)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise DriverFailed(f"{self.side}: {what} timed out")
            try:
                msg = self.q.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if msg is None:
                rc = self.proc.wait() if self.proc is not None else None
                self.kill()
                raise DriverFailed(f"{self.side}: driver exited ({rc}):\n{self._log_tail()}")
            if msg.get("event") == "pid":
                self.pids.add(int(msg["pid"]))
                continue
            return msg

    def call(self, m: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"m": m, "args": args}) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            self.kill()
            raise DriverFailed(f"{self.side}: driver gone ({e})") from None
        msg = self._next(time.monotonic() + timeout, m)
        if not msg.get("ok"):
            raise DriverFailed(str(msg.get("error", msg)).strip().splitlines()[-1])
        return msg["result"]

    def kill(self) -> None:
        """Stop the driver and everything in its process group."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None and proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.write(json.dumps({"m": "exit"}) + "\n")
                proc.stdin.flush()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(2.0)
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
            try:
                os.killpg(proc.pid, 0)  # anyone left in its group (helpers included)?
            except (ProcessLookupError, PermissionError):
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                try:
                    os.killpg(proc.pid, 0)
                except (ProcessLookupError, PermissionError):
                    break
                time.sleep(0.05)
        with contextlib.suppress(Exception):
            proc.wait(1.0)
        for f in (proc.stdin, proc.stdout):
            with contextlib.suppress(Exception):
                if f is not None:
                    f.close()


def shm_sweep(before: set[str], pids: set[int]) -> list[str]:
    """Unlink ``/dev/shm/rw.<pid>.*`` names of our processes that appeared during the run."""
    removed = []
    try:
        names = set(os.listdir(SHM)) - before
    except OSError:
        return removed
    for name in sorted(names):
        m = re.match(r"rw\.(\d+)\.", name)
        if m and int(m.group(1)) in pids:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM, name))
                removed.append(name)
    return removed


# --------------------------------------------------------------------------- statistics, table


def _spread(vals: list[float]) -> tuple[float, float] | None:
    if not vals:
        return None
    if len(vals) >= 4:
        q = statistics.quantiles(vals, n=4, method="inclusive")
        return q[0], q[2]
    return min(vals), max(vals)


def summarize(meas: Measure, old: list[Any], new: list[Any], noise: float) -> dict[str, Any]:
    ov = [r["value"] for r in old if r is not None]
    nv = [r["value"] for r in new if r is not None]
    out: dict[str, Any] = {
        "label": meas.label,
        "unit": meas.unit,
        "better": "higher" if meas.higher_is_better else "lower",
        "old": {"median": statistics.median(ov) if ov else None, "rounds": old},
        "new": {"median": statistics.median(nv) if nv else None, "rounds": new},
    }
    om, nm = out["old"]["median"], out["new"]["median"]
    out["ratio"] = nm / om if om and nm else None
    paired = [n["value"] / o["value"] for o, n in zip(old, new) if o and n and o["value"]]
    out["round_ratios"] = paired
    out["round_ratio_median"] = statistics.median(paired) if paired else None
    out["round_ratio_iqr"] = _spread(paired)
    # The verdict goes by the per-round ratios: old and new of one round ran seconds
    # apart, while the medians of the two trees may mix rounds from different states of
    # the machine (other work starting or stopping shifts every number for a while).
    verdict = "—"
    ratio, iqr = out["round_ratio_median"], out["round_ratio_iqr"]
    if ratio is not None and iqr is not None:
        if iqr[0] <= 1.0 <= iqr[1]:
            verdict = "≈ (within spread)"
        elif abs(ratio - 1.0) < noise:
            verdict = f"≈ (< {noise:.0%})"
        else:
            better = (ratio > 1) == meas.higher_is_better
            verdict = f"new {'better' if better else 'worse'} ({ratio - 1:+.0%})"
    out["verdict"] = verdict
    return out


def fmt_val(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "records/s":
        return f"{v:,.0f}"
    return f"{v:,.0f}" if v >= 1000 else f"{v:.3g}" if v < 10 else f"{v:.1f}"


def _short(s: str, n: int = 72) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _path_word(hello: dict[str, Any]) -> str:
    return "the C ring" if hello.get("native") else "pure-Python ring"


def render(summary: dict[str, Any], info: dict[str, Any]) -> str:
    old, new = info["old"], info["new"]
    new_desc = f"{new['ref']} at {_short(new['describe'])}"
    if new.get("ringwire_changes"):
        new_desc += f" + uncommitted changes ({new['ringwire_changes']} paths in ringwire/)"
    mach = info["machine"]
    lines = [
        "## Before/after: ringwire old vs new",
        "",
        f"- old: `{old['ref']}` = {_short(old['describe'])} (ringwire from {old['ringwire_file']}"
        f"; {_path_word(info['old_driver'])})",
        f"- new: {new_desc} (ringwire from {new['ringwire_file']}; {_path_word(info['new_driver'])})",
        f"- CPU: {mach['cpu']}; cpus: {mach['cpu_count']} ({mach['cpus_usable']} usable); "
        f"{mach['platform']}; python {mach['python']}",
        f"- rounds: {info['rounds_done']} of {info['rounds']}{' (--quick)' if info['quick'] else ''}"
        f", old and new back to back per measurement, order alternating; load average "
        f"{info['load_start']:.2f} at start, {info['load_end']:.2f} at end; "
        f"{info['elapsed_s']:.0f} s",
        "",
    ]
    rows = []
    for key, s in summary.items():
        unit = s["unit"] + (" ↑" if s["better"] == "higher" else " ↓")
        iqr = s["round_ratio_iqr"]
        rows.append(
            [
                s["label"],
                unit,
                fmt_val(s["old"]["median"], s["unit"]),
                fmt_val(s["new"]["median"], s["unit"]),
                f"{s['ratio']:.3f}×" if s["ratio"] else "—",
                f"{s['round_ratio_median']:.3f} ({iqr[0]:.3f}–{iqr[1]:.3f})" if iqr else "—",
                s["verdict"],
            ]
        )
        for side in ("old", "new"):
            errs = [r for r in info["errors"] if r["key"] == key and r["side"] == side]
            if errs:
                rows.append(
                    [f"  ↳ {side}: {len(errs)} failed: {errs[-1]['error'][:80]}"] + [""] * 6
                )
    lines.append(
        format_table(
            [
                "measurement",
                "unit",
                "old",
                "new",
                "new ÷ old",
                "per-round new ÷ old: median (IQR)",
                "verdict",
            ],
            rows,
            align="llrrrrl",
        )
    )
    lines += [
        "",
        "µs ↓: a median time, lower is better (new ÷ old < 1: new is faster).  "
        "records/s ↑: higher is better (new ÷ old > 1: new is faster).  Round trips are "
        "the median of each round's samples, throughputs one timed batch per round; the "
        "table shows the median over rounds.  The verdict goes by the per-round ratios "
        "(each round's new over the same round's old): *≈* when their interquartile range "
        f"contains 1 or their median is within the noise threshold ({info['noise']:.0%}, "
        "`--noise`) of 1.",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", metavar="REF", help="the old revision")
    ap.add_argument(
        "--pure-vs-native",
        action="store_true",
        help="one tree (the working tree, or --new) both ways: old = RINGWIRE_PURE=1, "
        "new = the C ring",
    )
    ap.add_argument(
        "--new",
        metavar="REF",
        help="measure this revision as the new side (default: the working tree)",
    )
    ap.add_argument("--rounds", type=int, help="rounds (default 9, --quick 4)")
    ap.add_argument("--quick", action="store_true", help="fewer, shorter rounds (< 1 minute)")
    ap.add_argument("--json", metavar="PATH", help="also write every number as JSON")
    ap.add_argument(
        "--noise",
        type=float,
        default=NOISE,
        metavar="F",
        help=f"a change of less than F (default {NOISE}) is reported as ≈",
    )
    ap.add_argument(
        "--only",
        action="append",
        choices=list(BY_KEY),
        help="run only these measurements (repeatable)",
    )
    args = ap.parse_args(argv)
    if bool(args.baseline) == args.pure_vs_native:
        ap.error("give exactly one of --baseline REF and --pure-vs-native")
    rounds = args.rounds or (4 if args.quick else 9)
    if rounds < 1:
        ap.error("--rounds must be at least 1")
    measures = [m for m in MEASURES if not args.only or m.key in args.only]

    # Ctrl-C and SIGTERM both unwind into the cleanup below (also when started with
    # SIGINT ignored, as a shell does for a background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _on_sigterm)
    t_start = time.monotonic()
    new_rev = resolve(args.new) if args.new else worktree_rev()
    old_rev = (
        dict(new_rev, ref=new_rev["ref"] + ", RINGWIRE_PURE=1")
        if args.pure_vs_native
        else resolve(args.baseline)
    )
    try:
        shm_before = set(os.listdir(SHM))
    except OSError:
        shm_before = set()
    pids: set[int] = set()
    tmp = Path(tempfile.mkdtemp(prefix="rwcmp-"))
    drivers: dict[str, Driver] = {}
    results: dict[str, dict[str, list[Any]]] = {m.key: {"old": [], "new": []} for m in measures}
    errors: list[dict[str, Any]] = []
    rounds_done = 0
    interrupted = False
    load_start = os.getloadavg()[0]
    setup_error: str | None = None
    try:
        run_dir = tmp / "run"
        run_dir.mkdir()
        shutil.copyfile(CHILD, run_dir / "rwcmp_child.py")
        if args.new:
            new_path = extract(new_rev["commit"], tmp / "new")
        else:
            new_path = snapshot_worktree(tmp / "new")
        old_path = new_path if args.pure_vs_native else extract(old_rev["commit"], tmp / "old")
        for side, path in (("old", old_path), ("new", new_path)):
            work = tmp / f"{side}-work"
            work.mkdir()
            env = {"RINGWIRE_PURE": "1"} if args.pure_vs_native and side == "old" else None
            drivers[side] = Driver(side, path, run_dir, work, pids, env)
            drivers[side].start()
            log(
                f"{side}: ringwire {drivers[side].hello.get('ringwire_version')} from "
                f"{drivers[side].hello['ringwire_file']} "
                f"({'the C ring' if drivers[side].hello.get('native') else 'pure Python'})"
            )
        if args.pure_vs_native and not drivers["new"].hello.get("native"):
            raise DriverFailed("--pure-vs-native: the C ring is not built in this tree")
        old_rev["ringwire_file"] = drivers["old"].hello["ringwire_file"]
        new_rev["ringwire_file"] = drivers["new"].hello["ringwire_file"]
        for r in range(rounds):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            t_round = time.monotonic()
            for meas in measures:
                n, warm = meas.quick if args.quick else meas.full
                call_args = {"n": n, "warm": warm, **meas.args}
                for side in order:
                    d = drivers[side]
                    a = (
                        dict(call_args, workdir=str(d.work))
                        if meas.m in ("fanin", "bcast_step", "bcast_tp")
                        else call_args
                    )
                    t0 = time.monotonic()
                    try:
                        res = d.call(meas.m, a, CALL_TIMEOUT_S)
                        res["wall_s"] = round(time.monotonic() - t0, 3)
                    except DriverFailed as e:
                        res = None
                        errors.append({"key": meas.key, "side": side, "round": r, "error": str(e)})
                        log(f"  {meas.key} [{side}] failed: {e}")
                    results[meas.key][side].append(res)
            rounds_done += 1
            log(f"round {r + 1}/{rounds} done ({time.monotonic() - t_round:.1f} s)")
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: stopping the drivers and cleaning up")
    except DriverFailed as e:  # a tree whose ringwire does not even import, say
        setup_error = str(e)
        log(f"could not start: {e}")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for d in drivers.values():
            d.kill()
        removed = shm_sweep(shm_before, pids)
        shutil.rmtree(tmp, ignore_errors=True)
        if removed:
            log(f"removed {len(removed)} leftover /dev/shm segment(s) of this run: {removed}")
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _on_sigterm)
    if not rounds_done or setup_error is not None:
        return 130 if interrupted else 1
    summary = {
        m.key: summarize(
            m, results[m.key]["old"][:rounds_done], results[m.key]["new"][:rounds_done], args.noise
        )
        for m in measures
    }
    info = {
        "machine": machine_info(),
        "old": old_rev,
        "new": new_rev,
        "old_driver": drivers["old"].hello,
        "new_driver": drivers["new"].hello,
        "rounds": rounds,
        "rounds_done": rounds_done,
        "quick": args.quick,
        "noise": args.noise,
        "interrupted": interrupted,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "elapsed_s": time.monotonic() - t_start,
        "errors": errors,
        "shm_removed": removed,
        "driver_starts": {s: d.starts for s, d in drivers.items()},
        "sizes": {
            m.key: dict(zip(("n", "warm"), m.quick if args.quick else m.full)) for m in measures
        },
    }
    print(render(summary, info), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({**info, "measurements": summary}, indent=2) + "\n")
        log(f"wrote {args.json}")
    if interrupted:
        return 130
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
