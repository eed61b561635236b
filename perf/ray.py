"""Ray benchmark: a round trip front <-> Ray worker over the ringwire channel, against
the same round trip as a Ray actor method call.

Run from the repository root (``pip install 'ringwire[ray]'``)::

    python -m perf.ray              # ~1 minute on a 2-core VM
    python -m perf.ray --quick      # ~30 s
    python -m perf.ray --json perf/results/ray.json

The question: once Ray has placed a worker, what does a request -> reply cost over the
ringwire channel a :class:`ringwire.runtime.RayWorker` gets (shared memory: the actor
is on this host; and forced to TCP, ``transport="tcp"``, as for an actor on another
node), against ``await actor.echo.remote(x)`` on a plain Ray actor (the transport
vLLM's executor stopped using for its steps)?  Payloads: a ~100-byte record and a
4 MiB float32 array; every peer echoes what it gets.  All peers run in one Ray
instance (a local one started here, or ``RAY_ADDRESS``'s), side by side, in
interleaved rounds (the first peer rotated each round), so a noisy machine's drift
lands on all alike; compare the ratios (``÷ ringwire shm``), not the microseconds.
Also: the time from entering ``async with topo`` to its Ray workers ready (both; each
alone), against creating a plain actor and getting its first reply.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf._common import fmt_ms, interleaved_async, machine_info, print_table, summarize

ROOT = Path(__file__).resolve().parent.parent
RECORD = {"id": 7, "op": "step", "payload": b"x" * 64}  # ~100 bytes of msgpack
ARRAY = np.arange(1 << 20, dtype=np.float32)  # 4 MiB


async def echo(ctx: Any) -> None:
    """The Ray workers' entry: every request back as it came."""
    async for request in ctx.channel:
        await ctx.channel.send(request)
        del request


class Echo:
    """The plain Ray actor (``ray.remote(Echo)``)."""

    def echo(self, x: Any) -> Any:
        return x


async def main(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from ringwire import runtime

    tmp = None
    if not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
        tmp = tempfile.mkdtemp(prefix="rwray-", dir="/tmp")  # short: Ray's socket paths
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # fmt: skip
        ray.init(
            num_cpus=4, object_store_memory=200 << 20, include_dashboard=False,
            _temp_dir=tmp, log_to_driver=False,
        )  # fmt: skip
    try:
        opts = {"num_cpus": 0}
        workers = [
            runtime.RayWorker("shm", "perf.ray:echo", ray_options=opts),
            runtime.RayWorker("tcp", "perf.ray:echo", ray_options=opts, transport="tcp"),
        ]
        starts: dict[str, list[float]] = {
            "topology with 2 RayWorkers, shm + tcp (async with -> all ready)": [],
            "topology with 1 RayWorker, shm": [],
            "topology with 1 RayWorker, tcp": [],
            "plain Ray actor (create -> first reply)": [],
        }
        kinds = list(zip(starts, [workers, workers[:1], workers[1:]]))
        for _ in range(args.starts):
            t0 = time.perf_counter()
            a = ray.remote(Echo).options(num_cpus=0).remote()
            await a.echo.remote(1)
            starts["plain Ray actor (create -> first reply)"].append(time.perf_counter() - t0)
            ray.kill(a)
            for label, which in kinds:
                t0 = time.perf_counter()
                async with runtime.Topology(which, ready_timeout=120):
                    starts[label].append(time.perf_counter() - t0)
        actor = ray.remote(Echo).options(num_cpus=0).remote()
        await actor.echo.remote(1)
        results: dict[str, Any] = {"startup_s": starts}
        async with runtime.Topology(workers, ready_timeout=120) as topo:
            shm, tcp = topo.channel("shm"), topo.channel("tcp")

            def over(chan: Any, x: Any, n: int) -> Any:
                async def peer() -> list[int]:
                    out = []
                    for _ in range(n):
                        t = time.perf_counter_ns()
                        await chan.send(x)
                        reply = await chan.receive()
                        out.append(time.perf_counter_ns() - t)
                        del reply
                    return out

                return peer

            def call(x: Any, n: int) -> Any:
                async def peer() -> list[int]:
                    out = []
                    for _ in range(n):
                        t = time.perf_counter_ns()
                        reply = await actor.echo.remote(x)
                        out.append(time.perf_counter_ns() - t)
                        del reply
                    return out

                return peer

            for label, x, n in (("100 B record", RECORD, args.n_small), ("4 MiB array", ARRAY, args.n_large)):  # fmt: skip
                samples = await interleaved_async(
                    {
                        "ringwire shm (RayWorker, same host)": over(shm, x, n),
                        "ringwire tcp (RayWorker, transport='tcp')": over(tcp, x, n),
                        "Ray actor call (await actor.echo.remote(x))": call(x, n),
                    },
                    rounds=args.rounds,
                    warmup=1,
                )
                results[label] = {k: summarize(v).to_dict() for k, v in samples.items()}
        ray.kill(actor)
        return results
    finally:
        if tmp is not None:
            ray.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


def report(results: dict[str, Any]) -> None:
    info = machine_info(["ray", "ringwire"])
    load = os.getloadavg()
    print(f"CPU: {info['cpu']} ({info['cpus_usable']} usable), Python {info['python']}, "
          f"Ray {info['ray']}; load average {load[0]:.1f} (other work on the machine counts)")  # fmt: skip
    for label in ("100 B record", "4 MiB array"):
        peers = results[label]
        base = peers["ringwire shm (RayWorker, same host)"]["median_ns"]
        rows = [
            [name, fmt_ms(s["median_ms"]), fmt_ms(s["p99_ms"]), f"{s['median_ns'] / base:.1f}x"]
            for name, s in peers.items()
        ]
        print(f"\nround trip, {label}")
        print_table(["peer", "median (ms)", "p99 (ms)", "÷ ringwire shm"], rows)
    print("\nstart-up")
    rows = [[k, f"{min(v):.2f} s", f"{max(v):.2f} s"] for k, v in results["startup_s"].items()]
    print_table(["what", "best", "worst"], rows)


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.rounds, args.n_small, args.n_large, args.starts = (
        (5, 100, 10, 1) if args.quick else (10, 200, 20, 3)
    )
    results = asyncio.run(main(args))
    report(results)
    if args.json:
        import json

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine_info(["ray"]), "results": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    cli()
