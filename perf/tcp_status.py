"""What the TCP status table (``python -m ringwire inspect``'s rows) costs the hot path.

Run from the repository root (pyzmq installed)::

    python -m perf.tcp_status            # ~15 s

Two measurements in one process, same conditions:

* **A/B round trips**: a 100-byte async round trip over ``tcp://127.0.0.1`` (client
  and echo server in this process), 20 rounds of 1500, alternating a transport whose
  status slot is live with one whose slot writes nowhere; medians and their ratio.
* **the hooks alone**: the store of ``tx.sent`` made per send, and ``Slot.heard`` made
  per receive that took messages in (``timeit``).

The status table is :mod:`ringwire._net.status`; the hooks are the lines of
:mod:`ringwire._net.transport` that touch ``.status``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import timeit
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio

import ringwire
import ringwire._net.transport as T
from ringwire._net.status import Slot

RECORD = {"seq": 0, "body": "x" * 80}


class _Nowhere(Slot):
    def heard(self, t: Any) -> None:
        pass

    def gone(self) -> None:
        pass

    def endpoints(self, fd: int) -> None:
        pass


def _nowhere(t: Any, sock: Any, peer_fd: Any) -> Slot:
    return _Nowhere(None)


async def _round_trips(n: int) -> float:
    async with ringwire.listen("tcp://127.0.0.1:0") as listener:
        client = await ringwire.connect(listener.path)
        server = await listener.accept()

        async def echo() -> None:
            async for r in server:
                await server.send(r)

        async with anyio.create_task_group() as tg:
            tg.start_soon(echo)
            for _ in range(50):
                await client.send(RECORD)
                await client.receive()
            t0 = time.perf_counter()
            for _ in range(n):
                await client.send(RECORD)
                await client.receive()
            dt = (time.perf_counter() - t0) / n
            await client.aclose()
            tg.cancel_scope.cancel()
    return dt


async def _hooks() -> tuple[float, float]:
    async with ringwire.listen("tcp://127.0.0.1:0") as listener:
        client = await ringwire.connect(listener.path)
        server = await listener.accept()
        t = client._core.transport
        st = t.status
        n = 200_000
        empty = timeit.timeit(lambda: None, number=n)
        store = timeit.timeit(lambda: st.cells.__setitem__(st.sent_at, 5), number=n) - empty
        heard = timeit.timeit(lambda: st.heard(t), number=n) - empty
        await client.aclose()
        await server.aclose()
    return store / n, heard / n


async def main() -> None:
    live = T.open_slot
    res: dict[str, list[float]] = {"live": [], "nowhere": []}
    try:
        for i in range(20):
            for mode in ("live", "nowhere") if i % 2 else ("nowhere", "live"):
                T.open_slot = live if mode == "live" else _nowhere  # type: ignore[assignment]
                res[mode].append(await _round_trips(1500))
    finally:
        T.open_slot = live  # type: ignore[assignment]
    store, heard = await _hooks()
    print(f"perf.tcp_status: load average {os.getloadavg()[0]:.2f}")
    for mode, values in res.items():
        print(f"  round trip, status {mode:8}: median {statistics.median(values) * 1e6:7.1f} µs")
    ratio = statistics.median(res["live"]) / statistics.median(res["nowhere"])
    print(f"  live / nowhere: {ratio:.3f}x")
    print(
        f"  per send (store of tx.sent): {store * 1e9:.0f} ns; per receive (heard): {heard * 1e9:.0f} ns"
    )


if __name__ == "__main__":
    anyio.run(main)
