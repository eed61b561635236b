"""The HTTP front end (Starlette on uvicorn) of the pipeline, and its ringwire backend.

``make_app(backend)`` is the same front end for every transport: ``POST /generate``
parses the JSON body (:func:`pipeline.stages.parse_request`), hands the request to
``backend.generate`` and answers the reply as JSON; an HTTP client that disconnects
cancels its call.  :class:`RingwireBackend` runs the pipeline's workers as a
``ringwire.runtime`` topology and calls the tokenizer through a ``ringwire.Client`` on
the topology's channel to it; ``perf/pipeline.py`` plugs ZeroMQ backends into the same
app.

Answers: 200 the reply; 400 a bad body; 502 the pipeline raised (``RemoteError``); 503
the pipeline is down (a worker died: the topology stopped) or out of slots; 504 no
answer within ``REPLY_TIMEOUT``.

Observability (:mod:`pipeline.observe`): when this process traces, every request is a
span (``POST /generate``, continuing a ``traceparent`` header) whose trace the calls
carry through every worker, and the answer names it in a ``traceresponse`` header.
``GET /metrics`` is the Prometheus text of this process's ringwire endpoints (and of
its requests, ``pipeline_http_requests_total``); 501 without ``prometheus_client``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import anyio
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

import ringwire

from . import observe, stages, workers
from .records import GenerateRequest, Reply

__all__ = ["REPLY_TIMEOUT", "Backend", "RingwireBackend", "make_app", "serve_http"]

REPLY_TIMEOUT = 30.0


class Backend(Protocol):
    """What the front end needs of a pipeline."""

    name: str

    def running(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Start the workers; stop them and clean up on exit."""
        ...

    async def generate(self, req: GenerateRequest, timeout: float) -> Reply:
        """One request through the pipeline.  Raises ``TimeoutError``,
        ``ringwire.RemoteError`` (the pipeline raised), ``anyio.BrokenResourceError`` /
        ``ClosedResourceError`` (the pipeline is down)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Its state, for ``GET /health``."""
        ...


class RingwireBackend:
    """The pipeline over ringwire: a ``ringwire.runtime`` topology (tokenizer,
    scheduler, ``ranks`` ranks) and a ``ringwire.Client`` to the tokenizer.

    ``remote``: the scheduler's remote ranks (:func:`pipeline.workers.remote_config`,
    checked there): the last ``remote["ranks"]`` ranks are not started here but join
    over TCP from another host (:func:`pipeline.workers.remote_rank`).  ``trace``: how
    the workers export spans (:func:`pipeline.observe.trace_choice`; ``None``: they do
    not); ``metrics``: ``{"host", "port"}`` where the workers serve their own metrics
    (:func:`pipeline.workers.topology`; ``None``: they do not)."""

    name = "ringwire"

    def __init__(
        self,
        ranks: int = 2,
        *,
        drain_timeout: float = 10.0,
        remote: dict[str, Any] | None = None,
        trace: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
        ray: dict[str, Any] | None = None,
    ) -> None:
        if not 1 <= ranks <= 8:
            raise ValueError(f"ranks must be from 1 to 8, not {ranks!r}")
        self.ranks = ranks
        self.remote = remote
        self.trace = trace
        self.metrics = metrics
        self.ray = ray  # {"options": ray_options}: the ranks are Ray actors
        self._dir: str | None = None
        self._drain_timeout = drain_timeout
        self.topology: Any = None
        self._client: ringwire.Client | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        # the workers' sockets live in a private directory, removed at the end
        with tempfile.TemporaryDirectory(prefix="rw-pipeline-") as d:
            topo = workers.topology(
                d, self.ranks, self.remote, trace=self.trace, metrics=self.metrics,
                drain_timeout=self._drain_timeout, ray=self.ray,
            )  # fmt: skip
            async with topo:
                self.topology, self._dir = topo, d
                async with ringwire.Client(topo.channel("tokenizer"), type=Reply) as c:
                    self._client = c
                    try:
                        yield
                    finally:
                        self._client, self._dir = None, None
                # the client is closed: the tokenizer's serve() has returned; leaving the
                # topology's block drains and stops every worker

    async def generate(self, req: GenerateRequest, timeout: float) -> Reply:
        client = self._client
        if client is None:
            raise anyio.ClosedResourceError("the pipeline is not running")
        return await client.call(req, timeout=timeout)  # type: ignore[no-any-return]

    def describe(self) -> dict[str, Any]:
        topo = self.topology
        status = {} if topo is None else {n: s.state for n, s in topo.status().items()}
        return {
            "backend": self.name,
            "ranks": self.ranks,
            "remote_ranks": 0 if self.remote is None else self.remote["ranks"],
            "state": None if topo is None else topo.state,
            "stop_reason": None if topo is None else topo.stop_reason,
            "workers": status,
            "pending": None if self._client is None else self._client.pending,
            "metrics": {}
            if self._dir is None
            else observe.worker_metrics_urls(self._dir, list(status)),
        }


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _unless_disconnected(request: HTTPRequest, backend: Backend, req: GenerateRequest) -> Any:
    """``backend.generate(req)``, cancelled if the HTTP client goes away (the pipeline
    is told and drops the call); ``None`` then."""
    reply = error = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:  # the body is read: the next message is a disconnect
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            reply = await backend.generate(req, REPLY_TIMEOUT)
        except Exception as exc:  # raised below, not wrapped in the task group's group
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return reply


