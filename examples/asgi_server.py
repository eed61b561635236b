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
  ``ringwire.pair()`` and opens the async end of the connection.
* Every request sends one ``Request`` record -- the array plus a request id -- and awaits
  the ``Reply`` with the same id.  All concurrent HTTP requests share the ONE connection:
  a single background task receives every reply and resolves the waiting request's
  future (:class:`WorkerClient`).
* Arrays of at least ``SLOTS.threshold`` bytes travel through shared-memory slots, not
  through the ring.  A raw upload of known shape is streamed straight into a *loaned*
  slot (``chan.loan``), so the body is written once, into memory the worker then reads
  in place.  The worker's answer (``op=scale``) comes back the same way, in the
  worker's own slots; when the server drops its reference, the slot goes back.
* At shutdown the app sends end-of-stream: the worker finishes what it has, closes,
  and exits; the app closes its end and joins the process.

Uploads are parsed without pickle (``allow_pickle=False``) and only plain numeric
dtypes are accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import math
import multiprocessing as mp
import os
import signal
from collections.abc import AsyncIterator
from typing import Any, Optional

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
    id: int
    op: str
    x: object  # a numpy array: inline, or a reference to a slot
    factor: float = 1.0


class Reply(ringwire.Record):
    id: int
    error: Optional[str] = None
    shape: tuple[int, ...] = ()
    dtype: str = ""
    stats: Optional[dict[str, Optional[float]]] = None
    y: object = None  # op=scale: the result array


# -- the worker process ------------------------------------------------------------------


def compute(req: Request) -> Reply:
    """What the worker does with one request (stands in for a model)."""
    x = req.x
    if not isinstance(x, np.ndarray):
        return Reply(id=req.id, error=f"expected an array, got {type(x).__name__}")
    reply = Reply(id=req.id, shape=tuple(x.shape), dtype=x.dtype.name)
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
        reply.error = f"unknown op {req.op!r}"
    return reply


def worker_main(end: ringwire.PairEnd) -> None:
    """The worker: a plain blocking loop over the blocking endpoint."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when we stop
    with end.connect_sync(type=Request, slots=SLOTS) as chan:
        for req in chan:  # ends when the server sends end-of-stream
            reply = compute(req)
            del req  # drop our view of the slot: it goes back to the server's pool
            chan.send(reply)
            del reply


# -- the server side of the connection ---------------------------------------------------------


class WorkerUnavailable(Exception):
    pass


class WorkerClient:
    """Many concurrent requests over one connection: send with an id, await that id."""

    def __init__(self, chan: ringwire.Channel, proc: Any) -> None:
        self.chan = chan
        self.proc = proc
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._failure: BaseException | None = None
        self._receiver = asyncio.create_task(self._receive_replies())

    @property
    def pending(self) -> int:
        """Requests sent and not answered yet."""
        return len(self._pending)

    async def _receive_replies(self) -> None:
        """The one task that receives: hand each reply to whoever waits for its id."""
        try:
            async for reply in self.chan:
                fut = self._pending.pop(reply.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(reply)
                # else: that request gave up; dropping the reply releases its slots
                del reply, fut
            self._failure = WorkerUnavailable("the worker closed the connection")
        except (ringwire.BrokenResourceError, ringwire.ClosedResourceError) as exc:
            self._failure = WorkerUnavailable(f"the worker is gone ({type(exc).__name__})")
        finally:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(self._failure or WorkerUnavailable("shutting down"))
            self._pending.clear()

    async def call(self, op: str, x: Any, factor: float = 1.0) -> Reply:
        if self._failure is not None:
            raise self._failure
        rid = next(self._ids)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await self.chan.send(Request(id=rid, op=op, x=x, factor=factor))
            return await asyncio.wait_for(fut, REPLY_TIMEOUT)
        finally:
            self._pending.pop(rid, None)

    async def aclose(self) -> None:
        """Graceful: the worker gets everything sent so far, then end-of-stream."""
        try:
            await self.chan.send_eof()
            await asyncio.wait_for(asyncio.shield(self._receiver), 10)
        except Exception:
            pass  # broken already, or the worker did not finish in time
        finally:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
            await self.chan.aclose()
            await asyncio.to_thread(self.proc.join, 10)
            if self.proc.is_alive():
                self.proc.kill()
                await asyncio.to_thread(self.proc.join)


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    ours, theirs = ringwire.pair()
    proc = mp.get_context("spawn").Process(
        target=worker_main, args=(theirs,), name="ringwire-worker", daemon=True
    )
    proc.start()
    try:
        chan = await ours.connect(type=Reply, slots=SLOTS)
    except BaseException:
        proc.kill()
        proc.join()
        raise
    app.state.worker = WorkerClient(chan, proc)
    try:
        yield
    finally:
        await app.state.worker.aclose()


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


async def infer(request: HTTPRequest) -> Response:
    worker: WorkerClient = request.app.state.worker
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
            x = await _receive_raw(request, worker.chan)
        reply = await worker.call(op, x, factor)  # x is not touched after this
    except BadRequest as exc:
        return JSONResponse({"error": str(exc)}, status_code=exc.status)
    except (
        WorkerUnavailable,
        ringwire.SlotsExhausted,
        ringwire.BrokenResourceError,  # the worker died (seen by a send or a loan)
        asyncio.TimeoutError,
    ) as exc:
        return JSONResponse({"error": f"worker unavailable: {exc}"}, status_code=503)
    if reply.error is not None:
        return JSONResponse({"error": reply.error}, status_code=422)
    if op == "scale":
        out = io.BytesIO()
        np.lib.format.write_array(out, np.asarray(reply.y), allow_pickle=False)
        del reply  # the last reference to the worker's slot: it is released now
        return Response(out.getvalue(), media_type=NPY)
    return JSONResponse({"shape": list(reply.shape), "dtype": reply.dtype, **(reply.stats or {})})


async def stats(request: HTTPRequest) -> Response:
    """The connection's counters (slots in use, records, ...), and the worker's pid."""
    worker: WorkerClient = request.app.state.worker
    s = worker.chan.statistics()
    return JSONResponse(
        {
            "worker_pid": worker.proc.pid,
            "server_pid": os.getpid(),
            "records_sent": s.records_sent,
            "records_received": s.records_received,
            "slots_in_use": s.slots_in_use,  # our slots the worker still holds
            "slot_arrays_held": s.slot_arrays_held,  # worker slots we still hold
            "inline_fallbacks": s.inline_fallbacks,
            "pending_requests": worker.pending,
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
