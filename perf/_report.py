"""Merge the JSON of ``perf.codec``, ``perf.transport``, ``perf.slots``,
``perf.longrun``, ``perf.calls``, ``perf.broadcast`` and ``perf.pipeline`` into one results file, a Markdown report and PNG plots.  Used by
``python -m perf``.

Only reads the scripts' JSON (the shapes written by their ``--json``); every section
copes with a benchmark that is missing or failed and says so instead.
"""

from __future__ import annotations

import datetime as _dt
import subprocess
import textwrap
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from perf._common import fmt_ms, format_table, format_targets, machine_info

__all__ = ["DISTRIBUTIONS", "suite_machine_info", "write_report", "write_plots"]

# distribution names (what pip knows), looked up with importlib.metadata, so nothing
# heavy (torch) is imported just to read a version
DISTRIBUTIONS = (
    "ringwire",
    "numpy",
    "msgspec",
    "torch",
    "anyio",
    "pyzmq",
    "faster-fifo",
    "uvloop",
    "posix_ipc",
    "iceoryx2",
    "rich",
    "matplotlib",
)

MiB = 1024 * 1024


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent.parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def suite_machine_info() -> dict[str, Any]:
    """machine_info() plus package versions (by distribution) and the git revision."""
    info = machine_info()
    versions: dict[str, str | None] = {}
    for dist in DISTRIBUTIONS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    info["versions"] = versions
    rev = _git("rev-parse", "--short", "HEAD")
    if rev is not None:
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        info["git"] = rev + ("-dirty" if dirty else "")
    return info


# --------------------------------------------------------------------------- helpers


def _result(results: dict[str, Any], name: str) -> dict[str, Any] | None:
    b = results.get("benchmarks", {}).get(name) or {}
    return b.get("result") if b.get("status") == "ok" else None


def _x(v: float | None) -> str:
    if v is None or v != v:
        return "—"
    return f"{v:.3f}×" if v < 1 else f"{v:.2f}×"


def _us(ns: float | None) -> str:
    return "—" if ns is None else fmt_ms(ns / 1e3)


def _msf(ns: float | None) -> str:
    return "—" if ns is None else fmt_ms(ns / 1e6)


def _rps(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}/s"


def _med(d: dict[str, Any] | None, key: str = "median_ns") -> float | None:
    if not d:
        return None
    v = d.get(key)
    return float(v) if v is not None else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# --------------------------------------------------------------------------- summary rows

SUMMARY_HEADERS = [
    "measurement",
    "better",
    "ringwire",
    "best peer",
    "peer value",
    "× best peer",
    "floor",
    "floor value",
    "× floor",
]


def _row(
    what: str,
    better: str,
    rw: float | None,
    peers: dict[str, float | None],
    floor: tuple[str, float | None] | None,
    fmt: Any,
) -> list[str]:
    """One summary row; ratios are ringwire ÷ peer and ringwire ÷ floor."""
    live = {k: v for k, v in peers.items() if v is not None}
    if live:
        pick = min if better == "lower" else max
        best = pick(live, key=lambda k: live[k])
        bv: float | None = live[best]
    else:
        best, bv = "—", None
    fname, fv = floor if floor else ("—", None)
    return [
        what,
        better,
        fmt(rw),
        best,
        fmt(bv),
        _x(_div(rw, bv)),
        fname,
        fmt(fv),
        _x(_div(rw, fv)),
    ]


