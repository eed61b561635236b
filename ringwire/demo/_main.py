"""The demo's entry point: the banner, progress while the workers start, the run, the
summary and the leak proof."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ringwire import runtime

from ._app import Demo, parse_args, torch_available
from ._view import human, labelled, ms, pct

# -- leak accounting -------------------------------------------------------------------------


def shm_names() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("rw.")}
    except OSError:
        return set()


def socket_files() -> set[str]:
    """Socket files in the temp dir (and in ringwire* folders there)."""
    found: set[str] = set()
    roots = [tempfile.gettempdir()]
    while roots:
        root = roots.pop()
        try:
            entries = list(os.scandir(root))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISSOCK(st.st_mode):
                found.add(e.path)
            elif stat.S_ISDIR(st.st_mode) and e.name.startswith("ringwire") and root == roots[:1]:
                roots.append(e.path)
    return found


def _creator(name: str) -> int:
    try:
        return int(name.split(".")[1])
    except (IndexError, ValueError):
        return -1


# -- summary and entry point -----------------------------------------------------------------


def _summary(demo: Demo, topo: runtime.Topology, stop_s: float | None = None) -> list[str]:
    """The summary's lines, each at most 80 columns (but for a single part longer than
    that, which is never split)."""
    say = labelled
    if demo.loading:
        lines = _figures(demo)
        elapsed = demo.elapsed or (time.monotonic() - demo.t0)
        times = [
            f"start-up {demo.startup_s:.1f} s (workers spawned, ready)",
            f"load {elapsed:.1f} s",
        ]
        if demo.extending:
            extra = elapsed - demo.opts.duration
            times[-1] += f" ({extra:.1f} s past --duration, for the restart)"
        if stop_s is not None:
            times.append(f"stop {stop_s:.2f} s")
        lines += say("time", times)
    else:  # stopped, or failed, before the load began
        up = time.monotonic() - demo.started
        lines = say("requests", [f"none: the run stopped during start-up, after {up:.1f} s"])
    for name, ws in topo.status().items():
        lines += say(name, [f"restarts {ws.restarts}, last pid {ws.pid}"])
    label = "--kill" if demo.opts.kill else "worker exit"
    for parts in demo.kill_lines:
        lines += say(label, parts)
    r = demo.restart
    if r is not None:
        served = demo.stats[r.name].answered - r.answered_before
        lines += say(
            label,
            [
                f"{r.name} restarted: pid {r.pid}, ready in {r.startup_s:.2f} s",
                f"answered {served:,} requests since its restart",
            ],
        )
    elif demo.opts.kill and demo.killed is not None:
        lines += say(label, [f"{demo.killed[0]} did not serve again before the end"])
    if topo.stop_reason:
        lines += say("stop", [topo.stop_reason.splitlines()[0]])
    return lines


def _figures(demo: Demo) -> list[str]:
    """Requests, round trips, bytes by slot reference, finalizers."""
    say = labelled
    stats = list(demo.stats.values())
    lat = np.asarray([x for st in stats for x in st.latencies])
    answered = sum(st.answered for st in stats)
    elapsed = demo.elapsed or (time.monotonic() - demo.t0)
    loaned = sum(st.loaned_bytes for st in stats)
    copied = sum(st.copied_bytes for st in stats)
    replies = sum(st.reply_bytes for st in stats)
    inline = sum(st.inline_bytes for st in stats)
    lost = sum(st.lost for st in stats)
    kind = demo.tensor_label
    counts = [
        f"{answered:,} answered in {elapsed:.1f} s ({answered / max(elapsed, 1e-9):,.0f}/s)",
        f"failed {sum(st.failed for st in stats)}; wrong answers {sum(st.wrong for st in stats)}",
    ]
    if lost:
        counts.append(f"{lost} in flight on the killed worker, lost with it")
    lines = say("requests", counts)
    lines += say(
        "round trip",
        [f"p50 {ms(pct(lat, 50))} ms   p99 {ms(pct(lat, 99))} ms   max {ms(pct(lat, 100))} ms"],
    )
    lines += say(
        "zero-copy",
        sep=", ",
        parts=[
            f"{human(loaned + copied + replies)} by slot reference: "
            f"{human(loaned)} loaned {kind} (no copy)",
            f"{human(copied)} numpy images (one copy into the slot)",
            f"{human(replies)} reply {kind} loaned by the workers",
            f"{human(inline)} of tiny arrays inline",
        ],
    )
    if demo.final:
        releases = sum(s.releases_received for s in demo.final.values())
        in_use = sum(s.slots_in_use for s in demo.final.values())
        held = sum(s.slot_arrays_held for s in demo.final.values())
        receipts = sum(st.receipts for st in stats)
        lines += say(
            "finalizers",
            [
                f"{releases:,} slot releases acknowledged by the workers' finalizers",
                f"{receipts:,} send_tracked receipts seen consumed",
                f"slots in use at the end: {in_use} lent, {held} held",
            ],
        )
    return lines


def _banner(demo: Demo) -> list[str]:
    opts = demo.opts
    front, _ = demo.slot_configs()
    s, t = opts.image_size, opts.tensor_size
    lines = [
        f"ringwire demo: {opts.workers} worker(s) x {opts.concurrency} requests in flight, "
        f"{opts.duration:g} s of load"
    ]
    if not opts.torch:
        why = "--no-torch" if torch_available() else "torch is not installed"
        lines.append(f"{why}: numpy only (float16 arrays stand in for the tensors)")
    lines += labelled(
        "images", [f"{s}x{s}x3 float32 numpy ({human(demo.images[0].nbytes)} each), copied"]
    )
    if opts.torch:
        what = f"3x{t}x{t} bfloat16 torch ({human(demo.tensor_nbytes)} each), loaned"
    else:
        what = f"3x{t}x{t} float16 numpy ({human(demo.tensor_nbytes)} each), loaned"
    lines += labelled("tensors" if opts.torch else "arrays", [what])
    lines += labelled("front pool", [f"{front.describe()} per worker"])
    return lines


def run(argv: Sequence[str] | None = None) -> int:
    """The demo; returns the process exit status (0: clean, no leaks)."""
    opts = parse_args(argv)
    # the demo shows the runtime's events itself (log lines would tear the live view)
    logging.getLogger("ringwire.runtime").setLevel(logging.ERROR)
    shm_before = shm_names()
    socks_before = socket_files()
    demo = Demo(opts)
    for line in _banner(demo):
        print(line, flush=True)
    topo = demo.topology()
    startup = _StartupView(demo)
    rc = 0
    if demo.prep is not None:
        demo.prep.start()
    try:
        topo.run(demo.main)
    except runtime.WorkerStartError as exc:
        startup.stop()
        first = str(exc).splitlines()[0]
        more = " (the worker's traceback is above)" if "\n" in str(exc) else ""
        print(f"ringwire demo: the workers did not start: {first}{more}", file=sys.stderr)
        rc = 2
    finally:
        startup.stop()
    stop_s = None if demo.load_end is None else time.monotonic() - demo.load_end
    if not opts.live:
        demo.print_new_events()
    print()
    print("summary")
    for line in _summary(demo, topo, stop_s):
        print(line)

    # the leak proof: everything this run created is gone
    pids = {os.getpid()} | {ev.pid for ev in topo.history if hasattr(ev, "pid")}
    children = multiprocessing.active_children()
    shm_after = shm_names()
    socks_after = socket_files()
    ours = sorted(n for n in shm_after - shm_before if _creator(n) in pids)
    others = len(shm_after - shm_before) - len(ours)
    new_socks = sorted(socks_after - socks_before)
    for line in labelled(
        "leak check",
        [
            f"rw.* names in /dev/shm: {len(shm_before)} before, {len(shm_after)} after",
            f"{len(ours)} of this run left behind",
            *([f"{others} new from other processes"] if others else []),
            f"socket files: {len(socks_before)} before, {len(socks_after)} after",
            f"worker processes alive: {len(children)}",
        ],
    ):
        print(line)
    leaked = bool(ours or new_socks or children)
    if leaked:
        print(f"  LEAKED: shm {ours} sockets {new_socks} processes {children}")
        rc = 1
    else:
        print("  no leaks: every /dev/shm name, socket file and worker process is gone")
    wrong = sum(st.wrong for st in demo.stats.values())
    if wrong and rc == 0:
        rc = 1
    if rc == 0 and demo.interrupted:
        rc = 128 + signal.Signals[demo.interrupted].value
    return rc


class _StartupView:
    """Progress while the workers start (a few seconds: each is a fresh interpreter that
    imports numpy, and torch when the demo sends tensors): a live panel on a terminal,
    lines otherwise (the ready events, printed as they come)."""

    def __init__(self, demo: Demo) -> None:
        self._live: Any = None
        if not demo.opts.live:
            what = "numpy and torch" if demo.opts.torch else "numpy"
            print(
                f"starting {demo.opts.workers} worker(s) (fresh interpreters importing {what}) ...",
                flush=True,
            )
            return
        try:
            from rich.console import Console
            from rich.live import Live
        except ImportError:  # pragma: no cover - rich is a dependency
            return
        console = Console()
        self._live = Live(
            get_renderable=lambda: demo.render_startup(console.width),
            console=console,
            auto_refresh=True,
            refresh_per_second=8,
            transient=True,
        )
        demo.on_loading = self.stop
        self._live.start()

    def stop(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.stop()
