"""Defaults that fit where users run: a container's /dev/shm is a 64 MiB tmpfs.

Each test runs its script in a private mount namespace whose ``/dev/shm`` is a fresh
64 MiB tmpfs (``support/shmns.py``; skipped with the reason where the machine does not
allow it).  With DEFAULT settings (memory files, issue 24) connections, pairs and
broadcasts work there, 256 MiB arrays and tensors travel by reference (through the
send pool's arena), the demo and the pipeline example run, and nothing ever appears in
``/dev/shm``.  With ``RINGWIRE_SEGMENTS=named`` the old failure is a clear
:class:`SharedMemoryFull` naming ``/dev/shm``.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
from support.extras import NO_TORCH, torch
from support.shmns import private_tmpfs_refused, run_with_private_shm

pytestmark = [pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[2]  # the repository: two up from tests/<folder>/
EXAMPLES = ROOT / "examples"


@pytest.fixture(autouse=True)
def _private_tmpfs() -> None:
    why = private_tmpfs_refused()
    if why:
        pytest.skip(why)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RINGWIRE_SEGMENTS"}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def _run(script: str, tmp_path: Path, *args: str, timeout: float = 180, **env: str) -> str:
    path = tmp_path / "in_namespace.py"
    path.write_text(script)
    proc = run_with_private_shm(
        [sys.executable, str(path), *args], timeout=timeout, env=_env(**env), cwd=str(ROOT)
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode} (-7 is SIGBUS)\n{out}"
    assert "ok" in proc.stdout.splitlines(), out
    return proc.stdout


# what every script checks first: it is in the small tmpfs, and ringwire's defaults apply
PRELUDE = """
import os, sys
SHM = "/dev/shm"
_st = os.statvfs(SHM)
assert _st.f_blocks * _st.f_frsize <= 64 << 20, "not our 64 MiB tmpfs"
assert os.listdir(SHM) == [], os.listdir(SHM)

def names():
    return sorted(os.listdir(SHM))