def _transport_rows(t: dict[str, Any]) -> list[list[str]]:
    rows: list[list[str]] = []
    r = t.get("results", {})
    art = r.get("async_rt", {})
    for loop in ("asyncio", "uvloop"):

        def m(name: str, loop: str = loop) -> float | None:
            return _med(art.get(f"{name} [{loop}]"))

        floors = {
            n: m(n)
            for n in (
                "asyncio pipe floor (add_reader, callback echo)",
                "asyncio pipe floor (add_reader, task echo)",
                "asyncio pipe floor (streams)",
            )
        }
        live = {k: v for k, v in floors.items() if v is not None}
        floor = (min(live, key=lambda k: live[k]), min(live.values())) if live else None
        for size in ("", ", 4 KiB"):
            for rw_name in ("ringwire parked (spin_us=0)", "ringwire default spin"):
                if m(rw_name + size) is None:
                    continue
                rows.append(
                    _row(
                        f"async RT µs [{loop}], {rw_name}{size or ', 100 B'}",
                        "lower",
                        m(rw_name + size),
                        {"zmq.asyncio PAIR ipc://": m("zmq.asyncio PAIR ipc://" + size)},
                        floor,
                        _us,
                    )
                )
    hot = r.get("hot_rt", {})
    if hot:
        for rw_name, size in (
            ("ringwire hot, blocking API", ""),
            ("ringwire hot, async API [asyncio]", ""),
            ("ringwire hot, blocking API, 4 KiB", ", 4 KiB"),
        ):
            if rw_name not in hot:
                continue
            peers = {
                "multiprocessing.Pipe": _med(hot.get("multiprocessing.Pipe" + size)),
                "iceoryx2 pub/sub": _med(hot.get("iceoryx2 pub/sub, busy-poll" + size)),
            }
            if not size:
                peers["posix_ipc semaphore ping-pong"] = _med(
                    hot.get("posix_ipc semaphore ping-pong")
                )
            rows.append(
                _row(
                    f"hot RT µs, {rw_name.removeprefix('ringwire ')}" + ("" if size else ", 100 B"),
                    "lower",
                    _med(hot.get(rw_name)),
                    peers,
                    ("busy-poll shared int64", _med(hot.get("busy-poll shared int64 (floor)"))),
                    _us,
                )
            )
    tp = r.get("throughput", {})
    if tp:

        def rps(name: str) -> float | None:
            return _med(tp.get(name), "median_rps")

        ceiling = ("codec ceiling", rps("codec ceiling (no transport; max of encode, decode time)"))
        for rw_name in (
            "ringwire sync send_many/receive_many",
            "ringwire sync send/receive",
            "ringwire async [asyncio] send_many/receive_many",
        ):
            if rw_name not in tp:
                continue
            rows.append(
                _row(
                    f"throughput, {rw_name.removeprefix('ringwire ')}",
                    "higher",
                    rps(rw_name),
                    {
                        "multiprocessing.Queue": rps("multiprocessing.Queue"),
                        "faster-fifo put/get": rps("faster-fifo put/get"),
                        "faster-fifo put_many/get_many": rps("faster-fifo put_many/get_many"),
                    },
                    ceiling,
                    _rps,
                )
            )
    fan = r.get("fanin", {})
    if fan:
        dec = next((d["median_rps"] for d in fan.values() if not d.get("producers")), None)
        for k in sorted({d["producers"] for d in fan.values() if d.get("producers")}):

            def best(transport: str, k: int = k) -> tuple[str, float] | None:
                c = [
                    (d["peer"], d["median_rps"])
                    for d in fan.values()
                    if d.get("producers") == k and d.get("transport") == transport
                ]
                return max(c, key=lambda x: x[1]) if c else None

            rw = best("ringwire")
            if rw is None:
                continue
            rows.append(
                _row(
                    f"fan-in throughput, {k} producer{'s' * (k > 1)} (best ringwire mode: "
                    f"{rw[0].removeprefix('ringwire ')})",
                    "higher",
                    rw[1],
                    {
                        (b[0] if b else t): (b[1] if b else None)
                        for t in ("multiprocessing.Queue", "faster-fifo", "zmq")
                        for b in [best(t)]
                    },
                    ("decode ceiling", dec),
                    _rps,
                )
            )
    return rows


SLOT_RW = ("ringwire loaned", "ringwire copy-in", "ringwire inline (Ext 3, no slots)")
SLOT_PEERS = ("zmq PAIR copy=False", "multiprocessing.Queue")
SLOT_FLOOR = "memcpy np.copyto (floor)"


def _slots_rows(s: dict[str, Any]) -> list[list[str]]:
    rows: list[list[str]] = []
    for size, g in s.get("results", {}).get("copy_in", {}).items():

        def ow(name: str, g: dict[str, Any] = g) -> float | None:
            return _med(g.get(name), "one_way_median_ns")

        for rw_name in SLOT_RW:
            if ow(rw_name) is None:
                continue
            rows.append(
                _row(
                    f"handoff one-way ms {size}, {rw_name.removeprefix('ringwire ')}",
                    "lower",
                    ow(rw_name),
                    {p: ow(p) for p in SLOT_PEERS},
                    ("memcpy np.copyto", ow(SLOT_FLOOR)),
                    _msf,
                )
            )
    return rows


