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
