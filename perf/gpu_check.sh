#!/usr/bin/env bash
# The GPU checks of ringwire, on a bare GPU machine, in at most 8 minutes:
#   1. the CUDA IPC tests across processes (tests/process/test_cuda_gpu.py), and the
#      CUDA protocol tests through the simulated backend (tests/unit/test_cuda.py,
#      tests/process/test_cuda.py), which must pass on a GPU machine too;
#   2. the GPU handoff benchmark, --quick (1 MiB and 1 GiB; ringwire vs torch.multiprocessing).
# It ends with one summary line, "gpu_check: PASS ..." or "gpu_check: FAIL ...", and
# exits 0 only on PASS.  Without CUDA (no torch, a CPU-only torch, no device) it fails
# at once: there is nothing to check.
#
# Usage:
#   bash perf/gpu_check.sh [--wheels DIR] [--out DIR] [--no-bench]
#   bash perf/gpu_check.sh --fetch-wheels [DIR]          (where there is a package index)
#
# What it needs: a Python (PYTHON=..., default python3) with a CUDA build of torch --
# that one cannot be carried (GBs); everything else the tests import (pytest,
# pytest-timeout, msgspec, numpy, posix_ipc, anyio and their dependencies) it installs,
# only if missing, from wheels in DIR (default build/gpu-wheels), without the network,
# into build/gpu-site (not the interpreter's site-packages).  ringwire itself runs
# from this checkout (PYTHONPATH), not installed.
#
# Carrying the wheels to a machine without network:
#   1. here (same Python minor version and platform as the GPU machine, or set
#      GPU_PY_VERSION=3.11 to fetch for another one):  bash perf/gpu_check.sh --fetch-wheels
#      -> build/gpu-wheels/ (about 19 MiB, 17 of them numpy, rarely needed there);
#   2. copy build/gpu-wheels/ into the checkout on the GPU machine (build/ is
#      git-ignored; with the project's device runner: carry=["build/gpu-wheels"]);
#   3. there: bash perf/gpu_check.sh
# Outputs (logs, JUnit XML, benchmark JSON) go to --out DIR (default perf/results/gpu).
# GPU_CHECK_TESTS="path ..." runs other test files instead (debugging); the check still
# fails unless at least one test of tests/process/test_cuda_gpu.py passed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
WHEELS=build/gpu-wheels
OUTDIR=perf/results/gpu
BENCH=1
FETCH=0
NEEDED="pytest pytest-timeout msgspec numpy posix_ipc anyio"
BUDGET=${GPU_CHECK_BUDGET:-470}  # seconds for everything (the promise is 8 minutes)
START=$SECONDS

say() { printf 'gpu_check: %s\n' "$*"; }
fail() { say "FAIL $*"; exit 1; }
left() { echo $((BUDGET - (SECONDS - START))); }