"""

DEFAULTS_SCRIPT = PRELUDE + textwrap.dedent(
    """
    import tempfile
    import anyio
    import numpy as np
    import ringwire
    from ringwire._pool import slotconfig

    assert slotconfig.resolve_config(slotconfig.DEFAULT_SLOTS) == ringwire.SlotConfig()
    KIND = sys.argv[1]  # "numpy" or "torch"
    BIG = 256 << 20

    def mapping_of(addr):
        # the file behind the mapping holding addr in this process
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= addr < hi:
                    return fields[5].strip() if len(fields) == 6 else ""
        raise AssertionError(f"{addr:#x} is not mapped")

    def make(salt):
        words = np.arange(BIG // 8, dtype=np.uint64) ^ np.uint64(salt)
        if KIND == "torch":
            import torch
            return torch.from_numpy(words)
        return words

    def as_numpy(x):
        return x.numpy() if KIND == "torch" else x

    def by_reference(got, salt):
        # the content, and that the receiver reads it in place in a memory file
        if KIND == "torch":
            import torch
            assert isinstance(got, torch.Tensor), type(got)
            addr = got.data_ptr()
        else:
            assert isinstance(got, np.ndarray), type(got)
            assert not got.flags.writeable, "a by-reference view is read-only"
            addr = got.ctypes.data
        arr = as_numpy(got)
        assert arr.nbytes == BIG and arr.dtype == np.uint64, (arr.nbytes, arr.dtype)
        want = np.arange(BIG // 8, dtype=np.uint64) ^ np.uint64(salt)
        assert np.array_equal(arr, want), "content differs"
        where = mapping_of(addr)
        assert where.startswith("/memfd:rw."), f"received in {where!r}, not a memory file"

    async def settled(sender):
        with anyio.fail_after(10):
            while sender.statistics().large_in_use:
                await anyio.sleep(0.01)

    async def big_one_way(sender, receiver, salt):
        before = sender.statistics().large_sent
        await sender.send(make(salt))
        got = await receiver.receive()
        st = sender.statistics()
        assert st.large_sent == before + 1, st
        assert st.large_bytes_in_use >= BIG, st
        by_reference(got, salt)
        assert names() == [], names()  # during: nothing in /dev/shm
        del got
        await settled(sender)  # the receiver's view died: the range came back

    async def main():
        d = tempfile.mkdtemp()
        path = d + "/l.sock"
        # connect() / listen()
        async with ringwire.listen(path) as lst:
            async with await ringwire.connect(path) as c, await lst.accept() as s:
                assert names() == [], names()
                await c.send(["hello", np.arange(1000)])
                msg = await s.receive()
                assert msg[0] == "hello" and (msg[1] == np.arange(1000)).all()
                del msg
                await big_one_way(c, s, 1)
                await big_one_way(s, c, 2)
        print("connect/listen", flush=True)
        # pair()
        a, b = ringwire.pair()
        async with anyio.create_task_group() as tg:
            ends = {}
            async def conn(key, end):
                ends[key] = await end.connect()
            tg.start_soon(conn, "a", a)
            tg.start_soon(conn, "b", b)
        async with ends["a"] as ca, ends["b"] as cb:
            assert names() == [], names()
            await big_one_way(cb, ca, 3)
        print("pair", flush=True)
        # broadcast() / subscribe(): records and a 4 MiB array (a slot) to two readers
        bpath = d + "/b.sock"
        async with ringwire.broadcast(bpath, readers=2) as bc:
            async with await ringwire.subscribe(bpath) as r0, await ringwire.subscribe(bpath) as r1:
                arr = np.arange(1 << 20, dtype=np.uint32)
                await bc.send(["rec", arr])
                for r in (r0, r1):
                    got = await r.receive()
                    assert got[0] == "rec" and np.array_equal(got[1], arr)
                    assert names() == [], names()
                    del got
        print("broadcast", flush=True)
        assert names() == [], names()

    anyio.run(main)
    assert names() == [], names()
    print("ok", flush=True)
    """
)


def test_defaults_work_in_a_64_mib_dev_shm_numpy(tmp_path: Path) -> None:
    """connect/listen, pair and broadcast/subscribe with default settings; 256 MiB numpy
    arrays by reference both ways (the receiver reads them in place in a memory file;
    the sender counts large_sent); /dev/shm stays empty during and after."""
    out = _run(DEFAULTS_SCRIPT, tmp_path, "numpy")
    assert out.split() == ["connect/listen", "pair", "broadcast", "ok"], out


def test_defaults_work_in_a_64_mib_dev_shm_torch(tmp_path: Path) -> None:
    """The same with a 256 MiB torch tensor."""
    if torch is None:
        pytest.skip(NO_TORCH)
    out = _run(DEFAULTS_SCRIPT, tmp_path, "torch")
    assert out.split() == ["connect/listen", "pair", "broadcast", "ok"], out


NAMED_SCRIPT = PRELUDE + textwrap.dedent(
    """
    import tempfile
    import anyio
    import ringwire
    from ringwire import SharedMemoryFull
    from ringwire._pool import segment

    assert os.environ["RINGWIRE_SEGMENTS"] == "named"
    seen = []

    async def main():
        path = tempfile.mkdtemp() + "/l.sock"
        async with ringwire.listen(path):
            # a default client: its own pool (~80 MiB) does not fit
            try:
                await ringwire.connect(path)
                raise AssertionError("a default client's pool fit a 64 MiB /dev/shm")
            except SharedMemoryFull as exc:
                seen.append(str(exc))
            # a client without a pool: the listener's pool does not fit, it refuses
            try:
                await ringwire.connect(path, slots=None)
                raise AssertionError("a default listener's pool fit a 64 MiB /dev/shm")
            except ringwire.HandshakeError as exc:
                seen.append(str(exc))
        a, b = ringwire.pair()
        try:
            await a.connect()
            raise AssertionError("a default pair end's pool fit a 64 MiB /dev/shm")
        except SharedMemoryFull as exc:
            seen.append(str(exc))
        finally:
            a.close()
            b.close()

    anyio.run(main)
    for msg in seen:
        assert SHM in msg and "full" in msg and "tensor-slot pool" in msg, msg
        print("error:", msg, flush=True)
    assert len(seen) == 3, seen
    assert names() == [], names()  # nothing half-made left behind
    print("ok", flush=True)
    """
)


def test_named_segments_fail_clearly_in_a_64_mib_dev_shm(tmp_path: Path) -> None:
    """RINGWIRE_SEGMENTS=named keeps the old behaviour honest: the default pool (~80
    MiB) does not fit a 64 MiB /dev/shm, and the error says so (SharedMemoryFull naming
    /dev/shm), leaving no name behind."""
    out = _run(NAMED_SCRIPT, tmp_path, RINGWIRE_SEGMENTS="named")
    assert out.count("error:") == 3, out


def test_demo_runs_in_a_64_mib_dev_shm() -> None:
    """``python -m ringwire.demo`` with its defaults: a clean short run, /dev/shm empty
    after (its own summary checks nothing of the run is left)."""
    proc = run_with_private_shm(
        [
            "sh",
            "-c",
            '"$0" -m ringwire.demo --duration 2 --no-live --workers 2 && '
            'echo "shm after: [$(ls -A /dev/shm)]"',
            sys.executable,
        ],
        timeout=120,
        env=_env(),
        cwd=str(ROOT),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "failed 0; wrong answers 0" in out and "no leaks" in out, out
    assert "by slot reference" in out, out
    assert "shm after: []" in proc.stdout, out


PIPELINE_SCRIPT = PRELUDE + textwrap.dedent(
    """
    import signal, subprocess
    import httpx
    sys.path.insert(0, {examples!r})
    from pipeline import stages

    proc = subprocess.Popen(
        [sys.executable, {examples!r} + "/pipeline", "--port", "0", "--ranks", "2"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        base = line.split()[-1]
        bodies = [
            dict(prompt=f"picture {{i}}", images=i % 3, seed=7 + i,
                 dtype=("float32", "bfloat16")[i % 2], size=224, max_new_tokens=3)
            for i in range(6)
        ]
        with httpx.Client(base_url=base, timeout=60) as c:
            for body in bodies:
                r = c.post("/generate", json=body)
                assert r.status_code == 200, r.text
                want = stages.expected(stages.parse_request(body, "x"))
                got = r.json()
                assert got["feature_sum"] == want["feature_sum"], (body, got)
                assert got["output_ids"] == want["output_ids"], (body, got)
                assert names() == [], names()  # during
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, f"the pipeline exited {{code}} on Ctrl-C"
    assert names() == [], names()  # after
    print("ok", flush=True)
    """
)


def test_pipeline_example_runs_in_a_64_mib_dev_shm(tmp_path: Path) -> None:
    """examples/pipeline (HTTP -> tokenizer -> scheduler -> 2 ranks) with its defaults
    answers exactly, /dev/shm empty during and after."""
    for mod in ("starlette", "uvicorn", "httpx"):
        pytest.importorskip(mod)
    if torch is None:
        pytest.skip(NO_TORCH)
    _run(PIPELINE_SCRIPT.format(examples=str(EXAMPLES)), tmp_path, timeout=240)
