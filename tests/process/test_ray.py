"""Ray workers on a real Ray cluster on this machine (``ray.cluster_utils``: a head
with resource ``node_a``, a second node with ``node_b`` and a third, ``node_c``, that one
test loses; started once for the module): a worker on each node (one forced to TCP)
beside a local worker, records and 4 MiB arrays both ways; kill -9 of an actor's process
under ``Restart`` and under ``"stop"``, and the chaos case (kills while serving); a lost
node; an actor that cannot start (a bad entry, an unsatisfiable resource); the pipeline
example's Ray ranks.  After every stop no actor, actor process, socket or shared-memory
name is left (the suite's conftest checks the last two; the module's end checks that
Ray's own processes are gone).  Skipped, with the reason, where Ray is not installed or
cannot start."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from support.procs import children

import ringwire
from ringwire import runtime

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ringwire[ray]')")
pytest.importorskip("zmq")

pytestmark = [pytest.mark.multiprocess]

TESTS = Path(__file__).resolve().parents[1]
ENTRY = "support.ray_workers:echo"
NODE_A = {"num_cpus": 0, "resources": {"node_a": 0.1}}
NODE_B = {"num_cpus": 0, "resources": {"node_b": 0.1}}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_bytes().split(b") ")[1][:1] == b"Z"


def _wait(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Two Ray nodes on this machine (and a third, ``node_c``, that a test loses); the
    driver connected.  Ray's files live in a
    temporary directory of the module's (removed at the end); its daemons, children of
    this process, are started before any test's leak check and must all be gone at the
    end."""
    from ray.cluster_utils import Cluster

    before = children()
    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init installs its own
    tmp = tempfile.mkdtemp(prefix="rwray-", dir="/tmp")  # short: Ray's socket paths
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "PYTHONPATH")}
    os.environ["RAY_TMPDIR"] = tmp
    path = [str(TESTS), str(TESTS.parent / "examples"), saved["PYTHONPATH"]]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, path))  # the actors import these
    os.makedirs(os.path.join(tmp, "ray"))
    node = dict(num_cpus=1, object_store_memory=80 << 20)
    c = None
    try:
        c = Cluster(
            initialize_head=True,
            head_node_args=dict(
                node, resources={"node_a": 1}, temp_dir=os.path.join(tmp, "ray"),
                include_dashboard=False,
            ),
        )  # fmt: skip
        c.add_node(**node, resources={"node_b": 1})
        c.node_c = c.add_node(**node, resources={"node_c": 1})  # lost by a test
        ray.init(address=c.address, log_to_driver=False)
    except Exception as exc:  # pragma: no cover - where Ray cannot start
        if c is not None:
            c.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.skip(f"Ray cannot start a cluster here: {exc!r}")
    daemons = children() - before
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        left = [p for p in daemons if not _wait(lambda p=p: _gone(p), 10.0)]
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"Ray's processes left running: {left}"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def alive_actors() -> list[str]:
    """The actors Ray's control store has as alive (of every class)."""
    from ray._private import state

    return [a["ActorID"] for a in state.actors().values() if a["State"] != "DEAD"]


def ready_pids(topo: runtime.Topology) -> dict[str, list[int]]:
    pids: dict[str, list[int]] = {}
    for ev in topo.history:
        if isinstance(ev, runtime.WorkerReady):
            pids.setdefault(ev.name, []).append(ev.pid)
    return pids


def assert_nothing_left(topo: runtime.Topology) -> None:
    """No actor alive, no actor process of the topology's running."""
    pids = [p for ps in ready_pids(topo).values() for p in ps]
    assert _wait(lambda: all(_gone(p) for p in pids), 10.0), f"actor processes left: {pids}"
    assert _wait(lambda: not alive_actors(), 10.0), f"actors left: {alive_actors()}"


