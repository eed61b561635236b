"""Coverage-guided fuzzing of ringwire's parsers with atheris (libFuzzer for Python).

    python fuzz/atheris_fuzz.py TARGET [libFuzzer flags] [CORPUS_DIR ...]
    python fuzz/atheris_fuzz.py decode_untyped -runs=200000
    python fuzz/atheris_fuzz.py ring -max_total_time=600 fuzz/corpus/ring
    python fuzz/atheris_fuzz.py --list

TARGET is one of :data:`targets.TARGETS` (see ``fuzz/targets.py``).  ringwire's modules
are instrumented (edge coverage and comparison tracing) when they are imported here.
With no corpus directory, a temporary one is filled with the target's seeds (valid
messages from ringwire's own writers); a given directory that is empty gets them too.
A crash (an undocumented exception, a hang past ``-timeout``, RSS past
``-rss_limit_mb``, or a broken invariant) stops the run with libFuzzer's report and a
``crash-*`` / ``timeout-*`` file holding the input; turn it into a regression test in
``tests/process/test_fuzz.py``.

libFuzzer ends the process itself (Python's ``atexit`` does not run), so the harness
writes its own counters -- inputs per outcome -- to ``$RINGWIRE_FUZZ_STATS`` (a JSON
file) every 1000 inputs and on the last one of ``-runs``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import atheris

with atheris.instrument_imports(include=["ringwire"]):
    import targets  # noqa: E402  (imports ringwire's modules under instrumentation)


def _write_seeds(target: str, corpus: str) -> int:
    n = 0
    for i, seed in enumerate(targets.seeds(target)):
        with open(os.path.join(corpus, f"seed-{i:03d}"), "wb") as f:
            f.write(seed)
        n += 1
    return n


def main() -> None:
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__)
        for name, t in targets.TARGETS.items():
            print(f"  {name:16} {t.doc}")
        sys.exit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in targets.TARGETS:
        sys.exit(f"unknown target {name!r}; one of {sorted(targets.TARGETS)}")
    target = targets.TARGETS[name]
    flags = [a for a in rest if a.startswith("-")]
    dirs = [a for a in rest if not a.startswith("-")]
    if not dirs:
        dirs = [tempfile.mkdtemp(prefix=f"rwfuzz-{name}-")]
    for d in dirs:
        if os.path.isfile(d):  # a crash file given to rerun: libFuzzer runs it once
            continue
        os.makedirs(d, exist_ok=True)
        if not os.listdir(d):
            _write_seeds(name, d)
    runs = next((int(a.split("=", 1)[1]) for a in flags if a.startswith("-runs=")), -1)
    stats_path = os.environ.get("RINGWIRE_FUZZ_STATS")
    counts: dict[str, int] = {}
    state = {"n": 0, "t0": time.monotonic()}

    def dump() -> None:
        if stats_path:
            tmp = stats_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(
                    {
                        "target": name,
                        "inputs": state["n"],
                        "outcomes": counts,
                        "seconds": round(time.monotonic() - state["t0"], 2),
                    },
                    f,
                )
            os.replace(tmp, stats_path)

    run = target.run

    def one_input(data: bytes) -> None:
        outcome = run(data)
        counts[outcome] = counts.get(outcome, 0) + 1
        state["n"] += 1
        if state["n"] % 1000 == 0 or state["n"] == runs:
            dump()

    atheris.Setup([sys.argv[0], *flags, *dirs], one_input)
    dump()
    atheris.Fuzz()


if __name__ == "__main__":
    main()
