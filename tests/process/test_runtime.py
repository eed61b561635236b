"""The process runtime: start/ready, request/reply, crash detection, restart and stop
policies, graceful drain, signals, and nothing left behind (tests/conftest.py checks
/dev/shm, socket files and child processes after every test)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import ringwire
from ringwire import SlotClass, SlotConfig, runtime

pytestmark = [pytest.mark.multiprocess]

TESTS = Path(__file__).resolve().parents[1]  # tests/: where support.runtime_workers is found
ROOT = TESTS.parent
SMALL = SlotConfig(classes=(SlotClass(64 << 10, 4), SlotClass(1 << 20, 4)))
W = "support.runtime_workers"  # tests/ is on sys.path, and spawned workers inherit it


@pytest.fixture
def anyio_backend() -> str:
    """asyncio here; the tests parametrized over "trio" run the front on trio too."""
    return "asyncio"


def worker(name: str, entry: str = "echo", **kw: Any) -> runtime.Worker:
    kw.setdefault("slots", SMALL)
    kw.setdefault("spin_us", 0)
    return runtime.Worker(name, f"{W}:{entry}", **kw)


def topology(*workers: runtime.Worker, **kw: Any) -> runtime.Topology:
    kw.setdefault("slots", SMALL)
    return runtime.Topology(workers, **kw)


def alive(pid: int) -> bool:
    return ringwire._pool.segment.pid_alive(pid)


async def next_event(events: Any, kind: type, timeout: float = 5.0) -> Any:
    with anyio.fail_after(timeout):
        async for ev in events:
            if isinstance(ev, kind):
                return ev
    raise AssertionError(f"the event stream ended before a {kind.__name__}")


# -- start, request/reply --------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_start_ready_request_reply(anyio_backend: str) -> None:
    topo = topology(worker("a"), worker("b", backend=anyio_backend))
    assert topo.state == "new"
    async with topo:
        assert topo.state == "running"
        status = topo.status()
        assert {s.state for s in status.values()} == {"ready"}
        pids = {name: s.pid for name, s in status.items()}
        assert all(pid and alive(pid) for pid in pids.values())
        ready = [ev for ev in topo.history if isinstance(ev, runtime.WorkerReady)]
        assert {ev.name for ev in ready} == {"a", "b"}
        big = np.arange(100_000, dtype=np.float32)  # 400 KB: travels in a slot
        for name in ("a", "b"):
            chan = topo.channel(name)
            await chan.send({"text": "hi", "big": big})
            reply = await chan.receive()
            assert reply["name"] == name and reply["pid"] == pids[name]
            assert reply["echo"]["text"] == "hi"
            assert np.array_equal(reply["echo"]["big"], big)
            del reply
    assert topo.state == "stopped"
    exits = [ev for ev in topo.history if isinstance(ev, runtime.WorkerExit)]
    assert {(ev.name, ev.exitcode, ev.expected) for ev in exits} == {("a", 0, True), ("b", 0, True)}
    assert not any(alive(pid) for pid in pids.values() if pid)


def test_plain_script_run_returns_main_result() -> None:
    async def main(topo: runtime.Topology) -> str:
        chan = topo.channel("a")
        await chan.send("ping")
        return (await chan.receive())["echo"]

    topo = topology(worker("a"))
    assert topo.run(main) == "ping"
    assert topo.state == "stopped" and topo.stop_reason == "main() returned"


@pytest.mark.anyio
async def test_start_failures_are_reported_and_cleaned_up() -> None:
    with pytest.raises(runtime.WorkerStartError, match="boom from the worker") as info:
        async with topology(worker("ok"), worker("bad", "raises", ready="explicit")):
            pass
    assert info.value.exit is not None and info.value.exit.exitcode == 1
    with pytest.raises(runtime.WorkerStartError, match="No module named"):
        async with topology(runtime.Worker("missing", "no_such_module_xyz:main", slots=SMALL)):
            pass
    with pytest.raises(runtime.WorkerStartError, match="not ready within 1 s"):
        async with topology(worker("slow", "never_ready", ready="explicit"), ready_timeout=1):
            pass


# -- crash detection, restart and stop policies ----------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_crash_detected_restarted_then_restart_limit_stops(anyio_backend: str) -> None:
    policy = runtime.Restart(max_restarts=2, window=60, backoff=0.05)
    async with topology(worker("w", policy=policy), worker("other")) as topo:
        with topo.subscribe() as events:
            chan = topo.channel("w")
            pid0 = topo.status()["w"].pid
            assert pid0 is not None
            # 1. the worker exits with status 3
            sent = time.monotonic()
            await chan.send({"exit": 3})
            ev = await next_event(events, runtime.WorkerExit)
            assert (ev.name, ev.pid, ev.exitcode, ev.signal, ev.expected) == (
                "w",
                pid0,
                3,
                None,
                False,
            )
            assert ev.at - sent < 1.0
            assert "exit status 3" in ev.describe()
            with pytest.raises(anyio.BrokenResourceError):
                await chan.receive()
            restarting = await next_event(events, runtime.WorkerRestarting)
            assert (restarting.attempt, restarting.delay) == (1, 0.05)
            # 2. restarted: a new process, a new channel, and it works
            chan1 = await topo.wait_channel("w", replacing=chan)
            assert chan1 is not chan and topo.status()["w"].restarts == 1
            await chan1.send("again")
            reply = await chan1.receive()
            assert reply["incarnation"] == 1 and reply["pid"] != pid0
            # 3. SIGKILL: reported with the signal, within a second of the kill
            pid1 = reply["pid"]
            killed = time.monotonic()
            os.kill(pid1, signal.SIGKILL)
            ev = await next_event(events, runtime.WorkerExit)
            assert (ev.pid, ev.signal, ev.exitcode) == (pid1, signal.SIGKILL, None)
            assert ev.at - killed < 1.0, ev.at - killed
            assert "killed by SIGKILL" in ev.describe()
            chan2 = await topo.wait_channel("w", replacing=chan1)
            await chan2.send("third")
            assert (await chan2.receive())["incarnation"] == 2
            # 4. a third death within the window exceeds max_restarts=2: the topology stops
            await chan2.send({"exit": 5})
            with anyio.fail_after(10):
                await topo.wait_stopped()
        assert "restart limit" in (topo.stop_reason or "")
        with pytest.raises(runtime.WorkerGone):
            await topo.wait_channel("w")
        with pytest.raises(runtime.WorkerGone):
            topo.channel("other")
    last = [ev for ev in topo.history if isinstance(ev, runtime.WorkerExit)]
    assert [(ev.name, ev.expected) for ev in last][-2:] in (
        [("w", False), ("other", True)],
        [("other", True), ("w", False)],
    )


@pytest.mark.anyio
async def test_stop_policy_stops_the_topology() -> None:
    async with topology(worker("a"), worker("b")) as topo:
        pid = topo.status()["a"].pid
        assert pid is not None
        waiter_result: list[BaseException] = []

        async def waiter() -> None:
            try:
                await topo.wait_channel("a", replacing=topo.channel("a"))
            except runtime.WorkerGone as exc:
                waiter_result.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            with anyio.fail_after(10):
                await topo.wait_stopped()
        assert waiter_result and "SIGKILL" in (topo.stop_reason or "")
        assert topo.status()["b"].state == "stopped"
    exits = {ev.name: ev for ev in topo.history if isinstance(ev, runtime.WorkerExit)}
    assert exits["a"].signal == signal.SIGKILL and not exits["a"].expected
    assert exits["b"].exitcode == 0 and exits["b"].expected


@pytest.mark.anyio
async def test_slots_held_by_a_killed_worker_are_reclaimed() -> None:
    async with topology(worker("w", policy=runtime.Restart(backoff=0.01))) as topo:
        chan = topo.channel("w")
        pid = topo.status()["w"].pid
        assert pid is not None
        # the worker holds both arrays (views of our slots) while it sleeps
        await chan.send({"sleep": 30, "a": np.ones(100_000), "b": np.ones(10_000)})
        with anyio.fail_after(5):
            while chan.statistics().slots_in_use < 2:
                await anyio.sleep(0.01)
        with topo.subscribe() as events:
            os.kill(pid, signal.SIGKILL)
            ev = await next_event(events, runtime.WorkerExit)
        assert ev.slots_reclaimed == 2 and ev.slots_in_use_after == 0
        assert chan.statistics().slots_in_use == 0
        chan = await topo.wait_channel("w", replacing=chan)
        await chan.send("alive")
        assert (await chan.receive())["incarnation"] == 1


# -- stopping ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_graceful_stop_drains_in_flight_requests() -> None:
    async with topology(worker("a"), worker("b"), drain_timeout=10) as topo:
        replies: dict[str, list[Any]] = {"a": [], "b": []}
        ended: list[str] = []

        async def collect(name: str) -> None:
            chan = topo.channel(name)
            try:
                while True:
                    replies[name].append((await chan.receive())["echo"]["n"])
            except anyio.EndOfStream:
                ended.append(name)

        async with anyio.create_task_group() as tg:
            for name in ("a", "b"):
                tg.start_soon(collect, name)
                for n in range(10):
                    await topo.channel(name).send({"n": n, "sleep": 0.02})
            t0 = time.monotonic()
            await topo.stop()  # stop accepting, drain: every request is answered
            assert time.monotonic() - t0 < 5
            assert topo.stopping
            with pytest.raises(runtime.WorkerGone):
                topo.channel("a")
        assert replies == {"a": list(range(10)), "b": list(range(10))}
        assert sorted(ended) == ["a", "b"]
    exits = [ev for ev in topo.history if isinstance(ev, runtime.WorkerExit)]
    assert all(ev.expected and ev.exitcode == 0 and ev.reason is None for ev in exits)


@pytest.mark.anyio
async def test_stop_cancels_then_kills_workers_that_do_not_drain() -> None:
    topo = topology(
        worker("stubborn", "stubborn"),
        worker("unkillable", "unkillable"),
        drain_timeout=0.3,
        kill_timeout=0.3,
    )
    async with topo:
        pass
    exits = {ev.name: ev for ev in topo.history if isinstance(ev, runtime.WorkerExit)}
    assert exits["stubborn"].exitcode == 0  # cancelled by the supervisor, exited cleanly
    assert exits["unkillable"].signal == signal.SIGKILL
    assert exits["unkillable"].reason == "did not stop within the drain deadline"
    assert all(ev.expected for ev in exits.values())


@pytest.mark.anyio
async def test_forced_stop_kills_at_once() -> None:
    async with topology(worker("u", "unkillable"), drain_timeout=30) as topo:
        t0 = time.monotonic()
        await topo.stop(force=True)
        assert time.monotonic() - t0 < 5
    (ev,) = [ev for ev in topo.history if isinstance(ev, runtime.WorkerExit)]
    assert ev.signal == signal.SIGKILL and ev.reason == "forced stop"


# -- signals and a killed supervisor (scripts in subprocesses) ---------------------------------

SCRIPT = textwrap.dedent(
    """
    import os, sys, anyio
    sys.path.insert(0, {tests!r})
    from ringwire import SlotConfig, runtime
    from ringwire import SlotClass

    SMALL = SlotConfig(classes=(SlotClass(64 << 10, 4),))

    async def main(topo):
        pids = [s.pid for s in topo.status().values()]
        print("ready", *pids, flush=True)
        await anyio.sleep(60)

    if __name__ == "__main__":
        topo = runtime.Topology(
            [runtime.Worker(n, "support.runtime_workers:{entry}", slots=SMALL) for n in ("a", "b")],
            slots=SMALL, drain_timeout={drain},
        )
        topo.run(main)
        print("stopped:", topo.stop_reason, flush=True)
    """
)


def _start_script(tmp_path: Path, entry: str = "echo", drain: float = 5) -> tuple[Any, list[int]]:
    script = tmp_path / "topo_script.py"
    script.write_text(SCRIPT.format(tests=str(TESTS), entry=entry, drain=drain))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the script did not start: {line}{out}{err}")
    return proc, [int(p) for p in line.split()[1:]]


def _wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_sigterm_stops_the_supervising_script_cleanly(tmp_path: Path) -> None:
    proc, pids = _start_script(tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "stopped: SIGTERM received" in out
    assert _wait_gone(pids)


def test_second_sigint_forces(tmp_path: Path) -> None:
    proc, pids = _start_script(tmp_path, entry="unkillable", drain=60)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None  # draining (for up to 60 s)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert time.monotonic() - t0 < 10
    assert "stopped: SIGINT received" in out and "forcing" in err
    assert _wait_gone(pids)


ORPHAN_LINE = re.compile(
    r"ringwire worker '(\w+)' \(pid \d+\): the supervisor \(pid (\d+)\) is gone; exiting"
)


def test_workers_exit_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    proc, pids = _start_script(tmp_path)
    proc.kill()
    _, err = proc.communicate(timeout=30)  # returns once the workers closed stderr too
    assert _wait_gone(pids, 10), "orphaned workers outlived their supervisor"
    ringwire.sweep_segments()  # the supervisor cannot unlink what it made any more
    said = [ORPHAN_LINE.fullmatch(line) for line in err.splitlines()]  # one line each, no more
    assert sorted((m[1], int(m[2])) for m in said if m) == [("a", proc.pid), ("b", proc.pid)]
    assert len(said) == 2, err


# The supervisor SIGKILLs itself at a chosen moment of its worker's start-up: right after
# the spawn (before multiprocessing's standard spawn would have written the child's
# arguments), while the worker imports its entry (before the channel's handshake), or
# while the worker loads something before calling ctx.ready().
KILLED_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading
    sys.path.insert(0, {tests!r})
    os.environ["RINGWIRE_TEST_IMPORT_DELAY"] = "{import_delay}"
    from multiprocessing import util
    from ringwire import SlotConfig, runtime
    from ringwire import SlotClass

    SMALL = SlotConfig(classes=(SlotClass(64 << 10, 4),))
    spawn = util.spawnv_passfds

    def spawn_then_die(path, args, fds):
        pid = spawn(path, args, fds)
        if "spawn_main" in " ".join(map(str, args)):  # a worker, not the resource tracker
            print("spawned", pid, flush=True)
            if {after} == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Timer({after}, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return pid

    util.spawnv_passfds = spawn_then_die
    if __name__ == "__main__":
        worker = runtime.Worker(
            "a", "support.{entry}", slots=SMALL, ready="{ready}", options={{"delay": 1.5}}
        )
        runtime.Topology([worker], slots=SMALL).run()
        print("the supervisor was not killed", flush=True)
    """
)


