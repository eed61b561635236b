"""One process on the C ring, the other on the pure-Python ring, over one segment (the
wire layout is the contract): records and slot arrays both ways, batches, the
eventcount with both ends parked, and the release lane; and ``RINGWIRE_PURE``."""

from __future__ import annotations

import os
import subprocess
import sys

import anyio
import numpy as np
import pytest
from support.channel import small_slot_pools  # noqa: F401  (an autouse fixture)
from support.spawn import spawned

import ringwire
from ringwire._conn.pair import PairEnd, pair
from ringwire._wire import lanes

pytestmark = pytest.mark.multiprocess
needs_native = pytest.mark.skipif(
    lanes.NativeRingWriter is None, reason=f"the C ring is not built: {lanes.REASON}"
)


def child_echo(end: PairEnd, spin_us: int) -> None:
    import ringwire as rw

    async def main() -> None:
        async with await end.connect(spin_us=spin_us) as ch:
            await ch.send({"native": rw.native})
            while True:
                batch = await ch.receive_many(64)
                if batch[-1] == "stop":
                    await ch.send_many(batch[:-1])
                    break
                await ch.send_many(batch)

    anyio.run(main)


@pytest.fixture
def child_on_the_other_path(monkeypatch: pytest.MonkeyPatch) -> bool:
    """The child runs the path this process does not; returns whether it is native."""
    monkeypatch.setenv("RINGWIRE_PURE", "0" if not lanes.NATIVE else "1")
    return not lanes.NATIVE


@needs_native
@pytest.mark.parametrize("spin_us", [0, 200])
def test_a_native_end_and_a_pure_end_share_a_segment(child_on_the_other_path, spin_us) -> None:
    a, b = pair()
    with spawned(child_echo, b, spin_us) as p:

        async def main() -> None:
            async with await a.connect(spin_us=spin_us) as ch:
                assert await ch.receive() == {"native": child_on_the_other_path}
                rng = np.random.default_rng(7)
                for i in range(150):
                    arr = rng.integers(0, 255, size=int(rng.integers(1, 40_000)), dtype=np.uint8)
                    msg = {"i": i, "s": "x" * int(rng.integers(0, 900)), "a": arr}
                    await ch.send(msg)
                    back = await ch.receive()
                    assert back["i"] == i and back["s"] == msg["s"]
                    assert np.array_equal(back["a"], arr)
                    del back
                items = [{"k": k, "pad": b"p" * (k % 300)} for k in range(2000)]
                await ch.send_many([*items, "stop"])
                got: list = []
                while len(got) < len(items):
                    got.extend(await ch.receive_many(500))
                assert got == items
                stats = ch.statistics()
                assert stats.records_received == 1 + 150 + len(items)

        anyio.run(main)
    assert p.exitcode == 0


@needs_native
def test_ringwire_pure_forces_the_pure_path() -> None:
    code = "import ringwire; print(ringwire.native, '|', ringwire.native_reason)"
    for value, native in (("1", False), ("yes", False), ("0", True), ("", True)):
        env = dict(os.environ, RINGWIRE_PURE=value)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout
        flag, reason = (x.strip() for x in out.split("|"))
        assert flag == str(native), (value, out)
        assert (f"RINGWIRE_PURE={value}" in reason) == (not native)
    assert ringwire.native == (os.environ.get("RINGWIRE_PURE", "") in ("", "0"))