@pytest.mark.anyio
async def test_a_worker_on_each_node_and_a_local_one(cluster: Any) -> None:
    topo = runtime.Topology(
        [
            runtime.RayWorker("a", ENTRY, ray_options=NODE_A, options={"k": 1}),
            runtime.RayWorker("b", ENTRY, ray_options=NODE_B, transport="tcp"),
            runtime.Worker("local", "support.runtime_workers:echo"),
        ],
        ready_timeout=60,
        heartbeat=1.0,
    )
    async with topo:
        paths = {}
        for name in ("a", "b"):
            chan = topo.channel(name)
            await chan.send({"n": name})
            reply = await chan.receive()
            assert reply["echo"] == {"n": name} and reply["incarnation"] == 0
            assert reply["pid"] == topo.status()[name].pid != os.getpid()
            paths[name] = reply["path"]
            arr = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
            await chan.send(arr)
            back = await chan.receive()
            np.testing.assert_array_equal(back, arr * 2)
            assert chan.statistics().tensor_path == reply["path"]
        assert paths["a"] == "slots", "same kernel, transport='auto': shared memory"
        assert paths["b"] != "slots", "transport='tcp' forces TCP"
        local = topo.channel("local")
        await local.send({"x": 1})
        assert (await local.receive())["echo"] == {"x": 1}
        assert topo.status()["a"].host and "Ray node" in topo.status()["a"].host
        assert len(alive_actors()) == 2
        # the TCP desk admits only the holder of the client key the actors were handed
        with pytest.raises(ringwire.PeerCredentialsError):
            await ringwire.connect(topo._ray_tcp_address, handshake_timeout=10)
    exits = [e for e in topo.history if isinstance(e, runtime.WorkerExit)]
    assert sorted(e.name for e in exits) == ["a", "b", "local"]
    assert all(e.expected and e.exitcode == 0 for e in exits), [e.describe() for e in exits]
    assert_nothing_left(topo)


@pytest.mark.anyio
async def test_kill_9_under_restart_brings_a_new_actor_on_a_new_channel(cluster: Any) -> None:
    topo = runtime.Topology(
        [runtime.RayWorker("r", ENTRY, ray_options=NODE_B, policy=runtime.Restart(backoff=0.05))],
        ready_timeout=60,
    )
    async with topo:
        old = topo.channel("r")
        await old.send("before")
        first = await old.receive()
        os.kill(first["pid"], signal.SIGKILL)
        with anyio.fail_after(5):  # the old channel is broken, not hung
            with pytest.raises((anyio.BrokenResourceError, anyio.EndOfStream)):
                await old.receive()
        with anyio.fail_after(60):
            new = await topo.wait_channel("r", replacing=old)
        assert new is not old
        await new.send("after")
        second = await new.receive()
        assert second["incarnation"] == 1 and second["pid"] != first["pid"]
        dead = [e for e in topo.history if isinstance(e, runtime.WorkerExit)]
        assert len(dead) == 1 and not dead[0].expected and dead[0].pid == first["pid"]
        assert dead[0].lost and dead[0].ray, dead[0].describe()  # Ray's own view, too
        assert any(isinstance(e, runtime.WorkerRestarting) for e in topo.history)
    assert_nothing_left(topo)


@pytest.mark.anyio
async def test_kill_9_under_stop_stops_the_topology(cluster: Any) -> None:
    topo = runtime.Topology([runtime.RayWorker("s", ENTRY, ray_options=NODE_A)], ready_timeout=60)
    async with topo:
        chan = topo.channel("s")
        await chan.send("x")
        pid = (await chan.receive())["pid"]
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(10):
            await topo.wait_stopped()
    assert topo.stop_reason is not None and "'s'" in topo.stop_reason, topo.stop_reason
    assert_nothing_left(topo)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("entry", "ray_options", "says"),
    [
        ("support.ray_workers:no_such_entry", NODE_A, "no_such_entry"),
        (ENTRY, {"num_cpus": 0, "resources": {"node_z": 1}}, "node_z"),
    ],
    ids=["bad-entry", "unsatisfiable-resource"],
)
async def test_an_actor_that_cannot_start_is_a_start_error(
    cluster: Any, entry: str, ray_options: dict[str, Any], says: str
) -> None:
    topo = runtime.Topology(
        [runtime.RayWorker("bad", entry, ray_options=ray_options)], ready_timeout=4
    )
    t0 = time.monotonic()
    with pytest.raises(runtime.WorkerStartError, match=says) as info:
        async with topo:
            pass
    assert time.monotonic() - t0 < 30
    assert "'bad'" in str(info.value)
    assert _wait(lambda: not alive_actors(), 10.0), f"actors left: {alive_actors()}"


@pytest.mark.anyio
@pytest.mark.timeout(180)
async def test_chaos_kills_of_ray_workers_while_serving(cluster: Any) -> None:
    """The runtime's chaos case on Ray workers (one per node, one over TCP): each is
    killed (kill -9) a few times while a driver makes checked round trips; the front's
    channel reports each death within a second, each is a WorkerExit with Ray's verdict,
    and the restarted actor serves again from a new channel."""
    kills = 2
    policy = runtime.Restart(max_restarts=100, backoff=0.0)
    topo = runtime.Topology(
        [
            runtime.RayWorker("ca", ENTRY, ray_options=NODE_A, policy=policy),
            runtime.RayWorker("cb", ENTRY, ray_options=NODE_B, policy=policy, transport="tcp"),
        ],
        ready_timeout=60,
        heartbeat=1.0,
    )
    detect: list[float] = []

    async def drive(name: str) -> None:
        chan = None
        for _ in range(kills + 1):
            with anyio.fail_after(60):
                chan = await topo.wait_channel(name, replacing=chan)
            await chan.send("hello")
            pid = (await chan.receive())["pid"]
            for n in range(20):  # checked round trips, then the kill
                await chan.send({"n": n})
                assert (await chan.receive())["echo"] == {"n": n}
            if len([e for e in topo.history if getattr(e, "name", "") == name and isinstance(e, runtime.WorkerExit)]) >= kills:  # fmt: skip
                return
            t = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            with anyio.fail_after(5), pytest.raises((anyio.BrokenResourceError, anyio.EndOfStream)):
                while True:
                    await chan.send({"n": -1})
                    await chan.receive()
            detect.append(time.perf_counter() - t)

    async with topo:
        async with anyio.create_task_group() as tg:
            tg.start_soon(drive, "ca")
            tg.start_soon(drive, "cb")
        exits = [e for e in topo.history if isinstance(e, runtime.WorkerExit)]
        assert len(exits) == 2 * kills, [e.describe() for e in exits]
        assert all(not e.expected and e.ray for e in exits), [e.describe() for e in exits]
        assert {topo.status()[n].incarnation for n in ("ca", "cb")} == {kills}
    assert len(detect) == 2 * kills and max(detect) < 1.0, detect
    assert_nothing_left(topo)


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["auto", "tcp"])
async def test_the_pipeline_with_ranks_placed_by_ray(
    cluster: Any, monkeypatch: pytest.MonkeyPatch, transport: str, tmp_path: Path
) -> None:
    """examples/pipeline --ray: every rank a Ray actor; on the front's host the steps
    arrive through shared memory, as on other hosts over TCP (``--ray-tcp``: forced
    here, with the CURVE keys the front makes and hands the ranks through Ray); the
    answers are exact."""
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(TESTS.parent / "examples"))
    from pipeline import stages
    from pipeline.app import RingwireBackend
    from pipeline.workers import ray_rank_keys, remote_config
    from support.net import free_url

    remote = None
    ray_: dict[str, Any] = {"options": NODE_B, "transport": transport}
    if transport == "tcp":
        steps, results = free_url(), free_url()
        keyed, ray_["keys"] = ray_rank_keys(str(tmp_path))
        remote = remote_config(2, 2, steps, results=results, **keyed)
    backend = RingwireBackend(2, ray=ray_, remote=remote)
    async with backend.running():
        body = {"prompt": "a ✓", "images": 2, "seed": 7, "dtype": "float32", "size": 224}
        req = stages.parse_request(body, "r1")
        got = await backend.generate(req, timeout=60)
        want = stages.expected(req)
        assert got.feature_sum == want["feature_sum"] and got.output_ids == want["output_ids"]
        status = backend.topology.status()
        assert all("Ray node" in (status[f"rank-{r}"].host or "") for r in range(2))
    assert_nothing_left(backend.topology)


@pytest.mark.anyio
async def test_a_lost_node_is_seen_through_the_channel_with_rays_verdict(cluster: Any) -> None:
    """The node of a Ray worker is lost (the module's third node, ``node_c``, there for
    this test: its raylet killed): the channel breaks, the topology (policy "stop")
    stops, and the WorkerExit carries Ray's view of the death."""
    node = cluster.node_c
    opts = {"num_cpus": 0, "resources": {"node_c": 0.1}}
    topo = runtime.Topology([runtime.RayWorker("n", ENTRY, ray_options=opts)], ready_timeout=60)
    async with topo:
        chan = topo.channel("n")
        await chan.send("x")
        await chan.receive()
        cluster.remove_node(node, allow_graceful=False)
        with anyio.fail_after(20):
            await topo.wait_stopped()
    (ex,) = [e for e in topo.history if isinstance(e, runtime.WorkerExit)]
    assert not ex.expected and ex.ray, ex.describe()
    assert_nothing_left(topo)
