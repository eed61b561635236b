"""The pipeline's worker processes, as ``ringwire.runtime`` entries.

::

    front (HTTP) --Client/serve--> tokenizer --Client/serve--> scheduler --broadcast--> rank 0..N-1
         ^                             |                          ^  |                      |
         +--------- Reply -------------+<-------- Reply ----------+  +<--- RankOutput ------+
                                                                     (listen: fan-in)

* **tokenizer** (``ctx.channel`` is its connection to the front): ``ringwire.serve``
  answers the front's calls.  For each request it *loans* a tensor slot on its
  connection to the scheduler, writes the pixel values into it
  (:func:`pipeline.stages.process`) and calls the scheduler with the
  ``TokenizedRequest`` -- the feature is written once, into shared memory the scheduler
  reads in place.
* **scheduler**: listens for the tokenizer (calls) and for the ranks' outputs (fan-in),
  and owns the broadcast.  Calls queue up; a step loop takes up to ``MAX_BATCH`` of them,
  broadcasts the step to every rank (each feature copied once into the broadcast's
  shared slot pool, viewed zero-copy by all N ranks), gathers N ``RankOutput`` records,
  combines them and answers each call.
* **rank** *r*: subscribes as reader *r*, computes its shard of every step
  (:func:`pipeline.stages.rank_compute`), drops the step (its views go, so the slot
  returns once all ranks have dropped theirs) and sends its output to the scheduler.

Every worker says it is ready (``ready="explicit"``) only once its connections are up,
so the topology is ready when the whole pipeline is.  Stopping: the front closes its
client (the tokenizer's ``serve`` returns), then stops the topology; each worker waits
for ``ctx.stopping`` and leaves its blocks, which closes the next hop: the scheduler's
``serve`` returns, it closes the broadcast, and the ranks see the end of the stream.
A rank that dies fails the broadcast (``on_reader_loss="fail"``): the step in flight
and every queued call fail at once, and the scheduler exits, which stops the topology.

**Ranks on other hosts** (``topology(..., remote=remote_config(...))``): the last
``remote["ranks"]`` ranks are not started here.  The scheduler's broadcast also serves
remote readers at ``remote["steps"]`` (``tcp=``, CURVE ``keys=`` off loopback) and a
TCP listener at ``remote["results"]`` takes their outputs; the two fan-ins (Unix and
TCP) are merged into one stream the step loop reads.  :func:`remote_rank` (``python
examples/pipeline rank tcp://HOST:PORT --rank R --ranks N``) is such a rank: the same
computation, its steps' features arriving as ZeroMQ frames instead of shared slots.
A remote rank that dies or is cut off fails the broadcast exactly as a local one.
"""

from __future__ import annotations

import collections
import contextlib
import os
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

import ringwire
from ringwire import runtime

from . import observe, stages
from .records import GenerateRequest, RankOutput, Reply, Step, TokenizedRequest

__all__ = [
    "CALL_TIMEOUT",
    "FEATURE_SLOTS",
    "MAX_BATCH",
    "paths",
    "rank",
    "remote_config",
    "ray_rank",
    "ray_rank_keys",
    "remote_rank",
    "results_address",
    "scheduler",
    "tokenizer",
    "topology",
]

T = TypeVar("T")

# One request's feature is one tensor [n, 3, 448, 448]: 2.4 MB (one float32 image) to
# 9.6 MB (four); the tokenizer's pool and the broadcast's pool both look like this.
FEATURE_SLOTS = ringwire.SlotConfig(
    classes=(
        ringwire.SlotClass(64 << 10, 16),
        ringwire.SlotClass(3 << 20, 16),
        ringwire.SlotClass(10 << 20, 16),
    ),
    threshold=64 << 10,
    wait_timeout=30.0,
)
MAX_BATCH = 16  # requests per step
CONCURRENCY = 64  # calls a tokenizer / scheduler admits at once (as many again wait)
CALL_TIMEOUT = 30.0  # seconds, tokenizer -> scheduler, when the front sent no deadline
START_TIMEOUT = 30.0  # for a peer to come up
STEP_TIMEOUT = 30.0  # for all ranks to answer one step
POLL_S = 0.25  # how often a step waiting for the ranks checks that they are alive