def make_app(backend: Backend, on_ready: Callable[[], None] | None = None) -> Starlette:
    """The front end over ``backend`` (started and stopped by the app's lifespan;
    ``on_ready`` is called once it is up)."""
    ids = itertools.count(1)
    prefix = f"{os.getpid():x}-"
    registry = observe.metrics_registry()  # None: prometheus_client is not installed
    answered = None
    if registry is not None:
        import prometheus_client

        answered = prometheus_client.Counter(
            "pipeline_http_requests", "HTTP requests to /generate answered, by status.",
            ["status"], registry=registry,
        )  # fmt: skip

    async def generate(request: HTTPRequest) -> JSONResponse:
        with observe.request_span("POST", "/generate", request.headers) as span:
            response = await _generate(request)
            if span is not None:
                span.set_attribute("http.response.status_code", response.status_code)
                if response.status_code >= 500:
                    from opentelemetry.trace import Status, StatusCode

                    span.set_status(Status(StatusCode.ERROR, response.body.decode()))
                response.headers["traceresponse"] = observe.traceresponse(span)
        if answered is not None:
            answered.labels(str(response.status_code)).inc()
        return response

    async def _generate(request: HTTPRequest) -> JSONResponse:
        try:
            body = json.loads(await request.body())
            req = stages.parse_request(body, prefix + str(next(ids)))
        except ValueError as exc:  # json.JSONDecodeError is one
            return _error(400, str(exc))
        try:
            reply = await _unless_disconnected(request, backend, req)
        except TimeoutError:
            return _error(504, f"no answer within {REPLY_TIMEOUT:g} s")
        except ringwire.RemoteError as exc:
            return _error(502, f"the pipeline failed: {exc}")
        except (
            anyio.BrokenResourceError,
            anyio.ClosedResourceError,
            ringwire.SlotsExhausted,
        ) as exc:
            return _error(503, f"the pipeline is down: {exc or type(exc).__name__}")
        if reply is None:  # the client went away
            return _error(499, "client disconnected")
        return JSONResponse(
            {
                "rid": reply.rid,
                "output_ids": reply.output_ids,
                "feature_sum": reply.feature_sum,
                "image_tokens": reply.image_tokens,
                "ranks": reply.ranks,
                "step": reply.step,
                "batch": reply.batch,
            }
        )

    async def health(request: HTTPRequest) -> JSONResponse:
        return JSONResponse({"pid": os.getpid(), **backend.describe()})

    async def metrics(request: HTTPRequest) -> Response:
        if registry is None:
            return PlainTextResponse(
                "prometheus_client is not installed: pip install 'ringwire[observe]'\n",
                status_code=501,
            )
        import prometheus_client

        # collected on a worker thread: the event loop keeps serving meanwhile
        body = await anyio.to_thread.run_sync(prometheus_client.generate_latest, registry)
        return Response(body, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        with observe.ringwire_metrics(registry):
            async with backend.running():
                if on_ready is not None:
                    on_ready()
                yield

    return Starlette(
        routes=[
            Route("/generate", generate, methods=["POST"]),
            Route("/health", health),
            Route("/metrics", metrics),
        ],
        lifespan=lifespan,
    )


def serve_http(app: Starlette, sock: socket.socket, *, log_level: str = "warning") -> None:
    """Run ``app`` on uvicorn on the bound socket ``sock`` (an ephemeral port: no race
    for a free one); returns when uvicorn stops (SIGINT / SIGTERM)."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=False)
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
