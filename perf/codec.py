"""Codec benchmark: ringwire's buffer layout vs the naive nested-Ext encoding.

Run ``python -m perf.codec`` (or ``python perf/codec.py``) from the repository root;
``--quick`` for fewer repeats, ``--json PATH`` to also write the results.

For every payload (numpy float32, torch float32, torch bfloat16 at 1 KiB, 64 KiB,
8 MiB and 64 MiB) one run times, round-robin in the same loop:

* ringwire ``Encoder().encode(x)``, ``Decoder().decode(msg)`` and, for numpy,
  ``Decoder(zero_copy=True).decode(msg)``;
* the naive baseline below: the raw bytes wrapped in an extra msgpack layer inside
  the Ext, decoded by unpacking that layer and copying the array out of it;
* two memcpy floors over the same payload bytes: ``np.copyto`` into a preallocated,
  already-touched array (pure copy bandwidth) and ``bytes(memoryview)`` (allocation
  plus copy, as any decode into fresh memory must do).

The message is the array/tensor itself (the top-level object), so the small rows show
the fixed per-message cost.  All times are milliseconds, smaller is better.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec
import numpy as np

from perf._common import fmt_ms, machine_info, print_table, time_interleaved
from ringwire import Decoder, Encoder

torch: Any
try:
    import torch
except ImportError:  # the torch rows are skipped
    torch = None

Ext = msgspec.msgpack.Ext

KiB = 1 << 10
MiB = 1 << 20
SIZES = [("1 KiB", 1 * KiB), ("64 KiB", 64 * KiB), ("8 MiB", 8 * MiB), ("64 MiB", 64 * MiB)]
# repeats per payload size: (default, --quick).  Sized so the default run of all
# twelve rows stays well under a minute on a 2-core VM.
REPEATS = {1 * KiB: (2000, 300), 64 * KiB: (1000, 150), 8 * MiB: (100, 20), 64 * MiB: (15, 5)}
WARMUP = {1 * KiB: (50, 10), 64 * KiB: (20, 5), 8 * MiB: (3, 2), 64 * MiB: (2, 1)}

TARGET_SPEEDUP = 10.0  # naive / ringwire, encode+decode, at 8 MiB
TARGET_DECODE_VS_MEMCPY = 2.0  # ringwire decode / one memcpy of the payload


# --------------------------------------------------------------------------- naive baseline


def _naive_torch_dtypes() -> dict[str, Any]:
    if torch is None:
        return {}
    names = ["float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8"]
    return {n: getattr(torch, n) for n in names}


_NAIVE_TORCH_DTYPES = _naive_torch_dtypes()


def _naive_enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        inner = msgspec.msgpack.encode([list(obj.shape), obj.dtype.str, obj.tobytes()])
        return Ext(3, inner)
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        dtype = str(t.dtype).removeprefix("torch.")
        inner = msgspec.msgpack.encode([list(t.shape), dtype, str(obj.device), raw])
        return Ext(2, inner)
    raise TypeError(f"naive codec cannot encode {type(obj).__qualname__}")


def _naive_ext_hook(code: int, data: memoryview) -> Any:
    if code == 3:
        shape, dtype, raw = msgspec.msgpack.decode(data)
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    if code == 2 and torch is not None:
        shape, dtype, _device, raw = msgspec.msgpack.decode(data)
        flat = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
        return flat.view(_NAIVE_TORCH_DTYPES[dtype]).reshape(shape)
    return Ext(code, bytes(data))


class NaiveEncoder:
    """The nested-Ext encoding: ``Ext(code, msgpack([shape, dtype, ..., raw bytes]))``.

    Copies per array: ``tobytes()``, the inner msgpack ``bin``, the outer message.
    """

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder(enc_hook=_naive_enc_hook)

    def encode(self, obj: Any) -> bytes:
        return self._enc.encode(obj)


class NaiveDecoder:
    """Decodes :class:`NaiveEncoder` output into writable, independent arrays/tensors.

    Copies per array: the inner msgpack ``bin`` into ``bytes``, then ``.copy()``.
    """

    def __init__(self) -> None:
        self._dec = msgspec.msgpack.Decoder(ext_hook=_naive_ext_hook)

    def decode(self, buf: bytes) -> Any:
        return self._dec.decode(buf)


# --------------------------------------------------------------------------- payloads


def _shape(nelem: int) -> tuple[int, ...]:
    return (nelem // 256, 256) if nelem % 256 == 0 and nelem >= 256 else (nelem,)


def make_payloads(nbytes: int) -> list[tuple[str, Any, np.ndarray]]:
    """``[(kind, value, uint8 view of its raw bytes)]`` for one payload size."""
    rng = np.random.default_rng(nbytes)
    out: list[tuple[str, Any, np.ndarray]] = []
    a = rng.standard_normal(nbytes // 4, dtype=np.float32).reshape(_shape(nbytes // 4))
    out.append(("numpy float32", a, a.reshape(-1).view(np.uint8)))
    if torch is not None:
        g = torch.Generator().manual_seed(nbytes)
        for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            nelem = nbytes // (torch.finfo(dt).bits // 8)
            t = torch.randn(_shape(nelem), dtype=dt, generator=g)
            out.append((f"torch {name}", t, t.reshape(-1).view(torch.uint8).numpy()))
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    return (
        isinstance(b, torch.Tensor)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


# --------------------------------------------------------------------------- one row


COLUMNS = [
    ("rw_enc", "ringwire enc"),
    ("rw_dec", "ringwire dec (copy)"),
    ("rw_dec_zc", "ringwire dec (zero_copy)"),
    ("naive_enc", "naive enc"),
    ("naive_dec", "naive dec"),
    ("memcpy_copyto", "memcpy copyto"),
    ("memcpy_bytes", "memcpy bytes()"),
]


def bench_row(
    kind: str, value: Any, raw: np.ndarray, *, repeats: int, warmup: int
) -> dict[str, Any]:
    rw_enc, rw_dec, rw_zc = Encoder(), Decoder(), Decoder(zero_copy=True)
    nv_enc, nv_dec = NaiveEncoder(), NaiveDecoder()

    rw_msg = rw_enc.encode(value)
    nv_msg = nv_enc.encode(value)
    # both round trips must give back the same array before anything is timed
    if not (_same(value, rw_dec.decode(rw_msg)) and _same(value, nv_dec.decode(nv_msg))):
        raise AssertionError(f"{kind}: a round trip changed the payload")
    is_numpy = isinstance(value, np.ndarray)
    if is_numpy and not _same(value, rw_zc.decode(rw_msg)):
        raise AssertionError(f"{kind}: zero-copy round trip changed the payload")

    dst = np.empty_like(raw)
    np.copyto(dst, raw)  # touch the destination pages once, outside the samples
    raw_mv = memoryview(raw)  # type: ignore[arg-type]  # numpy's stubs lack Buffer

    peers: dict[str, Callable[[], object]] = {
        "rw_enc": lambda: rw_enc.encode(value),
        "rw_dec": lambda: rw_dec.decode(rw_msg),
        "naive_enc": lambda: nv_enc.encode(value),
        "naive_dec": lambda: nv_dec.decode(nv_msg),
        "memcpy_copyto": lambda: np.copyto(dst, raw),
        "memcpy_bytes": lambda: bytes(raw_mv),
    }
    if is_numpy:
        peers["rw_dec_zc"] = lambda: rw_zc.decode(rw_msg)
    stats = time_interleaved(peers, repeats=repeats, warmup=warmup, count_faults=True)

    med = {k: s.median_ms for k, s in stats.items()}
    ratios = {
        "naive_over_rw_total": (med["naive_enc"] + med["naive_dec"])
        / (med["rw_enc"] + med["rw_dec"]),
        "naive_over_rw_enc": med["naive_enc"] / med["rw_enc"],
        "naive_over_rw_dec": med["naive_dec"] / med["rw_dec"],
        "rw_dec_over_copyto": med["rw_dec"] / med["memcpy_copyto"],
        "rw_dec_over_bytes": med["rw_dec"] / med["memcpy_bytes"],
    }
    return {
        "kind": kind,
        "nbytes": int(raw.nbytes),
        "message_bytes": {"ringwire": len(rw_msg), "naive": len(nv_msg)},
        "repeats": repeats,
        "warmup": warmup,
        "stats": {k: s.to_dict() for k, s in stats.items()},
        "ratios": ratios,
    }


# --------------------------------------------------------------------------- report


def _size_label(nbytes: int) -> str:
    return next(label for label, n in SIZES if n == nbytes)


def _cell(row: dict[str, Any], key: str) -> str:
    s = row["stats"].get(key)
    if s is None:
        return "n/a"
    return f"{fmt_ms(s['median_ms'])} / {fmt_ms(s['p99_ms'])}"


def print_report(rows: list[dict[str, Any]], info: dict[str, Any], quick: bool) -> None:
    print("# ringwire codec: buffer layout vs naive nested Ext")
    print()
    print(
        f"machine: {info['platform']}, {info['cpu']}, {info['cpu_count']} CPUs "
        f"({info['cpus_usable']} usable), {info['libc']}, transparent huge pages: "
        f"{info['thp']}; python {info['python']}, numpy {info['numpy']}, "
        f"msgspec {info['msgspec']}, torch {info['torch']}, ringwire {info['ringwire']}"
    )
    print(
        f"mode: {'quick' if quick else 'default'}; peers interleaved round-robin per row; "
        "cells are median / p99 in ms (smaller is better); ratios from medians"
    )
    print()
    headers = ["payload", *(title for _, title in COLUMNS)]
    headers += ["naive÷rw enc+dec", "rw dec÷copyto", "rw dec÷bytes()"]
    table = []
    for r in rows:
        q = r["ratios"]
        table.append(
            [
                f"{r['kind']} {_size_label(r['nbytes'])}",
                *(_cell(r, key) for key, _ in COLUMNS),
                f"{q['naive_over_rw_total']:.2f}×",
                f"{q['rw_dec_over_copyto']:.2f}×",
                f"{q['rw_dec_over_bytes']:.2f}×",
            ]
        )
    print_table(headers, table)
    print()
    big = [r for r in rows if r["nbytes"] >= 8 * MiB]
    if big:
        print("minor page faults per call (mean over the timed calls; 4 KiB pages unless")
        print("the allocator asked for huge pages), payloads >= 8 MiB:")
        print()
        fault_rows = []
        for r in big:
            cells = []
            for key, _ in COLUMNS:
                s = r["stats"].get(key)
                f = None if s is None else s.get("faults_per_call")
                cells.append("n/a" if f is None else f"{f:.0f}")
            fault_rows.append([f"{r['kind']} {_size_label(r['nbytes'])}", *cells])
        print_table(["payload", *(title for _, title in COLUMNS)], fault_rows)
        print()
    for line in target_lines(rows):
        print(line)


def target_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    at8 = [r for r in rows if r["nbytes"] == 8 * MiB]
    if at8:
        parts = ", ".join(f"{r['kind']} {r['ratios']['naive_over_rw_total']:.2f}×" for r in at8)
        ok = all(r["ratios"]["naive_over_rw_total"] >= TARGET_SPEEDUP for r in at8)
        lines.append(
            f"target naive÷ringwire ≥ {TARGET_SPEEDUP:g}× at 8 MiB (enc+dec): {parts} "
            f"-> {'MET' if ok else 'MISSED'}"
        )
    big = [r for r in rows if r["nbytes"] >= 8 * MiB]
    if big:
        parts = ", ".join(
            f"{r['kind']} {_size_label(r['nbytes'])} {r['ratios']['rw_dec_over_copyto']:.2f}×"
            for r in big
        )
        ok = all(r["ratios"]["rw_dec_over_copyto"] <= TARGET_DECODE_VS_MEMCPY for r in big)
        lines.append(
            f"target ringwire decode ≤ {TARGET_DECODE_VS_MEMCPY:g}× memcpy (np.copyto floor, "
            f"≥ 8 MiB): {parts} -> {'MET' if ok else 'MISSED'}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m perf.codec",
        description="ringwire codec vs the naive nested-Ext encoding (smaller is better)",
    )
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a few seconds)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)

    info = machine_info(["numpy", "msgspec", "torch", "ringwire"])
    pick = 1 if args.quick else 0
    rows = []
    for _label, nbytes in SIZES:
        for kind, value, raw in make_payloads(nbytes):
            rows.append(
                bench_row(
                    kind,
                    value,
                    raw,
                    repeats=REPEATS[nbytes][pick],
                    warmup=WARMUP[nbytes][pick],
                )
            )
    print_report(rows, info, args.quick)

    if args.json:
        doc = {
            "benchmark": "perf.codec",
            "machine": info,
            "quick": args.quick,
            "unit": "ms (stats also in ns); smaller is better",
            "targets": {
                "naive_over_rw_total_at_8MiB_min": TARGET_SPEEDUP,
                "rw_dec_over_copyto_max": TARGET_DECODE_VS_MEMCPY,
                "summary": target_lines(rows),
            },
            "rows": rows,
        }
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
