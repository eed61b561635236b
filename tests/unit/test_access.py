"""Access: who may connect and attach, what names give away, and no pickle anywhere.

* Every segment ringwire creates (rings, slot pools) and every listener socket is
  mode 0600, whatever the umask.
* Segment names carry 48 bits from ``secrets`` and pool ids 64: not guessable.
  ringwire makes no socket path of its own (``pair()`` is a socketpair; a listener's
  path is the caller's).
* No pickle: not imported by ringwire, runtime, examples or the fuzz harness, and not
  called at run time while records, arrays and tensors cross a connection.

A real process of another uid is in tests/process/test_access.py.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import os
import pathlib
import pickle
import re
import socket
import stat
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import posix_ipc
import pytest
from support.access import NOBODY, mode_of, root_only
from support.extras import needs_torch, torch

import ringwire
from ringwire._conn.connect import connect, connect_sync
from ringwire._conn.listener import listen
from ringwire._conn.pair import pair
from ringwire._conn.sync_listener import SyncListener
from ringwire._errors import SegmentError
from ringwire._pool.segment import SHM_DIR, Segment
from ringwire._pool.slotconfig import SlotConfig, create_pool
from ringwire._shm.sockets import bind_unix_socket
from ringwire._wire.names import is_segment_name, new_segment_name
from ringwire._wire.slotlayout import SlotClass, init_pool, pool_size

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository: two up from tests/<folder>/
POOL = SlotConfig(classes=(SlotClass(64 << 10, 4),), threshold=1024, wait_timeout=10)


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


# ---------------------------------------------------------------------- file modes


@pytest.mark.parametrize("kind", ["named", "memfd"])
@pytest.mark.parametrize("mask", [0o000, 0o022, 0o077])
def test_segments_are_0600_whatever_the_umask(
    mask: int, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every segment a connection creates -- both ring segments' and both slot pools'
    -- is 0600 and ours: a named one from the moment it exists, a memory file (which
    nobody can open by name) before it is sealed and passed to the peer."""
    created: list[tuple[str, int, int]] = []
    monkeypatch.setenv("RINGWIRE_SEGMENTS", kind)
    if kind == "named":
        real = posix_ipc.SharedMemory

        def spy(name: str, flags: int = 0, *args: Any, **kw: Any) -> Any:
            shm = real(name, flags, *args, **kw)
            if flags & posix_ipc.O_CREAT:
                st = os.fstat(shm.fd)
                created.append((name, stat.S_IMODE(st.st_mode), st.st_uid))
            return shm

        monkeypatch.setattr("ringwire._pool.segment.posix_ipc.SharedMemory", spy)
    else:
        import fcntl

        from ringwire._pool import segment as segment_module

        real_fcntl = fcntl.fcntl

        def spy_seal(fd: int, cmd: int, arg: int = 0) -> Any:
            if cmd == fcntl.F_ADD_SEALS and "rw.probe" not in os.readlink(f"/proc/self/fd/{fd}"):
                st = os.fstat(fd)
                created.append(
                    (os.readlink(f"/proc/self/fd/{fd}"), stat.S_IMODE(st.st_mode), st.st_uid)
                )
            return real_fcntl(fd, cmd, arg)

        monkeypatch.setattr(segment_module.fcntl, "fcntl", spy_seal)
    with umask(mask):
        seg = Segment.create(4096)
        pseg, _ = create_pool(POOL)
        for s in (seg, pseg):
            assert s.kind == kind
            if kind == "named":
                assert mode_of(SHM_DIR + s.name) == 0o600
            else:
                assert stat.S_IMODE(os.fstat(s.fd).st_mode) == 0o600
            s.unlink()
            s.close()
        a, b = pair()
        out: list[Any] = []
        t = threading.Thread(
            target=lambda: out.append(b.connect_sync(slots=POOL, handshake_timeout=10))
        )
        t.start()
        ca = a.connect_sync(slots=POOL, handshake_timeout=10)
        t.join()
        with ca, out[0]:
            ca.send(np.arange(1000))
            assert out[0].receive(timeout=5)[-1] == 999
    assert len(created) >= 5  # the two above; rings + a pool for the client, a pool for the server
    assert all(m == 0o600 and uid == os.geteuid() for _, m, uid in created), created


