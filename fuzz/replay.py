"""Replay inputs through a fuzz target, and measure which lines of the parsers they reach.

    python fuzz/replay.py TARGET FILE_OR_DIR ...            # rerun a crash or a corpus
    python fuzz/replay.py TARGET DIR ... --coverage          # + line coverage per parser

No atheris needed.  ``--coverage`` traces (``sys.settrace``) the lines run inside the
functions listed in :data:`PARSERS` and prints, for each, lines reached / lines it has.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from types import CodeType
from typing import Any

import targets

# The functions that read peer-controlled bytes, per target (module path, qualname).
PARSERS: dict[str, list[str]] = {
    "decode": [
        "ringwire._wire.codec:Decoder.decode",
        "ringwire._wire.codec:Decoder._ext_hook",
        "ringwire._wire.codec:Decoder._array",
        "ringwire._wire.codec:Decoder._ndarray",
        "ringwire._wire.codec:Decoder._tensor",
        "ringwire._wire.codec:Decoder._to_device",
        "ringwire._wire.codec:Decoder._shm_ref",
        "ringwire._wire.codec:Decoder._cuda_ref",
        "ringwire._wire.codec:Decoder._tuple",
        "ringwire._wire.codec:Decoder._torch_size",
        "ringwire._wire.codec:Decoder._torch_dtype",
        "ringwire._wire.codec:Decoder._torch_device",
        "ringwire._wire.codec:Decoder._numpy_dtype",
        "ringwire._wire.codec:Decoder._numpy_scalar",
        "ringwire._wire.codec:Decoder._dec_hook",
        "ringwire._wire.codec:_split_buffer",
        "ringwire._wire.codec:_check_shape",
        "ringwire._wire.codec:_check_raw",
        "ringwire._wire.codec:_check_text",
        "ringwire._wire.codec:_check_device",
        "ringwire._wire.dtypes:numpy_dtype_from_wire",
        "ringwire._wire.dtypes:_numpy_dtype_from_wire",
        "ringwire._wire.dtypes:torch_dtype_from_wire",
        "ringwire._wire.descriptors:decode_descriptor",
        "ringwire._wire.descriptors:_check_nbytes",
    ],
    "slots": [
        "ringwire._shm.recvpool:ShmRecvPool.resolve",
        "ringwire._shm.recvpool:ShmRecvPool.salvage",
        "ringwire._wire.slotlayout:check_ref",
        "ringwire._shm.sendpool:ShmSendPool._poll_locked",
        "ringwire._shm.sendpool:ShmSendPool.reclaim",
        "ringwire._wire.slotlayout:SlotAllocator.release",
    ],
    "ring": [
        "ringwire._wire.ring:RingReader.next_frame",
        "ringwire._wire.ring:RingReader.read_many",
        "ringwire._wire.ring:RingReader._load_tail",
        "ringwire._wire.ring:RingWriter._refresh_head",
        "ringwire._wire.ring:RingWriter.try_write",
        "ringwire._wire.ring:RingWriter.write_many",
        "ringwire._wire.ring:check_ring",
        "ringwire._wire.ring:_Lane.__init__",
    ],
    "handshake": [
        "ringwire._wire.control:decode_message",
        "ringwire._wire.control:Handshake.next_message",
        "ringwire._wire.control:Handshake.receive_data",
        "ringwire._wire.control:validate_hello",
        "ringwire._wire.control:choose_version",
    ],
}


def _code_of(spec: str) -> CodeType:
    mod_name, qual = spec.split(":")
    obj: Any = sys.modules[mod_name]
    for part in qual.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__wrapped__", obj).__code__


def _lines(code: CodeType) -> set[int]:
    out = {ln for _, _, ln in code.co_lines() if ln is not None and ln != code.co_firstlineno}
    for const in code.co_consts:  # nested functions and comprehensions
        if isinstance(const, CodeType):
            out |= _lines(const)
    return out


def _inputs(paths: list[str]) -> list[bytes]:
    out = []
    for p in paths:
        files = [os.path.join(p, f) for f in sorted(os.listdir(p))] if os.path.isdir(p) else [p]
        for f in files:
            with open(f, "rb") as fh:
                out.append(fh.read())
    return out


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    coverage = "--coverage" in sys.argv
    if len(args) < 2 or args[0] not in targets.TARGETS:
        sys.exit(__doc__)
    run: Callable[[bytes], str] = targets.TARGETS[args[0]].run
    inputs = _inputs(args[1:]) + targets.seeds(args[0])
    specs = [s for group in PARSERS.values() for s in group]
    codes = {}
    for spec in specs:
        try:
            codes[spec] = _code_of(spec)
        except AttributeError:
            pass
    hit: dict[CodeType, set[int]] = {}
    wanted = set()
    for c in codes.values():
        wanted.add(c)
        for const in c.co_consts:
            if isinstance(const, CodeType):
                wanted.add(const)

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code not in wanted:
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line":
                hit.setdefault(frame.f_code, set()).add(frame.f_lineno)
            return local

        return local

    outcomes: dict[str, int] = {}
    if coverage:
        sys.settrace(tracer)
    try:
        for data in inputs:
            try:
                out = run(data)
            except Exception:
                traceback.print_exc()
                out = "CRASH"
            outcomes[out] = outcomes.get(out, 0) + 1
    finally:
        sys.settrace(None)
    print(f"{len(inputs)} inputs: {outcomes}")
    if coverage:
        total_have = total_hit = 0
        for group in PARSERS.values():
            rows = []
            for spec in group:
                code = codes.get(spec)
                if code is None:
                    continue
                have = _lines(code)
                got: set[int] = set()
                for c in wanted:
                    if c is code or c in code.co_consts:
                        got |= hit.get(c, set())
                rows.append((spec, len(got & have), len(have)))
            if not any(n for _, n, _ in rows):
                continue  # a group this target does not reach
            for spec, n, m in rows:
                total_have += m
                total_hit += n
                print(f"  {spec:50} {n:3}/{m:3} lines")
        if total_have:
            pct = 100 * total_hit / total_have
            print(f"  parsers of this target: {total_hit}/{total_have} lines ({pct:.0f}%)")


if __name__ == "__main__":
    main()
