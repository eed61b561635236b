"""Merge the JSON of ``perf.codec``, ``perf.transport`` and ``perf.slots`` into one
results file, a Markdown report and PNG plots.  Used by ``python -m perf``.

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

from perf._common import fmt_ms, format_table, machine_info

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
        for rw_name in ("ringwire parked (spin_us=0)", "ringwire default spin"):
            if m(rw_name) is None:
                continue
            rows.append(
                _row(
                    f"async RT µs [{loop}], {rw_name}",
                    "lower",
                    m(rw_name),
                    {"zmq.asyncio PAIR ipc://": m("zmq.asyncio PAIR ipc://")},
                    floor,
                    _us,
                )
            )
    hot = r.get("hot_rt", {})
    if hot:
        for rw_name in ("ringwire hot, blocking API", "ringwire hot, async API [asyncio]"):
            if rw_name not in hot:
                continue
            rows.append(
                _row(
                    f"hot RT µs, {rw_name.removeprefix('ringwire ')}",
                    "lower",
                    _med(hot.get(rw_name)),
                    {
                        "posix_ipc semaphore ping-pong": _med(
                            hot.get("posix_ipc semaphore ping-pong")
                        ),
                        "multiprocessing.Pipe": _med(hot.get("multiprocessing.Pipe")),
                    },
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
    return format_table(
        ["target", "measured", "status"],
        [[t["target"], t["shown"], t["status"]] for t in doc.get("targets", [])],
        "lrl",
    )


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
        "Peers: async RT zmq.asyncio; hot RT posix_ipc semaphore and multiprocessing.Pipe; "
        "throughput multiprocessing.Queue and faster-fifo; handoff zmq copy=False and "
        "multiprocessing.Queue; codec the naive nested-Ext encoding.  Floors: the fastest "
        "asyncio pipe echo, a busy-polled shared int64, the codec ceiling (encode/decode "
        "with no transport; ringwire ÷ ceiling ≤ 1), one np.copyto."
    )
    if plots:
        w("")
        w("## Plots")
        w("")
        for p in plots:
            w(f"![{p.stem}]({p.name})")
            w("")
    for name, doc in (("Transport", t), ("Tensor handoff (slots)", s)):
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
    missing = [n for n, b in results["benchmarks"].items() if b["status"] != "ok"]
    w("")
    w("## Not measured")
    w("")
    for n in missing:
        b = results["benchmarks"][n]
        w(f"- {n}: {b['status']} ({b.get('error') or 'see ' + str(b.get('log'))})")
    w("- throughput vs number of producers: no multi-producer benchmark exists yet.")
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
        ("codec", _plot_codec),
    ):
        doc = _result(results, name)
        if not doc:
            continue
        path = fn(plt, doc, out_dir, sub)
        if path is not None:
            written.append(path)
    return written


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
    fig.suptitle(f"Small-record (100 B msgpack) round trip per peer\n{sub}", fontsize=10)
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


def _parse_size(label: str) -> int:
    num, unit = label.split()
    return int(float(num) * {"KiB": 1024, "MiB": MiB, "GiB": 1024 * MiB}[unit])


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
