"""Remote workers across processes: a worker started separately (``python -m
ringwire.runtime join``) joins a topology by name over tcp://127.0.0.1; records both
ways; kill -9 of the joined worker is noticed by liveness; a rejoin within the bound
continues, none stops the topology with a clear reason; a killed front ends the worker.
tests/conftest.py checks that no process is left; each test checks its port is free."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from ringwire import SlotClass, SlotConfig, runtime

pytest.importorskip("zmq")

from support.net import free_url, port_free  # noqa: E402

pytestmark = [pytest.mark.multiprocess]

TESTS = Path(__file__).resolve().parents[1]
SMALL = SlotConfig(classes=(SlotClass(64 << 10, 4), SlotClass(1 << 20, 4)))
ENTRY = "support.runtime_workers:echo"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def joiner(url: str, name: str = "tok", *extra: str) -> subprocess.Popen[str]:
    """``python -m ringwire.runtime join`` in its own process (cwd tests/)."""
    return subprocess.Popen(
        [sys.executable, "-m", "ringwire.runtime", "join", url, "--name", name,
         "--entry", ENTRY, "--retry-for", "30", "--heartbeat", "1", *extra],
        cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen[str], timeout: float = 15.0) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the joined worker did not exit: {err}") from None
    return proc.returncode, err


def reap(*procs: subprocess.Popen[str] | None) -> None:
    """Kill (if still running) and wait, closing the pipes."""
    for p in procs:
        if p is not None:
            if p.poll() is None:
                p.kill()
            p.communicate()


def topology(url: str, policy: Any = "stop", **kw: Any) -> runtime.Topology:
    kw.setdefault("ready_timeout", 30.0)
    return runtime.Topology(
        [runtime.RemoteWorker("tok", policy=policy)], listen=url, slots=SMALL, heartbeat=1.0, **kw
    )


async def next_event(events: Any, kind: type, timeout: float = 10.0) -> Any:
    with anyio.fail_after(timeout):
        async for ev in events:
            if isinstance(ev, kind):
                return ev
    raise AssertionError(f"the event stream ended before a {kind.__name__}")


@pytest.mark.anyio
async def test_a_worker_of_another_process_joins_by_name_records_both_ways() -> None:
    url = free_url()
    proc = joiner(url)
    try:
        async with topology(url) as topo:
            status = topo.status()["tok"]
            assert status.state == "ready" and status.pid == proc.pid
            chan = topo.channel("tok")
            assert chan.peer_pid == proc.pid
            big = np.arange(200_000, dtype=np.float32)  # 800 KB: a frame beside the record
            for i in range(50):
                await chan.send({"i": i, "big": big} if i % 10 == 0 else {"i": i})
            for i in range(50):
                reply = await chan.receive()
                assert reply["echo"]["i"] == i and reply["pid"] == proc.pid
                if i % 10 == 0:
                    assert np.array_equal(reply["echo"]["big"], big)
            del reply
        code, err = finish(proc)
    finally:
        reap(proc)
    assert code == 0, err
    (ready,) = [e for e in topo.history if isinstance(e, runtime.WorkerReady)]
    assert ready.pid == proc.pid and ready.host == socket.gethostname()
    assert port_free(url)


@pytest.mark.anyio
async def test_kill_9_is_noticed_and_a_rejoin_within_the_bound_continues() -> None:
    url = free_url()
    first = joiner(url)
    second: subprocess.Popen[str] | None = None
    try:
        async with topology(url, runtime.Rejoin(within=20.0)) as topo:
            old = topo.channel("tok")
            await old.send("before")
            assert (await old.receive())["echo"] == "before"
            with topo.subscribe() as events:
                killed = time.monotonic()
                os.kill(first.pid, signal.SIGKILL)
                lost = await next_event(events, runtime.WorkerExit)
                waiting = await next_event(events, runtime.WorkerAwaitingRejoin)
            reap(first)
            assert lost.pid == first.pid and not lost.expected
            assert lost.lost is not None and "lost its connection" in lost.describe()
            assert lost.at - killed < 1.0, "a killed peer on a live network is seen at once"
            assert waiting.within == 20.0
            assert topo.status()["tok"].state == "rejoining"
            with pytest.raises(runtime.WorkerGone):
                topo.channel("tok")
            second = joiner(url)
            with anyio.fail_after(30):
                new = await topo.wait_channel("tok", replacing=old)
            await new.send("after")
            reply = await new.receive()
            assert reply == {"echo": "after", "pid": second.pid, "incarnation": 1, "name": "tok"}
            assert topo.status()["tok"].restarts == 1
            with pytest.raises((anyio.ClosedResourceError, anyio.BrokenResourceError)):
                await old.send("to the dead one")  # replaced: closed by the runtime
        code, err = finish(second)
        assert code == 0, err
    finally:
        reap(first, second)
    assert port_free(url)


@pytest.mark.anyio
async def test_what_a_killed_worker_sent_stays_readable_and_nothing_is_resent() -> None:
    url = free_url()
    first = joiner(url)
    second: subprocess.Popen[str] | None = None
    try:
        async with topology(url, runtime.Rejoin(within=20.0)) as topo:
            old = topo.channel("tok")
            with topo.subscribe() as events:
                for i in range(5):
                    await old.send({"i": i})
                await old.send({"kill": True})  # the worker kills itself on reading it
                await old.send({"i": "never answered"})
                await next_event(events, runtime.WorkerExit)
            reap(first)
            got = []
            with pytest.raises(anyio.BrokenResourceError):
                while True:
                    got.append((await old.receive())["echo"]["i"])
            # what reached us before the kill, in order, then the break: nothing made up
            # (answers still queued in the killed process's libzmq die with it)
            assert got == list(range(len(got))) and len(got) <= 5
            second = joiner(url)
            with anyio.fail_after(30):
                new = await topo.wait_channel("tok", replacing=old)
            await new.send({"i": "fresh"})
            reply = await new.receive()  # the new worker got nothing of the old stream
            assert reply["echo"] == {"i": "fresh"} and reply["incarnation"] == 1
        code, err = finish(second)
        assert code == 0, err
    finally:
        reap(first, second)


@pytest.mark.anyio
async def test_a_frozen_worker_is_noticed_within_the_heartbeat_bound() -> None:
    url = free_url()
    proc = joiner(url)  # --heartbeat 1, and the topology's heartbeat is 1 s
    try:
        async with topology(url, runtime.Rejoin(within=20.0)) as topo:
            with topo.subscribe() as events:
                frozen = time.monotonic()
                os.kill(proc.pid, signal.SIGSTOP)  # alive, silent: no sentinel would tell
                lost = await next_event(events, runtime.WorkerExit, timeout=15)
            assert lost.pid == proc.pid and lost.lost is not None
            assert 0.5 < lost.at - frozen < 5.0, lost.at - frozen
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            os.kill(proc.pid, signal.SIGCONT)
        reap(proc)


@pytest.mark.anyio
async def test_no_rejoin_within_the_bound_stops_the_topology() -> None:
    url = free_url()
    proc = joiner(url)
    try:
        async with topology(url, runtime.Rejoin(within=1.0)) as topo:
            chan = topo.channel("tok")
            os.kill(proc.pid, signal.SIGKILL)
            reap(proc)
            with anyio.fail_after(10):
                await topo.wait_stopped()
            assert topo.stop_reason == f"remote worker 'tok' did not rejoin {url} within 1 s"
            with pytest.raises(runtime.WorkerGone, match="not coming back"):
                await topo.wait_channel("tok", replacing=chan)
    finally:
        reap(proc)
    assert port_free(url)


@pytest.mark.anyio
async def test_stop_policy_stops_the_topology_when_the_worker_is_lost() -> None:
    url = free_url()
    proc = joiner(url)
    try:
        async with topology(url) as topo:
            os.kill(proc.pid, signal.SIGKILL)
            reap(proc)
            with anyio.fail_after(10):
                await topo.wait_stopped()
            assert topo.stop_reason is not None
            assert topo.stop_reason.startswith("worker 'tok' lost its connection (")
    finally:
        reap(proc)


def test_the_cli_names_what_it_tried_when_nobody_listens() -> None:
    url = free_url()
    proc = subprocess.run(
        [sys.executable, "-m", "ringwire.runtime", "join", url, "--name", "tok", "--entry", ENTRY],
        cwd=TESTS, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert f"worker 'tok' cannot join {url}: no topology listens there" in proc.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "ringwire.runtime", "join", "tcp://nowhere", "--name", "tok",
         "--entry", ENTRY],
        cwd=TESTS, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "bad TCP address 'tcp://nowhere'" in bad.stderr


FRONT = """
import sys
from ringwire import runtime
async def main(topo):
    print("running", flush=True)
    await topo.wait_stopped()
