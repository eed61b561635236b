"""The demo's worker: answers the front's requests (runs in a spawned process).

Requests are plain dicts (see :mod:`ringwire.demo._app`); the arrays in them arrive as
read-only views of the front's slots, so reading them copies nothing.  Dropping a
request releases its slots: a finalizer acknowledges consumption to the front.

torch is imported only when the front sends torch tensors (``options["torch"]``); a
numpy array where a tensor would be gets a numpy preview, so the worker needs nothing
but numpy without torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import ringwire
from ringwire import runtime


def _mean(x: Any) -> float:
    if isinstance(x, np.ndarray):
        return float(x.mean(dtype=np.float64))
    return float(x.float().mean())


async def _answer(
    chan: ringwire.Channel, req: dict[str, Any], n: int, every: int
) -> dict[str, Any]:
    reply: dict[str, Any] = {"id": req["id"], "kind": req["kind"]}
    if "text" in req:
        reply["text"] = req["text"].upper()
        reply["tiny"] = float(req["tiny"].sum())
    if "image" in req:
        reply["image_mean"] = _mean(req["image"])
    if "tensor" in req:
        t = req["tensor"]
        reply["tensor_mean"] = _mean(t)
        if every and n % every == 0:
            # a reply tensor loaned from *our* pool: filled in place, sent by reference
            c, h, w = t.shape
            small = t[:, ::4, ::4]
            preview = await chan.loan((c, h // 4, w // 4), t.dtype)
            if isinstance(preview, np.ndarray):
                np.copyto(preview, small)
            else:
                preview.copy_(small)
            reply["preview"] = preview
    return reply  # the request's arrays die with this frame


async def serve(ctx: runtime.WorkerContext) -> None:
    """Answer requests until the front ends the stream (a graceful stop drains here)."""
    if ctx.options.get("torch", True):
        try:
            import torch  # requests carry tensors: import torch before reporting ready
        except ImportError:  # the front then finds it missing too, and sends numpy
            pass
        else:
            torch.set_num_threads(1)  # the workers and the front share the machine's cores
    ctx.ready()
    chan = ctx.channel
    every = int(ctx.options.get("preview_every", 2))
    n = 0
    async for req in chan:
        n += 1
        reply = await _answer(chan, req, n, every)
        del req  # the last reference: the request's slots go back to the front now
        await chan.send(reply)
