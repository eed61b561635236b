#!/usr/bin/env bash
# The GPU checks of ringwire in one go (a few minutes on one GPU):
#   1. the CUDA IPC tests across processes (tests/process/test_cuda_gpu.py) and the CPU-side
#      protocol tests (tests/unit/test_cuda.py, tests/process/test_cuda.py), which also run in CI;
#   2. the GPU handoff benchmark (1 MiB and 1 GiB, ringwire vs torch.multiprocessing).
# Needs a Python with CUDA torch, msgspec, numpy, posix_ipc, anyio and pytest; with
# INSTALL=1 it installs the project first (pip install -e '.[test]').
# Usage: bash perf/gpu_check.sh [OUTDIR]      (OUTDIR defaults to perf/results)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-perf/results}}"
mkdir -p "$out"
if [ "${INSTALL:-0}" = 1 ]; then
    python -m pip install -q -e '.[test]' || exit 1
fi
python - <<'PY' || exit 1
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "(no CUDA)")
PY
status=0
timeout 600 python -m pytest -v -p no:cacheprovider tests/process/test_cuda_gpu.py tests/unit/test_cuda.py tests/process/test_cuda.py \
    2>&1 | tee "$out/gpu_tests.txt" || status=1
timeout 600 python -m perf.cuda --json "$out/gpu_bench.json" 2>&1 | tee "$out/gpu_bench.txt" \
    || status=1
ls /dev/shm | tee "$out/dev_shm_after.txt"
exit $status
