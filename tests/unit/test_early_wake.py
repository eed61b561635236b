"""Early wake-up of a parked reader before a large copy-in ends (ringwire._shm.early_wake)
and the reader's spin on the copy hint (ringwire._conn.waits)."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest
from support.slots import apair, spair

from ringwire._conn import waits
from ringwire._pool.slotconfig import SlotConfig
from ringwire._shm.early_wake import LARGE_COPY, MAX_SPIN_NS, WAKE_BYTES, copy_bytes
from ringwire._wire.ring import COPY_HINT
from ringwire._wire.slotlayout import SlotClass

MiB = 1 << 20
BIG = SlotConfig(classes=(SlotClass(4 * MiB, 2),), threshold=1024)


@pytest.fixture(params=[pytest.param("asyncio", id="asyncio"), pytest.param("trio", id="trio")])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


def test_copy_bytes_in_two_parts_is_one_copy():
    src = np.arange(LARGE_COPY + 12345, dtype=np.uint8)
    dst = np.zeros_like(src)
    told: list[int] = []

    def wake(left: int) -> None:  # runs between the parts: the head is in, the tail not
        told.append(left)
        assert np.array_equal(dst[: len(src) - WAKE_BYTES], src[: len(src) - WAKE_BYTES])
        assert not dst[len(src) - WAKE_BYTES + 1 :].any()

    copy_bytes(src, dst, len(src), wake)
    assert told == [WAKE_BYTES] and np.array_equal(dst, src)
    small = np.arange(1000, dtype=np.uint8)
    out = np.zeros_like(small)
    copy_bytes(small, out, len(small), wake)  # below LARGE_COPY: one part, no wake
    assert told == [WAKE_BYTES] and np.array_equal(out, small)


def _parked(ch: Any, timeout: float = 5.0) -> None:
    """Wait until ``ch``'s receive has parked (its parked flag is in the ring)."""
    core = ch._core
    end = time.monotonic() + timeout
    while not core.rx_parked:
        assert time.monotonic() < end, "the receiver never parked"
        time.sleep(0.001)


def test_a_parked_reader_is_rung_before_a_large_copy_in_ends():
    a, b = spair(BIG, BIG, spin_us=0)
    with a, b:
        wake = a._core.pool.early_wake
        got: list[Any] = []
        th = threading.Thread(target=lambda: got.append(b.receive(timeout=10)))
        th.start()
        _parked(b)
        x = np.arange(3 * MiB // 4, dtype=np.float32)  # 3 MiB: copied in two parts
        a.send(x)
        th.join()
        # the early doorbell (whether the publish rings again depends on how long the
        # rest of the copy took: a reader whose spin on the hint ran out parked again)
        assert wake.woken == 1
        assert np.array_equal(got[0], x)
        # the hint was set for the rest of the copy, and is over by now
        until = a._core.tx.header[COPY_HINT]
        assert 0 < until <= time.monotonic_ns() + MAX_SPIN_NS
        # a record below LARGE_COPY rings at its publish only
        th = threading.Thread(target=lambda: got.append(b.receive(timeout=10)))
        th.start()
        _parked(b)
        a.send(np.ones(1000, np.float32))
        th.join()
        assert wake.woken == 1 and got[-1].shape == (1000,)
        got.clear()


def test_the_reader_spins_while_the_hint_lasts_and_not_after():
    a, b = spair(BIG, BIG, spin_us=0)
    with a, b:
        core = b._core
        assert not waits._copy_spin(core)  # no hint: no spin
        hint = a._core.tx.header
        hint[COPY_HINT] = time.monotonic_ns() - 1  # a stale hint: no spin
        assert not waits._copy_spin(core)
        hint[COPY_HINT] = time.monotonic_ns() + 20_000_000  # past MAX_SPIN_NS
        t0 = time.monotonic_ns()
        assert not waits._copy_spin(core)  # nothing came: gives up at MAX_SPIN_NS
        spun = time.monotonic_ns() - t0
        assert MAX_SPIN_NS <= spun < 20_000_000
        # a record that lands while it spins ends the spin (a thread sends it: the
        # spin yields the GIL; tried a few times, a loaded machine may be slower
        # than MAX_SPIN_NS to run the sender)
        landed = False
        for _ in range(5):
            go = threading.Event()
            sender = threading.Thread(target=lambda go=go: (go.wait(5), a.send("x")))
            sender.start()
            hint[COPY_HINT] = time.monotonic_ns() + MAX_SPIN_NS
            go.set()
            landed = waits._copy_spin(core)
            sender.join()
            assert b.receive(timeout=5) == "x"
            if landed:
                break
        assert landed
        hint[COPY_HINT] = 0


@pytest.mark.anyio
async def test_async_reader_parked_on_a_large_copy_in(anyio_backend: str):
    a, b = await apair(BIG, BIG, spin_us=0)
    async with a, b:
        got: list[Any] = []

        async def take() -> None:
            got.append(await b.receive())

        x = np.arange(3 * MiB // 4, dtype=np.float32)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(take)
                while not b._core.rx_parked:
                    await anyio.sleep(0.001)
                await a.send(x)
        assert a._core.pool.early_wake.woken == 1
        assert np.array_equal(got[0], x)
        got.clear()
