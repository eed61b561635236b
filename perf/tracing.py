"""Tracing benchmark: what OpenTelemetry costs a call.

Run from the repository root::

    python -m perf.tracing            # ~1.5 minutes on a 2-core VM
    python -m perf.tracing --quick    # ~40 s
    python -m perf.tracing --json perf/results/tracing.json

The question: does a call get slower when ``opentelemetry-api`` is installed but no
span is current, and what does a traced call cost?  Three modes, side by side in one
run, each a client process (one asyncio loop) and its server child (``serve``, echo):

* **absent** -- OpenTelemetry cannot be imported in either process (a meta-path finder
  refuses it, as in a venv without it): the envelope is the five-position one;
* **idle** -- both processes import it and run the SDK (a ``TracerProvider`` with a
  batch processor), but no span is current as the calls are made: a caller pays one
  look at the current span, and nothing goes on the wire;
* **traced** -- each caller task calls within a span of its own, the SDK recording:
  every call is a ``ringwire.call`` span, its CALL carries the trace context, the
  server runs the handler in a ``ringwire.serve Req`` span and answers with timings.
  The spans go to a batch processor whose exporter drops them (no I/O measured).

Per mode: calls/s at 64 concurrent callers (median over rounds of N calls / wall time)
and the parked round trip (one caller, calls back to back over a connection with
``spin_us=0``, so both sides park between records: median and p99 per call, pooled).
Every call carries the ~100-byte :class:`perf.peers.Req` record.  Rounds run
interleaved across the modes (rotating who goes first), so a noisy machine's drift
lands on all alike; compare the ratios (``÷ absent``).  The targets: idle within
noise of absent; traced at most 15 % fewer calls/s at 64 callers.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf._common import format_table, machine_info
from perf.peers.base import SETUP_TIMEOUT_S, Req, make_record, proc_cpu_seconds

MODES = ("absent", "idle", "traced")
CALLERS = 64
SPAWN = mp.get_context("spawn")


def _setup(mode: str) -> None:
    """Make this process one of ``mode``'s (first thing in each child)."""
    if mode == "absent":
        import importlib.abc

        class _NoOtel(importlib.abc.MetaPathFinder):
            def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
                if name == "opentelemetry" or name.startswith("opentelemetry."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, _NoOtel())
        return
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class _Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    # a queue deep enough that no span is dropped (a dropped span costs less)
    provider.add_span_processor(BatchSpanProcessor(_Drop(), max_queue_size=1 << 17))
    trace.set_tracer_provider(provider)


