"""Long run: memory (RSS) and /dev/shm use over many records and tensor handoffs.

Run from the repository root::

    python -m perf.longrun             # 5 M records + 40 000 tensor handoffs (~1 minute)
    python -m perf.longrun --quick     # 200 000 records + 2 000 handoffs (~10 s)
    python -m perf.longrun --records 20000000 --json out.json

One connection (``ringwire.pair()``, blocking endpoints, the default tensor-slot pool),
this process producing, a ``spawn`` child consuming.  The producer sends the records
in batches (``send_many`` of 256 small :class:`perf.peers.Req` records) and, spread
evenly over the run, tensor handoffs in turn: a 1 MiB float32 loan (``loan`` -> fill ->
``send``), a 4 MiB float32 copy-in (``send`` of a private array: one copy into a slot)
and a 32 KiB array sent inline (below the slot threshold) -- plus, in the full mode
when torch is installed, a 2 MiB bfloat16 torch tensor copy-in.  The consumer checks a
marker element of every array and drops it (which releases its slot).

Sampled at fixed points of the run (after a warm-up of 2 %, then every 5 %): VmRSS,
RssAnon, RssShmem and VmHWM of both processes (``/proc/<pid>/status``), their open
file descriptors, the ringwire names of both pids in ``/dev/shm`` (count and bytes;
they are unlinked once both sides attached, so normally none), and the used bytes of
the whole ``/dev/shm`` file system (every process on the machine, for information).
After the run: the same names again (must be none), the child's exit status, and what
``/dev/shm`` held of ours.

Targets: after the warm-up, RSS grows by at most 8 MiB per process over the whole run,
and by at most max(2 MiB, 2 %) over its second half (flat); nothing of ours left in
``/dev/shm``; every slot back in the pool; the child exits cleanly.  The last four,
no descriptor growth, and every record and array intact are correctness checks: a
run that fails one exits 1 (a wrong answer or a leak), where a missed RSS target is
only reported.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perf import peers as P
from perf._common import failed_checks, format_table, format_targets, machine_info

MiB = 1 << 20
BATCH = P.BATCH
WARMUP_FRAC = 0.05
SAMPLE_EVERY = 0.05
T_GROWTH_TOTAL = 8 * MiB  # after warm-up -> end
T_GROWTH_HALF = 2 * MiB  # mid -> end (or 2 % of the midpoint RSS, whichever is larger)
T_GROWTH_HALF_FRAC = 0.02


@dataclass
class Config:
    records: int
    handoffs: int
    torch: bool


QUICK = Config(records=200_000, handoffs=2_000, torch=False)
FULL = Config(records=5_000_000, handoffs=40_000, torch=True)

STATUS_KEYS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM", "Threads")


def proc_status(pid: int) -> dict[str, int]:
    """Selected fields of /proc/<pid>/status (memory in bytes), plus open fds."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in STATUS_KEYS:
                    v = rest.split()
                    out[key] = int(v[0]) * (1024 if len(v) > 1 and v[1] == "kB" else 1)
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError, IndexError):
        pass
    return out


def shm_ours(pids: set[int], shm_dir: str = "/dev/shm") -> dict[str, Any]:
    """ringwire names (rw.<pid>.<hex>) created by ``pids``: count, sizes, names."""
    names, size, alloc = [], 0, 0
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        entries = []
    for e in entries:
        parts = e.name.split(".")
        if len(parts) == 3 and parts[0] == "rw" and parts[1].isdigit() and int(parts[1]) in pids:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            names.append(e.name)
            size += st.st_size
            alloc += st.st_blocks * 512
    return {"count": len(names), "bytes": size, "allocated": alloc, "names": sorted(names)}