def test_the_extension_compiles_without_warnings(tmp_path) -> None:
    """``-Wall -Wextra -Werror`` with the flags setup.py uses (gcc is on CI machines)."""
    import shutil
    import sysconfig

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler here")
    src = os.path.join(os.path.dirname(lanes.__file__), "_cring.c")
    cmd = [
        cc,
        "-std=c11",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-fPIC",
        f"-I{sysconfig.get_paths()['include']}",
        "-c",
        src,
        "-o",
        str(tmp_path / "cring.o"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr


_ASAN_DRIVER = r"""
import importlib.machinery, importlib.util, random, sys, time
name = "ringwire._wire._cring"
loader = importlib.machinery.ExtensionFileLoader(name, sys.argv[1])
spec = importlib.util.spec_from_file_location(name, sys.argv[1], loader=loader)
mod = importlib.util.module_from_spec(spec)
loader.exec_module(mod)
sys.modules[name] = mod
sys.path.insert(0, sys.argv[2])
import ringwire
from ringwire._wire import lanes
assert lanes.NATIVE and lanes.NativeRingReader.__module__ == "ringwire._wire.lanes"
assert sys.modules[name].__file__ == sys.argv[1]
import targets
rng = random.Random(int(sys.argv[4]))
deadline = time.monotonic() + float(sys.argv[3])
runs = 0
for tname in ("ring_native", "release_lane"):
    seeds = targets.seeds(tname)
    for s in seeds:
        targets.TARGETS[tname].run(s)
while time.monotonic() < deadline:
    tname = "ring_native" if runs % 4 else "release_lane"
    data = bytearray(rng.choice(targets.seeds(tname)))
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(4)
        pos = rng.randrange(len(data) + 1)
        if op == 0 and data:
            data[pos % len(data)] = rng.randrange(256)
        elif op == 1:
            data[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 2:
            del data[pos : pos + rng.randint(1, 16)]
        else:
            v = rng.choice([0, 1, 7, 8, 0xFFFFFFFF, 0x7FFFFFF0, 508, 509, 1020, 1024])
            data[pos : pos + 4] = v.to_bytes(4, "little")
    targets.TARGETS[tname].run(bytes(data))
    runs += 1
# the lift scan: random nests of lists, dicts and leaves (deep ones too)
atomic = {int, float, str, bytes, bool, type(None)}
def nest(d):
    k = rng.randrange(6) if d < 80 else 5
    if k == 0:
        return [nest(d + 1) for _ in range(rng.randrange(4))]
    if k == 1:
        return {str(i): nest(d + 1) for i in range(rng.randrange(4))}
    return rng.choice([1, 2.5, "s", b"b", None, True, (1,), {1}, [], {}])
for _ in range(20000):
    mod.needs_lift(nest(0), atomic)
print("runs", runs)
"""


@needs_native
@pytest.mark.slow
@pytest.mark.timeout(0)
def test_the_c_parser_under_address_sanitizer(tmp_path) -> None:
    """The C ring built with ``-fsanitize=address,undefined``, loaded in place of the
    normal build, driven by the ``ring_native`` and ``release_lane`` fuzz targets (random
    mutations of their seeds) for ``RINGWIRE_ASAN_SECONDS`` (default 60), then the lift
    scan (``needs_lift``) over random nests: any out-of-bounds access aborts the
    process."""
    import shutil
    import sysconfig

    from support.fuzz import FUZZ

    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("no gcc here")
    libasan = subprocess.run(
        [cc, "-print-file-name=libasan.so"], capture_output=True, text=True
    ).stdout.strip()
    if not os.path.isabs(libasan) or not os.path.exists(libasan):
        pytest.skip("gcc has no AddressSanitizer runtime here")
    src = os.path.join(os.path.dirname(lanes.__file__), "_cring.c")
    so = tmp_path / ("_cring" + sysconfig.get_config_var("EXT_SUFFIX"))
    include = sysconfig.get_paths()["include"]
    cmd = [cc, "-std=c11", "-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    cmd += [
        "-fno-sanitize-recover=undefined",
        "-shared",
        "-fPIC",
        f"-I{include}",
        src,
        "-o",
        str(so),
    ]
    subprocess.run(cmd, check=True)
    driver = tmp_path / "asan_driver.py"
    driver.write_text(_ASAN_DRIVER)
    env = dict(
        os.environ,
        LD_PRELOAD=libasan,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
        RINGWIRE_PURE="0",
        PYTHONPATH=str(FUZZ),
    )
    seconds = os.environ.get("RINGWIRE_ASAN_SECONDS", "60")
    root = os.path.dirname(os.path.dirname(os.path.dirname(lanes.__file__)))
    proc = subprocess.run(
        [sys.executable, str(driver), str(so), root, seconds, "1515"],
        env=env,
        capture_output=True,
        text=True,
        timeout=float(seconds) + 240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "runs" in proc.stdout


def test_no_compiler_prints_one_line_and_builds_nothing(tmp_path) -> None:
    """setup.py's build_ext with a compiler that does not exist: exit 0, one line saying
    the pure path is used, no extension built (what ``pip install`` does there)."""
    # setup.py runs on this interpreter; pip gives a build its own setuptools, but a venv
    # of Python 3.12+ has none of its own.
    pytest.importorskip("setuptools", reason="setuptools is not installed in this venv")
    root = os.path.dirname(os.path.dirname(os.path.dirname(lanes.__file__)))
    (tmp_path / "ringwire" / "_wire").mkdir(parents=True)
    for rel in ("setup.py", os.path.join("ringwire", "_wire", "_cring.c")):
        with open(os.path.join(root, rel), "rb") as src:
            (tmp_path / rel).write_bytes(src.read())
    env = dict(os.environ, CC="/nonexistent/cc")
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    ours = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "ringwire:" in ln]
    assert len(ours) == 1, proc.stdout + proc.stderr
    assert ours[0].endswith("the pure-Python path is used")
    assert not list((tmp_path / "ringwire").rglob("*.so"))