def paths(directory: str) -> dict[str, str]:
    """The Unix socket paths the workers meet at, inside the front's private directory."""
    return {
        "calls": os.path.join(directory, "scheduler.sock"),
        "results": os.path.join(directory, "results.sock"),
        "steps": os.path.join(directory, "steps.sock"),
    }


async def _retry(
    make: Callable[[], Awaitable[T]], what: str, timeout: float = START_TIMEOUT
) -> T:
    """``make()`` until the peer's socket exists (workers start in parallel)."""
    try:
        with anyio.fail_after(timeout):
            while True:
                try:
                    return await make()
                except (FileNotFoundError, ConnectionRefusedError):
                    await anyio.sleep(0.02)
    except TimeoutError:
        raise TimeoutError(f"{what}: nobody there within {timeout:g} s") from None


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # N+2 processes share the cores: no intra-op pools


# -- tokenizer ---------------------------------------------------------------------------


async def tokenizer(ctx: runtime.WorkerContext) -> None:
    _one_thread()
    with observe.worker(ctx):
        await _tokenizer(ctx)


async def _tokenizer(ctx: runtime.WorkerContext) -> None:
    where = paths(ctx.options["dir"])
    chan = await _retry(
        lambda: ringwire.connect(where["calls"], slots=FEATURE_SLOTS), "the scheduler"
    )
    async with ringwire.Client(chan, type=Reply) as sched:

        async def handle(req: GenerateRequest) -> Reply:
            feature = None
            if req.images:  # written once, in place, in a slot of this connection
                feature = await sched.channel.loan(
                    stages.feature_shape(req), stages.torch_dtype(req.dtype)
                )
            tokenized = stages.process(req, feature)
            del feature
            left = anyio.current_effective_deadline() - anyio.current_time()
            return await sched.call(tokenized, timeout=min(left, CALL_TIMEOUT))  # type: ignore[no-any-return]

        ctx.ready()
        # returns when the front closes its client
        await ringwire.serve(
            ctx.channel, handle, type=GenerateRequest, concurrency=CONCURRENCY
        )
        await ctx.stopping.wait()


# -- scheduler ---------------------------------------------------------------------------


class _Pending:
    __slots__ = ("done", "error", "reply", "req", "trace")

    def __init__(self, req: TokenizedRequest) -> None:
        self.req: TokenizedRequest | None = req
        self.trace = observe.current_context()  # its serve span's (None: not tracing)
        self.done = anyio.Event()
        self.reply: Reply | None = None
        self.error: BaseException | None = None


class _Scheduler:
    """Calls in, steps out: a queue and one step loop."""

    def __init__(
        self,
        bc: ringwire.Broadcaster,
        receive: Callable[[], Awaitable[tuple[Any, Any]]],
        ranks: int,
    ) -> None:
        self.bc = bc
        self.receive = receive  # the ranks' outputs: (connection, record)
        self.ranks = ranks
        self.queue: collections.deque[_Pending] = collections.deque()
        self.wake = anyio.Event()
        self.failed: BaseException | None = None
        self.steps = 0

    async def handle(self, req: TokenizedRequest) -> Reply:
        if self.failed is not None:
            raise RuntimeError(f"the scheduler has failed: {self.failed}")
        p = _Pending(req)
        del req
        self.queue.append(p)
        self.wake.set()
        try:
            await p.done.wait()
        except BaseException:
            p.req = None  # cancelled: a step not yet taken skips it
            raise
        if p.error is not None:
            raise RuntimeError(f"step failed: {p.error}")
        assert p.reply is not None
        return p.reply

    async def run(self) -> None:
        batch: list[_Pending] = []
        try:
            while True:
                while not self.queue:
                    self.wake = anyio.Event()
                    with anyio.move_on_after(POLL_S):
                        await self.wake.wait()
                    if not self.queue:  # idle: take the ranks' slot releases in (so the
                        # metrics show the slots free) and notice a rank that went
                        self.bc.poll_readers()
                batch = []
                while self.queue and len(batch) < MAX_BATCH:
                    p = self.queue.popleft()
                    if p.req is not None:
                        batch.append(p)
                if not batch:
                    continue
                self.steps += 1
                spans = observe.start_spans(
                    "pipeline.step", [p.trace for p in batch],
                    {"pipeline.step": self.steps, "pipeline.batch": len(batch),
                     "pipeline.ranks": self.ranks},
                )  # fmt: skip
                try:
                    step = Step(
                        step=self.steps,
                        reqs=[p.req for p in batch if p.req is not None],
                        trace=[observe.carrier(s) for s in spans],
                    )
                    await self.bc.send(step)  # each feature: one copy into the shared pool
                    outputs = await self._gather(step.step)
                    replies = stages.combine(step, outputs)
                except BaseException as exc:
                    observe.end_spans(spans, exc)
                    raise
                observe.end_spans(spans)
                del step
                for p, reply in zip(batch, replies):
                    p.req, p.reply = None, reply  # the tokenizer's slot goes with the call
                    p.done.set()
                batch = []
        except BaseException as exc:
            self.failed = exc
            for p in [*batch, *self.queue]:
                p.req, p.error = None, exc
                p.done.set()
            self.queue.clear()
            raise

    async def _gather(self, step: int) -> list[RankOutput]:
        got: dict[int, RankOutput] = {}
        deadline = anyio.current_time() + STEP_TIMEOUT
        while len(got) < self.ranks:
            with anyio.move_on_after(POLL_S):
                _, out = await self.receive()
                if not isinstance(out, RankOutput) or out.step != step or out.rank in got:
                    raise ringwire.ProtocolError(f"step {step}: unexpected rank output {out!r}")
                got[out.rank] = out
                continue
            live = self.bc.poll_readers()  # raises BrokenResourceError once a rank died
            if live < self.ranks:
                raise anyio.BrokenResourceError(f"step {step}: {self.ranks - live} rank(s) gone")
            if anyio.current_time() > deadline:
                missing = sorted(set(range(self.ranks)) - set(got))
                raise TimeoutError(f"step {step}: ranks {missing} did not answer")
        return [got[r] for r in range(self.ranks)]