topo = runtime.Topology([runtime.RemoteWorker("tok")], listen=sys.argv[1], heartbeat=1.0)
topo.run(main)
"""


def test_a_joined_worker_exits_when_the_front_is_killed(tmp_path: Path) -> None:
    url = free_url()
    script = tmp_path / "front.py"
    script.write_text(textwrap.dedent(FRONT))
    front = subprocess.Popen(
        [sys.executable, str(script), url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc = joiner(url)
    try:
        assert front.stdout is not None
        assert front.stdout.readline().strip() == "running"
        reap(front)
        code, err = finish(proc, timeout=10)
        assert code == 3, err
        assert f"ringwire worker 'tok' (pid {proc.pid}): the front at {url} is gone" in err
        assert "Traceback" not in err
    finally:
        reap(front, proc)


def test_the_example_front_and_its_remote_worker() -> None:
    url = free_url()
    examples = TESTS.parent / "examples"
    front = subprocess.Popen(
        [sys.executable, str(examples / "remote_worker.py"), url, "-n", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    worker = subprocess.Popen(
        [sys.executable, "-m", "ringwire.runtime", "join", url, "--name", "tokenizer",
         "--entry", "remote_worker:tokenize", "--retry-for", "30"],
        cwd=examples, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = front.communicate(timeout=60)
        assert front.returncode == 0, err
        for i in range(3):
            assert f"request {i}: {len(f'prompt number {i}')} tokens from pid {worker.pid}" in out
        code, werr = finish(worker)
        assert code == 0, werr
    finally:
        reap(front, worker)
    assert port_free(url)