@pytest.mark.parametrize("mask", [0o000, 0o022])
def test_listener_sockets_are_0600_whatever_the_umask(mask: int, tmp_path: pathlib.Path) -> None:
    with umask(mask):
        s = bind_unix_socket(str(tmp_path / "raw.sock"))
        assert mode_of(str(tmp_path / "raw.sock")) == 0o600
        s.close()
        os.unlink(tmp_path / "raw.sock")
        sl = SyncListener(str(tmp_path / "sync.sock"))
        assert mode_of(str(tmp_path / "sync.sock")) == 0o600
        sl.close()

        async def main() -> None:
            async with listen(tmp_path / "async.sock"):
                assert mode_of(str(tmp_path / "async.sock")) == 0o600

        anyio.run(main)


def test_attach_refuses_a_segment_others_can_open() -> None:
    seg = Segment.create(4096, kind="memfd")
    try:
        os.fchmod(seg.fd, 0o640)
        with pytest.raises(SegmentError, match="accessible to others"):
            Segment.from_fd(seg.fd, seg.name, seg.size, "memfd")
    finally:
        seg.close()
    seg = Segment.create(4096, kind="named")
    try:
        for mode in (0o640, 0o604, 0o666, 0o660):
            os.chmod(SHM_DIR + seg.name, mode)
            with pytest.raises(SegmentError, match="accessible to others"):
                Segment.attach(seg.name, seg.size)
        os.chmod(SHM_DIR + seg.name, 0o600)
        Segment.attach(seg.name, seg.size).close()
    finally:
        seg.unlink()
        seg.close()


@root_only
def test_attach_refuses_a_segment_of_another_uid() -> None:
    seg = Segment.create(4096, kind="memfd")
    try:
        os.fchown(seg.fd, NOBODY, NOBODY)
        with pytest.raises(SegmentError, match=f"belongs to uid {NOBODY}"):
            Segment.from_fd(seg.fd, seg.name, seg.size, "memfd")
    finally:
        seg.close()
    seg = Segment.create(4096, kind="named")
    try:
        os.chown(SHM_DIR + seg.name, NOBODY, NOBODY)
        with pytest.raises(SegmentError, match=f"belongs to uid {NOBODY}"):
            Segment.attach(seg.name, seg.size)
    finally:
        seg.unlink()
        seg.close()


def test_attach_refuses_names_that_are_not_ringwire_segments() -> None:
    for name in (
        "/etc/passwd",
        "/../../etc/shadow",
        "/rw.1.0123456789AB",
        "/rw.0.0123456789ab",
        "rw.1.0123456789ab",
        "/rw.1.0123456789ab/../x",
        "/psm_1234",
    ):
        with pytest.raises(SegmentError, match="not a ringwire segment name"):
            Segment.attach(name, 4096)


