"""Connected pairs with tensor-slot pools, in one process (the other end on a task or a
thread): for tests/unit/test_slots.py and tests/unit/test_cuda.py."""

from __future__ import annotations

import threading
from typing import Any

import anyio

from ringwire._conn.async_channel import Channel
from ringwire._conn.pair import pair
from ringwire._conn.sync_channel import SyncChannel
from ringwire._pool.slotconfig import SlotConfig
from ringwire._wire.slotlayout import SlotClass

KiB, MiB = 1 << 10, 1 << 20
POOL = SlotConfig(classes=(SlotClass(64 * KiB, 4), SlotClass(1 * MiB, 2)), threshold=1024)


async def apair(
    a_slots: SlotConfig | None = POOL,
    b_slots: SlotConfig | None = POOL,
    *,
    b_copy_out: bool = False,
    **kw: Any,
) -> tuple[Channel, Channel]:
    """``b_copy_out``: the second end copies what it receives (``copy_out=True``)."""
    a, b = pair(**{k: v for k, v in kw.items() if k == "capacity"})
    opts = {k: v for k, v in kw.items() if k != "capacity"}
    out: dict[str, Channel] = {}

    async def conn_b() -> None:
        out["b"] = await b.connect(slots=b_slots, copy_out=b_copy_out, **opts)

    async with anyio.create_task_group() as tg:
        tg.start_soon(conn_b)
        out["a"] = await a.connect(slots=a_slots, **opts)
    return out["a"], out["b"]


def spair(
    a_slots: SlotConfig | None = POOL, b_slots: SlotConfig | None = POOL, **kw: Any
) -> tuple[SyncChannel, SyncChannel]:
    a, b = pair()
    out: list[SyncChannel] = []
    t = threading.Thread(target=lambda: out.append(b.connect_sync(slots=b_slots, **kw)))
    t.start()
    ca = a.connect_sync(slots=a_slots, **kw)
    t.join()
    return ca, out[0]
