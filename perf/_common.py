"""Small helpers shared by the ``perf/`` scripts: timing, tables, machine info.

Timing
------
:func:`time_interleaved` times several callables ("peers") round-robin: one sample of
each per round, with the starting peer rotated every round, so slow drift of a noisy
machine (frequency changes, a neighbour waking up) lands on every peer alike instead
of on whichever ran last.  :func:`time_callable` is the one-peer case.

Each sample is ``time.perf_counter_ns()`` around one call.  The callable's return
value is kept alive until the clock has been read and dropped afterwards, so freeing
a large result is *not* part of the sample.  The garbage collector is off while
sampling.  Reported statistics are the median and the 99th percentile (nearest rank:
with fewer than 100 samples that is the maximum).  With ``count_faults=True`` the
minor page faults of each call (``getrusage`` before and after, outside the clock
reads) are averaged too: on Linux, large fresh allocations are paid for in faults.

Tables
------
:func:`format_table` / :func:`print_table` produce a Markdown pipe table with padded,
aligned columns, readable both in a terminal and when pasted into a README.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "write_report",
    "Stats",
    "summarize",
    "time_callable",
    "time_interleaved",
    "fmt_ms",
    "format_table",
    "print_table",
    "machine_info",
]


@dataclass(frozen=True)
class Stats:
    """Summary of one peer's samples, in nanoseconds."""

    n: int
    median_ns: float
    p99_ns: float
    min_ns: int
    max_ns: int
    mean_ns: float
    faults_per_call: float | None = None  # mean minor page faults, when counted

    @property
    def median_ms(self) -> float:
        return self.median_ns / 1e6

    @property
    def p99_ms(self) -> float:
        return self.p99_ns / 1e6

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = asdict(self)
        d["median_ms"] = self.median_ms
        d["p99_ms"] = self.p99_ms
        return d


def _nearest_rank(sorted_samples: Sequence[int], q: float) -> int:
    """The ``q``-quantile (0 < q <= 1) by the nearest-rank method."""
    k = max(1, math.ceil(q * len(sorted_samples)))
    return sorted_samples[k - 1]


def summarize(samples_ns: Iterable[int], faults: Sequence[int] | None = None) -> Stats:
    s = sorted(samples_ns)
    if not s:
        raise ValueError("no samples")
    return Stats(
        n=len(s),
        median_ns=float(statistics.median(s)),
        p99_ns=float(_nearest_rank(s, 0.99)),
        min_ns=s[0],
        max_ns=s[-1],
        mean_ns=statistics.fmean(s),
        faults_per_call=statistics.fmean(faults) if faults else None,
    )


def _minflt_reader() -> Callable[[], int]:
    import resource  # Unix only; imported only when faults are counted

    def read() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    return read


