"""Access across uids: a process of another uid can neither connect nor attach.

The file modes stop it first (EACCES), and behind them the listener checks the peer's
uid (SO_PEERCRED) and ``Segment.attach`` the segment's owner and mode.  Shown with a
real process of uid 65534 (nobody); needs root, skipped otherwise.  The modes, names
and the absence of pickle are in tests/unit/test_access.py.
"""

from __future__ import annotations

import errno
import json
import os
import select
import shutil
import signal
import socket
import tempfile
import warnings
from typing import Any

import anyio
import posix_ipc
import pytest
from support.access import NOBODY, mode_of, root_only

from ringwire._conn.connect import connect, connect_sync
from ringwire._conn.listener import listen
from ringwire._errors import SegmentError
from ringwire._pool.segment import SHM_DIR, Segment

pytestmark = pytest.mark.multiprocess  # every test here starts a process

# ------------------------------------------------------------- a process of another uid


def _child_checks(path: str, name: str, size: int) -> dict[str, Any]:
    """What a process of uid nobody gets (runs in the forked child)."""
    out: dict[str, Any] = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups()}

    def err(exc: BaseException) -> str:
        code = getattr(exc, "errno", None)
        return (
            type(exc).__name__
            + (f" {errno.errorcode.get(code, code)}" if code else "")
            + f": {exc}"
        )

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        s.settimeout(5)
        out["raw_connect"] = "connected; then " + repr(s.recv(100))
    except OSError as exc:
        out["raw_connect"] = err(exc)
    finally:
        s.close()
    try:
        connect_sync(path, handshake_timeout=5, slots=None).close()
        out["connect"] = "connected"
    except Exception as exc:
        out["connect"] = err(exc)
    try:
        posix_ipc.SharedMemory(name).close_fd()
        out["shm_open"] = "opened"
    except Exception as exc:
        out["shm_open"] = err(exc)
    try:
        Segment.attach(name, size).close()
        out["attach"] = "attached"
    except SegmentError as exc:
        out["attach"] = err(exc)
    try:
        os.close(os.open(SHM_DIR + name, os.O_RDWR))
        out["open_rw"] = "opened"
    except OSError as exc:
        out["open_rw"] = err(exc)
    return out


def _as_nobody(path: str, seg: Segment) -> dict[str, Any]:
    """Fork; the child drops to uid/gid 65534 with no groups, tries, reports on a pipe.

    (A fork, not a new interpreter: this one may live where nobody cannot read it.)"""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = _child_checks(path, seg.name, seg.size)
        except BaseException as exc:
            result = {"error": repr(exc)}
        try:
            os.write(w, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([r], [], [], 30)
            if not ready:
                os.kill(pid, signal.SIGKILL)
                break
            data = os.read(r, 65536)
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    result = json.loads(b"".join(chunks) or b"{}")
    assert "error" not in result and result, result
    return result


@root_only
@pytest.mark.multiprocess
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_another_uid_can_neither_connect_nor_attach(caplog: pytest.LogCaptureFixture) -> None:
    """uid 65534 against a live listener and a live segment of ours.  With the modes
    as ringwire sets them, the kernel refuses (EACCES); with the modes opened up by
    hand, ringwire itself still refuses: the listener drops the socket at once (its peer
    uid is not ours), and Segment.attach refuses a segment owned by someone else."""
    # a directory nobody can traverse (pytest's and the session's are 0700), so that
    # the socket's own mode is what is tested
    d = tempfile.mkdtemp(prefix="rw-access-", dir="/tmp")
    os.chmod(d, 0o711)
    path = os.path.join(d, "l.sock")
    seg = Segment.create(8192, kind="named")  # (a memory file has no name to open)
    try:
        async with listen(path, spin_us=0) as lst:
            assert mode_of(path) == 0o600 and mode_of(SHM_DIR + seg.name) == 0o600
            strict = await anyio.to_thread.run_sync(_as_nobody, path, seg)
            assert strict["uid"] == NOBODY and strict["groups"] == []
            assert "EACCES" in strict["raw_connect"], strict
            assert "EACCES" in strict["connect"], strict
            assert strict["shm_open"].startswith("PermissionsError"), strict
            assert "no permission" in strict["attach"], strict
            assert "EACCES" in strict["open_rw"], strict
            assert lst.statistics().refused == 0  # the kernel stopped it first
            # open the modes up by hand: the second line of defence
            os.chmod(path, 0o666)
            os.chmod(SHM_DIR + seg.name, 0o666)
            caplog.set_level("WARNING", logger="ringwire")
            loose = await anyio.to_thread.run_sync(_as_nobody, path, seg)
            assert loose["raw_connect"] == "connected; then b''", loose  # closed at once
            # the client checks the listener too: a root listener is not its uid
            assert "PeerCredentialsError" in loose["connect"], loose
            assert loose["shm_open"] == "opened" and loose["open_rw"] == "opened"  # the OS allows
            assert f"belongs to uid {os.geteuid()}" in loose["attach"], loose  # ringwire does not
            with anyio.fail_after(5):
                while lst.statistics().refused < 2:
                    await anyio.sleep(0.01)
            assert lst.statistics().accepted == 0
            why = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
            assert len(why) == 2 and all(f"uid {NOBODY}" in w for w in why), why
            # and our own uid is still welcome
            async with await connect(path, slots=None) as c:
                conn = await lst.accept()
                await c.send("me")
                assert (await lst.receive())[1] == "me" and conn.peer_pid == os.getpid()
    finally:
        seg.unlink()
        seg.close()
        shutil.rmtree(d, ignore_errors=True)