def test_sync_listener_refuses_another_uid_by_peer_credentials(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SO_PEERCRED check on the blocking listener (the uid is faked, so this runs
    without root; the real other-uid process is in the test above)."""
    import ringwire._shm.sockets as ctl

    real = ctl.peer_credentials
    stranger = {"on": True}

    def creds(sock: socket.socket) -> tuple[int, int, int]:
        pid, uid, gid = real(sock)
        return (pid, uid + 4242, gid) if stranger["on"] and sock.getsockname() else (pid, uid, gid)

    monkeypatch.setattr(ctl, "peer_credentials", creds)  # check_peer reads it from there
    path = str(tmp_path / "s.sock")
    with SyncListener(path) as sl:
        errors: list[BaseException] = []

        def client() -> None:
            try:
                connect_sync(path, handshake_timeout=5, slots=None).close()
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=client)
        t.start()
        with pytest.raises(TimeoutError):
            sl.accept(timeout=0.5)
        t.join()
        assert (
            sl.statistics().refused == 1
            and errors
            and isinstance(errors[0], ringwire.RingwireError)
        )
        stranger["on"] = False
        t = threading.Thread(
            target=lambda: connect_sync(path, handshake_timeout=5, slots=None).close()
        )
        t.start()
        sl.accept(timeout=5).close()
        t.join()


# -------------------------------------------------------------------------- names


def test_segment_names_are_unguessable() -> None:
    names = [new_segment_name() for _ in range(4096)]
    assert len(set(names)) == len(names)
    pid = os.getpid()
    for n in names:
        assert is_segment_name(n) and len(n) <= 31  # macOS's limit
        assert n.startswith(f"/rw.{pid}.")
    tails = [n.rsplit(".", 1)[1] for n in names]
    assert all(len(t) == 12 for t in tails)  # 48 random bits
    # the digits are uniform (chi-square, 15 degrees of freedom: 60 is p < 1e-6)
    digits = collections.Counter("".join(tails))
    expected = len(tails) * 12 / 16
    chi2 = sum((digits[c] - expected) ** 2 / expected for c in "0123456789abcdef")
    assert chi2 < 60, digits
    # and unrelated from one name to the next (no counter, no clock)
    values = [int(t, 16) for t in tails]
    steps = {b - a for a, b in zip(values, values[1:])}
    assert len(steps) > 4000


def test_names_and_pool_ids_come_from_the_csprng() -> None:
    """Names and pool ids are drawn from ``secrets`` (the OS CSPRNG), never from
    ``random`` (whose state can be recovered from its outputs) or a counter."""
    sources = {p: p.read_text() for p in sorted((ROOT / "ringwire").rglob("*.py"))}
    assert len(sources) > 10
    for mod, text in sources.items():
        tree = ast.parse(text)
        imported = {
            a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names
        } | {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        }
        assert "random" not in imported, mod
    assert any(re.search(r"secrets\.token_hex\(6\)", text) for text in sources.values())
    size = pool_size([SlotClass(64, 1)])
    ids = {init_pool(bytearray(size), [SlotClass(64, 1)]).pool_id for _ in range(2000)}
    assert len(ids) == 2000
    assert sum(1 for i in ids if i >= 1 << 60) > 1500  # all 64 bits used


def test_pairs_make_no_socket_path(tmp_path: pathlib.Path) -> None:
    """ringwire names no socket file of its own: pair() is an anonymous socketpair."""
    a, b = pair()
    for end in (a, b):
        sock = end._take()
        assert sock.getsockname() in ("", b"", None)
        sock.close()


# ----------------------------------------------------------------------- no pickle

_FORBIDDEN = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "shelve", "marshal", "copyreg"}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "__import__":
                found.add("__import__")
        elif isinstance(node, ast.Attribute) and node.attr in ("load", "loads"):
            if isinstance(node.value, ast.Name) and node.value.id in ("torch", "np", "numpy"):
                found.add(f"{node.value.id}.{node.attr}")  # both unpickle by default
    return found


def test_no_pickle_in_any_shipped_or_example_code() -> None:
    """tests/unit/test_package.py scans ringwire/ and runtime/; this adds examples/ and the
    fuzz harness (perf/ times multiprocessing.Queue, which pickles, on purpose)."""
    files = [
        p
        for d in ("ringwire", "runtime", "examples", "fuzz")
        for p in sorted((ROOT / d).rglob("*.py"))
    ]
    assert len(files) >= 20
    offenders = {
        str(p.relative_to(ROOT)): sorted(bad)
        for p in files
        if (
            bad := _imports(p)
            & (_FORBIDDEN | {"__import__", "torch.load", "np.load", "numpy.load"})
        )
    }
    assert not offenders, offenders


@needs_torch
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_nothing_is_pickled_at_run_time(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records, numpy arrays and torch tensors (inline and through slots), a typed
    record and the typed leaves cross a listener connection both ways while every
    pickling entry point raises."""
    calls: list[str] = []

    def trap(name: str) -> Any:
        def f(*a: Any, **k: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} called")

        return f

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, trap(f"pickle.{name}"))
    monkeypatch.setattr(pickle, "Pickler", trap("pickle.Pickler"))
    monkeypatch.setattr(pickle, "Unpickler", trap("pickle.Unpickler"))
    import multiprocessing.reduction as red

    monkeypatch.setattr(red.ForkingPickler, "dumps", trap("ForkingPickler.dumps"))
    monkeypatch.setattr(red.ForkingPickler, "loads", trap("ForkingPickler.loads"))

    class Item(ringwire.Record):
        name: str
        x: np.ndarray
        t: torch.Tensor
        extra: object = None

    record = {
        "small": np.arange(10),
        "big": np.arange(100_000, dtype=np.float32),
        "t": torch.ones(64, 64, dtype=torch.bfloat16),
        "leaves": (
            np.int8(1),
            np.dtype("<f8"),
            torch.float16,
            torch.Size([2]),
            torch.device("cpu"),
        ),
        "typed": Item(name="i", x=np.ones(5000), t=torch.zeros(3), extra=(1, 2)),
    }
    path = tmp_path / "p.sock"
    async with listen(path, slots=POOL) as lst:
        async with await connect(path, slots=POOL) as c:
            conn = await lst.accept()
            await c.send(record)
            got = await conn.receive()
            assert got["big"][-1] == 99_999 and got["leaves"][3] == torch.Size([2])
            await conn.send(got)
            back = await c.receive()
            assert torch.equal(back["t"], record["t"])
            del got, back
            await c.send(record["typed"])
            item = await conn.receive(type=Item)
            assert item.extra == (1, 2) and item.x.sum() == 5000
            del item
    assert calls == []
