"""A send waiting for a slot is bounded by default and says who holds the pool."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

import ringwire
from ringwire import SlotClass, SlotConfig, SlotsExhausted


def test_the_default_wait_is_finite() -> None:
    assert SlotConfig().wait_timeout == 30.0
    assert ringwire.DEFAULT_SLOTS.wait_timeout == 30.0


def test_a_slow_slot_wait_warns_once_naming_the_pool_then_gives_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="ringwire")
    config = SlotConfig(classes=(SlotClass(1 << 20, 2),), threshold=1024, wait_timeout=1.6)
    a, b = ringwire.pair()
    out: dict[str, ringwire.SyncChannel] = {}
    t = threading.Thread(target=lambda: out.setdefault("b", b.connect_sync(slots=config)))
    t.start()
    ca = a.connect_sync(slots=config)
    t.join()
    cb = out["b"]
    try:
        kept = []
        for i in range(2):  # the receiver keeps every array: both slots stay held
            ca.send(np.full(1 << 17, i, dtype=np.float64))
            kept.append(cb.receive(timeout=5))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="within 1.6 s") as ei:  # the blocking form
            ca.send(np.zeros(1 << 17, dtype=np.float64))
        assert isinstance(ei.value, SlotsExhausted)
        assert 1.5 < time.monotonic() - t0 < 5
        warnings = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
        assert len(warnings) == 1, warnings
        text = warnings[0]
        assert "2 x 1 MiB" in text and "2 slot(s) held by the peer" in text, text
        assert "gives up after 1.6 s" in text
        del kept
    finally:
        ca.close()
        cb.close()
