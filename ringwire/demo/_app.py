"""The demo's front process: load generator, live view, summary and leak proof."""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import multiprocessing
import os
import signal
import stat
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

import ringwire
from ringwire import runtime

_KiB = 1 << 10
_MiB = 1 << 20
WORKER_ENTRY = "ringwire.demo._worker:serve"
KINDS = ("text", "image", "tensor", "mixed")  # the request mix, in turn


# -- options -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    duration: float = 10.0
    workers: int = 2
    concurrency: int = 4
    image_size: int = 224
    tensor_size: int = 512
    kill: bool = False
    kill_at: float = 0.4
    live: bool = True
    spin_us: float = ringwire.DEFAULT_SPIN_US


def parse_args(argv: Sequence[str] | None) -> Options:
    p = argparse.ArgumentParser(
        prog="python -m ringwire.demo",
        description=(
            "A front process sends requests -- text records with tiny inline arrays, "
            "HxWx3 float32 numpy images copied once into shared-memory slots, 3xHxW "
            "bfloat16 torch tensors loaned from a slot and filled in place -- to worker "
            "processes that answer (some answers carry a tensor loaned from the worker's "
            "own slots).  Ctrl-C stops it gracefully; a second Ctrl-C forces."
        ),
    )
    p.add_argument("--duration", type=float, default=10.0, help="seconds of load (default 10)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument(
        "--concurrency", type=int, default=4, help="requests in flight per worker (default 4)"
    )
    p.add_argument(
        "--image-size", type=int, default=224, help="images are SIZE x SIZE x 3 float32 (224)"
    )
    p.add_argument(
        "--tensor-size", type=int, default=512, help="tensors are 3 x SIZE x SIZE bfloat16 (512)"
    )
    p.add_argument(
        "--kill",
        action="store_true",
        help="kill -9 worker-0 mid-run: shows detection, reclaim and restart",
    )
    p.add_argument(
        "--kill-at", type=float, default=0.4, help="when to kill, as a fraction of the duration"
    )
    p.add_argument(
        "--no-live", action="store_true", help="print a line per second instead of a live table"
    )
    p.add_argument(
        "--spin-us",
        type=float,
        default=None,
        help="how long an idle endpoint spins before it parks, in microseconds (default: "
        f"{ringwire.DEFAULT_SPIN_US:g} when there is a core per process, else 0)",
    )
    a = p.parse_args(argv)
    if a.duration <= 0 or a.workers < 1 or a.concurrency < 1:
        p.error("--duration, --workers and --concurrency must be positive")
    if a.image_size < 1 or a.tensor_size < 4:
        p.error("--image-size must be >= 1 and --tensor-size >= 4")
    if not 0 < a.kill_at < 1:
        p.error("--kill-at must be between 0 and 1")
    live = not a.no_live and sys.stdout.isatty()
    spin = a.spin_us
    if spin is None:  # spinning only pays when every process has a core of its own
        spin = ringwire.DEFAULT_SPIN_US if (os.cpu_count() or 1) > a.workers + 1 else 0.0
    return Options(
        a.duration,
        a.workers,
        a.concurrency,
        a.image_size,
        a.tensor_size,
        a.kill,
        a.kill_at,
        live,
        spin,
    )


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


# -- statistics ----------------------------------------------------------------------------


@dataclass
class WorkerStats:
    name: str
    answered: int = 0
    failed: int = 0  # lost with a killed worker, or cut off by a forced stop
    wrong: int = 0  # answers that did not check out
    loaned_bytes: int = 0  # tensors loaned from a slot, filled in place: zero copies
    copied_bytes: int = 0  # arrays copied once into a slot, then passed by reference
    reply_bytes: int = 0  # reply tensors the worker loaned from its own slots
    inline_bytes: int = 0  # small arrays that travelled inside the record
    receipts: int = 0  # send_tracked receipts seen consumed
    latencies: list[float] = field(default_factory=list)  # seconds
    recent: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=4096))
    last_answered: int = 0
    rate: float = 0.0

    @property
    def zero_copy_bytes(self) -> int:
        return self.loaned_bytes + self.copied_bytes + self.reply_bytes


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def _pct(values: Sequence[float] | np.ndarray, q: float) -> float:
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values), q)) * 1e3


