"""Records/s on the batched path with a metrics collector scraped, vs none, side by side.

Run from the repository root::

    python -m perf.metrics                 # 12 rounds of each, ~1 minute on a 2-core VM
    python -m perf.metrics --quick         # 6 rounds of each, ~30 s
    python -m perf.metrics --json out.json

A ``spawn`` child sends ``--records`` small msgpack records per round with
``SyncChannel.send_many`` (batches of 256) over one connection; the parent receives
them with ``receive_many``.  Two modes, alternating round by round (the first mode
rotated) so the machine's drift lands on both:

* ``none``: no collector registered in either process;
* ``scraped``: ``ringwire.metrics.register()`` on a fresh ``CollectorRegistry`` in both
  processes, and a thread in each that renders the whole text exposition
  (``prometheus_client.generate_latest``) every ``--interval`` seconds (default 1)
  for as long as the round runs.

Registration happens at the round's start and is undone at its end, so a ``none``
round has no collector anywhere.  The records pay nothing for the collector (it reads
the counters when scraped); what a scrape costs is its own thread's CPU, on a machine
with few cores taken from the sender or the receiver.  Reported: the median records/s
of each mode over its rounds, the ratio, and the scrapes that ran.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf._common import format_table, machine_info

BATCH = 256
MODES = ("none", "scraped")


class Scraper:
    """A collector on a fresh registry, rendered every ``interval`` s by a thread."""

    def __init__(self, interval: float) -> None:
        import prometheus_client

        import ringwire

        self._prom = prometheus_client
        self.registry = prometheus_client.CollectorRegistry()
        self.collector = ringwire.metrics.register(self.registry)
        self.scrapes = 0
        self.scrape_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while True:  # one scrape at once, then one every interval
            t0 = time.perf_counter()
            text = self._prom.generate_latest(self.registry)
            self.scrape_s += time.perf_counter() - t0
            assert b"ringwire_records_total" in text
            self.scrapes += 1
            if self._stop.wait(interval):
                return

    def stop(self) -> None:
        import ringwire

        self._stop.set()
        self._thread.join()
        ringwire.metrics.unregister(self.collector, self.registry)


def child(end: Any, ctl: Any, interval: float) -> None:  # pragma: no cover - a child
    import ringwire

    rec = {"id": 0, "tokens": list(range(16)), "note": "a small record"}
    batch = [dict(rec, id=i) for i in range(BATCH)]
    with end.connect_sync(slots=None) as chan:
        while True:
            msg = ctl.recv()
            if msg is None:
                break
            n, mode = msg
            scraper = Scraper(interval) if mode == "scraped" else None
            ctl.send("ready")
            sent = 0
            while sent < n:
                chan.send_many(batch[: min(BATCH, n - sent)], timeout=60)
                sent += BATCH
            if scraper is not None:
                scraper.stop()
            ctl.send(scraper.scrapes if scraper is not None else 0)
    del ringwire


def run(rounds: int, n: int, interval: float) -> dict[str, Any]:
    import ringwire

    ctx = mp.get_context("spawn")
    a, b = ringwire.pair(capacity=1 << 20)
    ctl, ctl_child = ctx.Pipe()
    proc = ctx.Process(target=child, args=(b, ctl_child, interval), daemon=True)
    proc.start()
    out: dict[str, Any] = {m: [] for m in MODES}
    scrapes: dict[str, int] = {m: 0 for m in MODES}
    scrape_s = 0.0  # the parent's scrapes' time
    parent_scrapes = 0
    try:
        with a.connect_sync(slots=None) as chan:
            for r in range(rounds * 2):
                mode = MODES[(r + r // 2) % 2]  # none, scraped, scraped, none, ...
                scraper = Scraper(interval) if mode == "scraped" else None
                ctl.send((n, mode))
                assert ctl.recv() == "ready"
                got = 0
                t0 = time.perf_counter()
                while got < n:
                    got += len(chan.receive_many(4096, timeout=60))
                dt = time.perf_counter() - t0
                child_scrapes = ctl.recv()
                if scraper is not None:
                    scraper.stop()
                    scrapes[mode] += scraper.scrapes + child_scrapes
                    scrape_s += scraper.scrape_s
                    parent_scrapes += scraper.scrapes
                out[mode].append(n / dt)
                print(f"round {r:2d} {mode:8s} {n / dt / 1e6:6.3f} M records/s", flush=True)
            ctl.send(None)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    med = {m: statistics.median(v) for m, v in out.items()}
    # rounds 2k and 2k+1 are one of each mode, back to back: their ratio sees the least
    # drift (this machine's load moves 2-3x within a minute)
    pairs = [out["scraped"][k] / out["none"][k] for k in range(min(map(len, out.values())))]
    return {
        "records_per_round": n,
        "interval_s": interval,
        "rounds": rounds,
        "records_per_s": out,
        "median": med,
        "ratio_scraped_to_none": med["scraped"] / med["none"],
        "paired_ratios": pairs,
        "paired_ratio_median": statistics.median(pairs),
        "scrapes": scrapes,
        "scrape_ms_mean": 1e3 * scrape_s / max(1, parent_scrapes),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--records", type=int, default=2_000_000)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rounds = args.rounds or (6 if args.quick else 12)
    res = run(rounds, args.records, args.interval)
    rows = [
        [m, f"{res['median'][m] / 1e6:.3f}", f"{min(res['records_per_s'][m]) / 1e6:.3f}",
         f"{max(res['records_per_s'][m]) / 1e6:.3f}", str(res["scrapes"][m])]
        for m in MODES
    ]  # fmt: skip
    print()
    print(format_table(["mode", "median M rec/s", "min", "max", "scrapes (both processes)"], rows))
    print(f"\nscraped / none: {res['ratio_scraped_to_none']:.3f} of the medians, "
          f"{res['paired_ratio_median']:.3f} the median of the back-to-back pairs; one scrape (the "
          f"parent's, one connection): {res['scrape_ms_mean']:.2f} ms; native ring: "
          f"{__import__('ringwire').native}")  # fmt: skip
    if args.json:
        res["machine"] = machine_info(["prometheus_client"])
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