def _codec_rows(c: dict[str, Any]) -> list[list[str]]:
    rows: list[list[str]] = []
    for r in c.get("rows", []):
        st = r.get("stats", {})
        rw = _sum(_med(st.get("rw_enc")), _med(st.get("rw_dec")))
        naive = _sum(_med(st.get("naive_enc")), _med(st.get("naive_dec")))
        floor = _med(st.get("memcpy_copyto"))
        rows.append(
            _row(
                f"codec enc+dec ms, {r['kind']} {_size(r['nbytes'])}",
                "lower",
                rw,
                {"naive nested Ext": naive},
                ("one memcpy (np.copyto)", floor),
                _msf,
            )
        )
    return rows


def _sum(a: float | None, b: float | None) -> float | None:
    return a + b if a is not None and b is not None else None


def _size(n: int) -> str:
    if n >= MiB:
        return f"{n // MiB} MiB"
    return f"{n // 1024} KiB"


def _targets_table(doc: dict[str, Any]) -> str:
    return format_targets(doc.get("targets", []))


def _log_tables(log: str | None) -> dict[str, str]:
    """The Markdown tables a benchmark printed (for those whose JSON has none)."""
    try:
        lines = Path(log).read_text(encoding="utf-8").splitlines() if log else []
    except OSError:
        return {}
    blocks: list[list[str]] = []
    for i, line in enumerate(lines):
        if line.startswith("|"):
            if not (i and lines[i - 1].startswith("|")):
                blocks.append([])
            blocks[-1].append(line)
    blocks = [b for b in blocks if not b[0].startswith("| target ")]  # shown from the JSON
    return {f"table {k + 1}": "\n".join(b) for k, b in enumerate(blocks)}


# --------------------------------------------------------------------------- report.md


