"""`python -m ringwire.demo` end to end, in subprocesses: a short run, --kill, Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[2]  # the repository: two up from tests/<folder>/


def demo(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "ringwire.demo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
        env=env,
    )


def answered(out: str) -> int:
    m = re.search(r"requests answered\s+([\d,]+)", out)
    assert m, out
    return int(m.group(1).replace(",", ""))


def test_demo_short_run_is_clean() -> None:
    proc = demo("--duration", "3", "--no-live")
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, out + err
    assert answered(out) > 0
    assert "wrong answers 0" in out and "failed 0" in out
    assert "slots in use at the end: 0 lent, 0 held" in out
    assert "(0 of this run left behind" in out and "worker processes alive: 0" in out
    assert "no leaks" in out
    assert re.search(r"p50 [\d.]+ ms\s+p99 [\d.]+ ms", out)
    assert "by slot reference" in out


def test_demo_kill_shows_detection_reclaim_and_restart() -> None:
    proc = demo("--duration", "4", "--no-live", "--kill")
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, out + err
    assert re.search(r"kill -9 worker-0 \(pid \d+\)", out)
    assert re.search(r"worker 'worker-0' \(pid \d+\) died: killed by SIGKILL", out)
    assert re.search(r"detected [\d.]+ ms after the kill", out)
    assert "slots in use on its connection now: 0" in out
    assert re.search(r"worker-0 restarted: pid \d+, ready in", out)
    assert "worker-0            restarts 1" in out
    assert "wrong answers 0" in out and "no leaks" in out


def test_demo_ctrl_c_stops_cleanly() -> None:
    proc = demo("--duration", "60", "--no-live")
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while "answered=" not in proc.stdout.readline():  # the first once-a-second line
        assert time.monotonic() < deadline and proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert "stopping: SIGINT received" in out
    assert "no leaks" in out and "wrong answers 0" in out
