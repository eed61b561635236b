"""Pipeline benchmark: an inference server's shape, end to end, over three transports.

Run from the repository root::

    python -m perf.pipeline             # N = 2 and 4 ranks; concurrency 1, 4, 16 (~5 min)
    python -m perf.pipeline --quick     # N = 2; concurrency 1 and 4 (< 1 minute)
    python -m perf.pipeline --json perf/results/pipeline.json --plot perf/results/pipeline.png

The pipeline is ``examples/pipeline``: an HTTP front end (Starlette on uvicorn) -> a
tokenizer process -> a scheduler process -> N rank processes (the step broadcast to
all of them) -> the replies back up to the front end.  Every request carries SGLang-
shaped records (``MultimodalProcessorOutput`` / ``MultimodalDataItem``: one pixel
tensor ``[n, 3, 448, 448]``, ``image_grid_thw``, offsets, a 64-bit hash, numpy
scalars); request ``i`` has ``1 + i % 4`` images, float32 and bfloat16 in turn
(2.4-9.6 MB of pixels).  The same front end and the same work per process
(``pipeline.stages``) run over:

* **ringwire** -- ``ringwire.Client`` / ``serve`` between front, tokenizer and
  scheduler (the tokenizer writes the pixels into a loaned slot), ``ringwire.broadcast``
  to the ranks (one copy into the shared slot pool, N zero-copy readers), a listener's
  fan-in for the ranks' outputs;
* **zmq-msgpack** -- ZeroMQ ``ipc://`` PUSH/PULL and PUB/SUB, msgspec msgpack with the
  tensors inline (SGLang's path after PR #29656; ``perf/_pipeline_zmq.py``);
* **zmq-pickle** -- the same sockets, pickle (SGLang's path before).

Each variant is a front-end process (``python -m perf._pipeline_front``) with its
workers; all three are up at once, and an httpx load generator in this process drives
their HTTP ports in interleaved rounds (the order rotates every round): at each
concurrency C, C client tasks send requests back to back until the round's requests
are done.  Per (N, variant, C): requests/s (median over rounds), end-to-end latency
p50 / p99 (pooled over rounds), CPU per request (the sum of user + system time of the
front end and all its workers over the round, from ``/proc``, / requests; the load
generator is not counted).  Every answer is checked (the feature sum the ranks
computed, the tokens): a wrong answer fails the benchmark.  Ratios are ringwire ÷ peer
(time: < 1 is ringwire faster; throughput: > 1 is ringwire faster).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf._common import format_table, machine_info

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
VARIANTS = ("ringwire", "zmq-msgpack", "zmq-pickle")
CLK_TCK = os.sysconf("SC_CLK_TCK")
PIDS: set[int] = {os.getpid()}  # every process of ours seen (for the /dev/shm check)


@dataclass
class Config:
    ranks: tuple[int, ...]
    levels: tuple[int, ...]
    rounds: int
    requests: int  # per round, at concurrency 1 (more at higher concurrency)
    warmup: int


QUICK = Config(ranks=(2,), levels=(1, 4), rounds=2, requests=16, warmup=8)
FULL = Config(ranks=(2, 4), levels=(1, 4, 16), rounds=4, requests=40, warmup=24)


def body(i: int) -> dict[str, Any]:
    return {
        "prompt": f"Describe the {1 + i % 4} pictures, request {i}.",
        "images": 1 + i % 4,
        "seed": i,
        "dtype": ("float32", "bfloat16")[(i // 4) % 2],
        "size": 448,
    }


# -- processes -----------------------------------------------------------------------------


def _tree_cpu(root: int, seen: set[int] | None = None) -> float:
    """CPU seconds (user + system) of ``root`` and every descendant alive now (their
    pids are added to ``seen``)."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(b")") + 2 :].split()
        pid = int(name)
        parent[pid] = int(rest[1])
        ticks[pid] = int(rest[11]) + int(rest[12])
    total = 0
    for pid, t in ticks.items():
        p = pid
        while p > 1:
            if p == root:
                total += t
                if seen is not None:
                    seen.add(pid)
                break
            p = parent.get(p, 0)
    return total / CLK_TCK