def time_interleaved(
    peers: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 3,
    count_faults: bool = False,
) -> dict[str, Stats]:
    """Time every callable in ``peers`` ``repeats`` times, round-robin.

    ``warmup`` whole rounds run first and are discarded.  Returns ``{name: Stats}``
    in the order of ``peers``.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    names = list(peers)
    fns = [peers[n] for n in names]
    samples: list[list[int]] = [[] for _ in names]
    faults: list[list[int]] = [[] for _ in names]
    clock = time.perf_counter_ns
    minflt = _minflt_reader() if count_faults else (lambda: 0)
    k = len(names)
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(warmup + repeats):
            record = r >= warmup
            for j in range(k):
                i = (r + j) % k  # rotate who goes first
                fn = fns[i]
                f0 = minflt()
                t0 = clock()
                out = fn()
                t1 = clock()
                f1 = minflt()
                del out  # freeing the result is outside the sample
                if record:
                    samples[i].append(t1 - t0)
                    faults[i].append(f1 - f0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {
        name: summarize(samples[i], faults[i] if count_faults else None)
        for i, name in enumerate(names)
    }


def time_callable(fn: Callable[[], object], *, repeats: int, warmup: int = 3) -> Stats:
    """Time one callable: ``warmup`` discarded calls, then ``repeats`` samples."""
    return time_interleaved({"fn": fn}, repeats=repeats, warmup=warmup)["fn"]


def fmt_ms(ms: float) -> str:
    """Milliseconds with about three significant digits."""
    if ms != ms:  # NaN
        return "n/a"
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    if ms >= 0.1:
        return f"{ms:.3f}"
    return f"{ms:.4f}"


def format_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    align: str | None = None,
) -> str:
    """A Markdown pipe table with padded columns.

    ``align`` has one letter per column, ``l`` or ``r``; by default the first column
    is left-aligned and the others right-aligned.
    """
    ncol = len(headers)
    if align is None:
        align = "l" + "r" * (ncol - 1)
    if len(align) != ncol or any(len(r) != ncol for r in rows):
        raise ValueError("every row and the align string need one entry per header")
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(headers[i]), 3, *(len(r[i]) for r in cells)]) for i in range(ncol)]

    def line(items: Sequence[str]) -> str:
        padded = [
            s.ljust(widths[i]) if align[i] == "l" else s.rjust(widths[i])
            for i, s in enumerate(items)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = [
        "-" * widths[i] if align[i] == "l" else "-" * (widths[i] - 1) + ":" for i in range(ncol)
    ]
    return "\n".join([line(list(headers)), line(rule), *(line(r) for r in cells)])


def print_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    align: str | None = None,
    *,
    title: str | None = None,
) -> None:
    if title:
        print(title)
        print()
    print(format_table(headers, rows, align))


def format_targets(targets: Iterable[dict[str, Any]]) -> str:
    """The Markdown table of target checks (``target``, ``shown``, ``status``)."""
    return format_table(
        ["target", "measured", "status"],
        [[t["target"], t["shown"], t["status"]] for t in targets],
        "lrl",
    )


def failed_checks(targets: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The correctness checks among ``targets`` (``"check": True``: every record
    intact, nothing left in ``/dev/shm``...) that did not pass, unmeasured ones
    included.  A benchmark exits non-zero when there is any: a wrong answer or a leak
    fails the run, where a missed speed target (``"MISS"``) is only reported."""
    return [t for t in targets if t.get("check") and t.get("status") != "HIT"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for ln in f:
                if ln.startswith("model name"):
                    return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _thp_mode() -> str | None:
    """The transparent huge page mode (the bracketed word), Linux only."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else text.strip()


def machine_info(packages: Sequence[str] = ()) -> dict[str, Any]:
    """Platform, CPU, allocator-relevant facts (libc, transparent huge pages) and the
    versions of ``packages`` (``None`` when not installed)."""
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "libc": " ".join(platform.libc_ver()).strip() or None,
        "thp": _thp_mode(),
    }
    for name in packages:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            info[name] = None
        else:
            info[name] = getattr(mod, "__version__", "unknown")
    return info


def write_report(
    path: str | os.PathLike[str],
    benchmark: str,
    mode: str,
    seconds: float,
    loads: tuple[Sequence[float], Sequence[float]],
    machine: Mapping[str, Any],
    results: Any,
    targets: Any,
    **extra: Any,
) -> None:
    """Write a run's JSON report (the parent folder made as needed): the benchmark,
    its mode, how long it took, the load average at start and end, the machine, the
    results and the targets (``extra`` keys go before the machine)."""
    import json
    from pathlib import Path

    doc = {
        "benchmark": benchmark,
        "mode": mode,
        "seconds": seconds,
        "load_start": loads[0],
        "load_end": loads[1],
        **extra,
        "machine": machine,
        "results": results,
        "targets": targets,
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))


def die_with_parent() -> None:  # pragma: no cover - runs in the child
    """``preexec_fn`` of a benchmark's child: SIGKILL when this process dies
    (``PR_SET_PDEATHSIG``), so an interrupted run leaves no peer behind."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


async def interleaved_async(
    peers: dict[str, Callable[[], Awaitable[list[int]]]], *, rounds: int, warmup: int
) -> dict[str, list[int]]:
    """Run one round of each (async) peer per turn, the first one rotated every turn,
    with the collector off; the samples of the ``warmup`` first turns are dropped."""
    import gc

    names = list(peers)
    samples: dict[str, list[int]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        gc.collect()
        gc.disable()
        try:
            for j in range(len(names)):
                name = names[(r + j) % len(names)]
                got = await peers[name]()
                if r >= warmup:
                    samples[name].extend(got)
        finally:
            gc.enable()
    return samples


@contextlib.contextmanager
def started_peers(
    makers: Sequence[tuple[str, Callable[[], Any]]],
    only: set[str] | None,
    *,
    close_first: bool,
    skipped: dict[str, str] | None = None,
) -> Iterator[list[Any]]:
    """The peers of ``makers`` (``(key, make)``; only those in ``only`` if given; one whose
    package is missing is skipped with a line on stderr, and its reason kept in
    ``skipped``), each with ``ctrls`` (pipes to its reader processes), ``procs`` and
    ``close()``; at the end each reader is told ``("stop",)`` and reaped (:func:`reap`),
    the peer closed before that if ``close_first`` (its readers end when it closes),
    else after; a peer whose close fails is reported and the others still cleaned up."""
    peers: list[Any] = []
    try:
        for key, make in makers:
            if only and key not in only:
                continue
            try:
                peers.append(make())
            except ImportError as exc:
                if skipped is not None:
                    skipped[key] = str(exc)
                print(f"skipped {key}: {exc}", file=sys.stderr)
        yield peers
    finally:
        for p in peers:
            for c in p.ctrls:
                with contextlib.suppress(Exception):
                    c.send(("stop",))
            try:
                if close_first:
                    _close(p)
            finally:
                reap(p.procs)
            if not close_first:
                _close(p)


def _close(peer: Any) -> None:
    try:
        peer.close()
    except Exception as exc:  # noqa: BLE001 - report it, clean up the others
        print(f"closing {peer.name}: {exc!r}", file=sys.stderr)


def reap(procs: Sequence[Any], wait: float = 10.0) -> None:
    """Join each process, killing one still alive after ``wait`` seconds."""
    for p in procs:
        p.join(wait)
        if p.is_alive():
            p.kill()
            p.join()


def spawn_readers(
    target: Callable[..., None], args_per_reader: Sequence[tuple[Any, ...]]
) -> tuple[list[Any], list[Any]]:
    """One spawned daemon process per argument tuple, ``target(pipe, *args)``: the
    benchmark's ends of their control pipes and the processes (those started already
    are reaped if one fails to start)."""
    import multiprocessing as mp

    spawn = mp.get_context("spawn")
    ctrls: list[Any] = []
    procs: list[Any] = []
    try:
        for args in args_per_reader:
            mine, theirs = spawn.Pipe()
            p = spawn.Process(target=target, args=(theirs, *args), daemon=True)
            p.start()
            theirs.close()
            ctrls.append(mine)
            procs.append(p)
    except BaseException:
        reap(procs)
        raise
    return ctrls, procs


def await_ready(ctrls: Sequence[Any], timeout: float) -> None:
    """Wait for every reader's ``("ready", ...)``; ``RuntimeError`` after ``timeout``
    seconds without one."""
    for c in ctrls:
        if not c.poll(timeout):
            raise RuntimeError("a reader did not start")
        assert c.recv()[0] == "ready"
