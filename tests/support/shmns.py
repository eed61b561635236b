"""A private mount namespace with a small tmpfs over /dev/shm (a default container's
64 MiB, or less): what the tests that imitate one need to know before they try."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time


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


# -- where shared memory goes: a memory cgroup of our own ------------------------------

_V1_MEMORY = "/sys/fs/cgroup/memory"


def _own_memory_cgroup() -> str | None:
    """This process's cgroup-v1 memory cgroup directory, if it can be written to."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            d = _V1_MEMORY + path
            return d if os.access(d, os.W_OK) and os.path.exists(d + "/memory.stat") else None
    return None


class ShmemCgroup:
    """A memory cgroup nested in this process's own (so under its limits), to count the
    shared memory (memory files, tmpfs) that the processes put into it fault in:
    exactly, whatever other processes on the machine do; the charge stays with the
    cgroup until the kernel frees the pages, so it shows what dead processes left.

    ``ShmemCgroup.make()`` is ``None`` where there is no writable cgroup-v1 memory
    controller.  :attr:`procs` is the file a process writes its pid to to join (its
    children follow); :meth:`shmem` reads the count; :meth:`remove` removes it (every
    process in it must have exited)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.procs = path + "/cgroup.procs"

    @classmethod
    def make(cls) -> ShmemCgroup | None:
        parent = _own_memory_cgroup()
        if parent is None:
            return None
        path = f"{parent}/ringwire-test-{os.getpid()}-{os.urandom(3).hex()}"
        try:
            os.mkdir(path)
        except OSError:
            return None
        return cls(path)

    def shmem(self) -> int:
        return read_shmem(self.path + "/memory.stat")

    def remove(self) -> None:
        deadline = time.monotonic() + 5
        while True:
            try:
                os.rmdir(self.path)
                return
            except OSError:  # EBUSY while a process of it is still being reaped
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)


def read_shmem(stat_file: str) -> int:
    """Bytes of shared memory in a cgroup's ``memory.stat`` (its own ``shmem`` line)."""
    with open(stat_file) as f:
        for line in f:
            key, value = line.split()
            if key == "shmem":
                return int(value)
    raise LookupError(f"no shmem line in {stat_file}")


def meminfo_shmem() -> int:
    """``Shmem:`` of /proc/meminfo, in bytes: the whole machine's shared memory."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise LookupError("no Shmem: line in /proc/meminfo")
