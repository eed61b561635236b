"""An ASGI server (Starlette on uvicorn) that hands uploaded arrays to a worker process.

    pip install 'ringwire[examples]'
    python examples/asgi_server.py --port 8000          # or:
    uvicorn --app-dir examples asgi_server:app --port 8000

    # raw C-order bytes, dtype and shape in the query string
    python -c "import numpy as np, sys; sys.stdout.buffer.write(np.ones((512, 512), 'f4').tobytes())" |
      curl -s --data-binary @- 'http://127.0.0.1:8000/infer?dtype=float32&shape=512,512'
    # a .npy file; op=scale answers with a .npy array
    curl -s -H 'content-type: application/x-npy' --data-binary @x.npy \
      'http://127.0.0.1:8000/infer?op=scale&factor=0.5' -o y.npy

How it fits together:

* At startup (the lifespan) the app spawns one worker process connected by
  ``ringwire.pair()``, opens the async end of the connection and makes a
  ``ringwire.Client`` over it; the worker answers with ``ringwire.serve``.
* Every request is one call: ``await client.call(Request(...), timeout=30)``.  All
  concurrent HTTP requests share the ONE connection; the client matches each reply to
  its caller by the call's id.  An HTTP client that disconnects cancels its call, and
  the worker drops it (or cancels its handler); a call that takes longer than 30 s is
  cancelled the same way and answered 504.
* The worker runs ``compute`` (blocking numpy code) in worker threads, at most
  ``CONCURRENCY`` at once; beyond that (and a backlog as long) it stops reading, so
  further calls wait in their sends, here -- backpressure, not an unbounded queue.
  An exception in ``compute`` comes back as ``ringwire.RemoteError`` (answered 422).
* Arrays of at least ``SLOTS.threshold`` bytes travel through shared-memory slots, not
  through the ring.  A raw upload of known shape is streamed straight into a *loaned*
  slot (``client.channel.loan``), so the body is written once, into memory the worker then reads
  in place.  The worker's answer (``op=scale``) comes back the same way, in the
  worker's own slots; when the server drops its reference, the slot goes back.
* At shutdown the app closes the client (uvicorn has finished every request by then):
  the worker's ``serve`` returns, the worker exits, and the app joins the process.

Uploads are parsed without pickle (``allow_pickle=False``) and only plain numeric
dtypes are accepted.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import multiprocessing as mp
import os
import signal
from collections.abc import AsyncIterator
from typing import Any, Optional

import anyio
import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import ringwire

# Both directions use a pool like this one (each side owns its own send pool).
SLOTS = ringwire.SlotConfig(
    classes=(
        ringwire.SlotClass(64 << 10, 32),
        ringwire.SlotClass(1 << 20, 16),
        ringwire.SlotClass(16 << 20, 4),
    ),
    threshold=64 << 10,  # smaller arrays travel inline, in the record itself
    wait_timeout=30.0,  # all slots busy for 30 s: SlotsExhausted (answered with 503)
)
MAX_UPLOAD = 16 << 20  # the largest slot
REPLY_TIMEOUT = 30.0
CONCURRENCY = 4  # compute() calls the worker runs at once (in threads)
DTYPES = {
    name: np.dtype(name)
    for name in (
        "int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64".split()
    )
}
OPS = ("stats", "scale")
NPY = "application/x-npy"


# -- the records on the wire -----------------------------------------------------------------


class Request(ringwire.Record):
    op: str
    x: object  # a numpy array: inline, or a reference to a slot
    factor: float = 1.0


class Reply(ringwire.Record):
    shape: tuple[int, ...] = ()
    dtype: str = ""
    stats: Optional[dict[str, Optional[float]]] = None
    y: object = None  # op=scale: the result array


# -- the worker process ------------------------------------------------------------------


def compute(req: Request) -> Reply:
    """What the worker does with one request (stands in for a model).  Its exceptions
    reach the HTTP handler as ``ringwire.RemoteError``."""
    x = req.x
    if not isinstance(x, np.ndarray):
        raise TypeError(f"expected an array, got {type(x).__name__}")
    reply = Reply(shape=tuple(x.shape), dtype=x.dtype.name)
    if req.op == "stats":
        empty = x.size == 0
        reply.stats = {
            "sum": float(x.sum(dtype=np.float64)),
            "mean": None if empty else float(x.mean(dtype=np.float64)),
            "min": None if empty else float(x.min()),
            "max": None if empty else float(x.max()),
        }
    elif req.op == "scale":
        reply.y = np.multiply(x, req.factor, dtype=np.float32)
    else:
        raise ValueError(f"unknown op {req.op!r}")
    return reply  # the request (and its view of the server's slot) dies with the call


async def serve_worker(end: ringwire.PairEnd) -> None:
    async with await end.connect(slots=SLOTS) as chan:
        # returns when the server closes its client (end of stream)
        await ringwire.serve(chan, compute, type=Request, concurrency=CONCURRENCY)


def worker_main(end: ringwire.PairEnd) -> None:
    """The worker process: ``ringwire.serve`` on its own event loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when we stop
    anyio.run(serve_worker, end)


