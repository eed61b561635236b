"""Child processes for the tests in tests/process/: ``spawned(target, *args)`` starts
``target`` in a fresh interpreter (the spawn context, or ``ctx=``) and always reaps it."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

SPAWN = mp.get_context("spawn")


@contextlib.contextmanager
def spawned(target: Any, *args: Any, ctx: Any = SPAWN) -> Iterator[Any]:
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    try:
        yield p
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