def _server(mode: str, fast: Any, parked: Any) -> None:
    _setup(mode)
    import anyio

    import ringwire

    async def echo(req: Req) -> Req:
        return req

    async def main() -> None:
        async with (
            await fast.connect(handshake_timeout=SETUP_TIMEOUT_S) as a,
            await parked.connect(spin_us=0, handshake_timeout=SETUP_TIMEOUT_S) as b,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(functools.partial(ringwire.serve, a, echo, concurrency=CALLERS, type=Req))
            await ringwire.serve(b, echo, type=Req)  # returns when the client closes
            tg.cancel_scope.cancel()

    anyio.run(main)


def _client(mode: str, ctrl: Any) -> None:
    _setup(mode)
    import asyncio

    import ringwire

    fast_a, fast_b = ringwire.pair()
    parked_a, parked_b = ringwire.pair()
    server = SPAWN.Process(target=_server, args=(mode, fast_b, parked_b), daemon=True)
    server.start()
    server_pid = server.pid
    assert server_pid is not None
    if mode == "traced":
        from opentelemetry import trace

        tracer = trace.get_tracer("perf.tracing")
    rec = make_record(7)

    async def main() -> None:
        fast = await fast_a.connect(handshake_timeout=SETUP_TIMEOUT_S)
        parked = await parked_a.connect(spin_us=0, handshake_timeout=SETUP_TIMEOUT_S)
        async with (
            ringwire.Client(fast, type=Req) as many,
            ringwire.Client(parked, type=Req) as one,
        ):
            ctrl.send("ready")
            loop = asyncio.get_running_loop()
            while True:
                cmd = await loop.run_in_executor(None, ctrl.recv)
                if cmd is None:
                    return
                n_calls, n_rtt = cmd
                left = [n_calls]

                async def caller(left: list[int] = left) -> None:
                    while left[0] > 0:
                        left[0] -= 1
                        await many.call(rec, timeout=30)

                async def traced_caller(left: list[int] = left) -> None:
                    with tracer.start_as_current_span("caller"):
                        await caller(left)

                body = traced_caller if mode == "traced" else caller
                cpu0 = proc_cpu_seconds(os.getpid()) + proc_cpu_seconds(server_pid)
                t0 = time.perf_counter()
                await asyncio.gather(*(body() for _ in range(CALLERS)))
                rate = n_calls / (time.perf_counter() - t0)
                cpu = proc_cpu_seconds(os.getpid()) + proc_cpu_seconds(server_pid) - cpu0
                rtts = []
                for _ in range(n_rtt):
                    if mode == "traced":
                        with tracer.start_as_current_span("one"):
                            t = time.perf_counter_ns()
                            await one.call(rec, timeout=30)
                    else:
                        t = time.perf_counter_ns()
                        await one.call(rec, timeout=30)
                    rtts.append(time.perf_counter_ns() - t)
                ctrl.send((rate, cpu / n_calls * 1e6, rtts))

    try:
        asyncio.run(main())
    finally:
        server.join(30)
        if server.is_alive():
            server.kill()


def _pct(samples: list[int], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] / 1000.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 short rounds")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    rounds, n_calls, n_rtt = (3, 3000, 300) if args.quick else (7, 8000, 1000)

    kids: dict[str, tuple[Any, Any]] = {}
    try:
        for mode in MODES:
            parent, child = SPAWN.Pipe()
            p = SPAWN.Process(target=_client, args=(mode, child))
            p.start()
            kids[mode] = (p, parent)
        for mode, (_, ctrl) in kids.items():
            if not ctrl.poll(SETUP_TIMEOUT_S) or ctrl.recv() != "ready":
                raise SystemExit(f"the {mode} client did not start")
        rates: dict[str, list[float]] = {m: [] for m in MODES}
        rtts: dict[str, list[int]] = {m: [] for m in MODES}
        cpus: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(rounds + 1):  # round 0 warms up
            order = MODES[r % 3 :] + MODES[: r % 3]
            for mode in order:
                ctrl = kids[mode][1]
                ctrl.send((n_calls, n_rtt))
                rate, cpu, samples = ctrl.recv()
                if r:
                    rates[mode].append(rate)
                    cpus[mode].append(cpu)
                    rtts[mode].extend(samples)
            print(f"round {r}/{rounds} done", file=sys.stderr)
    finally:
        for _, ctrl in kids.values():
            try:
                ctrl.send(None)
            except OSError:
                pass
        for p, _ in kids.values():
            p.join(30)
            if p.is_alive():
                p.kill()

    base_rate = statistics.median(rates["absent"])
    base_rtt = statistics.median(rtts["absent"]) / 1000.0
    base_cpu = statistics.median(cpus["absent"])
    rows = []
    out: dict[str, Any] = {"machine": machine_info(["opentelemetry-api", "opentelemetry-sdk"])}
    for mode in MODES:
        rate = statistics.median(rates[mode])
        cpu = statistics.median(cpus[mode])
        p50, p99 = statistics.median(rtts[mode]) / 1000.0, _pct(rtts[mode], 0.99)
        rows.append(
            [
                mode,
                f"{rate:,.0f}",
                f"{rate / base_rate:.3f}",
                f"{min(rates[mode]):,.0f}-{max(rates[mode]):,.0f}",
                f"{cpu:.1f}",
                f"{cpu / base_cpu:.3f}",
                f"{p50:.1f}",
                f"{p50 / base_rtt:.3f}",
                f"{p99:.1f}",
            ]
        )
        out[mode] = {
            "calls_per_s": rates[mode],
            "cpu_us_per_call": cpus[mode],
            "rtt_p50_us": p50,
            "rtt_p99_us": p99,
        }
    print(
        f"CPU: {out['machine'].get('cpu')}; {rounds} rounds of {n_calls} calls, {n_rtt} round trips"
    )
    print(
        format_table(
            [
                "mode",
                f"calls/s ({CALLERS} callers)",
                "÷ absent",
                "range",
                "CPU µs/call",
                "÷ absent",
                "parked RTT p50 µs",
                "÷ absent",
                "p99 µs",
            ],
            rows,
        )
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