def write_report(results: dict[str, Any], path: Path, plots: Sequence[Path] = ()) -> None:
    info = results["machine"]
    v = info.get("versions", {})
    out: list[str] = []
    w = out.append
    w(f"# ringwire benchmarks ({results['mode']} mode)")
    w("")
    w(
        f"{results['started']}; {info['platform']}; {info['cpu']}; "
        f"{info['cpus_usable']} usable CPUs of {info['cpu_count']}; Python {info['python']}"
        + (f"; git {info['git']}" if info.get("git") else "")
    )
    w("")
    w("versions: " + ", ".join(f"{k} {val or 'not installed'}" for k, val in v.items()))
    w("")
    w(
        "Times: smaller is better; throughput: larger is better.  Ratios are ringwire ÷ "
        "peer and ringwire ÷ floor, so for a time < 1× means ringwire is faster and "
        "for a throughput > 1× means ringwire is faster.  The machine is noisy: compare "
        "ratios within one run, not absolute numbers across runs."
    )
    w("")
    w("## Runs")
    w("")
    w(
        format_table(
            ["benchmark", "command", "status", "seconds"],
            [
                [n, f"`{' '.join(b['command'])}`", b["status"], f"{b['elapsed_s']:.0f}"]
                for n, b in results["benchmarks"].items()
            ],
            "lllr",
        )
    )
    w("")
    w("## Summary: ringwire against the best peer and the floor")
    w("")
    srows: list[list[str]] = []
    t = _result(results, "transport")
    s = _result(results, "slots")
    c = _result(results, "codec")
    lr = _result(results, "longrun")
    if t:
        srows += _transport_rows(t)
    if s:
        srows += _slots_rows(s)
    if c:
        srows += _codec_rows(c)
    if srows:
        w(format_table(SUMMARY_HEADERS, srows, "llrlrrlrr"))
    else:
        w("(no benchmark produced results)")
    w("")
    w(
        "Peers: async RT zmq.asyncio (same record size); hot RT posix_ipc semaphore, "
        "multiprocessing.Pipe and iceoryx2 (same record size); throughput "
        "multiprocessing.Queue and faster-fifo; fan-in multiprocessing.Queue, faster-fifo "
        "and zmq PUSH/PULL, each in its best mode; handoff zmq copy=False and "
        "multiprocessing.Queue; codec the naive nested-Ext encoding.  Floors: the fastest "
        "asyncio pipe echo, a busy-polled shared int64, the codec ceiling (encode/decode "
        "with no transport; ringwire ÷ ceiling ≤ 1), the decode ceiling for fan-in (one "
        "consumer decoding), one np.copyto."
    )
    if plots:
        w("")
        w("## Plots")
        w("")
        for p in plots:
            w(f"![{p.stem}]({p.name})")
            w("")
    for name, doc in (
        ("Transport", t),
        ("Tensor handoff (slots)", s),
        ("Long run (memory, /dev/shm)", lr),
    ):
        if not doc:
            continue
        w("")
        w(f"## {name} targets")
        w("")
        w(_targets_table(doc))
        for title, table in doc.get("tables", {}).items():
            w("")
            w(f"### {name}: {title}")
            w("")
            w(table)
    if c:
        w("")
        w("## Codec targets")
        w("")
        for line in c.get("targets", {}).get("summary", []):
            w(f"- {line}")
    for name, title in (
        ("calls", "Calls (request -> reply over one connection)"),
        ("broadcast", "Broadcast (one writer, N readers)"),
        ("pipeline", "Pipeline (HTTP -> tokenizer -> scheduler -> N ranks)"),
        ("tcp", "Across hosts (TCP over ZeroMQ, against plain pyzmq)"),
        ("broadcast_remote", "Broadcast with a remote reader (2 local + 1 over TCP)"),
        ("tracing", "Tracing (OpenTelemetry absent / idle / a span per call)"),
        ("metrics", "Metrics (the batched path with a scraped collector)"),
    ):
        doc = _result(results, name)
        if not doc:
            continue
        w("")
        w(f"## {title}")
        if doc.get("targets"):
            w("")
            w(_targets_table(doc))
        tables = doc.get("tables") or _log_tables(results["benchmarks"][name].get("log"))
        for sub, table in tables.items():
            w("")
            w(f"### {title.split(' (')[0]}: {sub}")
            w("")
            w(table)
    missing = [n for n, b in results["benchmarks"].items() if b["status"] != "ok"]
    w("")
    w("## Not measured")
    w("")
    for n in missing:
        b = results["benchmarks"][n]
        w(f"- {n}: {b['status']} ({b.get('error') or 'see ' + str(b.get('log'))})")
    skipped = (t or {}).get("results", {}).get("hot_rt_skipped") or {}
    for peer, why in skipped.items():
        w(f"- {peer}: skipped ({why})")
    if not missing and not skipped:
        w("- (everything ran)")
    path.write_text("\n".join(out) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- plots


def write_plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write the PNGs the results allow; returns their paths.  Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    sub = f"{results['started'][:16]}, {results['mode']} mode, {results['machine']['cpu']}"
    for name, fn in (
        ("slots", _plot_handoff),
        ("transport", _plot_rt),
        ("transport", _plot_fanin),
        ("codec", _plot_codec),
        ("longrun", _plot_longrun),
        ("pipeline", _plot_pipeline),
    ):
        doc = _result(results, name)
        if not doc:
            continue
        path = fn(plt, doc, out_dir, sub)
        if path is not None:
            written.append(path)
    return written


_FAN_STYLE = {  # transport -> (colours, one per mode in order of appearance; marker)
    "ringwire": (("tab:green", "darkgreen", "limegreen", "olive", "seagreen", "yellowgreen"), "o"),
    "faster-fifo": (("tab:orange", "darkorange"), "s"),
    "zmq": (("tab:red", "firebrick"), "D"),
    "multiprocessing.Queue": (("tab:brown",), "v"),
}


def _plot_fanin(plt: Any, doc: dict[str, Any], out_dir: Path, sub: str) -> Path | None:
    fan = doc.get("results", {}).get("fanin", {})
    if not fan:
        return None
    series: dict[str, list[tuple[int, float]]] = {}
    meta: dict[str, tuple[str, bool]] = {}
    ceiling = None
    for d in fan.values():
        if not d.get("producers"):
            ceiling = d["median_rps"]
            continue
        series.setdefault(d["peer"], []).append((d["producers"], d["median_rps"]))
        meta[d["peer"]] = (d["transport"], bool(d["batch"]))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(12, 6))
    ks = sorted({k for pts in series.values() for k, _ in pts})
    shade: dict[str, int] = {}
    for peer, pts in series.items():
        transport, batch = meta[peer]
        colors, marker = _FAN_STYLE.get(transport, (("0.4",), "x"))
        i = shade[transport] = shade.get(transport, -1) + 1
        pts.sort()
        ax.plot(
            [k for k, _ in pts],
            [v for _, v in pts],
            color=colors[i % len(colors)],
            marker=marker,
            linestyle="-" if batch else "--",
            linewidth=2.2 if transport == "ringwire" else 1.4,
            label=peer,
        )
    if ceiling:
        ax.axhline(ceiling, color="black", linestyle=":", label="decode ceiling (one consumer)")
    ax.set_yscale("log")
    ax.set_xticks(ks)
    ax.set_xlabel("producer processes → one consumer")
    ax.set_ylabel("records/s, median of the rounds (log; higher is better)")
    ax.set_title(
        "Fan-in throughput vs producers, 100-byte records (solid: batched, dashed: per record)"
        f"\n{sub}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path = out_dir / "throughput_vs_producers.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _plot_longrun(plt: Any, doc: dict[str, Any], out_dir: Path, sub: str) -> Path | None:
    samples = doc.get("results", {}).get("samples", [])
    if len(samples) < 2:
        return None
    xs = [s["records_sent"] / 1e6 for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8.5, 6.5), sharex=True)
    for who, color in (("producer", "tab:blue"), ("consumer", "tab:green")):
        for key, style in (("VmRSS", "-"), ("RssAnon", "--"), ("RssShmem", ":")):
            ys = [(s[who].get(key) or 0) / MiB for s in samples]
            ax1.plot(xs, ys, color=color, linestyle=style, marker=".", label=f"{who} {key}")
    ax1.set_ylabel("MiB")
    ax1.set_ylim(bottom=0)
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=7, ncol=2)
    ax1.set_title("Resident memory of both processes over the run", fontsize=9)
    ours = [s["shm_ours"]["bytes"] / MiB for s in samples]
    fs = [(s.get("shm_fs_used") or 0) / MiB for s in samples]
    after = doc.get("results", {}).get("shm_after", {})
    before = doc.get("results", {}).get("shm_before", {})
    ax2.plot(xs, fs, color="0.4", marker=".", label="/dev/shm used (whole machine)")
    ax2.plot(xs, ours, color="tab:red", marker=".", label="our ringwire names in /dev/shm")
    if after.get("fs_used") is not None:
        ax2.axhline(after["fs_used"] / MiB, color="0.4", linestyle="--", label="used after close")
    if before.get("fs_used") is not None:
        ax2.axhline(before["fs_used"] / MiB, color="0.7", linestyle=":", label="used before")
    ax2.set_ylabel("MiB")
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("records sent (millions)")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=7)
    ax2.set_title("/dev/shm during and after the run", fontsize=9)
    fig.suptitle(f"Long run: memory and /dev/shm\n{sub}", fontsize=10)
    fig.tight_layout()
    path = out_dir / "longrun_memory.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_LINE_STYLE = {
    "ringwire loaned": dict(color="tab:green", marker="o"),
    "ringwire copy-in": dict(color="tab:blue", marker="o"),
    "ringwire inline (Ext 3, no slots)": dict(color="tab:cyan", marker="o"),
    "zmq PAIR copy=False": dict(color="tab:red", marker="s"),
    "multiprocessing.Queue": dict(color="tab:orange", marker="s"),
    "memcpy np.copyto (floor)": dict(color="black", marker="^", linestyle=":"),
}


