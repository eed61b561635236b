"""ringwire's process runtime: a topology of worker processes wired to a front process
by ringwire channels -- spawned, supervised (restart or stop), drained and cleaned up.

::

    from ringwire import runtime

    topo = runtime.Topology([
        runtime.Worker("echo-0", "myapp.workers:echo", policy=runtime.Restart(max_restarts=3)),
        runtime.Worker("echo-1", "myapp.workers:echo"),          # policy "stop"
    ])

    async def main(topo: runtime.Topology) -> None:
        chan = topo.channel("echo-0")
        await chan.send({"text": "hello"})
        print(await chan.receive())

    topo.run(main)            # a plain script; or `async with topo:` in an async program

    # myapp/workers.py
    async def echo(ctx: runtime.WorkerContext) -> None:
        async for request in ctx.channel:      # ends when the topology stops (drained)
            await ctx.channel.send({"echo": request})

A worker on another machine joins by name over TCP (:class:`RemoteWorker`,
``Topology(listen="tcp://...")``; there: ``python -m ringwire.runtime join
tcp://front:7100 --name NAME --entry package.module:function`` or :func:`join`).

A worker placed by a Ray cluster is a :class:`RayWorker` (``pip install
'ringwire[ray]'``): the topology starts it as a Ray actor and wires it by shared memory
on the front's host, by TCP with CURVE keys elsewhere (:mod:`ringwire.runtime._ray`).

See :class:`Topology` for the lifecycle, supervision and stop semantics.
"""

from ._join import join, join_async
from ._state import WorkerStatus
from ._supervisor import Topology
from ._topology import (
    JoinRefused,
    RayWorker,
    Rejoin,
    RemoteWorker,
    Restart,
    RuntimeFailure,
    TopologyStopping,
    Worker,
    WorkerAwaitingRejoin,
    WorkerEvent,
    WorkerExit,
    WorkerGone,
    WorkerReady,
    WorkerRestarting,
    WorkerStartError,
)
from ._worker import WorkerContext

__all__ = [
    "JoinRefused",
    "RayWorker",
    "Rejoin",
    "RemoteWorker",
    "Restart",
    "RuntimeFailure",
    "Topology",
    "TopologyStopping",
    "Worker",
    "WorkerAwaitingRejoin",
    "WorkerContext",
    "WorkerEvent",
    "WorkerExit",
    "WorkerGone",
    "WorkerReady",
    "WorkerRestarting",
    "WorkerStartError",
    "WorkerStatus",
    "join",
    "join_async",
]