def shm_fs_used(shm_dir: str = "/dev/shm") -> int | None:
    """Used bytes of the /dev/shm file system (every process, unlinked-but-mapped
    segments included)."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    return (st.f_blocks - st.f_bfree) * st.f_frsize


# --------------------------------------------------------------------------- the consumer


def _marker_ok(np: Any, rec: dict[str, Any]) -> bool:
    x = rec["x"]
    if hasattr(x, "numpy"):  # torch: compare as float
        return float(x.reshape(-1)[0]) == float(rec["seq"] % 256)
    return int(np.asarray(x).reshape(-1)[0]) == rec["seq"] % 256


def _consumer(ctrl: Any, end: Any) -> None:
    import numpy as np
    from anyio import EndOfStream

    chan = end.connect_sync(handshake_timeout=P.SETUP_TIMEOUT_S)
    got = arrays = bad = 0
    try:
        ctrl.send(("ready", os.getpid()))
        rm = chan.receive_many
        while True:
            try:
                batch = rm(1024, P.CHILD_WAIT_S)
            except EndOfStream:
                break
            for rec in batch:
                got += 1
                if type(rec) is dict:
                    arrays += 1
                    bad += not _marker_ok(np, rec)
            batch = rec = None  # drop the last views: their slots go back
        st = chan.statistics()
        ctrl.send(
            (
                "done",
                {
                    "records": got,
                    "arrays": arrays,
                    "bad_markers": bad,
                    "slot_arrays_received": st.slot_arrays_received,
                    "slot_arrays_held": st.slot_arrays_held,
                    "receive_parks": st.receive_parks,
                },
            )
        )
        P.ctrl_recv(ctrl)  # wait until the parent has taken its last sample
    finally:
        chan.close()


# --------------------------------------------------------------------------- the run


def run(cfg: Config, records: int) -> dict[str, Any]:
    import numpy as np

    import ringwire

    torch: Any = None
    if cfg.torch:
        try:
            import torch
        except ImportError:
            torch = None

    ctx = mp.get_context("spawn")
    me = os.getpid()
    shm_before = shm_fs_used()
    ours_before = shm_ours({me})
    a, b = ringwire.pair()
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(
        target=P.child_entry, args=(_consumer, child_end, b), daemon=True, name="perf-longrun"
    )
    proc.start()
    child_end.close()
    b.close()
    chan = None
    cpid: int | None = None
    samples: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    try:
        chan = a.connect_sync(handshake_timeout=P.SETUP_TIMEOUT_S)
        if not parent_end.poll(P.SETUP_TIMEOUT_S):
            raise RuntimeError("the consumer did not start")
        tag, cpid = parent_end.recv()
        if tag != "ready":
            raise RuntimeError(f"consumer: {tag} {cpid}")
        pids = {me, cpid}

        def sample(label: str, sent: int, handed: int) -> None:
            samples.append(
                {
                    "label": label,
                    "records_sent": sent,
                    "handoffs_sent": handed,
                    "t": time.monotonic() - t0,
                    "producer": proc_status(me),
                    "consumer": proc_status(cpid),
                    "shm_ours": {k: v for k, v in shm_ours(pids).items() if k != "names"},
                    "shm_fs_used": shm_fs_used(),
                }
            )

        recs = [P.make_record(i) for i in range(BATCH)]
        big = np.zeros((1024, 1024), np.float32)  # 4 MiB: copy-in
        small = np.zeros((64, 128), np.float32)  # 32 KiB: inline (below the threshold)
        tt = torch.zeros((1024, 1024), dtype=torch.bfloat16) if torch is not None else None
        kinds = ["loan", "copy", "inline"] + (["torch"] if tt is not None else [])
        batches = max(1, records // BATCH)
        # handoff j goes out after batch ceil((j + 1) * batches / handoffs): spread evenly
        due = [-(-(j + 1) * batches // cfg.handoffs) for j in range(cfg.handoffs)]
        marks = sorted(
            {max(1, int(batches * WARMUP_FRAC))}
            | {max(1, int(batches * f * SAMPLE_EVERY)) for f in range(1, int(1 / SAMPLE_EVERY) + 1)}
        )
        mid_batch = batches // 2
        sent = handed = 0
        t0 = time.monotonic()
        sample("connected", 0, 0)
        next_mark = 0
        for bi in range(1, batches + 1):
            chan.send_many(recs, P.CHILD_WAIT_S)
            sent += BATCH
            while handed < cfg.handoffs and due[handed] <= bi:
                kind = kinds[handed % len(kinds)]
                seq = handed
                if kind == "loan":
                    x = chan.loan((256, 1024), np.float32, timeout=P.CHILD_WAIT_S)
                    x[0, 0] = seq % 256
                    chan.send({"seq": seq, "x": x}, P.CHILD_WAIT_S)
                    del x
                elif kind == "copy":
                    big[0, 0] = seq % 256
                    chan.send({"seq": seq, "x": big}, P.CHILD_WAIT_S)
                elif kind == "inline":
                    small[0, 0] = seq % 256
                    chan.send({"seq": seq, "x": small}, P.CHILD_WAIT_S)
                else:
                    assert tt is not None
                    tt[0, 0] = seq % 256
                    chan.send({"seq": seq, "x": tt}, P.CHILD_WAIT_S)
                handed += 1
                sent += 1
            while next_mark < len(marks) and bi >= marks[next_mark]:
                label = "warm-up" if next_mark == 0 else f"{bi / batches:.0%}"
                if bi >= mid_batch and not any(sm["label"] == "mid" for sm in samples):
                    label = "mid"
                sample(label, sent, handed)
                next_mark += 1
        elapsed = time.monotonic() - t0
        chan.send_eof()
        if not parent_end.poll(P.CHILD_WAIT_S):
            raise RuntimeError("the consumer did not finish")
        tag, info = parent_end.recv()
        if tag != "done":
            raise RuntimeError(f"consumer: {tag} {info}")
        time.sleep(0.05)  # the last releases travel back
        pst = chan.statistics()
        sample("end", sent, handed)
        samples[-1]["label"] = "end"
        result.update(
            records_sent=sent,
            handoffs_sent=handed,
            handoff_kinds=kinds,
            elapsed_s=elapsed,
            records_per_s=sent / elapsed if elapsed else None,
            consumer=info,
            producer_stats={
                "slots_in_use": pst.slots_in_use,
                "releases_received": pst.releases_received,
                "loans_outstanding": pst.loans_outstanding,
                "inline_fallbacks": pst.inline_fallbacks,
                "send_parks": pst.send_parks,
            },
        )
    finally:
        if chan is not None:
            chan.close()
        try:
            parent_end.send(None)
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        parent_end.close()
    result["shm_bound"] = _shm_bound()
    result["child_exitcode"] = proc.exitcode
    result["samples"] = samples
    result["shm_before"] = {"fs_used": shm_before, "ours": ours_before["count"]}
    after = shm_ours({me} | ({cpid} if cpid else set()))
    result["shm_after"] = {
        "fs_used": shm_fs_used(),
        "ours": after["count"],
        "ours_bytes": after["bytes"],
        "names": after["names"],
    }
    result["children_left"] = [c.pid for c in mp.active_children()]
    return result


def _shm_bound() -> int | None:
    """Both sides' default send pools plus the two ring lanes: what one process of the
    connection can map of shared memory at most (headers aside)."""
    try:
        import ringwire

        pool = sum(c.size * c.count for c in ringwire.DEFAULT_SLOTS.classes)
        return 2 * pool + 2 * int(ringwire.DEFAULT_CAPACITY) + 2 * MiB  # + headers, lanes
    except Exception:
        return None


# --------------------------------------------------------------------------- report


def _mib(v: float | None) -> str:
    return "—" if v is None else f"{v / MiB:.1f}"


def _growth(v: float | None) -> str:
    return "—" if v is None else f"{v / MiB:+.2f}"


def _metric(st: dict[str, Any], key: str) -> Any:
    if key == "VmRSS − RssShmem":
        rss, shm = st.get("VmRSS"), st.get("RssShmem")
        return rss - shm if rss is not None and shm is not None else None
    return st.get(key)


def _pick(samples: list[dict[str, Any]], label: str) -> dict[str, Any] | None:
    return next((s for s in samples if s["label"] == label), None)


def evaluate(result: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The Markdown tables and the targets of one run."""
    samples = result.get("samples", [])
    warm, mid, end = (_pick(samples, k) for k in ("warm-up", "mid", "end"))
    first = samples[0] if samples else None
    lines: list[str] = []
    targets: list[dict[str, Any]] = []

    def target(
        what: str, value: float | None, limit: float, op: str, shown: str, check: bool = False
    ) -> None:
        # check: a correctness check (a wrong answer, a leak), which fails the run when it
        # does not pass -- also when it could not be measured (n/a)
        ok = None if value is None else (value <= limit if op == "<=" else value >= limit)
        status = "n/a" if ok is None else "HIT" if ok else "MISS"
        if check and not ok:
            status = "FAIL"
        targets.append(
            {
                "target": what,
                "value": value,
                "limit": limit,
                "op": op,
                "shown": shown,
                "status": status,
                "check": check,
            }
        )

    rows = []
    for who in ("producer", "consumer"):
        for key in ("VmRSS", "RssAnon", "RssShmem", "VmRSS − RssShmem", "VmHWM", "fds"):

            def val(s: dict[str, Any] | None, who: str = who, key: str = key) -> float | None:
                return None if s is None else _metric(s[who], key)

            v0, vw, vm, ve = val(first), val(warm), val(mid), val(end)
            is_fd = key == "fds"
            f = (lambda v: "—" if v is None else str(v)) if is_fd else _mib
            g = (lambda v: "—" if v is None else f"{v:+d}") if is_fd else _growth
            rows.append(
                [
                    who,
                    key + ("" if is_fd else " MiB"),
                    f(v0),
                    f(vw),
                    f(vm),
                    f(ve),
                    g(ve - vw if ve is not None and vw is not None else None),
                    g(ve - vm if ve is not None and vm is not None else None),
                ]
            )
    lines.append(
        format_table(
            [
                "process",
                "metric",
                "connected",
                "after warm-up",
                "mid",
                "end",
                "end − warm-up",
                "end − mid",
            ],
            rows,
            "llrrrrrr",
        )
    )
    lines.append("")
    shm_rows = [
        [
            s["label"],
            f"{s['records_sent']:,}",
            f"{s['handoffs_sent']:,}",
            str(s["shm_ours"]["count"]),
            _mib(s["shm_ours"]["bytes"]),
            _mib(s.get("shm_fs_used")),
        ]
        for s in samples
        if s["label"] in ("connected", "warm-up", "mid", "end")
    ]
    after = result.get("shm_after", {})
    before = result.get("shm_before", {})
    shm_rows.append(
        [
            "after close",
            "—",
            "—",
            str(after.get("ours", "—")),
            _mib(after.get("ours_bytes")),
            _mib(after.get("fs_used")),
        ]
    )
    lines.append(
        format_table(
            [
                "point",
                "records sent",
                "handoffs sent",
                "our /dev/shm names",
                "their MiB",
                "/dev/shm used MiB (whole machine)",
            ],
            shm_rows,
            "lrrrrr",
        )
    )
    lines.append("")
    lines.append(
        f"/dev/shm used before the run: {_mib(before.get('fs_used'))} MiB (whole machine, "
        "other processes included); ringwire names are unlinked as soon as both ends "
        "attached, so the pool and rings show up as RssShmem of the processes, not as files."
    )
    bound = result.get("shm_bound")
    for who in ("producer", "consumer"):

        def get(s: dict[str, Any] | None, key: str, who: str = who) -> Any:
            return None if s is None else s[who].get(key)

        aw, ae = get(warm, "RssAnon"), get(end, "RssAnon")
        tot = ae - aw if ae is not None and aw is not None else None
        target(
            f"{who} private memory (RssAnon) growth after warm-up ≤ {T_GROWTH_TOTAL // MiB} MiB",
            tot,
            T_GROWTH_TOTAL,
            "<=",
            _growth(tot) + " MiB",
        )
        vm = None if mid is None else _metric(mid[who], "VmRSS − RssShmem")
        ve = None if end is None else _metric(end[who], "VmRSS − RssShmem")
        half = ve - vm if ve is not None and vm is not None else None
        lim = max(T_GROWTH_HALF, T_GROWTH_HALF_FRAC * vm) if vm else T_GROWTH_HALF
        target(
            f"{who} RSS flat: VmRSS − RssShmem growth over the second half ≤ max(2 MiB, 2 %)",
            half,
            lim,
            "<=",
            _growth(half) + " MiB",
        )
        peak = max((s[who].get("RssShmem") or 0 for s in samples), default=None)
        if bound:
            target(
                f"(info) {who} shared memory (RssShmem) ≤ both pools + both ring lanes "
                f"({bound / MiB:.0f} MiB)",
                peak,
                bound,
                "<=",
                f"peak {_mib(peak)} MiB",
            )
        fw, fe = get(warm, "fds"), get(end, "fds")
        df = fe - fw if fe is not None and fw is not None else None
        target(f"{who} open fds: no growth", df, 0, "<=", "—" if df is None else f"{df:+d}", True)
    target(
        "nothing of ours left in /dev/shm after close",
        after.get("ours"),
        0,
        "<=",
        f"{after.get('ours', '—')} names",
        True,
    )
    ps = result.get("producer_stats", {})
    target(
        "every slot back in the pool at the end",
        ps.get("slots_in_use"),
        0,
        "<=",
        f"{ps.get('slots_in_use', '—')} in use",
        True,
    )
    ci = result.get("consumer", {})
    target(
        "every record and array arrived intact",
        (ci.get("bad_markers", 0) or 0)
        + abs(ci.get("records", -1) - result.get("records_sent", 0)),
        0,
        "<=",
        f"{ci.get('records', '—'):,} of {result.get('records_sent', 0):,} records, "
        f"{ci.get('bad_markers', '—')} bad markers"
        if isinstance(ci.get("records"), int)
        else "—",
        True,
    )
    target(
        "consumer exited cleanly, no child left",
        (0 if result.get("child_exitcode") == 0 else 1) + len(result.get("children_left", [])),
        0,
        "<=",
        f"exit {result.get('child_exitcode')}, {len(result.get('children_left', []))} left",
        True,
    )
    return "\n".join(lines), targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="200 000 records, 2 000 handoffs")
    ap.add_argument("--records", type=int, help="records to send (default: by mode)")
    ap.add_argument("--handoffs", type=int, help="tensor handoffs (default: by mode)")
    ap.add_argument("--no-torch", action="store_true", help="no torch tensor handoffs")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.handoffs is not None:
        cfg = Config(cfg.records, args.handoffs, cfg.torch)
    if args.no_torch:
        cfg = Config(cfg.records, cfg.handoffs, False)
    records = args.records or cfg.records

    info = machine_info()
    print("## Long run: memory and /dev/shm" + (" (--quick)" if args.quick else ""))
    print()
    print(
        f"- {records:,} records (100 B, send_many batches of {BATCH}) and {cfg.handoffs:,} "
        f"tensor handoffs through one connection; platform {info['platform']}, "
        f"python {info['python']}"
    )
    t = time.monotonic()
    result = run(cfg, records)
    tables, targets = evaluate(result)
    print(
        f"- {result.get('records_sent', 0):,} records incl. {result.get('handoffs_sent', 0):,} "
        f"handoffs ({', '.join(result.get('handoff_kinds', []))}) in "
        f"{result.get('elapsed_s', 0):.1f} s ({(result.get('records_per_s') or 0):,.0f} records/s)"
    )
    print()
    print(tables)
    print("\n### Targets\n")
    print(format_targets(targets))
    elapsed = time.monotonic() - t
    print(f"\n(total {elapsed:.0f} s)")
    if args.json:
        out = {
            "machine": info,
            "config": {**cfg.__dict__, "records": records},
            "quick": args.quick,
            "results": result,
            "targets": targets,
            "tables": {"longrun": tables},
            "elapsed_s": elapsed,
        }
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2, default=str) + "\n", encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)
    # a missed target (RSS growth) is a result; a failed check -- a record lost or
    # corrupted, a name left in /dev/shm, a slot or descriptor not given back, the
    # consumer not exiting cleanly -- means the run itself is wrong: exit 1
    failed = failed_checks(targets)
    if failed:
        print(
            "\nFAILED: " + "; ".join(f"{t['target']} ({t['shown']})" for t in failed),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