# -- the server side of the connection ---------------------------------------------------------


class Worker:
    """The worker process and the client of its connection."""

    def __init__(self, client: ringwire.Client, proc: Any) -> None:
        self.client = client
        self.proc = proc


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    ours, theirs = ringwire.pair()
    proc = mp.get_context("spawn").Process(
        target=worker_main, args=(theirs,), name="ringwire-worker", daemon=True
    )
    proc.start()
    try:
        chan = await ours.connect(slots=SLOTS)
        async with ringwire.Client(chan, type=Reply) as client:
            app.state.worker = Worker(client, proc)
            yield
        # the client closed its channel: the worker's serve() returns and it exits
        await anyio.to_thread.run_sync(proc.join, 10)
    finally:
        if proc.is_alive():
            proc.kill()
            await anyio.to_thread.run_sync(proc.join)


# -- HTTP ------------------------------------------------------------------------------------


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.split(",") if d.strip()) if text.strip() else ()
    except ValueError:
        raise BadRequest(400, f"bad shape {text!r}") from None
    if any(d < 0 for d in shape) or len(shape) > 32:
        raise BadRequest(400, f"bad shape {text!r}")
    return shape


def _dtype(name: str) -> np.dtype[Any]:
    try:
        return DTYPES[name]
    except KeyError:
        raise BadRequest(400, f"dtype must be one of {sorted(DTYPES)}, not {name!r}") from None