while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS=${2:?--wheels needs a directory}; shift 2 ;;
        --out) OUTDIR=${2:?--out needs a directory}; shift 2 ;;
        --no-bench) BENCH=0; shift ;;
        --fetch-wheels) FETCH=1; if [ $# -gt 1 ] && [ "${2#-}" = "$2" ]; then WHEELS=$2; shift; fi; shift ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) fail "unknown argument $1 (see --help)" ;;
    esac
done

if [ "$FETCH" = 1 ]; then
    mkdir -p "$WHEELS" || fail "cannot create $WHEELS"
    extra=()
    if [ -n "${GPU_PY_VERSION:-}" ]; then
        extra=(--python-version "$GPU_PY_VERSION" --implementation cp
               --platform "${GPU_PLATFORM:-manylinux_2_28_x86_64}")
    fi
    # shellcheck disable=SC2086
    "$PY" -m pip download --only-binary=:all: -d "$WHEELS" "${extra[@]}" $NEEDED \
        || fail "pip download failed (no package index here? run it where there is one)"
    say "fetched $(ls "$WHEELS"/*.whl | wc -l) wheels ($(du -sh "$WHEELS" | cut -f1)) into $WHEELS: carry that folder to the GPU machine"
    exit 0
fi

mkdir -p "$OUTDIR" || fail "cannot create $OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)

# -- 1. CUDA, or nothing to do ------------------------------------------------------------
"$PY" -c 'import torch' 2>/dev/null || fail "no CUDA: $PY cannot import torch (install a CUDA build of torch first)"
info=$("$PY" - <<'PY' 2>&1
import torch
ok = torch.cuda.is_available()
name = torch.cuda.get_device_name(0) if ok else "-"
print(int(ok), torch.__version__, torch.version.cuda, torch.cuda.device_count() if ok else 0, name, sep="|")
PY
) || fail "no CUDA: torch failed to start: ${info##*$'\n'}"
IFS='|' read -r cuda_ok tv cv ndev gpu <<<"${info##*$'\n'}"
[ "$cuda_ok" = 1 ] || fail "no CUDA: torch.cuda.is_available() is False (torch $tv, built for CUDA $cv): a CPU-only torch, no driver, or no visible device (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset})"
say "torch $tv (CUDA $cv), $ndev device(s): $gpu"

# -- 2. what the tests import, from carried wheels ------------------------------------------
SITE=$REPO/build/gpu-site
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
missing=$("$PY" - <<'PY'
import importlib.util
mods = {"pytest": "pytest", "pytest_timeout": "pytest-timeout", "msgspec": "msgspec",
        "numpy": "numpy", "posix_ipc": "posix_ipc", "anyio": "anyio"}
print(" ".join(d for m, d in mods.items() if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
    [ -d "$WHEELS" ] || fail "missing $missing and no wheels in $WHEELS: fetch them with 'bash perf/gpu_check.sh --fetch-wheels' where there is a package index and carry $WHEELS here (see the top of this script)"
    say "installing $missing from $WHEELS into $SITE"
    # shellcheck disable=SC2086
    if ! "$PY" -m pip install -q --no-index --find-links "$WHEELS" --target "$SITE" $missing \
            >"$OUTDIR/install.txt" 2>&1; then
        # no pip here (or it refused): a wheel is a zip; unpacked, it imports
        "$PY" - "$WHEELS" "$SITE" <<'PY' >>"$OUTDIR/install.txt" 2>&1 || fail "cannot install $missing from $WHEELS (see $OUTDIR/install.txt)"
import pathlib, sys, zipfile
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
dst.mkdir(parents=True, exist_ok=True)
for whl in sorted(src.glob("*.whl")):
    zipfile.ZipFile(whl).extractall(dst)
    print("unpacked", whl.name)
PY
    fi
    again=$("$PY" -c 'import pytest, pytest_timeout, msgspec, numpy, posix_ipc, anyio' 2>&1) \
        || fail "still cannot import what the tests need after installing from $WHEELS: ${again##*$'\n'}"
fi

# -- 3. the tests ------------------------------------------------------------------------------
t0=$SECONDS
budget=$(( $(left) - (BENCH ? 150 : 10) ))
[ "$budget" -gt 60 ] || budget=60
TESTS=${GPU_CHECK_TESTS:-tests/process/test_cuda_gpu.py tests/unit/test_cuda.py tests/process/test_cuda.py}
# shellcheck disable=SC2086
timeout "$budget" "$PY" -m pytest -q -rs -p no:cacheprovider \
    --junitxml="$OUTDIR/gpu_tests.xml" $TESTS >"$OUTDIR/gpu_tests.txt" 2>&1
test_rc=$?
test_s=$((SECONDS - t0))
tail -n 25 "$OUTDIR/gpu_tests.txt"
counts=$("$PY" - "$OUTDIR/gpu_tests.xml" <<'PY' 2>/dev/null
import sys, xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
gpu = [c for c in cases if "test_cuda_gpu" in c.get("classname", "")]
def n(cs, tag): return sum(1 for c in cs if c.find(tag) is not None)
bad = n(cases, "failure") + n(cases, "error")
skip = n(cases, "skipped")
print(len(cases) - bad - skip, bad, skip, len(gpu) - n(gpu, "failure") - n(gpu, "error") - n(gpu, "skipped"))
PY
)
read -r passed failed skipped gpu_passed <<<"${counts:-0 0 0 0}"
status=PASS
why=""
if [ "$test_rc" = 124 ]; then status=FAIL; why=" (tests timed out after ${budget}s)"
elif [ "$test_rc" != 0 ]; then status=FAIL
elif [ "${gpu_passed:-0}" = 0 ]; then status=FAIL; why=" (no GPU test ran)"
fi

# -- 4. the benchmark, --quick -------------------------------------------------------------------
bench="skipped"
if [ "$BENCH" = 1 ]; then
    b0=$SECONDS
    bbudget=$(( $(left) - 5 ))
    if [ "$bbudget" -lt 30 ]; then
        bench="not run (no time left)"; status=FAIL
    elif timeout "$bbudget" "$PY" -m perf.cuda --quick --json "$OUTDIR/gpu_bench.json" \
            >"$OUTDIR/gpu_bench.txt" 2>&1; then
        cat "$OUTDIR/gpu_bench.txt"
        bench=$("$PY" - "$OUTDIR/gpu_bench.json" <<'PY' 2>/dev/null || echo "ran (no summary)"
import json, sys
cases = json.load(open(sys.argv[1]))["cases"]
def pick(t, b):
    c = next(c for c in cases if c["transport"] == t and c["bytes"] == b)
    return f"{c['median_us']:.0f} us ({c.get('vs_torch_mp', 1):.2f}x torch.mp)"
print(f"1 MiB copy {pick('ringwire copy', 1 << 20)}, 1 GiB loan {pick('ringwire loan', 1 << 30)}")
PY
)
        bench="$bench in $((SECONDS - b0))s"
    else
        tail -n 20 "$OUTDIR/gpu_bench.txt"
        bench="FAILED (see $OUTDIR/gpu_bench.txt)"; status=FAIL
    fi
fi

# -- 5. leftovers, and the one line ------------------------------------------------------------
ls /dev/shm >"$OUTDIR/dev_shm_after.txt" 2>/dev/null
left_shm=$(grep -cE '^(rw\.|torch_)' "$OUTDIR/dev_shm_after.txt" 2>/dev/null || true)
shm="clean"
if [ "${left_shm:-0}" != 0 ]; then shm="$left_shm ringwire/torch name(s) left"; status=FAIL; fi
say "$status $gpu x$ndev, torch $tv; tests: $passed passed, $failed failed, $skipped skipped in ${test_s}s$why; bench: $bench; /dev/shm: $shm; $((SECONDS - START))s; logs: $OUTDIR"
[ "$status" = PASS ]