def _server_keys(remote: dict[str, Any]) -> ringwire.ServerKeys | None:
    if remote.get("key_secret") is None:
        return None
    return ringwire.ServerKeys(secret=remote["key_secret"], clients=remote["clients"])


async def _forward(listener: ringwire.Listener, into: Any) -> None:
    """Every record of ``listener``'s fan-in into the memory stream ``into``."""
    async for _, record in listener:
        await into.send((None, record))


async def scheduler(ctx: runtime.WorkerContext) -> None:
    with observe.worker(ctx):
        await _scheduler(ctx)


async def _scheduler(ctx: runtime.WorkerContext) -> None:
    ranks = int(ctx.options["ranks"])
    remote: dict[str, Any] = ctx.options.get("remote") or {}
    where = paths(ctx.options["dir"])
    keys = _server_keys(remote) if remote else None
    tcp = {"tcp": remote["steps"], "keys": keys, "insecure": remote["insecure"]} if remote else {}
    async with contextlib.AsyncExitStack() as stack:
        bc = await stack.enter_async_context(
            ringwire.broadcast(
                where["steps"], readers=ranks, slots=FEATURE_SLOTS, on_reader_loss="fail",
                stall_timeout=STEP_TIMEOUT, **tcp,
            )
        )  # fmt: skip
        if ctx.options.get("metrics"):  # stamp each step: the ranks time its hop
            ringwire.trace_records(bc, hop_times=True)
        results = await stack.enter_async_context(
            ringwire.listen(where["results"], type=RankOutput, slots=None)
        )
        calls = await stack.enter_async_context(ringwire.listen(where["calls"], slots=None))
        receive = results.receive
        fan_ins: list[ringwire.Listener] = []
        if remote:  # the remote ranks' outputs come to a TCP listener: merge both fan-ins
            net = await stack.enter_async_context(
                ringwire.listen(
                    remote["results"], type=RankOutput, slots=None, keys=keys,
                    insecure=remote["insecure"],
                )
            )  # fmt: skip
            merged_in, merged = anyio.create_memory_object_stream[Any](2 * ranks)
            stack.enter_context(merged_in)
            stack.enter_context(merged)
            fan_ins, receive = [results, net], merged.receive
            first = ranks - int(remote["ranks"])
            print(
                f"waiting for remote rank(s) {', '.join(map(str, range(first, ranks)))} of "
                f"{ranks}: steps at {bc.tcp_address}, results at {net.path}",
                flush=True,
            )
        join_timeout = float(remote.get("join_timeout", START_TIMEOUT))
        try:
            with anyio.fail_after(join_timeout):
                await bc.wait_ready(ranks)
        except TimeoutError:
            where = f" (remote ranks join at {bc.tcp_address})" if remote else ""
            raise TimeoutError(
                f"{bc.poll_readers()} of {ranks} ranks joined within {join_timeout:g} s{where}"
            ) from None
        with anyio.fail_after(START_TIMEOUT):
            chan = await calls.accept()  # the tokenizer
        sched = _Scheduler(bc, receive, ranks)
        ctx.ready()
        async with chan, anyio.create_task_group() as tg:
            for fan_in in fan_ins:
                tg.start_soon(_forward, fan_in, merged_in)
            tg.start_soon(sched.run)
            await ringwire.serve(
                chan, sched.handle, type=TokenizedRequest, concurrency=CONCURRENCY
            )  # returns when the tokenizer closes its client (at the stop)
            await ctx.stopping.wait()
            tg.cancel_scope.cancel()


