"""GPU tensor handoff latency: ringwire Ext 5 vs ``torch.multiprocessing`` queues.

One producer process (this one) and one spawned consumer.  A *handoff* is: the
producer sends a CUDA tensor; the consumer receives it, reads one element on the GPU
(so the data is really usable there: ``t[-1].item()`` waits for every kernel the
handoff needs) and answers with that number.  We time send -> answer, medians and p99
over many handoffs, for:

* ``ringwire copy``  -- an ordinary CUDA tensor: one device-to-device copy into a slot
  of the producer's GPU pool, Ext 5 reference, consumer view of the pool;
* ``ringwire loan``  -- the tensor is a loan from the pool, filled in place: nothing is
  copied at all (the fill is outside the timed region);
* ``torch.mp queue`` -- ``torch.multiprocessing`` ``Queue.put(tensor)``: torch exports
  the tensor's CUDA block (IPC handle + ref counter) and the consumer rebuilds it.

Run: ``python -m perf.cuda [--quick] [--json PATH]`` on a machine with CUDA; without
CUDA it says so and exits 0.  Smaller is better.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

SIZES = [1 << 20, 1 << 30]  # 1 MiB and 1 GiB
ITERS = {1 << 20: 300, 1 << 30: 30}
QUICK_ITERS = {1 << 20: 100, 1 << 30: 10}


def _config() -> Any:
    from ringwire._pool.slotconfig import SlotConfig
    from ringwire._wire.slotlayout import SlotClass

    return SlotConfig(
        cuda_threshold=4096,
        cuda_classes=(SlotClass(1 << 20, 4), SlotClass(1 << 30, 2)),
    )


def _consume_ringwire(end: Any, n: int) -> None:
    with end.connect_sync(slots=_config()) as ch:
        for _ in range(n):
            t = ch.receive(timeout=120)
            ch.send(float(t[-1].item()))
            del t


def _consume_torch(q_in: Any, q_out: Any, n: int) -> None:
    for _ in range(n):
        t = q_in.get(timeout=120)
        q_out.put(float(t[-1].item()))
        del t


def _summary(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "median_us": statistics.median(s) * 1e6,
        "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6,
        "n": len(s),
    }


def run(quick: bool) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as tmp

    from ringwire._conn.pair import pair
    from ringwire._pool.cuda import drop_idle_pools

    iters = QUICK_ITERS if quick else ITERS
    total = sum(iters[s] for s in SIZES)
    ctx = tmp.get_context("spawn")
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cases": [],
    }

    # ringwire: copy and loan, both sizes, one consumer process
    a, b = pair()
    p = ctx.Process(target=_consume_ringwire, args=(b, 2 * total), daemon=True)
    p.start()
    rw: dict[tuple[str, int], list[float]] = {}
    try:
        with a.connect_sync(slots=_config()) as ch:
            for size in SIZES:
                n = iters[size]
                x = torch.ones(size // 4, device="cuda:0")
                copy: list[float] = []
                loan: list[float] = []
                for i in range(n):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    ch.send(x)
                    ch.receive(timeout=120)
                    copy.append(time.perf_counter() - t0)
                    y = ch.loan((size // 4,), torch.float32, device="cuda:0", timeout=120)
                    y.fill_(float(i))
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    ch.send(y)
                    got = ch.receive(timeout=120)
                    loan.append(time.perf_counter() - t0)
                    assert got == float(i), (got, i)
                    del y
                rw[("copy", size)] = copy[1:]  # the first opens the pool
                rw[("loan", size)] = loan[1:]
                del x
        p.join(60)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
        drop_idle_pools()

    # torch.multiprocessing queues
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_consume_torch, args=(q_in, q_out, total), daemon=True)
    p.start()
    tq: dict[int, list[float]] = {}
    try:
        for size in SIZES:
            samples = []
            for i in range(iters[size]):
                x = torch.full((size // 4,), float(i), device="cuda:0")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                q_in.put(x)
                got = q_out.get(timeout=120)
                samples.append(time.perf_counter() - t0)
                assert got == float(i)
                del x
            tq[size] = samples[1:]
        p.join(60)
    finally:
        if p.is_alive():
            p.kill()
            p.join()

    for size in SIZES:
        base = _summary(tq[size])
        for name, samples in (
            ("ringwire copy", rw[("copy", size)]),
            ("ringwire loan", rw[("loan", size)]),
        ):
            s = _summary(samples)
            s["vs_torch_mp"] = s["median_us"] / base["median_us"]
            results["cases"].append({"transport": name, "bytes": size, **s})
        results["cases"].append({"transport": "torch.mp queue", "bytes": size, **base})
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("perf.cuda: torch is not installed; nothing to measure")
        return 0
    if not torch.cuda.is_available():
        print("perf.cuda: no CUDA device here; nothing to measure (run it on a GPU machine)")
        return 0
    res = run(args.quick)
    print(f"GPU handoff latency on {res['device']} (torch {res['torch']}); smaller is better")
    print(f"{'transport':<16} {'size':>8} {'median µs':>11} {'p99 µs':>10} {'÷ torch.mp':>11}")
    for c in res["cases"]:
        size = "1 MiB" if c["bytes"] == 1 << 20 else "1 GiB"
        ratio = f"{c['vs_torch_mp']:.3f}" if "vs_torch_mp" in c else "1"
        print(
            f"{c['transport']:<16} {size:>8} {c['median_us']:>11.1f} {c['p99_us']:>10.1f} "
            f"{ratio:>11}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
