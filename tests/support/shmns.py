"""A private mount namespace with a small tmpfs over /dev/shm (a default container's
64 MiB, or less): what the tests that imitate one need to know before they try."""

from __future__ import annotations

import shutil
import subprocess
import sys


def private_tmpfs_refused() -> str | None:
    """Why a private tmpfs cannot be mounted over /dev/shm here (a skip reason), or
    ``None`` if it can (``unshare -m`` as root)."""
    if not sys.platform.startswith("linux") or not shutil.which("unshare"):
        return "needs Linux and unshare(1)"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"cannot mount a private tmpfs over /dev/shm here: {probe.stderr.strip()}"
    return None


def run_with_private_shm(
    argv: list[str],
    *,
    size: str = "64m",
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a private mount namespace whose ``/dev/shm`` is a fresh tmpfs of
    ``size`` (a default container's 64 MiB); its output is captured.  Call
    :func:`private_tmpfs_refused` first (and skip with its reason)."""
    mount = f"mount -t tmpfs -o size={size},mode=1777 tmpfs /dev/shm"
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", f'{mount} && exec "$0" "$@"', *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )
