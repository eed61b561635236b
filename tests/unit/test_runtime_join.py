"""Remote workers without a second process: the front and the joining worker in one
event loop over tcp://127.0.0.1 (ringwire/runtime/_remote.py, _join.py and the
declarations in _topology.py).  The separate-process tests, kill -9 and rejoin are
in tests/process/test_runtime_join.py."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import ringwire
from ringwire import SlotClass, SlotConfig, runtime

pytest.importorskip("zmq")

from support.net import free_url, port_free  # noqa: E402

SMALL = SlotConfig(classes=(SlotClass(64 << 10, 4), SlotClass(1 << 20, 4)))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def echo(ctx: runtime.WorkerContext) -> None:
    async for request in ctx.channel:
        await ctx.channel.send({"echo": request, "name": ctx.name, "options": ctx.options})


def join_kw(**kw: Any) -> dict[str, Any]:
    kw.setdefault("slots", SMALL)
    kw.setdefault("timeout", 10.0)
    kw.setdefault("retry_for", 10.0)
    return kw


# -- declarations ---------------------------------------------------------------------------


def test_remote_worker_and_rejoin_are_validated() -> None:
    with pytest.raises(ValueError, match="worker names"):
        runtime.RemoteWorker("bad name")
    with pytest.raises(ValueError, match="policy must be 'stop' or a Rejoin"):
        runtime.RemoteWorker("a", policy=runtime.Restart())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="within"):
        runtime.Rejoin(within=0)
    with pytest.raises(ValueError, match="max_rejoins"):
        runtime.Rejoin(max_rejoins=-1)
    with pytest.raises(ValueError, match="options must be a mapping"):
        runtime.RemoteWorker("a", options=[1])  # type: ignore[arg-type]


def test_topology_validates_its_listen_address() -> None:
    remote = runtime.RemoteWorker("tok")
    with pytest.raises(ValueError, match=r"remote workers \['tok'\] join over TCP"):
        runtime.Topology([remote])
    local = runtime.Worker("a", "support.runtime_workers:echo")
    with pytest.raises(ValueError, match="has no RemoteWorker"):
        runtime.Topology([local], listen="tcp://127.0.0.1:0")
    with pytest.raises(ValueError, match="tcp://host:port address"):
        runtime.Topology([remote], listen="/tmp/front.sock")
    with pytest.raises(ValueError, match="bad TCP address 'tcp://nowhere'"):
        runtime.Topology([remote], listen="tcp://nowhere")
    with pytest.raises(ValueError, match="refusing to listen at tcp://0.0.0.0:7100"):
        runtime.Topology([remote], listen="tcp://0.0.0.0:7100")
    runtime.Topology([remote], listen="tcp://0.0.0.0:7100", insecure=True)  # nothing bound yet
    with pytest.raises(TypeError, match=r"must be ringwire.ServerKeys\(...\)"):
        runtime.Topology([remote], listen="tcp://127.0.0.1:0", keys=("pub", "secret"))


def test_join_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="tcp://host:port address, not '/tmp/x.sock'"):
        runtime.join("/tmp/x.sock", "tok", echo)
    with pytest.raises(ValueError, match="worker names"):
        runtime.join("tcp://127.0.0.1:1", "no spaces", echo)
    with pytest.raises(TypeError, match="entry must be"):
        runtime.join("tcp://127.0.0.1:1", "tok", 42)  # type: ignore[arg-type]
    with pytest.raises(ModuleNotFoundError):
        runtime.join("tcp://127.0.0.1:1", "tok", "no_such_module_here:entry")
    with pytest.raises(ValueError, match="ready must be"):
        runtime.join("tcp://127.0.0.1:1", "tok", echo, ready="later")
    with pytest.raises(ValueError, match="bad TCP address 'tcp://x'"):
        runtime.join("tcp://x", "tok", echo)
    with pytest.raises(TypeError, match=r"must be ringwire.ClientKeys\(...\)"):
        runtime.join("tcp://127.0.0.1:1", "tok", echo, keys="k")


def test_joining_where_no_topology_listens_names_the_address() -> None:
    url = free_url()
    with pytest.raises(runtime.JoinRefused, match=f"'tok' cannot join {url}: no topology listens"):
        runtime.join(url, "tok", echo, timeout=2.0)


# -- joining in one event loop ----------------------------------------------------------------


@pytest.mark.anyio
async def test_a_joined_worker_gets_records_both_ways_and_stops_cleanly() -> None:
    url = free_url()
    topo = runtime.Topology(
        [runtime.RemoteWorker("tok", options={"model": "m1"})], listen=url, slots=SMALL
    )
    codes: list[int] = []

    async def worker() -> None:
        codes.append(await runtime.join_async(url, "tok", echo, **join_kw()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        async with topo:
            assert topo.address == url
            status = topo.status()["tok"]
            assert status.state == "ready" and status.host == socket.gethostname()
            chan = topo.channel("tok")
            big = np.arange(100_000, dtype=np.float32)  # travels beside the record
            await chan.send({"n": 1, "big": big})
            reply = await chan.receive()
            assert reply["name"] == "tok" and reply["options"] == {"model": "m1"}
            assert reply["echo"]["n"] == 1 and np.array_equal(reply["echo"]["big"], big)
            del reply
    assert codes == [0]
    exits = [e for e in topo.history if isinstance(e, runtime.WorkerExit)]
    assert len(exits) == 1 and exits[0].expected and exits[0].exitcode == 0
    assert exits[0].host == socket.gethostname()
    assert port_free(url)


@pytest.mark.anyio
async def test_a_keyed_topology_admits_the_listed_worker_only(tmp_path: Path) -> None:
    """keys= end to end: a front with ringwire.ServerKeys, a worker joining with its
    ringwire.ClientKeys gets its channel; one with an unlisted key is refused saying
    so (and the CLI's --key-secret / --server-key build those keys)."""
    from ringwire._net.keys import keygen

    pub = {}
    for name in ("front", "tok", "stranger"):
        pub[name] = keygen(tmp_path / name, name)
    (tmp_path / "clients").mkdir()
    shutil.copy(pub["tok"][0], tmp_path / "clients")
    url = free_url()
    server = ringwire.ServerKeys(secret=pub["front"][1], clients=tmp_path / "clients")
    topo = runtime.Topology([runtime.RemoteWorker("tok")], listen=url, slots=SMALL, keys=server)
    good = ringwire.ClientKeys(secret=pub["tok"][1], server=pub["front"][0])
    bad = ringwire.ClientKeys(secret=pub["stranger"][1], server=pub["front"][0])
    codes: list[int] = []

    async def worker() -> None:
        codes.append(await runtime.join_async(url, "tok", echo, **join_kw(keys=good)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        async with topo:
            chan = topo.channel("tok")
            await chan.send({"n": 1})
            assert (await chan.receive())["echo"] == {"n": 1}
            with pytest.raises(runtime.JoinRefused, match="CURVE"):
                await runtime.join_async(url, "tok", echo, **join_kw(keys=bad, retry_for=0))
    assert codes == [0]
    assert port_free(url)


def test_the_cli_takes_both_key_files_or_neither(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ringwire.runtime.__main__ import main

    base = ["join", free_url(), "--name", "tok", "--entry", "x:y"]
    with pytest.raises(SystemExit) as info:
        main([*base, "--key-secret", str(tmp_path / "w.key_secret")])
    assert info.value.code == 2
    assert "--key-secret and --server-key go together" in capsys.readouterr().err
    missing = [*base, "--key-secret", str(tmp_path / "w.key_secret"), "--server-key", "f.key"]
    assert main(missing) == 2
    err = capsys.readouterr().err
    assert "w.key_secret" in err and "ringwire.runtime join:" in err


@pytest.mark.anyio
async def test_joins_are_refused_with_a_reason_naming_what_was_tried() -> None:
    url = free_url()
    topo = runtime.Topology(
        [
            runtime.RemoteWorker("tok"),
            runtime.Worker("local", "support.runtime_workers:echo", slots=SMALL, spin_us=0),
        ],
        listen=url,
        slots=SMALL,
    )
    codes: list[int] = []

    async def worker() -> None:
        codes.append(await runtime.join_async(url, "tok", echo, **join_kw()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        async with topo:
            with pytest.raises(runtime.JoinRefused, match=r"no remote worker named 'nope' \(remote workers: \['tok'\]\)"):  # fmt: skip
                await runtime.join_async(url, "nope", echo, **join_kw(retry_for=0))
            with pytest.raises(runtime.JoinRefused, match="'local' is a local worker"):
                await runtime.join_async(url, "local", echo, **join_kw(retry_for=0))
            with pytest.raises(runtime.JoinRefused, match="'tok' is already joined to the topology at tcp://127.0.0.1:.* \\(pid"):  # fmt: skip
                await runtime.join_async(url, "tok", echo, **join_kw(retry_for=0))
            # the joined one is unharmed
            await topo.channel("tok").send("still there?")
            assert (await topo.channel("tok").receive())["echo"] == "still there?"
            await topo.stop()
            with pytest.raises(runtime.JoinRefused, match="cannot join|is stopping"):
                await runtime.join_async(url, "tok", echo, **join_kw(retry_for=0))
    assert codes == [0]


@pytest.mark.anyio
async def test_a_remote_worker_that_never_joins_fails_the_start() -> None:
    url = free_url()
    topo = runtime.Topology([runtime.RemoteWorker("tok")], listen=url, ready_timeout=0.5)
    with pytest.raises(runtime.WorkerStartError, match=f"'tok' did not join {url} within 0.5 s"):
        await topo.start()
    assert topo.state == "stopped"
    assert port_free(url)


@pytest.mark.anyio
async def test_explicit_ready_and_the_stopping_event() -> None:
    url = free_url()
    topo = runtime.Topology([runtime.RemoteWorker("tok")], listen=url, slots=SMALL)
    seen: list[str] = []
    go = anyio.Event()

    async def slow(ctx: runtime.WorkerContext) -> None:
        await go.wait()  # "loading a model"
        await ctx.channel.send("early")  # before ready: kept, the front reads it later
        ctx.ready()
        await ctx.stopping.wait()
        seen.append("stopping")

    async def worker() -> None:
        await runtime.join_async(url, "tok", slow, ready="explicit", **join_kw())

    async def checker() -> None:
        await anyio.sleep(0.5)
        seen.append(topo.status()["tok"].state)  # joined, not ready yet
        go.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        tg.start_soon(checker)
        with anyio.fail_after(10):
            async with topo:
                assert await topo.channel("tok").receive() == "early"
    assert seen == ["starting", "stopping"]


@pytest.mark.anyio
async def test_a_busy_port_fails_the_start_naming_it() -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    url = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
    try:
        topo = runtime.Topology([runtime.RemoteWorker("tok")], listen=url)
        with pytest.raises(OSError, match=f"cannot listen at {url}"):
            await topo.start()
    finally:
        busy.close()


@pytest.mark.anyio
async def test_a_connection_that_is_not_a_join_is_dropped_with_a_reason() -> None:
    import ringwire

    url = free_url()
    topo = runtime.Topology([runtime.RemoteWorker("tok")], listen=url, slots=SMALL)

    async def worker() -> None:
        await runtime.join_async(url, "tok", echo, **join_kw())

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        async with topo:
            stranger = await ringwire.connect(url, slots=None)
            await stranger.send({"hello": "who are you?"})
            with pytest.raises(ringwire.BrokenResourceError, match="not a ringwire.runtime join"):
                with anyio.fail_after(10):
                    await stranger.receive()
            stranger.close()
            forged = await ringwire.connect(url, slots=None)
            await forged.send({"ringwire.runtime": "attach", "v": 1, "token": b"x" * 16})
            with pytest.raises(ringwire.BrokenResourceError, match="unknown or used token"):
                with anyio.fail_after(10):
                    await forged.receive()
            forged.close()
            await topo.channel("tok").send("fine?")  # the joined worker is unharmed
            assert (await topo.channel("tok").receive())["echo"] == "fine?"


@pytest.mark.anyio
async def test_a_remote_worker_that_does_not_drain_is_cancelled_at_stop() -> None:
    url = free_url()
    topo = runtime.Topology(
        [runtime.RemoteWorker("tok")], listen=url, slots=SMALL, drain_timeout=0.5
    )
    seen: list[str] = []

    async def stubborn(ctx: runtime.WorkerContext) -> None:
        try:
            await anyio.sleep_forever()  # reads nothing, ignores the stop
        finally:
            seen.append(f"cancelled, stopping={ctx.stopping.is_set()}")

    codes: list[int] = []

    async def worker() -> None:
        codes.append(await runtime.join_async(url, "tok", stubborn, **join_kw()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        async with topo:
            pass
        # drained for drain_timeout, then told to cancel: an expected, clean exit
    assert seen == ["cancelled, stopping=True"] and codes == [0]
    (ex,) = [e for e in topo.history if isinstance(e, runtime.WorkerExit)]
    assert ex.expected and ex.exitcode == 0


@pytest.mark.anyio
async def test_malformed_joins_are_refused_and_break_nothing() -> None:
    import ringwire

    url = free_url()
    topo = runtime.Topology([runtime.RemoteWorker("tok")], listen=url, slots=SMALL)

    async def worker() -> None:
        await runtime.join_async(url, "tok", echo, **join_kw())

    async def refusal(hello: Any) -> str:
        chan = await ringwire.connect(url, slots=None)
        try:
            await chan.send(hello)
            with anyio.fail_after(10):
                reply = await chan.receive()
            assert reply["ringwire.runtime"] == "refuse"
            return str(reply["reason"])
        finally:
            chan.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        async with topo:
            base = {"ringwire.runtime": "join", "v": 1}
            assert "must name its worker" in await refusal({**base, "name": 5})
            assert "must name its worker" in await refusal(base)
            assert "speaks runtime protocol 1, the worker 2" in await refusal(
                {**base, "v": 2, "name": "tok"}
            )
            assert "speaks runtime protocol 1" in await refusal({"ringwire.runtime": "join"})
            await topo.channel("tok").send("fine?")
            assert (await topo.channel("tok").receive())["echo"] == "fine?"


@pytest.mark.anyio
async def test_a_worker_that_keeps_leaving_exceeds_its_rejoin_limit() -> None:
    url = free_url()
    policy = runtime.Rejoin(within=5.0, max_rejoins=1)
    topo = runtime.Topology([runtime.RemoteWorker("tok", policy=policy)], listen=url)

    async def leaves(ctx: runtime.WorkerContext) -> None:
        await anyio.sleep(0.2)  # (after the start: an exit during it fails the start)
        # an entry that returns on its own is an unexpected exit

    codes: list[int] = []

    async def worker() -> None:
        for _ in range(2):
            codes.append(await runtime.join_async(url, "tok", leaves, **join_kw()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        async with topo:
            with anyio.fail_after(10):
                await topo.wait_stopped()
    assert codes == [0, 0]
    assert topo.stop_reason == (
        "worker 'tok' exit status 0 and exceeded its rejoin limit (1 within 60 s)"
    )
    kinds = [type(e).__name__ for e in topo.history]
    assert kinds[:5] == [
        "WorkerReady", "WorkerExit", "WorkerAwaitingRejoin", "WorkerReady", "WorkerExit",
    ]  # fmt: skip