def _plot_handoff(plt: Any, doc: dict[str, Any], out_dir: Path, sub: str) -> Path | None:
    res = doc.get("results", {})
    copy_in = res.get("copy_in", {})
    if not copy_in:
        return None
    sizes = {k: _parse_size(k) for k in copy_in}
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for peer, style in _LINE_STYLE.items():
        xs, ys = [], []
        for label, g in sorted(copy_in.items(), key=lambda kv: sizes[kv[0]]):
            v = _med(g.get(peer), "one_way_median_ns")
            if v is not None:
                xs.append(sizes[label])
                ys.append(v / 1e6)
        if xs:
            ax.plot(xs, ys, label=peer.replace(" (floor)", " (in-process floor)"), **style)
    loaned = res.get("loaned", {})
    xs, ys = [], []
    for name, d in loaned.items():
        if not name.startswith("ringwire loaned ") or "torch" in name:
            continue
        v = _med((d or {}).get("one_way"))
        if v is not None:
            xs.append(_parse_size(name.removeprefix("ringwire loaned ")))
            ys.append(v / 1e6)
    if xs:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        ax.plot(
            [xs[i] for i in order],
            [ys[i] for i in order],
            color="tab:green",
            linestyle="--",
            marker=".",
            alpha=0.7,
            label="ringwire loaned, back to back (4 KiB–256 MiB table)",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({*sizes.values(), *xs})
    ax.set_xticks(ticks)
    ax.set_xticklabels([_size(t) for t in ticks])
    ax.set_xlabel("payload (float32 numpy array)")
    ax.set_ylabel("one-way handoff, median ms (log)")
    ax.set_title(f"Tensor handoff latency vs payload size (lower is better)\n{sub}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = out_dir / "handoff_latency_vs_size.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_rt(plt: Any, doc: dict[str, Any], out_dir: Path, sub: str) -> Path | None:
    res = doc.get("results", {})
    art, hot = res.get("async_rt", {}), res.get("hot_rt", {})
    if not art and not hot:
        return None
    panels = [
        (title, d)
        for title, d in (
            ("async round trip, both ends parked", art),
            ("hot round trip, spinning readers", hot),
        )
        if d
    ]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(10.5, 3 + 0.35 * sum(len(d) for _, d in panels))
    )
    if len(panels) == 1:
        axes = [axes]
    for ax, (title, d) in zip(axes, panels):
        names = list(d)
        med = [(_med(d[n]) or 0) / 1e3 for n in names]
        p99 = [(_med(d[n], "p99_ns") or 0) / 1e3 for n in names]
        colors = [
            "tab:green" if n.startswith("ringwire") else "0.6" if "floor" in n else "tab:red"
            for n in names
        ]
        y = range(len(names))
        ax.barh(y, med, color=colors)
        ax.plot(p99, list(y), "k|", markersize=10, label="p99")
        for yi, m in zip(y, med):
            ax.text(m, yi, f" {m:.3g}", va="center", fontsize=7)
        ax.set_yticks(list(y))
        ax.set_yticklabels([textwrap.fill(n, 46) for n in names], fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("µs per round trip, median bar, p99 tick (log; lower is better)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, axis="x", which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Round trip per peer (100 B and 4 KiB msgpack records)\n{sub}", fontsize=10)
    fig.tight_layout()
    path = out_dir / "small_record_rt.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_codec(plt: Any, doc: dict[str, Any], out_dir: Path, sub: str) -> Path | None:
    rows = doc.get("rows", [])
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    if not kinds:
        return None
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 4.5), sharey=True)
    if len(kinds) == 1:
        axes = [axes]
    series = (
        ("ringwire enc+dec", ("rw_enc", "rw_dec"), dict(color="tab:green", marker="o")),
        ("naive enc+dec", ("naive_enc", "naive_dec"), dict(color="tab:red", marker="s")),
        (
            "one memcpy (np.copyto)",
            ("memcpy_copyto",),
            dict(color="black", marker="^", linestyle=":"),
        ),
    )
    for ax, kind in zip(axes, kinds):
        kr = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["nbytes"])
        for label, keys, style in series:
            xs, ys = [], []
            for r in kr:
                vals = [_med(r["stats"].get(k)) for k in keys]
                if all(v is not None for v in vals):
                    xs.append(r["nbytes"])
                    ys.append(sum(v for v in vals if v is not None) / 1e6)
            if xs:
                ax.plot(xs, ys, label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = [r["nbytes"] for r in kr]
        ax.set_xticks(ticks)
        ax.set_xticklabels([_size(t) for t in ticks])
        ax.set_title(kind, fontsize=9)
        ax.set_xlabel("payload")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median ms (log; lower is better)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Codec encode + decode time vs size\n{sub}", fontsize=10)
    fig.tight_layout()
    path = out_dir / "codec_vs_size.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_pipeline(plt: Any, doc: dict[str, Any], out_dir: Path, sub: str) -> Path | None:
    from perf import pipeline

    return pipeline.plot(plt, doc, out_dir / "pipeline_latency_cpu.png", sub)


def _parse_size(label: str) -> int:
    num, unit = label.split()
    return int(float(num) * {"KiB": 1024, "MiB": MiB, "GiB": 1024 * MiB}[unit])


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
