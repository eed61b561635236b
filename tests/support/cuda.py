"""Helpers of both halves of the CUDA tests (tests/unit/test_cuda.py and
tests/process/test_cuda.py): a slot configuration with CUDA pools, the simulated backend
as a fixture (``fake``: import it), and small waits."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from ringwire._pool.cuda import (
    drop_idle_pools,
    lingering_pools,
    set_cuda_backend,
)
from ringwire._pool.slotconfig import SlotConfig
from ringwire._wire.slotlayout import SlotClass
from support.cuda_fake import FakeCudaBackend, install

KiB, MiB = 1 << 10, 1 << 20
GPU = SlotConfig(
    classes=(SlotClass(64 * KiB, 4),),
    threshold=1024,
    cuda_threshold=1024,
    cuda_classes=(SlotClass(64 * KiB, 2), SlotClass(1 * MiB, 1)),
)


@pytest.fixture(name="fake")
def fake_fixture() -> Iterator[FakeCudaBackend]:
    """The simulated backend, installed for one test.  Afterwards every GPU block of
    the test must be settled (nothing lingering for a consumer) and then freed."""
    backend = install()
    try:
        yield backend
    finally:
        gc.collect()
        drop_idle_pools()
        left = lingering_pools()
        set_cuda_backend(None)
        gc.collect()
        assert left == 0, f"{left} GPU block(s) still wait for a consumer after the test"


def cuda_in_use(ch: Any) -> int:
    return int(ch.statistics().cuda_slots_in_use)  # statistics() is a safe point


async def until(pred: Any, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not pred():
            await anyio.sleep(0.002)
