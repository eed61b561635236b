"""The demo's front process: load generator, live view, summary and leak proof.

torch is optional here as everywhere in ringwire: without it (or with ``--no-torch``)
the demo says so in one line and sends numpy float16 arrays, loaned from a slot and
filled in place, where it would send bfloat16 torch tensors; the workers answer them
with numpy previews.  Everything else -- images, slots, finalizers, ``--kill`` -- is the
same.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

import ringwire
from ringwire import runtime

from ._view import WIDTH, Row, human, live_view, ms, pct, startup_view, status_line, wrap_event

_KiB = 1 << 10
_MiB = 1 << 20
WORKER_ENTRY = "ringwire.demo._worker:serve"
KINDS = ("text", "image", "tensor", "mixed")  # the request mix, in turn
# a --kill run does not end before the killed worker's restart has served this long ...
SERVE_AGAIN_S = 1.0
# ... waiting at most this long past --duration for it (a restart imports torch afresh,
# next to a busy front and worker: seconds on a small machine)
EXTEND_MAX_S = 30.0


def torch_available() -> bool:
    """Can torch be imported?  (Asked without importing it, which takes seconds.)"""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a finder that refuses it, a broken package
        return False


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
    torch: bool = True  # send torch tensors (False: numpy arrays stand in for them)


def parse_args(argv: Sequence[str] | None) -> Options:
    p = argparse.ArgumentParser(
        prog="python -m ringwire.demo",
        description=(
            "A front process sends requests -- text records with tiny inline arrays, "
            "HxWx3 float32 numpy images copied once into shared-memory slots, 3xHxW "
            "bfloat16 torch tensors loaned from a slot and filled in place -- to worker "
            "processes that answer (some answers carry a tensor loaned from the worker's "
            "own slots).  Without torch, float16 numpy arrays stand in for the tensors.  "
            "Ctrl-C stops it gracefully; a second Ctrl-C forces."
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
        help="kill -9 worker-0 mid-run: shows detection, reclaim and restart (the run goes "
        f"on past --duration, {EXTEND_MAX_S:g} s at most, until the restarted worker has "
        "served again)",
    )
    p.add_argument(
        "--kill-at", type=float, default=0.4, help="when to kill, as a fraction of the duration"
    )
    p.add_argument(
        "--no-live", action="store_true", help="print a line per second instead of a live table"
    )
    p.add_argument(
        "--no-torch",
        action="store_true",
        help="numpy float16 arrays instead of torch tensors (the default without torch)",
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
        torch=not a.no_torch and torch_available(),
    )


# -- statistics ----------------------------------------------------------------------------


@dataclass
class WorkerStats:
    name: str
    answered: int = 0
    failed: int = 0  # cut off by a forced stop, or lost with a worker that died on its own
    lost: int = 0  # in flight on the worker --kill killed: lost with it
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


@dataclass
class _Restart:
    """The restart of the worker --kill killed."""

    name: str
    pid: int
    startup_s: float
    at: float  # monotonic, when it was ready
    answered_before: int  # the worker's answers (all incarnations) at that moment


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
        self.kill_lines: list[list[str]] = []  # the --kill story (or other deaths), in parts
        self.loading = False  # the load has begun (start-up is over)
        self.draining = False
        self.extending = False  # past --duration, waiting for a restart to serve
        self.interrupted: str | None = None
        self.started = time.monotonic()  # the program
        self.t0 = self.started  # the load
        self.startup_s = 0.0
        self.elapsed = 0.0
        self.load_end: float | None = None
        self.final: dict[str, ringwire.ChannelStatistics] = {}
        self.worker_pids: set[int] = set()
        self.ready_s: dict[str, float] = {}  # first start: spawn to ready
        self.restart: _Restart | None = None
        self.on_loading: Callable[[], None] | None = None  # the start-up view ends
        self._ids = itertools.count()
        self.killed: tuple[str, int, float] | None = None  # --kill's victim: name, pid, when
        self._killed_chan: ringwire.Channel | None = None
        self._topo: runtime.Topology | None = None
        self._stopping: anyio.Event | None = None
        self._draining: anyio.Event | None = None
        rng = np.random.default_rng(7)
        s, t = opts.image_size, opts.tensor_size
        self.images = [rng.random((s, s, 3), dtype=np.float32) for _ in range(4)]
        self.image_means = [float(x.mean(dtype=np.float64)) for x in self.images]
        self.tensor_shape = (3, t, t)
        self.tensor_nbytes = 3 * t * t * 2  # bfloat16 or float16
        self.tensors: list[Any] = []
        self.tensor_means: list[float] = []
        self.torch: Any = None
        self.tensor_dtype: Any = np.float16
        self.front_state = "importing torch, making tensors ..."
        self.front_ready_s: float | None = None
        self.torch_error: str | None = None
        # importing torch takes a second or two: do it while the workers start
        self.prep: threading.Thread | None = None
        if opts.torch:
            self.prep = threading.Thread(
                target=self._prepare_tensors, name="demo-prep", daemon=True
            )
        else:
            self._prepare_arrays()

    @property
    def uses_torch(self) -> bool:
        return self.torch is not None or (self.prep is not None and self.torch_error is None)

    @property
    def tensor_label(self) -> str:
        return "tensors" if self.uses_torch else "arrays"

    def _prepare_tensors(self) -> None:
        try:
            import torch

            gen = torch.Generator().manual_seed(7)
            tensors, means = [], []
            for _ in range(4):
                x = torch.randn(self.tensor_shape, generator=gen).to(torch.bfloat16)
                tensors.append(x)
                means.append(float(x.float().mean()))
        except Exception as exc:  # a broken torch: the demo goes on with numpy
            self.torch_error = f"{type(exc).__name__}: {exc}"
            self._prepare_arrays()
            return
        self.tensors, self.tensor_means = tensors, means
        self.tensor_dtype = torch.bfloat16
        self.torch = torch
        self._front_ready()

    def _prepare_arrays(self) -> None:
        rng = np.random.default_rng(7)
        self.tensors = [
            rng.standard_normal(self.tensor_shape, dtype=np.float32).astype(np.float16)
            for _ in range(4)
        ]
        self.tensor_means = [float(x.mean(dtype=np.float64)) for x in self.tensors]
        self.tensor_dtype = np.float16
        self._front_ready()

    def _front_ready(self) -> None:
        self.front_ready_s = time.monotonic() - self.started
        what = "torch imported, tensors made" if self.torch is not None else "numpy arrays made"
        self.front_state = f"ready in {self.front_ready_s:.2f} s ({what})"

    # -- the topology -------------------------------------------------------------------

    def slot_configs(self) -> tuple[ringwire.SlotConfig, ringwire.SlotConfig]:
        """(the front's send pool, a worker's send pool), sized for the payloads."""
        k = self.opts.concurrency

        def size(n: int) -> int:
            return max(64 * _KiB, -(-n // (64 * _KiB)) * 64 * _KiB)

        img = self.images[0].nbytes
        ten = self.tensor_nbytes
        prev = 3 * (self.opts.tensor_size // 4) ** 2 * 2
        classes = [
            ringwire.SlotClass(size(img), 2 * k + 2),
            ringwire.SlotClass(size(ten), k + 2),
        ]
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
                options={"preview_every": 2, "torch": self.opts.torch},
            )
            for name in self.stats
        ]
        self._topo = runtime.Topology(
            workers, slots=front, drain_timeout=5.0, kill_timeout=2.0, on_event=self.on_event
        )
        return self._topo

    def _stamp(self) -> str:
        if not self.loading:
            return f"{'start':>7}"
        return f"{time.monotonic() - self.t0:6.2f}s"

    def _event(self, line: str) -> None:
        self.log.append(f"{self._stamp()}  {line}")
        if not self.opts.live:
            self.print_new_events()

    def on_event(self, ev: runtime.WorkerEvent) -> None:
        if isinstance(ev, runtime.WorkerReady):
            self.worker_pids.add(ev.pid)
            if not ev.incarnation:
                self.ready_s[ev.name] = ev.startup_s
                self._event(f"{ev.name} ready in {ev.startup_s:.2f} s (pid {ev.pid})")
                return
            line = f"{ev.name} restarted: pid {ev.pid}, ready in {ev.startup_s:.2f} s"
            if self.killed is not None and self.killed[0] == ev.name and self.restart is None:
                self.restart = _Restart(
                    ev.name, ev.pid, ev.startup_s, ev.at, self.stats[ev.name].answered
                )
            else:
                self.kill_lines.append([line])
            self._event(line)
        elif isinstance(ev, runtime.WorkerExit):
            if not ev.expected:
                parts = ev.describe().split("; ")
                if self.killed is not None and self.killed[1] == ev.pid:
                    parts.append(f"detected {(ev.at - self.killed[2]) * 1e3:.1f} ms after the kill")
                parts.append(f"slots in use on its connection now: {ev.slots_in_use_after}")
                self.kill_lines.append(parts)
                self._event("; ".join(parts))
        elif isinstance(ev, runtime.WorkerRestarting):
            self._event(ev.describe())
        elif isinstance(ev, runtime.TopologyStopping):
            hint = "  (again to force)" if ev.reason.endswith(" received") and not ev.force else ""
            self._event(f"{ev.describe().splitlines()[0]}{hint}")
            if ev.reason.endswith(" received"):
                self.interrupted = ev.reason.split()[0]
            if self._stopping is not None:
                self._stopping.set()

    # -- the front ----------------------------------------------------------------------

    async def main(self, topo: runtime.Topology) -> None:
        self._topo = topo
        if self.prep is not None:
            await anyio.to_thread.run_sync(self.prep.join)
        self.startup_s = time.monotonic() - self.started
        if self.on_loading is not None:
            self.on_loading()
        if self.torch_error is not None:
            print(f"torch failed to import ({self.torch_error[:40]}): numpy only", flush=True)
        self._stopping = anyio.Event()
        self._draining = anyio.Event()
        if topo.stopping:
            self._stopping.set()
        self.t0 = time.monotonic()
        self.loading = True
        if not self.opts.live:
            print(
                f"ready after {self.startup_s:.1f} s; {self.opts.duration:g} s of load", flush=True
            )
        async with anyio.create_task_group() as outer:
            outer.start_soon(self._view)
            if self.opts.kill:
                outer.start_soon(self._killer)
            async with anyio.create_task_group() as drivers:
                drivers.start_soon(self._clock)
                for name in self.stats:
                    drivers.start_soon(self._drive, name)
            self.load_end = time.monotonic()
            self.elapsed = self.load_end - self.t0
            self._snapshot()
            outer.cancel_scope.cancel()

    def _snapshot(self) -> None:
        assert self._topo is not None
        for name in self.stats:
            try:
                self.final[name] = self._topo.channel(name).statistics()
            except runtime.WorkerGone:
                pass

    def recovered(self) -> bool:
        """Has the worker --kill killed served again?  (True when nothing was killed.)"""
        if self.killed is None:
            return True
        r = self.restart
        if r is None:
            return False
        served = time.monotonic() - r.at >= SERVE_AGAIN_S
        return served and self.stats[r.name].answered > r.answered_before

    async def _clock(self) -> None:
        assert self._stopping is not None
        with anyio.move_on_after(self.opts.duration):
            await self._stopping.wait()
        if self.opts.kill and not self._stopping.is_set() and not self.recovered():
            assert self.killed is not None
            self.extending = True
            self._event(
                f"waiting for {self.killed[0]}'s restart to serve ({EXTEND_MAX_S:g} s at most)"
            )
            with anyio.move_on_after(EXTEND_MAX_S):
                while not self.recovered() and not self._stopping.is_set():
                    await anyio.sleep(0.05)
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
        try:
            self._killed_chan = self._topo.channel(name)
        except runtime.WorkerGone:
            return
        self.killed = (name, pid, time.monotonic())
        t = time.monotonic() - self.t0
        self.kill_lines.append([f"kill -9 {name} (pid {pid}) at t={t:.2f} s"])
        self._event(f"kill -9 {name} (pid {pid})")
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

    def _failed(self, st: WorkerStats, sess: _Session) -> None:
        if self._killed_chan is not None and sess.chan is self._killed_chan:
            st.lost += 1
        else:
            st.failed += 1

    async def _send_loop(self, name: str, sess: _Session) -> None:
        st = self.stats[name]
        chan = sess.chan
        torch, dtype = self.torch, self.tensor_dtype
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
                    t = await chan.loan(self.tensor_shape, dtype)
                    if torch is not None:
                        t.copy_(self.tensors[k])  # filled in place: the only write
                    else:
                        np.copyto(t, self.tensors[k])
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
                self._failed(st, sess)
                return
            reply, slot[1] = slot[1], None
            if reply is None:  # the session broke with this request in flight
                self._failed(st, sess)
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
                ok = ok and preview.dtype == dtype
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

    def rows(self) -> tuple[list[Row], Row]:
        """The live table's rows and its total row."""
        assert self._topo is not None
        status = self._topo.status()
        now = time.monotonic()
        rows: list[Row] = []
        lats: list[float] = []
        restarts = 0
        for name, st in self.stats.items():
            ws = status[name]
            recent = [lat for (t, lat) in st.recent if t > now - 2.0]
            lats += recent
            restarts += ws.restarts
            used, held = self._slots(name)
            rows.append(
                Row(
                    name,
                    str(ws.pid or "-"),
                    ws.state,
                    str(ws.restarts),
                    f"{st.answered:,}",
                    f"{st.rate:,.0f}",
                    ms(pct(recent, 50)),
                    ms(pct(recent, 99)),
                    human(st.zero_copy_bytes),
                    f"{used}+{held}",
                )
            )
        total = Row(
            "total",
            "",
            "",
            str(restarts),
            f"{sum(st.answered for st in self.stats.values()):,}",
            f"{sum(st.rate for st in self.stats.values()):,.0f}",
            ms(pct(lats, 50)),
            ms(pct(lats, 99)),
            human(sum(st.zero_copy_bytes for st in self.stats.values())),
            "",
        )
        return rows, total

    def status_text(self) -> str:
        if self.load_end is not None:
            return "done"
        if self.draining:
            return "draining..."
        if self.extending and self.killed is not None:
            over = time.monotonic() - self.t0 - self.opts.duration
            return f"+{over:.1f} s: waiting for {self.killed[0]}'s restart to serve"
        return "running"

    def render_startup(self, width: int) -> Any:
        assert self._topo is not None
        workers = []
        for name, ws in self._topo.status().items():
            ready = self.ready_s.get(name)
            if ready is not None:
                state = f"ready in {ready:.2f} s"
            else:
                state = {"new": "spawning"}.get(ws.state, ws.state) + " ..."
            workers.append((name, f"pid {ws.pid}" if ws.pid else "", state))
        return startup_view(
            workers,
            self.front_state,
            elapsed=time.monotonic() - self.started,
            imports="numpy and torch" if self.opts.torch else "numpy",
            width=width,
        )

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
            recent = [lat for st in self.stats.values() for (t, lat) in st.recent if t > now - 1.0]
            slots = [self._slots(n) for n in self.stats]
            print(
                status_line(
                    elapsed=now - self.t0,
                    answered=sum(st.answered for st in self.stats.values()),
                    rate=sum(st.rate for st in self.stats.values()),
                    p50=pct(recent, 50),
                    p99=pct(recent, 99),
                    zero_copy=sum(st.zero_copy_bytes for st in self.stats.values()),
                    slots=(sum(u for u, _ in slots), sum(h for _, h in slots)),
                ),
                flush=True,
            )
            self.print_new_events()

    def print_new_events(self) -> None:
        while self.printed < len(self.log):
            for line in wrap_event("  " + self.log[self.printed], WIDTH, indent=12):
                print(line, flush=True)
            self.printed += 1

    def render_live(self, width: int) -> Any:
        rows, total = self.rows()
        return live_view(
            rows,
            total,
            width=width,
            elapsed=time.monotonic() - self.t0,
            duration=self.opts.duration,
            status=self.status_text(),
            log=self.log,
        )

    async def _view_rich(self) -> None:
        from rich.console import Console
        from rich.live import Live

        console = Console()
        last = time.monotonic()
        with Live(
            self.render_live(console.width), console=console, auto_refresh=False, transient=False
        ) as live:
            try:
                while True:
                    await anyio.sleep(0.25)
                    now = time.monotonic()
                    if now - last >= 1.0:
                        self._tick_rates(now - last)
                        last = now
                    live.update(self.render_live(console.width), refresh=True)
            finally:  # the last frame: the whole run
                live.update(self.render_live(console.width), refresh=True)