class Front:
    """One variant's front-end process (and its workers)."""

    def __init__(self, variant: str, ranks: int, log: Path) -> None:
        self.variant = variant
        self._log = log.open("w", encoding="utf-8")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "perf._pipeline_front",
                "--variant",
                variant,
                "--ranks",
                str(ranks),
            ],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,  # one process group: a stop reaches every worker
        )
        self.base = ""

    def wait_listening(self, deadline: float) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.variant}: the front end did not start (log: {self._log.name})"
                )
            if select.select([fd], [], [], min(left, 0.5))[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    continue
                buf += chunk
        line = buf.decode().splitlines()[0]
        if not line.startswith("listening on "):
            raise RuntimeError(f"{self.variant}: unexpected output {line!r}")
        self.base = line.split()[-1]

    def cpu(self) -> float:
        return _tree_cpu(self.proc.pid, PIDS)

    def stop(self) -> None:
        """SIGINT (graceful: the workers drain and stop), then SIGKILL the group."""
        for sig, wait in ((signal.SIGINT, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig) if sig is signal.SIGKILL else self.proc.send_signal(
                    sig
                )
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        time.sleep(0.3)
        try:  # anything of its group still alive
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


# -- load ----------------------------------------------------------------------------------


async def _run_cell(
    client: Any, front: Front, conc: int, first: int, n: int, expected: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """``n`` requests (bodies ``first ..``) by ``conc`` tasks back to back."""
    from pipeline import stages

    nxt = iter(range(first, first + n))
    lat: list[float] = []
    bad: list[str] = []

    async def worker() -> None:
        for i in nxt:
            t0 = time.perf_counter()
            r = await client.post(front.base + "/generate", json=body(i))
            lat.append((time.perf_counter() - t0) * 1e3)
            if r.status_code != 200:
                bad.append(f"{r.status_code} {r.text[:200]}")
                continue
            want = expected.get(i)
            if want is None:
                want = expected[i] = stages.expected(stages.parse_request(body(i), "x"))
            got = r.json()
            if any(got[k] != want[k] for k in ("feature_sum", "output_ids", "image_tokens")):
                bad.append(f"wrong answer to request {i}: {got} != {want}")

    cpu0, t0 = front.cpu(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    wall, cpu = time.perf_counter() - t0, front.cpu() - cpu0
    if bad:
        raise RuntimeError(f"{front.variant}: {len(bad)} bad answers, e.g. {bad[0]}")
    return {"wall_s": wall, "rps": n / wall, "lat_ms": lat, "cpu_ms_per_req": 1e3 * cpu / n}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]


async def _bench_ranks(cfg: Config, ranks: int, logs: Path) -> list[dict[str, Any]]:
    import httpx

    expected: dict[int, dict[str, Any]] = {}  # request i -> its answer
    fronts = [Front(v, ranks, logs / f"pipeline-{v}-n{ranks}.log") for v in VARIANTS]
    rows: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 120
        for f in fronts:
            f.wait_listening(deadline)
        limits = httpx.Limits(max_connections=max(cfg.levels) + 4)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            for f in fronts:  # the port is bound before uvicorn listens: retry until it does
                while True:
                    try:
                        await client.get(f.base + "/health")
                        break
                    except httpx.ConnectError:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.05)
                await _run_cell(client, f, 4, 0, cfg.warmup, expected)
            cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
            for conc in cfg.levels:
                n = cfg.requests * max(1, conc // 2)
                for r in range(cfg.rounds):
                    order = fronts[r % len(fronts) :] + fronts[: r % len(fronts)]
                    for f in order:
                        res = await _run_cell(client, f, conc, r * n, n, expected)
                        cells.setdefault((f.variant, conc), []).append(res)
                print(f"  N={ranks} C={conc}: done ({os.getloadavg()[0]:.2f} load)", flush=True)
        for (variant, conc), rs in cells.items():
            lat = [x for res in rs for x in res["lat_ms"]]
            rows.append(
                {
                    "ranks": ranks,
                    "variant": variant,
                    "concurrency": conc,
                    "rps": statistics.median(res["rps"] for res in rs),
                    "p50_ms": _pct(lat, 0.50),
                    "p99_ms": _pct(lat, 0.99),
                    "cpu_ms_per_req": statistics.median(res["cpu_ms_per_req"] for res in rs),
                    "requests": len(lat),
                    "rounds_rps": [res["rps"] for res in rs],
                }
            )
    finally:
        for f in fronts:
            f.stop()
    return rows


# -- report --------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b else "—"


def tables(rows: list[dict[str, Any]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for ranks in sorted({r["ranks"] for r in rows}):
        by = {(r["variant"], r["concurrency"]): r for r in rows if r["ranks"] == ranks}
        lines = []
        for (variant, conc), r in sorted(
            by.items(), key=lambda kv: (kv[0][1], VARIANTS.index(kv[0][0]))
        ):
            rw = by.get(("ringwire", conc))
            lines.append(
                [
                    str(conc),
                    variant,
                    f"{r['rps']:.1f}",
                    f"{r['p50_ms']:.1f}",
                    f"{r['p99_ms']:.1f}",
                    f"{r['cpu_ms_per_req']:.1f}",
                    "" if rw is None or rw is r else _ratio(rw["rps"], r["rps"]),
                    "" if rw is None or rw is r else _ratio(rw["p50_ms"], r["p50_ms"]),
                    "" if rw is None or rw is r else _ratio(rw["p99_ms"], r["p99_ms"]),
                    ""
                    if rw is None or rw is r
                    else _ratio(rw["cpu_ms_per_req"], r["cpu_ms_per_req"]),
                ]
            )
        out[f"N = {ranks} ranks"] = format_table(
            [
                "C",
                "transport",
                "req/s",
                "p50 ms",
                "p99 ms",
                "CPU ms/req",
                "ringwire ÷ it: req/s",
                "p50",
                "p99",
                "CPU/req",
            ],
            lines,
            "rlrrrrrrrr",
        )
    return out


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ringwire ahead of both ZeroMQ paths in p50 and CPU per request at every level."""
    out = []
    for ranks in sorted({r["ranks"] for r in rows}):
        by = {(r["variant"], r["concurrency"]): r for r in rows if r["ranks"] == ranks}
        for peer in VARIANTS[1:]:
            for key, what in (("p50_ms", "p50 latency"), ("cpu_ms_per_req", "CPU per request")):
                rs = [
                    by[("ringwire", c)][key] / by[(peer, c)][key]
                    for (v, c) in by
                    if v == peer and ("ringwire", c) in by
                ]
                if not rs:
                    continue
                worst = max(rs)
                out.append(
                    {
                        "target": f"N={ranks}: ringwire {what} below {peer} at every concurrency",
                        "shown": f"{min(rs):.2f}–{worst:.2f}×",
                        "status": "met" if worst < 1 else "missed",
                    }
                )
    return out


def plot(plt: Any, doc: dict[str, Any], path: Path, sub: str = "") -> Path | None:
    """p50 (solid) / p99 (dashed) latency and CPU per request vs concurrency, per N."""
    rows = doc.get("rows") or []
    all_ranks = sorted({r["ranks"] for r in rows})
    if not all_ranks:
        return None
    colour = {"ringwire": "tab:green", "zmq-msgpack": "tab:blue", "zmq-pickle": "tab:red"}
    fig, axes = plt.subplots(2, len(all_ranks), figsize=(5.5 * len(all_ranks), 7.5), squeeze=False)
    for col, ranks in enumerate(all_ranks):
        ax_l, ax_c = axes[0][col], axes[1][col]
        for v in VARIANTS:
            rs = sorted(
                (r for r in rows if r["ranks"] == ranks and r["variant"] == v),
                key=lambda r: r["concurrency"],
            )
            if not rs:
                continue
            cs = [r["concurrency"] for r in rs]
            ax_l.plot(cs, [r["p50_ms"] for r in rs], "o-", color=colour[v], label=f"{v} p50")
            ax_l.plot(
                cs, [r["p99_ms"] for r in rs], "o--", color=colour[v], alpha=0.6, label=f"{v} p99"
            )
            ax_c.plot(cs, [r["cpu_ms_per_req"] for r in rs], "s-", color=colour[v], label=v)
        levels = sorted({r["concurrency"] for r in rows if r["ranks"] == ranks})
        for ax in (ax_l, ax_c):
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels)
            ax.set_xticklabels([str(c) for c in levels])
            ax.set_xlabel("concurrent HTTP clients")
            ax.grid(True, alpha=0.3)
        ax_l.set_yscale("log")
        ax_l.set_ylabel("end-to-end latency, ms")
        ax_l.set_title(f"HTTP -> tokenizer -> scheduler -> {ranks} ranks")
        ax_c.set_ylabel("CPU ms per request (all processes)")
        ax_l.legend(fontsize=7)
        ax_c.legend(fontsize=7)
    fig.suptitle(
        "Pipeline, 1-4 x 3x448x448 images (float32 / bfloat16)" + (f"\n{sub}" if sub else ""),
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _shm() -> set[str]:
    """ringwire's names in /dev/shm (``rw.<pid>.<id>``)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("rw.")}


def _ours(names: set[str]) -> set[str]:
    """Those made by a process of this run (other programs may run meanwhile)."""
    return {n for n in names if n.split(".")[1].isdigit() and int(n.split(".")[1]) in PIDS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 2, concurrency 1 and 4 (< 1 min)")
    ap.add_argument("--ranks", type=int, action="append", help="rank counts (repeatable)")
    ap.add_argument("--json", type=Path, help="also write the results as JSON")
    ap.add_argument("--plot", type=Path, help="the PNG (default: next to --json, else none)")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.ranks:
        if any(not 1 <= n <= 8 for n in args.ranks):
            ap.error("--ranks takes 1 to 8")
        cfg.ranks = tuple(args.ranks)
    info = machine_info(["ringwire", "msgspec", "zmq", "torch", "starlette", "uvicorn", "httpx"])
    print("## Pipeline benchmark" + (" (--quick)" if args.quick else ""))
    print()
    print(
        f"- CPU: {info['cpu']}; {info['cpus_usable']} usable cores; {info['platform']}; "
        f"python {info['python']}; load average at start: {os.getloadavg()[0]:.2f}"
    )
    print(
        f"- ranks {list(cfg.ranks)}, concurrency {list(cfg.levels)}, {cfg.rounds} rounds; "
        "request i: 1 + i % 4 images of 3x448x448, float32 / bfloat16 in turn"
    )
    logs = (args.json.parent if args.json else ROOT / "perf" / "results") / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    shm0 = _shm()
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    for ranks in cfg.ranks:
        rows += asyncio.run(_bench_ranks(cfg, ranks, logs))
    time.sleep(0.5)
    left = _ours(_shm() - shm0)
    tab = tables(rows)
    tg = targets(rows)
    print()
    print(
        "req/s: higher is better; latency and CPU (front end + tokenizer + scheduler + "
        "ranks, per request): lower is better.  ringwire ÷ it: < 1 for times and > 1 for "
        "req/s mean ringwire is ahead."
    )
    for title, t in tab.items():
        print(f"\n### {title}\n\n{t}")
    from perf._common import format_targets

    print()
    print(format_targets(tg))
    elapsed = time.monotonic() - t0
    print(f"\n(total {elapsed:.0f} s; load average at end: {os.getloadavg()[0]:.2f})")
    if left:
        print(f"left in /dev/shm: {sorted(left)}", file=sys.stderr)
    doc = {
        "machine": info,
        "config": asdict(cfg),
        "quick": args.quick,
        "rows": rows,
        "tables": tab,
        "targets": tg,
        "shm_left": sorted(left),
        "elapsed_s": elapsed,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    png = args.plot or (args.json.with_suffix(".png") if args.json else None)
    if png is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            plot(plt, doc, png)
            print(f"wrote {png}")
        except ImportError:
            print("matplotlib is not installed: no plot")
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main())
