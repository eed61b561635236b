"""Worker entry points for tests/process/test_runtime.py (imported by spawned worker
processes as ``support.runtime_workers``)."""

from __future__ import annotations

import os
import signal
import time

import anyio

from ringwire import runtime


async def echo(ctx: runtime.WorkerContext) -> None:
    """Answer every request with ``{"echo": request, "pid": ..., "incarnation": ...}``."""
    async for request in ctx.channel:
        if isinstance(request, dict) and request.get("sleep"):
            await anyio.sleep(request["sleep"])
        if isinstance(request, dict) and request.get("exit") is not None:
            os._exit(request["exit"])
        if isinstance(request, dict) and request.get("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        await ctx.channel.send(
            {"echo": request, "pid": os.getpid(), "incarnation": ctx.incarnation, "name": ctx.name}
        )


async def exit_at_once(ctx: runtime.WorkerContext) -> None:
    """Ready, then exit with the status in ``options["code"]``."""
    await anyio.sleep(ctx.options.get("delay", 0.0))
    os._exit(ctx.options.get("code", 3))


async def never_ready(ctx: runtime.WorkerContext) -> None:
    """Declared with ready="explicit" and never calls ctx.ready()."""
    await anyio.sleep_forever()


async def raises(ctx: runtime.WorkerContext) -> None:
    raise RuntimeError("boom from the worker")


async def stubborn(ctx: runtime.WorkerContext) -> None:
    """Ignores stop requests and end of stream (must be cancelled)."""
    try:
        async for _ in ctx.channel:
            pass
    except Exception:
        pass
    await anyio.sleep_forever()


async def unkillable(ctx: runtime.WorkerContext) -> None:
    """Shields itself from cancellation: only SIGKILL ends it."""
    with anyio.CancelScope(shield=True):
        await anyio.sleep(3600)


async def ready_late(ctx: runtime.WorkerContext) -> None:
    """Declared with ready="explicit": blocks for ``options["delay"]`` seconds (a
    synchronous model load, say), then calls ctx.ready()."""
    time.sleep(ctx.options.get("delay", 1.0))
    ctx.ready()
    await anyio.sleep_forever()
