"""Entries of the Ray workers in tests/process/test_ray.py (imported inside the actors)."""

from __future__ import annotations

import os

import numpy as np

from ringwire import runtime


async def echo(ctx: runtime.WorkerContext) -> None:
    """Answer every request with itself and where it ran; arrays come back doubled."""
    async for request in ctx.channel:
        if isinstance(request, np.ndarray):
            await ctx.channel.send(request * 2)
        else:
            await ctx.channel.send(
                {"echo": request, "pid": os.getpid(), "incarnation": ctx.incarnation,
                 "path": ctx.channel.statistics().tensor_path,
                 "options": dict(ctx.options)}
            )  # fmt: skip


def not_a_coroutine() -> None:
    """Not an entry (there is no such attribute as the bad-entry test names)."""
