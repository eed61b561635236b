"""Once the peer process is gone, nothing can read the slots it held: a producer's pool
counts them free at once, even a producer that is not doing anything."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from support.spawn import spawned

import ringwire

pytestmark = pytest.mark.multiprocess


def consumer_keeps_arrays_then_closes(end: ringwire.PairEnd, n: int, fail: bool) -> None:
    chan = end.connect_sync(handshake_timeout=30)
    kept = [chan.receive(timeout=30) for _ in range(n)]  # alive views: slots held
    assert all(k.nbytes == 1 << 20 for k in kept)
    if fail:  # leave through an exception, as the reported case did
        try:
            raise RuntimeError("the consumer gives up")
        except RuntimeError:
            chan.close()
    else:
        chan.close()
    del kept


@pytest.mark.parametrize("fail", [False, True], ids=["clean", "through an exception"])
def test_slots_of_a_consumer_that_closed_and_exited_are_free_at_once(fail: bool) -> None:
    a, b = ringwire.pair()
    n = 8
    with spawned(consumer_keeps_arrays_then_closes, b, n, fail) as proc:
        chan = a.connect_sync(handshake_timeout=30)
        try:
            for i in range(n):
                chan.send(np.full(1 << 18, i, dtype=np.float32), timeout=30)
            proc.join(30)
            assert proc.exitcode == 0
            # no send, receive or wait since: statistics() alone must see the peer gone
            t0 = time.monotonic()
            stats: Any = chan.statistics()
            assert stats.slots_in_use == 0, stats
            assert time.monotonic() - t0 < 0.1
            assert stats.slots_reclaimed == n
        finally:
            chan.close()