# -- ranks -------------------------------------------------------------------------------


async def _compute(sub: ringwire.Subscriber, out: ringwire.Channel, me: int, ranks: int) -> None:
    async for step in sub:  # ends when the scheduler closes the broadcast
        # each request's trace goes on here (the step carries one context per request)
        spans = observe.start_spans(
            "pipeline.rank", [observe.parent(t) for t in step.trace],
            {"pipeline.step": step.step, "pipeline.rank": me, "pipeline.batch": len(step.reqs)},
        )  # fmt: skip
        try:
            result = stages.rank_compute(step, me, ranks)
            del step  # our views of the shared slots (or of the received frames) die here
            await out.send(result)
        except BaseException as exc:
            observe.end_spans(spans, exc)
            raise
        observe.end_spans(spans)


async def rank(ctx: runtime.WorkerContext) -> None:
    _one_thread()
    with observe.worker(ctx):
        await _rank(ctx)


async def _rank(ctx: runtime.WorkerContext) -> None:
    me, ranks = int(ctx.options["rank"]), int(ctx.options["ranks"])
    where = paths(ctx.options["dir"])
    out = await _retry(
        lambda: ringwire.connect(where["results"], slots=None, capacity=64 << 10), "the scheduler"
    )
    async with out:
        sub = await _retry(
            lambda: ringwire.subscribe(where["steps"], rank=me, type=Step), "the broadcast"
        )
        async with sub:
            if ctx.options.get("metrics"):  # (the scheduler stamps the steps)
                ringwire.trace_records(sub)
            ctx.ready()
            await _compute(sub, out, me, ranks)


