"""Suite-wide guards: every test must leave /dev/shm, socket files and child
processes exactly as it found them.

The check is autouse, so a test that leaks fails even if its own asserts pass.
Leaked child processes are killed (so one leak does not cascade) and reported.

Two suites may run side by side on one machine (a developer's run next to a benchmark
or a second checkout).  So that they do not blame each other: each session gets its
own ``TMPDIR`` (inherited by every child), and a ``/dev/shm`` name whose creator pid is
alive but outside this session's process tree is somebody else's and is ignored.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
from support.procs import children

from ringwire._wire.names import is_segment_name, name_pid

SHM_DIR = Path("/dev/shm")

# A private temporary directory for this session and every process it starts.
_SESSION_TMP = tempfile.mkdtemp(prefix="rwtest-")
os.environ["TMPDIR"] = _SESSION_TMP
tempfile.tempdir = None  # forget the cached default so gettempdir() reads TMPDIR again


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    return int(data[data.rfind(b")") + 2 :].split()[1])


def _in_our_tree(pid: int) -> bool:
    me = os.getpid()
    for _ in range(64):
        if pid == me:
            return True
        if pid <= 1:
            return False
        pid = _parent(pid)
    return False


def _foreign(name: str) -> bool:
    """Was ``name`` made by a live process outside this session's process tree?"""
    if not is_segment_name("/" + name):
        return False
    pid = name_pid("/" + name)
    return not _in_our_tree(pid) and os.path.exists(f"/proc/{pid}")


def _held_elsewhere(names: set[str]) -> set[str]:
    """Of these other (non-ringwire) ``/dev/shm`` names -- multiprocessing semaphores,
    another tool's segments -- those that a live process outside this session maps or
    holds open: another suite's, not ours.  Matched by inode (glibc maps a semaphore
    under a temporary name).  Only run when something looks leaked."""
    wanted: dict[int, str] = {}
    for n in names:
        with contextlib.suppress(OSError):
            st = os.stat(SHM_DIR / n)
            wanted[st.st_ino] = n
    shm_dev = os.stat(SHM_DIR).st_dev
    found: set[str] = set()
    for entry in os.listdir("/proc"):
        if not wanted or not entry.isdigit() or _in_our_tree(int(entry)):
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                        name = wanted.get(int(fields[4]))
                        if name is not None:
                            found.add(name)
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    st = os.stat(f"/proc/{entry}/fd/{fd}")
                    if st.st_dev == shm_dev and st.st_ino in wanted:
                        found.add(wanted[st.st_ino])
        except OSError:
            continue
    return found


def _shm_names() -> set[str]:
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:  # pragma: no cover - non-Linux
        return set()
    return {n for n in names if not _foreign(n)}


def _socket_files(roots: list[Path]) -> set[str]:
    found: set[str] = set()
    for root in roots:
        try:
            entries = list(os.scandir(root))
        except OSError:
            continue
        for entry in entries:
            try:
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    found.add(entry.path)
                elif (
                    entry.is_dir(follow_symlinks=False)
                    and root == Path(tempfile.gettempdir())
                    and entry.name.startswith("ringwire")
                ):
                    found |= _socket_files([Path(entry.path)])
            except OSError:
                continue
    return found


def _memory_files() -> set[str]:
    """This process's descriptors of ringwire memory files (``fd -> /memfd:rw.…``):
    a segment, arena or mapping a test left open.  (Python's ``mmap`` keeps a
    descriptor of what it maps, so a live view counts too.)"""
    held: set[str] = set()
    # a process's TCP status tables (ringwire._net.status) live as long as it does
    status = sys.modules.get("ringwire._net.status")
    tables = {f"/{t.seg.name}" for t in getattr(status, "_tables", ())}
    try:
        entries = os.listdir("/proc/self/fd")
    except OSError:
        return held
    for fd in entries:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:rw.") and not target.startswith("/memfd:rw.probe"):
            if target.removesuffix(" (deleted)") not in tables:
                held.add(f"{fd} -> {target}")
    return held


def _test_netns() -> set[str]:
    """Network namespaces made by this process's tests/process/test_net_hosts.py
    (``rwtest-<pid>-``; another run's, on a shared machine, are not ours to judge)."""
    mine = f"rwtest-{os.getpid()}-"
    try:
        return {n for n in os.listdir("/run/netns") if n.startswith(mine)}
    except OSError:
        return set()


def _reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _wait_until(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


@pytest.fixture(scope="session", autouse=True)
def _resource_tracker_running() -> Iterator[None]:
    """'spawn' starts multiprocessing's resource tracker (a long-lived child) on first
    use; start it before the per-test child-process accounting begins."""
    resource_tracker.ensure_running()
    yield
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    roots = [Path(tempfile.gettempdir())]
    if "tmp_path" in request.fixturenames:
        roots.append(request.getfixturevalue("tmp_path"))
    shm_before = _shm_names()
    memfds_before = _memory_files()
    socks_before = _socket_files(roots)
    kids_before = children()
    netns_before = _test_netns()
    yield
    me = os.getpid()
    # Survivors are given a moment to notice a dead peer and clean up.
    _wait_until(lambda: not (children(me) - kids_before), 5.0)
    leaked_kids = children(me) - kids_before
    for pid in leaked_kids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap_zombies()
    _wait_until(lambda: not (_shm_names() - shm_before), 2.0)
    leaked_shm = _shm_names() - shm_before
    others = {n for n in leaked_shm if not is_segment_name("/" + n)}
    if others:
        leaked_shm -= _held_elsewhere(others)
    leaked_socks = _socket_files(roots) - socks_before
    problems = []
    if _memory_files() - memfds_before:
        gc.collect()  # views of a finished test die with its frames
        _wait_until(lambda: not (_memory_files() - memfds_before), 2.0)
        leaked_memfds = _memory_files() - memfds_before
        if leaked_memfds:
            problems.append(f"memory files left open in this process: {sorted(leaked_memfds)}")
    if leaked_shm:
        problems.append(f"/dev/shm names left behind: {sorted(leaked_shm)}")
        for name in leaked_shm:  # do not let one leak fail every later test
            try:
                (SHM_DIR / name).unlink()
            except OSError:
                pass
    if leaked_socks:
        problems.append(f"socket files left behind: {sorted(leaked_socks)}")
    if leaked_kids:
        problems.append(f"child processes left running (killed now): {sorted(leaked_kids)}")
    leaked_netns = _test_netns() - netns_before
    if leaked_netns:
        problems.append(f"network namespaces left behind: {sorted(leaked_netns)}")
    if problems:
        pytest.fail("resource leak: " + "; ".join(problems), pytrace=False)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="also run the long modes (tests marked 'slow': soak, chaos, load, fuzz)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long") or os.environ.get("RINGWIRE_LONG") == "1":
        return
    skip = pytest.mark.skip(reason="long mode: run with --long (or RINGWIRE_LONG=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