async def _read_body(request: HTTPRequest, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, f"the body is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _receive_raw(request: HTTPRequest, chan: ringwire.Channel) -> Any:
    """A raw upload: C-order bytes of ``dtype`` and ``shape`` from the query string."""
    dtype = _dtype(request.query_params.get("dtype", "float32"))
    shape = _shape(request.query_params.get("shape", ""))
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_UPLOAD:
        raise BadRequest(413, f"{nbytes} bytes is more than the {MAX_UPLOAD} accepted")
    if nbytes < SLOTS.threshold:  # small: it travels inline anyway
        body = await _read_body(request, nbytes)
        if len(body) != nbytes:
            raise BadRequest(400, f"expected {nbytes} bytes of body, got {len(body)}")
        return np.frombuffer(body, dtype).reshape(shape)
    # large: borrow a slot and stream the body straight into it (no other copy)
    x = await chan.loan(shape, dtype)
    flat = x.reshape(-1).view(np.uint8)
    pos = 0
    async for chunk in request.stream():
        end = pos + len(chunk)
        if end > nbytes:
            raise BadRequest(400, f"expected {nbytes} bytes of body, got more")
        flat[pos:end] = np.frombuffer(chunk, np.uint8)
        pos = end
    del flat
    if pos != nbytes:
        raise BadRequest(400, f"expected {nbytes} bytes of body, got {pos}")
    return x


async def _receive_npy(request: HTTPRequest) -> Any:
    body = await _read_body(request, MAX_UPLOAD + 4096)
    try:
        x = np.lib.format.read_array(io.BytesIO(body), allow_pickle=False)
    except Exception as exc:  # not a valid .npy file
        raise BadRequest(400, f"not a .npy array: {exc}") from None
    if not x.dtype.isnative:
        raise BadRequest(400, "only native byte order is accepted")
    _dtype(x.dtype.name)
    return x


async def call_unless_disconnected(request: HTTPRequest, client: ringwire.Client, req: Any) -> Any:
    """``client.call(req)``, cancelled if the HTTP client goes away meanwhile: the worker
    is told, and drops the call or cancels its handler.  ``None`` if it went away."""
    reply = error = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:  # the body is read: the next message is a disconnect
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            reply = await client.call(req, timeout=REPLY_TIMEOUT)
        except Exception as exc:  # raised below, not wrapped in the task group's group
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return reply


async def infer(request: HTTPRequest) -> Response:
    worker: Worker = request.app.state.worker
    try:
        op = request.query_params.get("op", "stats")
        if op not in OPS:
            raise BadRequest(400, f"op must be one of {OPS}, not {op!r}")
        try:
            factor = float(request.query_params.get("factor", "1"))
        except ValueError:
            raise BadRequest(400, "factor must be a number") from None
        if request.headers.get("content-type", "").split(";")[0].strip() == NPY:
            x = await _receive_npy(request)
        else:
            x = await _receive_raw(request, worker.client.channel)
        req = Request(op=op, x=x, factor=factor)
        del x  # the request holds the array (a loaned slot): not touched after sending
        reply = await call_unless_disconnected(request, worker.client, req)
        del req
    except BadRequest as exc:
        return JSONResponse({"error": str(exc)}, status_code=exc.status)
    except ringwire.RemoteError as exc:  # compute() raised
        return JSONResponse({"error": str(exc)}, status_code=422)
    except TimeoutError:
        return JSONResponse({"error": f"no answer within {REPLY_TIMEOUT:g} s"}, status_code=504)
    except (
        ringwire.SlotsExhausted,
        ringwire.BrokenResourceError,  # the worker died: every pending call fails at once
        ringwire.ClosedResourceError,  # shutting down
    ) as exc:
        return JSONResponse({"error": f"worker unavailable: {exc}"}, status_code=503)
    if reply is None:  # the HTTP client went away
        return Response(status_code=499)
    if op == "scale":
        out = io.BytesIO()
        np.lib.format.write_array(out, np.asarray(reply.y), allow_pickle=False)
        del reply  # the last reference to the worker's slot: it is released now
        return Response(out.getvalue(), media_type=NPY)
    return JSONResponse({"shape": list(reply.shape), "dtype": reply.dtype, **(reply.stats or {})})


async def stats(request: HTTPRequest) -> Response:
    """The connection's counters (slots in use, records, ...), and the worker's pid."""
    worker: Worker = request.app.state.worker
    s = worker.client.channel.statistics()
    return JSONResponse(
        {
            "worker_pid": worker.proc.pid,
            "server_pid": os.getpid(),
            "records_sent": s.records_sent,
            "records_received": s.records_received,
            "slots_in_use": s.slots_in_use,  # our slots the worker still holds
            "slot_arrays_held": s.slot_arrays_held,  # worker slots we still hold
            "inline_fallbacks": s.inline_fallbacks,
            "pending_requests": worker.client.pending,
        }
    )


def create_app() -> Starlette:
    return Starlette(
        routes=[Route("/infer", infer, methods=["POST"]), Route("/stats", stats)],
        lifespan=lifespan,
    )


app = create_app()


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
