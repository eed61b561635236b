"""``python -m ringwire inspect | cleanup``, the command in subprocesses: a live
connection with a spawned peer, the cleanup of a dead creator's names, usage errors."""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import subprocess
import sys
from typing import Any

import numpy as np
import posix_ipc
import pytest
from support.shmns import private_tmpfs_refused

import ringwire
from ringwire import _cli
from ringwire._pool.segment import (
    SHM_DIR,
    Segment,
    memfd_supported,
    segment_kind,
    stale_segments,
    unlink_segment,
)
from ringwire._wire.ring import frame_size

pytestmark = pytest.mark.multiprocess  # every test here starts a process

SPAWN = mp.get_context("spawn")
KiB = 1 << 10
CFG = ringwire.SlotConfig(classes=(ringwire.SlotClass(64 * KiB, 4),), threshold=1024)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ringwire", *args], capture_output=True, text=True, timeout=60
    )


def cli_env(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """:func:`cli` with ``env`` added to the environment."""
    return subprocess.run(
        [sys.executable, "-m", "ringwire", *args], capture_output=True, text=True, timeout=60,
        env=dict(os.environ, **env),
    )  # fmt: skip


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# -- inspect: a live connection ----------------------------------------------------------


def child_holds(end: ringwire.PairEnd, stop: Any) -> None:
    with end.connect_sync(slots=CFG) as ch:
        ch.send({"x": np.arange(4096, dtype=np.float32)}, timeout=10)  # into a slot
        stop.poll(30)  # reads nothing: what the parent sends stays in the ring


@pytest.mark.multiprocess
def test_inspect_shows_a_live_connection() -> None:
    me = os.getpid()
    a, b = ringwire.pair()
    # a pipe, not an Event: Events are named semaphores in /dev/shm
    stop_r, stop_w = SPAWN.Pipe(duplex=False)
    p = SPAWN.Process(target=child_holds, args=(b, stop_r), daemon=True)
    p.start()
    stop_r.close()
    assert p.pid is not None
    try:
        with a.connect_sync(slots=CFG) as ch:
            records = [{"n": i, "pad": "x" * 100} for i in range(5)]
            for r in records:
                ch.send(r, timeout=10)
            held = ch.receive(timeout=10)["x"]  # a view of the child's slot
            loaned = ch.loan((1000,), np.float64)  # one of our slots, being filled
            fill = ch.statistics().send_fill
            assert fill == 5 * frame_size(len(ringwire.encode(records[0])))

            out = cli("inspect", "--json", "--pid", str(p.pid))
            assert out.returncode == 0, out.stderr
            report = json.loads(out.stdout)
            [conn] = [c for c in report["connections"] if c["pids"] == sorted([me, p.pid])]
            assert conn["creator_pid"] == me and conn["creator_alive"] and conn["unlinked"]
            there, back = conn["lanes"]
            assert (there["writer_pid"], there["reader_pid"]) == (me, p.pid)
            assert there["fill"] == fill and there["capacity"] == ringwire.DEFAULT_CAPACITY
            assert (back["writer_pid"], back["reader_pid"], back["fill"]) == (p.pid, me, 0)
            pools = {pool["owner_pid"]: pool for pool in report["pools"]}
            theirs, ours = pools[p.pid], pools[me]
            assert (theirs["sent"], theirs["loaned"], theirs["in_use"]) == (1, 0, 1)
            assert theirs["bytes_in_use"] == 64 * KiB and theirs["peer_pids"] == [me]
            assert (ours["sent"], ours["loaned"], ours["free"]) == (0, 1, 3)
            assert theirs["slots"] == ours["slots"] == 4
            procs = {q["pid"]: q for q in report["processes"]}
            assert procs[me]["alive"] and procs[p.pid]["alive"]
            assert not [n for n in report["names"] if n["creator_pid"] in (me, p.pid)]

            text = cli("inspect", "--pid", str(me))
            assert text.returncode == 0, text.stderr
            assert conn["segment"] in text.stdout
            assert f"{me} -> {p.pid}" in text.stdout and f"{p.pid} -> {me}" in text.stdout
            assert f"{_cli._size(fill)} / 1 MiB" in text.stdout
            assert "1/4" in text.stdout  # slots in use, both pools

            del held, loaned
            stop_w.send(b"stop")
        p.join(30)
        assert p.exitcode == 0
        gc.collect()  # (a closed endpoint's mapping goes with the last view of it)
        after = json.loads(cli("inspect", "--json", "--pid", str(me)).stdout)
        assert after["connections"] == [] and after["pools"] == [], after
    finally:
        stop_w.close()
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


# -- inspect: a TCP connection ----------------------------------------------------------


def child_tcp(url: str, stop: Any) -> None:
    with ringwire.connect_sync(url, slots=CFG, heartbeat=2.0) as ch:
        ch.send({"hello": 1}, timeout=10)
        stop.poll(30)  # reads nothing: what the parent sends stays unread here


@pytest.mark.multiprocess
def test_inspect_lists_a_live_tcp_connection_and_forgets_it_when_closed() -> None:
    pytest.importorskip("zmq")
    me = os.getpid()
    listener = ringwire.SyncListener("tcp://127.0.0.1:0", slots=CFG)
    stop_r, stop_w = SPAWN.Pipe(duplex=False)
    with listener:
        p = SPAWN.Process(target=child_tcp, args=(listener.path, stop_r), daemon=True)
        p.start()
        stop_r.close()
        try:
            ch = listener.accept(timeout=30)
            assert ch.receive(timeout=10) == {"hello": 1}
            for i in range(3):
                ch.send({"n": i}, timeout=10)
            out = cli("inspect", "--json", "--pid", str(p.pid))
            assert out.returncode == 0, out.stderr
            report = json.loads(out.stdout)
            [theirs] = [t for t in report["tcp_connections"] if t["pid"] == p.pid]
            assert theirs["side"] == "client" and theirs["state"] == "live"
            assert theirs["address"] == listener.path and theirs["peer_pid"] == me
            assert theirs["peer"].startswith("127.0.0.1:")
            # the child never receives: our records wait in libzmq's queue there, which
            # the table does not see (it counts what a receive took in); our side shows them
            assert theirs["inbox_records"] == 0 and theirs["in_flight_bytes"] > 0
            assert theirs["heartbeat_s"] == 2.0 and theirs["heard_s_ago"] < 10
            mine = cli("inspect", "--json", "--pid", str(me))
            [ours] = [t for t in json.loads(mine.stdout)["tcp_connections"] if t["pid"] == me]
            assert ours["side"] == "server" and ours["peer_pid"] == p.pid
            assert ours["peer"] == theirs["local"] and ours["local"] == theirs["peer"]
            assert ours["in_flight_bytes"] > 0  # not credited: the child reads nothing
            text = cli("inspect", "--pid", str(p.pid))
            assert "TCP connections:" in text.stdout and theirs["peer"] in text.stdout
            stop_w.send(b"stop")
            p.join(30)
            assert p.exitcode == 0
            ch.close()
            after = json.loads(cli("inspect", "--json", "--pid", str(me)).stdout)
            assert [t for t in after["tcp_connections"] if t["pid"] == me] == [], after
        finally:
            stop_w.close()
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


# -- cleanup -----------------------------------------------------------------------------


class Vanished(Exception):
    """Somebody else swept our fabricated stale name (another suite on this host)."""


def test_cleanup_removes_only_dead_creators_names() -> None:
    # A stale name is stale for everybody: a concurrent sweep elsewhere on the host may
    # remove it first.  That is retried, never counted as a pass.
    for _ in range(5):
        try:
            check_cleanup()
            return
        except Vanished:
            continue
    pytest.fail("the fabricated stale name was swept by somebody else five times")


def check_cleanup() -> None:
    dead = dead_pid()
    stale = f"/rw.{dead}.{os.urandom(6).hex()}"
    posix_ipc.SharedMemory(stale, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
    live = Segment.create(4096, kind="named")  # ours, named, mapped: a live process's name
    memfd = Segment.create(4096) if memfd_supported() else None  # no name: nothing to clean

    def still_there() -> None:
        if not os.path.exists(SHM_DIR + stale):
            raise Vanished

    try:
        listed = stale_segments()  # what sweep would remove; removes nothing
        still_there()
        assert stale in listed and live.name not in listed
        report = json.loads(cli("inspect", "--json").stdout)
        names = {n["name"]: n for n in report["names"]}
        if stale[1:] not in names:
            raise Vanished
        s, lv = names[stale[1:]], names[live.name[1:]]
        assert (s["creator_pid"], s["creator_alive"], s["stale"]) == (dead, False, True)
        assert s["mapped_by"] == [] and s["size"] == 4096
        assert (lv["creator_pid"], lv["creator_alive"], lv["stale"]) == (os.getpid(), True, False)
        assert lv["mapped_by"] == [os.getpid()]
        if memfd is not None:  # listed as a segment, never as a name
            [m] = [g for g in report["segments"] if g["segment"] == memfd.name]
            assert m["segment_kind"] == "memfd" and m["size"] == 4096
            assert memfd.name not in names and memfd.name[len("memfd:") :] not in names

        dry = cli("cleanup", "--dry-run")
        still_there()
        assert dry.returncode == 1, dry.stderr  # stale names exist
        assert f"would remove {stale[1:]} (creator pid {dead} is dead, 4 KiB)" in dry.stdout
        assert live.name[1:] not in dry.stdout
        assert os.path.exists(SHM_DIR + live.name)
        dry_json = json.loads(cli("cleanup", "--dry-run", "--json").stdout)
        still_there()
        assert stale[1:] in dry_json["stale"] and dry_json["removed"] == []

        done = cli("cleanup")
        if f"removed {stale[1:]}" not in done.stdout and not os.path.exists(SHM_DIR + stale):
            raise Vanished
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"removed {stale[1:]}" in done.stdout and live.name[1:] not in done.stdout
        assert "memory files (the default segments, memfd) need no cleanup" in done.stdout
        if memfd is not None:
            assert memfd.name not in done.stdout
        assert not os.path.exists(SHM_DIR + stale)
        assert os.path.exists(SHM_DIR + live.name)

        again = json.loads(cli("cleanup", "--dry-run", "--json").stdout)
        assert stale[1:] not in again["stale"] and live.name[1:] not in again["stale"]
        assert "the kernel frees each one" in again["memory_files"]
    finally:
        unlink_segment(stale)
        live.unlink()
        live.close()
        if memfd is not None:
            memfd.close()


def test_cleanup_with_nothing_in_dev_shm_says_so_and_that_memory_files_need_none() -> None:
    """In a private /dev/shm (nothing of anybody's there) cleanup finds nothing, says so,
    and says why memory files never need it; exit status 0."""
    why = private_tmpfs_refused()
    if why:
        pytest.skip(why)
    r = subprocess.run(
        [
            "unshare", "-m", "sh", "-c",
            "mount -t tmpfs -o size=1m,mode=1777 tmpfs /dev/shm && "
            f'exec "{sys.executable}" -m ringwire cleanup',
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        f"nothing to clean up in {SHM_DIR}",
        "memory files (the default segments, memfd) need no cleanup: the kernel frees each "
        "one when the last process holding or mapping it exits",
    ]


def test_usage_errors_exit_2() -> None:
    assert cli().returncode == 2
    assert cli("frobnicate").returncode == 2
    assert "inspect" in cli("--help").stdout


# -- doctor ---------------------------------------------------------------------------------


def test_doctor_json_reports_every_check() -> None:
    from ringwire import _doctor

    r = cli("doctor", "--json")
    data = json.loads(r.stdout)
    assert set(data) == {"about", "needs", "exit_status", "unmet", "checks"}
    assert r.returncode == data["exit_status"], r.stdout + r.stderr
    assert data["about"]["ringwire"] == ringwire.__version__
    assert list(data["checks"]) == list(_doctor.CHECKS)
    for check in data["checks"].values():
        assert set(check) == {"status", "detail", "fix", "facts"}
        assert check["status"] in ("ok", "warn", "fail", "absent")
    kind = segment_kind()  # what this process, and so the doctor's, creates
    segments = data["checks"]["segments"]
    assert segments["status"] == "ok" and segments["facts"]["kind"] == kind
    assert segments["facts"]["memfd_available"] is memfd_supported()
    assert data["checks"]["native"]["facts"]["native"] == ringwire.native
    shm = os.statvfs(SHM_DIR)
    assert data["checks"]["shm"]["facts"]["size"] == shm.f_frsize * shm.f_blocks
    assert data["checks"]["shm"]["facts"]["used"] is (kind == "named")
    if data["checks"]["shm"]["facts"]["fits"] > 0 or kind == "memfd":
        assert data["checks"]["shm"]["status"] != "fail"
    if data["checks"]["memory_limit"]["status"] != "fail" and (
        data["checks"]["shm"]["status"] != "fail"
    ):
        assert r.returncode == 0  # nothing breaks the defaults here
    named = json.loads(cli_env({"RINGWIRE_SEGMENTS": "named"}, "doctor", "--json").stdout)
    assert named["checks"]["segments"]["facts"]["kind"] == "named"
    assert "as RINGWIRE_SEGMENTS=named asks" in named["checks"]["segments"]["detail"]
    assert named["checks"]["shm"]["facts"]["used"] is True
    bad = cli_env({"RINGWIRE_SEGMENTS": "ramdisk"}, "doctor", "--json")
    assert bad.returncode == 1 and json.loads(bad.stdout)["unmet"][0] == "segments"
    asked = cli("doctor", "--json", "--need", "curve,native")
    assert json.loads(asked.stdout)["needs"] == ["curve", "native"]
    assert cli("doctor", "--need", "warp-drive").returncode == 2


@pytest.mark.parametrize("kind", ["memfd", "named"])
def test_doctor_in_a_64_mib_dev_shm(kind: str) -> None:
    """The issue's container case, for real: a private mount namespace whose /dev/shm is
    a 64 MiB tmpfs (Docker's default).  With named segments a default connection does
    not fit (exit status 1); memory files do not use /dev/shm: the doctor passes, and
    reports /dev/shm's numbers as information."""
    if kind == "memfd" and not memfd_supported():
        pytest.skip("no sealed memory files here")
    why = private_tmpfs_refused()
    if why:
        pytest.skip(why)

    def doctor(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                "unshare", "-m", "sh", "-c",
                "mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && "
                f'exec "{sys.executable}" -m ringwire doctor {" ".join(args)}',
            ],
            capture_output=True, text=True, timeout=120,
            env=dict(os.environ, RINGWIRE_SEGMENTS=kind),
        )  # fmt: skip

    text = doctor()
    words = " ".join(text.stdout.split())  # the screen wraps long lines
    data = json.loads(doctor("--json").stdout)
    shm = data["checks"]["shm"]
    assert shm["facts"]["size"] == 64 << 20 and shm["facts"]["fits"] == 0
    if kind == "named":
        assert text.returncode == 1, text.stdout + text.stderr
        assert "/dev/shm cannot hold one default connection" in words
        assert "docker run --shm-size=1g" in words
        assert "result: not usable as asked: /dev/shm (exit status 1)" in text.stdout
        assert data["exit_status"] == 1 and data["unmet"][0] == "shm"
        assert shm["status"] == "fail" and shm["facts"]["used"] is True
        assert "--ipc=host" in shm["fix"]
        return
    limit = data["checks"]["memory_limit"]
    if limit["status"] == "fail":  # (a memory cgroup smaller than one connection)
        pytest.skip(f"this host's memory limit fails the defaults: {limit['detail']}")
    assert text.returncode == 0, text.stdout + text.stderr
    assert "not used: memory files; 64 MiB, 64 MiB free" in words
    assert "result: the defaults work here (exit status 0)" in text.stdout
    assert data["exit_status"] == 0 and data["unmet"] == []
    assert shm["status"] == "ok" and shm["facts"]["used"] is False
    assert data["checks"]["segments"]["facts"]["kind"] == "memfd"