def _boot_id() -> str:
    """This kernel's boot id: two processes with the same one share memory and sockets."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


async def ray_rank(ctx: runtime.WorkerContext) -> None:
    """A rank placed by Ray (``topology(..., ray=...)``, ``--ray``): on the front's host
    (the same kernel boot id) it is a local rank -- the broadcast's steps through shared
    memory; on another host it subscribes over TCP to the scheduler's ``--tcp`` address,
    exactly as :func:`remote_rank`, with the CURVE keys the front handed it
    (:func:`ray_rank_keys`).  Raises ``RuntimeError`` when placed elsewhere and the
    server serves no TCP, or has keys it was not handed."""
    if ctx.options["boot_id"] == _boot_id():
        return await rank(ctx)
    remote: dict[str, Any] = ctx.options.get("remote") or {}
    me, ranks = int(ctx.options["rank"]), int(ctx.options["ranks"])
    handed = ctx.options.get("keys")
    if not remote or (remote.get("key_secret") and not handed):
        why = "with CURVE keys it was not handed" if remote else "without --tcp"
        raise RuntimeError(
            f"rank {me}: Ray placed it on another host ({os.uname().nodename}) and the server "
            f"runs {why}: give --tcp tcp://HOST:PORT (--ray-tcp hands the ranks keys), or "
            "pin the ranks to the front's node with --ray-resources"
        )
    with tempfile.TemporaryDirectory(prefix="pipeline-rank-keys-") as tmp:
        keys = None
        if remote.get("key_secret"):  # written 0600, read back by ClientKeys
            paths = {}
            for name in ("secret", "server"):
                paths[name] = os.path.join(tmp, name)
                fd = os.open(paths[name], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(handed[name])
            keys = ringwire.ClientKeys(secret=paths["secret"], server=paths["server"])
        await remote_rank(
            remote["steps"], rank=me, ranks=ranks, results=remote["results"], keys=keys,
            on_joined=ctx.ready,
        )  # fmt: skip


def ray_rank_keys(directory: str) -> tuple[dict[str, str], dict[str, bytes]]:
    """CURVE keys for the ranks Ray places on other hosts, made in ``directory`` (a
    private one, kept while the server runs): the server's pair and one pair for the
    ranks (its public half in ``directory/clients``).  Returns the
    :func:`remote_config` keyword arguments (``key_secret``, ``clients``) and what each
    Ray rank is handed (``{"secret": ..., "server": ...}``: the files' bytes).  The
    ranks' secret travels in the actor's arguments, through Ray's own control plane:
    TCP is then as private as the Ray cluster."""
    import shutil

    import zmq.auth

    clients = os.path.join(directory, "clients")
    os.makedirs(clients, mode=0o700)
    for name in ("server", "ranks"):  # (in a 0700 directory: nobody else reads the secret)
        zmq.auth.create_certificates(directory, name)
        os.chmod(os.path.join(directory, f"{name}.key_secret"), 0o600)
    shutil.copy(os.path.join(directory, "ranks.key"), clients)
    with open(os.path.join(directory, "ranks.key_secret"), "rb") as f:
        secret = f.read()
    with open(os.path.join(directory, "server.key"), "rb") as f:
        server = f.read()
    config = {"key_secret": os.path.join(directory, "server.key_secret"), "clients": clients}
    return config, {"secret": secret, "server": server}


def results_address(steps: str) -> str:
    """The scheduler's TCP results listener beside its broadcast at ``steps``: the next
    port (``tcp://host:0`` -- any free port -- stays 0)."""
    head, _, port = steps.rpartition(":")
    if not steps.startswith("tcp://") or not port.isdigit():
        raise ValueError(f"not a tcp://host:port address: {steps!r}")
    return f"{head}:{int(port) + 1 if int(port) else 0}"


async def remote_rank(
    steps: str,
    *,
    rank: int,
    ranks: int,
    results: str | None = None,
    keys: ringwire.ClientKeys | None = None,
    retry_for: float = START_TIMEOUT,
    on_joined: Callable[[], None] | None = None,
) -> None:
    """Rank ``rank`` of ``ranks`` on another host: it subscribes to the scheduler's
    broadcast at ``steps`` (its ``tcp=``) and sends its outputs to the scheduler's TCP
    listener at ``results`` (default: :func:`results_address`), with ``keys`` when the
    scheduler has keys; it retries for ``retry_for`` seconds while nobody listens there
    yet.  Returns when the scheduler closes the broadcast (the server stopped); raises
    ``BrokenResourceError`` if the broadcast fails or the server goes away."""
    _one_thread()
    results = results_address(steps) if results is None else results
    out = await _retry(
        lambda: ringwire.connect(results, slots=None, capacity=64 << 10, keys=keys),
        f"the scheduler's results at {results}", retry_for,
    )  # fmt: skip
    async with out:
        sub = await _retry(
            lambda: ringwire.subscribe(steps, rank=rank, type=Step, keys=keys),
            f"the scheduler's broadcast at {steps}", retry_for,
        )  # fmt: skip
        async with sub:
            if on_joined is not None:
                on_joined()
            await _compute(sub, out, rank, ranks)


def remote_config(
    remote_ranks: int,
    ranks: int,
    tcp: str,
    *,
    results: str | None = None,
    key_secret: str | None = None,
    clients: str | None = None,
    insecure: bool = False,
    join_timeout: float = 300.0,
) -> dict[str, Any]:
    """The scheduler's ``remote`` option: the last ``remote_ranks`` of ``ranks`` join
    from another host, at the broadcast's ``tcp`` address and the results listener's
    ``results`` (default :func:`results_address`), with CURVE keys (``key_secret``: the
    server's ``NAME.key_secret``; ``clients``: the directory of the remote ranks'
    public ``.key`` files) or ``insecure``; ``join_timeout`` seconds for them to join.

    Checked here, in the front, with ringwire's own checks, before any process starts:
    raises ``ValueError`` (a bad address; a non-loopback address without keys or
    ``insecure`` -- ringwire refuses to listen there), ``FileNotFoundError`` & co.
    naming a bad key file."""
    if not 1 <= remote_ranks <= ranks:
        raise ValueError(f"remote ranks must be from 1 to {ranks}, not {remote_ranks!r}")
    if (key_secret is None) != (clients is None):
        raise ValueError("CURVE keys need both the server's secret key and the clients' directory")
    results = results_address(tcp) if results is None else results
    keys = None if key_secret is None else ringwire.ServerKeys(secret=key_secret, clients=clients)
    for url in (tcp, results):  # ringwire's checks, without binding anything yet
        ringwire.listen(url, slots=None, keys=keys, insecure=insecure).close()
    return {
        "ranks": remote_ranks, "steps": tcp, "results": results, "key_secret": key_secret,
        "clients": clients, "insecure": insecure, "join_timeout": float(join_timeout),
    }  # fmt: skip


def topology(
    directory: str,
    ranks: int,
    remote: dict[str, Any] | None = None,
    *,
    trace: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    ray: dict[str, Any] | None = None,
    **options: Any,
) -> runtime.Topology:
    """The pipeline's workers: tokenizer, scheduler and ``ranks`` ranks (their sockets
    in ``directory``).  With ``remote`` (see :class:`pipeline.app.RingwireBackend`) the
    last ``remote["ranks"]`` ranks are not started here: the scheduler also serves its
    broadcast and a results listener over TCP, and waits for those ranks to join from
    another host (:func:`remote_rank`).  ``trace``: how every worker exports its spans
    (:func:`pipeline.observe.trace_choice`; ``None``: not at all); ``metrics``:
    ``{"host": HOST, "port": PORT}`` -- each worker serves its endpoints' metrics at
    PORT + its index (tokenizer 0, scheduler 1, rank R 2 + R; PORT 0: any free port).
    ``ray``: ``{"options": RAY_OPTIONS}`` -- every rank is a Ray actor
    (:class:`ringwire.runtime.RayWorker`, :func:`ray_rank`), placed by Ray with those
    ``ray_options``; ``remote`` then only says where ranks on other hosts subscribe
    (``"transport": "tcp"`` sends every rank there, as if all were on other hosts)."""
    if not 1 <= ranks <= 8:
        raise ValueError(f"ranks must be from 1 to 8, not {ranks!r}")
    local = ranks - (int(remote["ranks"]) if remote else 0)
    if not 0 <= local < ranks and remote is not None:
        raise ValueError(f"remote ranks must be from 1 to {ranks}, not {remote['ranks']!r}")
    common = {"dir": directory, "ranks": ranks, "trace": trace}

    def serving(index: int) -> dict[str, Any]:
        if metrics is None:
            return {"metrics": None}
        port = int(metrics["port"])
        return {"metrics": {"host": metrics["host"], "port": port + index if port else 0}}

    workers = [
        runtime.Worker(
            "tokenizer", "pipeline.workers:tokenizer", options={**common, **serving(0)},
            slots=None, ready="explicit",
        ),
        runtime.Worker(
            "scheduler", "pipeline.workers:scheduler",
            options={**common, **serving(1), "remote": remote},
            slots=None, capacity=64 << 10, ready="explicit",
        ),
    ] + [
        runtime.Worker(
            f"rank-{r}", "pipeline.workers:rank",
            options={**common, **serving(2 + r), "rank": r}, slots=None,
            capacity=64 << 10, ready="explicit",
        )
        for r in range(local if ray is None else 0)
    ]  # fmt: skip
    if ray is not None:
        workers += [
            runtime.RayWorker(
                f"rank-{r}", "pipeline.workers:ray_rank", ray_options=ray.get("options"),
                options={**common, **serving(2 + r), "rank": r, "remote": remote,
                         "boot_id": _boot_id() if ray.get("transport") != "tcp" else "tcp",
                         "keys": ray.get("keys")},
                slots=None, capacity=64 << 10, ready="explicit",
            )
            for r in range(ranks)
        ]  # fmt: skip
    if remote:  # the remote ranks may take a while to be started on their host
        options.setdefault("ready_timeout", float(remote["join_timeout"]) + START_TIMEOUT)
    return runtime.Topology(workers, slots=None, **options)
