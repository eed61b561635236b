"""Fuzzing under atheris (coverage-guided, in a subprocess, since libFuzzer ends the
process): the targets of ``fuzz/targets.py`` through ``fuzz/atheris_fuzz.py``, all of
them in one short run in CI mode, each target for ``RINGWIRE_FUZZ_SECONDS`` (default 120)
in the long mode (``pytest --long``); skipped where atheris does not install.  The
hypothesis fuzzers and the regressions are in tests/unit/test_fuzz.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest
from support.fuzz import FUZZ, NAMES

pytestmark = pytest.mark.multiprocess  # every test here starts a process


def _has_atheris() -> bool:
    return importlib.util.find_spec("atheris") is not None


needs_atheris = pytest.mark.skipif(
    not _has_atheris(),
    reason="atheris is not installed (it has wheels for CPython 3.11 on x86-64 Linux only); "
    "the hypothesis fuzzers (tests/unit/test_fuzz.py) still run",
)


# ------------------------------------------------------------------------- atheris


def _run_atheris(target: str, workdir: pathlib.Path, *flags: str, timeout: float) -> dict[str, Any]:
    corpus = workdir / f"corpus-{target}"
    corpus.mkdir(exist_ok=True)
    stats = workdir / f"stats-{target}.json"
    env = dict(os.environ, RINGWIRE_FUZZ_STATS=str(stats))
    cmd = [
        sys.executable,
        str(FUZZ / "atheris_fuzz.py"),
        target,
        "-timeout=20",  # seconds for one input: a hang is a finding
        "-rss_limit_mb=4096",  # a lying length that allocates is a finding
        "-print_final_stats=1",
        *flags,
        str(corpus),
    ]
    proc = subprocess.run(
        cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout
    )
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        # atheris prints an uncaught exception's traceback on stdout, libFuzzer its
        # report on stderr: show both ends, not only libFuzzer's progress lines
        uncaught = proc.stdout.find("=== Uncaught Python exception")
        if uncaught >= 0:
            log = proc.stdout[uncaught:][:4000] + "\n...\n" + proc.stderr[-2000:]
        crashes = sorted(
            p.name for p in workdir.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-"))
        )
        pytest.fail(
            f"atheris found something in {target} (rc {proc.returncode}, {crashes}):\n{log[-6000:]}"
        )
    done = re.findall(r"stat::number_of_executed_units:\s*(\d+)", log)
    cov = re.findall(r"DONE\s+cov: (\d+) ft: (\d+)", log)
    result = json.loads(stats.read_text()) if stats.exists() else {}
    result["executed"] = int(done[-1]) if done else 0
    result["cov"], result["ft"] = (int(cov[-1][0]), int(cov[-1][1])) if cov else (0, 0)
    result["corpus"] = len(list(corpus.iterdir()))
    print(f"\natheris {target}: {json.dumps(result)}")
    return result


@needs_atheris
@pytest.mark.multiprocess
def test_atheris_every_target_ci(tmp_path: pathlib.Path) -> None:
    """One short coverage-guided run over every target (the first byte of an input
    picks the target): no undocumented exception, no hang, no broken invariant."""
    res = _run_atheris("all", tmp_path, "-max_total_time=15", "-runs=3000000", timeout=100)
    assert res["executed"] >= 2000, res
    per_target: dict[str, int] = {}
    for key, n in res.get("outcomes", {}).items():
        if ":" in key:
            name = key.split(":", 1)[0]
            per_target[name] = per_target.get(name, 0) + n
    assert set(NAMES) == set(per_target), per_target
    assert min(per_target.values()) >= 100, per_target
    assert res["cov"] > 300, res  # instrumented edges in ringwire reached


@needs_atheris
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(0)
@pytest.mark.parametrize("name", NAMES)
def test_atheris_long(name: str, tmp_path: pathlib.Path) -> None:
    seconds = int(os.environ.get("RINGWIRE_FUZZ_SECONDS", "120"))
    workdir = pathlib.Path(os.environ.get("RINGWIRE_FUZZ_DIR", str(tmp_path)))
    workdir.mkdir(parents=True, exist_ok=True)
    res = _run_atheris(name, workdir, f"-max_total_time={seconds}", timeout=seconds + 300)
    assert res["executed"] > 1000, res
