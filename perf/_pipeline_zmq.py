"""The pipeline of ``examples/pipeline`` over ZeroMQ, for ``perf/pipeline.py``.

The same processes, records and work (:mod:`pipeline.stages`) as the ringwire
pipeline, wired the way SGLang wires its processes: ZeroMQ ``ipc://`` sockets,
PUSH/PULL between processes, PUB/SUB from the scheduler to the ranks, every message one
serialized object with its tensors inline:

* ``"msgpack"`` -- ``ringwire.Encoder(profile="sglang")`` / ``Decoder(profile="sglang")``,
  which write and read exactly the bytes of SGLang's ``msgpack_utils`` (msgspec msgpack,
  tensors inline in its buffer layout): SGLang's path since PR #29656;
* ``"pickle"`` -- ``pickle.dumps`` / ``loads`` (what ``send_pyobj`` / ``recv_pyobj`` do):
  its path before.

::

    front --PUSH--> tokenizer --PUSH--> scheduler --PUB--> rank 0..N-1
      ^                 |  ^                |  ^               |
      +-----PUSH--------+  +-----PUSH-------+  +-----PUSH------+

The worker processes are ``ringwire.runtime`` workers (the runtime spawns, supervises
and stops them; their ringwire channel to the front carries nothing), so both peers
start, stop and clean up alike.  ZeroMQ has no deadlines or cancellation: a call the
front gives up on is forgotten there, and its reply dropped when it comes.

Pickle appears here because it is the peer being measured: every message is between
this benchmark's own processes, over sockets in a private directory.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import anyio
import zmq
import zmq.asyncio
from pipeline import stages
from pipeline.records import GenerateRequest, RankOutput, Reply, Step, TokenizedRequest
from pipeline.workers import MAX_BATCH

import ringwire
from ringwire import runtime

__all__ = ["SERIALIZERS", "ZmqBackend"]

SERIALIZERS = ("msgpack", "pickle")
START_TIMEOUT = 30.0


class _Codec:
    def __init__(self, kind: str) -> None:
        if kind not in SERIALIZERS:
            raise ValueError(f"serializer must be one of {SERIALIZERS}, not {kind!r}")
        self.kind = kind
        self._enc = ringwire.Encoder(profile="sglang")
        self._dec: dict[type, ringwire.Decoder] = {}

    def dumps(self, obj: Any) -> bytes:
        if self.kind == "pickle":
            return pickle.dumps(obj, pickle.DEFAULT_PROTOCOL)
        return self._enc.encode(obj)

    def loads(self, data: bytes, typ: type) -> Any:
        if self.kind == "pickle":
            return pickle.loads(data)  # noqa: S301  (the peer under test; our own processes)
        dec = self._dec.get(typ)
        if dec is None:
            dec = self._dec[typ] = ringwire.Decoder(typ, profile="sglang")
        return dec.decode(data)


def _addr(directory: str, name: str) -> str:
    return f"ipc://{os.path.join(directory, name)}"


def _ctx_socket(ctx: zmq.asyncio.Context, kind: int, addr: str, *, bind: bool) -> Any:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)  # no drops, no blocking: as SGLang's PUSH sockets
    s.setsockopt(zmq.RCVHWM, 0)
    if bind:
        s.bind(addr)
    else:
        s.connect(addr)
    return s


async def _until_stopping(ctx: runtime.WorkerContext, *loops: Any) -> None:
    async with anyio.create_task_group() as tg:
        for loop in loops:
            tg.start_soon(loop)
        await ctx.stopping.wait()
        tg.cancel_scope.cancel()


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


# -- workers -----------------------------------------------------------------------------


async def tokenizer(ctx: runtime.WorkerContext) -> None:
    _one_thread()
    import torch

    d, codec = ctx.options["dir"], _Codec(ctx.options["serializer"])
    zctx = zmq.asyncio.Context()
    try:
        from_front = _ctx_socket(zctx, zmq.PULL, _addr(d, "tok_in"), bind=True)
        to_front = _ctx_socket(zctx, zmq.PUSH, _addr(d, "front_in"), bind=False)
        to_sched = _ctx_socket(zctx, zmq.PUSH, _addr(d, "sched_in"), bind=False)
        from_sched = _ctx_socket(zctx, zmq.PULL, _addr(d, "tok_replies"), bind=True)
        ctx.ready()

        async def requests() -> None:
            while True:
                req = codec.loads(await from_front.recv(), GenerateRequest)
                feature = None
                if req.images:
                    feature = torch.empty(
                        stages.feature_shape(req), dtype=stages.torch_dtype(req.dtype)
                    )
                await to_sched.send(codec.dumps(stages.process(req, feature)))
                del feature

        async def replies() -> None:
            while True:
                await to_front.send(await from_sched.recv())  # a Reply, passed on

        await _until_stopping(ctx, requests, replies)
    finally:
        zctx.destroy(linger=0)


async def scheduler(ctx: runtime.WorkerContext) -> None:
    d, codec, ranks = ctx.options["dir"], _Codec(ctx.options["serializer"]), ctx.options["ranks"]
    zctx = zmq.asyncio.Context()
    try:
        from_tok = _ctx_socket(zctx, zmq.PULL, _addr(d, "sched_in"), bind=True)
        to_tok = _ctx_socket(zctx, zmq.PUSH, _addr(d, "tok_replies"), bind=False)
        steps = _ctx_socket(zctx, zmq.PUB, _addr(d, "steps"), bind=True)
        results = _ctx_socket(zctx, zmq.PULL, _addr(d, "results"), bind=True)
        # PUB/SUB drops what is published before a subscriber is connected: publish a
        # sync message until every rank has answered it
        synced: set[int] = set()
        with anyio.fail_after(START_TIMEOUT):
            while len(synced) < ranks:
                await steps.send_multipart([b"S", b""])
                with anyio.move_on_after(0.02):
                    while len(synced) < ranks:
                        kind, body = await results.recv_multipart()
                        if kind == b"H":
                            synced.add(int(body))
        ctx.ready()

        async def run() -> None:
            n = 0
            while True:
                batch = [codec.loads(await from_tok.recv(), TokenizedRequest)]
                while len(batch) < MAX_BATCH:
                    try:
                        data = from_tok.recv(zmq.NOBLOCK)
                        batch.append(codec.loads(await data, TokenizedRequest))
                    except zmq.Again:
                        break
                n += 1
                step = Step(step=n, reqs=batch)
                await steps.send_multipart([b"T", codec.dumps(step)])
                got: dict[int, RankOutput] = {}
                while len(got) < ranks:
                    kind, body = await results.recv_multipart()
                    if kind == b"R":
                        out = codec.loads(body, RankOutput)
                        got[out.rank] = out
                for reply in stages.combine(step, [got[r] for r in range(ranks)]):
                    await to_tok.send(codec.dumps(reply))
                del step, batch

        await _until_stopping(ctx, run)
    finally:
        zctx.destroy(linger=0)


async def rank(ctx: runtime.WorkerContext) -> None:
    _one_thread()
    d, codec = ctx.options["dir"], _Codec(ctx.options["serializer"])
    me, ranks = ctx.options["rank"], ctx.options["ranks"]
    zctx = zmq.asyncio.Context()
    try:
        sub = _ctx_socket(zctx, zmq.SUB, _addr(d, "steps"), bind=False)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        out = _ctx_socket(zctx, zmq.PUSH, _addr(d, "results"), bind=False)
        ctx.ready()

        async def run() -> None:
            while True:
                kind, body = await sub.recv_multipart()
                if kind == b"S":
                    await out.send_multipart([b"H", str(me).encode()])
                    continue
                step = codec.loads(body, Step)
                del body
                result = stages.rank_compute(step, me, ranks)
                del step
                await out.send_multipart([b"R", codec.dumps(result)])

        await _until_stopping(ctx, run)
    finally:
        zctx.destroy(linger=0)


# -- the front end's side ----------------------------------------------------------------


class ZmqBackend:
    """The pipeline over ZeroMQ + ``serializer`` (a backend of ``pipeline.app``)."""

    def __init__(self, serializer: str, ranks: int = 2) -> None:
        self.codec = _Codec(serializer)
        self.name = f"zmq-{serializer}"
        self.ranks = ranks
        self.topology: Any = None
        self._pending: dict[str, Any] = {}
        self._push: Any = None

    def _workers(self, d: str) -> list[runtime.Worker]:
        common = {"dir": d, "ranks": self.ranks, "serializer": self.codec.kind}
        kw: dict[str, Any] = {"slots": None, "capacity": 64 << 10, "ready": "explicit"}
        mod = "perf._pipeline_zmq"
        return [
            runtime.Worker("tokenizer", f"{mod}:tokenizer", options=common, **kw),
            runtime.Worker("scheduler", f"{mod}:scheduler", options=common, **kw),
        ] + [
            runtime.Worker(f"rank-{r}", f"{mod}:rank", options={**common, "rank": r}, **kw)
            for r in range(self.ranks)
        ]

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        import asyncio

        with tempfile.TemporaryDirectory(prefix="rw-pipeline-zmq-") as d:
            zctx = zmq.asyncio.Context()
            try:
                self._push = _ctx_socket(zctx, zmq.PUSH, _addr(d, "tok_in"), bind=False)
                pull = _ctx_socket(zctx, zmq.PULL, _addr(d, "front_in"), bind=True)

                async def replies() -> None:
                    while True:
                        reply = self.codec.loads(await pull.recv(), Reply)
                        fut = self._pending.pop(reply.rid, None)
                        if fut is not None and not fut.done():
                            fut.set_result(reply)

                topo = runtime.Topology(self._workers(d), slots=None, drain_timeout=5.0)
                async with topo, anyio.create_task_group() as tg:
                    self.topology = topo
                    tg.start_soon(replies)
                    self._loop = asyncio.get_running_loop()
                    try:
                        yield
                    finally:
                        self._push = None
                        tg.cancel_scope.cancel()
            finally:
                for fut in self._pending.values():
                    fut.cancel()
                self._pending.clear()
                zctx.destroy(linger=0)

    async def generate(self, req: GenerateRequest, timeout: float) -> Reply:
        push = self._push
        if push is None or self.topology is None or self.topology.stopping:
            raise anyio.ClosedResourceError("the pipeline is not running")
        fut = self._loop.create_future()
        self._pending[req.rid] = fut
        try:
            await push.send(self.codec.dumps(req))
            with anyio.fail_after(timeout):
                return await fut  # type: ignore[no-any-return]
        finally:
            self._pending.pop(req.rid, None)

    def describe(self) -> dict[str, Any]:
        topo = self.topology
        return {
            "backend": self.name,
            "ranks": self.ranks,
            "state": None if topo is None else topo.state,
            "workers": {} if topo is None else {n: s.state for n, s in topo.status().items()},
            "pending": len(self._pending),
        }
