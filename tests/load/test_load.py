"""Load: many producer processes into one consumer, every record checked, memory flat.

Eight producers (``tests/chaos/workers.py``, role ``load_producer``, blocking API) send
sequence-numbered, checksummed records to one listener's fair fan-in in this process:
small records (in batches through ``send_many``), numpy arrays inline and through
tensor slots (half of the slot arrays loaned: filled in place), and, from one producer,
torch tensors.  The consumer checks every record (its producer's sequence, gap-free and
in order; payload and array checksums; the payload its producer would have made), holds
the last few hundred (re-checked when let go, so a slot reused too early shows), and
samples its RSS; each producer samples its own.  At the end every producer's slots have
come back by releases (none reclaimed), and RSS grew by less than ``RSS_SLACK`` between
the first sample and the last.

CI mode: 8 x 25 000 records.  ``pytest --long``: 8 x 1 000 000 (``RINGWIRE_LOAD_COUNT``
overrides either).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import deque
from pathlib import Path
from typing import Any

import anyio
import pytest
from chaos.workers import Child, check_record, recheck, rss

import ringwire

pytestmark = [pytest.mark.multiprocess]

PRODUCERS = 8
CI_COUNT = 25_000
LONG_COUNT = 1_000_000
HOLD = 256  # records without slot arrays the consumer keeps alive at a time...
HOLD_SLOTS = 3  # ...and records with slot arrays, per producer: fewer than the smallest
# slot class has slots (4), so a producer waiting for a slot always gets one back --
# holding a whole pool while waiting for more would deadlock any transport
MiB = 1 << 20
RSS_SLACK = 16 * MiB  # allowed growth from the first sample (after warm-up) to the last


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:  # pragma: no cover
        return False
    return True


async def consume(path: str, count: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    use_torch = torch_available()
    salts = [rng.randrange(1, 1 << 30) for _ in range(PRODUCERS)]
    children: list[Child] = []
    expected: dict[int, int] = {}  # producer pid -> next sequence number
    salt_of: dict[int, int] = {}
    ends: dict[int, list[Any]] = {}
    done: dict[int, dict[str, Any]] = {}
    my_rss: list[tuple[int, int]] = []
    total = 0
    every = max(1, PRODUCERS * count // 20)
    held: deque[Any] = deque()
    held_slots: dict[int, deque[Any]] = {}
    t0 = time.perf_counter()
    async with ringwire.listen(path, slots=None, spin_us=50) as lst:
        try:
            for _ in range(PRODUCERS):
                children.append(Child())
            for k, child in enumerate(children):
                cfg = {
                    "role": "load_producer",
                    "path": path,
                    "salt": salts[k],
                    "count": count,
                    "batch": rng.choice([1, 16, 64]),
                    "torch": use_torch and k == 0,
                    "capacity": rng.choice([1 << 16, 1 << 20]),
                }
                await anyio.to_thread.run_sync(child.begin, cfg)
                expected[child.pid] = 0
                salt_of[child.pid] = salts[k]
                held_slots[child.pid] = deque()
            with anyio.fail_after(120 + count * PRODUCERS / 5000):
                while len(ends) < PRODUCERS:
                    conn, rec = await lst.receive()
                    pid = conn.peer_pid
                    if rec[0] == "end":
                        assert rec[1] == salt_of[pid] and rec[2] == expected[pid] == count, rec
                        ends[pid] = rec
                        mine = held_slots[pid]
                        while mine:  # let go of this producer's slots
                            err = recheck(mine.popleft())
                            assert err is None, err
                        del rec
                        await conn.send("bye")
                        continue
                    err = check_record(rec, expected[pid], salt_of[pid])
                    assert err is None, f"producer {pid}: {err}"
                    expected[pid] += 1
                    total += 1
                    arr = rec[3]
                    slot = arr is not None and arr.nbytes >= 1024
                    window = held_slots[pid] if slot else held
                    window.append(rec)
                    del rec, arr
                    if len(window) > (HOLD_SLOTS if slot else HOLD):
                        err = recheck(window.popleft())
                        assert err is None, err
                    if total % every == 0:
                        my_rss.append((total, rss()))
            elapsed = time.perf_counter() - t0
            for child in children:
                line = await anyio.to_thread.run_sync(child.until, "done")
                done[child.pid] = json.loads(line.split(" ", 1)[1])
                assert await anyio.to_thread.run_sync(child.finish) == 0, child.log
        finally:
            held.clear()  # (closing with received slot arrays alive would warn)
            held_slots.clear()
            for child in children:
                if child.proc.poll() is None:
                    child.proc.kill()
                await anyio.to_thread.run_sync(child.finish)
    return {
        "total": total,
        "elapsed": elapsed,
        "expected": expected,
        "ends": ends,
        "done": done,
        "rss": my_rss,
        "torch": use_torch,
    }


def run_load(tmp_path: Path, count: int) -> None:
    env = os.environ.get("RINGWIRE_LOAD_COUNT")
    if env:
        count = int(env)
    seed = random.SystemRandom().randrange(1 << 32)
    print(f"load: {PRODUCERS} producers x {count} records, seed {seed}")
    out = anyio.run(consume, str(tmp_path / "load.sock"), count, seed)
    total = out["total"]
    assert total == PRODUCERS * count
    assert all(n == count for n in out["expected"].values()), out["expected"]
    for d in out["done"].values():
        assert d["n"] == count, d
        # every slot came back by a release while the connection was up
        assert d["slots_in_use"] == 0 and d["loans_outstanding"] == 0, d
        assert d["releases"] == d["slot_arrays"] and d["reclaimed"] == 0, d
    mine = out["rss"]
    my_growth = mine[-1][1] - mine[1][1]  # from 10% of the records to the end
    theirs = {
        pid: (end[3][-1][1] - end[3][0][1]) for pid, end in out["ends"].items()
    }  # from 10% of their records to the end
    rate = total / out["elapsed"]
    print(
        f"load: {total} records checked in {out['elapsed']:.1f} s ({rate:,.0f}/s), "
        f"torch producer: {out['torch']}; consumer RSS {mine[1][1] / MiB:.1f} -> "
        f"{mine[-1][1] / MiB:.1f} MiB ({my_growth / MiB:+.1f}); producers' RSS growth "
        f"max {max(theirs.values()) / MiB:+.1f} MiB"
    )
    assert my_growth < RSS_SLACK, f"consumer RSS grew {my_growth / MiB:.1f} MiB: {mine}"
    for pid, growth in theirs.items():
        assert growth < RSS_SLACK, f"producer {pid} RSS grew {growth / MiB:.1f} MiB"


@pytest.mark.timeout(300)
def test_load_8_producers_one_consumer(tmp_path: Path) -> None:
    run_load(tmp_path, CI_COUNT)


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)
def test_load_8_producers_one_consumer_1m_each(tmp_path: Path) -> None:
    run_load(tmp_path, LONG_COUNT)