def _human(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


class _Session:
    """One connection to one worker process: the requests in flight on it."""

    def __init__(self, chan: ringwire.Channel) -> None:
        self.chan = chan
        self.pending: dict[int, list[Any]] = {}  # id -> [event, reply or None]
        self.broken = False

    def fail_all(self) -> None:
        self.broken = True
        for slot in self.pending.values():
            slot[0].set()


class Demo:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.stats = {f"worker-{i}": WorkerStats(f"worker-{i}") for i in range(opts.workers)}
        self.log: list[str] = []  # events, as lines
        self.printed = 0
        self.kill_lines: list[str] = []
        self.draining = False
        self.interrupted: str | None = None
        self.t0 = time.monotonic()
        self.elapsed = 0.0
        self.final: dict[str, ringwire.ChannelStatistics] = {}
        self.worker_pids: set[int] = set()
        self._ids = itertools.count()
        self._kill: tuple[str, int, float] | None = None  # name, pid, when
        self._topo: runtime.Topology | None = None
        self._stopping: anyio.Event | None = None
        self._draining: anyio.Event | None = None
        rng = np.random.default_rng(7)
        s, t = opts.image_size, opts.tensor_size
        self.images = [rng.random((s, s, 3), dtype=np.float32) for _ in range(4)]
        self.image_means = [float(x.mean(dtype=np.float64)) for x in self.images]
        self.tensor_shape = (3, t, t)
        self.tensor_nbytes = 3 * t * t * 2  # bfloat16
        self.tensors: list[Any] = []
        self.tensor_means: list[float] = []
        self.torch: Any = None
        # importing torch takes a second or two: do it while the workers start
        self.prep = threading.Thread(target=self._prepare_tensors, name="demo-prep", daemon=True)

    def _prepare_tensors(self) -> None:
        import torch

        gen = torch.Generator().manual_seed(7)
        for _ in range(4):
            x = torch.randn(self.tensor_shape, generator=gen).to(torch.bfloat16)
            self.tensors.append(x)
            self.tensor_means.append(float(x.float().mean()))
        self.torch = torch

    # -- the topology -------------------------------------------------------------------

    def slot_configs(self) -> tuple[ringwire.SlotConfig, ringwire.SlotConfig]:
        """(the front's send pool, a worker's send pool), sized for the payloads."""
        k = self.opts.concurrency

        def size(n: int) -> int:
            return max(64 * _KiB, -(-n // (64 * _KiB)) * 64 * _KiB)

        img = self.images[0].nbytes
        ten = self.tensor_nbytes
        prev = 3 * (self.opts.tensor_size // 4) ** 2 * 2
        classes = [ringwire.SlotClass(size(img), 2 * k + 2), ringwire.SlotClass(size(ten), k + 2)]
        if size(img) == size(ten):
            classes = [ringwire.SlotClass(size(img), 3 * k + 4)]
        front = ringwire.SlotConfig(classes=tuple(classes), threshold=64 * _KiB)
        back = ringwire.SlotConfig(
            classes=(ringwire.SlotClass(size(prev), k + 2),), threshold=64 * _KiB
        )
        return front, back

    def topology(self) -> runtime.Topology:
        front, back = self.slot_configs()
        workers = [
            runtime.Worker(
                name,
                WORKER_ENTRY,
                policy=runtime.Restart(max_restarts=3, window=60.0, backoff=0.2),
                slots=back,
                spin_us=self.opts.spin_us,
                ready="explicit",
                options={"preview_every": 2},
            )
            for name in self.stats
        ]
        return runtime.Topology(
            workers, slots=front, drain_timeout=5.0, kill_timeout=2.0, on_event=self.on_event
        )

    def on_event(self, ev: runtime.WorkerEvent) -> None:
        t = time.monotonic() - self.t0
        if isinstance(ev, runtime.WorkerReady):
            self.worker_pids.add(ev.pid)
            if ev.incarnation:
                line = f"{ev.name} restarted: pid {ev.pid}, ready in {ev.startup_s:.2f} s"
                self.kill_lines.append(line)
                self.log.append(f"{t:6.2f}s  {line}")
        elif isinstance(ev, runtime.WorkerExit):
            if not ev.expected:
                line = ev.describe()
                if self._kill is not None and self._kill[1] == ev.pid:
                    line += f"; detected {(ev.at - self._kill[2]) * 1e3:.1f} ms after the kill"
                line += f"; slots in use on its connection now: {ev.slots_in_use_after}"
                self.kill_lines.append(line)
                self.log.append(f"{t:6.2f}s  {line}")
        elif isinstance(ev, runtime.WorkerRestarting):
            self.log.append(f"{t:6.2f}s  {ev.describe()}")
        elif isinstance(ev, runtime.TopologyStopping):
            hint = "  (again to force)" if ev.reason.endswith(" received") and not ev.force else ""
            self.log.append(f"{t:6.2f}s  {ev.describe()}{hint}")
            if ev.reason.endswith(" received"):
                self.interrupted = ev.reason.split()[0]
            if self._stopping is not None:
                self._stopping.set()

    # -- the front ----------------------------------------------------------------------

    async def main(self, topo: runtime.Topology) -> None:
        self._topo = topo
        await anyio.to_thread.run_sync(self.prep.join)
        if self.torch is None:
            raise RuntimeError("preparing the demo's tensors failed (is torch installed?)")
        self._stopping = anyio.Event()
        self._draining = anyio.Event()
        if topo.stopping:
            self._stopping.set()
        self.t0 = time.monotonic()
        async with anyio.create_task_group() as outer:
            outer.start_soon(self._view)
            if self.opts.kill:
                outer.start_soon(self._killer)
            async with anyio.create_task_group() as drivers:
                drivers.start_soon(self._clock)
                for name in self.stats:
                    drivers.start_soon(self._drive, name)
            self.elapsed = time.monotonic() - self.t0
            self._snapshot()
            outer.cancel_scope.cancel()

    def _snapshot(self) -> None:
        assert self._topo is not None
        for name in self.stats:
            try:
                self.final[name] = self._topo.channel(name).statistics()
            except runtime.WorkerGone:
                pass

    async def _clock(self) -> None:
        assert self._stopping is not None
        with anyio.move_on_after(self.opts.duration):
            await self._stopping.wait()
        self.draining = True  # stop issuing; the drivers finish what is in flight
        assert self._draining is not None
        self._draining.set()

    async def _killer(self) -> None:
        assert self._topo is not None
        await anyio.sleep(self.opts.duration * self.opts.kill_at)
        name = next(iter(self.stats))
        pid = self._topo.status()[name].pid
        if pid is None or self.draining:
            return
        self._kill = (name, pid, time.monotonic())
        t = time.monotonic() - self.t0
        self.log.append(f"{t:6.2f}s  kill -9 {name} (pid {pid})")
        self.kill_lines.append(f"kill -9 {name} (pid {pid}) at t={t:.2f} s")
        os.kill(pid, signal.SIGKILL)

    async def _drive(self, name: str) -> None:
        assert self._topo is not None
        chan: ringwire.Channel | None = None
        while not self.draining:
            chan = await self._next_channel(name, chan)
            if chan is None:
                return
            sess = _Session(chan)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._receive, name, sess)
                async with anyio.create_task_group() as senders:
                    for _ in range(self.opts.concurrency):
                        senders.start_soon(self._send_loop, name, sess)
                tg.cancel_scope.cancel()

    async def _next_channel(
        self, name: str, old: ringwire.Channel | None
    ) -> ringwire.Channel | None:
        """The worker's channel (a restarted worker's new one), or ``None`` if it is not
        coming back or the run is over first."""
        assert self._topo is not None and self._draining is not None
        topo, draining, got = self._topo, self._draining, []

        async def wait_channel() -> None:
            try:
                got.append(await topo.wait_channel(name, replacing=old))
            except runtime.WorkerGone:
                pass
            tg.cancel_scope.cancel()

        async def wait_drain() -> None:
            await draining.wait()
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_channel)
            tg.start_soon(wait_drain)
        return got[0] if got and not self.draining else None

    async def _receive(self, name: str, sess: _Session) -> None:
        try:
            while True:
                reply = await sess.chan.receive()
                slot = sess.pending.pop(reply["id"], None)
                if slot is not None:
                    slot[1] = reply
                    slot[0].set()
                del reply
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            sess.fail_all()
        except ringwire.DecodeError as exc:  # never expected: count the session as broken
            print(f"ringwire demo: {name}: undecodable reply: {exc}", file=sys.stderr)
            sess.fail_all()

    async def _send_loop(self, name: str, sess: _Session) -> None:
        st = self.stats[name]
        chan = sess.chan
        torch = self.torch
        while not self.draining and not sess.broken:
            i = next(self._ids)
            kind = KINDS[i % len(KINDS)]
            req: dict[str, Any] = {"id": i, "kind": kind}
            expect: dict[str, Any] = {}
            receipt: ringwire.Receipt | None = None
            slot: list[Any] = [anyio.Event(), None]
            try:
                if kind in ("text", "mixed"):
                    req["text"] = f"request {i} from the front"
                    tiny = np.arange(16, dtype=np.float32) + (i % 7)
                    req["tiny"] = tiny
                    expect["text"] = req["text"].upper()
                    expect["tiny"] = float(tiny.sum())
                    st.inline_bytes += tiny.nbytes
                if kind in ("image", "mixed"):
                    k = i % len(self.images)
                    req["image"] = self.images[k]  # copied once into a slot by send()
                    expect["image_mean"] = self.image_means[k]
                    st.copied_bytes += self.images[k].nbytes
                if kind == "tensor":
                    k = i % len(self.tensors)
                    t = await chan.loan(self.tensor_shape, torch.bfloat16)
                    t.copy_(self.tensors[k])  # filled in place: the only write
                    req["tensor"] = t
                    del t
                    expect["tensor_mean"] = self.tensor_means[k]
                    st.loaned_bytes += self.tensor_nbytes
                sess.pending[i] = slot
                start = time.perf_counter()
                if kind == "tensor" and i % 8 == 2:
                    receipt = await chan.send_tracked(req)  # ... and ask to hear it was consumed
                else:
                    await chan.send(req)
                del req
                await slot[0].wait()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream):
                sess.pending.pop(i, None)
                st.failed += 1
                return
            reply, slot[1] = slot[1], None
            if reply is None:  # the session broke with this request in flight
                st.failed += 1
                return
            elapsed = time.perf_counter() - start
            ok = all(
                (
                    math.isclose(reply.get(k), v, rel_tol=1e-5, abs_tol=1e-6)
                    if isinstance(v, float)
                    else reply.get(k) == v
                )
                for k, v in expect.items()
            )
            preview = reply.get("preview")
            if preview is not None:
                c, h, w = preview.shape
                st.reply_bytes += c * h * w * 2
                ok = ok and preview.dtype == torch.bfloat16
            del preview, reply  # the worker's slot goes back to it (finalizer)
            if receipt is not None:
                await receipt.wait()  # the worker dropped the request: its slots came back
                st.receipts += 1
            st.answered += 1
            st.wrong += not ok
            st.latencies.append(elapsed)
            st.recent.append((time.monotonic(), elapsed))

    # -- the view -------------------------------------------------------------------------

    def _slots(self, name: str) -> tuple[int, int]:
        """(front slots in use on this worker's connection, worker slots we hold)."""
        assert self._topo is not None
        try:
            s = self._topo.channel(name).statistics()
        except runtime.WorkerGone:
            return 0, 0
        return s.slots_in_use, s.slot_arrays_held

    def _rows(self) -> list[tuple[str, ...]]:
        assert self._topo is not None
        status = self._topo.status()
        now = time.monotonic()
        rows: list[tuple[str, ...]] = []
        for name, st in self.stats.items():
            ws = status[name]
            recent = [lat for (t, lat) in st.recent if t > now - 2.0]
            used, held = self._slots(name)
            rows.append(
                (
                    name,
                    str(ws.pid or "-"),
                    ws.state,
                    str(ws.restarts),
                    f"{st.answered}",
                    f"{st.rate:,.0f}",
                    _ms(_pct(recent, 50)),
                    _ms(_pct(recent, 99)),
                    _human(st.zero_copy_bytes),
                    f"{used} + {held}",
                )
            )
        return rows

    def _tick_rates(self, dt: float) -> None:
        for st in self.stats.values():
            st.rate = (st.answered - st.last_answered) / dt if dt > 0 else 0.0
            st.last_answered = st.answered

    async def _view(self) -> None:
        if self.opts.live:
            try:
                await self._view_rich()
                return
            except ImportError:  # pragma: no cover - rich is a dependency
                pass
        await self._view_lines()

    async def _view_lines(self) -> None:
        last = time.monotonic()
        while True:
            await anyio.sleep(1.0)
            now = time.monotonic()
            self._tick_rates(now - last)
            last = now
            total = sum(st.answered for st in self.stats.values())
            rate = sum(st.rate for st in self.stats.values())
            recent = [lat for st in self.stats.values() for (t, lat) in st.recent if t > now - 1.0]
            zc = sum(st.zero_copy_bytes for st in self.stats.values())
            slots = [self._slots(n) for n in self.stats]
            print(
                f"t={now - self.t0:5.1f}s  answered={total}  rec/s={rate:,.0f}  "
                f"p50={_ms(_pct(recent, 50))}ms  p99={_ms(_pct(recent, 99))}ms  "
                f"zero-copy={_human(zc)}  slots in use={sum(u for u, _ in slots)}"
                f"+{sum(h for _, h in slots)}",
                flush=True,
            )
            self._print_new_events()

    def _print_new_events(self) -> None:
        while self.printed < len(self.log):
            print("  " + self.log[self.printed], flush=True)
            self.printed += 1

    async def _view_rich(self) -> None:
        from rich.console import Group
        from rich.live import Live
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        def render() -> Group:
            now = time.monotonic()
            t = min(now - self.t0, self.opts.duration)
            table = Table(
                title="ringwire demo: front -> workers over shared-memory rings and slots",
                title_justify="left",
            )
            for col, just in (
                ("worker", "left"),
                ("pid", "right"),
                ("state", "left"),
                ("restarts", "right"),
                ("answered", "right"),
                ("rec/s", "right"),
                ("p50 ms", "right"),
                ("p99 ms", "right"),
                ("zero-copy", "right"),
                ("slots in use", "right"),
            ):
                table.add_column(col, justify=just)  # type: ignore[arg-type]
            for row in self._rows():
                table.add_row(*row)
            recent = [
                lat for st in self.stats.values() for (ts, lat) in st.recent if ts > now - 2.0
            ]
            table.add_row(
                "total",
                "",
                "",
                str(sum(int(r[3]) for r in self._rows())),
                str(sum(st.answered for st in self.stats.values())),
                f"{sum(st.rate for st in self.stats.values()):,.0f}",
                _ms(_pct(recent, 50)),
                _ms(_pct(recent, 99)),
                _human(sum(st.zero_copy_bytes for st in self.stats.values())),
                "",
                style="bold",
            )
            head = Text(
                f"{t:5.1f} / {self.opts.duration:g} s"
                + ("   draining..." if self.draining else "")
                + "   (slots in use: front slots lent + worker slots held; Ctrl-C stops)"
            )
            bar = ProgressBar(total=self.opts.duration, completed=t, width=60)
            log = Text("\n".join(self.log[-6:]) or "no events yet", style="dim")
            return Group(head, bar, table, log)

        last = time.monotonic()
        with Live(render(), auto_refresh=False, transient=False) as live:
            while True:
                await anyio.sleep(0.25)
                now = time.monotonic()
                if now - last >= 1.0:
                    self._tick_rates(now - last)
                    last = now
                live.update(render(), refresh=True)


# -- summary and entry point -----------------------------------------------------------------


def _summary(demo: Demo, topo: runtime.Topology) -> list[str]:
    stats = list(demo.stats.values())
    lat = np.asarray([x for st in stats for x in st.latencies])
    answered = sum(st.answered for st in stats)
    elapsed = demo.elapsed or (time.monotonic() - demo.t0)
    loaned = sum(st.loaned_bytes for st in stats)
    copied = sum(st.copied_bytes for st in stats)
    replies = sum(st.reply_bytes for st in stats)
    inline = sum(st.inline_bytes for st in stats)
    lines = [
        f"requests answered   {answered:,} in {elapsed:.1f} s = {answered / max(elapsed, 1e-9):,.0f} "
        f"records/s; failed {sum(st.failed for st in stats)}; wrong answers "
        f"{sum(st.wrong for st in stats)}",
        f"round trip          p50 {_pct(lat, 50):.2f} ms   p99 {_pct(lat, 99):.2f} ms   "
        f"max {_pct(lat, 100):.2f} ms",
        f"zero-copy           {_human(loaned + copied + replies)} by slot reference: "
        f"{_human(loaned)} loaned tensors (no copy), {_human(copied)} numpy images (one "
        f"copy into the slot), {_human(replies)} reply tensors loaned by the workers; "
        f"{_human(inline)} of tiny arrays inline",
    ]
    releases = sum(s.releases_received for s in demo.final.values())
    in_use = sum(s.slots_in_use for s in demo.final.values())
    held = sum(s.slot_arrays_held for s in demo.final.values())
    receipts = sum(st.receipts for st in stats)
    if demo.final:
        lines.append(
            f"finalizers          {releases:,} slot releases acknowledged by the workers' "
            f"finalizers on the live connections; {receipts} send_tracked receipts seen "
            f"consumed; slots in use at the end: {in_use} lent, {held} held"
        )
    for name, ws in topo.status().items():
        lines.append(f"{name:<19} restarts {ws.restarts}, last pid {ws.pid}")
    for line in demo.kill_lines:
        lines.append(f"--kill              {line}")
    if topo.stop_reason:
        lines.append(f"stop                {topo.stop_reason}")
    return lines


def run(argv: Sequence[str] | None = None) -> int:
    """The demo; returns the process exit status (0: clean, no leaks)."""
    opts = parse_args(argv)
    # the demo shows the runtime's events itself (log lines would tear the live view)
    logging.getLogger("ringwire.runtime").setLevel(logging.ERROR)
    shm_before = shm_names()
    socks_before = socket_files()
    demo = Demo(opts)
    front, _ = demo.slot_configs()
    print(
        f"ringwire demo: {opts.workers} worker(s) x {opts.concurrency} requests in flight for "
        f"{opts.duration:g} s; images {opts.image_size}x{opts.image_size}x3 float32 "
        f"({_human(demo.images[0].nbytes)}, copied into slots), tensors 3x{opts.tensor_size}"
        f"x{opts.tensor_size} bfloat16 ({_human(demo.tensor_nbytes)}, loaned); "
        f"front pool per worker: {front.describe()}",
        flush=True,
    )
    topo = demo.topology()
    rc = 0
    demo.prep.start()
    try:
        topo.run(demo.main)
    except runtime.WorkerStartError as exc:
        print(f"ringwire demo: the workers did not start: {exc}", file=sys.stderr)
        rc = 2
    for line in demo.log[demo.printed :] if not opts.live else []:
        print("  " + line)
    print()
    print("summary")
    for line in _summary(demo, topo):
        print("  " + line)

    # the leak proof: everything this run created is gone
    pids = {os.getpid()} | {ev.pid for ev in topo.history if hasattr(ev, "pid")}
    children = multiprocessing.active_children()
    shm_after = shm_names()
    socks_after = socket_files()
    ours = sorted(n for n in shm_after - shm_before if _creator(n) in pids)
    others = len(shm_after - shm_before) - len(ours)
    new_socks = sorted(socks_after - socks_before)
    print(
        f"  leak check          /dev/shm rw.* names: {len(shm_before)} before, "
        f"{len(shm_after)} after ({len(ours)} of this run left behind"
        + (f"; {others} new from other processes" if others else "")
        + f"); socket files: {len(socks_before)} before, {len(socks_after)} after; "
        f"worker processes alive: {len(children)}"
    )
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