@pytest.mark.parametrize(
    ("phase", "entry", "ready", "after", "import_delay"),
    [
        ("right after the spawn", "runtime_workers:echo", "auto", 0, 0),
        ("while the worker imports", "runtime_slow_import:echo", "auto", 0.5, 1.5),
        ("before ctx.ready()", "runtime_workers:ready_late", "explicit", 0.5, 0),
    ],
)
def test_a_supervisor_killed_during_start_up_gets_one_line_not_a_traceback(
    tmp_path: Path, phase: str, entry: str, ready: str, after: float, import_delay: float
) -> None:
    """Issue 14 item 8: workers printed BrokenPipeError / HandshakeError tracebacks (and,
    killed right after the spawn, multiprocessing's EOFError) when the front process was
    killed with -9 during start-up.  Now: one line saying the supervisor is gone."""
    script = tmp_path / "killed_supervisor.py"
    script.write_text(
        KILLED_SCRIPT.format(
            tests=str(TESTS), entry=entry, ready=ready, after=after, import_delay=import_delay
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
    )
    out, err = proc.communicate(timeout=60)  # until the worker, too, has closed stderr
    assert proc.returncode == -signal.SIGKILL, out + err
    [spawned] = [int(x.split()[1]) for x in out.splitlines() if x.startswith("spawned")]
    assert _wait_gone([spawned], 10), f"the worker outlived its supervisor ({phase})"
    ringwire.sweep_segments()  # what the dead supervisor made
    lines = err.splitlines()
    m = ORPHAN_LINE.fullmatch(lines[0]) if len(lines) == 1 else None
    assert m is not None and m[1] == "a" and int(m[2]) == proc.pid, f"{phase}:\n{err}"
